"""Confidence intervals for agent benchmarks: pass^1 with a 95% interval, and two agents compared on the same tasks.

Two single runs on tau2 must differ by ~7-10 points to mean anything: the test sets are small (40 retail tasks) and
each task is solved or not. So every score here comes with a 95% interval from the bootstrap over tasks (tasks drawn
with replacement, each with all its trials: the tasks are the sample, the trials of one task are not independent of
it), and two agents are compared *paired*: the same tasks, the per-task difference resampled, which removes the
spread of task difficulty that an unpaired comparison carries.

    lo, hi = bootstrap_ci(per_task_means)                 # pass^1's interval
    d = paired(per_task_a, per_task_b)                    # {"diff", "ci", "tasks", "better", "worse"}

Pure functions over floats (numpy only), so a reader can check them against a plain loop (tests/test_stats.py).
"""
from __future__ import annotations

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
