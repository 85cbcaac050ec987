"""plumbing/options.py: the option groups of the entry points, each defined once: how the agent samples (grpo.py,
eval.py), the simulated user (grpo.py, sft.py, eval.py), LoRA adapters (grpo.py, sft.py), sft.py's data (its training's
own are sft.SFT), and grpo.py's start and run options (pipeline.py reads them; the algorithm's own are grpo.Algorithm),
with `validate`, the check of grpo.py's
options at start, and the checks grpo.py and sft.py share; the paper's recipe (`--recipe paper`, RECIPES) and
--freeze applied to a model. An entry point's config dataclass inherits the groups it
needs; `cli.parse_config` lists each group under its own header in --help, and a subclass may give a field another
default (grpo.py samples the tiny model at 0.7; eval.py's user is GPT-4.1)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import torch

from plumbing import cli, lora
from plumbing.models import ATTENTION
from plumbing.users import check_user_sim
from plumbing.cli import SEEDS, TIMEOUTS, Range
from envs import opening_messages
from envs.shop import COLD_TEACHER
from loss import ADVANTAGES, AGGS, CORRECTIONS, CREDIT, POLICY_LOSSES, RATIO_LEVELS
from muarl import prompt_ids


@dataclass
class SamplingOptions:
    """sampling: how the agent samples, and the caps of an episode"""
    temperature: Annotated[float, Range("(0, inf)")] = 1.0
    """sampling temperature, applied identically when the trainer scores the tokens (the paper: 1.0)"""
    top_p: Annotated[float, Range("(0, 1]")] = 1.0
    """nucleus sampling (1.0: off); it picks which token is drawn, the recorded log-prob stays the full tempered one"""
    max_turns: Annotated[int, Range("[1, inf)")] = 30
    """agent turns per episode (the paper: 30)"""
    max_new_tokens: Annotated[int, Range("[1, inf)")] = 1024
    """new tokens per agent turn (the paper: 1024); a turn that reaches it ends the episode (response_truncated)"""
    max_context: Annotated[int, Range("[1, inf)")] = 32768
    """tokens per episode (the paper: 32k); an episode that reaches it ends (context_limit)"""
    tool_timeout: Annotated[float, Range("[0, 1e8]")] = 30.0
    """seconds one tool call may run (0: no deadline); a call that overruns is stopped, changes nothing and comes
    back as an error the agent reads (deadlines.py)"""
    reuse_cache: bool = True
    """keep each episode's KV cache across turns (off: re-encode the conversation every turn; same tokens, slower)"""
    decode_attention: str = "grouped"
    """the decoding steps' attention: 'grouped' reads each episode's KV cache once a step, whatever the number of query
    heads per key-value head (decode.py); 'model' the model's own (--attn) with a padding mask"""
    compile_decode: str = "off"
    """the decoder's step through torch.compile: 'on', 'off', or 'auto' (on a GPU only); where compiling fails it
    warns once and decodes eagerly. Off by default, on a GPU too: on an H200 it compiled for 114 s a shape, and again
    for every shape a run meets"""
    decode_graphs: str = "off"
    """the decoding step over fixed buffers, captured as CUDA graphs and replayed (fast/graphs.py): 'on', 'off', or
    'auto' (on a GPU only; on the CPU 'on' runs the same body eagerly); where a capture fails it warns once and
    decodes eagerly. Off by default: timed on an H200 (2.2x the eager step at Qwen3-8B's shape, batch 16, 8k;
    bench/README.md), its tokens and memory through a real run not yet checked on a GPU"""
    decode_share_opening: bool = False
    """hold a group's opening (system prompt, tools, first user message) once while its episodes decode, each
    episode's KV cache only what follows it, the opening read once per group a step (opening.opening_attention; with
    --decode-attention grouped); off: every episode's cache holds a copy of the opening"""
    decode_slots: str = ""
    """slots sized by need: the rollout's KV cache slots as a few sizes, SLOTSxPOSITIONS comma-separated (e.g.
    "24x8192,4x32768"; the largest at least --max-context), an episode decoding in the smallest whose slots hold its
    turn and moved up once when it outgrows it (pool.Tiers; with --decode-attention grouped, not graphed yet); '':
    every slot --max-context positions"""
    rollout: str = "engine"
    """how episodes are played: 'engine' (fast/batched_rollout.py: many at once, each KV cache kept across turns) or
    'reference' (rollout.py's reference_rollout: one at a time with model.generate, the loop a reader read; the same
    greedy episodes, slower; the engine's options below do not apply)"""
    rollout_batch: Annotated[int, Range("[0, inf)")] = 0
    """at most this many episodes decode together on one process (0: all; in eval.py on a GPU, as many as it holds
    by the memory estimate); bounds GPU memory: on a GPU the other episodes' KV caches wait in host memory"""


