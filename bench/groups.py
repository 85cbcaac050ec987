"""Does this checkpoint give GRPO something to learn from? Greedy pass^1 against what sampling finds, per task kind.

    ./run python bench/groups.py --agent runs/sft-shop            # a cold start (or any checkpoint) on shop:test
    ./run python bench/groups.py --agent A --agent B --tasks 64 --trials 8

GRPO trains on groups of G sampled episodes of one task; a group teaches only when its rewards differ ("mixed").
And greedy pass^1 (what eval.py and the default run report) rises only where the greedy episode fails *and* the
sampled ones sometimes succeed: a task that no sample solves gives an all-wrong group, no gradient. For each
checkpoint this plays the first `--tasks` test tasks once greedily and `--trials` times at `--temperature`, and
prints per task kind (kind + change of mind):
  greedy        greedy pass^1
  sampled       success rate of the sampled episodes
  mixed         tasks whose sampled group is mixed (what GRPO learns from)
  fixable       tasks greedy fails on that some sample solves (what can lift greedy pass^1 soonest)
  unask(g/s)    share of greedy, then sampled, episodes that wrote without the user's yes (the policy's
                confirmation rule; reward 0): a decision, where the other failures are mostly copy errors
  asked(s)      share of the decision tasks' sampled episodes that asked what the user wants before writing
and how the failed episodes ended (termination). Same rollout code, user and caps as the default run.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from collections import Counter, defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from plumbing import models  # noqa: E402
from fast.batched_rollout import RolloutConfig, rollout  # noqa: E402
from plumbing.users import make_user_sim  # noqa: E402
from envs import make_env  # noqa: E402


def measure(agent: str, env, tasks, trials: int, temperature: float, caps: dict) -> dict:
    model, tok = models.load_model(agent, env=env)
    sim = make_user_sim("scripted")
    t0 = time.time()
    greedy = rollout(model, tok, env, tasks, 1, sim, RolloutConfig(greedy=True, **caps))
    gen = torch.Generator(model.device).manual_seed(0)
    sampled = rollout(model, tok, env, tasks, trials, sim, RolloutConfig(temperature=temperature, **caps), gen)
    rows = defaultdict(Counter)
    for i, task in enumerate(tasks):
        kind = task.meta.get("kind", "?") + (f"+{task.meta['change']}" if task.meta.get("change") else "") + (
            f" ({task.meta['decision']}: {task.meta['wants']})" if task.meta.get("decision") else "")
        wins = sum(e.reward == 1.0 for e in sampled[i * trials:(i + 1) * trials])
        g = greedy[i].reward == 1.0
        for key in (kind, "ALL"):
            r = rows[key]
            r["tasks"] += 1
            r["greedy"] += g
            r["sampled"] += wins
            r["mixed"] += 0 < wins < trials
            r["fixable"] += (not g) and wins > 0
            r["g_unasked"] += bool(greedy[i].reward_info.get("unconfirmed_writes"))
            r["s_unasked"] += sum(bool(e.reward_info.get("unconfirmed_writes")) for e in sampled[i * trials:(i + 1) * trials])
            r["s_asked"] += sum(bool(e.reward_info.get("asked")) for e in sampled[i * trials:(i + 1) * trials])
            r["refund_tasks"] += bool(task.meta.get("decision"))
    ends = Counter(e.termination for e in greedy + sampled if e.reward != 1.0)
    return {"rows": rows, "ends": ends, "seconds": time.time() - t0}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--agent", action="append", required=True, help="checkpoint directory (repeat to compare)")
    p.add_argument("--env", default="shop")
    p.add_argument("--tasks", type=int, default=32, help="first N test tasks")
    p.add_argument("--trials", type=int, default=8, help="sampled episodes per task (GRPO's group size)")
    p.add_argument("--temperature", type=float, default=0.7, help="GRPO's default (the paper: 1.0)")
    p.add_argument("--max-turns", type=int, default=30)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--max-context", type=int, default=1536)
    args = p.parse_args(argv)
    env = make_env(args.env)
    tasks = env.tasks("test")[:args.tasks]
    caps = dict(max_turns=args.max_turns, max_new_tokens=args.max_new_tokens, max_context=args.max_context)
    for agent in args.agent:
        m = measure(agent, env, tasks, args.trials, args.temperature, caps)
        print(f"\n{agent}: {args.tasks} {args.env}:test tasks, greedy once and {args.trials} samples at temperature "
              f"{args.temperature:g} ({m['seconds']:.0f}s)")
        print(f"{'kind':24s} {'tasks':>5s} {'greedy':>7s} {'sampled':>8s} {'mixed':>6s} {'fixable':>8s} "
              f"{'unask(g)':>8s} {'unask(s)':>8s} {'asked(s)':>10s}")
        for kind in sorted(m["rows"], key=lambda k: (k == "ALL", k)):
            r = m["rows"][kind]
            print(f"{kind:24s} {r['tasks']:5d} {r['greedy'] / r['tasks']:7.2f} "
                  f"{r['sampled'] / (r['tasks'] * args.trials):8.2f} {r['mixed']:6d} {r['fixable']:8d} "
                  f"{r['g_unasked'] / r['tasks']:8.2f} {r['s_unasked'] / (r['tasks'] * args.trials):8.2f} "
                  f"{r['s_asked'] / max(1, r['refund_tasks'] * args.trials):10.2f}")
        print("failed episodes ended by: " + ", ".join(f"{k} {v}" for k, v in m["ends"].most_common()))


if __name__ == "__main__":
    main()
