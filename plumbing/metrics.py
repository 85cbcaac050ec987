"""plumbing/metrics.py: what a GRPO run measures, in one place. Every step's metrics go to metrics.jsonl
(grpo.grpo_step, pipeline.log_step).

    METRICS            every name a step logs, with its meaning (the README's metric table is checked against it)
    rollout_metrics    the step's episodes, over all processes: reward, group outcomes, turns, endings, tool calls
    Accumulator        the update's micro-batch metrics (what loss.grpo_loss returns), token-weighted over
                       micro-batches and processes, reduced in one collective with the same names on every process
    console_line       the step's line on the console
    plot_curves        the run's learning curves (curves.png; eval.py --plot RUN_DIR redraws them)
    gain, compare      a run's held-out after - before, and two evaluations' A - B, paired task by task

A fork that adds a metric returns it from its loss (loss.grpo_loss's metrics dict) or its rollout summary, names
it in METRICS and gives it a kind (TOKEN_MEANS, MAXES, SUMS); Accumulator refuses a metric of no kind, and
tests/test_grpo.py fails when one is missing from METRICS. Imports nothing of the project.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

# name -> meaning. The kind decides how micro-batches and processes combine it: "token" metrics are means over trained
# tokens (weighted by their count), "max" the largest, "sum" a sum; the others are computed from all episodes at once.
METRICS = {
    "reward_mean": "mean episode reward over all processes (infra-failed episodes left out)",
    "all_correct_ratio": "fraction of task groups whose G episodes all scored 1; such groups have zero advantage",
    "all_wrong_ratio": "fraction of task groups whose G episodes all scored 0; such groups have zero advantage",
    "turns_mean": "agent messages per episode (the paper tracks it)",
    "response_tokens_mean": "tokens the agent sampled per episode (the paper tracks it)",
    "termination/<reason>": "fraction of episodes ending by user_stop, transfer, max_turns, context_limit, "
                            "response_truncated or infra_error; only the first two can score",
    "tool_calls/<name>": "calls per episode by tool; think, calculate and transfer_to_human_agents always present, "
                         "as the paper tracks them",
    "reward_info/<check>": "share of the episodes that record it where the reward's yes/no check holds (booleans) or "
                           "its list is not empty: shop's db_match, differ (1 - db_match), unconfirmed_writes (wrote "
                           "without a yes) and asked (asked what the user wants of its task's decision, where a refund "
                           "goes or how a new item ships, on the tasks that carry one)",
    "tool_errors_per_episode": "malformed tool calls, unknown tools, bad arguments and tools that raised, per episode",
    "user_latency_s_mean": "seconds a user reply took, mean over the step's replies (retries included)",
    "user_latency_s_max": "seconds the slowest user reply of the step took",
    "user_retries": "requests to the user simulator's endpoint retried in the step (timeouts, 429, 5xx, bad replies)",
    "infra_failed": "episodes lost to the user simulator or evaluator failing, or to a non-finite reward",
    "episodes": "episodes in the step",
    "dropped_groups": "groups left out of the update by --drop-uniform-groups (all rewards equal)",
    "unshared_groups": "groups of several episodes trained whole because they share no opening (--share-opening: "
                       "a group's opening is otherwise computed once), over all processes",
    "trained_tokens": "agent-sampled tokens the update trained on, over all processes (the token-mean normalizer)",
    "loss": "the step's GRPO loss (surrogate + KL term), summed over micro-batches and processes, averaged over "
            "updates",
    "kl": "mean k3 estimate of KL(policy || reference) over trained tokens",
    "approx_kl": "mean k3 estimate of KL between the sampling policy and the current one (0 with one update per batch)",
    "clip_frac_low": "fraction of trained tokens whose ratio is clipped below (A < 0)",
    "clip_frac_high": "fraction of trained tokens whose ratio is clipped above (A > 0)",
    "dual_clip_frac": "fraction of trained tokens capped by the dual clip (A < 0, ratio > --dual-clip)",
    "ratio_mean": "importance ratio pi/pi_old over trained tokens (1 with one update per batch)",
    "ratio_max": "largest importance ratio of the step",
    "entropy": "mean entropy of the policy's next-token distribution at trained tokens",
    "logprob_gap": "mean absolute difference between the sampler's and the trainer's log-probabilities of the sampled "
                   "tokens on the same weights: numerical drift between the two paths, should be ~0",
    "correction_weight_mean": "mean weight of the trained tokens' policy term under --correction (tis: "
                              "min(exp(trainer - sampler log-prob), --tis-cap)): 1 where sampler and trainer agree",
    "grad_norm": "gradient norm before clipping",
    "skipped_updates": "updates dropped because the gradient norm was not finite",
    "lr": "learning rate",
    "rollout_s": "seconds spent rolling out",
    "update_s": "seconds spent updating",
    "gen_tokens_per_s": "sampled tokens per second of rollout",
    "eval/pass1": "greedy pass^1 on the first --eval-tasks test tasks after this step (every --eval-every steps)",
    "eval/<check>": "the same evaluation's share of episodes where the reward's check holds, as reward_info/<check> "
                    "(eval/asked: the held-out asking rate, against --eval-env's user when it is given)",
    "eval/pass1/<field>=<value>": "that evaluation's greedy pass^1 within one group of test tasks (shop: kind=return, "
                                  "wants=non-default, ...)",
    "eval_s": "seconds that evaluation took",
    "step": "the GRPO step this line is for (a rollout and its update: --updates-per-batch optimizer steps)",
}
TOKEN_MEANS = ("kl", "approx_kl", "clip_frac_low", "clip_frac_high", "dual_clip_frac", "ratio_mean", "entropy",
               "logprob_gap", "correction_weight_mean")
MAXES = ("ratio_max",)
SUMS = ("loss",)
TRACKED_TOOLS = ("think", "calculate", "transfer_to_human_agents")  # logged even when 0, as the paper tracks them


def documented(name: str) -> bool:
    """Whether a logged name is in METRICS (a family like tool_calls/<name> by its prefix)."""
    return name in METRICS or any(k.endswith(">") and name.startswith(k.split("<")[0]) for k in METRICS)


def reward_checks(info: dict) -> dict:
    """The reward's yes/no checks: booleans as they are, lists as "not empty" (shop's db_match: is the database
    right; unconfirmed_writes: did the agent write without the user's yes)."""
    return {k: bool(v) for k, v in (info or {}).items() if isinstance(v, (bool, list))}


