"""The update phase of a GRPO step with and without --share-opening, side by side.

    ./run python bench/train_step.py                 # the default run's episodes, then a tau2-shaped workload
    ./run python bench/train_step.py --rounds 5 --only default

What is timed: grpo.train_on_episodes on the very same episodes (the reference's forward, the policy's forward and
backward, the optimizer step), once with each group's opening computed once per micro-batch (share_opening) and once
with every episode whole, interleaved round by round in one process after a warm-up round (this CPU pages idle memory
out and is shared: the ratio within a round is what to read). Printed per workload: the median seconds of each, their
ratio, and the tokens each pushes through the decoder (the opening counted once per micro-batch, or once per
episode). Peak memory: on CUDA, torch's peak allocation of each variant's call; on the CPU, each variant's maximum
resident size in a child process of its own (--memory).

Workloads:
  default  the default run's cold start (grpo.py's own, made and cached if missing) and its first step's episodes:
           4 shop tasks x 8 samples at temperature 0.7, 128 new tokens a turn, 1,536-token context; grpo.py's
           defaults (micro-batches of 4, AdamW, the reference's KL)
  tau2     tau2 retail's real opening (its policy, tool schemas and a task's first user message, through the tiny
           tokenizer) with episodes of tau2's proportions (the opening about a third of each, --tau2-length tokens
           in all) of random tokens, 2 groups of 8, through the tiny model's shape with a context that holds them
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

import cli  # noqa: E402
import grpo  # noqa: E402
import models  # noqa: E402
import muarl  # noqa: E402


def default_workload(agent: str = ""):
    """The default run's cold start (or `agent`) and 4 tasks x 8 episodes of its first step, as grpo.py plays them."""
    import sft
    from batched_rollout import RolloutConfig, make_user_sim, rollout
    from envs import make_env

    cfg = grpo.Config()
    start = agent or sft.cold_start("tiny", "shop", "train", cfg.seed, False, cfg.cold_start_skips_confirm,
                                    cfg.cold_start_skips_refund)
    model, tok = models.load_model(start, device="cpu")
    env = make_env("shop")
    sampling = RolloutConfig(temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens,
                             max_context=cfg.max_context)
    models.seed_everything(0)
    eps = rollout(model, tok, env, env.tasks("train")[:cfg.tasks_per_step], cfg.group_size, make_user_sim("scripted"),
                  sampling, torch.Generator().manual_seed(0))
    return model, tok, eps, cfg


