"""bench/ablation.py's tables and pictures, from its results.json alone (so anyone can recompute them from the
committed file: `./run python bench/ablation.py --replot DIR`).

Scores are means over seeds and tasks; each interval is 95%, from the bootstrap over seeds and tasks together
(stats.bootstrap_ci_seeds); a difference between two arms is taken task by task within each seed (the same test
tasks, the same cold start for the arms that share it) before it is resampled.
"""
from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from plumbing import stats  # noqa: E402
from ablation import ARMS, ORDER  # noqa: E402

PAIRS = [("dynamic", "static"), ("dynamic", "teacher"), ("dynamic", "replay"), ("dynamic", "sft"), ("dynamic", "cold"),
         ("cold", "base"), ("rl", "base"), ("rl", "cold"), ("static", "cold"), ("teacher", "cold"), ("replay", "cold"),
         ("ctl_dynamic", "ctl_static"), ("ctl_dynamic", "ctl_replay")]
COLORS = {"base": "#7f7f7f", "cold": "#bcbd22", "sft": "#1f77b4", "rl": "#2ca02c", "dynamic": "#d62728",
          "static": "#ff7f0e", "replay": "#9467bd", "teacher": "#17becf", "ctl_dynamic": "#e377c2",
          "ctl_static": "#8c564b", "ctl_replay": "#aec7e8"}


def load(out: Path) -> dict:
    saved = json.loads((out / "results.json").read_text())
    saved["results"] = {int(s): arms for s, arms in saved["results"].items()}
    return saved


def matrix(results: dict, seeds: list[int], arm: str, key: str, subset) -> list[list[float]]:
    """[seeds, tasks] of a per-task value (`key` of the arm's final evaluation), on all tasks (subset False), the
    decision tasks (True), those whose user wants the non-default ("non-default") or the tasks whose ids are in
    `subset` (a set)."""
    rows = []
    for s in seeds:
        f = results[s][arm]["final"]
        decided = f.get("decision", f.get("refund"))  # results before the shipping decision: "refund"
        keep = ((lambda t: decided.get(t)) if subset is True else
                (lambda t: f.get("wants", {}).get(t) == "non-default") if subset == "non-default" else
                (lambda t: t in subset) if subset else None)
        tasks = sorted(t for t in f["greedy"] if keep is None or keep(t))
        rows.append([f.get(key, {}).get(t, float("nan")) for t in tasks])
    return rows


def score(results: dict, arm: str, key: str, subset=False, minus: str | None = None) -> dict | None:
    """Mean and interval of an arm's per-task `key` (or of its difference from arm `minus`), over the seeds that have
    it (both arms)."""
    return contrast(results, [(1, arm)] + ([(-1, minus)] if minus is not None else []), key, subset)


def contrast(results: dict, terms: list[tuple[int, str]], key: str, subset=False) -> dict | None:
    """Mean and interval of a signed sum of arms' per-task `key` (e.g. [(1, a), (-1, b)]: a - b), task by task within
    each seed, over the seeds that have every arm of it."""
    seeds = [s for s in sorted(results)
             if all(a in results[s] and key in results[s][a]["final"] for _, a in terms)]
    if not seeds:
        return None
    ms = [(sign, matrix(results, seeds, a, key, subset)) for sign, a in terms]
    m = [[sum(sign * mat[i][j] for sign, mat in ms) for j in range(len(ms[0][1][i]))] for i in range(len(seeds))]
    values = [x for row in m for x in row]
    if not values:
        return None
    return {"mean": statistics.mean(values), "ci": list(stats.bootstrap_ci_seeds(m)), "seeds": len(seeds),
            "tasks": len(m[0])}


def cell(sc: dict | None, signed: bool = False) -> str:
    if sc is None:
        return ""
    lo, hi = sc["ci"]
    return (f"{sc['mean']:+.3f} [{lo:+.3f}, {hi:+.3f}]" if signed else f"{sc['mean']:.3f} [{lo:.3f}, {hi:.3f}]")


