"""plumbing/lora.py: LoRA adapters (the peft library) for grpo.py and sft.py, eval.py and models.load_model.

With --lora-rank R the policy is its start model, frozen in the compute dtype (bf16 on a GPU), plus low-rank adapters
on the target layers, trained in fp32. The frozen reference of the KL term is then the same network with its adapters
switched off: no second copy of the weights, and kl is exactly 0 until the adapters move (a fresh adapter's B is 0).

    add_adapters    wrap a loaded model in adapters (peft.get_peft_model): base frozen, adapters fp32; targets that
                    match no layer are refused naming --lora-target-modules and showing the model's linear layers
    adapters_off    the reference: the policy with its adapters disabled, for the span of a `with`
    is_adapter_dir, load
                    an adapter checkpoint (PEFT's format: adapter_config.json + adapter_model.safetensors, loadable
                    with PeftModel.from_pretrained) on its base, itself any start: a model directory, a hub id, or
                    another adapter checkpoint (merged)
    merge           the adapters folded into the base weights: a plain model for serving (eval.py --merge-lora)
    merged_for_decoding
                    the adapters folded into the base for the span of a rollout (--lora-decode merged), the base
                    restored bit for bit after it from a host copy
    adapter_params  the parameters adapters add to a model of a given config (memory.memory_estimate)
    check_backend   one process and DDP run LoRA; FSDP2 and DeepSpeed are refused at start, by name
    checkpoint_hooks
                    Accelerate's save_state keeps the adapters only (the base is on disk already: the run's start)
    fingerprint, check_base
                    the base's weights as the adapters were saved on them, recorded in muarl_config.json and checked
                    wherever the adapters load (eval, --init-from, --resume): adapters on a base trained again or
                    replaced in place are refused, not applied to weights they were never trained with

Why the start is merged when it is an adapter checkpoint (grpo.py --init-from runs/sft-lora): the reference must be
the starting policy, and "adapters off" must give it; so the cold start's adapters become part of the base, and
GRPO trains new ones on top.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
from pathlib import Path

import torch

# The attention and MLP projections of Llama/Qwen/Mistral-style decoders.
DEFAULT_TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
ADAPTER_CONFIG = "adapter_config.json"


def check_options(cfg, program: str) -> None:
    """SystemExit naming the option when a run config's --lora-* value (grpo.Config, sft.SFTConfig) cannot work, or
    is set away from its default without --lora-rank, where it would do nothing."""
    rank, alpha, dropout, targets = cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout, cfg.lora_target_modules

    def bad(opt, why):
        raise SystemExit(f"{program}: --lora-{opt}: {why}")
    if not rank:
        for opt, value in (("alpha", alpha), ("dropout", dropout), ("target-modules", targets)):
            if value != getattr(type(cfg), "lora_" + opt.replace("-", "_")):
                bad(opt, "has no effect without --lora-rank (0: no adapters)")
    if rank and not [t for t in targets.split(",") if t.strip()]:
        bad("target-modules", "names no module (a comma-separated list of layer names, e.g. q_proj,v_proj)")


def linear_names(model) -> list[str]:
    """The distinct last names of the model's linear layers (what --lora-target-modules can name)."""
    return sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)})


def check_targets(model, targets: str, program: str = "grpo.py") -> None:
    """SystemExit naming --lora-target-modules when a name in it matches no linear layer of `model` (shapes only: a
    meta model will do), showing the names there are. Matched on a module's last name, peft's rule for a list."""
    wanted = [t.strip() for t in targets.split(",") if t.strip()]
    head = model.get_output_embeddings() if callable(getattr(model, "get_output_embeddings", None)) else None
    heads = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if head is not None and m is head}
    if heads & set(wanted):
        raise SystemExit(f"{program}: --lora-target-modules: {', '.join(sorted(heads & set(wanted)))} is the output "
                         "layer, whose weight the trainer reads directly (logprobs.token_logprobs' chunked head), so "
                         "an adapter there would be skipped in training: leave it out")
    there = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)} - heads
    missing = [t for t in wanted if t not in there]
    if missing:
        raise SystemExit(f"{program}: --lora-target-modules: {', '.join(missing)} "
                         f"match{'es' if len(missing) == 1 else ''} no linear layer of this model; its linear layers "
                         f"are named: {', '.join(sorted(there)[:12])}")