def episode_summary(ep) -> dict:
    """What the step's metrics need of one episode (gathered from every process)."""
    return {"reward": ep.reward, "valid": not ep.infra_failed, "turns": ep.turns, "gen_tokens": ep.gen_tokens,
            "termination": ep.termination, "tool_calls": dict(ep.tool_calls), "tool_errors": ep.tool_errors,
            "task_id": ep.task_id, "checks": reward_checks(ep.reward_info),
            "user_seconds": list(ep.user_seconds), "user_retries": ep.user_retries,
            "error": (ep.reward_info or {}).get("error") if ep.infra_failed else None}


def rollout_metrics(summaries: list[dict], G: int) -> dict:
    """The rollout's metrics over all processes' episodes (`episode_summary`, consecutive groups of G)."""
    n = len(summaries)
    valid = [s for s in summaries if s["valid"]]
    m = {"episodes": n, "infra_failed": n - len(valid)}
    if valid:
        m["reward_mean"] = sum(s["reward"] for s in valid) / len(valid)
        m["turns_mean"] = sum(s["turns"] for s in valid) / len(valid)
        m["response_tokens_mean"] = sum(s["gen_tokens"] for s in valid) / len(valid)
        m["tool_errors_per_episode"] = sum(s["tool_errors"] for s in valid) / len(valid)
    waits = [w for s in summaries for w in s.get("user_seconds", ())]  # failed episodes too: a slow user shows
    m["user_latency_s_mean"] = sum(waits) / len(waits) if waits else 0.0
    m["user_latency_s_max"] = max(waits, default=0.0)
    m["user_retries"] = sum(s.get("user_retries", 0) for s in summaries)
    groups = [summaries[i:i + G] for i in range(0, n, G)]
    rewards = [r for r in ([s["reward"] for s in g if s["valid"]] for g in groups) if r]
    m["all_correct_ratio"] = sum(all(x == 1.0 for x in r) for r in rewards) / max(1, len(rewards))
    m["all_wrong_ratio"] = sum(all(x == 0.0 for x in r) for r in rewards) / max(1, len(rewards))
    for s in summaries:
        key = f"termination/{s['termination']}"
        m[key] = m.get(key, 0) + 1 / n
    for s in valid:
        for name, c in s["tool_calls"].items():
            m[f"tool_calls/{name}"] = m.get(f"tool_calls/{name}", 0) + c / len(valid)
    for name in sorted({k for s in valid for k in s.get("checks", {})}):  # over the episodes that record it
        has = [s["checks"][name] for s in valid if name in s.get("checks", {})]
        m[f"reward_info/{name}"] = sum(has) / len(has)
    for name in TRACKED_TOOLS:
        m.setdefault(f"tool_calls/{name}", 0.0)
    return m