def table(saved: dict) -> str:
    results, st = saved["results"], saved["settings"]
    arms = [a for a in ORDER if any(a in r for r in results.values())]
    seeds = sorted(results)
    lines = [f"Settings: {json.dumps(st)}; base {saved.get('base', '?')}; seeds "
             f"{', '.join(str(s) for s in seeds)}. Evaluated against the dynamic user (the control arms against "
             f"shop:default's) on the first {st['eval_tasks']} test tasks; sampled: {st['trials']} episodes a task at "
             f"temperature {st['temperature']:g}. Mean over seeds and tasks [95% interval, bootstrap over seeds and "
             "tasks; with 5 seeds the percentile bootstrap over seeds is somewhat optimistic].", "",
             "| arm | seeds | greedy pass^1 | greedy, decision tasks | greedy, non-default users | sampled pass^1 | "
             "sampled, decision tasks | asked what the user wants (sampled, decision tasks) | wrote without a yes "
             "(sampled) | CPU seconds of training |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for a in arms:
        have = [s for s in seeds if a in results[s]]
        secs = statistics.mean(cpu_seconds(results[s][a]) for s in have)
        lines.append(f"| {a}: {ARMS[a]} | {len(have)} | {cell(score(results, a, 'greedy'))} | "
                     f"{cell(score(results, a, 'greedy', True))} | "
                     f"{cell(score(results, a, 'greedy', 'non-default'))} | {cell(score(results, a, 'sampled'))} | "
                     f"{cell(score(results, a, 'sampled', True))} | {cell(score(results, a, 'sampled_asked', True))} | "
                     f"{cell(score(results, a, 'sampled_unasked'))} | {secs:.0f} |")
    lines += per_seed(results)
    lines += ["", "Paired differences (task by task within each seed):", "",
              "| difference | seeds | greedy, all tasks | greedy, refund tasks | sampled, all tasks | sampled, refund "
              "tasks | asked (sampled, refund tasks) |", "|---|---|---|---|---|---|---|"]
    for a, b in PAIRS:
        sc = score(results, a, "greedy", minus=b)
        if sc is None:
            continue
        lines.append(f"| {a} - {b} | {sc['seeds']} | {cell(sc, True)} | "
                     f"{cell(score(results, a, 'greedy', True, b), True)} | "
                     f"{cell(score(results, a, 'sampled', minus=b), True)} | "
                     f"{cell(score(results, a, 'sampled', True, b), True)} | "
                     f"{cell(score(results, a, 'sampled_asked', True, b), True)} |")
    lines += by_kind(results, task_kinds(st["eval_tasks"]))
    lines += predictions(results)
    return "\n".join(lines) + "\n"


def per_seed(results: dict) -> list[str]:
    """Every arm at every seed, so that no seed hides in a mean: greedy pass^1 on all tasks, and the asking rate
    (sampled, decision tasks) where the results hold it; "-" where the arm has not run at that seed."""
    seeds = sorted(results)
    arms = [a for a in ORDER if any(a in results[s] for s in seeds)]
    lines = ["", "Every seed (greedy pass^1 on all tasks / asked what the user wants, sampled, decision tasks):", "",
             "| arm | " + " | ".join(f"seed {s}" for s in seeds) + " |", "|---|" + "---|" * len(seeds)]
    for a in arms:
        cells = []
        for s in seeds:
            if a not in results[s]:
                cells.append("-")
                continue
            greedy = [x for x in matrix(results, [s], a, "greedy", False)[0] if x == x]
            asked = [x for x in matrix(results, [s], a, "sampled_asked", True)[0] if x == x]
            cells.append((f"{statistics.mean(greedy):.3f}" if greedy else "-")
                         + (f" / {statistics.mean(asked):.2f}" if asked else ""))
        lines.append(f"| {a} | " + " | ".join(cells) + " |")
    return lines


KINDS = ("cancel", "return", "exchange", "transfer")


def task_kinds(n: int) -> dict[str, frozenset]:
    """The ids of the first n shop test tasks by kind (the split is a pure function of its seed, as evaluated)."""
    from envs import make_env

    tasks = make_env("shop", n_train=0, n_test=n).tasks("test")
    return {k: frozenset(t.id for t in tasks if t.meta["kind"] == k) for k in KINDS}


def by_kind(results: dict, kinds: dict[str, frozenset]) -> list[str]:
    """Greedy pass^1 of each arm by kind of task, and the user arms' paired differences (main and control) by kind:
    where an arm's score, or a difference between users, comes from."""
    arms = [a for a in ORDER if any(a in r for r in results.values())]
    head = " | ".join(f"{k} ({len(kinds[k])})" for k in KINDS)
    lines = ["", "Greedy pass^1 by kind of task (tasks of that kind among those evaluated):", "",
             f"| arm | seeds | {head} |", "|---|---|" + "---|" * len(KINDS)]
    for a in arms:
        sc = [score(results, a, "greedy", kinds[k]) if kinds[k] else None for k in KINDS]
        lines.append(f"| {a} | {sum(a in r for r in results.values())} | " + " | ".join(cell(x) for x in sc) + " |")
    for a, b in (("dynamic", "static"), ("dynamic", "replay"), ("ctl_dynamic", "ctl_static"),
                 ("ctl_dynamic", "ctl_replay")):
        sc = [score(results, a, "greedy", kinds[k], b) if kinds[k] else None for k in KINDS]
        if any(sc):
            lines.append(f"| {a} - {b} | {max(x['seeds'] for x in sc if x)} | "
                         + " | ".join(cell(x, True) for x in sc) + " |")
    return lines


# The predictions, each a paired contrast: (what it says, terms, refund tasks only?, kind). Kind "above": the
# contrast is predicted positive; "none": predicted zero (the negative control, where asking is never needed).
PREDICTIONS = [
    ("the cold start is above the base", [(1, "cold"), (-1, "base")], False, "above"),
    ("full (cold start + GRPO, dynamic user) is above the cold start", [(1, "dynamic"), (-1, "cold")], False, "above"),
    ("RL without a cold start is above the base", [(1, "rl"), (-1, "base")], False, "above"),
    ("full is above more SFT for the same CPU seconds", [(1, "dynamic"), (-1, "sft")], False, "above"),
    ("full is above the static user's arm, on the refund tasks", [(1, "dynamic"), (-1, "static")], True, "above"),
    ("full is above the replayed user's arm, on the refund tasks", [(1, "dynamic"), (-1, "replay")], True, "above"),
    ("control: dynamic and static do not differ, on the refund tasks", [(1, "ctl_dynamic"), (-1, "ctl_static")],
     True, "none"),
    ("control: dynamic and replayed do not differ, on the refund tasks", [(1, "ctl_dynamic"), (-1, "ctl_replay")],
     True, "none"),
    ("dynamic - static exceeds the control's dynamic - static, on the refund tasks",
     [(1, "dynamic"), (-1, "static"), (-1, "ctl_dynamic"), (1, "ctl_static")], True, "above"),
    ("dynamic - replay exceeds the control's dynamic - replay, on the refund tasks",
     [(1, "dynamic"), (-1, "replay"), (-1, "ctl_dynamic"), (1, "ctl_replay")], True, "above"),
]


# Issue 51's ablation (two decisions, a strict user, the in-domain base): pre-registered before its first seed, with
# the effect each predicts (`bench/README.md`, "The ablation, pre-registered"). Subset True: the decision tasks;
# "non-default": the tasks whose user wants the non-default. Results that carry "wants" are judged by these.
PREDICTIONS_DECISIONS = [
    ("primary: dynamic asks more than static (+0.3 or more)", [(1, "dynamic"), (-1, "static")], True, "above",
     "sampled_asked"),
    ("primary: dynamic asks more than the teacher's replay (+0.4 or more)", [(1, "dynamic"), (-1, "teacher")], True,
     "above", "sampled_asked"),
    ("dynamic above static on the users wanting the non-default (+0.15)", [(1, "dynamic"), (-1, "static")],
     "non-default", "above", "greedy"),
    ("dynamic above the teacher's replay on the users wanting the non-default (+0.15)",
     [(1, "dynamic"), (-1, "teacher")], "non-default", "above", "greedy"),
    ("dynamic - static asking exceeds the control's (+0.3)",
     [(1, "dynamic"), (-1, "static"), (-1, "ctl_dynamic"), (1, "ctl_static")], True, "above", "sampled_asked"),
    ("control: dynamic and static ask alike (within 0.1)", [(1, "ctl_dynamic"), (-1, "ctl_static")], True, "none",
     "sampled_asked"),
    ("full (cold start + GRPO, dynamic user) above the cold start (+0.15)", [(1, "dynamic"), (-1, "cold")], False,
     "above", "greedy"),
    ("full above more SFT for the same CPU seconds (+0.1)", [(1, "dynamic"), (-1, "sft")], False, "above", "greedy"),
    ("full above RL without a cold start (+0.1)", [(1, "dynamic"), (-1, "rl")], False, "above", "greedy"),
    ("the cold start above the base (+0.05; 8 seeds)", [(1, "cold"), (-1, "base")], False, "above", "greedy"),
    ("not expected to reproduce: RL without a cold start above the base on the users wanting the non-default "
     "(the base never asks)", [(1, "rl"), (-1, "base")], "non-default", "none", "greedy"),
]


def verdict(sc: dict | None, kind: str, within: float | None = None) -> str:
    """What a 95% interval says of a prediction: "above" holds when the interval lies above 0 and is refuted when it
    lies below; "none" (no difference) fails when the interval excludes 0 and is otherwise not refuted (an interval
    around 0 shows no difference as large as its half-width, not that there is none): with a tolerance predicted
    ("within 0.1"), it holds only when the whole interval lies within it."""
    if sc is None:
        return "not run"
    lo, hi = sc["ci"]
    if kind == "above":
        return "held" if lo > 0 else "refuted (below 0)" if hi < 0 else "not shown (interval spans 0)"
    width = max(abs(lo), abs(hi))
    if lo > 0 or hi < 0:
        return "failed (a difference)"
    if within is not None and width > within:
        return f"not shown (interval within +-{width:.3f}, wider than +-{within:g})"
    return f"held (interval within +-{width:.3f})"


def size_verdict(sc: dict | None, size: float) -> str:
    """Whether a difference predicted "above 0, by +size" reached its size: the interval's lower end at or above it
    (reached), its upper end below it (below its size), else not settled by this many seeds."""
    if sc is None:
        return ""
    lo, hi = sc["ci"]
    return "; size reached" if lo >= size else "; below its size" if hi < size else "; size not settled"


def predictions(results: dict) -> list[str]:
    lines = ["", "The predictions, each a paired contrast of greedy and of sampled pass^1, or of the asking rate where "
             "a prediction is about asking (task by task within each seed; verdicts from the 95% intervals: above 0 or not, and, where a size is predicted, whether the interval reaches it):", "",
             "| prediction | contrast | seeds | greedy | verdict | sampled | verdict |", "|---|---|---|---|---|---|---|"]
    decisions = any("wants" in arm["final"] for arms in results.values() for arm in arms.values())
    for text, terms, subset, kind, *key in (PREDICTIONS_DECISIONS if decisions else PREDICTIONS):
        if key and key[0] == "sampled_asked":  # the asking rate: sampled only (greedy_asked: greedy episodes)
            g, smp = contrast(results, terms, "greedy_asked", subset), contrast(results, terms, key[0], subset)
        else:
            g, smp = contrast(results, terms, "greedy", subset), contrast(results, terms, "sampled", subset)
        name = " ".join(f"{'+' if sign > 0 else '-'} {a}" for sign, a in terms).lstrip("+ ")
        size = re.search(r"\(\+(\d+(?:\.\d+)?)", text) if kind == "above" else None  # the size predicted, if any
        sized = (lambda sc: size_verdict(sc, float(size[1]))) if size else (lambda sc: "")
        within = re.search(r"within (\d+(?:\.\d+)?)", text) if kind == "none" else None  # the tolerance, if any
        judge = lambda sc: verdict(sc, kind, float(within[1]) if within else None) + sized(sc)
        lines.append(f"| {text} | {name} | {g['seeds'] if g else 0} | {cell(g, True)} | {judge(g)} "
                     f"| {cell(smp, True)} | {judge(smp)} |")
    return lines


def cpu_seconds(r: dict) -> float:
    """An arm's training cost in CPU seconds (all threads; a run paused with kill -STOP, or sharing the machine,
    costs the same), or its wall seconds where it recorded none."""
    return r.get("cpu_s", r["seconds"])


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot(saved: dict, path: Path) -> None:
    """Left: final greedy pass^1 per arm, all tasks and refund tasks, with intervals. Right: greedy pass^1 against
    CPU seconds of training after the cold start (mean over seeds)."""
    plt = _plt()
    results = saved["results"]
    arms = [a for a in ORDER if any(a in r for r in results.values())]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(14, 5.5), constrained_layout=True)
    for j, (subset, label) in enumerate(((False, "all tasks"), (True, "refund tasks"))):
        for i, a in enumerate(arms):
            sc = score(results, a, "greedy", subset)
            if sc is None:
                continue
            x = i + (j - 0.5) * 0.38
            ax.bar(x, sc["mean"], 0.36, color=COLORS[a], alpha=1.0 if not subset else 0.55,
                   label=label if i == 0 else None, edgecolor="black" if subset else None)
            ax.errorbar(x, sc["mean"], [[sc["mean"] - sc["ci"][0]], [sc["ci"][1] - sc["mean"]]], color="black",
                        capsize=3)
    ax.set_xticks(range(len(arms)), arms, rotation=30, ha="right")
    ax.set(title="greedy pass^1 (95% intervals), all tasks then refund tasks; ctl_* tested against shop:default",
           ylabel="pass^1")
    ax.legend(fontsize=9)
    for a in arms:
        # a curve's points are at wall seconds; scaled to the arm's CPU seconds, like the table
        curves = [[(x * cpu_seconds(r) / max(r["seconds"], 1e-9), y) for x, y in r["curve"]]
                  for r in (results[s][a] for s in results if a in results[s]) if len(r["curve"]) > 1]
        if not curves:
            continue
        n = min(len(c) for c in curves)
        pts = [(statistics.mean(c[i][0] for c in curves), statistics.mean(c[i][1] for c in curves)) for i in range(n)]
        bx.plot(*zip(*pts), color=COLORS[a], marker="o", lw=2, label=a)
    bx.set(title="greedy pass^1 over training (mean over seeds)",
           xlabel="CPU seconds of training after the cold start",
           ylabel="pass^1")
    bx.grid(alpha=0.3)
    bx.legend(fontsize=9)
    fig.savefig(path, dpi=110)
    plt.close(fig)