def add_adapters(model, *, rank: int, alpha: float, dropout: float, targets: str, base: str,
                 program: str = "grpo.py", autocast: bool = False):
    """`model` wrapped in fresh LoRA adapters (a peft.PeftModel): only the adapters require grad; they are fp32
    whatever the base's dtype (peft's autocast_adapter_dtype). `base` is what the adapters were trained on, recorded
    in the checkpoint's adapter_config.json (a local path made absolute, so the checkpoint loads from anywhere).
    autocast: every forward runs under autocast (--bf16), which casts the adapters' inputs itself; peft's own cast of
    each adapted layer's input to fp32 would only add a copy of it per layer, so it is turned off."""
    from peft import LoraConfig, get_peft_model

    check_targets(model, targets, program)
    wanted = [t.strip() for t in targets.split(",") if t.strip()]
    config = LoraConfig(r=rank, lora_alpha=alpha or 2 * rank, lora_dropout=dropout, target_modules=wanted,
                        bias="none", task_type="CAUSAL_LM")
    widths = [min(m.in_features, m.out_features) for n, m in model.named_modules()
              if isinstance(m, torch.nn.Linear) and n.rsplit(".", 1)[-1] in wanted]
    if widths and rank > min(widths):
        print(f"[{program.removesuffix('.py')}] warning: --lora-rank {rank} is above the narrowest adapted layer's "
              f"width ({min(widths)}): such adapters are no longer low-rank", flush=True)
    model = get_peft_model(model, config, autocast_adapter_dtype=True)
    for p in model.parameters():  # adapters in fp32 on a fp32 base too (peft casts only 16-bit bases)
        if p.requires_grad and p.dtype != torch.float32:
            p.data = p.data.float()
    model.peft_config["default"].base_model_name_or_path = base_name(base)
    if autocast:
        for module in model.modules():
            if hasattr(module, "cast_input_dtype_enabled"):  # peft's tuner layers
                module.cast_input_dtype_enabled = False
    return model


def base_name(start: str) -> str:
    """A start as a checkpoint should record it: a local directory as an absolute path, anything else as given."""
    p = Path(start).expanduser()
    return str(p.resolve()) if p.exists() else start


def is_adapted(model) -> bool:
    """Whether `model` (unwrapped) carries peft adapters."""
    return callable(getattr(model, "disable_adapter", None)) and hasattr(model, "peft_config")


def adapters_off(model, enabled: bool = True):
    """Context: `model` with its adapters disabled (the frozen reference of a --lora-rank run), or `model` as it is
    when it has none or `enabled` is False."""
    return model.disable_adapter() if enabled and is_adapted(model) else contextlib.nullcontext()


def is_adapter_dir(name) -> bool:
    return (Path(str(name)).expanduser() / ADAPTER_CONFIG).is_file()


def base_of(path) -> str:
    """The base an adapter checkpoint was trained on (its adapter_config.json's base_model_name_or_path)."""
    cfg_file = Path(path) / ADAPTER_CONFIG
    try:
        base = json.loads(cfg_file.read_text()).get("base_model_name_or_path")
    except (OSError, ValueError) as e:
        raise SystemExit(f"{cfg_file}: unreadable ({e.__class__.__name__}: {e})") from None
    if not base:
        raise SystemExit(f"{cfg_file}: names no base model (base_model_name_or_path); set it to the directory or hub "
                         "id the adapters were trained on")
    return base