def check_activation_checkpointing(acc, gradient_checkpointing: bool, program: str) -> None:
    """--gradient-checkpointing and FSDP's own activation checkpointing (`accelerate config`:
    fsdp_activation_checkpointing, read from FSDP_ACTIVATION_CHECKPOINTING into the FSDP plugin) would both wrap every
    layer: each recomputed twice in the backward pass. Refused at start, naming both."""
    fsdp = getattr(acc.state, "fsdp_plugin", None)  # set only under FSDP
    if gradient_checkpointing and getattr(fsdp, "activation_checkpointing", False):
        raise SystemExit(f"{program}: --gradient-checkpointing with FSDP's activation checkpointing (accelerate "
                         "config: fsdp_activation_checkpointing: true) recomputes every layer twice: keep one, "
                         "preferably --gradient-checkpointing, the one muarl tests (fsdp_activation_checkpointing: "
                         "false), or drop it (--no-gradient-checkpointing)")


@dataclass
class UserOptions:
    """the simulated user"""
    user_sim: str = "scripted"
    """user simulator: 'scripted' (rule-based, per environment), 'openai' (any OpenAI-compatible endpoint), 'hf' (a
    local model)"""
    user_model: str = "gpt-4o"
    """user simulator model: the endpoint's model name ('openai') or a checkpoint/hub id ('hf'); the paper trains
    with GPT-4o and evaluates with GPT-4.1"""
    user_base_url: str = ""
    """OpenAI-compatible endpoint of the user simulator (default: OPENAI_BASE_URL); key from OPENAI_API_KEY"""
    user_concurrency: Annotated[int, Range("[1, inf)")] = 64
    """requests in flight to the user-simulator endpoint, over all processes: each process keeps ceil(N / processes)
    of them (at least 1), printed at start when there are several"""
    user_timeout: Annotated[float, TIMEOUTS] = 60.0
    """seconds the user simulator's endpoint has to answer one request, the whole reply read, before it is retried"""
    user_retries: Annotated[int, Range("[0, inf)")] = 5
    """retries of a failed user-simulator request (timeouts, connection errors, 408/409/429, 5xx, malformed replies),
    with backoff 1, 2, 4, ... s; then the episode ends as infra_error. A call costs at most
    (retries + 1) x timeout + the backoff (~6.5 minutes with the defaults)"""


@dataclass
class AttentionOptions:
    """attention"""
    attn: str = "sdpa"
    """attention kernel: 'sdpa' (PyTorch's, everywhere) or 'flash' (flash-attn 2, only by choice: a CUDA device, the
    flash-attn package and bf16 forward passes: grpo.py's and sft.py's --bf16, eval.py's default on a GPU; refused at
    start otherwise)"""


@dataclass
class LoraOptions:
    """LoRA adapters (lora.py)"""
    lora_rank: Annotated[int, Range("[0, inf)")] = 0
    """train adapters of this rank on --lora-target-modules, the start model frozen in the compute dtype (bf16 with
    --bf16), the adapters in fp32; a GRPO reference is then the policy with its adapters off, no second copy. 0: train
    the whole model"""
    lora_alpha: Annotated[float, Range("[0, inf)")] = 0.0
    """LoRA scale: an adapter's output is multiplied by alpha / rank (0: alpha = 2 x rank)"""
    lora_dropout: Annotated[float, Range("[0, 1)")] = 0.0
    """dropout on the adapters' inputs while training (not while sampling: above 0 the trainer's log-probs differ
    from the sampler's, and logprob_gap shows it)"""
    lora_target_modules: str = lora.DEFAULT_TARGETS
    """layers that get adapters, by the last part of their name, comma-separated (the default: the attention and MLP
    projections of Llama/Qwen-style models; not the output layer, whose weight the trainer reads directly)"""


