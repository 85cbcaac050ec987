"""shard.py: what training needs to know about how the model is spread over the GPUs. grpo.py and sft.py use it.

    check_backend     refuse, at start, a distributed setup the loop does not implement (FSDP1, ZeRO-1, ...)
    is_sharded        whether a model is sharded by FSDP2 (`fully_shard`)
    shard_like        shard the frozen reference model by hand, as the policy is
    full_weights      gather a sharded policy's full weights once for a rollout, so decoding needs no collectives
    load_device       where to load a model: host memory under FSDP2 (sharding moves each process's part over)
    micro_batch, backward, optimizer_step
                      one optimizer step over several micro-batches, the same for DDP, FSDP2 and DeepSpeed
    configure_deepspeed, expose_head, full_state_dict
                      what DeepSpeed needs besides: its config set from muarl's options, the output layer's weight
                      gathered in the root's forward (ZeRO-3), the fp32 weights gathered for a checkpoint
    plain             a gradient norm as a plain tensor (FSDP2 gives a DTensor)
    memory_estimate   bytes per GPU, by what holds them, for DDP or a sharded backend over N GPUs (a pure function)
    check_memory      print it at start; stop on a GPU it cannot fit

Backends. DDP (and one process): every GPU holds the whole model, its gradients and its AdamW state. FSDP2
(`accelerate config`: distributed_type FSDP, fsdp_version 2) and DeepSpeed ZeRO-3 (distributed_type DEEPSPEED,
zero_stage 3): each of N GPUs holds 1/N of them; a layer's full weights are gathered for its forward and backward
only. DeepSpeed ZeRO-2 shards gradients and optimizer state only. The training forward runs body and head inside the
model's forward (loss.call_as_forward), so those gathers happen. Under DeepSpeed the loop drives the engine itself
(micro_batch, backward, optimizer_step): Accelerate's backward would step the engine after every micro-batch, and
its gradient_accumulation_steps would rescale a loss that is already normalized over the whole step. Not
implemented, and refused at start: FSDP1 (its nested units still communicate at every decoding step, so processes
that decode different numbers of steps hang), ZeRO-0/1 (use DDP), Megatron-LM, XLA.

Why the rollout gathers everything: with sharding hooks on, every decoding step is a collective, so all
processes would have to decode the same number of steps; muarl's per-process continuous batching almost never
does. The price: the full weights (in the compute dtype) on every GPU while rolling out, ~16 GB at 8B in bf16.
"""
from __future__ import annotations

import contextlib
import math
import os

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
    lm_head.weight inside the root's forward (loss.token_logprobs), so it is registered as the root's external
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
    """The trained weights, whole, for a checkpoint (every process must call it: the gathers are collectives). Under
    DeepSpeed the fp32 master weights (deepspeed.utils.safe_get_full_fp32_param), not the engine's bf16 copies:
    rounding them would drop the small updates fp32 master weights exist for."""
    if not is_deepspeed(model):
        return acc.get_state_dict(model)
    from deepspeed.utils import safe_get_full_fp32_param

    return {name: safe_get_full_fp32_param(p).detach().cpu() for name, p in model.module.named_parameters()}