class Accumulator:
    """The update's metrics over micro-batches and processes: token-weighted means (TOKEN_MEANS), maxima (MAXES),
    sums (SUMS). Added as tensors where they are (the GPU): nothing is read back to the host until `reduce`, so
    the next micro-batch's forward is queued while this one's backward still runs. `reduce` issues one all-reduce
    per kind with the same names on every process, whatever each one saw: a process with nothing to train (every
    episode failed, every group dropped) still joins with zeros, where a metric added only when present would leave
    the processes waiting on different collectives; then one read of every number."""

    def __init__(self):
        self.sums = dict.fromkeys(TOKEN_MEANS + SUMS, 0.0)
        self.weights = dict.fromkeys(TOKEN_MEANS, 0.0)
        self.maxes = dict.fromkeys(MAXES, 0.0)

    def add(self, metrics: dict, tokens: int) -> None:
        """One micro-batch's metrics (0-dim tensors or floats) over its `tokens` trained tokens (a host number). A
        metric of no known kind is an error: a fork's new metric needs its name in METRICS and its kind above, or it
        would be lost."""
        for k, v in metrics.items():
            if k == "n_tokens":
                continue
            if not (k in self.weights or k in self.maxes or k in self.sums):
                raise KeyError(f"metric {k!r} has no kind: add it to metrics.METRICS and to TOKEN_MEANS, MAXES or "
                               "SUMS")
            v = v.detach().double() if torch.is_tensor(v) else float(v)  # a tensor stays on its device, unread
            if k in self.weights:
                if tokens:
                    self.sums[k] = self.sums[k] + v * tokens
                    self.weights[k] += tokens
            elif k in self.maxes:
                f64 = torch.float64  # (a 0-dim host tensor meets a GPU one as a scalar)
                self.maxes[k] = torch.maximum(torch.as_tensor(self.maxes[k], dtype=f64), torch.as_tensor(v, dtype=f64))
            elif k in self.sums:
                self.sums[k] = self.sums[k] + v

    def reduce(self, acc) -> dict:
        def column(values):
            return torch.stack([torch.as_tensor(x, dtype=torch.float64).to(acc.device) for x in values])
        means = torch.stack([column([self.sums[k] for k in TOKEN_MEANS]), column([self.weights[k] for k in
                                                                                  TOKEN_MEANS])], 1)
        sums, maxes = column([self.sums[k] for k in SUMS]), column([self.maxes[k] for k in MAXES])
        if acc.num_processes > 1:
            means, sums = acc.reduce(means, reduction="sum"), acc.reduce(sums, reduction="sum")
            maxes = acc.reduce(maxes, reduction="max")
        means, sums, maxes = means.tolist(), sums.tolist(), maxes.tolist()  # the update's only reads to the host
        # a mean over no token (nothing trained, no reference for kl) is absent, not a 0 that reads as a measurement
        out = {k: s / w for k, (s, w) in zip(TOKEN_MEANS, means) if w}
        out.update(zip(SUMS, sums))
        out.update(zip(MAXES, maxes))
        return out