DYNAMICS = [("reward per step", "reward_mean"),  # asked: the decisions domain's name, then the refund domain's
            ("asked what the user wants (decision episodes)", ("reward_info/asked", "reward_info/asked_refund")),
            ("wrote without a yes", "reward_info/unconfirmed_writes"), ("groups all correct", "all_correct_ratio"),
            ("groups all wrong", "all_wrong_ratio"), ("turns per episode", "turns_mean")]


def plot_dynamics(saved: dict, path: Path) -> None:
    plt = _plt()
    results = saved["results"]
    fig, axes = plt.subplots(3, 2, figsize=(11, 10), sharex=True, constrained_layout=True)
    for ax, (title, keys) in zip(axes.flat, DYNAMICS):
        for a in ("rl", "dynamic", "static", "teacher", "replay", "ctl_dynamic", "ctl_static", "ctl_replay"):
            runs = [results[s][a]["dynamics"] for s in results if a in results[s]]
            if not runs:
                continue
            key = next((k for k in keys if any(k in row for r in runs for row in r)), keys[0]) \
                if isinstance(keys, tuple) else keys
            n = min(len(r) for r in runs)
            # a step with no refund task records no asked_refund: left out of the mean, not counted as 0
            ys = [statistics.mean(v) if (v := [r[i][key] for r in runs if key in r[i]]) else float("nan")
                  for i in range(n)]
            ax.plot(range(1, n + 1), ys, color=COLORS[a], lw=2, label=a, ls="--" if a.startswith("ctl_") else "-")
        ax.set(title=title)
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=9)
    for ax in axes[-1]:
        ax.set_xlabel("GRPO step (mean over seeds)")
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(out: Path) -> str:
    saved = load(out)
    md = table(saved)
    (out / "results.md").write_text(md)
    plot(saved, out / "ablation.png")
    plot_dynamics(saved, out / "dynamics.png")
    return md
