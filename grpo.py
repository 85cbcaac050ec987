"""grpo.py: the pipeline. The paper's whole recipe, run by `main()` under Accelerate:

    ./run accelerate launch grpo.py                  # the embedded CPU default (shop domain, tiny model)
    ./run accelerate launch grpo.py --recipe paper --init-from runs/sft-qwen3-8b

  1. cold start: with --model tiny and no --init-from, conversations of the scripted teacher (made imperfect by
     --cold-start-skips-confirm) then SFT (sft.py; cached)
  2. greedy pass^1 on --eval-tasks test tasks (eval.py's summary)
  3. each step: G episodes of each of the step's tasks (rollout.py), their group advantages, one or more
     GRPO updates (train_on_episodes, with the math of loss.py), metrics to JSONL, a checkpoint now and then
  4. greedy pass^1 again, summary.json and curves.png

The math lives in loss.py and is re-exported here: `from grpo import group_advantages, kl_k3, grpo_loss,
token_logprobs` is the API forks and tests use. This module sits on top: it may import sft.py and eval.py,
never the reverse (tests/test_layout.py).
"""

import inspect
import json
import random
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from types import SimpleNamespace

import torch

import checkpoints
import cli
import lora
import metrics
import muarl
import shard
from loss import (AGGS, DEFAULT_CHUNK_SIZE, LOG_RATIO_CLAMP, RATIO_LEVELS, group_advantages, grpo_loss,  # noqa: F401
                  kl_k3, logprobs_from_hidden, masked_token_entropy, token_logprobs, uniform_groups)
from metrics import episode_summary, reward_checks  # noqa: F401  (re-exported)
from metrics import rollout_metrics as step_metrics  # noqa: F401