def console_line(m: dict, failed: list[dict], t_roll: float, t_upd: float) -> str:
    """The step's line on the console; episodes lost to infrastructure (the user simulator, the evaluator) are
    counted with the first error, so that a failing endpoint is seen at once, not after the run."""
    line = (f"step {m['step']:4d} | reward {m.get('reward_mean', 0):.3f} "
            f"all-correct {m['all_correct_ratio']:.2f} all-wrong {m['all_wrong_ratio']:.2f} | "
            f"turns {m.get('turns_mean', 0):.1f} resp-tok {m.get('response_tokens_mean', 0):.0f} | "
            f"loss {m['loss']:+.4f} kl {m.get('kl', 0):.4f} "
            f"clip {m.get('clip_frac_low', 0) + m.get('clip_frac_high', 0):.3f} "
            f"ent {m.get('entropy', 0):.2f} gnorm {m.get('grad_norm', 0):.2f} | {t_roll:.1f}s+{t_upd:.1f}s")
    if m.get("dropped_groups"):
        line += f" | {m['dropped_groups']} uniform groups dropped"
    if m.get("user_latency_s_max", 0) >= 1 or m.get("user_retries"):  # a slow or flaky user endpoint shows here
        line += (f" | user {m['user_latency_s_mean']:.1f}s mean, {m['user_latency_s_max']:.1f}s max, "
                 f"{m['user_retries']} retries")
    if failed:
        line += (f"\n     | {len(failed)} of {m['episodes']} episodes failed on infrastructure, left out; "
                 f"first: {failed[0]['error']}")
    return line


def gain(run_dir, meta: dict, say=print) -> list[dict]:
    """A run's held-out gain: after minus before, greedy pass^1 paired on the same test tasks (stats.paired_groups:
    over all tasks and within each task group, with 95% intervals), from its eval-before.jsonl and eval-after.jsonl
    (so a resumed run's "before" counts too); the overall, per-kind and per-wish rows said in one line."""
    from plumbing.stats import fmt, paired_groups

    per = []
    for tag in ("after", "before"):
        by: dict[str, list[float]] = {}
        for line in open(Path(run_dir) / f"eval-{tag}.jsonl", encoding="utf-8"):
            e = json.loads(line)
            if not e["infra_failed"]:
                by.setdefault(e["task_id"], []).append(e["reward"])
        per.append({t: sum(r) / len(r) for t, r in by.items()})
    rows = paired_groups(*per, meta)
    say("[grpo] after - before, greedy pass^1 paired on the same test tasks (95% interval): " + "; ".join(
        f"{d['group']} ({d['tasks']}) {d['b']:.2f} -> {d['a']:.2f}, {fmt(d)}" for d in rows
        if d["group"] == "all tasks" or d["group"].split(" = ")[0] in ("kind", "wants")))
    return rows


# ---- the learning curves (matplotlib, Agg: files only, nothing shown) ----
CURVE_GROUPS = {"wants=non-default": ("tab:red", "users who want the non-default"),
                "kind=transfer": ("tab:green", "transfers (a control: nothing to learn)")}
"""The task groups whose held-out pass^1 the curves draw beside the overall one (shop's; absent elsewhere)."""


