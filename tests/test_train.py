"""The entry points end to end on a toy environment: grpo.py main (updates, resume, skipped steps, options,
two processes), sft.py (data errors, training), eval.py (pass^k)."""
import hashlib
import json
import re
import os
import sys
import warnings
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from plumbing import coldstart, conversations, disk, models, stats
import eval as evaluation
import grpo
from fast import logprobs
import muarl
import sft
import toolcall
import two_procs
from envs.users import GREETING
from plumbing.metrics import reward_checks, rollout_metrics

FAKE_ENV = "tests.fake_env:FakeEnv"  # a plug-in environment is named again on --resume

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def grpo_args(ckpt, out, *extra):
    return ["--init-from", str(ckpt), "--env", "tests.fake_env:FakeEnv", "--steps", "2", "--tasks-per-step", "2",
            "--group-size", "4", "--max-new-tokens", "48", "--max-context", "512", "--eval-tasks", "0",
            "--lr", "1e-2", "--micro-batch-size", "3", "--temperature", "1.0", "--out-dir", str(out), *extra]


def weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def metrics(run_dir):
    return [json.loads(line) for line in open(run_dir / "metrics.jsonl")]


@pytest.mark.versions
def test_grpo_moves_every_parameter_and_logs(tmp_path, ckpt, start_lm):
    res = grpo.main(grpo_args(ckpt, tmp_path / "run"))
    before, after = weights(start_lm), weights(res.model)
    for name, w in before.items():
        assert not torch.equal(w, after[name]), f"{name} did not move"
    rows = metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2]
    for key in ("reward_mean", "all_correct_ratio", "all_wrong_ratio", "turns_mean", "response_tokens_mean",
                "kl", "clip_frac_low", "clip_frac_high", "entropy", "grad_norm", "logprob_gap", "loss",
                "gen_tokens_per_s", "rollout_s", "update_s", "tool_calls/transfer_to_human_agents"):
        assert key in rows[0], key
    assert 0 < rows[0]["reward_mean"] < 1  # the toy reward is a coin flip: groups are mixed
    # Same weights as the sampler in a one-update step: the trainer's logprobs match the sampler's.
    assert rows[0]["logprob_gap"] < 1e-4
    ck = tmp_path / "run" / "checkpoints" / "step-000002"
    assert (ck / "model" / "model.safetensors").exists() and (ck / "model" / "tokenizer.json").exists()
    assert json.loads((ck / "model" / "muarl_config.json").read_text())["grpo"]["group_size"] == 4
    episodes = [json.loads(line) for line in open(tmp_path / "run" / "episodes.jsonl")]
    assert episodes and episodes[0]["messages"][0]["role"] == "system"


def test_grpo_with_a_slow_flaky_user_endpoint_logs_its_latency_and_retries(tmp_path, ckpt, capsys):
    """GRPO against a real OpenAI-compatible endpoint (a local HTTP server) whose replies take 0.3 s and whose first
    reply request fails with a 500: the step's metrics carry the user's latency and the retry, and the console line
    shows them."""
    import time

    from conftest import ChatServer

    failed = []

    def script(body, n):
        if body["messages"][-1]["content"] == GREETING:  # an opening: at once
            return 200, {"content": "Hello, I need help."}
        time.sleep(0.3)
        if not failed:
            failed.append(n)
            return 500, {}
        return 200, {"content": "Thanks, that is all. ###STOP###"}

    server = ChatServer(script)
    try:
        grpo.main(grpo_args(ckpt, tmp_path / "run", "--user-sim", "openai", "--user-base-url", server.url,
                            "--user-model", "sim"))
    finally:
        server.close()
    rows = metrics(tmp_path / "run")
    assert rows[0]["user_retries"] + rows[1]["user_retries"] == 1
    assert all(0.3 <= r["user_latency_s_mean"] <= r["user_latency_s_max"] for r in rows)
    assert "retries" in capsys.readouterr().out  # the console line shows a slow or flaky user


def test_step_metrics_average_the_rewards_checks():
    def summary(reward, info, valid=True):
        return {"reward": reward, "valid": valid, "turns": 3, "gen_tokens": 10, "termination": "user_stop",
                "tool_calls": {}, "tool_errors": 0, "task_id": "t", "checks": reward_checks(info)}

    assert reward_checks({"db_match": True, "unconfirmed_writes": ["cancel_order"], "differ": [], "env_reward": 0.0,
                               "ended_early": "max_turns"}) == {"db_match": True, "unconfirmed_writes": True, "differ": False}
    rows = [summary(1.0, {"db_match": True, "unconfirmed_writes": []}),
            summary(0.0, {"db_match": True, "unconfirmed_writes": ["cancel_order"]}),
            summary(0.0, {"db_match": False, "unconfirmed_writes": ["return_item", "cancel_order"]}),
            summary(0.0, {"db_match": False, "unconfirmed_writes": []}, valid=False)]  # left out: infra failure
    m = rollout_metrics(rows, G=2)
    assert m["reward_info/db_match"] == pytest.approx(2 / 3) and m["reward_info/unconfirmed_writes"] == pytest.approx(2 / 3)
    assert m["reward_mean"] == pytest.approx(1 / 3)


def test_freeze_keeps_matching_parameters_and_trains_the_rest(tmp_path, ckpt, start_lm):
    res = grpo.main(grpo_args(ckpt, tmp_path / "run", "--freeze", "embed_tokens|layers\\.0\\."))
    before, after = weights(start_lm), weights(res.model)
    frozen = [k for k in before if "embed_tokens" in k or "layers.0." in k]
    frozen += ["lm_head.weight"] if start_lm.config.tie_word_embeddings else []  # the embeddings, tied
    assert frozen and all(torch.equal(before[k], after[k]) for k in frozen)
    assert all(not torch.equal(before[k], after[k]) for k in before if k not in frozen)
    for bad, why in (("nothing_named_so", "matches no parameter"), ("(", "not a regular expression"),
                     (".*", "matches every parameter name: nothing would train")):
        with pytest.raises(SystemExit, match=why) as e:
            grpo.main(grpo_args(ckpt, tmp_path / "bad", "--freeze", bad))
        assert "--freeze" in str(e.value)


def test_checkpoints_pruned_and_weights_only(tmp_path, ckpt):
    grpo.main(grpo_args(ckpt, tmp_path / "a", "--steps", "3", "--save-every", "1", "--keep-checkpoints", "2"))
    kept = sorted(p.name for p in (tmp_path / "a" / "checkpoints").iterdir())
    assert kept == ["latest.json", "step-000002", "step-000003"]
    grpo.main(grpo_args(ckpt, tmp_path / "b", "--save-weights-only"))
    ck = tmp_path / "b" / "checkpoints" / "step-000002"
    assert (ck / "model" / "model.safetensors").exists() and not (ck / "accelerate").exists()
    with pytest.raises(SystemExit, match="save-weights-only"):
        grpo.main(["--resume", str(tmp_path / "b"), "--env", FAKE_ENV, "--steps", "4"])


@pytest.mark.versions
def test_resume_continues_exactly(tmp_path, ckpt):
    full = grpo.main(grpo_args(ckpt, tmp_path / "a", "--steps", "4", "--save-every", "2"))
    grpo.main(grpo_args(ckpt, tmp_path / "b", "--steps", "2", "--save-every", "2"))
    resumed = grpo.main(["--resume", str(tmp_path / "b"), "--env", FAKE_ENV, "--steps", "4"])
    a, b = weights(full.model), weights(resumed.model)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    la, lb = metrics(tmp_path / "a"), metrics(tmp_path / "b")
    assert [r["step"] for r in lb] == [1, 2, 3, 4]
    assert [r["loss"] for r in la] == [r["loss"] for r in lb]
    assert [r["reward_mean"] for r in la] == [r["reward_mean"] for r in lb]


