"""plumbing/policy.py: what a GRPO run trains and measures against, loaded (pipeline.load calls it): the policy, in
fp32 or with LoRA adapters, its optimizer and schedule prepared by Accelerate, and the frozen reference (a copy of the
start, sharded like the policy; with LoRA the policy with its adapters off), the memory they need checked before any
weight is loaded. Machinery: a first reader skips it."""
from __future__ import annotations

import torch

from plumbing import cli, lora, memory, models, shard
import muarl
from fast.logprobs import token_logprobs
from plumbing.options import freeze


def load_policy(run) -> None:
    """The policy (fp32 master weights: a bf16 AdamW step of lr 1e-6 rounds to nothing; --bf16 runs the forward
    passes under autocast), its optimizer and scheduler, prepared by Accelerate, and the frozen reference. Under
    FSDP2 the policy is loaded in host memory and sharded onto the GPUs by acc.prepare (under ZeRO-3 partitioned as
    it loads); the reference after it, so that host memory holds one full model at a time (shard.load_device).
    With --lora-rank: the start frozen in the compute dtype with fp32 adapters, and the reference is the policy with
    the adapters off (an adapter checkpoint as the start is merged into its base first: lora.py)."""
    cfg, acc = run.cfg, run.acc
    start = cfg.init_from or cfg.model
    option = "--init-from" if cfg.init_from else "--model"
    load_errors = cli.option_errors(f"grpo.py: {option}")
    if getattr(run, "resume_from", None):  # the start comes from the run's saved settings, not the command line
        load_errors = cli.option_errors(
            f"grpo.py: --resume: the run's start ({option} in its saved settings, "
            f"{run.resume_from / 'model' / 'muarl_config.json'}; if it moved, put it back or edit that entry)")
    with load_errors:  # a local path that is not there stops now, not after a hub lookup
        models.check_local(start)

    def check_memory(config):
        from fast.batched_rollout import RolloutConfig, parse_slots
        from fast.graphs import graphs_on

        per_process = cfg.tasks_per_step // acc.num_processes * cfg.group_size
        live = max(per_process, -(-cfg.eval_tasks // acc.num_processes))
        decoding = min(live, cfg.rollout_batch or live)
        sizes = parse_slots(cfg.decode_slots, cfg.max_context) if cfg.decode_slots else []
        decoding = min(decoding, sum(n for n, _ in sizes) or decoding)  # (the slots sized by need bound it too)
        adapters = memory.lora_params(config, cfg, "grpo.py")
        memory.check_memory(config, **shard.memory_backend(acc), bf16=cfg.bf16,
                           reference=cfg.kl_coef > 0 and not cfg.lora_rank, max_context=cfg.max_context,
                           episodes=decoding, parked=live - decoding if acc.device.type != "cpu" else 0,
                           device=acc.device, check=cfg.memory_check, prefill_tokens=RolloutConfig.prefill_tokens,
                           lora=adapters, lora_base=memory.lora_base_params(config, cfg),
                           kept_pool=graphs_on(cfg, acc.device, decoding),  # the graphed step keeps its pool
                           slot_positions=sum(n * cap for n, cap in sizes))
    # Before loading, when the start names a config (a directory, a hub id, adapters on one of those)
    config = memory.read_config(lora.base_chain(start)[-1])
    if config is not None:
        check_memory(config)
    adapter_start = lora.is_adapter_dir(start)
    if cfg.lora_rank and run.resume_from:  # the checkpoint's adapters were trained on the start as it was then
        lora.check_base(run.resume_from / "model", start, f"grpo.py: --resume {run.resume_from}")
    if adapter_start and shard.is_zero3_plugin(acc):
        raise SystemExit(f"grpo.py: --init-from {start} holds adapters, which ZeRO-3 cannot merge into a base it "
                         "partitions as it loads: merge them first (eval.py --agent CHECKPOINT --merge-lora OUT) and "
                         "start from OUT")
    load_on = shard.load_device(acc)
    compute = torch.bfloat16 if cfg.bf16 else torch.float32  # the forward passes' dtype (--bf16: autocast's)
    attn = models.attention_implementation(acc.device, compute, cfg.attn)
    with load_errors:
        model, run.tok = models.load_model(start, device=load_on, seed=cfg.seed, attn_implementation=attn,
                                          dtype=compute if cfg.lora_rank else torch.float32)
    if adapter_start:
        model = merged_start(run, model, start)
    if config is None:
        check_memory(model.config)
    if cfg.gradient_checkpointing:  # (with LoRA, peft makes the frozen embeddings' output require grad for it)
        model.gradient_checkpointing_enable()
    if cfg.lora_rank:
        model = lora.add_adapters(model, rank=cfg.lora_rank, alpha=cfg.lora_alpha, dropout=cfg.lora_dropout,
                                  targets=cfg.lora_target_modules, base=start, program="grpo.py", autocast=cfg.bf16)
        acc.print(f"[grpo] --lora-rank {cfg.lora_rank}: {lora.describe(model)}"
                  + ("; the reference is the policy with its adapters off" if cfg.kl_coef > 0 else ""))
    if cfg.freeze:
        frozen = freeze(model, cfg.freeze)
        acc.print(f"[grpo] --freeze {cfg.freeze!r}: {frozen:,} of {sum(p.numel() for p in model.parameters()):,} "
                  "parameters frozen")
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = (torch.optim.SGD(trained, lr=cfg.lr) if cfg.optimizer == "sgd" else
           torch.optim.AdamW(trained, lr=cfg.lr, weight_decay=0.0))
    # Stepped by hand once per update (Accelerate's prepared scheduler steps once per process).
    run.sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / cfg.warmup_steps) if cfg.warmup_steps else 1.0)
    shard.configure_deepspeed(acc, micro_batch_size=cfg.micro_batch_size, grad_clip=cfg.grad_clip)
    run.model, run.opt = acc.prepare(model, opt)
    shard.expose_head(run.model)
    if cfg.lora_rank:  # the reference is the policy itself, scored with its adapters off (train_on_episodes)
        run.ref = acc.unwrap_model(run.model) if cfg.kl_coef > 0 else None
        lora.checkpoint_hooks(acc)  # checkpoints hold the adapters, not the frozen base
    else:
        run.ref = models.load_reference(start, load_on, cfg.seed, attn) if cfg.kl_coef > 0 else None
        if run.ref is not None:  # each process loaded its own copy: the same one?
            shard.check_same_weights(acc, run.ref, f"the reference ({start})")
        if run.ref is not None and shard.is_sharded(run.model):
            shard.shard_like(run.ref, run.model, param_dtype=torch.bfloat16 if cfg.bf16 else None)
        elif run.ref is not None and shard.is_deepspeed(run.model):
            run.ref = shard.deepspeed_reference(run.ref, acc.state.deepspeed_plugin.deepspeed_config)
    # run.sched is saved by checkpoints.save as JSON, not registered with Accelerate, which would unpickle it on
    # --resume with weights_only=False: a file planted in a run directory would run code


def merged_start(run, model, start: str):
    """A start that is an adapter checkpoint, folded into its base, whose dtype it keeps: the reference is this
    merged model, so what the merge changed is measured (on the first task's opening) and said. In bf16 each merged
    weight is rounded once (W + dW to 8 bits of mantissa); in fp32 the change is at rounding level."""
    from envs import opening_messages

    task = run.tasks[0]
    ids = muarl.prompt_ids(run.tok, opening_messages(run.env, task, None), run.env.tools(task))[:1024]
    device = next(model.parameters()).device
    x = torch.tensor([ids], device=device)
    with torch.no_grad(), run.acc.autocast():
        before = token_logprobs(model, x, torch.ones_like(x))
        model = lora.merge(model)
        after = token_logprobs(model, x, torch.ones_like(x))
    gap = (before - after)[:, 1:].abs()
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    run.acc.print(f"[grpo] --init-from {start}: its adapters merged into the base ({dtype}); the start's log-probs of "
                  f"the first task's opening ({len(ids)} tokens) moved by {gap.mean().item():.2g} on average, "
                  f"{gap.max().item():.2g} at most; the reference is this merged start")
    return model