def plot_curves(rows: list[dict], path, before: float | None = None, after: float | None = None,
                asked: tuple = (None, None), groups: dict | None = None) -> dict:
    """A run's learning curves as a PNG, from its metrics.jsonl rows: the reward per step and its mean over the last 5
    steps, with greedy test pass^1 before and after training; the groups whose episodes all scored 1 or all 0 (they
    teach nothing) and, where the reward checks it, the episodes that wrote without the user's yes; turns and sampled
    tokens per episode; the KL to the reference and the policy's entropy. `asked`: the held-out asking rate before and
    after training, drawn with the evaluations' own (eval/asked); `groups`: CURVE_GROUPS' pass^1 before and after
    ({"kind=transfer": (before, after)}), drawn with the evaluations' own. Returns {panel title: its legend}."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    col = lambda key: [r[key] if type(r.get(key)) in (int, float) else float("nan") for r in rows]  # (a number)
    reward = col("reward_mean")
    last5 = [[x for x in reward[max(0, i - 4):i + 1] if x == x] for i in range(len(reward))]  # x == x: not NaN
    mean5 = [sum(xs) / len(xs) if xs else float("nan") for xs in last5]
    fig, ax = plt.subplots(2, 2, figsize=(11, 7), sharex=True, constrained_layout=True)
    a = ax[0, 0]
    a.plot(steps, reward, color="tab:blue", alpha=0.45, label="reward (sampled episodes)")
    a.plot(steps, mean5, color="tab:blue", lw=2, label="mean of the last 5 steps")
    for v, name, c in ((before, "before", "tab:gray"), (after, "after", "tab:orange")):
        if v is not None:
            a.axhline(v, ls="--", color=c, label=f"test pass^1 {name} ({v:.2f}, greedy)")
    held = [(0, before)] * (before is not None) + [(r["step"], r["eval/pass1"]) for r in rows
                                                   if r.get("eval/pass1") is not None]
    if after is not None and steps:
        held.append((steps[-1], after))
    if any(r.get("eval/pass1") is not None for r in rows):
        a.plot(*zip(*held), color="black", marker="o", lw=1.5, label="held-out test pass^1 (greedy)")
    for g, (c, name) in CURVE_GROUPS.items():
        ends = (groups or {}).get(g, (None, None))
        pts = [(0, ends[0])] * (ends[0] is not None) + [(r["step"], r[f"eval/pass1/{g}"]) for r in rows
                                                        if r.get(f"eval/pass1/{g}") is not None]
        if ends[1] is not None and steps:
            pts.append((steps[-1], ends[1]))
        if pts:
            a.plot(*zip(*pts), color=c, marker=".", lw=1, label=f"held-out pass^1, {name}")
    a.set(title="reward", ylabel="mean episode reward", ylim=(-0.02, 1.02))
    a = ax[0, 1]
    a.plot(steps, col("all_correct_ratio"), color="tab:green", label="groups all correct")
    a.plot(steps, col("all_wrong_ratio"), color="tab:red", label="groups all wrong")
    if any("reward_info/unconfirmed_writes" in r for r in rows):
        a.plot(steps, col("reward_info/unconfirmed_writes"), color="tab:brown",
               label="episodes that wrote without a yes")
    if any("reward_info/asked" in r for r in rows):
        a.plot(steps, col("reward_info/asked"), color="tab:gray",
               label="decision episodes that asked what the user wants")
    held = [(0, asked[0])] * (asked[0] is not None) + [(r["step"], r["eval/asked"]) for r in rows
                                                       if r.get("eval/asked") is not None]
    if asked[1] is not None and steps:
        held.append((steps[-1], asked[1]))
    if held:
        a.plot(*zip(*held), color="black", marker="o", lw=1.5, label="held-out decision episodes that asked (greedy)")
    a.set(title="group outcomes", ylabel="fraction", ylim=(-0.02, 1.02))
    a = ax[1, 0]
    a.plot(steps, col("turns_mean"), color="tab:purple", label="agent turns per episode")
    a.set(title="episode length", ylabel="turns", xlabel="GRPO step")
    b = a.twinx()
    b.plot(steps, col("response_tokens_mean"), color="tab:olive", label="sampled tokens per episode")
    b.set_ylabel("tokens")
    a = ax[1, 1]
    a.plot(steps, col("kl"), color="tab:cyan", label="KL to the reference (k3)")
    a.set(title="KL and entropy", ylabel="nats per token", xlabel="GRPO step")
    b2 = a.twinx()
    b2.plot(steps, col("entropy"), color="tab:pink", label="policy entropy")
    b2.set_ylabel("entropy (nats)")
    drawn = {}
    for a, twin in ((ax[0, 0], None), (ax[0, 1], None), (ax[1, 0], b), (ax[1, 1], b2)):
        handles, labels = a.get_legend_handles_labels()
        if twin is not None:
            h2, l2 = twin.get_legend_handles_labels()
            handles, labels = handles + h2, labels + l2
        a.legend(handles, labels, fontsize=8, loc="best")
        a.grid(alpha=0.3)
        drawn[a.get_title()] = labels
    tmp = Path(path).with_name(Path(path).name + ".tmp")
    try:  # drawn beside the file and renamed over it: a full disk leaves no half picture
        fig.savefig(tmp, dpi=110, format=Path(path).suffix.lstrip(".") or "png")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
        plt.close(fig)
    return drawn


def plot_run(run_dir) -> Path:
    """curves.png of a run directory, from its metrics.jsonl and summary.json (`python eval.py --plot RUN_DIR`)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise SystemExit(f"eval.py: --plot: {run_dir} {'is a file' if run_dir.exists() else 'does not exist'}: give a "
                         "grpo.py run directory")
    if not (run_dir / "metrics.jsonl").exists():
        raise SystemExit(f"eval.py: --plot: {run_dir} has no metrics.jsonl (not a grpo.py run directory?)")
    rows = []
    for line in open(run_dir / "metrics.jsonl", encoding="utf-8", errors="replace"):
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a line cut short by a crash
        if isinstance(row, dict) and type(row.get("step")) is int:
            rows.append(row)
    if not rows:
        raise SystemExit(f"eval.py: --plot: {run_dir / 'metrics.jsonl'} holds no step's metrics: nothing to draw")
    try:
        summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else {}
    except (OSError, ValueError) as e:  # a summary cut short: the curves without the evaluations' lines
        print(f"[eval] --plot: {run_dir / 'summary.json'} is unreadable ({e}): drawn without the evaluations")
        summary = {}
    summary = summary if isinstance(summary, dict) else {}
    asked = tuple((summary.get(f"eval/{tag}/rates") or {}).get("asked") for tag in ("before", "after"))
    def group_pass1(tag: str, group: str):  # summary.json's eval/<tag>/by_meta: {field: {value: {"pass^1": ...}}}
        field, value = group.split("=")
        return ((summary.get(f"eval/{tag}/by_meta") or {}).get(field) or {}).get(value, {}).get("pass^1")

    groups = {g: (group_pass1("before", g), group_pass1("after", g)) for g in CURVE_GROUPS}
    plot_curves(rows, run_dir / "curves.png", summary.get("eval/before/pass1"), summary.get("eval/after/pass1"),
                asked, groups)
    return run_dir / "curves.png"