def test_non_finite_step_is_skipped_and_counted(tmp_path, ckpt, start_lm, monkeypatch):
    real = grpo.grpo_loss

    def broken(*a, **k):
        loss, met = real(*a, **k)
        return loss * float("nan"), met
    monkeypatch.setattr(grpo, "grpo_loss", broken)
    res = grpo.main(grpo_args(ckpt, tmp_path / "run", "--steps", "1"))
    assert metrics(tmp_path / "run")[0]["skipped_updates"] == 1
    before, after = weights(start_lm), weights(res.model)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_non_finite_reward_is_left_out_not_scored(tmp_path, ckpt):
    args = grpo_args(ckpt, tmp_path / "run", "--steps", "1")
    args[args.index("tests.fake_env:FakeEnv")] = "tests.fake_env:NanEnv"
    grpo.main(args)
    row = metrics(tmp_path / "run")[0]
    assert row["infra_failed"] == 4 and row["episodes"] == 8  # task train-0's group of 4
    assert row["termination/infra_error"] == 0.5 and row["skipped_updates"] == 0


@pytest.mark.parametrize("argv, option", [
    (["--agg", "nope"], "--agg"), (["--group-size", "1"], "--group-size"), (["--user-sim", "x"], "--user-sim"),
    (["--tasks-per-step", "0"], "--tasks-per-step"), (["--temperature", "0"], "--temperature"),
    (["--optimizer", "lion"], "--optimizer"), (["--cold-start-skips-confirm", "2"], "--cold-start-skips-confirm"),
    (["--env-reward", "db"], "--env-reward"), (["--decode-slots", "foo"], "--decode-slots"),
    (["--compile-decode", "foo"], "grpo.py: --compile-decode"), (["--decode-graphs", "yes"], "grpo.py: --decode-graphs"),
    (["--decode-attention", "flat"], "grpo.py: --decode-attention"),
    (["--decode-share-opening", "--decode-attention", "model"], "grpo.py: --decode-share-opening"),
    # set where nothing reads them: refused, not silently ignored
    (["--tis-cap", "3"], "grpo.py: --tis-cap: 3.0 has no effect without --correction tis"),
    (["--turn-discount", "0.5"], "grpo.py: --turn-discount: 0.5 has no effect without --credit turn-discount"),
    (["--policy-loss", "cispo", "--dual-clip", "2"], "grpo.py: --dual-clip: 2.0 has no effect without --policy-loss"),
    (["--rollout", "reference", "--decode-slots", "2x512"], "grpo.py: --decode-slots: '2x512' has no effect without"),
])
def test_bad_option_fails_at_start_naming_it(tmp_path, ckpt, argv, option, capsys, monkeypatch):
    from plumbing import policy

    monkeypatch.setattr(policy, "load_policy", lambda run: pytest.fail("the model loaded before the refusal"))
    with pytest.raises(SystemExit) as e:
        grpo.main(grpo_args(ckpt, tmp_path / "run", *argv))
    assert option in str(e.value)


def test_an_option_without_effect_is_refused_for_new_runs_only_and_0_turns_one_off():
    """A run saved before the refusal of options set where nothing reads them resumes as it ran (they cannot change
    in a resume); a value that turns an option off (--dual-clip 0) has no effect to refuse."""
    from plumbing import options

    options.validate(grpo.Config(tis_cap=3.0, resume="runs/old"), 1)
    options.validate(grpo.Config(policy_loss="cispo", dual_clip=0.0), 1)
    with pytest.raises(SystemExit, match="^grpo.py: --tis-cap: 3.0 has no effect without --correction tis$"):
        options.validate(grpo.Config(tis_cap=3.0), 1)


def test_the_models_attention_under_flash_cannot_decode_and_is_refused():
    from fast.batched_rollout import RolloutConfig

    cfg = evaluation.EvalConfig(attn="flash", decode_attention="model")
    with pytest.raises(SystemExit, match=r"^--decode-attention model: .*--attn flash .*give --decode-attention grouped"):
        RolloutConfig.from_options(cfg, on_gpu=True)
    assert RolloutConfig.from_options(replace(cfg, decode_attention="grouped"), on_gpu=True).decode_attention == "grouped"


def test_training_on_the_test_split_says_its_evaluations_are_not_held_out(tmp_path, ckpt, capsys):
    """--split test with evaluations on --env's test split trains on the tasks it reports as held out: a warning at
    start and summary.json say so; evaluated elsewhere (--eval-env), or on no task, it is not."""
    grpo.main(grpo_args(ckpt, tmp_path / "run", "--split", "test", "--steps", "1", "--eval-tasks", "1"))
    assert "[grpo] warning: --split test: the run trains on the test tasks its evaluations hold out" in \
        capsys.readouterr().out
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["eval_tasks_trained_on"] is True
    grpo.main(grpo_args(ckpt, tmp_path / "other", "--split", "test", "--steps", "1", "--eval-tasks", "1",
                        "--eval-env", "tests.fake_env:OtherEnv"))
    assert "warning: --split test" not in capsys.readouterr().out
    assert "eval_tasks_trained_on" not in json.loads((tmp_path / "other" / "summary.json").read_text())


def test_tiny_without_a_cold_start_outside_shop_fails_naming_env(capsys):
    with pytest.raises(SystemExit) as e:
        grpo.main(["--env", "bfcl:multi_turn_base", "--eval-tasks", "0"])
    assert "--env" in str(e.value) and "--init-from" in str(e.value)


def test_unknown_option_fails(capsys):
    with pytest.raises(SystemExit):
        grpo.main(["--no-such-option", "1"])
    assert "--no-such-option" in capsys.readouterr().err


def _torchrun(tmp_path, argv, prologue="", port=29519, timeout=300):
    """grpo.main under torchrun on two CPU processes (the Accelerator joins them over gloo); `prologue` runs first in
    each (e.g. to slow one down). Each process writes a hash of its final weights to OUT/weights-RANK.sha."""
    script = tmp_path / "dist.py"
    script.write_text(
        f"import os, sys, time, hashlib\nsys.path.insert(0, {ROOT!r})\n{prologue}\nimport grpo\n"
        "res = grpo.main(sys.argv[1:])\n"
        "h = hashlib.sha256(b''.join(v.detach().numpy().tobytes() for v in res.model.state_dict().values()))\n"
        "open(sys.argv[sys.argv.index('--out-dir') + 1] + f'/weights-{os.environ[\"RANK\"]}.sha', 'w')"
        ".write(h.hexdigest())\n")
    return two_procs.torchrun([str(script), *argv], port, timeout)  # a hang fails with each process's Python stacks


def test_a_launch_that_hangs_fails_with_its_processes_stacks():
    """two_procs.run, the launcher of the two-process tests: a child that never ends is shown where it waits."""
    child = "import time\ndef waiting_here():\n    time.sleep(120)\nwaiting_here()"
    cmd = [sys.executable, "-c", f"import subprocess, sys; subprocess.run([sys.executable, '-c', {child!r}])"]
    with pytest.raises(pytest.fail.Exception) as e:
        two_procs.run(cmd, timeout=3)
    assert "did not end within 3 s (the launcher was still running)" in str(e.value)
    assert "waiting_here" in str(e.value)  # the child's Python stack, printed at SIGABRT


