"""grpo.py: GRPO with a simulated user in the loop (MUA-RL), the step and the run.

    ./run accelerate launch grpo.py                  # the embedded CPU default (shop domain, tiny model)
    ./run accelerate launch grpo.py --recipe paper --init-from runs/sft-qwen3-8b

The method, one step (grpo_step below):
  1. Take the step's tasks (--tasks-per-step over all processes); play G = --group-size episodes of each with the
     current policy, each against its own copy of the environment and a simulated user (grpo_step: the rollout).
  2. Score each episode: 1 when the task is truly done, else 0 (at its end in the rollout: rollout.end_episode, by
     the episode rule, envs.score). An episode lost to infrastructure is left out (grpo_step, decide).
  3. Advantage of each episode: (r - mean of its group) / (std of its group + 1e-6) (decide: loss.group_advantages).
  4. Loss on the tokens the agent sampled (loss mask 1), per token: PPO's clipped ratio with dual clip, plus
     0.001 x the k3 KL to the frozen start (train_on_episodes: loss.grpo_loss); summed over the whole step and
     divided by its number of sampled tokens, one normalizer for every micro-batch and process.
  5. One optimizer step (AdamW, gradient clipped at 1.0; train_on_episodes, through shard.optimizer_step).
The run (main): the cold start, greedy pass^1 before, the steps with metrics and checkpoints, pass^1 after; what
surrounds the method (set-up, logs, the loop's checkpoints and stop signals) is plumbing/pipeline.py's.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Annotated

import torch
from accelerate.utils import gather_object

import sft
from fast import batched_rollout
from plumbing import cli, lora, metrics, models, options, pipeline, rundir, shard, stopping
from plumbing.batches import micro_batches
from plumbing.cli import Range
from loss import ADVANTAGES, CORRECTIONS, CREDIT, grpo_loss, normalizer_count, uniform_groups
from fast.opening import group_carries, micro_batch_logprobs
from plumbing.options import AttentionOptions, LoraOptions, RunOptions, SamplingOptions, StartOptions, UserOptions


@dataclass
class Algorithm:
    """GRPO: the algorithm (defaults: the paper's, at the tiny CPU run's scale and learning rate: see --recipe paper)"""
    steps: Annotated[int, Range("[1, inf)")] = 30
    """GRPO steps (each: a rollout, its rewards and advantages, then --updates-per-batch optimizer steps; the tiny
    run's held-out pass^1 is flat after 30: bench/README.md, "The default run's recipe")"""
    tasks_per_step: Annotated[int, Range("[1, inf)")] = 16
    """tasks per step over all processes (the paper: 32); each process rolls out an equal share (the tiny run at 4:
    too few groups rewarded asking for it to move; at 16 it did: bench/README.md, the pilots)"""
    group_size: Annotated[int, Range("[2, inf)")] = 8
    """episodes per task, G (the paper: 8)"""
    lr: Annotated[float, Range("(0, inf)")] = 2e-4
    """learning rate, constant after warm-up (the paper: 1e-6 for Qwen3; the tiny model needs more)"""
    warmup_steps: Annotated[int, Range("[0, inf)")] = 0
    """linear warm-up steps"""
    optimizer: str = "adamw"
    """'adamw' (the paper) or 'sgd' (plain SGD: its --lr is on another scale)"""
    grad_clip: Annotated[float, Range("(0, inf)")] = 1.0
    """gradient-norm clip (the paper: 1.0)"""
    kl_coef: Annotated[float, Range("[0, inf)")] = 0.001
    """coefficient of the k3 KL to the frozen reference, as a loss term (the paper: 0.001; 0 drops the reference)"""
    clip_low: Annotated[float, Range("(0, 1)")] = 0.2
    """ratio clipped below at 1 - clip_low"""
    clip_high: Annotated[float, Range("(0, 1)")] = 0.2
    """ratio clipped above at 1 + clip_high"""
    dual_clip: Annotated[float, Range("[0, inf)")] = 3.0
    """dual-clip constant for negative advantages (the paper: 3.0; 0 disables; --policy-loss ppo only)"""
    policy_loss: str = "ppo"
    """per-token policy term in loss.POLICY_LOSSES: 'ppo' (clipped ratio, dual clip: the paper) or 'cispo'"""
    ratio_level: str = "token"
    """importance ratio: 'token' (the paper) or 'sequence' (GSPO, with --agg seq-mean-token-mean and clips of
    3e-4 / 4e-4); they differ only off-policy (--updates-per-batch > 1)"""
    agg: str = "token-mean"
    """loss aggregation: token-mean (the paper), seq-mean-token-mean (original GRPO), seq-mean-token-sum-norm
    (Dr. GRPO)"""
    advantage: str = "grpo"
    """advantage estimator in loss.ADVANTAGES: 'grpo' (group-normalized, the paper) or 'rloo'"""
    scale_advantages: bool = True
    """divide GRPO's advantages by the group std (the paper); off: r - mean (Dr. GRPO)"""
    drop_uniform_groups: bool = False
    """leave the groups whose rewards are all equal out of the update (DAPO's dynamic sampling, no resampling)"""
    share_opening: bool = True
    """compute a group's common opening (system prompt, tools, first user message) once in each training forward and
    backward: the same loss and gradient, less compute (--no-share-opening: every episode whole)"""
    credit: str = "episode"
    """advantage per token in loss.CREDIT: 'episode' (each token its episode's: the paper) or 'turn-discount'"""
    turn_discount: Annotated[float, Range("(0, 1]")] = 0.9
    """--credit turn-discount: a token of agent turn k of K gets its episode's advantage x turn_discount^(K-1-k)"""
    correction: str = "none"
    """weights on the policy term against the sampler/trainer mismatch, in loss.CORRECTIONS: 'none' (the paper) or
    'tis' (truncated importance sampling, as verl, slime, SkyRL and TRL ship it)"""
    tis_cap: Annotated[float, Range("(0, inf)")] = 2.0
    """--correction tis: each weight min(exp(trainer - sampler log-prob), tis_cap)"""
    tis_level: str = "token"
    """--correction tis: a weight per 'token', or per 'sequence' (exp of the episode's summed log-ratios)"""
    updates_per_batch: Annotated[int, Range("[1, inf)")] = 1
    """policy updates per rollout batch (the paper: 1, so old logprobs are the current ones and cost nothing)"""


@dataclass  # bases last to first: --help and config.json list the algorithm first, the run's plumbing last
class Config(AttentionOptions, RunOptions, LoraOptions, UserOptions, SamplingOptions, StartOptions, Algorithm):
    """GRPO with a simulated user. Defaults: the paper's algorithm settings at a CPU-sized scale (the small
    'shop' domain, the 'tiny' model, a scripted user); `--recipe paper` gives the paper's GPU recipe."""
    temperature: float = 0.7
    """sampling temperature, applied identically when the trainer scores the tokens (the paper: 1.0, which --recipe
    paper sets; the tiny model's samples make copy errors at 1.0 that its greedy decoding does not)"""
    max_new_tokens: int = 128
    """new tokens per agent turn (the paper: 1024)"""
    max_context: int = 1536
    """tokens per episode (the paper: 32k)"""
    lora_decode: str = "merged"
    """how the rollout decodes with adapters: 'merged' folds them into the frozen base for the rollout and restores
    the base bit for bit after it from a host copy (the base's kernels alone at each step; the merged weights rounded
    once to the compute dtype), 'unmerged' runs peft's adapter layers at every step"""


# ---------------------------------------------------------------------------------------------------------
# The step
# ---------------------------------------------------------------------------------------------------------
def grpo_step(run: pipeline.Run, step: int) -> tuple[dict | None, list[dict]]:
    """One step of the method (1-5 above). Returns (the step's metrics, the episodes lost to infrastructure); the
    metrics are None, and nothing trains, when every episode of the step was lost."""
    cfg, acc, t0 = run.cfg, run.acc, time.time()
    tasks = pipeline.step_tasks(run.tasks, cfg, step, acc.process_index, acc.num_processes)  # a resumed run's too
    gen = torch.Generator(acc.device).manual_seed(cfg.seed * 1_000_003 + step * 1_009 + acc.process_index)
    run.rng_at_step = models.rng_state()  # what a checkpoint of the last step holds, if this rollout is abandoned
    # 1-2. the batched twin of rollout.reference_rollout (which --rollout reference plays instead); one process
    # abandons its rollout at SIGTERM (preemption leaves ~30 s), several finish the step together
    with run.stop_signals.abandoning("SIGTERM", "SIGHUP"), pipeline.decoding(run) as policy:
        episodes = batched_rollout.rollout(policy, run.tok, run.env, tasks, cfg.group_size, run.user_sim,
                                           run.sampling, gen)
    t_roll, t1 = time.time() - t0, time.time()
    summaries = gather_object([metrics.episode_summary(e) for e in episodes])
    failed = [s for s in summaries if not s["valid"]]
    if len(failed) == len(summaries):
        return None, failed
    # 3-5.
    update = train_on_episodes(episodes, run.model, run.ref, run.opt, run.sched, acc, cfg, run.tok.pad_token_id)
    n_gen = shard.total(acc, sum(e.gen_tokens for e in episodes))[0]
    m = {"step": step + 1, **metrics.rollout_metrics(summaries, cfg.group_size), **update,
         "lr": run.sched.get_last_lr()[0], "rollout_s": t_roll, "update_s": time.time() - t1,
         "gen_tokens_per_s": n_gen / max(t_roll, 1e-9)}
    pipeline.log_step(run, step, m, episodes)
    return m, failed


def decide(episodes, cfg) -> tuple[torch.Tensor, list[int], int]:
    """What the algorithm decides before any forward pass: (each episode's advantage [B], the episodes that train,
    the groups dropped). Infra-failed episodes never train; with --drop-uniform-groups (DAPO's dynamic sampling,
    without resampling) neither do the groups whose rewards are all equal."""
    rewards = torch.tensor([ep.reward for ep in episodes], dtype=torch.float32)
    valid = torch.tensor([not ep.infra_failed for ep in episodes], dtype=torch.bool)
    adv = ADVANTAGES[cfg.advantage](rewards, cfg.group_size, valid, cfg.scale_advantages)
    train, dropped = valid.clone(), 0
    if cfg.drop_uniform_groups:
        uniform = uniform_groups(rewards, cfg.group_size, valid)
        dropped = int((uniform & valid).reshape(-1, cfg.group_size).any(1).sum())
        train &= ~uniform
    return adv, [i for i in range(len(episodes)) if train[i]], dropped


def train_on_episodes(episodes, model, ref_model, opt, sched, acc, cfg: Config, pad_id: int) -> dict:
    """One rollout batch -> `updates_per_batch` optimizer steps. Returns the update's metrics (over all processes)."""
    model.train()  # the rollout and the evaluation leave it in eval mode; gradient checkpointing needs train mode
    adv, rows, dropped = decide(episodes, cfg)
    masks = [episodes[i].loss_mask for i in rows]
    # One normalizer for the whole optimizer step, over all micro-batches and processes (docs/invariants.md, 3).
    normalizer, tokens, dropped = shard.total(acc, normalizer_count(masks, cfg.agg), sum(map(sum, masks)), dropped)
    out = {"dropped_groups": int(dropped), "trained_tokens": int(tokens), "skipped_updates": 0, "unshared_groups": 0}
    stats = metrics.Accumulator()
    if not normalizer:  # no process has a token to train on (every group dropped): no update this step
        return {**out, **stats.reduce(acc)}
    batches, unshared = micro_batches(episodes, rows, adv, cfg, acc, pad_id)
    out["unshared_groups"] = int(shard.total(acc, unshared)[0]) if cfg.share_opening else 0
    old, ref = [None] * len(batches), [None] * len(batches)
    every = lambda m: [micro_batch_logprobs(m, b, cfg.temperature, c) for b, c in zip(batches, group_carries(batches))]
    with torch.no_grad(), acc.autocast():
        if cfg.updates_per_batch > 1:  # the policy moves between updates: score the sampled tokens once first
            old = every(model)
        if ref_model is not None and cfg.kl_coef > 0:  # with LoRA the reference is the policy, its adapters off
            with lora.adapters_off(ref_model, enabled=cfg.lora_rank > 0):
                ref = every(ref_model)
            shard.free_gathered_weights(ref_model)  # sharded: no backward will reshard it
    norms = []
    for update in range(cfg.updates_per_batch):
        for k, (b, carry) in enumerate(zip(batches, group_carries(batches))):
            with shard.micro_batch(acc, model, last=k == len(batches) - 1):
                with acc.autocast():
                    logp, ent = micro_batch_logprobs(model, b, cfg.temperature, carry, return_entropy=True)
                if logp.dtype != torch.float32:  # e.g. an FSDP2 policy that casts outputs (cli.fsdp2_plugin)
                    raise RuntimeError(f"the policy's log-probs came as {logp.dtype}, not float32: rounded loss")
                # on-policy (one update per batch) the old policy is the current one: ratio 1, with its gradient
                old_logp = logp.detach() if old[k] is None else old[k]
                correct = CORRECTIONS[cfg.correction]
                loss, met = grpo_loss(logp, old_logp, ref[k], CREDIT[cfg.credit](b.advantages, b.turn, cfg),
                                      b.loss_mask, clip_low=cfg.clip_low, clip_high=cfg.clip_high,
                                      dual_clip=cfg.dual_clip, kl_coef=cfg.kl_coef, agg=cfg.agg,
                                      ratio_level=cfg.ratio_level, policy_loss=cfg.policy_loss, normalizer=normalizer,
                                      max_len=cfg.max_context, entropy=ent if update == 0 else None,
                                      weights=correct and correct(old_logp, b.sampler_logp, b.loss_mask.bool(), cfg))
                if ref[k] is None:
                    met.pop("kl")  # no reference, no KL: absent rather than a 0 that reads as a measurement
                # the backends average gradients over processes; the normalizer is already global: undo the mean
                shard.backward(acc, model, loss * acc.num_processes)
            n_tok = b.n_tokens
            if update == 0 and n_tok:  # sampler vs trainer on the same weights: should be ~0 (numerics only)
                met["logprob_gap"] = ((b.sampler_logp - logp.detach()).abs() * b.loss_mask).sum() / n_tok
            stats.add({**met, "loss": loss.detach() / cfg.updates_per_batch}, n_tok)
        # Clipped and stepped on every process, or skipped on every one when the norm is not finite, and counted.
        grad_norm, stepped = shard.optimizer_step(acc, model, opt, cfg.grad_clip)
        if stepped:
            sched.step()
            norms.append(float(grad_norm))
        else:
            out["skipped_updates"] += 1
    if norms:
        out["grad_norm"] = sum(norms) / len(norms)
    return {**out, **stats.reduce(acc)}


def main(argv=None):
    """The paper's pipeline, phase by phase. Ctrl-C, SIGTERM or SIGHUP save what finished and stop (rundir.stops)."""
    cli.cuda_allocator_defaults()  # before CUDA starts: expandable segments, unless the user set the allocator
    cfg, resume_from, changes = rundir.options(Config, argv, options.RECIPES)
    if rundir.finished(cfg, resume_from):  # nothing left to do, nothing rewritten
        return None
    with stopping.StopOnInterrupt("grpo") as stop, rundir.stops(cfg, stop):
        with stop.abandoning():  # loading and evaluating are left at once: nothing of them is worth saving
            run = pipeline.start(cfg, resume_from, changes)  # the Accelerator, the directory, environment, user
            if not cfg.init_from and cfg.model == "tiny":  # the paper's cold start, made (or found cached) here
                cfg.init_from = sft.cold_start(cfg.model, cfg.env, cfg.split, cfg.seed, cfg.bf16,
                                               cfg.cold_start_skips_confirm, cfg.cold_start_skips_ask,
                                               cfg.cold_start_skips_status)
            pipeline.load(run)                              # the policy, its optimizer, the reference, resumed state
            run.stop_signals = stop
            results = pipeline.evaluate(run, "before") if run.first_step == 0 else rundir.results_so_far(run)
        pipeline.train(run, grpo_step)                        # the GRPO steps, checkpoints
        with stop.abandoning():
            results.update(pipeline.evaluate(run, "after"))
        pipeline.write(run, results)
    return SimpleNamespace(run_dir=run.dir, model=run.acc.unwrap_model(run.model), results=results)


if __name__ == "__main__":
    main()