def base_chain(name) -> list[str]:
    """`name` and the bases under it, down to a full model or hub id: an adapter checkpoint's base can be another
    adapter checkpoint (GRPO's adapters on a LoRA cold start). Refuses a chain that loops."""
    chain = [str(name)]
    while is_adapter_dir(chain[-1]):
        base = base_of(chain[-1])
        if base_name(base) in {base_name(c) for c in chain}:
            raise SystemExit(f"{chain[-1]}: its adapter_config.json names {base} as its base, which is in its own "
                             f"chain of bases ({' -> '.join(chain)}): point base_model_name_or_path at the model the "
                             "adapters were trained on")
        chain.append(base)
    return chain


def check_base_kept(start: str, out, what: str) -> None:
    """SystemExit when writing to `out` would delete the model the adapters are trained on (`start`, or a base under
    it): their checkpoints would name a base that is gone."""
    out = Path(out).expanduser().resolve()
    for name in base_chain(start):
        p = Path(name).expanduser()
        if p.exists() and (p.resolve() == out or out in p.resolve().parents):
            raise SystemExit(f"{what}: {out} holds {name}, the base the adapters are trained on; writing there would "
                             "delete it and leave the adapters without their base: choose another output")


SAMPLES, SAMPLE_BYTES = 64, 64 * 1024  # what fingerprint reads of a weight file: ~4 MiB, whatever its size


