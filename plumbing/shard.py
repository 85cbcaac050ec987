"""plumbing/shard.py: what training needs to know about how the model is spread over the GPUs (pipeline.py, grpo.py,
sft.py).

    check_backend     refuse, at start, a distributed setup the loop does not implement (FSDP1, ZeRO-1, ...)
    is_sharded        whether a model is sharded by FSDP2 (`fully_shard`)
    shard_like        shard the frozen reference model by hand, as the policy is
    full_weights      gather a sharded policy's full weights once for a rollout, so decoding needs no collectives
                      (under FSDP2 through plain_twin: the same tensors in a model without FSDP's hooks)
    load_device       where to load a model: host memory under FSDP2 (sharding moves each process's part over)
    micro_batch, backward, optimizer_step
                      one optimizer step over several micro-batches, the same for DDP, FSDP2 and DeepSpeed
    configure_deepspeed, expose_head, full_state_dict
                      what DeepSpeed needs besides: its config set from muarl's options, the output layer's weight
                      gathered in the root's forward (ZeRO-3), the fp32 weights gathered for a checkpoint
    plain             a gradient norm as a plain tensor (FSDP2 gives a DTensor)
    memory_backend    what memory.memory_estimate needs to know of the backend
    lockstep, free_gathered_weights, total
                      what every process must do together: as many micro-batches, the reference's gathered weights
                      freed, numbers summed over processes
    check_same_weights
                      refuse at start a model that loaded differently on some process
The memory estimate per GPU is memory.py's.

Backends. DDP (and one process): every GPU holds the whole model, its gradients and its AdamW state. FSDP2
(`accelerate config`: distributed_type FSDP, fsdp_version 2) and DeepSpeed ZeRO-3 (distributed_type DEEPSPEED,
zero_stage 3): each of N GPUs holds 1/N of them; a layer's full weights are gathered for its forward and backward
only. DeepSpeed ZeRO-2 shards gradients and optimizer state only. The training forward runs body and head inside the
model's forward (logprobs.call_as_forward), so those gathers happen. Under DeepSpeed the loop drives the engine itself
(micro_batch, backward, optimizer_step): Accelerate's backward would step the engine after every micro-batch, and
its gradient_accumulation_steps would rescale a loss that is already normalized over the whole step. Not
implemented, and refused at start: FSDP1 (its nested units still communicate at every decoding step, so processes
that decode different numbers of steps hang), ZeRO-0/1 (use DDP), Megatron-LM, XLA.

Why the rollout gathers everything: with sharding hooks on, every decoding step is a collective, so all
processes would have to decode the same number of steps; muarl's per-process continuous batching almost never
does. The price: the full weights (in the compute dtype) on every GPU while rolling out (docs/gpus.md).
"""
from __future__ import annotations

import contextlib
import math

import torch

# Accelerate's distributed types whose prepared model is a DDP replica on each device: the loop runs as written.
DATA_PARALLEL = ("NO", "MULTI_CPU", "MULTI_GPU", "MULTI_XPU", "MULTI_NPU", "MULTI_MLU", "MULTI_MUSA",
                 "MULTI_SDAA", "MULTI_HPU")


def check_backend(distributed_type: str, fsdp_version: int | None = None, program: str = "grpo.py",
                  zero_stage: int | None = None) -> None:
    """SystemExit naming the backend unless the training loop implements it: DDP, FSDP2, DeepSpeed ZeRO-2 or -3."""
    kind = str(getattr(distributed_type, "value", distributed_type))
    use = ("use FSDP2 (accelerate config: distributed_type FSDP, fsdp_version 2) or DeepSpeed ZeRO-3 to shard the "
           "model, or DDP (multi-GPU) when it fits")
    if (kind in DATA_PARALLEL or (kind == "FSDP" and fsdp_version == 2)
            or (kind == "DEEPSPEED" and zero_stage in (2, 3))):
        return
    if kind == "FSDP":
        raise SystemExit(f"{program}: FSDP version {fsdp_version} (FSDP1) is not supported: its nested units "
                         "communicate at every decoding step, so processes that decode different numbers of steps "
                         "hang in the rollout. Set fsdp_version: 2 in the accelerate config (FSDP2).")
    if kind == "DEEPSPEED":
        raise SystemExit(f"{program}: DeepSpeed ZeRO stage {zero_stage} is not supported: set zero_stage 3 (or 2) in "
                         "the DeepSpeed config, or use DDP, which stage 0 and 1 gain little over.")
    raise SystemExit(f"{program}: distributed type {kind} is not supported; {use}.")