@dataclass
class SFTData:
    """SFT: data (a file or a teacher), the checkpoint, the tiny base's pretraining"""
    model: str = "tiny"
    """model to fine-tune: 'tiny', 'smollm2-135m', a local checkpoint directory or a hub id (Qwen/Qwen3-8B)"""
    data: str = ""
    """JSONL conversations ({"messages": [...], "tools": [...]}); empty: synthesize them with --teacher"""
    out: str = "runs/sft"
    """the checkpoint's directory (Hugging Face format, tokenizer, this config); an existing one needs --overwrite"""
    overwrite: bool = False
    """replace the checkpoint already in --out (and an existing --data-out file); a directory that holds anything but
    a checkpoint's files is refused even so: nothing else is ever deleted"""
    strict_data: bool = False
    """refuse a --data file with any malformed conversation (default: report each with its file and line, skip it)"""
    teacher: str = "expert"
    """cold-start teacher when --data is empty: 'expert' (scripted, small domain) or an OpenAI-compatible model"""
    teacher_skips_confirm: Annotated[float, Range("[0, 1]")] = 0.0
    """share of conversations in which the scripted expert writes without asking for a yes (shop only): kept when the
    database is right (reward 0: demonstrations filtered on the database alone)"""
    teacher_skips_ask: Annotated[float, Range("[0, 1]")] = 0.0
    """share of conversations in which the scripted expert never asks what the user wants (shop only: refund, shipping):
    it names what the user said, else nothing, and the write does the default; kept when the database is right"""
    teacher_skips_status: Annotated[float, Range("[0, 1]")] = 0.0
    """share of conversations in which the scripted expert writes before reading the order's status (shop only): where
    the tool refuses (a pending order's return, a delivered order's cancellation), it transfers, as the policy wants"""
    teacher_users: str = ""
    """the users the teacher talks to, each on its share of the tasks: 'dynamic:3,told:1' plays 3 of every 4 tasks with
    --env's dynamic user, the fourth with its told user (shop's users; empty: --env's own)"""
    copy_drills: Annotated[float, Range("[0, inf)")] = 0.0
    """copy drills beside the conversations, per conversation (shop's family): windows of the last 1-4 messages before
    one that writes values, items renamed as drawn, as the tiny base was pretrained (bench/README.md, try 12)"""
    teacher_base_url: str = ""
    """OpenAI-compatible endpoint of the teacher (default: OPENAI_BASE_URL)"""
    teacher_timeout: Annotated[float, TIMEOUTS] = 600.0
    """seconds a teacher model's request may wait for each read, retried 3 times (then its episode fails)"""
    env: str = "shop"
    """environment the teacher plays: 'shop' or 'tau2:<domain>'"""
    split: str = "train"
    """task split the teacher plays"""
    num_tasks: Annotated[int, Range("[1, inf)")] = 1200
    """how many tasks the teacher plays (episodes with reward 1 are kept; see --teacher-skips-confirm)"""
    data_out: str = ""
    """also write the synthesized conversations here (JSONL)"""
    pretrain_only: bool = False
    """only make (or find) the pretrained 'tiny' base (`pretrain_tiny`) and exit"""
    pretrain_target: Annotated[float, Range("[0, inf)")] = 0.1
    """'tiny' pretraining stops when the held-out copy loss (nats per copied value) falls below this"""
    pretrain_max_steps: Annotated[int, Range("[1, inf)")] = 3000
    """'tiny' pretraining stops here at the latest (and says that it missed the target)"""
    pretrain_batch_size: Annotated[int, Range("[1, inf)")] = 32
    """drills per pretraining step, over all processes"""
    tiny_width: Annotated[int, Range("[64, inf)")] = 128
    """hidden size of the 'tiny' model pretrained here, a multiple of 64: 128 ~ 1M parameters, 256 ~ 3.5M"""
    base_conversations: Annotated[int, Range("[1, inf)")] = 2400
    """'tiny' pretraining's second stage: whole conversations it is fine-tuned on, half of them shop's"""
    base_out: str = ""
    """with --pretrain-only: also copy the base here (assets/tiny-base is the committed one)"""
    cold_start_out: str = ""
    """only make grpo.py's own cold start for --model tiny (sft.cold_start: of --env, --split and --seed, the teacher
    skipping as --teacher-skips-* say) and copy it here (assets/tiny-cold is the committed one)"""
    dist_timeout: Annotated[float, TIMEOUTS] = 7200.0
    """seconds a process waits for the others at a collective before it stops (NCCL's default: 10 minutes)"""
    memory_check: bool = True
    """on a GPU, stop at start when the estimated memory (printed: weights, gradients, AdamW state) exceeds it"""