@dataclass
class Config:
    """GRPO with a simulated user. Defaults: the paper's algorithm settings at a CPU-sized scale (the small
    'shop' domain, the 'tiny' model, a scripted user); `--recipe paper` gives the paper's GPU recipe."""

    model: str = "tiny"
    """policy to start from: 'tiny', 'smollm2-135m', a checkpoint directory or a hub id (Qwen/Qwen3-8B)"""
    init_from: str = ""
    """cold-start (SFT) checkpoint to start from; with --model tiny and none given, one is made and cached"""
    cold_start_skips_confirm: float = 0.6
    """the cold start made when no --init-from is given: share of the scripted teacher's write conversations in which
    it writes without asking the user first (sft.py --teacher-skips-confirm), a decision the reward settles"""
    env: str = "shop"
    """environment: 'shop' (small domain; 'shop:static': its user says everything at once and never changes its
    mind) or 'tau2:<retail|airline|telecom|mock>'"""
    split: str = "train"
    """task split trained on"""
    env_reward: str = ""
    """tau2 only: 'db' for the paper's training simplification (database check only); '' for tau2's full reward"""
    user_sim: str = "scripted"
    """user simulator: 'scripted' (rule-based, per environment), 'openai' (any OpenAI-compatible endpoint), 'hf'"""
    user_model: str = "gpt-4o"
    """user simulator model: the endpoint's model name ('openai') or a checkpoint/hub id ('hf')"""
    user_base_url: str = ""
    """OpenAI-compatible endpoint of the user simulator (default: OPENAI_BASE_URL); key from OPENAI_API_KEY"""
    user_concurrency: int = 64
    """requests in flight to the user-simulator endpoint"""
    user_timeout: float = 60.0
    """seconds the user simulator's endpoint has to answer one request before it is retried"""
    user_retries: int = 5
    """retries of a failed user-simulator request (timeouts, connection errors, 408/409/429, 5xx, malformed replies),
    with backoff 1, 2, 4, ... s; then the episode ends as infra_error. A call costs at most
    (retries + 1) x timeout + the backoff (~6.5 minutes with the defaults)"""
    steps: int = 40
    """optimizer steps (each: rollout, rewards, advantages, update)"""
    tasks_per_step: int = 4
    """tasks per step over all processes (the paper: 32); each process rolls out an equal share"""
    group_size: int = 8
    """episodes per task, G (the paper: 8)"""
    lr: float = 2e-4
    """learning rate, constant after warm-up (the paper: 1e-6 for Qwen3; the tiny model needs more)"""
    warmup_steps: int = 0
    """linear warm-up steps"""
    kl_coef: float = 0.001
    """coefficient of the k3 KL to the frozen reference, as a loss term (the paper: 0.001; 0 drops the reference)"""
    clip_low: float = 0.2
    """ratio clipped below at 1 - clip_low"""
    clip_high: float = 0.2
    """ratio clipped above at 1 + clip_high"""
    dual_clip: float = 3.0
    """dual-clip constant for negative advantages (the paper: 3.0; 0 disables)"""
    agg: str = "token-mean"
    """loss aggregation: token-mean (the paper), seq-mean-token-mean (original GRPO), seq-mean-token-sum-norm
    (Dr. GRPO)"""
    scale_advantages: bool = True
    """divide advantages by the group std (the paper); off: r - mean (Dr. GRPO)"""
    advantage: str = "grpo"
    """advantage estimator, by name in grpo.ADVANTAGES: 'grpo' (group-normalized, the paper)"""
    drop_uniform_groups: bool = False
    """leave out of the update the groups whose rewards are all equal (zero advantage), as DAPO's dynamic sampling
    does (without its resampling: the step is smaller); counted as dropped_groups"""
    ratio_level: str = "token"
    """importance ratio: 'token' (PPO/GRPO, the paper) or 'sequence' (GSPO: each episode's geometric-mean ratio,
    clipped as one; use with --agg seq-mean-token-mean and GSPO's clip ranges, e.g. 3e-4 / 4e-4). It differs from
    'token' only off-policy, i.e. with --updates-per-batch > 1: with one update the ratio is 1 either way"""
    updates_per_batch: int = 1
    """policy updates per rollout batch (the paper: 1, so old logprobs are the current ones and cost nothing)"""
    micro_batch_size: int = 4
    """episodes per forward/backward pass on one process (gradient accumulation covers the rest)"""
    grad_clip: float = 1.0
    """gradient-norm clip (the paper: 1.0)"""
    temperature: float = 0.7
    """sampling temperature, applied identically when the trainer scores the tokens (the paper: 1.0, which --recipe
    paper sets; the tiny model's samples make copy errors at 1.0 that its greedy decoding does not)"""
    top_p: float = 1.0
    """nucleus sampling (1.0: off)"""
    max_turns: int = 30
    """agent turns per episode (the paper: 30)"""
    max_new_tokens: int = 128
    """new tokens per agent turn (the paper: 1024)"""
    max_context: int = 1536
    """tokens per episode (the paper: 32k)"""
    reuse_cache: bool = True
    """keep the KV cache across turns (off: re-encode the conversation every turn; same tokens, slower)"""
    rollout_batch: int = 0
    """at most this many episodes decode together on one process (0: all); bounds GPU memory: on a GPU the other
    episodes' KV caches wait in host memory"""
    bf16: bool = False
    """bf16 mixed precision (GPU)"""
    optimizer: str = "adamw"
    """'adamw' (the paper) or 'sgd' (plain SGD: its --lr is on another scale, ~0.1-1 for the tiny model)"""
    freeze: str = ""
    """regular expression: parameters whose name it matches are not trained (e.g. 'embed_tokens': the embeddings,
    and with them a tied output layer); '' trains all"""
    lora_rank: int = 0
    """LoRA: train adapters of this rank on --lora-target-modules, the start model frozen in the compute dtype (bf16
    with --bf16); the reference is then the policy with its adapters switched off, no second copy (lora.py). 0: train
    the whole model"""
    lora_alpha: float = 0.0
    """LoRA scale: an adapter's output is multiplied by alpha / rank (0: alpha = 2 x rank)"""
    lora_dropout: float = 0.0
    """dropout on the adapters' inputs while training (not while sampling: above 0 the trainer's log-probs differ
    from the sampler's, and logprob_gap shows it)"""
    lora_target_modules: str = lora.DEFAULT_TARGETS
    """layers that get adapters, by the last part of their name, comma-separated (the default: the attention and MLP
    projections of Llama/Qwen-style models; not the output layer, whose weight the trainer reads directly)"""
    gradient_checkpointing: bool = False
    """recompute activations in the backward pass (long contexts)"""
    seed: int = 0
    """seed of task order, sampling and initialization"""
    out_dir: str = ""
    """run directory (default: runs/grpo-<env>-<time>); one that already holds a run is refused unless --resume or
    --overwrite"""
    overwrite: bool = False
    """replace the run already in --out-dir: its config, logs, checkpoints and summary are removed (nothing else)"""
    save_every: int = 20
    """steps between checkpoints (the last step is always saved)"""
    keep_checkpoints: int = 0
    """keep only the newest N checkpoints of the run (0: keep all); the one `latest` names is never removed"""
    save_weights_only: bool = False
    """checkpoints hold the model and tokenizer only: no optimizer, scheduler or RNG state (a quarter of the size
    with AdamW in fp32), so they start new runs (--init-from) but cannot be resumed"""
    resume: str = ""
    """run directory or checkpoint to continue from exactly (weights, optimizer, scheduler, RNG, data position)"""
    report_to: str = ""
    """also log to Accelerate trackers: 'tensorboard', 'wandb', ... (JSONL is always written)"""
    log_episodes: int = 4
    """episodes per step saved as readable conversations (episodes.jsonl)"""
    eval_tasks: int = 64
    """test-split tasks evaluated (greedy, pass^1) before and after training; 0 skips"""
    dist_timeout: float = 7200.0
    """seconds a process waits for the others at a collective before the run stops, naming this option (NCCL's
    default is 10 minutes; a process's rollout can wait far longer on a slow user endpoint, or the others on a large
    checkpoint being written)"""
    memory_check: bool = True
    """on a GPU, stop at start when the estimated memory per GPU (printed) exceeds it; its KV-cache term assumes
    every episode reaches --max-context, a worst case"""