def check_accelerator(acc, program: str = "grpo.py") -> None:
    """check_backend for an Accelerator (its distributed type, its FSDP plugin's version, its ZeRO stage)."""
    fsdp = getattr(acc.state, "fsdp_plugin", None)  # set only under FSDP
    ds = getattr(acc.state, "deepspeed_plugin", None)  # set only under DeepSpeed
    check_backend(acc.distributed_type, fsdp.fsdp_version if fsdp is not None else None, program,
                  ds.zero_stage if ds is not None else None)
    if ds is not None and ds.zero_stage == 3 and not getattr(ds, "zero3_init_flag", True) \
            and getattr(acc, "is_main_process", True):
        print(f"[{program.removesuffix('.py')}] warning: ZeRO-3 without zero3_init_flag: the DeepSpeed engine moves "
              "the whole model onto every GPU before partitioning it; set zero3_init_flag: true in the accelerate "
              "config", flush=True)
    if ds is not None and ds.zero_stage == 3:  # the rollout's gather (full_weights): fail now, not after loading
        try:
            from deepspeed.runtime.zero.stage3 import unwrap_model_for_generation  # noqa: F401
        except ImportError:
            raise SystemExit(f"{program}: this DeepSpeed has no deepspeed.runtime.zero.stage3."
                             "unwrap_model_for_generation, which the ZeRO-3 rollout uses: install deepspeed==0.19.8 "
                             "(MUARL_DEEPSPEED=1 ./run true), the version tested here") from None