@dataclass
class StartOptions:
    """start: what is trained, and on what"""
    model: str = "tiny"
    """policy to start from: 'tiny', 'smollm2-135m', a checkpoint directory or a hub id (Qwen/Qwen3-8B)"""
    init_from: str = ""
    """cold-start (SFT) checkpoint to start from; with --model tiny and none given, one is made and cached"""
    cold_start_skips_confirm: Annotated[float, Range("[0, 1]")] = 0.6
    """the cold start made when no --init-from is given: share of the scripted teacher's write conversations in which
    it writes without asking the user first (sft.py --teacher-skips-confirm), a decision the reward settles (the
    ablation's teacher: 0.3, COLD_TEACHER; at 0.6 the cold start's greedy agent writes without a yes, for GRPO to
    unlearn beside learning to ask)"""
    cold_start_skips_ask: Annotated[float, Range("[0, 1]")] = COLD_TEACHER["skip_ask"]
    """likewise, the share of its conversations in which it never asks what the user wants (where a refund goes, how
    a new item ships; sft.py --teacher-skips-ask): decisions only a user who answers what it is asked can teach"""
    cold_start_skips_status: Annotated[float, Range("[0, 1]")] = 0.5
    """likewise, the share in which it writes before reading the order's status and, refused by the tool, transfers
    (sft.py --teacher-skips-status): the cold start then knows what follows a refusal (bench/README.md, "The default
    run's recipe": without it GRPO's asking spread to pending orders' returns, which go to a human)"""
    env: str = "shop"
    """environment: 'shop' (small domain; 'shop:static': its user says everything at once, 'shop:told': it says its
    wish unasked and answers like the dynamic one, 'shop:replay' and 'shop:teacher': the user's turns of the
    expert's, or the cold-start teacher's, conversation whatever the agent says; ':default' every user wants the
    defaults, ':hard' the harder procedure; envs/shop.py) or
    'tau2:<retail|airline|telecom|mock>'"""
    split: str = "train"
    """task split trained on"""
    eval_env: str = ""
    """the environment of the held-out evaluations (before, after, --eval-every: its test split) when it is not --env:
    '--env shop:static --eval-env shop' trains with the user who says everything at once and measures against the one
    who says only what it is asked, so the asking rate's curve shows what the static user did not teach"""
    env_reward: str = ""
    """tau2 only: 'db' for the paper's training simplification (database check only); '' for tau2's full reward"""


@dataclass
class RunOptions:
    """run: precision, memory, checkpoints, logs, processes"""
    micro_batch_size: Annotated[int, Range("[1, inf)")] = 4
    """episodes per forward/backward pass on one process (gradient accumulation covers the rest; the gradient does
    not depend on it)"""
    bf16: bool = False
    """bf16 mixed precision (GPU)"""
    freeze: str = ""
    """regular expression: parameters whose name it matches are not trained (e.g. 'embed_tokens': the embeddings,
    and with them a tied output layer); '' trains all"""
    gradient_checkpointing: bool = False
    """recompute activations in the backward pass (long contexts)"""
    seed: Annotated[int, SEEDS] = 0
    """seed of task order, sampling and initialization"""
    out_dir: str = ""
    """run directory (default: runs/grpo-<env>-<time>); one that already holds a run is refused unless --resume or
    --overwrite"""
    overwrite: bool = False
    """replace the run already in --out-dir: its config, logs, checkpoints and summary are removed (nothing else)"""
    save_every: Annotated[int, Range("[1, inf)")] = 20
    """steps between checkpoints (the last step is always saved)"""
    keep_checkpoints: Annotated[int, Range("[0, inf)")] = 0
    """keep only the newest N checkpoints of the run (0: keep all), removed once the next one is written, or before it
    when the disk has too little room for it; the newest is never removed before its successor is written"""
    save_weights_only: bool = False
    """checkpoints hold the model and tokenizer only: no optimizer, scheduler or RNG state (a quarter of the size
    with AdamW in fp32), so they start new runs (--init-from) but cannot be resumed"""
    resume: str = ""
    """run directory or checkpoint to continue from exactly (weights, optimizer, scheduler, RNG, data position)"""
    report_to: str = ""
    """also log to Accelerate trackers: 'tensorboard', 'wandb', ... (JSONL is always written)"""
    log_episodes: Annotated[int, Range("[0, inf)")] = 4
    """episodes per step saved as readable conversations (episodes.jsonl)"""
    eval_tasks: Annotated[int, Range("[0, inf)")] = 128
    """test-split tasks evaluated (greedy, pass^1) before and after training; 0 skips"""
    eval_every: Annotated[int, Range("[0, inf)")] = 10
    """also evaluate them every this many steps (eval/pass1 in metrics.jsonl, points on the curve); 0: only before
    and after"""
    dist_timeout: Annotated[float, TIMEOUTS] = 7200.0
    """seconds a process waits for the others at a collective before the run stops, naming this option (NCCL's
    default is 10 minutes; a process's rollout can wait far longer on a slow user endpoint, or the others on a large
    checkpoint being written)"""
    memory_check: bool = True
    """on a GPU, stop at start when the estimated memory per GPU (printed) exceeds it; its KV-cache term assumes
    every episode reaches --max-context, a worst case"""