@pytest.mark.versions
def test_two_processes_end_with_identical_weights(tmp_path, ckpt):
    """torchrun starts two CPU processes that the Accelerator joins over gloo; each rolls out one task."""
    out = tmp_path / "run"
    r = _torchrun(tmp_path, grpo_args(ckpt, out), port=29517)
    assert r.returncode == 0, r.stderr[-3000:]
    h0, h1 = (out / "weights-0.sha").read_text(), (out / "weights-1.sha").read_text()
    assert h0 == h1
    from transformers import AutoModelForCausalLM
    init = AutoModelForCausalLM.from_pretrained(ckpt)
    h_init = hashlib.sha256(b"".join(v.detach().numpy().tobytes() for v in init.state_dict().values())).hexdigest()
    assert h0 != h_init  # they trained (identical because they never moved would also be "identical")
    rows = metrics(out)
    assert all(r["episodes"] == 8 for r in rows)  # 2 tasks x 4, gathered from both processes
    assert all(r["skipped_updates"] == 0 for r in rows)


def test_two_processes_drop_uniform_groups_in_step(tmp_path, ckpt):
    """--drop-uniform-groups under torchrun: one process's only group is uniform in every step, so it has nothing to
    train on; it still runs the micro-batches the other one runs (empty ones), and both end with the same weights."""
    out = tmp_path / "run"
    args = grpo_args(ckpt, out, "--drop-uniform-groups", "--steps", "3")
    args[args.index("tests.fake_env:FakeEnv")] = "tests.fake_env:HalfUniformEnv"
    r = _torchrun(tmp_path, args, port=29518)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (out / "weights-0.sha").read_text() == (out / "weights-1.sha").read_text()
    rows = metrics(out)
    assert all(r["dropped_groups"] >= 1 for r in rows)  # train-0's group, every step
    assert any(r["trained_tokens"] > 0 for r in rows)  # and train-1's trained


def test_a_process_that_waits_past_the_timeout_stops_naming_the_option(tmp_path, ckpt):
    """One process's rollout takes longer than --dist-timeout: the other, waiting at the step's first collective,
    stops with an error that names the option instead of hanging (or dying at NCCL's fixed 10 minutes)."""
    slow = ("from fast import batched_rollout\nif os.environ['RANK'] == '1':\n    real = batched_rollout.rollout\n"
            "    batched_rollout.rollout = lambda *a, **k: (time.sleep(12), real(*a, **k))[1]\n")
    r = _torchrun(tmp_path, grpo_args(ckpt, tmp_path / "run", "--dist-timeout", "3", "--steps", "1"), slow, 29519)
    assert r.returncode != 0
    assert "waited more than --dist-timeout 3 s for another at a collective" in r.stderr + r.stdout, r.stderr[-3000:]


@pytest.mark.parametrize("where", ["metrics", "evaluation"])
def test_a_write_the_main_disk_refuses_stops_every_process_in_one_line(tmp_path, ckpt, where):
    """The main process's disk fills while step 2's metrics line is appended, or while step 1's evaluation is written:
    the file is cut back or removed and every process stops in one line (the main's names the file and the --resume
    command), none with a traceback at its next collective."""
    name, at, port = {"metrics": ("metrics.jsonl", '{"step": 2,', 29521),
                      "evaluation": ("eval-step1.jsonl", "", 29522)}[where]
    full = (f"sys.path.insert(0, {os.path.join(ROOT, 'tests')!r})\nimport test_failures\nfrom plumbing import rundir\n"
            f"if os.environ['RANK'] == '0':\n    test_failures.fills_at(rundir, __import__('pytest').MonkeyPatch(), "
            f"{name!r}, {at!r})\n")
    run = tmp_path / "run"
    r = _torchrun(tmp_path, grpo_args(ckpt, run, "--steps", "3", "--save-every", "1", "--eval-tasks", "2",
                                      "--eval-every", "1"), full, port=port)
    assert r.returncode != 0
    said = {"metrics": r"writing step 2's metrics to .*metrics.jsonl failed: .*No space left on device \(is the disk "
                       r"full or read-only\?\)\. The log was cut back to where it was; the newest checkpoint, "
                       r"step-000001, is untouched",
            "evaluation": r"writing the episodes of the evaluation at step 1 to .*eval-step1.jsonl failed: .*No space "
                          r"left on device \(is the disk full or read-only\?\)\. The file was removed; no checkpoint "
                          r"was saved before it"}[where]
    assert re.search(rf"grpo.py: {said}\. Make room, then: accelerate launch grpo.py --resume", r.stderr), r.stderr[-3000:]
    assert "grpo.py: stopped with the process whose disk refused a write" in r.stderr, r.stderr[-3000:]
    assert "[rank0]: Traceback" not in r.stderr and "[rank1]: Traceback" not in r.stderr, r.stderr[-3000:]
    assert [json.loads(line)["step"] for line in open(run / "metrics.jsonl")] == [1] if where == "metrics" else \
        not (run / "metrics.jsonl").exists() and not (run / "eval-step1.jsonl").exists()


# A disk that fills on one process while step 2's checkpoint is written: (rank, what fails there, the launch's port)
CHECKPOINT_FILLS = {
    "the main's states": (0, "accelerate:Accelerator.save_state", 29523),  # its model, optimizer and RNG state
    "the other's states": (1, "accelerate:Accelerator.save_state", 29524),  # its RNG state
    "the main's last files": (0, "plumbing.checkpoints:finish", 29525),  # trainer_state.json, rename, latest.json
    "the main's model": (0, "plumbing.checkpoints:_write_pretrained", 29526),  # the weights and tokenizer
    "the main's room check": (0, "plumbing.checkpoints:room_needed", 29527),  # before the first byte
}


@pytest.mark.parametrize("where", sorted(CHECKPOINT_FILLS))
def test_a_checkpoint_one_processs_disk_refuses_stops_every_process_in_one_line(tmp_path, ckpt, where):
    """The disk of one of two processes fills while step 2's checkpoint is written: the partial copy is removed and
    every process stops at the same collective, the one whose disk refused with the line that says how to go on, the
    other saying so; none with a traceback, none left waiting at a later collective."""
    rank, fails, port = CHECKPOINT_FILLS[where]
    module, attribute = fails.split(":")
    owner, name = attribute.rpartition(".")[::2]
    full = (f"import errno, importlib\nif os.environ['RANK'] == '{rank}':\n"
            f"    owner = importlib.import_module({module!r})\n"
            f"    owner = getattr(owner, {owner!r}) if {owner!r} else owner\n"
            f"    real = getattr(owner, {name!r})\n"
            "    def full(*a, **k):\n"
            "        if 'step-000002' in ' '.join(map(str, a)):\n"
            "            raise OSError(errno.ENOSPC, 'No space left on device')\n"
            "        return real(*a, **k)\n"
            f"    setattr(owner, {name!r}, full)\n")
    run = tmp_path / "run"
    r = _torchrun(tmp_path, grpo_args(ckpt, run, "--steps", "3", "--save-every", "1"), full, port=port)
    assert r.returncode != 0
    assert re.search(r"grpo.py: writing the checkpoint of step 2 into .*checkpoints failed: \[Errno 28\] No space left "
                     r"on device \(is the disk full or read-only\?\)\. The partial copy was removed; the newest "
                     r"checkpoint, step-000001, is untouched\. Make room, then: accelerate launch grpo.py --resume",
                     r.stderr), r.stderr[-3000:]
    assert "grpo.py: stopped with the process whose disk refused a write" in r.stderr, r.stderr[-3000:]
    assert "[rank0]: Traceback" not in r.stderr and "[rank1]: Traceback" not in r.stderr, r.stderr[-3000:]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest.json", "step-000001"]
    assert [json.loads(line)["step"] for line in open(run / "metrics.jsonl")] == [1, 2]


