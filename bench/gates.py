"""The gates a miniature must pass before the ablation's hours are spent (issue 51): is the base in the paper's regime,
and does the cold start give GRPO a decision to learn?

    ./run python bench/gates.py --stage base --agent assets/tiny-base              # 128 test tasks, greedy
    ./run python bench/gates.py --stage coldstart --agent DIR --tasks 64          # 8 samples a task at 0.7

The paper's base (Qwen3-32B) already does half of tau2 retail before any of its training; what the user holds is what
it lacks. So the base must do the procedure and not ask:
  base       greedy pass^1 in [0.35, 0.55] on the test tasks (the dynamic user of shop); at least 0.6 on the tasks
             that need no decision (transfers, and users who want the default); on the decision tasks, asking what
             the user wants in at most 0.2 of the greedy episodes
  coldstart  asking in [0.2, 0.45] of the sampled decision episodes, and at least 40% of the tasks' sampled groups
             mixed (some episodes right, some wrong: the only groups GRPO learns from)
Beside them, unjudged: the cold start's sampled success on the decision tasks split by the user's wish and by whether
the episode asked (GRPO raises asking only if the episodes that ask win more often than those that do not).
Each figure is printed beside its band with "pass" or "MISS", and written to --out (JSON) when given. Same rollout
code, user and caps as the default run.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from plumbing import models  # noqa: E402
from fast.batched_rollout import RolloutConfig, rollout  # noqa: E402
from plumbing.users import make_user_sim  # noqa: E402
from envs import make_env  # noqa: E402

# stage -> [(figure, low, high)]
BANDS = {"base": [("greedy pass^1", 0.35, 0.55), ("greedy pass^1, no decision needed", 0.6, 1.0),
                  ("greedy asked, decision tasks", 0.0, 0.2)],
         "coldstart": [("sampled asked, decision tasks", 0.2, 0.45), ("groups mixed", 0.4, 1.0)]}


def share(values: list) -> float | None:
    return sum(values) / len(values) if values else None


def figures(greedy, sampled, tasks, trials: int) -> dict:
    """The gates' figures from one greedy episode a task and `trials` sampled ones (in task order)."""
    needs = [t.meta.get("wants") == "non-default" for t in tasks]
    decided = [bool(t.meta.get("decision")) for t in tasks]
    out = {"tasks": len(tasks), "decision tasks": sum(decided),
           "greedy pass^1": share([e.reward == 1.0 for e in greedy]),
           "greedy pass^1, no decision needed": share([e.reward == 1.0 for e, n in zip(greedy, needs) if not n]),
           "greedy pass^1, non-default users": share([e.reward == 1.0 for e, n in zip(greedy, needs) if n]),
           "greedy asked, decision tasks": share([bool(e.reward_info.get("asked")) for e, d in zip(greedy, decided)
                                                  if d]),
           "greedy wrote without a yes": share([bool(e.reward_info.get("unconfirmed_writes")) for e in greedy])}
    if trials:
        groups = [sampled[i * trials:(i + 1) * trials] for i in range(len(tasks))]
        out.update({"sampled pass^1": share([e.reward == 1.0 for e in sampled]),
                    "sampled asked, decision tasks": share([bool(e.reward_info.get("asked")) for g, d in
                                                            zip(groups, decided) if d for e in g]),
                    "groups mixed": share([0 < sum(e.reward == 1.0 for e in g) < trials for g in groups])})
        # Does asking pay? GRPO raises asking only if, in the same groups, the episodes that ask win more often.
        for wants in ("default", "non-default"):
            for asked in (True, False):
                out[f"sampled pass^1, {wants} users, {'asked' if asked else 'did not ask'}"] = share(
                    [e.reward == 1.0 for g, t in zip(groups, tasks) if t.meta.get("decision")
                     and t.meta.get("wants") == wants for e in g if bool(e.reward_info.get("asked")) == asked])
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stage", choices=sorted(BANDS), required=True)
    p.add_argument("--agent", required=True, help="checkpoint directory")
    p.add_argument("--env", default="shop")
    p.add_argument("--tasks", type=int, default=128, help="first N test tasks")
    p.add_argument("--trials", type=int, default=None, help="sampled episodes a task (default: 0 for the base, 8)")
    p.add_argument("--temperature", type=float, default=0.7, help="GRPO's default")
    p.add_argument("--out", default="", help="also write the figures here (JSON)")
    args = p.parse_args(argv)
    trials = args.trials if args.trials is not None else (0 if args.stage == "base" else 8)
    env = make_env(args.env, n_train=0, n_test=args.tasks)
    tasks = env.tasks("test")
    caps = dict(max_turns=30, max_new_tokens=128, max_context=1536)  # the default run's (grpo.Config)
    model, tok = models.load_model(args.agent, device="cpu", dtype=torch.float32)
    sim, t0 = make_user_sim("scripted"), time.time()
    greedy = rollout(model, tok, env, tasks, 1, sim, RolloutConfig(greedy=True, **caps))
    sampled = []
    if trials:
        gen = torch.Generator().manual_seed(0)
        sampled = rollout(model, tok, env, tasks, trials, sim, RolloutConfig(temperature=args.temperature, **caps), gen)
    fig = figures(greedy, sampled, tasks, trials)
    print(f"{args.agent} on {args.tasks} {args.env}:test tasks ({fig['decision tasks']} carry a decision), greedy"
          + (f" and {trials} samples a task at {args.temperature:g}" if trials else "") + f" ({time.time() - t0:.0f}s)")
    gates = {}
    for name, value in fig.items():
        band = next(((lo, hi) for n, lo, hi in BANDS[args.stage] if n == name), None)
        if band and value is not None:
            gates[name] = band[0] <= value <= band[1]
        shown = f"{value:.3f}" if isinstance(value, float) else str(value)
        print(f"  {name:48s} {shown:>7s}" + (f"   [{band[0]}, {band[1]}] {'pass' if gates.get(name) else 'MISS'}"
                                              if band else ""))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"agent": args.agent, "stage": args.stage, "env": args.env, "trials": trials,
                       "temperature": args.temperature, "figures": fig, "gates": gates}, f, indent=1)
    return gates


if __name__ == "__main__":
    main()