MEASURED = ("env_reward", "temperature", "top_p", "max_turns", "max_new_tokens", "max_context", "tool_timeout",
            "user_sim", "user_model")  # the settings that change what an evaluation measures, beside its agent


def compare(a: str, b: str) -> str:
    """Agent A minus agent B, from two eval.py output directories on the same tasks (eval.py --compare A B): the
    paired difference of per-task pass^1 with its 95% interval (stats.paired), over all shared tasks and within each
    task group; a last line names the MEASURED settings in which the two differ (part of the difference may be
    theirs)."""
    runs = []
    for d in (a, b):
        path = Path(d) / "summary.json"
        if not path.exists():
            raise SystemExit(f"eval.py: --compare: {path} does not exist (give eval.py --out-dir directories)")
        try:
            runs.append(json.loads(path.read_text()))
            runs[-1].get("steps")  # (an object, not a list or a number)
        except (OSError, ValueError, AttributeError) as e:
            raise SystemExit(f"eval.py: --compare: {path} is unreadable ({e.__class__.__name__}: {e})") from None
        if "steps" in runs[-1]:
            raise SystemExit(f"eval.py: --compare: {d} is a training run (grpo.py's summary.json): compare the "
                             "directories of two evaluations (eval.py --out-dir)")
    cfg = [r.get("config", {}) for r in runs]
    where = [(c.get("env"), c.get("split")) for c in cfg]
    if where[0] != where[1]:  # shop and shop:default share task ids, not tasks
        raise SystemExit(f"eval.py: --compare: {a} evaluated {':'.join(map(str, where[0]))}, {b} "
                         f"{':'.join(map(str, where[1]))}; compare evaluations of the same environment and split")
    tasks = [{t: r["mean_reward"] for t, r in run["per_task"].items() if r["trials"]} for run in runs]
    shared = set(tasks[0]) & set(tasks[1])
    if not shared:
        raise SystemExit(f"eval.py: --compare: {a} and {b} share no scored task")
    meta = {t: r.get("meta") or {} for t, r in runs[0]["per_task"].items()}
    from plumbing import stats

    lines = [f"# {a} minus {b}", "", f"Paired over the {len(shared)} tasks both scored (mean reward per task; 95% "
             "interval: bootstrap over tasks, stats.py). A's and B's pass^1 on those tasks, then A - B.", "",
             "| tasks | n | A | B | A - B [95%] | A better / worse |", "|---|---|---|---|---|---|"]
    for d in stats.paired_groups(*tasks, meta):
        lines.append(f"| {d['group']} | {d['tasks']} | {d['a']:.3f} | {d['b']:.3f} | {stats.fmt(d)} | "
                     f"{d['better']} / {d['worse']} |")
    differ = [f"{k} {cfg[0].get(k)} / {cfg[1].get(k)}" for k in MEASURED if cfg[0].get(k) != cfg[1].get(k)]
    if differ:
        lines += ["", "Settings that differ (A / B), so part of the difference may be theirs: " + ", ".join(differ)]
    return "\n".join(lines) + "\n"
