"""Confidence intervals for agent benchmarks: pass^1 with a 95% interval, and two agents compared on the same tasks.

Two single runs on tau2 must differ by ~7-10 points to mean anything: the test sets are small (40 retail tasks) and
each task is solved or not. So every score here comes with a 95% interval from the bootstrap over tasks (tasks drawn
with replacement, each with all its trials: the tasks are the sample, the trials of one task are not independent of
it), and two agents are compared *paired*: the same tasks, the per-task difference resampled, which removes the
spread of task difficulty that an unpaired comparison carries.

    lo, hi = bootstrap_ci(per_task_means)                 # pass^1's interval
    d = paired(per_task_a, per_task_b)                    # {"diff", "ci", "tasks", "better", "worse"}
    rows = paired_groups(per_task_a, per_task_b, meta)    # the same over all tasks and within each task group
    s = summarize(episodes, trials, meta)                 # an evaluation's pass^k, intervals, rates, by task group

Pure functions over floats (numpy only), so a reader can check them against a plain loop (tests/test_stats.py).
"""
from __future__ import annotations

from collections import Counter
from math import comb

import numpy as np

DRAWS = 10_000


def bootstrap_ci(values: list[float], level: float = 0.95, draws: int = DRAWS, seed: int = 0) -> tuple[float, float]:
    """The percentile bootstrap interval of the mean of `values` (one value per task). (nan, nan) for no values;
    a single value gives a zero-width interval."""
    x = np.asarray(values, dtype=np.float64)
    if x.size == 0:
        return float("nan"), float("nan")
    idx = np.random.default_rng(seed).integers(0, x.size, size=(draws, x.size))
    means = x[idx].mean(axis=1)
    tail = (1 - level) / 2 * 100
    lo, hi = np.percentile(means, [tail, 100 - tail])
    return float(lo), float(hi)


def mean_ci(values: list[float], **kw) -> dict:
    """{"mean", "ci": [lo, hi], "n"}: a score with its interval, as summaries and tables report it."""
    lo, hi = bootstrap_ci(values, **kw)
    return {"mean": float(np.mean(values)) if len(values) else float("nan"), "ci": [lo, hi], "n": len(values)}


def paired(a: dict[str, float], b: dict[str, float], **kw) -> dict:
    """Agent A minus agent B on the tasks both were scored on (task id -> the task's mean reward): the mean
    difference, its 95% interval (bootstrap over the shared tasks), and how many tasks A did better and worse on."""
    shared = sorted(set(a) & set(b))
    d = [a[t] - b[t] for t in shared]
    out = mean_ci(d, **kw)
    return {"diff": out["mean"], "ci": out["ci"], "tasks": len(shared), "better": sum(x > 0 for x in d),
            "worse": sum(x < 0 for x in d)}


def paired_groups(a: dict[str, float], b: dict[str, float], meta: dict[str, dict]) -> list[dict]:
    """A minus B (`paired`) over all the tasks both were scored on, then within each task group (each value of each
    string-valued field of the tasks' `meta`, as summarize's by_meta): [{"group": "all tasks" or "kind = return",
    "a", "b" (their pass^1 there), **paired}], the groups in name order after "all tasks"."""
    shared = set(a) & set(b)
    meta = {t: {k: v for k, v in (meta.get(t) or {}).items() if v is None or isinstance(v, str)} for t in shared}
    groups = [("all tasks", shared)] + sorted(
        (f"{k} = {v}", {t for t in shared if k in meta[t] and str(meta[t][k]) == v})
        for k in sorted({k for t in shared for k in meta[t]}) for v in sorted({str(meta[t].get(k)) for t in shared}))
    out = []
    for name, ids in groups:
        if ids:
            out.append({"group": name, "a": sum(a[t] for t in ids) / len(ids), "b": sum(b[t] for t in ids) / len(ids),
                        **paired({t: a[t] for t in ids}, {t: b[t] for t in ids})})
    return out


def fmt(score: dict) -> str:
    """0.512 [0.431, 0.590] (a mean_ci result) or +0.080 [+0.010, +0.150] (a paired one)."""
    if "diff" in score:
        lo, hi = score["ci"]
        return f"{score['diff']:+.3f} [{lo:+.3f}, {hi:+.3f}]"
    lo, hi = score["ci"]
    return f"{score['mean']:.3f} [{lo:.3f}, {hi:.3f}]"


def bootstrap_ci_seeds(matrix, level: float = 0.95, draws: int = DRAWS, seed: int = 0) -> tuple[float, float]:
    """The interval of the mean of a [seeds, tasks] matrix (one training run a row, the same tasks in every column):
    seeds and tasks resampled together (a two-level bootstrap), so that it carries both the spread between training
    runs and the test set's own sampling error. One row: the bootstrap over tasks alone."""
    x = np.asarray(matrix, dtype=np.float64)
    if x.size == 0:
        return float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    s = rng.integers(0, x.shape[0], size=(draws, x.shape[0]))
    t = rng.integers(0, x.shape[1], size=(draws, x.shape[1]))
    means = np.array([x[s[i]][:, t[i]].mean() for i in range(draws)])
    tail = (1 - level) / 2 * 100
    lo, hi = np.percentile(means, [tail, 100 - tail])
    return float(lo), float(hi)