def tau2_workload(length: int):
    """tau2 retail's opening through the tiny tokenizer, then random remainders: 2 groups of 8, `length` tokens each."""
    from envs import make_env

    shop = make_env("shop")
    tok = models.load_tokenizer("tiny", shop)
    env = make_env("tau2:retail")
    task = env.tasks("train")[0]
    messages = [{"role": "system", "content": env.system_prompt(task)}, {"role": "user", "content": "Hi, I need help "
                "with an order I placed last week: it has not arrived."}]
    opening = tok(muarl.render(tok, messages, env.tools(task), add_generation_prompt=True))["input_ids"]
    opening = opening[:max(1, length // 3)]  # tau2: the opening is a third to a half of an episode
    g, eps = torch.Generator().manual_seed(0), []
    for group in range(2):
        for k in range(8):
            rest = length - len(opening) - int(torch.randint(0, length // 4, (1,), generator=g))
            ids = opening + torch.randint(10, len(tok), (rest,), generator=g).tolist()
            mask = [0] * len(opening) + [int(x) for x in (torch.rand(rest, generator=g) < 0.5)]
            eps.append(muarl.Episode(task_id=f"t{group}", sample=k, input_ids=ids, loss_mask=mask,
                                     logprobs=[-1.0 * m for m in mask], reward=float(k % 2)))
    torch.manual_seed(0)
    config = models.tiny_config(len(tok), max_position_embeddings=max(4096, length + 16),
                                pad_token_id=tok.pad_token_id, eos_token_id=muarl.end_of_turn_id(tok))
    model = __import__("transformers").AutoModelForCausalLM.from_config(config)
    return model, tok, eps, grpo.Config(max_context=length + 16)


def forward_tokens(eps, cfg, share: bool) -> int:
    """Tokens through the decoder in one forward of every micro-batch (the opening once per micro-batch if shared)."""
    acc = cli.make_accelerator()
    adv, rows, _ = grpo.decide(eps, cfg)
    batches = grpo.micro_batches(eps, rows, adv, grpo.Config(**{**cfg.__dict__, "share_opening": share}), acc,
                                 0)
    total = 0
    for b in batches:
        n = int(b.attention_mask.sum())
        if b.opening > 1 and b.opening < b.input_ids.shape[1] - 1:
            n -= (b.input_ids.shape[0] - 1) * (b.opening - 1)
        total += n
    return total


def update(model, ref, eps, cfg, share: bool) -> float:
    """One train_on_episodes call (an lr so small that the weights barely move: every call sees the same model)."""
    cfg = grpo.Config(**{**cfg.__dict__, "share_opening": share, "lr": 1e-12})
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    acc = cli.make_accelerator()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    grpo.train_on_episodes(eps, model, ref, opt, sched, acc, cfg, 0)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def load(name: str, args):
    return default_workload(args.agent) if name == "default" else tau2_workload(args.tau2_length)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--only", default="", help="default or tau2 (default: both)")
    p.add_argument("--tau2-length", type=int, default=3000, help="tokens of a tau2-shaped episode")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's choice)")
    p.add_argument("--agent", default="", help="the default workload's model (default: grpo.py's cold start)")
    p.add_argument("--memory", default="", help=argparse.SUPPRESS)  # child process: WORKLOAD:shared|whole
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.memory:  # one variant alone in this process: its maximum resident size
        import resource

        name, variant = args.memory.split(":")
        model, tok, eps, cfg = load(name, args)
        ref = copy.deepcopy(model).eval().requires_grad_(False)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        update(model, ref, eps, cfg, variant == "shared")
        print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024)
        return
    for name in [args.only] if args.only else ["default", "tau2"]:
        model, tok, eps, cfg = load(name, args)
        model.train()
        ref = copy.deepcopy(model).eval().requires_grad_(False)
        lengths = [len(e.input_ids) for e in eps]
        times = {True: [], False: []}
        for r in range(args.rounds + 1):  # round 0 warms up
            for share in (True, False) if r % 2 else (False, True):
                t = update(model, ref, eps, cfg, share)
                if r:
                    times[share].append(t)
        a, b = statistics.median(times[False]), statistics.median(times[True])
        tokens = {s: forward_tokens(eps, cfg, s) for s in (False, True)}
        print(f"[train_step] {name}: {len(eps)} episodes of {min(lengths)}-{max(lengths)} tokens, micro-batches of "
              f"{cfg.micro_batch_size}: whole {a:.2f} s, shared {b:.2f} s, {a / b:.2f}x; tokens through the decoder "
              f"a forward pass: {tokens[False]:,} whole, {tokens[True]:,} shared "
              f"({tokens[False] / tokens[True]:.2f}x); rounds {args.rounds}", flush=True)
        if not torch.cuda.is_available():
            rss = {}
            for variant in ("whole", "shared"):
                out = subprocess.run([sys.executable, __file__, "--memory", f"{name}:{variant}", "--tau2-length",
                                      str(args.tau2_length), "--agent", args.agent], capture_output=True, text=True,
                                     check=True)
                rss[variant] = float(out.stdout.strip().splitlines()[-1])
            print(f"[train_step] {name}: peak resident memory added by the update: whole {rss['whole']:.0f} MB, "
                  f"shared {rss['shared']:.0f} MB", flush=True)


if __name__ == "__main__":
    main()