def fsdp_modules(model) -> list:
    """The FSDP2 modules of `model`, root first (the same order on every process), or [] when not sharded."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch built without distributed
        return []
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def is_sharded(model) -> bool:
    return bool(fsdp_modules(model))


def is_deepspeed(model) -> bool:
    """Whether `model` is a DeepSpeed engine (what Accelerate's prepare returns under DEEPSPEED)."""
    return (callable(getattr(model, "zero_optimization_stage", None))
            and hasattr(model, "set_gradient_accumulation_boundary"))


def is_zero3(model) -> bool:
    return is_deepspeed(model) and model.zero_optimization_stage() == 3


def is_zero3_plugin(acc) -> bool:
    """Whether the chosen backend is DeepSpeed ZeRO-3, before anything is prepared."""
    ds = getattr(acc.state, "deepspeed_plugin", None)
    return ds is not None and ds.zero_stage == 3


def memory_backend(acc) -> dict:
    """How the chosen backend holds the model, for memory.memory_estimate, before anything is prepared: the number of
    processes; whether each holds 1/N of the weights (FSDP2, ZeRO-3: sharded) or only 1/N of the gradients and
    AdamW state (ZeRO-2)."""
    ds = getattr(acc.state, "deepspeed_plugin", None)
    return {"world": acc.num_processes, "sharded": shards_weights(acc),
            "zero2": ds is not None and ds.zero_stage == 2}


def shards_weights(acc) -> bool:
    """Whether the chosen backend holds 1/N of the weights per process (FSDP2, ZeRO-3), before anything is prepared."""
    return bool(getattr(acc, "is_fsdp2", False)) or is_zero3_plugin(acc)


@contextlib.contextmanager
def micro_batch(acc, model, last: bool):
    """Around one micro-batch's forward and backward of an optimizer step. DDP all-reduces on the last one only
    (no_sync before it: DDP reads the flag in its forward). FSDP2 reduce-scatters every one (no_sync would keep
    full-size gradients on every process). A DeepSpeed engine is told whether this one is its accumulation boundary."""
    if is_deepspeed(model):
        model.set_gradient_accumulation_boundary(last)
        yield
    elif last or is_sharded(model):
        yield
    else:
        with acc.no_sync(model):
            yield


def backward(acc, model, loss) -> None:
    """Backward of one micro-batch's share of the step loss. A DeepSpeed engine's own backward, unscaled by its
    gradient_accumulation_steps (the loss is normalized over the whole step already, docs/invariants.md, 3);
    Accelerate's backward would also step the engine after every micro-batch."""
    if is_deepspeed(model):
        model.backward(loss, scale_wrt_gas=False)
    else:
        acc.backward(loss)


def optimizer_step(acc, model, opt, grad_clip: float) -> tuple[float, bool]:
    """Clip the step's gradients to grad_clip and step on every process, or on none when the norm is not finite
    anywhere; the gradients are cleared either way. Returns (norm before clipping, stepped). A DeepSpeed engine clips
    by its config's gradient_clipping (configure_deepspeed sets it to grad_clip) and skips a non-finite norm itself,
    on every process (engine.step); the optimizer Accelerate hands back is then a no-op."""
    if is_deepspeed(model):
        model.step()
        norm = model.get_global_grad_norm()
        norm = float(norm) if norm is not None else math.nan
        return norm, math.isfinite(norm)
    # FSDP2 gives the norm over all shards as a DTensor (plain() makes it a tensor).
    norm = plain(acc.clip_grad_norm_(model.parameters(), grad_clip))
    # Every process must agree to step (or not). Accelerate's reduce knows only sum and max: count the bad.
    bad = float(not torch.isfinite(torch.as_tensor(norm)).all().item())
    ok = acc.reduce(torch.tensor(bad, device=acc.device), reduction="sum").item() == 0
    if ok:
        opt.step()
    opt.zero_grad(set_to_none=True)
    return float(norm), ok


def configure_deepspeed(acc, *, micro_batch_size: int, grad_clip: float, program: str = "grpo.py") -> None:
    """Before acc.prepare under DeepSpeed: the engine clips at grad_clip, takes micro-batches of micro_batch_size,
    counts one micro-batch a step (the loop sets the accumulation boundary itself, and normalizes the loss over the
    whole step) and reduces gradients in fp32. The config must not bring its own optimizer or scheduler: the loop
    builds AdamW and its warm-up."""
    ds = getattr(acc.state, "deepspeed_plugin", None)
    if ds is None:
        return
    config = ds.deepspeed_config
    for section in ("optimizer", "scheduler"):
        if section in config:
            raise SystemExit(f"{program}: the DeepSpeed config has a '{section}' section: remove it; {program} builds "
                             "its own AdamW and learning-rate warm-up from its options (--lr, --warmup-steps).")
    # Gradients are reduced in fp32, as under DDP (fp32 master weights) and FSDP2 (cli.fsdp2_plugin): DeepSpeed's
    # default reduces them in the compute dtype, bf16 under --bf16, which rounds away small per-process gradients.
    config.update(gradient_clipping=grad_clip, train_micro_batch_size_per_gpu=micro_batch_size,
                  gradient_accumulation_steps=1, train_batch_size=micro_batch_size * acc.num_processes,
                  communication_data_type="fp32")


def expose_head(model) -> None:
    """ZeRO-3 gathers a module's parameters in that module's own forward. The chunked output layer reads
    lm_head.weight inside the root's forward (logprobs.token_logprobs), so it is registered as the root's external
    parameter: gathered with the root, kept through backward. A no-op for other backends."""
    if is_zero3(model):
        import deepspeed

        deepspeed.zero.register_external_parameter(model.module, model.module.get_output_embeddings().weight)


def deepspeed_reference(ref_model, config: dict):
    """The frozen reference as a DeepSpeed engine of its own, with the policy's config less its optimizer: sharded
    the same way under ZeRO-3 (whole on every GPU under ZeRO-2, which shards only what training keeps), and in the
    same precision as the policy (the engine casts both to bf16 under bf16)."""
    import deepspeed

    config = {k: v for k, v in config.items() if k not in ("optimizer", "scheduler")}
    if config.get("zero_optimization", {}).get("stage") != 3:
        config["zero_optimization"] = {**config.get("zero_optimization", {}), "stage": 0}
    engine = deepspeed.initialize(model=ref_model, config=config)[0]
    engine.eval()
    expose_head(engine)
    return engine


def full_state_dict(acc, model) -> dict:
    """The trained weights, whole, for the model directory the main process writes; every process must call it (the
    gathers are collectives), the others get {} and hold nothing. One parameter at a time is gathered and, on the main
    process only, copied to host memory (memory.memory_estimate's host_save). Under DeepSpeed the fp32 master weights
    (deepspeed.utils.safe_get_full_fp32_param), not the engine's bf16 copies: rounding them would drop the small
    updates fp32 master weights exist for. Under DDP the model's own tensors (nothing gathered)."""
    if is_deepspeed(model):
        from deepspeed.utils import safe_get_full_fp32_param

        out = {}
        for name, p in model.module.named_parameters():
            full = safe_get_full_fp32_param(p)  # every process gathers it; only the main process keeps it
            if acc.is_main_process:
                out[name] = full.detach().cpu()
            del full
        return out
    if is_sharded(model):  # torch's own full gather to the first process, as Accelerate's FSDP2 branch does
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return acc.get_state_dict(model)


def shard_like(ref_model, policy, param_dtype=None) -> None:
    """Shard the frozen reference model as the policy is: each decoder layer its own unit, then the root, over the
    policy's device mesh, its weights gathered in `param_dtype` (the policy's: bf16 under --bf16, cli.fsdp2_plugin)
    so that it computes what the policy computes. By hand, because Accelerate's FSDP2 prepares one model (with its
    optimizer) per call. Its scores go through the same redirected forward as the policy's (logprobs.token_logprobs);
    grpo.train_on_episodes reshards its root after scoring (no backward does it)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import DTensor

    mesh = next(p for p in policy.parameters() if isinstance(p, DTensor)).device_mesh
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    layers = set(getattr(ref_model, "_no_split_modules", None) or [])
    for module in ref_model.modules():
        if type(module).__name__ in layers:
            fully_shard(module, mesh=mesh, mp_policy=mp)
    fully_shard(ref_model, mesh=mesh, mp_policy=mp)


def plain_twin(model):
    """A model of `model`'s own class with no FSDP hooks, built on the meta device, whose parameters and buffers are
    `model`'s current tensors (nothing copied): while `model` is unsharded, its forward is the plain module's, with
    no collective, no per-step root set-up and nothing recorded for a backward that never comes."""
    from torch.distributed.fsdp import FSDPModule

    model = getattr(model, "_orig_mod", model)  # torch.compile's wrapper
    cls = next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))  # fully_shard subclasses it
    with torch.device("meta"):
        twin = cls(model.config)
    twin.generation_config = getattr(model, "generation_config", None)  # the checkpoint's (its stop tokens), not
    twin.name_or_path = getattr(model, "name_or_path", "")                # the one built from the config
    for name, tensor in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        # FSDP's activation checkpointing (accelerate config) wraps each layer: the twin's layers are plain
        owner, _, leaf = name.replace("_checkpoint_wrapped_module.", "").rpartition(".")
        setattr(twin.get_submodule(owner), leaf, tensor)  # a tied weight is set under both names, to one tensor
    left = [n for n, t in [*twin.named_parameters(), *twin.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"shard.plain_twin: {type(model).__name__} built anew has tensors the sharded model has "
                           f"not: {left[:3]}")
    return twin.train(model.training)


@contextlib.contextmanager
def full_weights(model, device):
    """Inside, a model to decode with whose every parameter is whole on this process (a sharded `model`, FSDP2 or
    ZeRO-3, gathered; any other as it is), so the rollout runs no collective and processes may decode different
    numbers of steps. All processes must enter it together (the gathers are collectives).

    FSDP2: one forward through the root (its lazy initialization happens there), every unit unsharded in the same
    order on all processes, then decoding through plain_twin, not through FSDP's hooks; resharded afterwards."""
    if is_zero3(model):  # DeepSpeed's own recipe: gather every parameter, take its hooks off, put them back after
        from deepspeed.runtime.zero.stage3 import unwrap_model_for_generation

        with unwrap_model_for_generation(model):
            yield model
        return
    modules = fsdp_modules(model)
    if not modules:
        yield model
        return
    with torch.no_grad():
        model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device), use_cache=False)
    try:
        for m in modules:
            m.unshard()
        yield plain_twin(model)
    finally:
        for m in modules:
            m.reshard()