# ---------------------------------------------------------------------------------------------------------
# An evaluation's summary (eval.py, and grpo.py's held-out evaluations)
# ---------------------------------------------------------------------------------------------------------
def pass_hat_k(successes: int, trials: int, k: int) -> float:
    """tau-bench's pass^k for one task: the chance that k trials drawn from the n run all succeed, C(c,k)/C(n,k)."""
    return comb(successes, k) / comb(trials, k) if trials >= k else float("nan")


def reported_ks(trials: int) -> list[int]:
    """The k of pass^k an evaluation reports: 2 to 8, then the powers of two, and the number of trials itself (an
    evaluation of 1,000 trials reports 13, not 999)."""
    ks = [k for k in range(2, 9)] + [2 ** i for i in range(4, trials.bit_length())] + [trials]
    return sorted({k for k in ks if 2 <= k <= trials})


def summarize(episodes: list[dict], trials: int, meta: dict[str, dict] | None = None) -> dict:
    """Summary over episode dicts (Episode.to_json()); infra-failed episodes are reported, not scored.
    `meta` (task id -> the task's meta dict) adds pass^1 per value of each string-valued meta field ("by_meta":
    shop's task kinds and changes of mind), which tells where an agent fails."""
    by_task: dict[str, list[dict]] = {}
    for e in episodes:
        by_task.setdefault(e["task_id"], []).append(e)
    scored = [e for e in episodes if not e["infra_failed"]]
    per_task = {}
    for tid, eps in by_task.items():
        ok = [e for e in eps if not e["infra_failed"]]
        c = sum(e["reward"] == 1.0 for e in ok)
        per_task[tid] = {"trials": len(ok), "successes": c,
                         "mean_reward": sum(e["reward"] for e in ok) / max(1, len(ok)),
                         "infra_failed": len(eps) - len(ok),
                         "meta": {k: v for k, v in ((meta or {}).get(tid) or {}).items()
                                  if v is None or isinstance(v, str)}}
    scored_tasks = {tid: t["mean_reward"] for tid, t in per_task.items() if t["trials"]}
    summary = {
        "episodes": len(episodes), "tasks": len(by_task), "infra_failed": len(episodes) - len(scored),
        "scored": len(scored),
        # over the scored episodes only; None (null), not 0, when none was scored: nothing was measured
        "pass^1": sum(e["reward"] for e in scored) / len(scored) if scored else None,
        # the bootstrap over tasks (bootstrap_ci): tasks are the sample, a task's trials go with it
        "pass^1_ci95": bootstrap_ci(list(scored_tasks.values())) if scored_tasks else None,
        "avg_turns": sum(e["turns"] for e in scored) / max(1, len(scored)),
        "termination": dict(Counter(e["termination"] for e in episodes)),
        "tool_calls_per_episode": {k: v / max(1, len(scored)) for k, v in
                                   sum((Counter(e["tool_calls"]) for e in scored), Counter()).items()},
    }
    for k in reported_ks(trials):
        vals = [pass_hat_k(t["successes"], t["trials"], k) for t in per_task.values() if t["trials"] >= k]
        summary[f"pass^{k}"] = sum(vals) / len(vals) if vals else float("nan")
    by_meta: dict[str, dict[str, list[float]]] = {}
    for e in scored:
        for k, v in ((meta or {}).get(e["task_id"]) or {}).items():
            if v is None or isinstance(v, str):
                by_meta.setdefault(k, {}).setdefault(str(v), []).append(e["reward"])
    if by_meta:
        def ci(k, v):  # over the group's tasks
            meta_of = lambda tid: per_task[tid]["meta"]  # noqa: E731
            return bootstrap_ci([m for tid, m in scored_tasks.items()
                                       if k in meta_of(tid) and str(meta_of(tid)[k]) == v])
        summary["by_meta"] = {k: {v: {"pass^1": sum(r) / len(r), "episodes": len(r), "ci95": ci(k, v)}
                                  for v, r in sorted(vs.items())} for k, vs in by_meta.items()}
    flags: dict[str, list[bool]] = {}  # yes/no facts the reward records (db_match; shop's asked)
    for e in scored:
        for k, v in (e.get("reward_info") or {}).items():
            if isinstance(v, bool):
                flags.setdefault(k, []).append(v)
    summary["rates"] = {k: {"rate": sum(v) / len(v), "episodes": len(v)} for k, v in sorted(flags.items())}
    if "category" in by_meta:  # BFCL / ACEBench: the headline is the unweighted mean over categories
        cats = summary["by_meta"]["category"]
        summary["category_mean"] = sum(c["pass^1"] for c in cats.values()) / len(cats)
    summary["per_task"] = per_task
    return summary