def test_a_process_whose_episodes_all_failed_keeps_in_step(tmp_path, ckpt):
    """Each process rolls out one task; every episode of train-0 fails on infrastructure (a NaN reward), so one
    process has nothing to train on in every step: it runs the same collectives as the other (empty micro-batches,
    the same metric names), and the run ends."""
    args = grpo_args(ckpt, tmp_path / "run", "--steps", "2")
    args[args.index("tests.fake_env:FakeEnv")] = "tests.fake_env:NanEnv"
    r = _torchrun(tmp_path, args, port=29520)
    # Once under a loaded machine (load 5 on 2 cores), a process aborted in gloo's teardown after the run had ended
    # (summary.json written, after the processes' last barrier): not what this test examines, so it is reported
    # (as tests/test_sharding.py does); any other failure fails.
    teardown_abort = "SIGABRT" in r.stderr + r.stdout and (tmp_path / "run" / "summary.json").exists()
    assert r.returncode == 0 or teardown_abort, r.stderr[-3000:]
    if r.returncode:
        warnings.warn("two processes: one aborted in gloo's teardown after the run ended")
    rows = metrics(tmp_path / "run")
    assert [row["infra_failed"] for row in rows] == [4, 4] and all(row["trained_tokens"] > 0 for row in rows)


# ---------------------------------------------------------------------------------------------------------
def test_sft_data_errors_name_file_and_line(tmp_path):
    p = tmp_path / "d.jsonl"
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    p.write_text(json.dumps(good) + "\n\n" + "{not json\n")
    with pytest.raises(ValueError, match=r"d.jsonl:3"):
        conversations.load_conversations(str(p), strict=True)
    p.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(ValueError, match=r"d.jsonl:1.*no assistant"):
        conversations.load_conversations(str(p))
    p.write_text(json.dumps({**good, "prompt_messages": 2}) + "\n")  # the only assistant turn is prompt
    with pytest.raises(ValueError, match=r"d.jsonl:1.*prompt_messages"):
        conversations.load_conversations(str(p))
    p.write_text(json.dumps({**good, "prompt_messages": 1}) + "\n")
    assert conversations.load_conversations(str(p))[0]["prompt_messages"] == 1
    # roles out of order (a system message after the start), a call of a tool the conversation does not offer
    late = {"messages": [{"role": "assistant", "content": "hello"}, {"role": "system", "content": "policy"},
                         {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    p.write_text(json.dumps(late) + "\n")
    with pytest.raises(ValueError, match=r"d.jsonl:1: malformed conversation: message 1: a system message after the conversation began"):
        conversations.load_conversations(str(p), strict=True)
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "format_disk", "arguments": "{}"}}]}
    unknown = {**good, "messages": good["messages"] + [call], "tools": [{"type": "function", "function": {
        "name": "get_order", "parameters": {"type": "object", "properties": {}}}}]}
    p.write_text(json.dumps(unknown) + "\n" + json.dumps(good) + "\n")
    with pytest.raises(ValueError, match=r"d.jsonl:1: .*message 2: calls .format_disk., which is not among the "
                                         r"conversation's tools \(get_order\)"):
        conversations.load_conversations(str(p), strict=True)
    assert len(conversations.load_conversations(str(p))) == 1  # skipped and counted, not trained on
    schema = {"name": "format_disk", "parameters": {"type": "object", "properties": {}}}  # flat, as some exports
    p.write_text(json.dumps({**good, "messages": good["messages"] + [call], "tools": [{"type": "function", **schema}]})
                 + "\n")
    assert conversations.load_conversations(str(p), strict=True)[0]["tools"] == [{"type": "function", "function": schema}]


def test_sft_windows_train_only_the_agent_message_that_ends_them(tiny_tok):
    import muarl

    call = {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {
        "name": "get_order", "arguments": json.dumps({"order_id": "o42"})}}]}
    msgs = [{"role": "system", "content": "policy"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "Which order?"}, {"role": "user", "content": "Order o42."}, call,
            {"role": "tool", "tool_call_id": "c1", "name": "get_order", "content": '{"status":"pending"}'},
            {"role": "assistant", "content": "Cancel order o42?"}, {"role": "user", "content": "yes"},
            {"role": "assistant", "content": "Done."}]
    wins = coldstart.windows([{"messages": msgs, "tools": [{"type": "function", "function": {"name": "get_order"}}],
                         "prompt_messages": 2}])
    # The call (index 4) and "Cancel order o42?" (index 6) carry arguments; "Which order?" and "Done." do not.
    # Sizes 1, 2, 4, cut forward to a user message: the call gets [3:5] (sizes 1 and 2, once) and [1:5]; the
    # question gets [3:7] (size 4; sizes 1 and 2 hold no user message).
    assert [[m["content"] for m in w["messages"]] for w in wins] == [
        ["Order o42.", ""], ["hi", "Which order?", "Order o42.", ""],
        ["Order o42.", "", '{"status":"pending"}', "Cancel order o42?"]]
    for w in wins:
        assert w["messages"][0]["role"] == "user" and w["tools"] == []
        assert w["prompt_messages"] == len(w["messages"]) - 1
        ids, mask = muarl.encode_conversation(tiny_tok, w["messages"], w["tools"], w["prompt_messages"])
        trained = [i for i, m in zip(ids, mask) if m]
        last = toolcall.encode_text(tiny_tok, toolcall.format_assistant(w["messages"][-1])) + [muarl.end_of_turn_id(tiny_tok)]
        assert trained == last and ids[-len(last):] == last


def fake_conversations(n=4):
    from envs import play
    from tests.fake_env import FakeEnv

    class Agent:
        def act(self, messages):
            return {"role": "assistant", "content": "Sure, done."}
    env = FakeEnv(n_tasks=n)
    return [{"messages": play(env, t, Agent())[0], "tools": env.tools(t)} for t in env.tasks("train")]


def test_sft_lowers_the_loss_on_agent_tokens(tmp_path, tiny_tok, tiny_lm):
    ckpt = tmp_path / "init"
    tiny_lm.save_pretrained(ckpt)
    tiny_tok.save_pretrained(ckpt)
    convs = fake_conversations()
    p = tmp_path / "c.jsonl"
    p.write_text("".join(json.dumps(c) + "\n" for c in convs))
    out = sft.train(sft.SFTConfig(model=str(ckpt), out=str(tmp_path / "sft"), epochs=10, batch_size=4,
                                  micro_batch_size=2, warmup_steps=1, lr=1e-2), conversations.load_conversations(str(p)))
    import muarl
    from fast.logprobs import token_logprobs
    losses = []
    for path in (ckpt, out):
        model, tok = models.load_model(str(path), device="cpu")
        ids, attn, mask = muarl.collate([muarl.encode_conversation(tok, c["messages"], c["tools"]) for c in convs],
                                        tok.pad_token_id)
        with torch.no_grad():
            losses.append(-(token_logprobs(model, ids, attn) * mask).sum().item() / mask.sum().item())
    assert losses[1] < 0.4 * losses[0]
    assert json.loads((out / "muarl_config.json").read_text())["sft"]["epochs"] == 10