def load_device(acc) -> torch.device:
    """Where grpo.py and sft.py load the policy (and the reference): host memory under FSDP2, the device otherwise.
    fully_shard moves one unit's full weights to the GPU at a time, keeps this process's slice and frees the rest, so
    a GPU never holds the whole fp32 model: a model loads where its shards fit (docs/gpus.md). The price is one full
    fp32 copy in host memory per process while loading (memory.memory_estimate's host_load). Under ZeRO-3,
    Accelerate's zero3_init_flag (its default for stage 3) has transformers partition the model as it loads
    (deepspeed.zero.Init), on the device; without it the engine moves the whole model onto every GPU before
    partitioning (check_accelerator says so)."""
    return torch.device("cpu") if getattr(acc, "is_fsdp2", False) else torch.device(acc.device)


def plain(t):
    """A gradient norm as a plain tensor: under FSDP2 clipping returns a DTensor (already reduced over the mesh)."""
    full = getattr(t, "full_tensor", None)
    return full() if full is not None else t


def weights_checksum(model) -> float:
    """A float64 checksum of a model's full weights (not of a sharded model's slice): the sum over its parameters of
    their sum and their sum of squares. Two copies of one checkpoint give the same number; an all-zero copy, or
    another checkpoint's, does not."""
    with torch.no_grad():
        parts = [t.sum() + (t * t).sum() for t in (p.detach().double() for p in model.parameters())]
    return float(torch.stack(parts).sum()) if parts else 0.0  # one device-to-host copy


