"""bench/ablation.py --quick: the five arms run end to end on a randomly initialized 'tiny' model and write the
table and both pictures. A smoke test of the pipeline (which arm wins is measured by the full run, bench/README.md),
with its bookkeeping checked: the table holds what was measured, arm 2's SFT got a budget from arm 3's seconds,
every GRPO arm logged its dynamics and was evaluated at its checkpoints."""
import json
import sys
from pathlib import Path

import models
from envs import make_env

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import ablation  # noqa: E402


def test_quick_ablation_runs_every_arm_and_writes_its_table(tmp_path):
    base = tmp_path / "base"
    model, tok = models.load_model("tiny", device="cpu", env=make_env("shop"))
    model.save_pretrained(base)
    tok.save_pretrained(base)
    out = tmp_path / "run"
    results = ablation.main(["--quick", "--base", str(base), "--out", str(out)])

    arms = results[0]
    assert sorted(arms) == [1, 2, 3, 4, 5]
    for arm, r in arms.items():
        f = r["final"]
        assert 0 <= f["greedy_pass1"] <= 1 and 0 <= f["pass2"] <= f["sampled_pass1"] <= 1, (arm, f)
        assert r["curve"][-1][1] == f["greedy_pass1"]  # the curve ends at the final evaluation
    for arm in (3, 4, 5):  # start, the step-1 checkpoint, the end; two logged GRPO steps
        assert len(arms[arm]["curve"]) == 3 and [row["step"] for row in arms[arm]["dynamics"]] == [1, 2]
        assert arms[arm]["seconds"] > 0
    assert arms[2]["sft_steps"] >= 1 and arms[2]["curve"][0] == (0.0, arms[1]["final"]["greedy_pass1"])
    assert arms[5]["curve"][0][1] == arms[5]["base_greedy_pass1"]

    md = (out / "results.md").read_text()
    for arm, name in ablation.ARMS.items():
        row = next(line for line in md.splitlines() if line.startswith(f"| {arm} {name} |"))
        assert row.split("|")[2].strip() == f"{arms[arm]['final']['greedy_pass1']:.3f}"
    base_row = next(line for line in md.splitlines() if line.startswith("| 0 base"))
    assert base_row.split("|")[2].strip() == f"{arms[5]['base_greedy_pass1']:.3f}"
    assert "| 3 - 1 |" in md and "--quick" in md and f"Arm 2 ran {arms[2]['sft_steps']} SFT steps" in md
    for png in ("ablation.png", "dynamics.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    saved = json.loads((out / "results.json").read_text())
    assert saved["results"]["0"]["3"]["final"] == arms[3]["final"]
    # --replot rewrites the table and pictures from results.json alone, to the same table
    (out / "results.md").unlink()
    ablation.main(["--replot", str(out)])
    assert (out / "results.md").read_text() == md


def test_bad_options_are_refused_by_name(tmp_path):
    import pytest

    for opt in ("--trials", "--seeds", "--eval-tasks", "--points"):
        bad = "1" if opt == "--trials" else "0"
        with pytest.raises(SystemExit, match=opt):
            ablation.main(["--quick", opt, bad, "--base", str(tmp_path), "--out", str(tmp_path / "x")])