def validate(cfg, world: int) -> None:
    """grpo.py's options checked at start: a bad value stops the run with a message naming the option. Each number's
    range is declared with it (cli.Range); what is checked here are the names and the options that depend on others."""
    def bad(opt, why):
        raise SystemExit(f"grpo.py: --{opt.replace('_', '-')}: {why}")
    cli.check_ranges(cfg, "grpo.py")
    if cfg.optimizer not in ("adamw", "sgd"):
        bad("optimizer", f"{cfg.optimizer!r} is not 'adamw' or 'sgd'")
    if cfg.agg not in AGGS:
        bad("agg", f"{cfg.agg!r} is not one of {sorted(AGGS)}")
    if cfg.ratio_level == "sequence" and cfg.updates_per_batch == 1:
        cli.main_print("[grpo] warning: --ratio-level sequence with --updates-per-batch 1: on-policy the ratio is 1 "
                       "for every token and GSPO's update equals GRPO's with --agg seq-mean-token-mean")
    if cfg.advantage not in ADVANTAGES:
        bad("advantage", f"{cfg.advantage!r} is not one of {sorted(ADVANTAGES)}")
    if not cfg.scale_advantages and cfg.advantage != "grpo":
        bad("no_scale_advantages", f"only the 'grpo' advantage divides by a std; --advantage {cfg.advantage} "
                                   "never does")
    for opt, names in (("ratio_level", RATIO_LEVELS), ("policy_loss", tuple(POLICY_LOSSES)), ("credit", tuple(CREDIT)),
                       ("correction", tuple(CORRECTIONS)), ("tis_level", RATIO_LEVELS),
                       ("rollout", ("engine", "reference")), ("compile_decode", ("auto", "on", "off")),
                       ("decode_graphs", ("auto", "on", "off"))):
        if getattr(cfg, opt) not in names:
            bad(opt, f"{opt} must be one of {names}, got {getattr(cfg, opt)!r}")
    if cfg.dual_clip and cfg.dual_clip <= 1:
        bad("dual_clip", f"dual_clip must be > 1 (or 0: off), got {cfg.dual_clip}")
    import dataclasses  # an option set away from its default where nothing reads it: refused, not silently ignored
    # (a resumed run is resumed as it ran: these options cannot change in it)

    default = {f.name: f.default for f in dataclasses.fields(cfg)}
    for opt, read, by in (("tis_cap", cfg.correction == "tis", "--correction tis"),
                          ("tis_level", cfg.correction == "tis", "--correction tis"),
                          ("turn_discount", cfg.credit == "turn-discount", "--credit turn-discount"),
                          ("dual_clip", cfg.policy_loss == "ppo", "--policy-loss ppo"),
                          ("decode_slots", cfg.rollout == "engine", "--rollout engine")):
        if getattr(cfg, opt) not in (default[opt], 0, "") and not read and not cfg.resume:
            bad(opt, f"{getattr(cfg, opt)!r} has no effect without {by}")
    check_user_sim(cfg, "grpo.py", resumed=bool(cfg.resume))
    if trains_on_eval_tasks(cfg):
        cli.main_print(f"[grpo] warning: --split test: the run trains on the test tasks its evaluations hold out "
                       f"(--eval-tasks {cfg.eval_tasks}): their pass^1 is not held out (summary.json says so); "
                       "--split train, or --eval-env to evaluate elsewhere")
    if cfg.tasks_per_step % world:
        bad("tasks_per_step", f"{cfg.tasks_per_step} must be a multiple of the {world} processes")
    if cfg.model == "tiny" and not cfg.init_from and not cfg.resume and cfg.env.split(":")[0] != "shop":
        bad("env", f"{cfg.env!r} with the 'tiny' model needs a cold-start checkpoint (--init-from): the embedded cold "
                   "start and the tiny base are made on 'shop' only")
    lora.check_options(cfg, "grpo.py")
    if cfg.lora_decode not in ("merged", "unmerged"):
        bad("lora_decode", f"{cfg.lora_decode!r} is not 'merged' or 'unmerged'")
    if cfg.lora_decode != "merged" and not cfg.lora_rank:
        bad("lora_decode", "has no effect without --lora-rank (0: no adapters)")
    if cfg.lora_rank and cfg.freeze:
        bad("freeze", "with --lora-rank only the adapters train already; drop --freeze")
    if cfg.attn not in ATTENTION:
        bad("attn", f"{cfg.attn!r} is not one of {', '.join(ATTENTION)}")
    if cfg.attn == "flash" and not (torch.cuda.is_available() and cfg.bf16):
        bad("attn", "flash needs a CUDA device and --bf16 (flash-attn refuses fp32 inputs)")
    if cfg.bf16 and not torch.cuda.is_available():
        bad("bf16", "needs a GPU (on a CPU bf16 decoding is slower: bench/dtype.py)")