RECIPES = {
    # The paper's recipe (its RL settings and released training script): Qwen3 non-thinking, a GPT-4o user, 32 tasks
    # x 8 per step, lr 1e-6.
    # Needs a cold-start checkpoint: --init-from runs/sft-qwen3 (see sft.py).
    "paper": dict(model="Qwen/Qwen3-8B", env="tau2:retail", env_reward="db", user_sim="openai", user_model="gpt-4o",
                  tasks_per_step=32, group_size=8, lr=1e-6, max_new_tokens=1024, max_context=32768,
                  micro_batch_size=1, bf16=True, gradient_checkpointing=True, steps=200, eval_tasks=0,
                  save_every=10, keep_checkpoints=2, temperature=1.0,
                  # 8 episodes decode at once, the rest park their caches in host memory: a worst-case KV cache of
                  # 39 GB per GPU for Qwen3-8B at 32k (all 32 of a process's episodes: 155 GB; shard.memory_estimate)
                  rollout_batch=8),
}


# What --resume lets a user change: how the run reaches its user simulator and how it reports and saves; none of it
# changes the algorithm. A dead endpoint can be replaced on resume, under another model name if the new server
# serves the user so (a --user-model that names another model changes the user itself: your call, recorded in
# resumes.jsonl). Anything else continues with the run's saved settings; giving another value is refused.
RESUMABLE = ("steps", "user_base_url", "user_model", "user_concurrency", "user_timeout", "user_retries",
             "report_to", "log_episodes", "save_every", "keep_checkpoints", "memory_check", "dist_timeout")


def validate(cfg: Config, world: int) -> None:
    """Fail at start with a message naming the option."""
    def bad(opt, why):
        raise SystemExit(f"grpo.py: --{opt.replace('_', '-')}: {why}")
    if cfg.optimizer not in ("adamw", "sgd"):
        bad("optimizer", f"{cfg.optimizer!r} is not 'adamw' or 'sgd'")
    if cfg.agg not in AGGS:
        bad("agg", f"{cfg.agg!r} is not one of {sorted(AGGS)}")
    if cfg.ratio_level == "sequence" and cfg.updates_per_batch == 1:
        cli.main_print("[grpo] warning: --ratio-level sequence with --updates-per-batch 1: on-policy the ratio is 1 "
                       "for every token and GSPO's update equals GRPO's with --agg seq-mean-token-mean")
    if cfg.advantage not in ADVANTAGES:
        bad("advantage", f"{cfg.advantage!r} is not one of {sorted(ADVANTAGES)}")
    try:  # the loss's own checks of its options (a fork's new option included), on a one-token batch
        z = torch.zeros(1, 1)
        grpo_loss(z, z, z, torch.zeros(1), torch.ones(1, 1), max_len=1, **loss_options(cfg))
    except ValueError as e:
        name = str(e).split()[0]
        bad(name if hasattr(cfg, name) else "loss option", str(e))
    if cfg.user_sim not in ("scripted", "openai", "hf"):
        bad("user_sim", f"{cfg.user_sim!r} is not one of scripted, openai, hf")
    if cfg.group_size < 2:
        bad("group_size", "group advantages need at least 2 episodes per task")
    if cfg.tasks_per_step < 1 or cfg.tasks_per_step % world:
        bad("tasks_per_step", f"{cfg.tasks_per_step} must be a positive multiple of the {world} processes")
    for opt in ("steps", "micro_batch_size", "updates_per_batch", "max_turns", "max_new_tokens", "max_context",
                "save_every"):
        if getattr(cfg, opt) < 1:
            bad(opt, "must be >= 1")
    for opt in ("warmup_steps", "eval_tasks", "log_episodes", "rollout_batch", "kl_coef", "grad_clip",
                "keep_checkpoints", "user_retries"):
        if getattr(cfg, opt) < 0:
            bad(opt, "must be >= 0")
    for opt in ("clip_low", "clip_high"):
        if not 0 < getattr(cfg, opt) < 1:
            bad(opt, "must be in (0, 1)")
    if cfg.dual_clip and cfg.dual_clip <= 1:
        bad("dual_clip", "must be > 1 (or 0 to disable)")
    if not cfg.user_timeout > 0:
        bad("user_timeout", "must be > 0 seconds")
    if not cfg.dist_timeout > 0:
        bad("dist_timeout", "must be > 0 seconds")
    if not cfg.temperature > 0:
        bad("temperature", "must be > 0")
    if not 0 < cfg.top_p <= 1:
        bad("top_p", "must be in (0, 1]")
    if cfg.lr <= 0:
        bad("lr", "must be > 0")
    if not 0 <= cfg.cold_start_skips_confirm <= 1:
        bad("cold_start_skips_confirm", "must be in [0, 1]")
    if cfg.model == "tiny" and not cfg.init_from and not cfg.resume and cfg.env.split(":")[0] != "shop":
        bad("env", f"{cfg.env!r} with the 'tiny' model needs a cold-start checkpoint (--init-from): the embedded cold "
                   "start and the tiny base are made on 'shop' only")
    lora.check_options(cfg, "grpo.py")
    if cfg.lora_rank and cfg.freeze:
        bad("freeze", "with --lora-rank only the adapters train already; drop --freeze")
    if cfg.bf16 and not torch.cuda.is_available():
        bad("bf16", "needs a GPU (on this CPU bf16 decoding was measured slower; see bench/dtype.py)")