def shard_like(ref_model, policy, param_dtype=None) -> None:
    """Shard the frozen reference model as the policy is: each decoder layer its own unit, then the root, over the
    policy's device mesh, its weights gathered in `param_dtype` (the policy's: bf16 under --bf16, cli.fsdp2_plugin)
    so that it computes what the policy computes. By hand, because Accelerate's FSDP2 prepares one model (with its
    optimizer) per call. Its scores go through the same redirected forward as the policy's (loss.token_logprobs);
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


def _param_groups(state) -> list | None:
    """An FSDP2 state's parameter groups (private): a list in torch 2.13, one optional group before; None when
    neither field exists."""
    groups = state.__dict__.get("_fsdp_param_groups")  # 2.13 also has a property _fsdp_param_group
    if isinstance(groups, list):
        return groups
    if "_fsdp_param_group" in state.__dict__:
        group = state.__dict__["_fsdp_param_group"]
        return [] if group is None else [group]
    return None


@contextlib.contextmanager
def full_weights(model, device):
    """Inside: every parameter of a sharded `model` (FSDP2, ZeRO-3) is whole on this process and stays so through
    forwards, so the rollout's decoding runs no collective and processes may decode different numbers of steps. A
    no-op when the model is not sharded. All processes must enter it together (the gathers are collectives).

    FSDP2 recipe: one forward through the root (its lazy initialization must happen there), unshard every FSDP
    module in the same order on all processes, stop resharding after forward; after the rollout, the settings
    are restored and the parameters resharded."""
    if is_zero3(model):  # DeepSpeed's own recipe: gather every parameter, take its hooks off, put them back after
        from deepspeed.runtime.zero.stage3 import unwrap_model_for_generation

        with unwrap_model_for_generation(model):
            yield
        return
    modules = fsdp_modules(model)
    if not modules:
        yield
        return
    with torch.no_grad():
        model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device), use_cache=False)
    # Each module's reshard-after-forward setting, restored exactly afterwards: the root's is specially off
    # (FSDP2's default) and accelerate may set the others either way. torch has no getter, hence the private fields:
    # each param group's post_forward_mesh_info (torch 2.13 keeps a list of groups, earlier torch one group, as
    # _fsdp_param_group) and, where it exists, the state's _auto_reshard_after_forward (torch 2.13).
    saved = []
    for m in modules:
        state = m._get_fsdp_state()
        groups = _param_groups(state)
        if groups is None:
            raise RuntimeError(f"shard.full_weights reads FSDP2 fields that torch {torch.__version__} does not have "
                               "(_fsdp_param_groups or _fsdp_param_group; seen in torch 2.11 and 2.13): use one of "
                               "those, or DDP / DeepSpeed ZeRO-3")
        saved.append((state, getattr(state, "_auto_reshard_after_forward", None), groups,
                      [g.post_forward_mesh_info for g in groups]))
    for m in modules:
        m.unshard()
        m.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        for state, auto, groups, infos in saved:
            if hasattr(state, "_auto_reshard_after_forward"):
                state._auto_reshard_after_forward = auto
            for group, info in zip(groups, infos):
                group.post_forward_mesh_info = info
        for m in modules:
            m.reshard()


def load_device(acc) -> torch.device:
    """Where grpo.py and sft.py load the policy (and the reference): host memory under FSDP2, the device otherwise.
    fully_shard moves one unit's full weights to the GPU at a time, keeps this process's slice and frees the rest, so
    a GPU never holds the whole fp32 model: 14B and 32B load where their shards fit. The price is one full fp32 copy
    in host memory per process while loading (memory_estimate's host_load). Under ZeRO-3, Accelerate's zero3_init_flag
    (its default for stage 3) has transformers partition the model as it loads (deepspeed.zero.Init), on the device;
    without it the engine moves the whole model onto every GPU before partitioning (check_accelerator says so)."""
    return torch.device("cpu") if getattr(acc, "is_fsdp2", False) else torch.device(acc.device)


def plain(t):
    """A gradient norm as a plain tensor: under FSDP2 clipping returns a DTensor (already reduced over the mesh)."""
    full = getattr(t, "full_tensor", None)
    return full() if full is not None else t


def memory_estimate(n_params: int, *, world: int = 1, sharded: bool = False, bf16: bool = False,
                    reference: bool = True, kv_bytes_per_token: int = 0, max_context: int = 0,
                    episodes: int = 0, parked: int = 0, unit: int = 0, inference: bool = False,
                    prefill: int = 0, lora: int = 0) -> dict:
    """Bytes per GPU, by what holds them, for a policy of n_params parameters trained with AdamW (or, with
    `inference`, only evaluated, as eval.py does: its weights in the compute dtype and the KV cache, nothing else).

    sharded: FSDP2 or ZeRO-3 over `world` GPUs (else DDP: each GPU holds everything; ZeRO-3 under bf16 also keeps
    a bf16 partition, 2 bytes a parameter / N, and its reference in bf16, not counted apart). bf16: compute in bf16
    (master weights stay fp32). kv_bytes_per_token: 2 (keys, values) x layers x kv_heads x head_dim x compute bytes.
    episodes: episodes one process decodes at once in a rollout (each holds its KV cache across turns).
    parked: episodes one process keeps waiting in host memory (--rollout-batch below its episodes, on a GPU).
    unit: parameters of the largest piece sharding moves onto the GPU whole (largest_unit).
    prefill: activation bytes of one prefill forward (prefill_bytes), held during the rollout beside its KV cache.
    lora: parameters of LoRA adapters (lora.adapter_params); then the base is frozen in the compute dtype (`weights`),
      and master_weights, gradients and optimizer count the adapters only; no reference (the adapters switched off).

      weights         the full weights in the compute dtype, as the forward uses them: FSDP2 gathers them for the
                      rollout; DDP keeps them (in fp32 these are the master weights themselves, counted there;
                      in bf16, autocast's cached bf16 copies during the rollout)
      master_weights  fp32 weights the optimizer updates (/ N under FSDP2)
      gradients       fp32 (/ N under FSDP2; twice under multi-process DDP, whose reduction buckets are a copy);
                      param.grad is freed before each rollout (zero_grad(set_to_none=True)), DDP's buckets are
                      allocated when the model is wrapped and kept, so every peak counts them
      optimizer       AdamW's two fp32 moments (/ N under FSDP2)
      reference       the frozen reference, fp32 like the policy's master weights (grpo.load_reference: the same
                      precision path, so kl is 0 until the policy moves) (/ N under FSDP2); 0 without a KL term
      kv_cache        kv_bytes_per_token x max_context x episodes: the worst case, every episode at the context cap
      host_kv_cache   the same for the parked episodes, in host memory (not GPU memory: not in the peaks)
      prefill         one prefill forward's activations (the rollout prefills in chunks of prefill_tokens)
      host_load       host memory while loading: one full fp32 model per process (the policy, then the reference)
      host_peak       the larger of host_load and host_kv_cache (they are not held at the same time)
    The rollout holds weights + master_weights + optimizer + reference + kv_cache + prefill; the update holds
    master_weights + gradients + optimizer + reference (+ weights under DDP); loading holds, under DDP, the whole
    fp32 policy (and its reduction buckets) and then the reference; under FSDP2 (load_device: loaded in host memory,
    then sharded) the shards of both plus one unit whole; `peak` is the largest. The optimizer's moments appear at
    the first update.
    Other activations, logits chunks and the allocator's slack are not counted: leave room for them (on an H100 a
    rollout peaked at ~1.5x weights + kv_cache + prefill; bench/README.md).
    """
    shards = world if sharded else 1
    compute = 2 if bf16 else 4
    kv, host_kv = kv_bytes_per_token * max_context * episodes, kv_bytes_per_token * max_context * parked
    if inference:  # eval.py: each process loads the whole model in the compute dtype and decodes
        est = {"weights": n_params * compute, "kv_cache": kv, "prefill": prefill, "host_kv_cache": host_kv,
               "rollout_peak": n_params * compute + kv + prefill, "load_peak": n_params * compute,
               "host_load": n_params * compute, "host_peak": max(n_params * compute, host_kv)}
        est["peak"] = est["rollout_peak"]
        return est
    grads = 2 if (not sharded and world > 1) else 1  # DDP keeps its reduction buckets beside param.grad
    if lora:  # the frozen base in the compute dtype, everything trained is the adapters' (DDP or one process)
        est = {"weights": n_params * compute, "master_weights": lora * 4, "gradients": grads * lora * 4,
               "optimizer": lora * 8, "reference": 0, "kv_cache": kv, "prefill": prefill, "host_kv_cache": host_kv}
        held = est["weights"] + est["master_weights"] + est["optimizer"] + (lora * 4 if grads == 2 else 0)
        est["rollout_peak"] = held + kv + prefill
        est["update_peak"] = held + lora * 4
        est["load_peak"] = n_params * compute + lora * 4 * grads
        est["host_load"] = n_params * compute
        est["host_peak"] = max(est["host_load"], host_kv)
        est["peak"] = max(est["rollout_peak"], est["update_peak"], est["load_peak"])
        return est
    est = {
        "weights": n_params * compute if (sharded or bf16) else 0,
        "master_weights": n_params * 4 // shards,
        "gradients": grads * n_params * 4 // shards,
        "optimizer": n_params * 8 // shards,
        "reference": n_params * 4 // shards if reference else 0,
        "kv_cache": kv,
        "prefill": prefill,
        "host_kv_cache": host_kv,
    }
    held = est["master_weights"] + est["optimizer"] + est["reference"]
    held += n_params * 4 if grads == 2 else 0  # DDP allocates its reduction buckets at wrap time and keeps them
    est["rollout_peak"] = held + est["weights"] + est["kv_cache"] + prefill
    est["update_peak"] = held + est["gradients"] // grads + (0 if sharded else est["weights"])
    if sharded:
        est["load_peak"] = (n_params * 4 // shards) * (2 if reference else 1) + unit * 4
    else:
        est["load_peak"] = n_params * 4 * (2 if reference else 1) + (n_params * 4 if grads == 2 else 0)
    est["host_load"] = n_params * 4
    est["host_peak"] = max(est["host_load"], est["host_kv_cache"])
    est["peak"] = max(est["rollout_peak"], est["update_peak"], est["load_peak"])
    return est


def read_config(name: str):
    """The transformers config of a checkpoint directory or hub id; None for a name only muarl knows (smollm2-135m)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(name)
    except (OSError, ValueError):
        return None