def test_sft_says_when_its_steps_draw_fewer_conversations_than_its_epochs_ask_or_never_finish_warming_up(
        tmp_path, tiny_tok, tiny_lm, capsys):
    """The steps are whole batches, rounded down (reproducing the committed checkpoints exactly): 15 conversations,
    one epoch, batches of 8 make one step, which draws 8; and a warm-up longer than the run never reaches --lr. Both
    are said, not silent; a run that draws what it asks says nothing."""
    ckpt = tmp_path / "init"
    tiny_lm.save_pretrained(ckpt)
    tiny_tok.save_pretrained(ckpt)
    convs = fake_conversations(15)
    sft.train(sft.SFTConfig(model=str(ckpt), out=str(tmp_path / "a"), epochs=1, batch_size=8, micro_batch_size=8),
              convs)
    out = capsys.readouterr().out
    assert ("[sft] warning: 1 step(s) of 8 draw 8 conversations, not the 15 that --epochs 1 of 15 asks for: raise "
            "--epochs or lower --batch-size") in out
    assert "[sft] warning: --warmup-steps 10 is more than the 1 step(s): the learning rate reaches 0.1 of --lr" in out
    sft.train(sft.SFTConfig(model=str(ckpt), out=str(tmp_path / "b"), epochs=1, batch_size=5, micro_batch_size=5,
                            warmup_steps=1), convs)
    assert "warning" not in capsys.readouterr().out


def test_sft_max_len_defaults_to_the_model_context_and_says_how_much_to_raise_it(tmp_path, tiny_tok, tiny_lm):
    """--max-len 0 (the default) keeps every conversation the model's context holds; when nothing fits, the error
    names the option and the length needed (the README's tau2 cold start used 2048, below a retail opening)."""
    import copy

    ckpt = tmp_path / "init"
    tiny_lm.save_pretrained(ckpt)
    tiny_tok.save_pretrained(ckpt)
    convs = fake_conversations(2)
    shortest = min(len(muarl.encode_conversation(tiny_tok, c["messages"], c["tools"])[0]) for c in convs)
    cfg = sft.SFTConfig(model=str(ckpt), out=str(tmp_path / "sft"), max_len=shortest - 1, epochs=0.5)
    with pytest.raises(ValueError, match=f"--max-len: no conversation fits --max-len {shortest - 1}.*"
                                         f"raise --max-len by at least 1 to {shortest}"):
        sft.train(cfg, convs)
    short = copy.deepcopy(tiny_lm)
    short.config.max_position_embeddings = shortest - 1
    short.save_pretrained(tmp_path / "short")
    tiny_tok.save_pretrained(tmp_path / "short")
    with pytest.raises(ValueError, match=f"longer than the model's context \\({shortest - 1} tokens"):
        sft.train(sft.SFTConfig(model=str(tmp_path / "short"), out=str(tmp_path / "sft")), convs)
    assert sft.SFTConfig().max_len == 0
    assert coldstart.length_limit(sft.SFTConfig(), tiny_lm) == tiny_lm.config.max_position_embeddings


def test_sft_bf16_keeps_small_updates_in_fp32_master_weights(tmp_path, tiny_tok, tiny_lm, bf16_accelerator, monkeypatch):
    """--bf16 SFT trains fp32 master weights under bf16 autocast, as GRPO does: three AdamW steps of lr 1e-5 move
    nearly every weight (and the checkpoint keeps them in fp32), where the same steps on bf16 weights round most
    updates away (a weight of 0.02 has a bf16 spacing of 1.2e-4, far above a step of ~1e-5)."""
    import copy

    from safetensors.torch import load_file

    ckpt = tmp_path / "init"
    tiny_lm.save_pretrained(ckpt)
    tiny_tok.save_pretrained(ckpt)
    convs = fake_conversations()
    seen = []

    def spy(model, *args, **kwargs):  # the passes run under bf16 autocast, on fp32 weights
        seen.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"),
                     next(model.parameters()).dtype))
        return logprobs.token_logprobs(model, *args, **kwargs)
    monkeypatch.setattr(sft, "token_logprobs", spy)
    lr, steps = 1e-5, 3
    out = sft.train(sft.SFTConfig(model=str(ckpt), out=str(tmp_path / "sft"), epochs=steps, batch_size=4,
                                  micro_batch_size=4, warmup_steps=1, lr=lr, bf16=True), convs,
                    accelerator=bf16_accelerator)
    assert seen and set(seen) == {(True, torch.bfloat16, torch.float32)}
    start = tiny_lm.state_dict()
    end = load_file(str(out / "model.safetensors"))
    assert {v.dtype for v in end.values()} == {torch.float32}

    def moved(before, after):
        n = sum((after[k] != before[k]).sum().item() for k in after)
        return n / sum(after[k].numel() for k in after)
    assert moved(start, end) > 0.95

    # the old way: the same steps on bf16 weights (AdamW's first steps have size ~lr whatever the gradient)
    bf16 = copy.deepcopy(tiny_lm).bfloat16().train()
    start = {k: v.clone() for k, v in bf16.state_dict().items() if k in end}
    opt = torch.optim.AdamW(bf16.parameters(), lr=lr, weight_decay=0.0)
    ids, attn, mask = muarl.collate([muarl.encode_conversation(tiny_tok, c["messages"], c["tools"]) for c in convs],
                                    tiny_tok.pad_token_id)
    for _ in range(steps):
        (-(logprobs.token_logprobs(bf16, ids, attn) * mask).sum() / mask.sum()).backward()
        opt.step()
        opt.zero_grad()
    assert moved(start, {k: v for k, v in bf16.state_dict().items() if k in end}) < 0.5


def test_pass_hat_k():
    assert stats.pass_hat_k(4, 4, 4) == 1.0
    assert stats.pass_hat_k(3, 4, 2) == pytest.approx(3 / 6)
    assert stats.pass_hat_k(1, 4, 2) == 0.0
    eps = [{"task_id": t, "reward": r, "infra_failed": False, "turns": 2, "termination": "user_stop",
            "tool_calls": {}} for t, r in [("a", 1), ("a", 1), ("b", 1), ("b", 0)]]
    eps.append({**eps[0], "infra_failed": True, "reward": 0, "termination": "infra_error"})
    s = stats.summarize(eps, 2)
    assert s["pass^1"] == 0.75 and s["pass^2"] == 0.5 and s["infra_failed"] == 1
    s = stats.summarize(eps, 2, {"a": {"kind": "cancel", "seed": 1}, "b": {"kind": "return", "seed": 2}})
    assert s["by_meta"] == {"kind": {"cancel": {"pass^1": 1.0, "episodes": 2, "ci95": (1.0, 1.0)},  # one task each:
                                     "return": {"pass^1": 0.5, "episodes": 2, "ci95": (0.5, 0.5)}}}  # no spread


@pytest.mark.versions
def test_eval_main_writes_summary(tmp_path, ckpt):
    evaluation.main(["--agent", str(ckpt), "--env", "tests.fake_env:FakeEnv", "--num-tasks", "3", "--trials", "2",
                     "--max-new-tokens", "8", "--out-dir", str(tmp_path / "ev")])
    s = json.loads((tmp_path / "ev" / "summary.json").read_text())
    assert s["tasks"] == 3 and s["episodes"] == 6 and "pass^2" in s
    assert (tmp_path / "ev" / "results.md").read_text().startswith("# ")
    assert len((tmp_path / "ev" / "episodes.jsonl").read_text().splitlines()) == 6