def step_tasks(tasks: list, cfg: Config, step: int, rank: int, world: int) -> list:
    """This process's share of the step's tasks. The order is a seeded permutation per epoch, so the data
    position is a function of the step alone and a resumed run sees the same tasks."""
    out, n = [], len(tasks)
    for k in range(step * cfg.tasks_per_step, (step + 1) * cfg.tasks_per_step):
        epoch, i = divmod(k, n)
        perm = list(range(n))
        random.Random(cfg.seed * 1_000_003 + epoch).shuffle(perm)
        out.append(tasks[perm[i]])
    return out[rank::world]  # whole groups per process: group statistics never cross processes


def load_reference(start: str, device, seed: int = 0, attn_implementation=None):
    """The frozen reference: a copy of the starting policy in the policy's own precision path, fp32 weights scored
    under the same autocast (train_on_episodes), so that `kl` is 0 up to rounding until the policy moves. A bf16
    copy is not the same function: its embeddings, norms and residual stream run in bf16 where the policy's run in
    fp32 under autocast, and kl was not 0 at step 1. Cost: 4 bytes a parameter instead of 2 (no gradients, no
    optimizer state)."""
    ref, _ = muarl.load_model(start, device=device, seed=seed, dtype=torch.float32,
                              attn_implementation=attn_implementation, merge_adapters=True)
    return ref.eval().requires_grad_(False)


def freeze(model, pattern: str) -> int:
    """Stop training the parameters whose name matches `pattern` (re.search); returns how many values that froze."""
    import re

    try:
        rx = re.compile(pattern)
    except re.error as e:
        raise SystemExit(f"grpo.py: --freeze: {pattern!r} is not a regular expression ({e})")
    hit = [p for name, p in model.named_parameters() if rx.search(name)]
    if not hit:
        names = ", ".join(n for n, _ in list(model.named_parameters())[:6])
        raise SystemExit(f"grpo.py: --freeze: {pattern!r} matches no parameter name (they look like: {names}, ...)")
    for p in hit:
        p.requires_grad_(False)
    return sum(p.numel() for p in hit)


# =========================================================================================================
# The training step. What the algorithm decides (advantages, which episodes train, the loss of each micro-batch,
# one normalizer) is here; how a backend runs micro-batches and steps, and what every process must do in lockstep,
# is shard.py's; the metrics and their names are metrics.py's.
# =========================================================================================================
# Advantage estimators by name (--advantage): the step's rewards [B] in consecutive groups of G and which episodes
# count (valid [B]) -> one advantage per episode. A fork adds its own here (RLOO: r minus the mean of the others).
ADVANTAGES = {
    "grpo": lambda rewards, valid, cfg: group_advantages(rewards, cfg.group_size, scale=cfg.scale_advantages,
                                                         valid=valid),
}


def loss_options(cfg) -> dict:
    """The Config fields named like a keyword option of loss.grpo_loss (clip_low, clip_high, dual_clip, kl_coef, agg,
    ratio_level): a loss variant's option reaches the loss by being both, with no call site to edit."""
    params = inspect.signature(grpo_loss).parameters
    return {k: getattr(cfg, k) for k, p in params.items() if p.kind is p.KEYWORD_ONLY and hasattr(cfg, k)}