def meta_model(config):
    """The causal LM a transformers config describes, on the meta device (shapes only, no memory used), never
    partitioned by an active ZeRO-3 config (its parameters would report 0 elements, and the estimate 0 bytes)."""
    from transformers import AutoModelForCausalLM

    import cli

    with cli.outside_zero3_init(), torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def count_params(config) -> int:
    return sum(p.numel() for p in meta_model(config).parameters())


def largest_unit(model) -> int:
    """Parameters of the largest piece fully_shard moves onto the GPU whole: a decoder layer (each is its own unit),
    or what is left to the root (embeddings, output layer, final norm; shard_like's split, an upper bound of
    Accelerate's, which gives the embeddings and the output layer units of their own)."""
    layers = set(getattr(model, "_no_split_modules", None) or [])
    in_layers, biggest = set(), 0
    for module in model.modules():
        if type(module).__name__ in layers:
            params = list(module.parameters())
            in_layers.update(id(p) for p in params)
            biggest = max(biggest, sum(p.numel() for p in params))
    rest = sum(p.numel() for p in model.parameters() if id(p) not in in_layers)
    return max(biggest, rest)


def host_memory_bytes() -> int:
    """This machine's physical memory (Linux, macOS); 0 where the OS does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def check_memory(config, *, world: int, sharded: bool, bf16: bool, reference: bool, max_context: int,
                 episodes: int, device, check: bool = True, program: str = "grpo.py", parked: int = 0,
                 inference: bool = False, prefill_tokens: int = 0, lora: int = 0) -> dict:
    """Print memory_estimate for this run; on a CUDA device, SystemExit when its peak exceeds the device's memory,
    or when what all processes on this machine hold in host memory at once exceeds it (unless check is False),
    naming the options that change it."""
    shapes = meta_model(config)
    est = memory_estimate(sum(p.numel() for p in shapes.parameters()), world=world, sharded=sharded, bf16=bf16,
                          reference=reference, kv_bytes_per_token=kv_bytes_per_token(config, bf16),
                          max_context=max_context, episodes=episodes, parked=parked, unit=largest_unit(shapes),
                          inference=inference, lora=lora,
                          prefill=prefill_bytes(config, bf16, min(prefill_tokens or max_context * episodes,
                                                                  max_context * episodes), max_context))
    backend = f"sharded over {world}" if sharded else ("DDP" if world > 1 else "one process")
    backend += f", LoRA adapters of {lora:,} parameters" if lora else ""
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"[{program.removesuffix('.py')}] estimated memory per GPU ({backend}): "
              + ", ".join(f"{k} {gib(v)}" for k, v in est.items()) + " (activations not counted)", flush=True)
    device = torch.device(device)
    if not check or device.type != "cuda":
        return est
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # processes on this machine, each with its own host memory
    host = host_memory_bytes()
    if host and est["host_peak"] * local > host:
        need, total = gib(est["host_peak"]), gib(est["host_peak"] * local)
        if est["host_kv_cache"] >= est["host_load"]:
            raise SystemExit(
                f"{program}: the parked episodes' KV caches need an estimated {need} of host memory per process, "
                f"{total} for the {local} on this machine, more than its {gib(host)} ({parked} episodes a process "
                f"wait off the GPU at --max-context {max_context}, the worst case). Raise --rollout-batch (fewer "
                "wait), lower --max-context or --tasks-per-step; --no-memory-check runs anyway.")
        raise SystemExit(
            f"{program}: loading needs an estimated {need} of host memory per process (the whole model in "
            f"{'the compute dtype' if lora else 'fp32'}, "
            f"before it is moved to the GPU or sharded), {total} for the {local} on this machine, more than its "
            f"{gib(host)}. Run fewer processes per machine or a smaller model; --no-memory-check runs anyway.")
    have = torch.cuda.get_device_properties(device).total_memory
    if est["peak"] > have:
        phase = max(("load", "rollout", "update"), key=lambda k: est.get(f"{k}_peak", 0))
        raise SystemExit(
            f"{program}: the estimated {phase} peak of {gib(est['peak'])} per GPU exceeds this GPU's {gib(have)} "
            f"({backend}; the KV cache term, {gib(est['kv_cache'])}, assumes {episodes} decoding episodes per "
            f"process at --max-context {max_context}). Set --rollout-batch (episodes decoding at once; the "
            "others' caches wait in host memory), lower --max-context or --tasks-per-step, "
            + ("lower --lora-rank or use a smaller model (LoRA runs on one GPU or DDP, each holding the whole base)"
               if lora else "add GPUs, shard with FSDP2 (fsdp_version 2), train LoRA adapters on a frozen base "
               "(--lora-rank, e.g. 64), or set --kl-coef 0 (no reference)") + "; --no-memory-check runs anyway.")
    return est


def kv_bytes_per_token(config, bf16: bool) -> int:
    """2 (keys and values) x layers x kv_heads x head_dim x bytes of the compute dtype, from a transformers config."""
    cfg = config.get_text_config(decoder=True)
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return 2 * cfg.num_hidden_layers * kv_heads * head_dim * (2 if bf16 else 4)


def prefill_bytes(config, bf16: bool, tokens: int, context: int) -> int:
    """Activations of one prefill forward of `tokens` tokens (rollout's prefill_tokens, rows x columns) whose keys
    reach `context` positions: per token the MLP's three intermediates and ~4 hidden-size tensors in the compute
    dtype, and the attention mask over the keys (a boolean and its additive form). An approximation from the model's
    shape, compared with what an H100 measured in bench/gpu.py's kv_peak check (bench/README.md)."""
    cfg = config.get_text_config(decoder=True)
    compute = 2 if bf16 else 4
    inter = getattr(cfg, "intermediate_size", None) or 4 * cfg.hidden_size
    return tokens * (4 * cfg.hidden_size + 3 * inter) * compute + tokens * context * (1 + compute)


def gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


# ---------------------------------------------------------------------------------------------------------
# Lockstep: what every process must do the same number of times, whatever its own share of the step holds
# ---------------------------------------------------------------------------------------------------------
def lockstep_count(acc, n: int) -> int:
    """How many micro-batches every process runs: the most any process has. Under DDP, FSDP2 and DeepSpeed each
    forward/backward is, or ends in, a collective, so a process that ran one fewer would leave the others waiting
    forever; a process with fewer rows (its episodes failed, its groups were dropped) runs empty micro-batches."""
    if acc.num_processes == 1:
        return n
    return int(acc.reduce(torch.tensor(n, device=acc.device), reduction="max").item())


def total(acc, *xs: float) -> list[float]:
    """Numbers summed over processes, in one collective (e.g. the step's trained tokens: one normalizer for every
    micro-batch of every process)."""
    if acc.num_processes == 1:
        return [float(x) for x in xs]
    t = torch.tensor([float(x) for x in xs], device=acc.device, dtype=torch.float64)
    return acc.reduce(t, reduction="sum").tolist()