def fingerprint(name) -> str | None:
    """The weights of the local model directory `name`, fingerprinted (None for a hub id, whose revision names its
    weights): each weight file's name and size, and 64 samples of 64 KiB spread over it (the whole of a smaller file),
    hashed. It reads ~4 MiB a file, so it is taken at every save and load; a base trained again or replaced by
    another model changes it (it is no checksum: an edit of a few bytes between the samples would not)."""
    p = Path(str(name)).expanduser()
    if not p.is_dir():
        return None
    h = hashlib.sha256()
    for f in sorted(f for f in p.iterdir() if f.suffix in (".safetensors", ".bin") and f.is_file()):
        size = f.stat().st_size
        h.update(f"{f.name}:{size}\n".encode())
        with open(f, "rb") as fh:
            if size <= SAMPLES * SAMPLE_BYTES:
                h.update(fh.read())
                continue
            for i in range(SAMPLES):
                fh.seek(i * (size - SAMPLE_BYTES) // (SAMPLES - 1))
                h.update(fh.read(SAMPLE_BYTES))
    return h.hexdigest()[:16]


def base_record(model) -> dict:
    """What an adapter checkpoint records of its base (muarl_config.json's "lora_base"): its name and fingerprint."""
    base = model.peft_config["default"].base_model_name_or_path
    return {"path": base, "fingerprint": fingerprint(base)}


def check_base(adapters, base, what: str) -> None:
    """Refuse adapters (the directory `adapters`, whose muarl_config.json records their base) on a `base` whose
    weights are not those they were saved on: the base was trained again or replaced in place."""
    try:
        recorded = json.loads((Path(adapters) / "muarl_config.json").read_text()).get("lora_base") or {}
    except (OSError, ValueError, AttributeError):
        return  # adapters from elsewhere (peft's own) or saved before the record: nothing to compare
    was, now = recorded.get("fingerprint"), fingerprint(base)
    if was and now and was != now:
        raise SystemExit(f"{what}: the base these adapters were trained on, {base}, holds other weights now "
                         f"(fingerprint {now}; {was} when {adapters} was saved): trained again or replaced there. "
                         "On these weights the adapters would compute what no run trained: put the base back, or "
                         "start from a model that needs none")


def load(path, base_model, trainable: bool = False):
    """The adapter checkpoint at `path` on `base_model` (loaded by the caller from base_of(path))."""
    from peft import PeftModel

    weights = sorted(f.name for f in Path(path).iterdir() if f.name.startswith("adapter_model"))
    if not weights:
        raise SystemExit(f"{path}: no adapter weights (adapter_model.safetensors) beside its {ADAPTER_CONFIG}")
    try:
        return PeftModel.from_pretrained(base_model, str(path), is_trainable=trainable)
    except Exception as e:  # a cut-short file (safetensors' own error), other shapes, ...
        if isinstance(e, (torch.OutOfMemoryError, ImportError)):
            raise  # not the checkpoint's fault
        raise SystemExit(f"{path}: could not load the adapters ({', '.join(weights)}): "
                         f"{e.__class__.__name__}: {str(e)[:300]}") from e


def merge(model):
    """A plain transformers model with the adapters folded into its weights (W + scale x B A), every weight
    trainable again as a loaded model's are (peft froze the base)."""
    return model.merge_and_unload().requires_grad_(True) if is_adapted(model) else model


def lora_layers(model) -> list:
    """peft's LoRA layers of `model` (each wraps its frozen `base_layer` and holds lora_A / lora_B)."""
    return [m for m in model.modules() if hasattr(m, "base_layer") and hasattr(m, "get_delta_weight")
            and hasattr(m, "lora_A")]


def mergeable(layers) -> bool:
    """Whether every adapted layer is what merged_for_decoding folds exactly: a linear layer, not merged already,
    its adapters on and plain LoRA (in lora_A / lora_B; no DoRA or other variant, no adapter bias)."""
    def plain(m, a):
        return a in m.lora_A and not getattr(m, "lora_variant", {}).get(a) and not getattr(m, "lora_bias", {}).get(a)
    return bool(layers) and all(isinstance(m.base_layer, torch.nn.Linear) and not m.merged and not m.disable_adapters
                                and all(plain(m, a) for a in m.active_adapters) for m in layers)


@contextlib.contextmanager
def merged_for_decoding(model, enabled: bool = True):
    """Context: `model` decoding as one plain network, its adapters folded into the frozen base's weights (W <- W +
    scale x B A, rounded once to the base's dtype) and each adapted layer calling its base linear directly, so
    that each step runs the base's kernels only (at 8B with adapters on every projection, peft's unmerged layers
    add ~1.3k kernels a step). On leaving, every adapted weight is copied back from a copy of the base made at
    the first call (in host memory): bit for bit the base it was, never W + BA - BA, which would drift in bf16
    by a rounding a rollout. What decoding gains costs the merged weights' one rounding: in bf16 the sampler's
    log-probs then differ from the trainer's (which runs the adapters unmerged) by about that (logprob_gap shows
    it). `model` as it is without adapters or when `enabled` is False."""
    layers = lora_layers(model) if enabled and is_adapted(model) else []
    if not mergeable(layers):  # nothing to fold, or adapters of a kind this does not fold: decoded unmerged
        yield model
        return
    own, folded = [vars(m).get("forward") for m in layers], []  # (an instance forward someone set: put back)
    # Outside autocast (the rollout runs under it): B A, its scale and the sum in the adapters' float32, one rounding
    exact = torch.autocast(layers[0].base_layer.weight.device.type, enabled=False)
    try:
        with torch.no_grad(), exact:
            for m in layers:
                w, copy = m.base_layer.weight, getattr(m, "muarl_base_copy", None)
                if copy is None or copy.shape != w.shape or copy.dtype != w.dtype:  # the base is frozen: one a run
                    # pageable host memory, its exact size (pinned memory comes from a caching allocator that
                    # rounds each block up to a power of two: +26% at Qwen3-8B's MLP shapes)
                    m.muarl_base_copy = w.detach().to("cpu", copy=True)
            for m in layers:
                w = m.base_layer.weight
                delta = sum(m.get_delta_weight(a) for a in m.active_adapters)
                folded.append(m)
                w.copy_(w.to(delta.dtype) + delta)
                m.forward = m.base_layer.forward  # the merged linear itself, skipping peft's wrapper (its Python
        yield model                               # around each projection costs ~10% of a small model's step)
    finally:
        with torch.no_grad(), exact:
            for m, f in zip(layers, own):
                vars(m).pop("forward", None)  # peft's forward again
                if f is not None:
                    m.forward = f
            for m in folded:
                m.base_layer.weight.copy_(m.muarl_base_copy)


def adapted_base_params(model, targets: str = DEFAULT_TARGETS) -> int:
    """Parameters of the base's linear layers that adapters on `targets` wrap (what merged_for_decoding copies)."""
    wanted = {t.strip() for t in targets.split(",") if t.strip()}
    return sum(m.weight.numel() for n, m in model.named_modules()  # (peft's base_layer: the same weight)
               if isinstance(m, torch.nn.Linear) and n.removesuffix(".base_layer").rsplit(".", 1)[-1] in wanted)


def adapter_params(model, rank: int, targets: str = DEFAULT_TARGETS) -> int:
    """Parameters the adapters add to `model` (shapes only: a meta model will do): rank x (in + out) for every
    targeted linear layer."""
    wanted = {t.strip() for t in targets.split(",") if t.strip()}
    return sum(rank * (m.in_features + m.out_features) for n, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and n.rsplit(".", 1)[-1] in wanted)


def check_backend(acc, program: str = "grpo.py") -> None:
    """LoRA runs on one process and under DDP. FSDP2 and DeepSpeed with adapters are not implemented (the rollout's
    gathered weights, the reference with adapters off and the adapter-only checkpoints are written for a replicated
    model): refused at start, naming the combination."""
    kind = str(getattr(acc.distributed_type, "value", acc.distributed_type))
    if kind in ("FSDP", "DEEPSPEED"):
        name = "FSDP2" if kind == "FSDP" else "DeepSpeed"
        raise SystemExit(f"{program}: --lora-rank with {name} is not supported: LoRA runs on one GPU or under DDP "
                         "(multi-GPU), where the frozen base in bf16 and the adapters fit each GPU (e.g. Qwen3-8B at "
                         "rank 64; the estimate is printed at start). Use DDP, or --lora-rank 0 to shard the full "
                         f"model with {name}.")


def trainable_names(model) -> list[str]:
    return [n for n, p in model.named_parameters() if p.requires_grad]


def checkpoint_hooks(acc) -> None:
    """Make Accelerate's save_state/load_state hold the adapters only: the frozen base is the run's start, already on
    disk, and would make each checkpoint the size of the model. Loading checks that the file holds exactly the
    adapters, so a resume can never run on half-restored weights."""
    def plain(name):  # the names of the unwrapped model: a state saved under DDP resumes on one process, and back
        return name.removeprefix("module.")

    def keep_adapters(models, weights, output_dir):
        for k, model in enumerate(models):
            wanted = set(trainable_names(model))
            weights[k] = {plain(n): t for n, t in weights[k].items() if n in wanted}

    def load_adapters(models, input_dir):
        from safetensors.torch import load_file

        for k, model in enumerate(list(models)):
            path = Path(input_dir) / ("model.safetensors" if k == 0 else f"model_{k}.safetensors")
            state = load_file(str(path))
            inner = getattr(model, "module", model)  # DDP's wrapped model
            wanted = set(trainable_names(inner))
            if set(state) != wanted:
                odd = sorted(set(state) ^ wanted)
                raise SystemExit(f"{path}: holds other weights than this run's adapters ({', '.join(odd[:4])}, ...):"
                                 " was it saved with other --lora-* settings?")
            inner.load_state_dict(state, strict=False)
        models.clear()  # loaded here; Accelerate loads optimizer, scheduler and RNG states as usual

    acc.register_save_state_pre_hook(keep_adapters)
    acc.register_load_state_pre_hook(load_adapters)


def describe(model) -> str:
    """'N adapter parameters on M layers (x% of the model)' for the start-up line."""
    n = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    layers = sum(1 for name, _ in model.named_modules() if name.endswith(".lora_A"))
    return f"{n:,} adapter parameters on {layers} layers ({100 * n / max(total, 1):.2f}% of {total:,})"
