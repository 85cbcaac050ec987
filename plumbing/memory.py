"""plumbing/memory.py: the memory a run needs, estimated before the weights load. A pure function by what holds the
bytes (memory_estimate: per GPU and per machine, for DDP or a sharded backend over N GPUs, with or without LoRA, for
training or evaluation), the model shapes it reads from a config without loading weights, and check_memory, which prints
the estimate at start and stops on a GPU it cannot fit (check_training: sft.py's, with no rollout). bench/gpu.py's
kv_peak holds it to a real peak (bench/README.md)."""
from __future__ import annotations

import os

import torch

MODEL_FILE_BYTES = 5 * 10**9  # the largest weights file of a model directory (checkpoints.save_pretrained)
# A rollout's real peak over the estimate, measured on an H100 at 8k-32k contexts (bench/README.md, kv_peak: 1.49 to
# 1.55): allocator slack and attention workspaces the estimate does not count
ESTIMATE_MISSES = 1.55


def memory_estimate(n_params: int, *, world: int = 1, sharded: bool = False, bf16: bool = False,
                    reference: bool = True, kv_bytes_per_token: int = 0, max_context: int = 0,
                    episodes: int = 0, parked: int = 0, unit: int = 0, inference: bool = False,
                    prefill: int = 0, lora: int = 0, zero2: bool = False, lora_base: int = 0,
                    kept_pool: bool = False, slot_positions: int = 0) -> dict:
    """Bytes per GPU, by what holds them, for a policy of n_params parameters trained with AdamW (or, with
    `inference`, only evaluated, as eval.py does: its weights in the compute dtype and the KV cache, nothing else).

    sharded: FSDP2 or ZeRO-3 over `world` GPUs (else DDP: each GPU holds everything; ZeRO-3 under bf16 also keeps
    a bf16 partition, 2 bytes a parameter / N, and its reference in bf16, not counted apart). zero2: DeepSpeed ZeRO-2
    over `world` GPUs: the weights whole in the compute dtype (the engine's), the fp32 master weights, gradients and
    AdamW state / N, the reference whole in the compute dtype (its own stage-0 engine). bf16: compute in bf16
    (master weights stay fp32). kv_bytes_per_token: 2 (keys, values) x layers x kv_heads x head_dim x compute bytes.
    episodes: episodes one process decodes at once in a rollout (each holds its KV cache across turns).
    parked: episodes one process keeps waiting in host memory (--rollout-batch below its episodes, on a GPU).
    unit: parameters of the largest piece sharding moves onto the GPU whole (largest_unit).
    prefill: activation bytes of one prefill forward (prefill_bytes), held during the rollout beside its KV cache.
    lora: parameters of LoRA adapters (lora.adapter_params); then the base is frozen in the compute dtype (`weights`),
      and master_weights, gradients and optimizer count the adapters only; no reference (the adapters switched off).
    kept_pool: the KV cache's pool is kept from one rollout to the next (the graphed decoding step, pool.rollout_pool),
      so the update holds it too.
    slot_positions: the positions of every KV cache slot when they come in several sizes (--decode-slots: the sum
      of slots x positions), which replaces max_context x episodes in kv_cache.

      weights         the full weights in the compute dtype, as the forward uses them: FSDP2 gathers them for the
                      rollout; DDP keeps them (in fp32 these are the master weights themselves, counted there;
                      in bf16, autocast's cached bf16 copies during the rollout)
      master_weights  fp32 weights the optimizer updates (/ N under FSDP2)
      gradients       fp32 (/ N under FSDP2; twice under multi-process DDP, whose reduction buckets are a copy);
                      param.grad is freed before each rollout (zero_grad(set_to_none=True)), DDP's buckets are
                      allocated when the model is wrapped and kept, so every peak counts them
      optimizer       AdamW's two fp32 moments (/ N under FSDP2)
      reference       the frozen reference, fp32 like the policy's master weights (models.load_reference: the same
                      precision path, so kl is 0 until the policy moves) (/ N under FSDP2); 0 without a KL term
      kv_cache        kv_bytes_per_token x max_context x episodes: the worst case, every episode at the context cap
                      (with slot_positions, x those: the slots as they are allocated)
      host_kv_cache   the same for the parked episodes, in host memory (not GPU memory: not in the peaks); its
                      blocks are kept from the first rollout that parks an episode to the end (pool._host_block)
      prefill         one prefill forward's activations (the rollout prefills in chunks of prefill_tokens)
      host_load       host memory while loading: one full fp32 model per process (the policy, then the reference)
      host_save       host memory of the one process that writes a checkpoint's model directory: the whole fp32
                      model gathered there when sharded (shard.full_state_dict), and one weights file serialized
                      (safetensors builds a file in memory; files of at most MODEL_FILE_BYTES). The other processes
                      write only their shards (a sharded save_state).
      host_base       with LoRA and --lora-decode merged: the adapted base weights' copy in the compute dtype that
                      restores them after each rollout (lora.merged_for_decoding), held from the first rollout on
      host_peak       the larger of host_load and host_kv_cache + host_save (loading ends before the first rollout;
                      the parked caches' blocks are still held when a checkpoint is written), host_base added to the
                      latter
    The rollout holds weights + master_weights + optimizer + reference + kv_cache + prefill; the update holds
    master_weights + gradients + optimizer + reference (+ weights under DDP, + kv_cache when kept_pool); loading
    holds, under DDP, the whole fp32 policy (and its reduction buckets) and then the reference; under FSDP2
    (shard.load_device: loaded in host memory, then sharded) the shards of both plus one unit whole; `peak` is the
    largest. The optimizer's moments appear at the first update.
    Other activations, logits chunks and the allocator's slack are not counted: leave room for them (how much:
    bench/README.md, kv_peak).
    """
    shards = world if (sharded or zero2) else 1
    compute = 2 if bf16 else 4
    kv = kv_bytes_per_token * (slot_positions or max_context * episodes)
    host_kv = kv_bytes_per_token * max_context * parked
    if inference:  # eval.py: each process loads the whole model in the compute dtype and decodes
        est = {"weights": n_params * compute, "kv_cache": kv, "prefill": prefill, "host_kv_cache": host_kv,
               "rollout_peak": n_params * compute + kv + prefill, "load_peak": n_params * compute,
               "host_load": n_params * compute, "host_save": 0, "host_peak": max(n_params * compute, host_kv)}
        est["peak"] = est["rollout_peak"]
        return est
    grads = 2 if (not sharded and not zero2 and world > 1) else 1  # DDP keeps its reduction buckets beside .grad
    if lora:  # the frozen base in the compute dtype, everything trained is the adapters' (DDP or one process)
        est = {"weights": n_params * compute, "master_weights": lora * 4, "gradients": grads * lora * 4,
               "optimizer": lora * 8, "reference": 0, "kv_cache": kv, "prefill": prefill, "host_kv_cache": host_kv}
        held = est["weights"] + est["master_weights"] + est["optimizer"] + (lora * 4 if grads == 2 else 0)
        est["rollout_peak"] = held + kv + prefill
        est["update_peak"] = held + lora * 4 + (kv if kept_pool else 0)
        est["load_peak"] = n_params * compute + lora * 4 * grads
        est["host_load"] = n_params * compute
        est["host_save"] = lora * 4  # the adapters only, in fp32
        est["host_base"] = lora_base * compute  # --lora-decode merged: the adapted base weights' copy, held all run
        est["host_peak"] = max(est["host_load"], est["host_base"] + host_kv + est["host_save"])
        est["peak"] = max(est["rollout_peak"], est["update_peak"], est["load_peak"])
        return est
    est = {
        "weights": n_params * compute if (sharded or bf16 or zero2) else 0,
        "master_weights": n_params * 4 // shards,
        "gradients": grads * n_params * 4 // shards,
        "optimizer": n_params * 8 // shards,
        "reference": (n_params * compute if zero2 else n_params * 4 // shards) if reference else 0,
        "kv_cache": kv,
        "prefill": prefill,
        "host_kv_cache": host_kv,
    }
    held = est["master_weights"] + est["optimizer"] + est["reference"]
    held += n_params * 4 if grads == 2 else 0  # DDP allocates its reduction buckets at wrap time and keeps them
    est["rollout_peak"] = held + est["weights"] + est["kv_cache"] + prefill
    est["update_peak"] = held + est["gradients"] // grads + (0 if sharded else est["weights"])
    est["update_peak"] += kv if kept_pool else 0
    if sharded:
        est["load_peak"] = (n_params * 4 // shards) * (2 if reference else 1) + unit * 4
    else:
        est["load_peak"] = n_params * 4 * (2 if reference else 1) + (n_params * 4 if grads == 2 else 0)
    est["host_load"] = n_params * 4
    est["host_save"] = (n_params * 4 if sharded or zero2 else 0) + min(n_params * 4, MODEL_FILE_BYTES)
    est["host_peak"] = max(est["host_load"], est["host_kv_cache"] + est["host_save"])
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

    from plumbing import cli

    with cli.outside_zero3_init(), torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def count_params(config) -> int:
    return sum(p.numel() for p in meta_model(config).parameters())


def largest_unit(model) -> int:
    """Parameters of the largest piece fully_shard moves onto the GPU whole: a decoder layer (each is its own unit),
    or what is left to the root (embeddings, output layer, final norm; shard.shard_like's split, an upper bound of
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


def available_host_bytes() -> int:
    """The host memory a new allocation can take now (Linux's MemAvailable: free and reclaimable), shared by every
    process on the machine; the physical memory where the OS does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return host_memory_bytes()


def cpu_room() -> int:
    """What one process running on the CPU may take: the available host memory shared by this machine's processes."""
    return available_host_bytes() // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def check_memory(config, *, world: int, sharded: bool, bf16: bool, reference: bool, max_context: int,
                 episodes: int, device, check: bool = True, program: str = "grpo.py", parked: int = 0,
                 inference: bool = False, prefill_tokens: int = 0, lora: int = 0, zero2: bool = False,
                 lora_base: int = 0, kept_pool: bool = False, slot_positions: int = 0) -> dict:
    """Print memory_estimate for this run; on a CUDA device, SystemExit when its peak exceeds the device's memory,
    or when what all processes on this machine hold in host memory at once exceeds it; on the CPU, when its peak
    exceeds the host memory available now (unless check is False); each naming the options that change it."""
    shapes = meta_model(config)
    est = memory_estimate(sum(p.numel() for p in shapes.parameters()), world=world, sharded=sharded, bf16=bf16,
                          reference=reference, kv_bytes_per_token=kv_bytes_per_token(config, bf16),
                          max_context=max_context, episodes=episodes, parked=parked, unit=largest_unit(shapes),
                          inference=inference, lora=lora, zero2=zero2, lora_base=lora_base, kept_pool=kept_pool,
                          slot_positions=slot_positions,
                          prefill=rollout_prefill(config, bf16, prefill_tokens, max_context, episodes))
    backend = backend_name(world, sharded, zero2)
    backend += f", LoRA adapters of {lora:,} parameters" if lora else ""
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"[{program.removesuffix('.py')}] estimated memory per GPU ({backend}): "
              + ", ".join(f"{k} {gib(v)}" for k, v in est.items()) + " (activations not counted)", flush=True)
    device = torch.device(device)
    room = cpu_room() if check and device.type == "cpu" else 0  # read once: it moves with the machine's other work
    if room and est["peak"] > room:
        raise SystemExit(
            f"{program}: the estimated peak of {gib(est['peak'])} per process exceeds the {gib(room)} of host "
            f"memory available to it on this machine (running on the CPU; the KV cache term, {gib(est['kv_cache'])}, "
            f"assumes {slots_said(episodes, max_context, slot_positions)}). Set --rollout-batch (episodes "
            "decoding at once), lower --max-context, --trials or --tasks-per-step, or use a smaller model; "
            "--no-memory-check runs anyway.")
    if not check or device.type != "cuda":
        return est
    check_host(est, program, lora=bool(lora), parked=parked, max_context=max_context)
    have = torch.cuda.get_device_properties(device).total_memory
    if est["peak"] > have:
        phase = max(("load", "rollout", "update"), key=lambda k: est.get(f"{k}_peak", 0))
        raise SystemExit(
            f"{program}: the estimated {phase} peak of {gib(est['peak'])} per GPU exceeds this GPU's {gib(have)} "
            f"({backend}; the KV cache term, {gib(est['kv_cache'])}, assumes "
            f"{slots_said(episodes, max_context, slot_positions)} per process). Set --rollout-batch (episodes "
            "decoding at once; the others' caches wait in host memory), lower --max-context or --tasks-per-step, "
            + ("lower --lora-rank or use a smaller model (LoRA runs on one GPU or DDP, each holding the whole base)"
               if lora else "add GPUs, shard with FSDP2 (fsdp_version 2), train LoRA adapters on a frozen base "
               "(--lora-rank, e.g. 64), or set --kl-coef 0 (no reference)") + "; --no-memory-check runs anyway.")
    return est


def backend_name(world: int, sharded: bool, zero2: bool = False) -> str:
    return f"sharded over {world}" if sharded else (f"ZeRO-2 over {world}" if zero2 else "DDP" if world > 1
                                                    else "one process")


def check_host(est: dict, program: str, *, lora: bool = False, parked: int = 0, max_context: int = 0) -> None:
    """SystemExit when this machine's host memory cannot hold what the estimate says it will: the checkpoint's
    writer alone (host_save), or every process on the machine at once (loading, parked KV caches)."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # processes on this machine, each with its own host memory
    host = host_memory_bytes()
    held = est.get("host_base", 0) + est["host_kv_cache"]  # the rollout's: merged LoRA's base copy, parked caches
    each = max(est["host_load"], held)  # every process at once; host_save on one process only
    if host and est["host_save"] > host and est["host_save"] >= each * local:
        raise SystemExit(
            f"{program}: saving a checkpoint needs an estimated {gib(est['host_save'])} of host memory on the process "
            f"that writes it (the whole model gathered there in fp32, and one weights file of up to "
            f"{gib(MODEL_FILE_BYTES)} serialized), more than this machine's {gib(host)}. Use a machine with more host "
            "memory, or train LoRA adapters (--lora-rank: only they are saved); --no-memory-check runs anyway.")
    saving = held * local + est["host_save"]  # at a checkpoint: every process's parked caches, and the writer's model
    if host and held and saving > host and each * local <= host:
        raise SystemExit(
            f"{program}: writing a checkpoint needs an estimated {gib(saving)} of host memory on this machine, more "
            f"than its {gib(host)}: the writer's {gib(est['host_save'])} beside the {local} processes' parked KV "
            f"caches{' and base copies' if est.get('host_base', 0) else ''} ({gib(held * local)}), which stay "
            "allocated for the next rollout. Raise --rollout-batch (fewer wait), lower --max-context or "
            "--tasks-per-step; --no-memory-check runs anyway.")
    if host and each * local > host:
        need, total = gib(each), gib(each * local)
        if est.get("host_base", 0) and held >= est["host_load"]:
            raise SystemExit(
                f"{program}: the rollout needs an estimated {need} of host memory per process ({total} for the "
                f"{local} on this machine, more than its {gib(host)}): a copy of the adapted base weights "
                f"({gib(est['host_base'])}, --lora-decode merged) and the parked episodes' KV caches "
                f"({gib(est['host_kv_cache'])}). Set --lora-decode unmerged (no copy), raise --rollout-batch or lower "
                "--max-context; --no-memory-check runs anyway.")
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


def fitting_batch(config, *, live: int, device_bytes: int, bf16: bool, max_context: int, prefill_tokens: int = 0,
                  world: int = 1) -> int:
    """For an evaluation (eval.py, --rollout-batch 0): the most of a process's `live` episodes that can decode at
    once on a GPU of device_bytes (or a CPU with that much host memory to spare) by memory_estimate (inference)
    with its measured miss (ESTIMATE_MISSES), the others waiting; at least 1, when even one does not fit
    (check_memory then says so)."""
    n_params = sum(p.numel() for p in meta_model(config).parameters())
    kv = kv_bytes_per_token(config, bf16)

    def peak(episodes):
        return memory_estimate(n_params, world=world, bf16=bf16, reference=False, kv_bytes_per_token=kv,
                               max_context=max_context, episodes=episodes, inference=True, prefill=rollout_prefill(
                                   config, bf16, prefill_tokens, max_context, episodes))["peak"]
    lo, hi = 1, max(1, live)
    while lo < hi:  # the peak grows with the episodes: the largest that fits
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if peak(mid) * ESTIMATE_MISSES <= device_bytes else (lo, mid - 1)
    return lo


def lora_params(config, cfg, program: str) -> int:
    """Parameters of the adapters --lora-rank asks for on the model `config` describes (0 without); a target that
    matches nothing stops here, before the weights load."""
    if not cfg.lora_rank:
        return 0
    from plumbing import lora

    shapes = meta_model(config)
    lora.check_targets(shapes, cfg.lora_target_modules, program)
    return lora.adapter_params(shapes, cfg.lora_rank, cfg.lora_target_modules)


def lora_base_params(config, cfg) -> int:
    """Parameters of the base weights --lora-decode merged copies to host memory (0 without LoRA or unmerged)."""
    if not cfg.lora_rank or getattr(cfg, "lora_decode", "unmerged") != "merged":
        return 0
    from plumbing import lora

    return lora.adapted_base_params(meta_model(config), cfg.lora_target_modules)


def slots_said(episodes: int, max_context: int, slot_positions: int) -> str:
    """What the KV cache term counts, in the options' words."""
    if slot_positions:
        return f"slots of {slot_positions:,} positions in all (--decode-slots)"
    return f"{episodes} decoding episodes at --max-context {max_context}"


def check_training(start: str, cfg, *, world: int, sharded: bool, device, zero2: bool = False,
                   program: str = "sft.py") -> dict | None:
    """sft.py's estimate at start, before the weights load: training with no rollout, so no reference, no KV cache,
    no prefill (episodes 0), the adapters' parameters with --lora-rank. Printed by check_memory; stopped here on
    the training peaks (loading, the update), not check_memory's `peak`: its rollout term holds the whole model
    gathered under FSDP2, which SFT never does (it gathers one layer at a time), and its advice names GRPO's options.
    None when the start's config cannot be read before loading (smollm2-135m, a name only muarl knows)."""
    from plumbing import lora

    config = read_config(lora.base_chain(start)[-1])  # adapters: the model at the chain's root
    if config is None:
        return None
    adapters = lora_params(config, cfg, program)
    est = check_memory(config, world=world, sharded=sharded, bf16=cfg.bf16, reference=False, max_context=0,
                       episodes=0, device=device, check=False, program=program, lora=adapters, zero2=zero2)
    if not cfg.memory_check or torch.device(device).type != "cuda":
        return est
    check_host(est, program, lora=bool(adapters))
    peak, have = max(est["load_peak"], est["update_peak"]), torch.cuda.get_device_properties(device).total_memory
    if peak > have:
        backend = backend_name(world, sharded, zero2)
        fix = ("lower --lora-rank or use a smaller model (LoRA runs on one GPU or DDP, each holding the whole base)"
               if adapters else "add GPUs, shard with FSDP2 (fsdp_version 2) or train LoRA adapters on a frozen base "
               "(--lora-rank, e.g. 64)")
        raise SystemExit(f"{program}: the estimated training peak of {gib(peak)} per GPU (weights, gradients, AdamW "
                         f"state) exceeds this GPU's {gib(have)} ({backend}): {fix}; --no-memory-check runs anyway")
    return est


def kv_bytes_per_token(config, bf16: bool) -> int:
    """2 (keys and values) x layers x kv_heads x head_dim x bytes of the compute dtype, from a transformers config."""
    cfg = config.get_text_config(decoder=True)
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return 2 * cfg.num_hidden_layers * kv_heads * head_dim * (2 if bf16 else 4)


def rollout_prefill(config, bf16: bool, prefill_tokens: int, max_context: int, episodes: int) -> int:
    """prefill_bytes of the rollout's prefill forward: prefill_tokens a forward (0: every episode's context at once),
    never more than the episodes' contexts."""
    return prefill_bytes(config, bf16, min(prefill_tokens or max_context * episodes, max_context * episodes),
                         max_context)


def prefill_bytes(config, bf16: bool, tokens: int, context: int) -> int:
    """Activations of one prefill forward of `tokens` tokens (rollout's prefill_tokens, rows x columns) whose keys
    reach `context` positions: per token the MLP's three intermediates and ~4 hidden-size tensors in the compute
    dtype, and the attention mask over the keys: the engine's boolean, repeated for the n_rep query heads of a
    key-value head (decode.grouped_decode_attention), and SDPA's additive form of that. An approximation from the
    model's shape, held to a real peak by bench/gpu.py's kv_peak check (bench/README.md)."""
    cfg = config.get_text_config(decoder=True)
    compute = 2 if bf16 else 4
    inter = getattr(cfg, "intermediate_size", None) or 4 * cfg.hidden_size
    n_rep = cfg.num_attention_heads // (getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
    return tokens * (4 * cfg.hidden_size + 3 * inter) * compute + tokens * context * (1 + n_rep * (1 + compute))


def gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