def test_the_reference_rollout_trains_and_evaluates_with_the_engine_s_greedy_episodes(tmp_path, ckpt):
    """--rollout reference plays every episode with rollout.reference_rollout (model.generate, one at a time): on
    shop, grpo.main's greedy held-out evaluation and eval.main find exactly the engine's episodes, and a step trains
    on its sampled episodes."""
    common = ["--env", "shop", "--max-new-tokens", "12", "--max-turns", "3", "--max-context", "4096"]
    keys = ("task_id", "messages", "reward", "termination", "turns")
    seen = {}
    for how in ("engine", "reference"):
        grpo.main(["--init-from", str(ckpt), *common, "--steps", "1", "--tasks-per-step", "1", "--group-size", "2",
                   "--eval-tasks", "3", "--rollout", how, "--out-dir", str(tmp_path / f"grpo-{how}")])
        evaluation.main(["--agent", str(ckpt), *common, "--num-tasks", "3", "--rollout", how,
                         "--out-dir", str(tmp_path / f"eval-{how}")])
        played = [tmp_path / f"grpo-{how}" / "eval-before.jsonl", tmp_path / f"eval-{how}" / "episodes.jsonl"]
        seen[how] = [[{k: json.loads(line)[k] for k in keys} for line in f.read_text().splitlines()] for f in played]
        assert metrics(tmp_path / f"grpo-{how}")[0]["trained_tokens"] > 0
    assert [len(eps) for eps in seen["engine"]] == [3, 3]
    assert seen["reference"] == seen["engine"]
    assert any(e["turns"] > 1 for e in seen["engine"][1]), "episodes of one turn would test little"


def test_eval_rollout_batch_and_memory_estimate(tmp_path, ckpt, capsys):
    """eval.py decodes --rollout-batch episodes at a time (the same greedy episodes as all at once) and prints its
    memory estimate, an inference one: weights and the decoding episodes' KV cache, no optimizer or reference."""
    from plumbing import memory

    eps = {}
    for batch in ("0", "2"):
        evaluation.main(["--agent", str(ckpt), "--env", "tests.fake_env:FakeEnv", "--num-tasks", "3", "--trials", "2",
                         "--max-new-tokens", "8", "--rollout-batch", batch, "--out-dir", str(tmp_path / batch)])
        eps[batch] = [json.loads(line)["messages"] for line in open(tmp_path / batch / "episodes.jsonl")]
    assert eps["0"] == eps["2"]
    out = capsys.readouterr().out
    # slots sized by need (--decode-slots): the same episodes; the slots bound the batch and the estimate counts them
    top = evaluation.EvalConfig().max_context
    evaluation.main(["--agent", str(ckpt), "--env", "tests.fake_env:FakeEnv", "--num-tasks", "3", "--trials", "2",
                     "--max-new-tokens", "8", "--decode-slots", f"2x200,1x{top}", "--out-dir", str(tmp_path / "s")])
    assert [json.loads(line)["messages"] for line in open(tmp_path / "s" / "episodes.jsonl")] == eps["0"]
    with pytest.raises(SystemExit, match="eval.py: --decode-slots 2x200: the largest slots .* --max-context"):
        evaluation.main(["--agent", str(ckpt), "--env", "tests.fake_env:FakeEnv", "--decode-slots", "2x200",
                         "--out-dir", str(tmp_path / "bad")])
    assert "[eval] estimated memory per GPU" in out and "kv_cache" in out and "optimizer" not in out
    est = memory.memory_estimate(1000, bf16=True, kv_bytes_per_token=10, max_context=100, episodes=2, parked=3,
                                inference=True)
    assert est == {"weights": 2000, "kv_cache": 2000, "prefill": 0, "host_kv_cache": 3000, "rollout_peak": 4000,
                   "load_peak": 2000, "host_load": 2000, "host_save": 0, "host_peak": 3000, "peak": 4000}


def test_pretrain_tiny_stops_at_the_copy_target_then_learns_whole_conversations_of_the_old_stores(tmp_path,
                                                                                                 monkeypatch):
    """Two stages: drills from shop and its siblings under their old policy (no decisions) until the copy target,
    then whole conversations of those stores; recorded in the base's muarl_config.json, cached, and the committed base used only for its own
    settings."""
    monkeypatch.setattr(models, "CACHE_DIR", tmp_path)
    made = []
    real = coldstart.make_cold_start
    monkeypatch.setattr(sft, "make_cold_start", lambda cfg: made.append(cfg.env) or real(cfg))
    cfg = sft.SFTConfig(num_tasks=8, pretrain_target=100.0, pretrain_max_steps=50, pretrain_batch_size=8,
                        base_conversations=8, tiny_width=64)
    with monkeypatch.context() as m:  # a cache whose disk cannot hold its two checkpoints: refused before a step
        m.setattr(disk, "free_bytes", lambda path: 1000)
        with pytest.raises(SystemExit, match=r"^sft.py: the tiny base -> .*tiny-base-\w+: 1000 bytes free on the disk "
                           r"of .*, and it needs at least .* \(two checkpoints of [\d,]+ weights at 4 bytes each\)\. "
                           r"Nothing was trained: make room, or set MUARL_CACHE to a directory on another disk$"):
            sft.pretrain_tiny(cfg)
    assert not list(tmp_path.iterdir())
    made.clear()
    out = sft.pretrain_tiny(cfg)
    assert out != sft.COMMITTED_BASE and out.parent == tmp_path
    shape = json.loads((out / "config.json").read_text())  # --tiny-width: heads of 32, half as many kv, MLP 3x
    assert (shape["hidden_size"], shape["num_attention_heads"], shape["num_key_value_heads"],
            shape["intermediate_size"]) == (64, 2, 1, 192)
    saved = json.loads((out / "muarl_config.json").read_text())
    info = saved["pretrain"]
    assert info["steps"] == 25 and info["copy_loss"] < 100.0  # the first check (every 25 steps) met the target
    assert info["settings"] == sft.base_settings(cfg) and saved["sft"]["epochs"] == 1.0
    # drills, then whole conversations
    assert made == ["shop:old:default", "shop:garden:old:default", "shop:sport:old:default"] * 2
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert sft.pretrain_tiny(cfg) == out and (out / "model.safetensors").stat().st_mtime_ns == stamp  # cached
    assert not list(tmp_path.glob("*-drills"))  # the first stage's checkpoint is not kept
    with pytest.raises(SystemExit, match="shop"):
        sft.pretrain_tiny(sft.SFTConfig(env="tau2:retail"))
    with pytest.raises(SystemExit, match="--tiny-width 96: give a multiple of 64"):
        sft.pretrain_tiny(sft.SFTConfig(tiny_width=96))


