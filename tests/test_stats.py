"""The intervals of stats.py against plain loops, and eval.py's use of them (pass^1 with its interval, --compare)."""
import json
import random

import numpy as np
import pytest

import eval as evaluation
from plumbing import metrics, stats


def test_bootstrap_ci_matches_a_plain_loop():
    values = [1.0] * 30 + [0.0] * 34 + [0.5] * 6
    lo, hi = stats.bootstrap_ci(values, draws=4000, seed=3)
    rng = np.random.default_rng(3)
    idx = rng.integers(0, len(values), size=(4000, len(values)))
    means = sorted(sum(values[i] for i in row) / len(values) for row in idx)
    assert lo == pytest.approx(np.percentile(means, 2.5)) and hi == pytest.approx(np.percentile(means, 97.5))
    mean = sum(values) / len(values)
    se = (np.var(values) / len(values)) ** 0.5
    assert lo < mean < hi and abs((hi - lo) - 2 * 1.96 * se) < 0.03  # near the normal interval at n = 70
    assert stats.bootstrap_ci([0.4]) == (0.4, 0.4)
    assert all(np.isnan(stats.bootstrap_ci([])))


def test_paired_difference_removes_the_spread_of_task_difficulty():
    """B solves what A solves plus 10 more of 100 tasks: the paired interval excludes 0 where an unpaired one
    (the two intervals side by side) overlaps."""
    rng = random.Random(0)
    a = {f"t{i}": float(rng.random() < 0.5) for i in range(100)}
    flip = [t for t, v in a.items() if v == 0.0][:10]
    b = {t: 1.0 if t in flip else v for t, v in a.items()}
    d = stats.paired(b, a)
    assert d["diff"] == pytest.approx(0.10) and d["better"] == 10 and d["worse"] == 0 and d["tasks"] == 100
    assert d["ci"][0] > 0
    ci_a, ci_b = stats.bootstrap_ci(list(a.values())), stats.bootstrap_ci(list(b.values()))
    assert ci_b[0] < ci_a[1]  # unpaired, they overlap
    assert stats.paired({"x": 1.0}, {"y": 0.0})["tasks"] == 0
    assert stats.fmt(d).startswith("+0.100 [+")


def _episodes(rewards: dict, kind: dict, trials: int = 2) -> list[dict]:
    return [{"task_id": t, "reward": r, "infra_failed": False, "turns": 3, "termination": "user_stop",
             "tool_calls": {}, "reward_info": {"db_match": r == 1.0, **({"asked": r == 1.0} if kind[t] else {})}}
            for t, r in rewards.items() for _ in range(trials)]


def test_summary_reports_intervals_rates_and_compare_pairs_by_group(tmp_path):
    kind = {f"t{i}": ("voucher" if i % 2 else None) for i in range(40)}
    a = {t: float(i % 3 != 0) for i, t in enumerate(kind)}
    b = {t: float(i % 3 != 0 and not (kind[t] and i % 5 == 1)) for i, t in enumerate(kind)}
    meta = {t: {"refund": v} for t, v in kind.items()}
    for name, rewards in (("A", a), ("B", b)):
        s = stats.summarize(_episodes(rewards, kind), 2, meta)
        lo, hi = s["pass^1_ci95"]
        assert lo < s["pass^1"] < hi
        assert s["rates"]["asked"]["episodes"] == 40  # the 20 refund tasks x 2 trials, no others
        assert s["by_meta"]["refund"]["voucher"]["ci95"][0] <= s["by_meta"]["refund"]["voucher"]["pass^1"]
        (tmp_path / name).mkdir()
        (tmp_path / name / "summary.json").write_text(json.dumps(s))
        md = evaluation.markdown(evaluation.EvalConfig(agent=name), s)
        assert f"{s['pass^1']:.3f} [{lo:.3f}, {hi:.3f}]" in md and "asked" in md
    table = metrics.compare(str(tmp_path / "A"), str(tmp_path / "B"))
    rows = {line.split(" | ")[0].strip("| "): line for line in table.splitlines() if line.startswith("| ")}
    diff = sum(a[t] - b[t] for t in kind) / 40
    assert f"+{diff:.3f} [" in rows["all tasks"] and rows["refund = None"].split(" | ")[4].startswith("+0.000")
    assert "differ" not in table
    for name, temp, seed in (("A", 0.0, 1), ("B", 0.7, 2)):  # sampled against greedy: named; the seed is not
        s = json.loads((tmp_path / name / "summary.json").read_text())
        (tmp_path / name / "summary.json").write_text(json.dumps({**s, "config": {"temperature": temp, "seed": seed}}))
    last = metrics.compare(str(tmp_path / "A"), str(tmp_path / "B")).splitlines()[-1]
    assert last == "Settings that differ (A / B), so part of the difference may be theirs: temperature 0.0 / 0.7"
    with pytest.raises(SystemExit, match="summary.json does not exist"):
        metrics.compare(str(tmp_path / "A"), str(tmp_path / "nowhere"))
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "summary.json").write_text(json.dumps({"steps": 30, "eval/before/pass1": 0.2}))
    with pytest.raises(SystemExit, match=r"^eval.py: --compare: .*run is a training run \(grpo.py's summary.json\)"):
        metrics.compare(str(tmp_path / "A"), str(tmp_path / "run"))
    (tmp_path / "run" / "summary.json").write_text('{"pass^1": 0.5, "con')  # cut short
    with pytest.raises(SystemExit, match=r"^eval.py: --compare: .*summary.json is unreadable \(JSONDecodeError: "):
        metrics.compare(str(tmp_path / "run"), str(tmp_path / "A"))
    with pytest.raises(SystemExit, match="--compare takes two"):
        evaluation.main(["--compare", str(tmp_path / "A")])