def trains_on_eval_tasks(cfg) -> bool:
    """Whether the run's evaluations (the test split of --eval-env, else of --env) score tasks it trains on."""
    return cfg.split == "test" and cfg.eval_tasks > 0 and cfg.eval_env in ("", cfg.env)


def check_max_context(tokenizer, env, tasks: list, max_context: int, program: str = "grpo.py") -> None:
    """Refuse a --max-context that no episode can start in (every one would end at 0 turns, scored 0 or trained
    on nothing), naming both numbers; warn when only some tasks' openings are too long. The opening measured is the
    system prompt with the tools and the task's earlier messages, before the user's first message: a lower bound."""
    sample = tasks[:256]
    lengths = [len(prompt_ids(tokenizer, opening_messages(env, t, None), env.tools(t))) for t in sample]
    over = [n for n in lengths if n >= max_context]
    which = f"{len(sample)} tasks" if len(sample) == len(tasks) else f"the first {len(sample)} of {len(tasks)} tasks"
    if lengths and len(over) == len(lengths):
        raise SystemExit(f"{program}: --max-context {max_context} is below every task's opening ({min(lengths)} to "
                         f"{max(lengths)} tokens of system prompt and tools before the user's first message, over "
                         f"{which}): no episode could start; raise it well above {max(lengths)}")
    if over:
        cli.main_print(f"[{program.split('.')[0]}] warning: --max-context {max_context}: {len(over)} of {which} open "
                   f"with more tokens (up to {max(over)}); their episodes end at once as context_limit")


RECIPES = {
    # The paper's recipe (its RL settings and released training script): Qwen3 non-thinking, a GPT-4o user, 32 tasks
    # x 8 per step, lr 1e-6.
    # Needs a cold-start checkpoint: --init-from runs/sft-qwen3 (see sft.py).
    "paper": dict(model="Qwen/Qwen3-8B", env="tau2:retail", env_reward="db", user_sim="openai", user_model="gpt-4o",
                  tasks_per_step=32, group_size=8, lr=1e-6, max_new_tokens=1024, max_context=32768,
                  micro_batch_size=1, bf16=True, gradient_checkpointing=True, steps=200, eval_tasks=0,
                  save_every=10, keep_checkpoints=2, temperature=1.0,
                  # 8 episodes decode at once, the rest park their caches in host memory (docs/gpus.md, precision
                  # and memory: what the estimate gives for Qwen3-8B at 32k)
                  rollout_batch=8),
}


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
    if len(hit) == len(list(model.parameters())):
        raise SystemExit(f"grpo.py: --freeze: {pattern!r} matches every parameter name: nothing would train")
    for p in hit:
        p.requires_grad_(False)
    return sum(p.numel() for p in hit)