def test_the_teachers_users_take_turns_by_task_and_the_drills_join_the_conversations():
    """--teacher-users: each task of the shuffled split played once, by the user its number gives (3 of every 4 by
    the dynamic user here), the conversations those users' own runs keep; --copy-drills adds as many drills (windows
    of the same conversations, items renamed), shuffled in by the seed; bad specs are named."""
    cfg = sft.SFTConfig(env="shop", num_tasks=24, teacher_users="dynamic:3,told:1", teacher_skips_ask=0.7)
    mixed = coldstart.teacher_data(cfg)
    by_user = {u: {c["task_id"]: c for c in coldstart.make_cold_start(replace(cfg, env=e, teacher_users=""))}
               for u, e in (("dynamic", "shop"), ("told", "shop:told"))}
    for c in mixed:
        user = "told" if int(c["task_id"].rsplit("-", 1)[1]) % 4 == 3 else "dynamic"
        assert c == by_user[user][c["task_id"]]
    assert {int(c["task_id"].rsplit("-", 1)[1]) % 4 for c in mixed} == {0, 1, 2, 3}
    drilled = coldstart.teacher_data(replace(cfg, copy_drills=1.0))
    assert len(drilled) == 2 * len(mixed) and all(c in drilled for c in mixed)
    assert drilled == coldstart.teacher_data(replace(cfg, copy_drills=1.0))  # the seed's draw and order
    assert drilled != coldstart.teacher_data(replace(cfg, copy_drills=1.0, seed=1))
    for bad, match in ((dict(teacher_users="dynamic:3,nobody:1"), "'nobody:1' is not USER"),
                       (dict(teacher_users="dynamic:0"), "'dynamic:0' is not USER"),
                       (dict(env="shop:told"), "without a user of its own"),
                       (dict(env="tau2:mock"), "without a user of its own")):
        with pytest.raises(SystemExit, match=match):
            coldstart.teacher_data(replace(cfg, **bad))
    with pytest.raises(SystemExit, match="--copy-drills 1.0: the drills rename shop's goods"):
        coldstart.teacher_data(sft.SFTConfig(env="tests.fake_env:FakeEnv", num_tasks=2, copy_drills=1.0))
    with pytest.raises(SystemExit, match=r"^sft.py: --copy-drills: the teacher's options have no effect with --data "
                       r"x.jsonl, whose conversations are made already$"):
        sft.main(["--data", "x.jsonl", "--copy-drills", "1"])
    with pytest.raises(SystemExit, match=r"^sft.py: --teacher-skips-confirm, --env, --num-tasks: the teacher's options "):
        sft.main(["--data", "x.jsonl", "--env", "tau2:retail", "--teacher-skips-confirm", "0.5", "--num-tasks", "3"])
    with pytest.raises(SystemExit, match="^sft.py: --epochs 0 trains nothing: give --data-out to keep the teacher's"):
        sft.main(["--epochs", "0"])  # before any conversation is made
    with pytest.raises(SystemExit, match="--cold-start-out: only the 'tiny' model"):
        sft.main(["--model", "smollm2-135m", "--cold-start-out", "x"])


def test_the_committed_cold_start_is_used_only_for_its_own_settings_and_conversations(tmp_path, monkeypatch, capsys):
    """grpo.py's cold start (sft.cold_start): made and cached with its settings and a digest of its very conversations
    recorded; the committed one (assets/tiny-cold) returned when both are its own, from any run of that store
    (the user and ':default' left out: one cold start for every arm), never when the conversations differ (a domain
    changed since it was made) or the settings do; sft.py --cold-start-out makes one and copies it."""
    monkeypatch.setattr(models, "CACHE_DIR", tmp_path / "cache")
    monkeypatch.setattr(sft, "COMMITTED_COLD", tmp_path / "committed")
    monkeypatch.setattr(models, "TINY_COLD_START", {"epochs": 0.5, "lr": 1e-3})
    monkeypatch.setattr(models, "TINY_COLD_DATA", {"num_tasks": 16, "copy_drills": 1.0})
    made = Path(sft.cold_start("tiny", "shop", "train", 0, False, 0.3, 0.7))
    assert made.parent == tmp_path / "cache" and "making one" in capsys.readouterr().out
    settings = json.loads((made / "muarl_config.json").read_text())["cold_start"]["settings"]
    assert settings["teacher_users"] == "dynamic:3,told:1" and settings["copy_drills"] == 1.0 and settings["env"] == "shop"
    sft.main(["--cold-start-out", str(tmp_path / "committed"), "--teacher-skips-confirm", "0.3",
              "--teacher-skips-ask", "0.7"])  # the cached one, copied
    assert (tmp_path / "committed" / "model.safetensors").read_bytes() == (made / "model.safetensors").read_bytes()
    for env in ("shop", "shop:told", "shop:default"):
        assert sft.cold_start("tiny", env, "train", 0, False, 0.3, 0.7) == str(tmp_path / "committed")
    assert coldstart.cold_start_users("shop:static") == ("shop", "dynamic:3,static:1")
    assert sft.cold_start("tiny", "shop", "train", 0, False, 0.3, 0.8) != str(tmp_path / "committed")
    record = json.loads((tmp_path / "committed" / "muarl_config.json").read_text())
    record["cold_start"]["settings"]["data"] = "0" * 16  # as if the domain's conversations had changed since
    (tmp_path / "committed" / "muarl_config.json").write_text(json.dumps(record))
    capsys.readouterr()
    assert sft.cold_start("tiny", "shop", "train", 0, False, 0.3, 0.7) == str(made)
    assert "using the cached SFT checkpoint" in capsys.readouterr().out


def test_copy_loss_matches_a_loop(tiny_tok, tiny_lm):
    ids = [tiny_tok("the order o123, for the order o123", add_special_tokens=False)["input_ids"],
           tiny_tok("Which order? yes please", add_special_tokens=False)["input_ids"]]
    data = [(x, [0] + [1] * (len(x) - 1)) for x in ids]
    twice = {i for i in ids[0] if ids[0].count(i) == 2}
    assert twice
    copy_ids = twice | {ids[1][2]}  # copies at their second occurrence only; ids[1][2] never repeats
    got = coldstart.copy_loss(tiny_lm, tiny_tok, data, copy_ids, micro_batch_size=1)
    nll = {True: [], False: []}
    with torch.no_grad():
        for x, m in data:
            logp = tiny_lm(input_ids=torch.tensor([x])).logits[0].log_softmax(-1)
            for t in range(1, len(x)):
                if m[t]:
                    nll[x[t] in copy_ids and x[t] in x[:t]].append(-logp[t - 1, x[t]].item())
    assert len(nll[True]) >= 2
    want = (sum(nll[True]) / len(nll[True]), sum(nll[False]) / len(nll[False]))
    assert got == pytest.approx(want, rel=1e-5)