def decide(episodes, cfg) -> tuple[torch.Tensor, list[int], int]:
    """What the algorithm decides before any forward pass: (each episode's advantage [B], the episodes that train,
    the groups dropped). Infra-failed episodes never train; with --drop-uniform-groups (DAPO's dynamic sampling,
    without resampling) neither do the groups whose rewards are all equal."""
    rewards = torch.tensor([ep.reward for ep in episodes], dtype=torch.float32)
    valid = torch.tensor([not ep.infra_failed for ep in episodes], dtype=torch.bool)
    adv = ADVANTAGES[cfg.advantage](rewards, valid, cfg)
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
    seqs = [(episodes[i].input_ids, episodes[i].loss_mask) for i in rows]
    local = sum(sum(m) for _, m in seqs) if cfg.agg == "token-mean" else sum(1 for _, m in seqs if any(m))
    # One normalizer for the whole optimizer step, over all micro-batches and processes (docs/invariants.md, 3).
    normalizer, tokens, dropped = shard.total(acc, local, sum(sum(m) for _, m in seqs), dropped)
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i][0]))  # similar lengths share a micro-batch
    micro = [order[i:i + cfg.micro_batch_size] for i in range(0, len(order), cfg.micro_batch_size)]
    micro += [[] for _ in range(shard.lockstep_count(acc, len(micro)) - len(micro))]  # empty ones keep step
    out = {"dropped_groups": int(dropped), "trained_tokens": int(tokens), "skipped_updates": 0}
    stats, options = metrics.Accumulator(), loss_options(cfg)
    if not normalizer:  # no process has a token to train on (every group dropped): no update this step
        return {**out, **stats.reduce(acc)}

    def batch(mb):  # (input_ids, attention_mask, loss_mask, sampler logprobs, advantages); empty: one pad token
        if not mb:
            ids, attn, mask = muarl.collate([([pad_id], [0])], pad_id, acc.device)
            return ids, attn, mask, mask.float(), torch.zeros(1, device=acc.device)
        sampled = [(seqs[i][0], episodes[rows[i]].logprobs) for i in mb]
        return (*muarl.collate([seqs[i] for i in mb], pad_id, acc.device),
                muarl.collate(sampled, 0, acc.device)[2], adv[[rows[i] for i in mb]].to(acc.device))
    batches = [batch(mb) for mb in micro]
    old = []
    if cfg.updates_per_batch > 1:  # the policy moves between updates: score the sampled tokens once first
        with torch.no_grad(), acc.autocast():
            old = [token_logprobs(model, b[0], b[1], temperature=cfg.temperature) for b in batches]
    ref = [None] * len(batches)
    if ref_model is not None and cfg.kl_coef > 0:
        # The policy's precision path (load_reference); with LoRA the reference is the policy, its adapters off.
        with torch.no_grad(), acc.autocast(), lora.adapters_off(ref_model, enabled=cfg.lora_rank > 0):
            ref = [token_logprobs(ref_model, b[0], b[1], temperature=cfg.temperature) for b in batches]
        if shard.is_sharded(ref_model):  # no backward will reshard its root: free the gathered weights now
            ref_model.reshard()
    norms = []
    for update in range(cfg.updates_per_batch):
        for k, (ids, attn, mask, sampler, a) in enumerate(batches):
            # DDP reduces on the last micro-batch only, FSDP2 every one, DeepSpeed's engine is told its boundary.
            with shard.micro_batch(acc, model, last=k == len(batches) - 1):
                with acc.autocast():
                    logp, ent = token_logprobs(model, ids, attn, temperature=cfg.temperature, return_entropy=True)
                if logp.dtype != torch.float32:  # e.g. an FSDP2 policy that casts outputs (cli.fsdp2_plugin)
                    raise RuntimeError(f"token_logprobs returned {logp.dtype}, not float32: the loss would be rounded")
                loss, met = grpo_loss(logp, old[k] if old else logp.detach(), ref[k], a, mask, normalizer=normalizer,
                                      max_len=cfg.max_context, **options)
                if ref[k] is None:
                    met.pop("kl")  # no reference, no KL: absent rather than a 0 that reads as a measurement
                # DDP, FSDP2 and DeepSpeed average gradients over processes; the normalizer is already global, so
                # undo the mean.
                shard.backward(acc, model, loss * acc.num_processes)
            n_tok = float(mask.sum())
            if update == 0 and n_tok:  # sampler vs trainer on the same weights: should be ~0 (numerics only)
                met["entropy"] = (ent * mask).sum() / n_tok
                met["logprob_gap"] = ((sampler - logp.detach()).abs() * mask).sum() / n_tok
            stats.add({**met, "loss": loss.detach() / cfg.updates_per_batch}, n_tok)
        # Clipped and stepped on every process, or dropped on every one when the norm is not finite, and counted.
        grad_norm, stepped = shard.optimizer_step(acc, model, opt, cfg.grad_clip)
        if stepped:
            sched.step()
            norms.append(float(grad_norm))
        else:
            out["skipped_updates"] += 1
    if norms:
        out["grad_norm"] = sum(norms) / len(norms)
    return {**out, **stats.reduce(acc)}


# =========================================================================================================
# The pipeline: set up, cold start, evaluate, train, evaluate, write
# =========================================================================================================
def options(argv) -> tuple[Config, Path | None, dict]:
    """The run's settings: the command line, or with --resume the run's saved settings and the few that may change
    (RESUMABLE). Returns (config, the checkpoint to resume from, what the resume changes: name -> [old, new])."""
    given = set()
    cfg = cli.parse_config(Config, argv, recipes=RECIPES, description=__doc__.split("\n\n")[0], given=given)
    if not cfg.resume:
        return cfg, None, {}
    resume_from = checkpoints.find(cfg.resume)
    saved, changes = checkpoints.resume_settings(resume_from, cfg, given, RESUMABLE)
    return Config(**{**saved, "resume": cfg.resume, "overwrite": False}), resume_from, changes


