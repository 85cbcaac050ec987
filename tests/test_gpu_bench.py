"""bench/gpu.py, the GPU checks, at toy size on the CPU (`--cpu`), so that the script a GPU session runs first
cannot rot: every check that can run here passes, and the GPU-only ones say why they were skipped."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_gpu_checks_pass_at_toy_size_on_the_cpu(tmp_path):
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "gpu.py"), "--cpu", "--out", str(tmp_path)],
                       cwd=ROOT, capture_output=True, text=True, timeout=900)
    rows = {row["check"]: row for row in json.loads((tmp_path / "report.json").read_text())}
    assert r.returncode == 0, (rows, r.stderr[-3000:])
    assert [c for c in rows] == ["versions", "engine", "flash", "kv_peak", "decode", "roofline", "decode_layouts",
                                 "head_grad", "share_opening", "train", "lora", "fsdp2", "zero3", "fsdp2_x2"]
    passed = {c for c, row in rows.items() if row["status"] == "PASS"}
    assert passed == {"versions", "engine", "decode", "roofline", "decode_layouts", "share_opening", "train", "lora"}
    layouts = rows["decode_layouts"]  # the five layouts played the same episodes; sharing holds and reads less
    assert layouts["same_episodes"] is True and layouts["opening_tokens"] > 250
    for graphed in ("", " graphed"):
        assert layouts["shared" + graphed]["read_MiB_a_step"] < layouts["per-row" + graphed]["read_MiB_a_step"]
        assert layouts["shared" + graphed]["pools_MiB"] < layouts["per-row" + graphed]["pools_MiB"]
    assert all("graphed uncut" in rows["roofline"][f"toy b{b} ctx{c}"] for b in (4, 16) for c in (128, 512))
    assert "ms a step" in rows["roofline"]["toy b4 ctx128 compiled"]  # measured last, after the grid
    first = rows["roofline"]["toy b4 ctx128"]
    assert "replays" in first and "x the eager step's before" in first
    assert "graphed" in rows["roofline"]["toy b4 ctx128 greedy"]
    alone = rows["roofline"]["toy b16 ctx512 alone"]  # the target point's parts, each alone
    assert "GB/s" in alone["attention"] and "GB/s" in alone["gemms"] and "ms of the graphed step's" in alone["the rest"]
    errors = rows["share_opening"]["bf16 gradient error vs float32"]
    assert 0 < errors["whole"] < 0.1 and errors["shared"] <= 2 * errors["whole"]
    assert all(rows[c]["why"] == "needs CUDA" for c in ("flash", "kv_peak", "fsdp2", "zero3", "fsdp2_x2"))
    # the CPU has no one-GEMM float32 accumulation: it measures the cast-and-add path, against float32 arithmetic
    head = rows["head_grad"]
    assert head["status"] == "SKIP" and head["cast and add"]["one_gemm"] is False
    assert 0 < head["cast and add"]["max_error"] < 1e-2
    assert rows["engine"]["all"] == rows["engine"]["max_batch 2"] == rows["engine"]["parked"] == "4/4 equal"
    assert rows["engine"]["prefill chunks"] == rows["engine"]["slow user"] == rows["engine"]["graphed"] == "4/4 equal"
    assert rows["engine"]["graphed again"] == rows["engine"]["uncut"] == "4/4 equal"  # the kept pool, a second rollout
    assert rows["engine"]["shared"] == rows["engine"]["shared graphed"] == "4/4 equal"  # the openings held apart
    again = rows["engine"]["graphed again: time"]  # the kept step reused (the CPU runs the body: nothing captured)
    assert again.endswith(", 0 replays") and "beside the kept graphs'" in again
    # every row decoded to its cap at the engine's real positions (past the openings' ~700 tokens), none stopped early
    assert rows["decode"]["tokens"] == "64 of 64" and rows["decode"]["ends"] == {"response_truncated": 4}
    assert rows["train"]["kl"][0] == 0.0 and all(g > 0 for g in rows["train"]["grad_norm"])
    assert rows["lora"]["kl"][0] == 0.0 and rows["lora"]["base bit-identical"] is True
    assert rows["lora"]["lora_decode_same_episodes"] == 1.0  # fp32: folded adapters play the same greedy tokens
    assert (tmp_path / "report.md").read_text().startswith("# bench/gpu.py report")


def test_a_check_that_fails_after_its_first_figures_keeps_them(tmp_path):
    """A check that crashes late (on an H200, share_opening's float32 comparison ran out of memory after the timed
    updates) is a FAIL that still reports what it measured before."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import gpu

    def late_crash():
        gpu.PROGRESS({"micro-batches of 4": {"x": 1.3}})
        raise RuntimeError("out of memory")

    report = gpu.Report(tmp_path)
    report.run("late", late_crash)
    report.run("clean", lambda: ("PASS", {"a": 1}))
    rows = {row["check"]: row for row in json.loads((tmp_path / "report.json").read_text())}
    assert rows["late"]["status"] == "FAIL" and rows["late"]["micro-batches of 4"] == {"x": 1.3}
    assert "out of memory" in rows["late"]["error"]
    assert rows["clean"] == {"check": "clean", "status": "PASS", "a": 1, "seconds": rows["clean"]["seconds"]}
