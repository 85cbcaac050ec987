"""bench/ablation.py --quick: the arms run end to end on a randomly initialized 'tiny' model and write the tables and
both pictures. A smoke test of the pipeline (which arm wins is measured by the full run, bench/README.md), with its
bookkeeping checked: the table holds what was measured, arm `sft` got its budget from arm `dynamic`'s seconds, every
GRPO arm logged its dynamics and was evaluated at its checkpoints, and a stopped run continues where it stopped,
rebuilding the cold start when only the results file is left."""
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

from plumbing import coldstart, models
from envs import make_env

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import ablation  # noqa: E402
import ablation_report  # noqa: E402


@pytest.fixture
def base(tmp_path):
    path = tmp_path / "base"
    model, tok = models.load_model("tiny", device="cpu", env=make_env("shop"))
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def test_quick_ablation_runs_its_arms_continues_where_it_stopped_and_writes_its_tables(tmp_path, base):
    out = tmp_path / "run"
    first = ["base", "cold", "dynamic", "sft"]
    ablation.main(["--quick", "--base", base, "--out", str(out), "--arms", ",".join(first)])
    saved = json.loads((out / "results.json").read_text())
    assert sorted(saved["results"]["0"]) == sorted(first)
    shutil.rmtree(out / "seed0" / "cold")  # continued elsewhere: the results file without the checkpoints
    # started again with more arms: the measured ones are kept as they are, the new ones run
    results = ablation.main(["--quick", "--base", base, "--out", str(out), "--arms", "base,cold,dynamic,sft,replay,"
                             "ctl_static"])
    arms = results[0]
    assert sorted(arms) == sorted(first + ["replay", "ctl_static"])
    assert arms["dynamic"]["final"] == saved["results"]["0"]["dynamic"]["final"]
    for name, r in arms.items():
        f = r["final"]
        assert set(f["greedy"]) == set(f["decision"]) == set(f["wants"]) and len(f["greedy"]) == 8, name
        assert all(0 <= v <= 1 for v in list(f["greedy"].values()) + list(f["sampled"].values())), name
    for name in ("dynamic", "replay", "ctl_static"):  # start, the step-1 checkpoint, the end; two logged steps
        assert len(arms[name]["curve"]) == 3 and [row["step"] for row in arms[name]["dynamics"]] == [1, 2]
        assert arms[name]["curve"][-1][1] == ablation.mean(arms[name]["final"]["greedy"])
    assert len(arms["ctl_static"]["final_mix"]["greedy"]) == 8  # the control measured against the real mix too
    assert "final_mix" not in arms["replay"]
    assert arms["cold"]["rebuilt_same"] is True  # rebuilt from its seed for replay, bit for bit
    assert arms["sft"]["sft_steps"] >= 1 and arms["dynamic"]["cpu_s"] > 0
    head = ablation.code_commit().split("+")[0]  # which code measured each arm
    assert all(r["commit"].split("+")[0] == head for r in arms.values())
    md = (out / "results.md").read_text()
    row = next(line for line in md.splitlines() if line.startswith("| dynamic:"))
    assert row.split(" | ")[2].startswith(f"{ablation.mean(arms['dynamic']['final']['greedy']):.3f} [")
    pairs, preds = md.split("Paired differences")[1].split("The predictions")
    assert "| dynamic - replay | 1 |" in pairs and "| ctl_dynamic" not in pairs  # a pair is shown where both ran
    assert "| ctl_dynamic - ctl_static | 0 |  | not run |" in preds  # a prediction is listed, untested
    for png in ("ablation.png", "dynamics.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (out / "results.md").unlink()  # --replot: the same table from results.json alone
    ablation.main(["--replot", str(out)])
    assert (out / "results.md").read_text() == md
    with pytest.raises(SystemExit, match="other settings"):
        ablation.main(["--quick", "--base", base, "--out", str(out), "--steps", "3"])


def test_the_report_pairs_by_seed_and_task():
    results = {s: {a: {"final": {"greedy": {"t1": x, "t2": y}, "refund": {"t1": "voucher", "t2": None}},
                       "seconds": 1.0, "curve": []}
                   for a, (x, y) in (("dynamic", (1.0, 1.0)), ("static", (0.0, 1.0)))} for s in (0, 1)}
    d = ablation_report.score(results, "dynamic", "greedy", minus="static")
    assert d["mean"] == 0.5 and d["seeds"] == 2 and d["tasks"] == 2
    refund = ablation_report.score(results, "dynamic", "greedy", subset=True, minus="static")
    assert refund["mean"] == 1.0 and refund["ci"] == [1.0, 1.0] and refund["tasks"] == 1
    # by kind: t1 a cancellation, t2 a transfer, no returns or exchanges among the tasks
    kinds = {"cancel": frozenset({"t1"}), "return": frozenset(), "exchange": frozenset(), "transfer": frozenset({"t2"})}
    rows = {r.split(" | ")[0].lstrip("| "): r.split(" | ")[1:] for r in ablation_report.by_kind(results, kinds)
            if r.startswith("| ") and not r.startswith("| arm")}
    assert rows["static"] == ["2", "0.000 [0.000, 0.000]", "", "", "1.000 [1.000, 1.000] |"]
    assert rows["dynamic - static"] == ["2", "+1.000 [+1.000, +1.000]", "", "", "+0.000 [+0.000, +0.000] |"]
    assert "ctl_dynamic - ctl_static" not in rows  # not run: no row
    del results[1]["static"]  # every seed of every arm, "-" where it has not run; no asking rate in these results
    assert ablation_report.per_seed(results)[-3:] == ["|---|---|---|", "| dynamic | 1.000 | 1.000 |",
                                                      "| static | 0.500 | - |"]
    shop = ablation_report.task_kinds(40)  # the first 40 test tasks, each of exactly one kind
    assert sum(len(v) for v in shop.values()) == 40 and all(shop.values())


def test_the_predictions_take_their_verdicts_from_paired_intervals():
    # per task (t1, t2 refund tasks; t3 not): the full arm wins the refund tasks the static arm loses, and the control
    # arms differ by as much, so the difference-in-differences is 0 on every task
    per_task = {"dynamic": (1, 1, 0), "static": (0, 0, 0), "ctl_dynamic": (1, 1, 0), "ctl_static": (0, 0, 0),
                "cold": (0, 1, 1), "base": (0, 1, 1)}
    results = {s: {a: {"final": {"greedy": dict(zip(("t1", "t2", "t3"), v)),
                                 "sampled": dict(zip(("t1", "t2", "t3"), v)),
                                 "refund": {"t1": "voucher", "t2": "original", "t3": None}},
                       "seconds": 1.0, "curve": []} for a, v in per_task.items()} for s in (0, 1, 2)}
    did = ablation_report.contrast(results, [(1, "dynamic"), (-1, "static"), (-1, "ctl_dynamic"), (1, "ctl_static")],
                                   "greedy", subset=True)
    assert did == {"mean": 0.0, "ci": [0.0, 0.0], "seeds": 3, "tasks": 2}
    rows = {r.split(" | ")[0].lstrip("| "): r for r in ablation_report.predictions(results) if r.startswith("| ")}
    assert "| held |" in rows["full is above the static user's arm, on the refund tasks"]
    assert "failed (a difference)" in rows["control: dynamic and static do not differ, on the refund tasks"]
    assert "not shown (interval spans 0)" in rows["dynamic - static exceeds the control's dynamic - static, on the "
                                                 "refund tasks"]
    assert "| +0.000 [+0.000, +0.000] | held (interval within +-0.000) |" not in rows["the cold start is above the base"]
    assert "not shown" in rows["the cold start is above the base"]  # equal on every task: no gain shown
    assert "| 0 |  | not run |" in rows["RL without a cold start is above the base"]
    # results with the users' wishes (issue 51's domain) are judged by its pre-registered predictions: the asking
    # rate on the decision tasks (sampled), pass^1 on the users wanting the non-default
    asks = {"dynamic": (1, 1, 0), "static": (0, 0, 0), "teacher": (0, 1, 0)}
    wins = {"dynamic": (1, 0, 1), "static": (0, 0, 1), "teacher": (0, 0, 1)}
    tasks = ("t1", "t2", "t3")
    results = {s: {a: {"final": {"greedy": dict(zip(tasks, wins[a])), "sampled": dict(zip(tasks, wins[a])),
                                 "sampled_asked": dict(zip(tasks[:2], asks[a])),
                                 "greedy_asked": dict(zip(tasks[:2], asks[a])),
                                 "decision": {"t1": "refund", "t2": "shipping", "t3": None},
                                 "wants": {"t1": "non-default", "t2": "default", "t3": None}},
                       "seconds": 1.0, "curve": []} for a in asks} for s in (0, 1, 2)}
    rows = {r.split(" | ")[0].lstrip("| "): r for r in ablation_report.predictions(results) if r.startswith("| ")}
    assert set(rows) >= {p[0] for p in ablation_report.PREDICTIONS_DECISIONS}
    assert "| +1.000 [+1.000, +1.000] | held; size reached |" in rows["primary: dynamic asks more than static (+0.3 or "
                                                                   "more)"]
    assert ablation_report.size_verdict({"ci": [0.02, 0.1]}, 0.15) == "; below its size"
    assert ablation_report.size_verdict({"ci": [0.02, 0.2]}, 0.15) == "; size not settled"
    assert "| +0.500 [" in rows["primary: dynamic asks more than the teacher's replay (+0.4 or more)"]
    nondefault = ablation_report.score(results, "dynamic", "greedy", "non-default", "static")
    assert nondefault["tasks"] == 1 and nondefault["mean"] == 1.0  # t1 alone
    assert ablation_report.verdict({"ci": [-0.2, -0.1]}, "above") == "refuted (below 0)"
    assert ablation_report.verdict({"ci": [-0.05, 0.02]}, "none") == "held (interval within +-0.050)"
    assert ablation_report.verdict({"ci": [-0.05, 0.02]}, "none", 0.1) == "held (interval within +-0.050)"
    assert ablation_report.verdict({"ci": [-0.33, 0.0]}, "none", 0.1) == ("not shown (interval within +-0.330, wider "
                                                                          "than +-0.1)")
    assert ablation_report.verdict({"ci": [-0.33, -0.01]}, "none", 0.1) == "failed (a difference)"


def test_bad_options_are_refused_by_name(tmp_path):
    for opt in ("--trials", "--seeds", "--eval-tasks", "--points"):
        with pytest.raises(SystemExit, match=opt):
            ablation.main(["--quick", opt, "0", "--base", str(tmp_path), "--out", str(tmp_path / "x")])
    with pytest.raises(SystemExit, match="--arms: nope"):
        ablation.main(["--quick", "--arms", "cold,nope", "--base", str(tmp_path), "--out", str(tmp_path / "x")])
    for users, bad in (("dynamic,chatty", "'chatty'"), ("dynamic:0,static", "'dynamic:0'"),
                       ("dynamic:x", "'dynamic:x'")):
        with pytest.raises(SystemExit, match=f"--cold-users: {bad}"):
            ablation.main(["--quick", "--cold-users", users, "--base", str(tmp_path), "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="arm sft needs dynamic"):
        ablation.main(["--quick", "--arms", "cold,sft", "--base", str(tmp_path), "--out", str(tmp_path / "y")])


def test_the_cold_start_talks_to_each_user_on_its_share_of_the_tasks():
    convs = ablation.teacher_conversations(60, 0, ["dynamic", "static"])
    ids = [c["task_id"] for c in convs]
    assert len(ids) == len(set(ids)) and len(ids) >= 40  # each task once; the teacher keeps most
    static = [c for c in convs if int(c["task_id"].rsplit("-", 1)[1]) % 2]
    assert static and len(static) < len(convs)
    # The static user says who it is and what it wants at once; the dynamic user opens vaguely.
    assert all("@" in c["messages"][1]["content"] or "zip code" in c["messages"][1]["content"] for c in static)
    assert not any("zip code" in c["messages"][1]["content"] or "@" in c["messages"][1]["content"]
                   for c in convs if c not in static)
    only = ablation.teacher_conversations(60, 0, ["dynamic"])  # the even tasks: the same conversations
    assert [c for c in only if int(c["task_id"].rsplit("-", 1)[1]) % 2 == 0] == [c for c in convs if c not in static]
    # Shares: the dynamic user on 3 of every 4 tasks, the static one on the fourth, the same conversations again.
    weighted = ablation.teacher_conversations(60, 0, ablation.user_shares("dynamic:3,static:1"))
    number = lambda c: int(c["task_id"].rsplit("-", 1)[1])  # noqa: E731
    assert [c for c in weighted if number(c) % 4 != 3] == [c for c in only if number(c) % 4 != 3]
    assert {number(c) % 4 for c in weighted if "@" in c["messages"][1]["content"]
            or "zip code" in c["messages"][1]["content"]} == {3}


def test_copy_drills_join_the_cold_start_s_conversations():
    """--cold-drills: as many drills as the share asks, each a window that ends in a message the agent writes values
    into (a tool call or an id), shuffled in with the conversations the same way for the same seed; 0 leaves the
    conversations as they were (tries 10 and 11 trained on them in that order)."""
    convs = ablation.teacher_conversations(40, 0, ["dynamic"])
    assert coldstart.with_drills(convs, 0, 0.0) is convs
    data = coldstart.with_drills(convs, 3, 0.5)
    assert data == coldstart.with_drills(convs, 3, 0.5) and data != coldstart.with_drills(convs, 4, 0.5)
    drills = [c for c in data if c not in convs]
    assert len(data) == len(convs) + len(convs) // 2 and len(drills) == len(convs) // 2
    for d in drills:
        last = d["messages"][-1]
        assert d["tools"] == [] and d["prompt_messages"] == len(d["messages"]) - 1 and last["role"] == "assistant"
        assert last.get("tool_calls") or any(ch.isdigit() for ch in last["content"])


def test_two_runs_share_a_directory_seed_by_seed(tmp_path, base, monkeypatch):
    """A seed another run holds is skipped, and a run's writes keep the seeds the other wrote meanwhile."""
    out = tmp_path / "run"
    out.mkdir()
    real = ablation.run_arm

    def the_other_run_writes_seed_2(arm, seed, *a):
        r = real(arm, seed, *a)
        ablation.merged(out / "results.json", 2, {"base": dict(r, threads=1, commit="theirs")})
        return r

    monkeypatch.setattr(ablation, "run_arm", the_other_run_writes_seed_2)
    monkeypatch.setitem(os.environ, "MUARL_THREADS", "0")  # put back after the test (--threads sets it)
    threads = torch.get_num_threads()
    try:
        with ablation.seed_held(out, 0) as held:  # the other run is on seed 0
            assert held
            with ablation.seed_held(out, 0) as again:
                assert not again
            results = ablation.main(["--quick", "--seeds", "2", "--arms", "base,rl", "--threads", "1", "--base",
                                     base, "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    # --threads holds in the GRPO arm too, whose Accelerator shares the cores out (cli.py): two runs at 1 thread each
    # on 2 cores, each arm's GRPO at 2 threads, had 4 threads on 2 cores and ran its steps ~10x slower
    assert sorted(results) == [1, 2] and results[1]["base"]["threads"] == results[1]["rl"]["threads"] == 1
    saved = json.loads((out / "results.json").read_text())
    assert sorted(saved["results"]) == ["1", "2"] and saved["settings"]["eval_tasks"] == 8
    assert "seed 0: another run holds it" in (out / "log.txt").read_text()
    with pytest.raises(SystemExit, match="--threads"):
        ablation.main(["--quick", "--threads", "-1", "--base", base, "--out", str(out)])


def test_the_gates_count_what_they_say(base, tmp_path):
    """bench/gates.py: its figures from hand-made episodes (no decision needed = transfers and users who want the
    default; asking counted on the decision tasks only; a group is mixed when some but not all of it succeeds), then
    the script end to end on a fresh model, with its bands judged and written."""
    import gates
    from types import SimpleNamespace as E

    tasks = [E(meta={"decision": "refund", "wants": "non-default"}), E(meta={"decision": "shipping", "wants": "default"}),
             E(meta={"decision": None, "wants": None})]
    greedy = [E(reward=0.0, reward_info={"asked": True}), E(reward=1.0, reward_info={"asked": False}),
              E(reward=1.0, reward_info={"unconfirmed_writes": []})]
    sampled = [E(reward=r, reward_info={"asked": a}) for r, a in ((1.0, True), (0.0, False), (0.0, True), (0.0, True),
                                                                   (1.0, None), (1.0, None))]
    f = gates.figures(greedy, sampled, tasks, 2)
    assert f["greedy pass^1"] == 2 / 3 and f["greedy pass^1, no decision needed"] == 1.0
    assert f["greedy pass^1, non-default users"] == 0.0 and f["greedy asked, decision tasks"] == 0.5
    assert f["sampled asked, decision tasks"] == 0.75 and f["groups mixed"] == 1 / 3 and f["sampled pass^1"] == 0.5
    # does asking pay: success by the user's wish and by whether the episode asked (decision tasks only)
    assert f["sampled pass^1, non-default users, asked"] == 1.0 and f["sampled pass^1, non-default users, did not ask"] == 0
    assert f["sampled pass^1, default users, asked"] == 0.0 and f["sampled pass^1, default users, did not ask"] is None
    out = tmp_path / "gates.json"
    judged = gates.main(["--stage", "coldstart", "--agent", base, "--tasks", "3", "--trials", "2", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["gates"] == judged and set(judged) == {"sampled asked, decision tasks", "groups mixed"}
    assert saved["figures"]["tasks"] == 3 and 0 <= saved["figures"]["groups mixed"] <= 1


def test_copies_by_kind_counts_the_copied_values_of_the_bases_drills():
    """bench/copies.py on the committed base, a few drills: every copied token has a kind; ids, which the base copies
    (bench/README.md), cost under a nat, and a kind's misses are a share of its copies."""
    import copies

    model, tok = models.load_model(str(Path(__file__).resolve().parents[1] / "assets" / "tiny-base"), device="cpu",
                                   dtype=torch.float32)
    data = copies.drills(2)
    got = copies.copies_by_kind(model, tok, data)
    assert {"id", "email"} <= set(got) and {"item", "item word"} & set(got)  # items: one token, or two words
    assert all(s["copies"] > 0 and 0 <= s["missed"] <= 1 for s in got.values())
    assert got["id"]["nll"] < 1.0
    assert [copies.kind(w) for w in ("o42", "@mail.com", "red mug", "mug", "Anna Lee")] == [
        "id", "email", "item", "item word", "full name"]