def set_up(cfg: Config, resume_from: Path | None, changes: dict) -> SimpleNamespace:
    """Everything a run needs, loaded and checked: the Accelerator, the run directory, the environment and its user,
    the policy (after the cold start, for tiny) with its optimizer, the frozen reference, the resumed state."""
    from envs import make_env
    from rollout import RolloutConfig, check_max_context, make_user_sim, user_sim_options

    acc = cli.make_accelerator(cfg.dist_timeout, mixed_precision="bf16" if cfg.bf16 else "no",
                               log_with=cfg.report_to or None)
    validate(cfg, acc.num_processes)
    shard.check_accelerator(acc)
    if cfg.lora_rank:
        lora.check_backend(acc)
    muarl.seed_everything(cfg.seed)
    run_dir = resume_from.parents[1] if resume_from else Path(
        cfg.out_dir or f"runs/grpo-{cfg.env.replace(':', '-')}-{time.strftime('%Y%m%d-%H%M%S')}")
    # An existing run is refused now unless --resume or --overwrite; nothing is removed until the run has loaded.
    run_dir = checkpoints.claim(acc, run_dir, resuming=resume_from is not None, overwrite=cfg.overwrite)
    if cfg.lora_rank and cfg.overwrite:  # the adapters' checkpoints need their base where it is
        lora.check_base_kept(cfg.init_from or cfg.model, run_dir, "grpo.py: --overwrite")
    cfg.out_dir = str(run_dir)
    if cfg.report_to:
        acc.init_trackers(run_dir.name, config=asdict(cfg))
    env = make_env(cfg.env, **({"reward": cfg.env_reward} if cfg.env_reward else {}))
    tasks = env.tasks(cfg.split)
    user_sim = make_user_sim(cfg.user_sim, **user_sim_options(cfg))
    if cfg.user_sim == "scripted":  # fail now, not after the model has loaded
        try:
            env.scripted_user(tasks[0])
        except NotImplementedError:
            raise SystemExit(f"grpo.py: --user-sim: {cfg.env} has no scripted user; use --user-sim openai or hf")
    if not cfg.init_from and cfg.model == "tiny":  # the paper's cold start, made here for the tiny model
        import sft  # here: importing grpo for the loss math loads no training stack

        cfg.init_from = sft.cold_start(cfg.model, cfg.env, cfg.split, cfg.seed, cfg.bf16, cfg.cold_start_skips_confirm)
    run = SimpleNamespace(cfg=cfg, acc=acc, dir=run_dir, env=env, tasks=tasks, user_sim=user_sim,
                          resume_from=resume_from)
    load_policy(run)
    check_max_context(run.tok, env, tasks, cfg.max_context)
    run.first_step = checkpoints.load(acc, resume_from, cfg.tasks_per_step) if resume_from else 0
    if resume_from:
        acc.print(f"[grpo] resumed from {resume_from} at step {run.first_step}")
    # Once everything has loaded: a run that fails to start leaves the directory as it was.
    checkpoints.open_run(acc, run_dir, asdict(cfg), run.first_step if resume_from else None, changes, cfg.overwrite)
    run.sampling = RolloutConfig(temperature=cfg.temperature, top_p=cfg.top_p, max_new_tokens=cfg.max_new_tokens,
                                 max_context=cfg.max_context, max_turns=cfg.max_turns, reuse_cache=cfg.reuse_cache,
                                 max_batch=cfg.rollout_batch,
                                 park_device="cpu" if cfg.rollout_batch and acc.device.type != "cpu" else "")
    return run


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
        muarl.check_local(start)

    def check_memory(config):
        from rollout import RolloutConfig

        per_process = cfg.tasks_per_step // acc.num_processes * cfg.group_size
        live = max(per_process, -(-cfg.eval_tasks // acc.num_processes))
        decoding = min(live, cfg.rollout_batch or live)
        adapters = 0
        if cfg.lora_rank:  # a target that matches nothing stops here, before the weights load
            shapes = shard.meta_model(config)
            lora.check_targets(shapes, cfg.lora_target_modules, "grpo.py")
            adapters = lora.adapter_params(shapes, cfg.lora_rank, cfg.lora_target_modules)
        shard.check_memory(config, world=acc.num_processes, sharded=shard.shards_weights(acc),
                           bf16=cfg.bf16, reference=cfg.kl_coef > 0 and not cfg.lora_rank,
                           max_context=cfg.max_context, episodes=decoding,
                           parked=live - decoding if acc.device.type != "cpu" else 0, device=acc.device,
                           check=cfg.memory_check, prefill_tokens=RolloutConfig.prefill_tokens, lora=adapters)
    # Before loading, when the start names a config (a directory, a hub id, adapters on one of those)
    config = shard.read_config(lora.base_chain(start)[-1])
    if config is not None:
        check_memory(config)
    adapter_start = lora.is_adapter_dir(start)
    if adapter_start and shard.is_zero3_plugin(acc):
        raise SystemExit(f"grpo.py: --init-from {start} holds adapters, which ZeRO-3 cannot merge into a base it "
                         "partitions as it loads: merge them first (eval.py --agent CHECKPOINT --merge-lora OUT) and "
                         "start from OUT")
    # flash-attn only where the forward runs in bf16 (--bf16's autocast): it refuses fp32 inputs
    load_on = shard.load_device(acc)
    compute = torch.bfloat16 if cfg.bf16 else torch.float32
    attn = muarl.attention_implementation(acc.device, compute)
    with load_errors:
        model, run.tok = muarl.load_model(start, device=load_on, seed=cfg.seed, attn_implementation=attn,
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
        run.ref = load_reference(start, load_on, cfg.seed, attn) if cfg.kl_coef > 0 else None
        if run.ref is not None and shard.is_sharded(run.model):
            shard.shard_like(run.ref, run.model, param_dtype=torch.bfloat16 if cfg.bf16 else None)
        elif run.ref is not None and shard.is_deepspeed(run.model):
            run.ref = shard.deepspeed_reference(run.ref, acc.state.deepspeed_plugin.deepspeed_config)
    acc.register_for_checkpointing(run.sched)


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


def play(run, tasks: list, group_size: int, sampling, generator=None) -> list:
    """This process's episodes of `tasks` with the current policy (its full weights gathered once when sharded)."""
    from rollout import rollout

    with shard.full_weights(run.model, run.acc.device), run.acc.autocast():
        return rollout(run.acc.unwrap_model(run.model), run.tok, run.env, tasks, group_size, run.user_sim, sampling,
                       generator)


def evaluate(run, tag: str) -> dict:
    """Greedy pass^1 on the first --eval-tasks test tasks (eval.py's summary); eval-<tag>.jsonl holds the episodes."""
    from accelerate.utils import gather_object

    from eval import summarize

    cfg, acc = run.cfg, run.acc
    if not cfg.eval_tasks:
        return {}
    test = run.env.tasks("test")[:cfg.eval_tasks]
    eps = play(run, test[acc.process_index::acc.num_processes], 1, replace(run.sampling, greedy=True))
    eps = gather_object([e.to_json() for e in eps])
    s = summarize(eps, 1, {t.id: t.meta for t in test})
    if acc.is_main_process:
        with open(run.dir / f"eval-{tag}.jsonl", "w") as f:
            f.writelines(json.dumps(e, ensure_ascii=False, default=str) + "\n" for e in eps)
    if not s["scored"]:
        first = next((e["reward_info"].get("error") for e in eps if e.get("reward_info")), None)
        acc.print(f"[grpo] eval ({tag}): none of the {len(eps)} episodes was scored (all failed on infrastructure; "
                  f"the first error: {first})")
        return {f"eval/{tag}/pass1": None, f"eval/{tag}/tasks": s["tasks"]}
    kinds = "; ".join(f"{k}: " + ", ".join(f"{v} {r['pass^1']:.2f}" for v, r in vs.items())
                      for k, vs in list(s.get("by_meta", {}).items())[:2])
    acc.print(f"[grpo] eval ({tag}) on {s['tasks']} test tasks, greedy: pass^1 = {s['pass^1']:.3f}"
              + (f" ({kinds})" if kinds else ""))
    return {f"eval/{tag}/pass1": s["pass^1"], f"eval/{tag}/tasks": s["tasks"],
            f"eval/{tag}/by_meta": s.get("by_meta", {})}


def train(run) -> None:
    """The GRPO loop from the run's first step: roll out, update, log, save. A step where every episode failed on
    infrastructure stops the run; Ctrl-C stops it after the step (both say how to continue)."""
    from tqdm.auto import tqdm

    cfg, acc = run.cfg, run.acc
    bar = tqdm(range(run.first_step, cfg.steps), initial=run.first_step, total=cfg.steps,
               disable=not acc.is_main_process, desc="grpo", dynamic_ncols=True)
    resume_hint = f"accelerate launch grpo.py --resume {run.dir}"
    saved, step = run.first_step, run.first_step  # the newest checkpoint's step; the step in progress
    try:
        with cli.StopOnInterrupt("grpo") as ctrl_c:
            for step in bar:
                m, failed = grpo_step(run, step)
                if m is None:  # stop, loudly, rather than train on nothing step after step
                    if step > saved:
                        checkpoints.save(acc, run.model, run.tok, cfg, run.dir, step)
                    then = (f"then continue with {resume_hint} (the user-simulator options may change on --resume)"
                            if step else f"then start again (--overwrite {run.dir})")
                    acc.end_training()
                    raise SystemExit(f"grpo.py: step {step + 1}: all {len(failed)} episodes failed on infrastructure, "
                                     f"so there is nothing to train on; the first error: {failed[0]['error']}\nFix "
                                     f"it, {then}.")
                if acc.is_main_process:
                    bar.set_postfix(reward=f"{m.get('reward_mean', 0):.3f}", kl=f"{m.get('kl', 0):.4f}")
                    tqdm.write(metrics.console_line(m, failed, m["rollout_s"], m["update_s"]))
                stop = ctrl_c.agreed(acc)  # every process stops after the same step
                if (step + 1) % cfg.save_every == 0 or step + 1 == cfg.steps or stop:
                    checkpoints.save(acc, run.model, run.tok, cfg, run.dir, step + 1)
                    saved = step + 1
                if stop and step + 1 < cfg.steps:
                    bar.close()
                    acc.end_training()
                    acc.print(f"[grpo] stopped by Ctrl-C after step {step + 1} of {cfg.steps}, checkpoint saved; "
                              f"continue with: {resume_hint}")
                    raise SystemExit(130)
    except KeyboardInterrupt:  # the second Ctrl-C: stop at once; the step in progress is lost
        bar.close()
        where = (f"the newest checkpoint is step {saved}; continue with: {resume_hint}" if saved else
                 f"no checkpoint was written; start again with --overwrite {run.dir}")
        acc.print(f"\n[grpo] interrupted during step {step + 1}: {where}")
        acc.end_training()
        raise SystemExit(130) from None


def grpo_step(run, step: int) -> tuple[dict | None, list[dict]]:
    """One step: G episodes of each of this process's tasks, the update, the metrics logged (metrics.jsonl,
    episodes.jsonl, trackers). Returns (the metrics, the episodes that failed on infrastructure); the metrics are
    None, and nothing is trained, when every episode of the step failed."""
    from accelerate.utils import gather_object

    cfg, acc = run.cfg, run.acc
    t0 = time.time()
    # Sampling seeded by (run seed, step, process): a resumed run draws exactly what it would have drawn.
    gen = torch.Generator(acc.device).manual_seed(cfg.seed * 1_000_003 + step * 1_009 + acc.process_index)
    episodes = play(run, step_tasks(run.tasks, cfg, step, acc.process_index, acc.num_processes), cfg.group_size,
                    run.sampling, gen)
    t_roll, t1 = time.time() - t0, time.time()
    summaries = gather_object([metrics.episode_summary(e) for e in episodes])
    failed = [s for s in summaries if not s["valid"]]
    if len(failed) == len(summaries):
        return None, failed
    update = train_on_episodes(episodes, run.model, run.ref, run.opt, run.sched, acc, cfg, run.tok.pad_token_id)
    n_gen = shard.total(acc, sum(e.gen_tokens for e in episodes))[0]
    m = {"step": step + 1, **metrics.rollout_metrics(summaries, cfg.group_size), **update,
         "lr": run.sched.get_last_lr()[0], "rollout_s": t_roll, "update_s": time.time() - t1,
         "gen_tokens_per_s": n_gen / max(t_roll, 1e-9)}
    samples = gather_object([e.to_json() for e in episodes[:max(0, cfg.log_episodes)]])
    if acc.is_main_process:
        with open(run.dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(m) + "\n")
        with open(run.dir / "episodes.jsonl", "a") as f:
            for s in samples[:cfg.log_episodes]:
                f.write(json.dumps({"step": step + 1, **s}, ensure_ascii=False) + "\n")
    if cfg.report_to:
        acc.log(m, step=step + 1)
    return m, failed


def write(run, results: dict) -> None:
    """summary.json and the learning curves (curves.png: `python eval.py --plot RUN_DIR` draws them again)."""
    from eval import plot_run

    if run.acc.is_main_process:
        cli.write_json_atomic(run.dir / "summary.json", {"steps": run.cfg.steps, **results})
        if (run.dir / "metrics.jsonl").exists():
            plot_run(run.dir)
    run.acc.end_training()
    run.acc.print(f"[grpo] done. Run directory: {run.dir} (metrics.jsonl, curves.png, episodes.jsonl, checkpoints/, "
                  "summary.json)")


def main(argv=None):
    """The paper's pipeline, phase by phase."""
    cfg, resume_from, changes = options(argv)
    try:
        run = set_up(cfg, resume_from, changes)  # run directory, environment, user, cold start, policy, reference
        results = evaluate(run, "before") if run.first_step == 0 else {}
        train(run)                               # the GRPO loop
        if run.first_step < run.cfg.steps:
            results.update(evaluate(run, "after"))
        write(run, results)
    except RuntimeError as e:
        if not cli.is_collective_timeout(e):
            raise
        raise SystemExit(f"grpo.py: this process waited more than --dist-timeout {cfg.dist_timeout:g} s for another "
                         f"at a collective (a rollout that waited on the user, a process that died, a slow disk): "
                         f"{str(e)[:300]}") from e
    return SimpleNamespace(run_dir=run.dir, model=run.acc.unwrap_model(run.model), results=results)


if __name__ == "__main__":
    main()