def test_a_runs_gain_is_after_minus_before_paired_by_task_and_within_each_group(tmp_path):
    """metrics.gain (grpo.py's summary.json "eval/gain" and its log line): from the run's eval-before.jsonl and
    eval-after.jsonl, per task the mean reward of its scored episodes, the paired difference over all tasks and within
    each task group, against a plain loop; an infra-failed episode counts for neither."""
    from plumbing import metrics

    kinds = ["return", "cancel", "transfer"]
    meta = {f"t{i}": {"kind": kinds[i % 3], "wants": "non-default" if i % 2 else "default", "seed": i}
            for i in range(30)}
    before = {t: float(i % 4 == 0) for i, t in enumerate(meta)}
    after = {t: float(i % 4 == 0 or (i % 2 == 1 and i % 3 == 0)) for i, t in enumerate(meta)}
    for tag, rewards in (("before", before), ("after", after)):
        lines = [{"task_id": t, "reward": r, "infra_failed": False} for t, r in rewards.items()]
        lines.append({"task_id": "t0", "reward": 1.0 - rewards["t0"], "infra_failed": True})
        (tmp_path / f"eval-{tag}.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines))
    said = []
    rows = {r["group"]: r for r in metrics.gain(tmp_path, meta, said.append)}
    assert sorted(rows) == ["all tasks", "kind = cancel", "kind = return", "kind = transfer", "wants = default",
                            "wants = non-default"]  # "seed" is not a string: no groups of one task each
    for name, ids in (("all tasks", list(meta)), ("wants = non-default", [t for t in meta if int(t[1:]) % 2]),
                      ("kind = return", [t for t in meta if meta[t]["kind"] == "return"])):
        diff = sum(after[t] - before[t] for t in ids) / len(ids)
        assert rows[name]["diff"] == pytest.approx(diff) and rows[name]["tasks"] == len(ids)
        assert rows[name]["b"] == pytest.approx(sum(before[t] for t in ids) / len(ids))
    assert rows["wants = non-default"]["diff"] > 0 and rows["wants = default"]["diff"] == 0
    assert rows["kind = transfer"]["better"] == 0 and rows["kind = cancel"]["worse"] == 0
    line = said[0]
    assert line.startswith("[grpo] after - before") and f"all tasks (30) 0.27 -> 0.43, {stats.fmt(rows['all tasks'])}" \
        in line and "wants = non-default (15)" in line


def test_an_evaluation_of_many_trials_reports_a_readable_set_of_pass_k():
    """1,000 trials printed pass^2 to pass^1000 on one line; now 2 to 8, the powers of two and the trials, each the
    same unbiased estimate (C(c, k) / C(n, k)) as before."""
    rng = random.Random(0)
    episodes = [{"task_id": t, "reward": float(rng.random() < 0.9), "turns": 2, "termination": "done", "infra_failed": False,
                 "tool_calls": []} for t in range(3) for _ in range(1000)]
    s = stats.summarize(episodes, 1000)
    ks = [int(k.split("^")[1]) for k in evaluation.pass_keys(s)]
    assert ks == [1, 2, 3, 4, 5, 6, 7, 8, 16, 32, 64, 128, 256, 512, 1000]
    successes = {t: sum(e["reward"] for e in episodes if e["task_id"] == t) for t in range(3)}
    assert s["pass^16"] == pytest.approx(sum(stats.pass_hat_k(int(c), 1000, 16) for c in successes.values()) / 3)
    assert [k for k in stats.summarize(episodes[:3], 3) if k.startswith("pass^") and "ci" not in k] == \
        ["pass^1", "pass^2", "pass^3"] and stats.reported_ks(1) == []