def check_same_weights(acc, model, what: str, program: str = "grpo.py") -> None:
    """Refuse, at start, a model whose weights differ between processes (`what` names it): each process loaded its
    own copy, and a copy that is zeros or another checkpoint on one process would decode, score or evaluate there
    with no error (models.real_weights_on_every_process is why they load alike). One all-gather of one number."""
    if acc.num_processes == 1:
        return
    mine = torch.tensor([weights_checksum(model)], dtype=torch.float64, device=acc.device)
    every = [float(x) for x in acc.gather(mine).cpu()]
    if any(abs(x - every[0]) > 1e-9 * max(1.0, abs(every[0])) for x in every):
        raise SystemExit(f"{program}: {what}: its weights differ between processes (checksums {every}); every process "
                         "must load the same model (is FSDP CPU-RAM-efficient loading zeroing it off rank 0? see "
                         "docs/gpus.md)")


def lockstep(acc, micro_batches: list[list]) -> list[list]:
    """The micro-batches padded with empty ones to as many as any process has. Under DDP, FSDP2 and DeepSpeed each
    forward/backward is, or ends in, a collective, so a process that ran one fewer would leave the others waiting
    forever; a process with fewer rows (its episodes failed, its groups were dropped) runs empty micro-batches."""
    if acc.num_processes == 1:
        return micro_batches
    most = int(acc.reduce(torch.tensor(len(micro_batches), device=acc.device), reduction="max").item())
    return micro_batches + [[] for _ in range(most - len(micro_batches))]


def free_gathered_weights(model) -> None:
    """Free the weights a sharded model gathered for forward passes that no backward follows (the reference's): no
    backward will reshard its root."""
    if is_sharded(model):
        model.reshard()


def total(acc, *xs: float) -> list[float]:
    """Numbers summed over processes, in one collective (e.g. the step's trained tokens: one normalizer for every
    micro-batch of every process)."""
    if acc.num_processes == 1:
        return [float(x) for x in xs]
    t = torch.tensor([float(x) for x in xs], device=acc.device, dtype=torch.float64)
    return acc.reduce(t, reduction="sum").tolist()