def test_plot_curves_writes_a_png_with_each_curve(tmp_path):
    rows = [{"step": i + 1, "reward_mean": i / 9, "all_correct_ratio": 0.1, "all_wrong_ratio": 0.5, "turns_mean": 7.0,
             "response_tokens_mean": 40.0, "kl": 0.001 * i, "entropy": 1.5, "reward_info/unconfirmed_writes": 0.3,
             "reward_info/asked": 0.5,
             **({"eval/pass1": 0.4, "eval/asked": 0.3, "eval/pass1/wants=non-default": 0.2} if i == 4 else {})}
            for i in range(10)]
    from plumbing.metrics import plot_curves

    drawn = plot_curves(rows, tmp_path / "c.png", before=0.2, after=0.6, asked=(0.1, 0.7),
                        groups={"kind=transfer": (0.9, 0.9)})
    assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert drawn == {
        "reward": ["reward (sampled episodes)", "mean of the last 5 steps", "test pass^1 before (0.20, greedy)",
                   "test pass^1 after (0.60, greedy)", "held-out test pass^1 (greedy)",
                   "held-out pass^1, users who want the non-default",
                   "held-out pass^1, transfers (a control: nothing to learn)"],
        "group outcomes": ["groups all correct", "groups all wrong", "episodes that wrote without a yes",
                           "decision episodes that asked what the user wants",
                           "held-out decision episodes that asked (greedy)"],
        "episode length": ["agent turns per episode", "sampled tokens per episode"],
        "KL and entropy": ["KL to the reference (k3)", "policy entropy"]}
    # From a run directory, as `python eval.py --plot RUN_DIR` does; a line cut short by a crash is skipped.
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 11, "rew')
    (run / "summary.json").write_text(json.dumps({"eval/before/pass1": 0.2, "eval/after/pass1": None,
                                                  "eval/after/by_meta": {"kind": {"transfer": {"pass^1": 0.9}}}}))
    evaluation.main(["--plot", str(run)])
    assert (run / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(SystemExit, match="no metrics.jsonl"):
        evaluation.main(["--plot", str(tmp_path)])
    with pytest.raises(SystemExit, match=r"^eval.py: --plot: .*nowhere does not exist: give a grpo.py run directory$"):
        evaluation.main(["--plot", str(tmp_path / "nowhere")])
    # Damaged: rows that are no step's (a list, no step, a word for a number, a line not UTF-8) are left out; a
    # summary cut short draws the curves without the evaluations; nothing to draw is said, not drawn empty.
    (run / "metrics.jsonl").write_bytes(b"".join(json.dumps(r).encode() + b"\n" for r in rows) + b'[1, 2]\n{"x": 1}\n'
                                        b'{"step": 11, "reward_mean": "high"}\n\xff\xfe\n')
    (run / "summary.json").write_text('{"eval/before/pass1": 0.')
    (run / "curves.png").unlink()
    evaluation.main(["--plot", str(run)])
    assert (run / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (run / "metrics.jsonl").write_text("")
    with pytest.raises(SystemExit, match=r"^eval.py: --plot: .*metrics.jsonl holds no step's metrics: nothing to draw$"):
        evaluation.main(["--plot", str(run)])


@pytest.mark.versions
def test_reference_kl_is_zero_at_step_one_under_bf16(ckpt, tiny_tok, bf16_accelerator):
    """The reference runs the policy's precision path (fp32 weights under the same bf16 autocast): before the
    policy moves, the kl metric is 0 to rounding. A bf16 reference, as it was, is a different function."""
    acc = bf16_accelerator
    g = torch.Generator().manual_seed(0)
    episodes = []
    for i in range(4):
        n = 30 + 7 * i
        ids = torch.randint(0, len(tiny_tok), (n,), generator=g).tolist()
        mask = [0] * 10 + [1] * (n - 10)
        episodes.append(muarl.Episode(task_id=f"t{i // 2}", input_ids=ids, loss_mask=mask, logprobs=[-1.0] * n,
                                      reward=float(i % 2)))
    cfg = grpo.Config(group_size=2, micro_batch_size=2, kl_coef=0.001, lr=1e-3)

    def step_one_kl(ref):
        policy, tok = models.load_model(str(ckpt), device="cpu", dtype=torch.float32)
        opt = torch.optim.AdamW(policy.parameters(), lr=cfg.lr)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        policy, opt = acc.prepare(policy, opt)
        return grpo.train_on_episodes(episodes, policy, ref, opt, sched, acc, cfg, tok.pad_token_id)["kl"]

    assert step_one_kl(models.load_reference(str(ckpt), "cpu")) < 1e-6
    bf16_ref, _ = models.load_model(str(ckpt), device="cpu", dtype=torch.bfloat16)
    assert step_one_kl(bf16_ref.eval()) > 5e-6  # 1.9e-5 here


def test_the_viewer_shows_an_episode_s_recorded_tokens_with_its_loss_mask(tmp_path, ckpt, capsys):
    """eval.py --show: a logged episode's recorded ids decoded stretch by stretch, each agent turn marked with its
    token span; what is marked is exactly the tokens of loss mask 1, and each turn ends on its sampled stop token.
    The tokenizer comes from the run's newest checkpoint; a line without tokens is refused, naming file and line."""
    from plumbing import show

    run = tmp_path / "run"
    grpo.main(grpo_args(ckpt, run, "--steps", "1", "--log-episodes", "2"))
    capsys.readouterr()
    evaluation.main(["--show", str(run / "episodes.jsonl"), "--show-index", "1"])
    out = capsys.readouterr().out
    rec = json.loads((run / "episodes.jsonl").read_text().splitlines()[1])
    ids, mask = rec["input_ids"], rec["loss_mask"]
    assert out.startswith(f"task {rec['task_id']} · sample {rec['sample']} · step 1 · reward {rec['reward']}")
    marked = re.findall(f"{show.OPEN}(.*?){show.CLOSE}", out, re.S)
    tok = models.load_tokenizer(str(ckpt))
    assert len(marked) == len(rec["turn_spans"]) == rec["turns"] > 0
    for (start, end), text in zip(rec["turn_spans"], marked):
        assert text == tok.decode(ids[start:end], skip_special_tokens=False) and all(mask[start:end])
    assert sum(end - start for start, end in rec["turn_spans"]) == sum(mask)
    assert out.count("--- agent turn ") == rec["turns"]
    first_prompt = rec["turn_spans"][0][0] - 1  # a token of the prompt: loss mask 0
    for bad, said in [({"task_id": "t", "messages": []}, r"an episode without its input_ids or loss_mask \(an API "),
                      ({"step": 1, "reward_mean": 0.5}, r"a step's metrics, not an episode: give episodes.jsonl"),
                      ([1, 2, 3], r"a JSON list, not an episode"),
                      ({**rec, "input_ids": ["a", *ids[1:]]}, r"input_ids is not a list of token ids"),
                      ({**rec, "input_ids": [-1, *ids[1:]]}, r"input_ids is not a list of token ids"),
                      ({**rec, "loss_mask": mask[:-1]}, rf"loss_mask is not a list of {len(ids)} 0s and 1s"),
                      ({**rec, "loss_mask": ["1"] * len(ids)}, r"loss_mask is not a list"),
                      ({**rec, "turn_spans": [[5, 3]]}, r"turn_spans are not in order"),
                      ({**rec, "turn_spans": [5]}, r"turn_spans is not a list of \[start, end\] pairs"),
                      ({**rec, "turn_spans": [[first_prompt, first_prompt + 2]]}, r"agent turn 1's span holds ")]:
        (tmp_path / "bad.jsonl").write_text(json.dumps(bad) + "\n")
        with pytest.raises(SystemExit, match=rf"^eval.py: --show: .*bad.jsonl, line 1: {said}"):
            show.show(str(tmp_path / "bad.jsonl"), 0, str(ckpt))
    (tmp_path / "bad.jsonl").write_bytes(b"\x89PNG\r\n\x1a\n\xff")
    with pytest.raises(SystemExit, match=r"bad.jsonl is not text \(UTF-8, byte \d+\): give a JSONL file of episodes"):
        show.show(str(tmp_path / "bad.jsonl"), 0, str(ckpt))
    with pytest.raises(SystemExit, match=r"--show: .*run is a directory: give one of its JSONL files of episodes"):
        show.show(str(run), 0, str(ckpt))
    with pytest.raises(SystemExit, match=r"--show-index 5: .* holds 2 episodes"):
        show.show(str(run / "episodes.jsonl"), 5)
    # an id past the tokenizer (it vanished from the text): shown, and counted; an empty file; a JSON document
    (tmp_path / "bad.jsonl").write_text(json.dumps({**rec, "input_ids": [*ids[:-1], 99999999]}) + "\n")
    text = show.show(str(tmp_path / "bad.jsonl"), 0, str(ckpt), color=False)
    assert f"1 token id(s) past the tokenizer's {len(tok)}" in text and "\u27e8id 99999999\u27e9" in text
    (tmp_path / "bad.jsonl").write_text("\n")
    with pytest.raises(SystemExit, match=r"bad.jsonl is empty: no episode to show$"):
        show.show(str(tmp_path / "bad.jsonl"), 0, str(ckpt))
    with pytest.raises(SystemExit, match=r"summary.json, episode 0: not JSON .*: the file is one JSON document, not "
                       r"JSONL \(one episode a line\)$"):
        show.show(str(run / "summary.json"), 0, str(ckpt))
