"""What happens to a run when something breaks: nothing a user had is lost, nothing fails silently, bad input is
named. One test per failure mode of the README's table ("When something breaks"); the user-simulator ones talk to
a real HTTP endpoint on the loopback (conftest.ChatServer) that fails in the way under test."""
import errno
import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from plumbing import cli, conversations, disk, models, options
import eval as evaluation
import grpo
import sft
from fast.batched_rollout import RolloutConfig, rollout
from plumbing.users import make_user_sim
from conftest import ChatServer
from envs import ToolResult
from envs.llm_users import OpenAIUserSim
from envs.users import MAX_REPLY_CHARS, UserSimError
from tests.fake_env import FakeEnv

FAKE_ENV = "tests.fake_env:FakeEnv"  # a plug-in environment is named again on --resume

GREEDY = RolloutConfig(greedy=True, max_new_tokens=64, max_turns=8)


def grpo_args(ckpt, out, *extra):
    return ["--init-from", str(ckpt), "--env", "tests.fake_env:FakeEnv", "--steps", "2", "--tasks-per-step", "2",
            "--group-size", "4", "--max-new-tokens", "32", "--max-context", "512", "--eval-tasks", "0",
            "--lr", "1e-2", "--micro-batch-size", "4", "--temperature", "1.0", "--out-dir", str(out), *extra]


def steps_logged(run_dir, name="metrics.jsonl"):
    return [json.loads(line)["step"] for line in open(run_dir / name)]


def user_says(body, n):
    said = sum(m["role"] == "user" for m in body["messages"])  # the agent's messages, from the user's side
    return 200, {"content": "Thanks. ###STOP###" if said >= 2 else "ok"}


# ---- outputs never destroy what was there ---------------------------------------------------------------------
def test_sft_out_never_deletes_what_is_not_a_checkpoint(tmp_path, ckpt, tiny_tok):
    out = tmp_path / "out"
    out.mkdir()
    data = out / "data.jsonl"  # the user's training data, inside the directory named as --out
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                             {"role": "assistant", "content": "hello"}]}) + "\n")
    argv = ["--model", str(ckpt), "--data", str(data), "--out", str(out), "--batch-size", "1"]
    for extra in ([], ["--overwrite"]):
        with pytest.raises(SystemExit, match="data.jsonl.*would delete them"):
            sft.main(argv + extra)
    assert data.exists()
    # A directory holding only a checkpoint is replaced with --overwrite, refused without it.
    first = tmp_path / "ck"
    sft.main(["--model", str(ckpt), "--data", str(data), "--out", str(first), "--batch-size", "1"])
    with pytest.raises(SystemExit, match="already holds a checkpoint.*--overwrite"):
        sft.main(["--model", str(ckpt), "--data", str(data), "--out", str(first), "--batch-size", "1"])
    sft.main(["--model", str(ckpt), "--data", str(data), "--out", str(first), "--batch-size", "1", "--overwrite"])
    assert (first / "model.safetensors").exists() and not (tmp_path / "ck.tmp").exists()


def test_save_pretrained_leaves_a_foreign_directory_alone(tmp_path, tiny_lm, tiny_tok):
    from plumbing import checkpoints
    from plumbing import cli

    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit, match=r"notes.txt.*not replaced.*out.tmp"):
        checkpoints.save_pretrained(cli.make_accelerator(), tiny_lm, tiny_tok, out, {})
    assert (out / "notes.txt").read_text() == "mine"
    assert (tmp_path / "out.tmp" / "model.safetensors").exists()  # the new checkpoint is kept, beside it


def test_grpo_refuses_an_existing_run_unless_resume_or_overwrite(tmp_path, ckpt):
    run = tmp_path / "run"
    grpo.main(grpo_args(ckpt, run, "--eval-tasks", "2", "--eval-every", "1"))  # evaluated along the way too
    assert (run / "eval-step1.jsonl").exists()
    (run / "notes.txt").write_text("mine")
    before = (run / "metrics.jsonl").read_text()
    with pytest.raises(SystemExit, match=r"already holds a run.*--resume.*--overwrite"):
        grpo.main(grpo_args(ckpt, run, "--seed", "1"))
    assert (run / "metrics.jsonl").read_text() == before
    assert json.loads((run / "config.json").read_text())["seed"] == 0
    # --overwrite removes nothing until the new run has loaded: one that cannot start leaves the old run as it was.
    with pytest.raises(SystemExit, match="--max-context 20 is below"):
        grpo.main(grpo_args(ckpt, run, "--seed", "1", "--overwrite", "--max-context", "20"))
    assert (run / "metrics.jsonl").read_text() == before and (run / "checkpoints" / "step-000002").exists()
    grpo.main(grpo_args(ckpt, run, "--seed", "1", "--overwrite"))
    assert steps_logged(run) == [1, 2] and json.loads((run / "config.json").read_text())["seed"] == 1
    assert (run / "notes.txt").read_text() == "mine"  # --overwrite removes the run's own files only
    assert not (run / "eval-step1.jsonl").exists()  # an evaluation the new run never made is not left beside it


def test_the_command_that_started_a_run_with_a_recipe_resumes_it(tmp_path):
    """--recipe's settings count as given on --resume, each compared with the run's saved one: the command that
    started a run with --recipe paper, --resume added, changes nothing (it raised AttributeError: the run's settings
    have no field "recipe"); the recipe given to resume a run that did not start with it is refused, in one line."""
    from dataclasses import asdict

    from plumbing import rundir

    run = tmp_path / "run"
    argv = ["--recipe", "paper", "--out-dir", str(run)]
    cfg, _, _ = rundir.options(grpo.Config, argv, options.RECIPES)
    run.mkdir()
    (run / "config.json").write_text(json.dumps(asdict(cfg)))  # a run that stopped before its first checkpoint
    again, resume_from, changes = rundir.options(grpo.Config, argv + ["--resume", str(run)], options.RECIPES)
    assert changes == {} and resume_from is None
    assert asdict(again) == {**asdict(cfg), "resume": str(run), "overwrite": False}
    with pytest.raises(SystemExit, match=r"^grpo.py: --model smollm2-135m: with --init-from x the run trains that "
                       r"checkpoint and --model is not read: give one of them$"):
        rundir.options(grpo.Config, ["--init-from", "x", "--model", "smollm2-135m"], options.RECIPES)
    assert rundir.options(grpo.Config, argv + ["--init-from", "x"], options.RECIPES)[0].init_from == "x"
    plain, _, _ = rundir.options(grpo.Config, ["--out-dir", str(run)], options.RECIPES)
    (run / "config.json").write_text(json.dumps(asdict(plain)))
    with pytest.raises(SystemExit, match=r"^grpo.py: --resume continues the run with its saved settings; --.* cannot "
                       r"change in it \(only .*\); --recipe sets --bf16, .*--model, .*; start a new run with "
                       r"--init-from"):
        rundir.options(grpo.Config, argv + ["--resume", str(run)], options.RECIPES)
    # a setting a resume may change keeps the run's value (here --steps, grown by an earlier resume) unless typed
    (run / "config.json").write_text(json.dumps({**asdict(cfg), "steps": 400}))
    again, _, changes = rundir.options(grpo.Config, argv + ["--resume", str(run)], options.RECIPES)
    assert again.steps == 400 and changes == {}
    again, _, changes = rundir.options(grpo.Config, argv + ["--resume", str(run), "--steps", "500"], options.RECIPES)
    assert again.steps == 500 and changes == {"steps": [400, 500]}


def test_resume_cuts_the_logs_back_to_the_checkpoint(tmp_path, ckpt, capsys):
    """A crash after step 3 was logged but before it was saved: on --resume from step 2 every step appears once. A log
    emptied by hand is said on the next resume (the curves go without those steps)."""
    run = tmp_path / "run"
    grpo.main(grpo_args(ckpt, run, "--save-every", "2"))
    for name in ("metrics.jsonl", "episodes.jsonl"):
        with open(run / name, "a") as f:
            f.write(json.dumps({"step": 3, "loss": 0.0}) + "\n" + '{"step": 4, "lo')  # and a line cut short
    grpo.main(["--resume", str(run), "--env", FAKE_ENV, "--steps", "4"])
    assert steps_logged(run) == [1, 2, 3, 4]
    assert sorted(set(steps_logged(run, "episodes.jsonl"))) == [1, 2, 3, 4]
    assert steps_logged(run, "episodes.jsonl") == sorted(steps_logged(run, "episodes.jsonl"))
    cut = (run / "metrics.jsonl.cut").read_text().splitlines()  # what was cut is kept aside, not lost
    assert cut == [json.dumps({"step": 3, "loss": 0.0}), '{"step": 4, "lo']
    assert [json.loads(line)["step"] for line in open(run / "resumes.jsonl")] == [2]
    assert "metrics.jsonl holds" not in capsys.readouterr().out
    (run / "metrics.jsonl").write_text("")
    grpo.main(["--resume", str(run), "--env", FAKE_ENV, "--steps", "5"])
    assert "--resume at step 4: metrics.jsonl holds 0 of the steps before it (emptied" in capsys.readouterr().out
    assert steps_logged(run) == [5]


def test_truncated_latest_falls_back_to_the_newest_complete_step(tmp_path, ckpt, capsys):
    run = tmp_path / "run"
    grpo.main(grpo_args(ckpt, run, "--save-every", "1"))
    (run / "checkpoints" / "latest.json").write_text('{"checkpoi')
    (run / "checkpoints" / "step-000003.tmp").mkdir()  # a save that never finished
    grpo.main(["--resume", str(run), "--env", FAKE_ENV, "--steps", "3"])
    out = capsys.readouterr().out
    assert "latest.json is unreadable" in out and "step-000002" in out
    assert steps_logged(run) == [1, 2, 3]


# ---- a failing user simulator is loud ---------------------------------------------------------------------------
def test_dead_user_endpoint_stops_the_run_and_the_endpoint_may_change_on_resume(tmp_path, ckpt, capsys):
    good, dead = ChatServer(user_says), ChatServer(lambda body, n: (500, {}))
    run = tmp_path / "run"
    user = ["--user-sim", "openai", "--user-model", "sim", "--user-retries", "0"]
    try:
        grpo.main(grpo_args(ckpt, run, *user, "--user-base-url", good.url, "--steps", "1", "--save-every", "1"))
        with pytest.raises(SystemExit) as e:
            grpo.main(["--resume", str(run), "--env", FAKE_ENV, "--steps", "3", "--user-base-url", dead.url])
        msg = str(e.value)
        assert "step 2: all 8 episodes failed on infrastructure" in msg and "500" in msg
        assert dead.url in msg and "--user-base-url" in msg and f"--resume {run}" in msg
        assert steps_logged(run) == [1]  # nothing trained on nothing
        # Other settings cannot change on resume: refused, naming them, rather than ignored.
        with pytest.raises(SystemExit, match=r"--lr cannot change"):
            grpo.main(["--resume", str(run), "--env", FAKE_ENV, "--lr", "0.5"])
        # The original command with --resume added works: options equal to the saved ones are not changes.
        grpo.main(grpo_args(ckpt, run, *user, "--resume", str(run), "--steps", "3", "--user-base-url", good.url))
        assert steps_logged(run) == [1, 2, 3]
        assert json.loads((run / "config.json").read_text())["user_base_url"] == good.url
        resumes = [json.loads(line) for line in open(run / "resumes.jsonl")]
        # Changes are against the checkpoint's settings (step 1's, with the good endpoint): the dead one is on record.
        assert [r["changed"] for r in resumes] == [{"steps": [1, 3], "user_base_url": [good.url, dead.url]},
                                                   {"steps": [1, 3]}]
    finally:
        good.close()
        dead.close()
    # A dead endpoint at the first step: nothing to resume, and the message says how to start again.
    dead = ChatServer(lambda body, n: (401, {}))
    try:
        with pytest.raises(SystemExit, match=r"(?s)step 1: all 8 episodes failed.*401.*--overwrite"):
            grpo.main(grpo_args(ckpt, tmp_path / "run2", *user, "--user-base-url", dead.url))
        # --overwrite of a finished run with a dead user: refused before the run it would replace is removed (it
        # was removed, and the new run then stopped at its first step, leaving nothing)
        with pytest.raises(SystemExit, match=rf"^grpo.py: --overwrite: the user simulator does not answer, so the run "
                           rf"in {re.escape(str(run))} is kept: .*401.*Fix the endpoint, then run the same command"):
            grpo.main(grpo_args(ckpt, run, *user, "--user-base-url", dead.url, "--overwrite"))
        assert steps_logged(run) == [1, 2, 3] and (run / "summary.json").exists()
    finally:
        dead.close()


def test_some_failed_episodes_are_counted_on_the_console(tmp_path, ckpt, capsys):
    def script(body, n):  # the replies of one task fail; its opening and every other request succeed
        if len(body["messages"]) > 3 and n % 3 == 0:
            return 503, {}
        return user_says(body, n)

    server = ChatServer(script)
    try:
        grpo.main(grpo_args(ckpt, tmp_path / "run", "--user-sim", "openai", "--user-model", "sim", "--user-retries",
                            "0", "--user-base-url", server.url, "--steps", "1"))
    finally:
        server.close()
    out = capsys.readouterr().out
    row = json.loads(open(tmp_path / "run" / "metrics.jsonl").readline())
    assert 0 < row["infra_failed"] < 8
    assert f"{row['infra_failed']} of 8 episodes failed on infrastructure, left out; first:" in out and "503" in out


@pytest.mark.parametrize("reply", [
    (200, {"content": ""}), (200, {"content": None}), (200, {"content": "   "}),   # says nothing
    (200, b"<html><body>Bad gateway</body></html>"),                                  # not JSON
    (200, b'{"id": "c1", "choices": [{"index": 0, "message": {"role": "assis'),      # cut short
    (200, b'{"id": "c1", "object": "chat.completion", "choices": []}'),                # no choices
    (200, b'{"error": "overloaded"}'),                                                  # no choices at all
    (200, b'{"id": "c1", "choices": {"0": {"message": {"role": "assistant", "content": "hi"}}}}'),  # not a list
    (200, b'{"id": "c1", "choices": 3}'),
    (200, b'{"id": "c1", "choices": [{"index": 0, "message": 7}]}'),                   # a message that is no message
    (200, b'{"id": "c1", "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi \\ud800"}}]}'),
    (200, {"content": "x" * (MAX_REPLY_CHARS + 1)}),                                    # endless
    (200, b'{"id": "c1", "choices": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),        # deeper than the parser goes
], ids=["empty", "null", "blank", "html", "truncated", "no-choices", "error-object", "choices-object", "choices-number",
        "message-number", "surrogate", "too-long", "nested-100000-deep"])
def test_malformed_or_empty_user_replies_are_retried_infra_errors(lm, tiny_tok, reply):
    def script(body, n):  # openings succeed; every reply is broken
        return reply if len(body["messages"]) > 3 else (200, {"content": "Hi, please help me."})

    server = ChatServer(script)
    try:
        sim = make_user_sim("openai", base_url=server.url, api_key="k", model="sim", backoff=0.0, max_retries=2)
        eps = rollout(lm, tiny_tok, FakeEnv(n_tasks=1), FakeEnv(n_tasks=1).tasks("train"), 2, sim, GREEDY)
    finally:
        server.close()
    asked = [b for _, b in server.requests if len(b["messages"]) > 3]
    for ep in eps:
        assert ep.infra_failed and ep.termination == "infra_error"
        assert "user simulator 'sim' at" in ep.reward_info["error"] and "after 3 attempts" in ep.reward_info["error"]
    assert len(asked) == 3 * len(eps)  # each reply tried 1 + max_retries times


def endless(handler):  # a 200 whose chunked body never ends, as fast as the socket takes it
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Transfer-Encoding", "chunked")
    handler.end_headers()
    chunk = b"x" * 65536
    handler.server.sent = 0
    head = b'{"id": "c1", "choices": [{"index": 0, "message": {"role": "assistant", "content": "'
    handler.wfile.write(b"%x\r\n%s\r\n" % (len(head), head))
    while True:
        handler.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        handler.server.sent += len(chunk)


@functools.cache
def bomb() -> bytes:
    import gzip

    return gzip.compress(b'{"id": "c1", "choices": [{"index": 0, "message": {"role": "assistant", "content": "'
                         + b" " * 200 * 2**20 + b'"}}]}', compresslevel=9)


def gzip_bomb(handler):  # compressed although asked not to: 200 KB on the wire, 200 MB decoded
    body = bomb()
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Encoding", "gzip")
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


@pytest.mark.parametrize("writer", [endless, gzip_bomb], ids=["endless", "gzip-bomb"])
def test_a_reply_body_is_refused_as_it_streams_past_its_cap_not_held_until_the_timeout(lm, tiny_tok, writer):
    """An endless reply accumulated at ~350 MB/s until --user-timeout (3.4 GB at 8 s, ~20 GB at the default 60 s, per
    request); a gzip bomb was decoded whole (1.2 GB) before the length cap refused it. The body is read as it comes
    and refused past MAX_REPLY_BYTES, and asked uncompressed; the episodes end as retried infra errors, at once."""
    from envs.llm_users import MAX_REPLY_BYTES

    def script(body, n):  # openings succeed; every reply is the writer's
        return (200, writer) if len(body["messages"]) > 3 else (200, {"content": "Hi, please help me."})

    server = ChatServer(script)
    try:
        sim = make_user_sim("openai", base_url=server.url, api_key="k", model="sim", backoff=0.0, max_retries=1,
                            timeout=60)
        t0 = time.monotonic()
        eps = rollout(lm, tiny_tok, FakeEnv(n_tasks=1), FakeEnv(n_tasks=1).tasks("train"), 2, sim, GREEDY)
        took = time.monotonic() - t0
    finally:
        server.close()
    for ep in eps:
        assert ep.infra_failed and "after 2 attempts" in ep.reward_info["error"]
        assert f"passed {MAX_REPLY_BYTES:,} bytes (MAX_REPLY_BYTES)" in ep.reward_info["error"]
    assert took < 30, f"{took:.0f} s: the body was read until the timeout"
    assert all({k.lower(): v for k, v in h.items()}["accept-encoding"] == "identity" for h in server.headers), \
        server.headers
    if writer is endless:  # what the server got into the socket before the client hung up: the cap and the buffers
        assert server.httpd.sent < MAX_REPLY_BYTES + 32 * 2**20


@pytest.mark.parametrize("reply, problem", [
    ("", "reply is empty"),
    ("x" * 10_000_000, "reply has 10,000,000 characters, more than a user says"),  # refused before it is tokenized
    ("caf\ud800", r"reply is not text: an unpaired surrogate \(\\ud800\) at character 3"),
], ids=["empty", "10MB", "surrogate"])
def test_an_empty_or_broken_reply_from_any_user_simulator_is_an_infra_error(lm, tiny_tok, reply, problem):
    class Broken(FakeEnv):  # a scripted user whose replies after its opening are broken
        def scripted_user(self, task):
            user = super().scripted_user(task)
            user.reply = lambda messages: reply
            return user

    env = Broken(n_tasks=1)
    eps = rollout(lm, tiny_tok, env, env.tasks("train"), 2, make_user_sim("scripted"), GREEDY)
    assert all(ep.infra_failed and ep.termination == "infra_error" for ep in eps)
    assert all(re.search(problem, ep.reward_info["error"]) for ep in eps)
    from rollout import reference_rollout  # the reference rollout ends it alike; the text-level user raises

    task = env.tasks("train")[0]
    ep = reference_rollout(lm, tiny_tok, env, task, make_user_sim("scripted"), GREEDY)
    assert ep.infra_failed and ep.termination == "infra_error" and re.search(problem, ep.reward_info["error"])
    user = make_user_sim("scripted").sync_user(env, task, env.start(task))  # envs.play's; its callers catch it
    user.opening()
    with pytest.raises(UserSimError, match=problem):
        user.reply([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello."}])


def test_a_plug_in_scripted_user_that_raises_fails_its_episodes_not_the_run(lm, tiny_tok):
    class Raising(FakeEnv):  # a plug-in domain's scripted user with a bug: task 0's replies raise, task 1's opening
        def scripted_user(self, task):
            user = super().scripted_user(task)
            if task.id.endswith("-1"):
                user.opening = lambda: 1 / 0
            else:
                user.reply = lambda messages: {}["missing"]
            return user

    env = Raising(n_tasks=3)
    tasks = env.tasks("train")[:2]
    eps = rollout(lm, tiny_tok, env, tasks, 2, make_user_sim("scripted"), GREEDY)
    assert all(ep.infra_failed and ep.termination == "infra_error" for ep in eps)
    assert "scripted user's reply raised KeyError: 'missing'" in eps[0].reward_info["error"]
    assert "scripted user's opening of task train-1 raised ZeroDivisionError" in eps[2].reward_info["error"]
    from rollout import reference_rollout

    for task in tasks:
        assert reference_rollout(lm, tiny_tok, env, task, make_user_sim("scripted"), GREEDY).infra_failed


def test_user_timeout_bounds_the_whole_request_not_each_read():
    import asyncio
    import time

    # The reply comes a byte every 0.1 s: each read is quick, the whole reply (~370 bytes) takes over 30 s.
    server = ChatServer(lambda body, n: (200, {"content": "ok " * 40}), drip=0.1)
    try:
        user = OpenAIUserSim(model="sim", base_url=server.url, api_key="k", timeout=2.0, max_retries=1, backoff=0.0)
        t0 = time.monotonic()
        with pytest.raises(UserSimError, match=r"after 2 attempts .*--user-timeout 2s.*no whole reply within 2s"):
            asyncio.run(user._complete([{"role": "user", "content": "hi"}], []))
        seconds = time.monotonic() - t0
    finally:
        server.close()
    assert len(server.requests) == 2
    assert seconds < 15  # two attempts of 2 s each, never the 30 s the reply would take to arrive


def test_a_user_simulator_without_aclose_closes_quietly(lm, tiny_tok, caplog):
    class Plain:  # the interface written out without subclassing UserSim: nothing to release
        local = False

        async def opening(self, env, task):
            return "Hi, please help me."

        def start(self, env, task, session, opening):
            return None

        async def replies(self, states, conversations):
            return ["Thanks. ###STOP###" for _ in states]

    env = FakeEnv(n_tasks=1)
    with caplog.at_level("WARNING"):
        eps = rollout(lm, tiny_tok, env, env.tasks("train"), 2, Plain(), GREEDY)
    assert all(ep.termination and not ep.infra_failed for ep in eps)
    assert not [r for r in caplog.records if r.levelname in ("WARNING", "ERROR")]


def test_text_that_is_not_unicode_is_written_as_its_escape(tmp_path):
    import muarl
    from toolcall import parse_assistant

    # A tool call of a surrogate escape is refused where it enters: the agent reads why, the tool never runs.
    parsed = parse_assistant('<tool_call>\n{"name": "echo", "arguments": {"text": "\\ud800"}}\n</tool_call>')
    assert parsed.errors[0].startswith("Error: tool call holds an unpaired surrogate")
    assert parsed.tool_calls[0]["function"]["arguments"].encode("utf-8")  # the call's text as sampled
    # Whatever still holds one (here a tool's result) is written as valid UTF-8 that reads back to the same text.
    ep = muarl.Episode(task_id="t", messages=[{"role": "tool", "content": "caf\u00e9 \ud800"}])
    path = tmp_path / "episodes.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        f.write(disk.json_line({"step": 1, **ep.to_json()}))
    line = path.read_bytes().decode("utf-8")
    assert "café" in line and json.loads(line)["messages"][0]["content"] == "caf\u00e9 \ud800"


def test_sft_data_out_below_a_file_or_on_a_full_disk_stops_in_one_line_and_leaves_nothing(tmp_path, monkeypatch):
    import builtins
    import errno

    d = tmp_path / "d.jsonl"
    d.write_text(conv(U, A) + "\n" + conv(U, A) + "\n")
    (tmp_path / "afile").write_text("x")
    with pytest.raises(SystemExit, match=r"^sft.py: --data-out: cannot write below .*afile: it is a file, not a "
                       r"directory$"):
        sft.main(["--data", str(d), "--data-out", str(tmp_path / "afile" / "out.jsonl"), "--epochs", "0"])

    class HalfWritten:  # the disk fills after the first line
        def __init__(self, f):
            self.f = f

        def writelines(self, lines):
            self.f.write(next(iter(lines)))
            self.f.flush()
            raise OSError(errno.ENOSPC, "No space left on device")

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    monkeypatch.setattr(disk, "open", lambda *a, **kw: HalfWritten(builtins.open(*a, **kw)), raising=False)
    with pytest.raises(SystemExit, match=r"^sft.py: --data-out: cannot write .*out.jsonl: No space left on device \(is "
                       r"the disk full or read-only\?\); nothing was written there$"):
        sft.main(["--data", str(d), "--data-out", str(tmp_path / "out.jsonl"), "--epochs", "0"])
    assert not list(tmp_path.glob("out.jsonl*"))


def test_paths_that_are_no_files_or_lie_below_one(tmp_path, ckpt, capsys):
    d = tmp_path / "d.jsonl"
    d.write_text(conv(U, A) + "\n")
    (tmp_path / "adir.jsonl").mkdir()
    with pytest.raises(SystemExit, match="--data-out: .*adir.jsonl is a directory"):
        sft.main(["--data", str(d), "--data-out", str(tmp_path / "adir.jsonl"), "--epochs", "0", "--overwrite"])
    assert not list(tmp_path.glob("*.tmp"))
    with pytest.raises(SystemExit, match="--data: .*adir.jsonl is a directory"):
        sft.main(["--data", str(tmp_path / "adir.jsonl"), "--epochs", "0", "--data-out", str(tmp_path / "x.jsonl")])
    fifo = tmp_path / "fifo.jsonl"  # a pipe, as `--data <(zcat data.gz)` gives: read, with a line saying it waits
    os.mkfifo(fifo)
    import threading

    writer = threading.Thread(target=lambda: fifo.write_text(conv(U, A) + "\n"), daemon=True)
    writer.start()
    assert len(conversations.load_conversations(str(fifo))) == 1
    writer.join(timeout=10)
    assert "is not a regular file (a pipe or a device): reading it waits" in capsys.readouterr().out
    with pytest.raises(SystemExit, match=r"--out-dir: cannot make .*sub: .*d.jsonl is a file, not a directory"):
        grpo.main(["--init-from", str(ckpt), "--env", FAKE_ENV, "--steps", "1", "--out-dir", str(d / "sub")])


def test_an_unwritable_cache_is_named_before_the_work_whose_result_it_would_hold(monkeypatch):
    import subprocess
    import sys
    from pathlib import Path

    monkeypatch.setattr(models, "CACHE_DIR", Path("/proc/muarl-nope"))
    with pytest.raises(SystemExit, match=r"grpo.py: MUARL_CACHE: cannot write into /proc/muarl-nope"):
        sft.cold_start("tiny", "shop", "train", 0, False, 0.6, 0.5)  # before its synthesis and SFT (minutes)
    root = Path(__file__).resolve().parents[1]  # BFCL's working directory is made under it at import
    env = {k: v for k, v in os.environ.items() if k != "BFCL_PROJECT_ROOT"} | {"MUARL_CACHE": "/proc/muarl-nope"}
    code = "from envs import load_tasks; load_tasks('bfcl:multi_turn_base', 'test', 'eval.py')"
    out = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert "eval.py: --env bfcl:multi_turn_base: BFCL's working directory /proc/muarl-nope/bfcl" in out.stderr


def test_sft_data_out_and_a_dead_teacher_user(tmp_path, capsys):
    d = tmp_path / "d.jsonl"
    d.write_text(conv(U, A) + "\n")
    sft.main(["--data", str(d), "--epochs", "0"])  # a check of the file: said, not silent
    assert f"[sft] --epochs 0: {d} holds 1 conversation(s) to train on; nothing trained" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--data-out: .*exists; replace it with --overwrite"):
        sft.main(["--data", str(d), "--data-out", str(d), "--epochs", "0"])
    with pytest.raises(SystemExit, match="is the --data file it reads"):
        sft.main(["--data", str(d), "--data-out", str(d), "--epochs", "0", "--overwrite"])
    assert d.read_text() == conv(U, A) + "\n"
    dead = ChatServer(lambda body, n: (500, {}))
    try:  # the scripted expert teaches against an LLM user whose endpoint is down: stop, saying why
        with pytest.raises(SystemExit, match=r"(?s)2 of 2 failed and none was kept.*500"):
            sft.main(["--env", "shop", "--num-tasks", "2", "--user-sim", "openai", "--user-base-url", dead.url,
                      "--user-retries", "0", "--epochs", "0", "--data-out", str(tmp_path / "out.jsonl")])
        # more tasks: the first three failing, the endpoint is taken for dead (not tried on every task left)
        with pytest.raises(SystemExit, match=r"(?s)^sft.py: the teacher's first 3 episodes all failed; stopping rather "
                           r"than playing the other 5 tasks\. The first failure: task .*500"):
            sft.main(["--env", "shop", "--num-tasks", "8", "--user-sim", "openai", "--user-base-url", dead.url,
                      "--user-retries", "0", "--epochs", "0", "--data-out", str(tmp_path / "out.jsonl")])
    finally:
        dead.close()


def test_user_timeout_and_retries_are_options(tmp_path):
    import asyncio
    import time

    cfg = grpo.Config(user_sim="openai", user_base_url="http://127.0.0.1:9/v1", user_timeout=0.3, user_retries=1)
    from plumbing.users import user_sim_options

    sim = make_user_sim("openai", **user_sim_options(cfg), backoff=0.0)
    assert (sim.timeout, sim.max_retries) == (0.3, 1)

    def slow(body, n):
        time.sleep(3.0)
        return 200, {"content": "late"}

    server = ChatServer(slow)
    try:  # (a deadline for the whole request: a loaded machine must still send it well within the second)
        user = OpenAIUserSim(model="sim", base_url=server.url, api_key="k", timeout=1.0, max_retries=1, backoff=0.0)
        with pytest.raises(UserSimError, match=r"after 2 attempts \(--user-retries 1, --user-timeout 1s\)"):
            asyncio.run(user._complete([{"role": "user", "content": "hi"}], []))
    finally:
        server.close()
    assert len(server.requests) == 2
    with pytest.raises(SystemExit, match="--user-timeout"):
        options.validate(grpo.Config(user_timeout=0), 1)


def test_a_model_name_that_is_nowhere_or_a_checkpoint_config_cut_short_stops_in_one_line(tmp_path, ckpt):
    with pytest.raises(SystemExit, match=r"^grpo.py: --model: nosuchmodel: not a local directory, and no model of that "
                       r"name could be found in the Hugging Face cache or on the hub: "):
        grpo.main(["--model", "nosuchmodel", "--env", FAKE_ENV, "--eval-tasks", "0", "--out-dir", str(tmp_path / "r")])
    broken = tmp_path / "broken"
    shutil.copytree(ckpt, broken)
    cut(broken / "config.json")
    with pytest.raises(SystemExit, match=rf"^eval.py: --agent: {re.escape(str(broken))}: .*config.json.* not a valid "
                       r"JSON file"):
        evaluation.main(["--agent", str(broken), "--env", FAKE_ENV, "--out-dir", str(tmp_path / "e")])


def test_an_openai_agent_without_a_key_or_a_server_stops_in_one_line(monkeypatch):
    from envs.api_agent import OpenAIAgent

    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with pytest.raises(SystemExit, match=r"^OpenAI-compatible agent 'gpt-x': OPENAI_API_KEY is not set, and no base "
                       r"URL names another server \(--agent-base-url, --teacher-base-url\)$"):
        OpenAIAgent("gpt-x", [])
    assert OpenAIAgent("gpt-x", [], base_url="http://127.0.0.1:9").client.api_key == "EMPTY"  # a local server


def test_an_api_agents_failing_endpoint_is_named_and_a_dead_one_stops_the_evaluation_early(tmp_path):
    """An API agent (eval.py --agent openai:..., sft.py's teacher) whose endpoint answers HTML, no choices or nothing
    fails its episode with AgentError naming the model and the endpoint (they were a raw AttributeError, IndexError,
    or "Connection error." naming nothing); an endpoint that fails the first episodes stops eval.py after
    DEAD_AFTER of them, not after the retries of every task."""
    from envs.api_agent import DEAD_AFTER, AgentError, OpenAIAgent

    replies = {1: (200, b"<html>busy</html>"), 2: (200, json.dumps({"id": "x", "choices": []}).encode())}
    server = ChatServer(lambda body, n: replies.get(n, (500, {})))
    try:
        agent = OpenAIAgent("gpt-x", [], base_url=server.url, max_retries=0)
        for _ in replies:
            with pytest.raises(AgentError, match=rf"^agent 'gpt-x' at {re.escape(server.url)} answered with what is "
                               "not a chat completion"):
                agent.act([{"role": "user", "content": "hi"}])
        with pytest.raises(AgentError, match=rf"^agent 'gpt-x' at {re.escape(server.url)} failed: InternalServerError"):
            agent.act([{"role": "user", "content": "hi"}])
        server.requests.clear()
        with pytest.raises(SystemExit, match=rf"^eval.py: the first {DEAD_AFTER} episodes all failed; stopping rather "
                           r"than playing the other 7\. The last failure: agent 'x' at .* failed: InternalServerError"):
            evaluation.main(["--agent", "openai:x", "--agent-base-url", server.url, "--env", FAKE_ENV, "--num-tasks",
                             "10", "--out-dir", str(tmp_path / "e")])
        assert DEAD_AFTER <= len(server.requests) <= DEAD_AFTER * 4  # each episode's first request and the retries
    finally:
        server.close()


def test_eval_with_nothing_scored_exits_non_zero(tmp_path, ckpt):
    dead = ChatServer(lambda body, n: (500, {}))
    try:
        with pytest.raises(SystemExit, match=r"none of the 2 episodes was scored.*500"):
            evaluation.main(["--agent", str(ckpt), "--env", "tests.fake_env:FakeEnv", "--num-tasks", "2",
                             "--user-sim", "openai", "--user-base-url", dead.url, "--user-retries", "0",
                             "--max-new-tokens", "16", "--out-dir", str(tmp_path / "ev")])
    finally:
        dead.close()
    s = json.loads((tmp_path / "ev" / "summary.json").read_text())
    assert s["scored"] == 0 and s["pass^1"] is None  # null: nothing was measured, not a score of 0


def test_a_read_only_place_to_write_is_refused_at_start_not_after_the_work(tmp_path, ckpt):
    """sft.py --out and --data-out, eval.py --out-dir on a read-only filesystem (or below a file): refused before
    any training, synthesis or evaluation, in one line naming the option."""
    if os.geteuid() != 0:
        pytest.skip("mounting a read-only filesystem needs root")
    ro = tmp_path / "ro"
    ro.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)]).returncode:
        pytest.skip("no tmpfs could be mounted here")
    data = tmp_path / "d.jsonl"
    data.write_text(conv(U, A) + "\n")
    try:
        for argv, words in (
                (["sft.py", "--model", str(ckpt), "--data", str(data), "--out", str(ro / "x")], "sft.py: --out"),
                (["sft.py", "--data", str(data), "--data-out", str(ro / "d.jsonl"), "--epochs", "0"],
                 "sft.py: --data-out"),
                (["eval.py", "--agent", str(ckpt), "--env", "tests.fake_env:FakeEnv", "--out-dir", str(ro / "e")],
                 "eval.py: --out-dir")):
            with pytest.raises(SystemExit, match=rf"^{words}: cannot write into {re.escape(str(ro))}: Read-only file "
                               r"system$"):
                (sft.main if argv[0] == "sft.py" else evaluation.main)(argv[1:])
    finally:
        subprocess.run(["umount", "-l", str(ro)])
    (tmp_path / "afile").write_text("x")
    with pytest.raises(SystemExit, match=r"^sft.py: --out: cannot write below .*afile: it is a file, not a directory$"):
        sft.main(["--model", str(ckpt), "--data", str(data), "--out", str(tmp_path / "afile" / "x")])
    run, view = tmp_path / "run", tmp_path / "view"  # a run seen read-only: its --resume says so, naming --resume
    grpo.main(grpo_args(ckpt, run, "--steps", "1"))
    view.mkdir()
    subprocess.run(["mount", "--bind", str(run), str(view)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(view)], check=True)
        with pytest.raises(SystemExit, match=r"^grpo.py: --resume: cannot write into .*view: Read-only file system"):
            grpo.main(["--resume", str(view), "--env", FAKE_ENV, "--steps", "2"])
    finally:
        subprocess.run(["umount", "-l", str(view)])


def test_eval_on_a_full_disk_stops_in_one_line_and_leaves_nothing_half_written(tmp_path, ckpt):
    """On real small filesystems (tmpfs, as root can mount): too small for the episodes, nothing is left but an empty
    --out-dir; room for the episodes alone, they are whole and the summary's failure is one line."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small filesystem needs root")
    argv = ["--agent", str(ckpt), "--env", "tests.fake_env:FakeEnv", "--num-tasks", "4", "--max-new-tokens", "16"]
    evaluation.main(argv + ["--out-dir", str(tmp_path / "sizing")])
    size = (tmp_path / "sizing" / "episodes.jsonl").stat().st_size
    pages = -(-size // 4096)
    assert pages >= 2, size

    def ids(path):  # each episode's tokens (their timings differ from run to run)
        return [json.loads(line)["input_ids"] for line in open(path)]

    for room, words in ((4096 * (pages - 1), r"cannot write .*episodes.jsonl: No space left on device \(is the disk "
                         r"full or read-only\?\); nothing was written there"),
                        (4096 * pages, r"cannot write .*'s summary: No space left on device \(is the disk full or "
                         r"read-only\?\); its episodes.jsonl is whole \(eval.py --show reads it\)\. Make room, then "
                         r"evaluate again into another --out-dir")):
        disk = tmp_path / f"disk{room}"
        disk.mkdir()
        if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={room}", "tmpfs", str(disk)]).returncode:
            pytest.skip("no tmpfs could be mounted here")
        try:
            with pytest.raises(SystemExit, match=rf"^eval.py: --out-dir: {words}$"):
                evaluation.main(argv + ["--out-dir", str(disk / "ev")])
            left = sorted(p.name for p in (disk / "ev").iterdir())
            assert left == ([] if room < 4096 * pages else ["episodes.jsonl"]), left
            assert not left or ids(disk / "ev" / left[0]) == ids(tmp_path / "sizing" / "episodes.jsonl")
        finally:
            subprocess.run(["umount", "-l", str(disk)])


def test_an_evaluation_on_the_cpu_decodes_what_the_free_host_memory_holds(tmp_path, ckpt, monkeypatch, capsys):
    """`eval.py --trials 1000` on a CPU started every episode at once and was killed by the kernel at 23 GB, nothing
    written. On the CPU, --rollout-batch 0 decodes as many episodes at once as the available host memory holds by
    the estimate, the others waiting their turn; an explicit --rollout-batch beyond it is refused at start."""
    from fast import batched_rollout
    from fast.batched_rollout import RolloutConfig
    from plumbing import memory

    config = memory.read_config(str(ckpt))

    def decoding(room):
        return memory.fitting_batch(config, live=8, device_bytes=room, bf16=False, prefill_tokens=RolloutConfig.
                                    prefill_tokens, max_context=evaluation.EvalConfig().max_context)
    lo, hi = 1 << 20, 1 << 40  # the least room in which 4 decode at once
    while lo < hi:
        lo, hi = (lo, (lo + hi) // 2) if decoding((lo + hi) // 2) >= 4 else ((lo + hi) // 2 + 1, hi)
    room = lo
    assert decoding(room) == 4 and decoding(room - 1) == 3
    monkeypatch.setattr(memory, "available_host_bytes", lambda: room)
    real, used = batched_rollout.rollout, []

    def spy(model, tok, env, tasks, trials, user_sim, cfg, *args, **kwargs):
        used.append(cfg.max_batch)
        return real(model, tok, env, tasks, trials, user_sim, cfg, *args, **kwargs)
    monkeypatch.setattr(batched_rollout, "rollout", spy)
    common = ["--agent", str(ckpt), "--env", FAKE_ENV, "--num-tasks", "1", "--trials", "8", "--max-new-tokens", "8"]
    evaluation.main(common + ["--out-dir", str(tmp_path / "ev")])
    assert used == [decoding(room)]
    assert f"{decoding(room)} of this process's 8 episodes decode at once, as many as the free host memory holds" \
        in capsys.readouterr().out
    assert json.loads((tmp_path / "ev" / "summary.json").read_text())["episodes"] == 8
    monkeypatch.setattr(memory, "available_host_bytes", lambda: int(room / memory.ESTIMATE_MISSES))  # 4's peak
    with pytest.raises(SystemExit, match=r"exceeds the .* of host memory available to it on this machine \(running on "
                       r"the CPU.*8 decoding episodes.*Set --rollout-batch"):
        evaluation.main(common + ["--rollout-batch", "8", "--out-dir", str(tmp_path / "ev8")])
    evaluation.main(common + ["--rollout-batch", "8", "--no-memory-check", "--out-dir", str(tmp_path / "ev8")])


# ---- options checked at start ------------------------------------------------------------------------------------
MAINS = {"grpo.py": grpo.main, "sft.py": sft.main, "eval.py": evaluation.main}


def entry_args(program, ckpt, tmp_path):
    """A command of each entry point that would run (on the fake environment, or shop's first tasks for sft.py)."""
    return {"grpo.py": grpo_args(ckpt, tmp_path / "run"),
            "sft.py": ["--model", str(ckpt), "--num-tasks", "4", "--out", str(tmp_path / "run")],
            "eval.py": ["--agent", str(ckpt), "--env", "tests.fake_env:FakeEnv", "--num-tasks", "2",
                        "--max-new-tokens", "8", "--out-dir", str(tmp_path / "run")]}[program]


def test_every_numeric_option_declares_its_range(capsys):
    """A number's range is part of its declaration (cli.Range in its annotation), so an option added without one
    fails here. Every default lies in its range, and --help shows it."""
    for program, cls in (("grpo.py", grpo.Config), ("sft.py", sft.SFTConfig), ("eval.py", evaluation.EvalConfig)):
        numbers = cli.numeric_fields(cls)
        assert len(numbers) > 3 and [n for n in numbers if cli.range_of(cls, n) is None] == [], program
        cli.check_ranges(cls(), program)
    assert str(cli.range_of(grpo.Config, "temperature")) == "(0, inf)"  # grpo.py's other default keeps the range
    assert str(cli.range_of(evaluation.EvalConfig, "temperature")) == "[0, inf)"  # eval.py's own: 0 is greedy
    with pytest.raises(SystemExit):
        cli.parse_config(grpo.Config, ["--help"])
    assert "(default: 0.0002; range: (0, inf))" in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("program, argv, shown", [
    ("grpo.py", ["--lr", "inf"], "--lr inf: must be a finite number in (0, inf)"),  # saved NaN weights, exit 0
    ("grpo.py", ["--lr", "nan"], "--lr nan: must be a finite number in (0, inf)"),
    ("grpo.py", ["--grad-clip", "nan"], "--grad-clip nan: must be a finite number in (0, inf)"),
    ("grpo.py", ["--grad-clip", "0"], "--grad-clip 0.0: must be in (0, inf)"),  # clipped every gradient to 0
    ("grpo.py", ["--kl-coef", "nan"], "--kl-coef nan: must be a finite number in [0, inf)"),  # the KL off
    ("grpo.py", ["--dual-clip", "nan"], "--dual-clip nan: must be a finite number in [0, inf)"),  # a NaN loss
    ("grpo.py", ["--lora-rank", "4", "--lora-alpha", "nan"], "--lora-alpha nan: must be a finite number in [0, inf)"),
    ("grpo.py", ["--dist-timeout", "inf"], "--dist-timeout inf: must be a finite number in (0, 1e8]"),
    ("grpo.py", ["--seed", "-1"], "--seed -1: must be in [0, 4294967295]"),
    ("grpo.py", ["--seed", str(2**32)], "--seed 4294967296: must be in [0, 4294967295]"),
    ("grpo.py", ["--user-concurrency", "0"], "--user-concurrency 0: must be in [1, inf)"),  # waited forever
    ("grpo.py", ["--user-concurrency", "-1"], "--user-concurrency -1: must be in [1, inf)"),
    ("eval.py", ["--num-tasks", "-1"], "--num-tasks -1: must be in [0, inf)"),  # left the last task out
    ("eval.py", ["--max-new-tokens", "0"], "--max-new-tokens 0: must be in [1, inf)"),
    ("eval.py", ["--max-turns", "0"], "--max-turns 0: must be in [1, inf)"),
    ("eval.py", ["--temperature", "-1"], "--temperature -1.0: must be in [0, inf)"),  # sampled at 1e-5
    ("eval.py", ["--user-concurrency", "0"], "--user-concurrency 0: must be in [1, inf)"),
    ("sft.py", ["--micro-batch-size", "0"], "--micro-batch-size 0: must be in [1, inf)"),
    ("sft.py", ["--epochs", "-1"], "--epochs -1.0: must be in [0, inf)"),  # did nothing, exit 0
    ("sft.py", ["--num-tasks", "-5"], "--num-tasks -5: must be in [1, inf)"),  # played all but 5 tasks
    ("sft.py", ["--user-concurrency", "0"], "--user-concurrency 0: must be in [1, inf)"),
    ("sft.py", ["--seed", "-1"], "--seed -1: must be in [0, 4294967295]"),
])
def test_a_number_outside_its_range_is_refused_at_start(tmp_path, ckpt, monkeypatch, program, argv, shown):
    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded before the options were checked")
    monkeypatch.setattr(models, "load_model", no_model)
    with pytest.raises(SystemExit) as e:
        MAINS[program](entry_args(program, ckpt, tmp_path) + argv)
    assert str(e.value) == f"{program}: {shown}"
    assert not (tmp_path / "run").exists()


def test_seeds_fit_every_generator_they_feed():
    """--seed's range is numpy's (models.seed_everything); the other generators it feeds take its top value too."""
    import random

    import numpy as np
    import torch

    top = int(cli.SEEDS.high)
    models.seed_everything(top)
    torch.Generator().manual_seed(top * 1_000_003 + 7)  # eval.py's generator of process 7
    random.Random(top * 1_000_003 + 10**6)  # pipeline.step_tasks' permutation of epoch 10**6
    with pytest.raises(ValueError):
        np.random.seed(top + 1)


@pytest.mark.parametrize("program, argv, shown", [
    ("grpo.py", ["--env", "nope"], "grpo.py: --env nope: unknown environment 'nope': use 'shop', 'tau2:<retail"),
    ("grpo.py", ["--env", "tests.nope:Env"], "grpo.py: --env tests.nope:Env: unknown environment "
                                             "'tests.nope:Env': there is no module 'tests.nope'"),
    ("grpo.py", ["--env", "tests.fake_env:Nope"], "tests.fake_env has no 'Nope'"),
    ("grpo.py", ["--env", "os:system"], "grpo.py: --env os:system: os.system is a builtin_function_or_method, not a "
                                        "class: name an Environment class"),
    ("eval.py", ["--env", "collections:Counter"],
     "eval.py: --env collections:Counter: collections.Counter is no Environment: it lacks name, tasks, system_prompt"),
    ("grpo.py", ["--split", "nope"], "grpo.py: --split nope: unknown split 'nope': train, test"),
    ("eval.py", ["--env", "nope"], "eval.py: --env nope: unknown environment 'nope': use 'shop'"),
    ("eval.py", ["--split", "nope"], "eval.py: --split nope: unknown split 'nope': train, test"),
    ("sft.py", ["--env", "nope"], "sft.py: --env nope: unknown environment 'nope': use 'shop'"),
    ("sft.py", ["--split", "nope"], "sft.py: --split nope: unknown split 'nope': shop has train, test"),
    ("sft.py", ["--env", "tau2:mock", "--split", "base"], "sft.py: --teacher expert: tau2:mock has no scripted expert"),
    ("eval.py", ["--env", "tau2:mock", "--split", "base", "--agent", "expert"],
     "eval.py: --agent expert: tau2:mock has no scripted expert"),
    ("grpo.py", ["--report-to", "nope"], "grpo.py: --report-to nope: not a tracker Accelerate knows (aim, "),
    *[(p, ["--user-sim", "nope"], f"{p}: --user-sim 'nope': not one of scripted, openai, hf")
      for p in ("grpo.py", "eval.py", "sft.py")],
    ("eval.py", ["--user-base-url", "http://localhost:1/v1"], "eval.py: --user-base-url: the options of an LLM user, "
                                                              "with the scripted one (--user-sim scripted, the default)"),
    ("sft.py", ["--user-model", "gpt-4.1"], "sft.py: --user-model: the options of an LLM user, with the scripted one"),
    ("grpo.py", ["--user-sim", "hf"], "grpo.py: --user-sim hf: name the local model with --user-model"),
    *[(p, ["--user-sim", "hf", "--user-model", "/nonexistent/user"],
       f"{p}: --user-model: /nonexistent/user: no such directory") for p in ("grpo.py", "eval.py")],
    ("eval.py", ["--agent", "tiny"], "eval.py: --agent tiny: the tiny model untrained (random weights); give a "),
])
def test_an_unknown_name_is_refused_at_start_with_the_known_ones(tmp_path, ckpt, monkeypatch, program, argv, shown):
    monkeypatch.setattr(models, "load_model", lambda *args, **kwargs: pytest.fail("a model was loaded"))
    with pytest.raises(SystemExit) as e:
        MAINS[program](entry_args(program, ckpt, tmp_path) + argv)
    assert shown in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "run" / "config.json").exists()


def test_report_to_a_tracker_not_installed_is_refused_at_start(tmp_path, ckpt, monkeypatch):
    """Accelerate only warns, and the run logs to no tracker."""
    import accelerate.tracking

    monkeypatch.setattr(accelerate.tracking, "get_available_trackers", lambda: [])
    with pytest.raises(SystemExit, match=r"^grpo.py: --report-to tensorboard: its package is not installed"):
        grpo.main(grpo_args(ckpt, tmp_path / "run", "--report-to", "tensorboard"))
    assert not (tmp_path / "run").exists()


def test_report_to_tensorboard_logs_into_the_run_directory(tmp_path, ckpt, monkeypatch):
    """Accelerate refuses TensorBoard (a tracker that writes files) on an Accelerator made without a directory; the
    run gives its trackers the run directory once it has one. TensorBoard itself is stood in for by a recorder."""
    import accelerate.tracking
    from accelerate.tracking import GeneralTracker, LoggerType

    made = []

    class Recorder(GeneralTracker):
        name, requires_logging_directory = "tensorboard", True

        def __init__(self, run_name, logging_dir, **kwargs):
            super().__init__()
            self.logging_dir, self.config, self.steps = logging_dir, None, []
            made.append(self)

        @property
        def tracker(self):
            return self

        def store_init_configuration(self, values):
            self.config = values

        def log(self, values, step=None, **kwargs):
            self.steps.append(step)

    monkeypatch.setattr(accelerate.tracking, "get_available_trackers", lambda: [LoggerType.TENSORBOARD])
    monkeypatch.setitem(accelerate.tracking.LOGGER_TYPE_TO_CLASS, "tensorboard", Recorder)
    grpo.main(grpo_args(ckpt, tmp_path / "run", "--report-to", "tensorboard"))
    assert len(made) == 1 and made[0].logging_dir == str(tmp_path / "run")
    assert made[0].config["lr"] == 1e-2 and sorted(set(made[0].steps)) == [1, 2]


# ---- checked inputs ----------------------------------------------------------------------------------------------
def test_max_context_below_the_opening_is_refused_at_start(tmp_path, ckpt, monkeypatch):
    """Before the weights load (the tokenizer alone tells), in grpo.py and eval.py."""
    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("the model loaded before the refusal"))
    with pytest.raises(SystemExit, match=r"--max-context 20 is below every task's opening \(\d+ to \d+ tokens"):
        grpo.main(grpo_args(ckpt, tmp_path / "run", "--max-context", "20"))
    assert not (tmp_path / "run" / "config.json").exists()  # a run that could not start leaves no run behind
    with pytest.raises(SystemExit, match=r"^eval.py: --max-context 20 is below every task's opening"):
        evaluation.main(["--agent", str(ckpt), "--env", FAKE_ENV, "--max-context", "20", "--out-dir",
                         str(tmp_path / "e")])


def test_max_context_below_some_openings_is_warned(tiny_tok, capsys):
    from plumbing.options import check_max_context

    class Mixed(FakeEnv):  # every other task opens with a long system prompt
        def system_prompt(self, task):
            return "You are a helpful agent. " * (40 if int(task.id.split("-")[1]) % 2 else 1)

    env = Mixed(n_tasks=4)
    check_max_context(tiny_tok, env, env.tasks("train"), 500)
    assert "--max-context 500: 2 of 4 tasks open with more tokens" in capsys.readouterr().out


def conv(*messages, **extra):
    return json.dumps({"messages": list(messages), **extra})


U, A = {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}
CALL = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "c1", "type": "function", "function": {"name": "echo", "arguments": '{"text": "x"}'}}]}
RESULT = {"role": "tool", "tool_call_id": "c1", "content": "x"}


@pytest.mark.parametrize("line, problem", [
    (conv(U, {"role": "tool", "tool_call_id": "c1", "content": "x"}, A), "answers no call"),
    (conv(U, CALL, {"role": "tool", "tool_call_id": "c9", "content": "x"}, A), "'c9' is not a call"),
    (conv(U, {**CALL, "tool_calls": [{"id": "c1", "function": {"name": "echo", "arguments": "{text: x"}}]}, RESULT, A),
     "arguments are not JSON"),
    (conv(U, {**CALL, "tool_calls": [{"id": "c1", "function": {"name": "echo", "arguments": "[1]"}}]}, RESULT, A),
     "must be a JSON object"),
    (conv(U, {**CALL, "tool_calls": [{"id": "c1", "type": "function"}]}, RESULT, A), "needs a 'function'"),
    (conv(U, CALL, {"role": "tool", "tool_call_id": "c1"}, A), "content must be a string"),
    (conv({"role": "robot", "content": "x"}, A), "role must be one of"),
    (conv(U, {"role": "assistant", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}), "other than text"),
    (conv(U, {"role": "assistant", "content": "x" * conversations.MAX_LINE_BYTES}), "bytes long, more than a conversation"),
    ('{"messages": ' + "[" * 5000 + "]" * 5000 + "}", "nested 5001 levels deep"),
    (conv(U, {"role": "assistant", "content": "caf\ud800"}), "an escape of an unpaired surrogate"),
    (conv(U, CALL, RESULT, A, tools=["echo"]), "tool 0: not a function schema"),
    (conv(U, CALL, RESULT, A, tools=[{"function": {"name": ""}}]), "tool 0: not a function schema"),
], ids=["no-call", "other-call", "not-json-arguments", "arguments-not-object", "no-function", "no-content", "role",
        "image", "too-long", "too-deep", "surrogate", "tool-a-name", "tool-no-name"])
def test_broken_cold_start_conversations_are_named_and_skipped(tmp_path, line, problem, capsys):
    p = tmp_path / "d.jsonl"
    good = conv(U, CALL, RESULT, {"role": "assistant", "content": [{"type": "text", "text": "done"}]})
    p.write_text(good + "\n" + line + "\n")
    kept = conversations.load_conversations(str(p))
    assert len(kept) == 1 and kept[0]["messages"][-1]["content"] == "done"  # content parts joined
    assert kept[0]["source"].endswith("d.jsonl:1")
    out = capsys.readouterr().out
    assert "d.jsonl:2:" in out and problem in out and "1 malformed conversation(s) skipped, 1 kept" in out
    with pytest.raises(ValueError, match=f"d.jsonl:2: malformed conversation: .*{problem}"):
        conversations.load_conversations(str(p), strict=True)


def test_data_file_encoding_and_emptiness_are_named(tmp_path):
    p = tmp_path / "d.jsonl"
    bad = b'{"messages": [{"role": "user", "content": "caf\xe9"}]}'
    p.write_bytes(conv(U, A).encode() + b"\n" + bad + b"\n")
    with pytest.raises(ValueError, match=rf"d.jsonl:2: .*not UTF-8: byte 0xe9 at column {bad.index(0xe9) + 1}"):
        conversations.load_conversations(str(p), strict=True)
    p.write_text("\n\n")
    with pytest.raises(ValueError, match="d.jsonl: the file is empty"):
        conversations.load_conversations(str(p))
    p.write_text("{bad\n[1]\n")
    with pytest.raises(ValueError, match=r"none of its 2 conversations is usable"):
        conversations.load_conversations(str(p))
    # a byte-order mark is not line 1's text (it made line 1 "not JSON"); a gzip file and one JSON document over
    # several lines (pretty-printed) are named as what they are, not as that many broken lines
    p.write_bytes(b"\xef\xbb\xbf" + conv(U, A).encode() + b"\n")
    assert conversations.load_conversations(str(p), strict=True)[0]["source"].endswith("d.jsonl:1")
    import gzip

    p.write_bytes(gzip.compress(conv(U, A).encode()))
    with pytest.raises(ValueError, match=r"d.jsonl is gzip-compressed: decompress it first"):
        conversations.load_conversations(str(p))
    p.write_text(json.dumps([json.loads(conv(U, A))] * 2, indent=2))
    with pytest.raises(ValueError, match=r"d.jsonl: one JSON array over 26 lines, not JSONL: give each conversation"):
        conversations.load_conversations(str(p))
    with pytest.raises(SystemExit, match=r"sft.py: --data: .*the file is empty"):
        (tmp_path / "e.jsonl").write_text("")
        sft.main(["--data", str(tmp_path / "e.jsonl"), "--out", str(tmp_path / "o")])


# ---- clear loading errors ---------------------------------------------------------------------------------------
def test_a_checkpoint_whose_config_weights_or_tokenizer_disagree_is_refused(tmp_path, ckpt):
    """A checkpoint whose config.json says fewer layers than its weights hold was evaluated with the extra layers
    dropped, exit 0; one naming another architecture loaded a random model; a tokenizer with more tokens than the
    embedding gave a raw IndexError mid-run (round 3). Each is refused at load in one line naming the mismatch."""
    import shutil

    from transformers import AutoTokenizer

    def variant(name, edit=None, tokens=0):
        d = tmp_path / name
        shutil.copytree(ckpt, d)
        if edit:
            cfg = json.loads((d / "config.json").read_text())
            edit(cfg)
            (d / "config.json").write_text(json.dumps(cfg))
        if tokens:
            tok = AutoTokenizer.from_pretrained(d)
            tok.add_tokens([f"<extra_{i}>" for i in range(tokens)])
            tok.save_pretrained(d)
        return str(d)

    fewer = variant("fewer-layers", lambda c: c.update(num_hidden_layers=1, **(
        {"layer_types": c["layer_types"][:1]} if "layer_types" in c else {})))
    with pytest.raises(SystemExit, match=r"fewer-layers: its weights and its config.json \(\w+\) disagree; weights the "
                                         r"config has no place for: \d+ \(model.layers.1."):
        models.load_model(fewer, device="cpu")
    with pytest.raises(SystemExit, match=r"its weights and its config.json \(\w+\) disagree"):
        evaluation.main(["--agent", fewer, "--env", "tests.fake_env:FakeEnv", "--num-tasks", "1",
                         "--out-dir", str(tmp_path / "ev")])
    other = variant("other-arch", lambda c: c.update(architectures=["GPTNeoXForCausalLM"], model_type="gpt_neox"))
    with pytest.raises(SystemExit, match=r"other-arch: (its weights and its config.json .* disagree|could not load)"):
        models.load_model(other, device="cpu")
    wide = variant("wide-tokenizer", tokens=600)
    with pytest.raises(SystemExit, match=r"wide-tokenizer: the tokenizer has \d+ tokens and the model's embedding \d+ "
                                         r"rows: they do not belong together"):
        grpo.main(grpo_args(wide, tmp_path / "run"))
    assert models.load_model(str(ckpt), device="cpu")[0] is not None  # the checkpoint itself loads


def test_loading_errors_name_the_path_and_the_option(tmp_path, ckpt, monkeypatch):
    import shutil

    with pytest.raises(SystemExit, match=r"grpo.py: --init-from: .*nowhere/sft: no such directory"):
        grpo.main(grpo_args(tmp_path / "nowhere" / "sft", tmp_path / "run"))
    monkeypatch.chdir(tmp_path)  # a relative path whose first part is a directory here is local, not a hub id
    (tmp_path / "runs").mkdir()
    with pytest.raises(SystemExit, match=r"runs/sft-qwen3: no such directory"):
        grpo.main(grpo_args("runs/sft-qwen3", tmp_path / "run"))
    broken = tmp_path / "broken"
    shutil.copytree(ckpt, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # cut short
    with pytest.raises(SystemExit, match=r"eval.py: --agent: .*broken: could not load the model \(weight files: model.safetensors\)"):
        evaluation.main(["--agent", str(broken), "--env", "tests.fake_env:FakeEnv", "--num-tasks", "1"])
    notok = tmp_path / "notok"
    shutil.copytree(ckpt, notok)
    for f in notok.glob("tokenizer*"):
        f.unlink()
    with pytest.raises(SystemExit, match=r"notok: no tokenizer files in the checkpoint"):
        grpo.main(grpo_args(notok, tmp_path / "run"))


# ---- interrupts ---------------------------------------------------------------------------------------------------
@pytest.fixture
def terminal_signals():
    """Signals as a terminal's foreground job has them, whatever the suite inherited (`nohup ./run pytest &` starts
    it with SIGINT and SIGHUP ignored, and muarl leaves an ignored signal ignored)."""
    names = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    old = {s: signal.getsignal(s) for s in names}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    yield
    for s, handler in old.items():
        signal.signal(s, handler)


def test_ctrl_c_stops_after_the_step_saves_and_says_how_to_resume(tmp_path, ckpt, monkeypatch, capsys, terminal_signals):
    from fast import batched_rollout as rollout_module

    real, calls = rollout_module.rollout, []

    def interrupted(*args, **kwargs):  # Ctrl-C arrives while step 2 rolls out
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGINT)
        return real(*args, **kwargs)

    monkeypatch.setattr(rollout_module, "rollout", interrupted)
    run = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        grpo.main(grpo_args(ckpt, run, "--steps", "4", "--save-every", "10"))
    assert e.value.code == 130
    out = capsys.readouterr().out
    assert "Ctrl-C: finishing this step" in out
    assert (f"stopped by Ctrl-C after step 2 of 4, checkpoint saved; continue with: accelerate launch grpo.py "
            f"--resume {run}") in out
    assert steps_logged(run) == [1, 2] and (run / "checkpoints" / "step-000002" / "trainer_state.json").exists()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handler is given back
    monkeypatch.undo()
    grpo.main(["--resume", str(run), "--env", FAKE_ENV, "--steps", "4"])
    assert steps_logged(run) == [1, 2, 3, 4]


def test_second_ctrl_c_stops_at_once_and_names_the_last_checkpoint(tmp_path, ckpt, monkeypatch, capsys, terminal_signals):
    from plumbing import stopping
    from fast import batched_rollout as rollout_module

    real, calls = rollout_module.rollout, []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGINT)  # once: stop after the step
            os.kill(os.getpid(), signal.SIGINT)  # again (debounce 0 here): stop now
        return real(*args, **kwargs)

    monkeypatch.setattr(rollout_module, "rollout", interrupted)
    monkeypatch.setattr(stopping.StopOnInterrupt, "debounce_s", 0.0)
    run = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        grpo.main(grpo_args(ckpt, run, "--steps", "4", "--save-every", "1"))
    assert e.value.code == 130
    out = capsys.readouterr().out
    assert (f"interrupted during step 2: the newest checkpoint is step 1; continue with: accelerate launch grpo.py "
            f"--resume {run}") in out
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


# ---- a tool call has a deadline ---------------------------------------------------------------------------------
class _Tools:
    """A session whose tools write, hold the interpreter in C (a big-integer power: no thread or signal can stop
    it), or kill their own process."""

    def __init__(self):
        self.db = []

    def call_tool(self, name, arguments, requestor="assistant"):
        if name == "power":
            return ToolResult(str((3 ** arguments["exponent"]).bit_length()))
        if name == "die":
            os.kill(os.getpid(), signal.SIGKILL)
        self.db.append(arguments["x"])
        return ToolResult(str(self.db))


class _ToolsEnv:
    """An environment whose sessions are _Tools (session_class: another kind)."""

    def __init__(self, session_class=None):
        self.session_class = session_class or _Tools

    def start(self, task):
        return self.session_class()


def test_a_tool_call_past_its_deadline_or_killing_its_process_is_an_error_that_changes_nothing():
    import time

    from fast import deadlines

    session = deadlines.guard(_ToolsEnv(), None, 1.0)
    assert session.call_tool("write", {"x": 1}) == ToolResult("[1]")
    t0 = time.monotonic()
    res = session.call_tool("power", {"exponent": 10**9})  # minutes in C
    assert res.error and "did not finish within its deadline of 1 s (--tool-timeout)" in res.content
    assert time.monotonic() - t0 < 10
    assert session.call_tool("power", {"exponent": 10}) == ToolResult("16")
    # the copy that tries each call is made again (the session's start, then the calls that ran): the write is there
    assert session.call_tool("write", {"x": 2}) == ToolResult("[1, 2]")
    res = session.call_tool("die", {})  # would end this process; ends only the copy
    assert res.error and "changed nothing" in res.content
    assert session.call_tool("write", {"x": 3}) == ToolResult("[1, 2, 3]") and session.session.db == [1, 2, 3]
    assert deadlines.guard(_ToolsEnv(), None, 0).__class__ is _Tools  # --tool-timeout 0: no deadline
    with pytest.raises(KeyError):  # an ordinary exception (a bug of the session's) raises here as it always did
        session.call_tool("write", {})
    assert session.call_tool("write", {"x": 4}) == ToolResult("[1, 2, 3, 4]")


def test_once_its_keeper_is_made_no_tool_call_forks_the_process_that_holds_the_model(monkeypatch):
    """The probes are forked from the environment's keeper, made before the model loads (grpo.py and eval.py call
    deadlines.prepare): a forked copy of a process holding the model makes it copy every page it writes while the
    copy lives (a rollout took 1.5x as long), and on a GPU would fork a CUDA context. Calls, an overrun, a crash and
    the copies made again after them all happen without this process forking once."""
    import time

    from fast import deadlines

    env = _ToolsEnv()
    deadlines.prepare(env)

    def no_fork():
        raise AssertionError("a tool call forked the process that holds the model")
    monkeypatch.setattr(os, "fork", no_fork)
    a, b = deadlines.guard(env, None, 1.0), deadlines.guard(env, None, 1.0)
    assert a.call_tool("write", {"x": 1}) == ToolResult("[1]") and b.call_tool("write", {"x": 5}) == ToolResult("[5]")
    t0 = time.monotonic()
    assert a.call_tool("power", {"exponent": 10**9}).error and time.monotonic() - t0 < 10
    assert a.call_tool("die", {}).error
    # the probe forked again by the keeper rebuilt both copies from their sessions' starts and calls
    assert a.call_tool("write", {"x": 2}) == ToolResult("[1, 2]") and b.call_tool("write", {"x": 6}) == ToolResult(
        "[5, 6]")
    assert a.session.db == [1, 2] and b.session.db == [5, 6]


def test_a_keeper_forked_by_a_thread_outlives_it_and_a_task_it_cannot_copy_runs_without_a_probe(caplog):
    """A keeper forked from a thread that then ends (the user thread of one rollout, with a dual-control user's tools)
    keeps serving the next rollout's calls (Linux's death signal follows the forking thread, so a keeper ends with
    its pipe instead); a session whose task cannot be sent to the probe (not picklable) runs its calls here, saying
    so, and nothing crashes."""
    import logging
    import threading

    from fast import deadlines

    env = _ToolsEnv()
    first = []
    t = threading.Thread(target=lambda: first.append(deadlines.guard(env, None, 1.0).call_tool("write", {"x": 1})))
    t.start()
    t.join()
    assert first == [ToolResult("[1]")]
    pid = deadlines.KEEPERS.get(env).pid
    session = deadlines.guard(env, None, 1.0)
    assert session.call_tool("write", {"x": 2}) == ToolResult("[2]") and deadlines.KEEPERS.get(env).pid == pid
    assert session.call_tool("power", {"exponent": 10**9}).error  # the deadline still holds
    with caplog.at_level(logging.WARNING, logger="muarl"):
        odd = deadlines.guard(env, lambda: None, 1.0)  # a task the probe cannot be sent
        assert odd.call_tool("write", {"x": 3}) == ToolResult("[3]")
    assert "cannot be sent to the probe" in caplog.text


def test_a_call_interrupted_mid_way_leaves_no_answer_behind_for_the_next(monkeypatch):
    """A stop signal (or any exception) between asking the probe and reading its answer: the next call must not
    read that stale answer as its own (it would then run, for real, a call nobody timed)."""
    import time

    from fast import deadlines

    env = _ToolsEnv()
    session = deadlines.guard(env, None, 1.0)
    assert session.call_tool("write", {"x": 1}) == ToolResult("[1]")
    conn_class = type(deadlines.KEEPERS.get(env).conn)

    def interrupted(conn, timeout):
        time.sleep(0.2)  # the probe has answered by now
        raise KeyboardInterrupt

    monkeypatch.setattr(conn_class, "poll", interrupted)
    with pytest.raises(KeyboardInterrupt):
        session.call_tool("write", {"x": 2})
    monkeypatch.undo()
    res = session.call_tool("power", {"exponent": 10**9})
    assert res.error and "deadline" in res.content  # timed, not answered by the interrupted call's "ok"
    assert session.session.db == [1]


def test_a_remote_tool_past_its_deadline_is_abandoned_and_the_session_takes_one_call_at_a_time():
    import threading
    import time

    from fast import deadlines

    gate = threading.Event()

    class Remote(_Tools):
        def call_tool(self, name, arguments, requestor="assistant"):
            if name == "slow":
                gate.wait(10)
            return super().call_tool(name, arguments, requestor)

    session = deadlines.guard(_ToolsEnv(Remote), None, 0.5, remote=True)
    t0 = time.monotonic()
    res = session.call_tool("slow", {"x": 1})
    assert res.error and "was abandoned" in res.content and time.monotonic() - t0 < 5
    res = session.call_tool("write", {"x": 2})  # the abandoned call still holds the session
    assert res.error and "previous tool call is still running" in res.content
    gate.set()
    time.sleep(0.2)
    assert session.call_tool("write", {"x": 3}) == ToolResult("[1, 3]")  # the abandoned one did land, remotely


def test_the_rollout_runs_every_tool_call_under_the_deadline(tiny_lm, tiny_tok):
    """The session an episode's tools (the agent's and a user's) act on is the one under --tool-timeout."""
    from fast import deadlines

    seen = []

    class Spy(FakeEnv):
        def start(self, task):
            return _Tools()

    sim = make_user_sim("scripted")
    real_start = sim.start
    sim.start = lambda env, task, session, opening: seen.append(session) or real_start(env, task, session, opening)
    rollout(tiny_lm, tiny_tok, Spy(), Spy().tasks("train")[:1], 2, sim,
            RolloutConfig(greedy=True, max_new_tokens=8, max_turns=2, tool_timeout=7.0))
    assert len(seen) == 2 and all(isinstance(s, deadlines.DeadlineSession) and s.timeout == 7.0 for s in seen)
    opts = options.SamplingOptions(tool_timeout=3.0)
    assert RolloutConfig.from_options(opts, on_gpu=False).tool_timeout == 3.0


# ---- stop signals, one run per directory, finished runs ---------------------------------------------------------
def _signal_at_rollout(monkeypatch, n, sig):
    from fast import batched_rollout as rollout_module

    real, calls = rollout_module.rollout, []

    def signalled(*args, **kwargs):  # the signal arrives while the n-th rollout runs
        calls.append(1)
        if len(calls) == n:
            os.kill(os.getpid(), sig)
        return real(*args, **kwargs)

    monkeypatch.setattr(rollout_module, "rollout", signalled)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_or_sighup_abandons_the_rollout_saves_the_last_step_and_says_how_to_resume(tmp_path, ckpt, monkeypatch,
                                                                                           capsys, sig,
                                                                                           terminal_signals):
    """Preemption (Slurm, Kubernetes) sends SIGTERM and kills ~30 s later: one process leaves the rollout at once
    and saves the last finished step, with its RNG state as it was then."""
    _signal_at_rollout(monkeypatch, 2, sig)
    run = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        grpo.main(grpo_args(ckpt, run, "--steps", "3", "--save-every", "10"))
    assert e.value.code == 128 + sig
    out = capsys.readouterr().out
    assert (f"stopped by {signal.Signals(sig).name} during step 2: checkpoint of step 1 saved; continue with: "
            f"accelerate launch grpo.py --resume {run}") in out
    assert steps_logged(run) == [1] and (run / "checkpoints" / "step-000001" / "trainer_state.json").exists()
    monkeypatch.undo()
    resumed = grpo.main(["--resume", str(run), "--env", FAKE_ENV])
    assert steps_logged(run) == [1, 2, 3]
    # exactly the run that was never stopped: the abandoned rollout left nothing behind
    full = grpo.main(grpo_args(ckpt, tmp_path / "full", "--steps", "3", "--save-every", "10"))
    a, b = full.model.state_dict(), resumed.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    losses = [[json.loads(line)["loss"] for line in open(d / "metrics.jsonl")] for d in (run, tmp_path / "full")]
    assert losses[0] == losses[1]


def test_a_stop_before_the_first_checkpoint_or_in_the_evaluation_leaves_a_run_that_resume_starts_again(
        tmp_path, ckpt, monkeypatch, capsys, terminal_signals):
    _signal_at_rollout(monkeypatch, 1, signal.SIGTERM)  # the "before" evaluation's rollout
    run = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        grpo.main(grpo_args(ckpt, run, "--eval-tasks", "2"))
    assert e.value.code == 128 + signal.SIGTERM
    assert (f"stopped by SIGTERM while loading or evaluating; continue with: accelerate launch grpo.py --resume "
            f"{run}") in capsys.readouterr().out
    _signal_at_rollout(monkeypatch, 2, signal.SIGINT)  # Ctrl-C in step 1's rollout: it finishes, and is saved
    with pytest.raises(SystemExit) as e:
        grpo.main(["--resume", str(run), "--env", FAKE_ENV])
    assert e.value.code == 130 and steps_logged(run) == [1]
    monkeypatch.undo()
    grpo.main(["--resume", str(run), "--env", FAKE_ENV])
    summary = json.loads((run / "summary.json").read_text())
    assert steps_logged(run) == [1, 2] and "eval/before/pass1" in summary and "eval/after/pass1" in summary
    # the gain pairs the resumed run's "before" (written by its first start) with its "after"
    rewards = {tag: {e["task_id"]: e["reward"] for e in map(json.loads, open(run / f"eval-{tag}.jsonl"))}
               for tag in ("before", "after")}
    gain = summary["eval/gain"][0]
    assert gain["group"] == "all tasks" and gain["tasks"] == 2 and sorted(rewards["before"]) == sorted(rewards["after"])
    assert gain["diff"] == pytest.approx(sum(rewards["after"][t] - rewards["before"][t] for t in rewards["after"]) / 2)


def test_resuming_a_finished_run_rewrites_nothing(tmp_path, ckpt, capsys):
    run = tmp_path / "run"
    grpo.main(grpo_args(ckpt, run, "--eval-tasks", "2"))
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    assert grpo.main(["--resume", str(run), "--env", FAKE_ENV]) is None
    assert "finished all 2 steps" in capsys.readouterr().out
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before


def test_two_runs_never_share_a_directory_and_a_dead_run_leaves_no_lock(tmp_path, ckpt, capsys):
    import shutil
    import subprocess
    import sys

    run, young = tmp_path / "run", tmp_path / "young"  # young: still going, before its first checkpoint
    grpo.main(grpo_args(ckpt, run, "--steps", "1"))
    young.mkdir()
    shutil.copy(run / "config.json", young / "config.json")
    holders = [subprocess.Popen([sys.executable, "-c", "import fcntl, sys, time; f = open(sys.argv[1], 'a+'); "
                                 "fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB); f.write('pid 4242'); f.flush(); "
                                 "print('held', flush=True); time.sleep(60)", str(d / "run.lock")],
                                stdout=subprocess.PIPE, text=True) for d in (run, young)]
    try:
        assert [h.stdout.readline().strip() for h in holders] == ["held", "held"]
        capsys.readouterr()
        with pytest.raises(SystemExit, match="is in use by a run that is still going"):
            grpo.main(["--resume", str(run), "--env", FAKE_ENV, "--steps", "2"])
        with pytest.raises(SystemExit, match="is in use by a run that is still going"):
            grpo.main(grpo_args(ckpt, run, "--overwrite"))
        with pytest.raises(SystemExit, match="is in use by a run that is still going"):
            grpo.main(["--resume", str(young), "--env", FAKE_ENV])
        assert "starting it again" not in capsys.readouterr().out  # no restart announced of a run still going
    finally:
        for h in holders:
            h.kill()
            h.wait()
    grpo.main(["--resume", str(run), "--env", FAKE_ENV, "--steps", "2"])  # killed: its lock went with it
    assert steps_logged(run) == [1, 2]


def test_overwrite_deletes_nothing_that_no_run_wrote_and_eval_never_writes_into_a_run(tmp_path, ckpt):
    other = tmp_path / "other"
    (other / "checkpoints").mkdir(parents=True)
    (other / "checkpoints" / "mine.bin").write_text("not a run's")
    for given in (["--overwrite"], []):  # (without --overwrite it said to use --overwrite, which then refused it)
        with pytest.raises(SystemExit, match=r"^grpo.py: --(overwrite|out-dir): .*no config.json, so no run of grpo.py "
                           r"wrote them; nothing was deleted. Move them away or choose another --out-dir$"):
            grpo.main(grpo_args(ckpt, other, *given))
    assert (other / "checkpoints" / "mine.bin").read_text() == "not a run's"
    run = tmp_path / "run"
    grpo.main(grpo_args(ckpt, run, "--steps", "1"))
    with pytest.raises(SystemExit, match="holds a training run"):
        evaluation.main(["--agent", str(ckpt), "--env", "tests.fake_env:FakeEnv", "--out-dir", str(run)])
    with pytest.raises(SystemExit, match=r"^eval.py: --out-dir: .* holds a model \(config.json and its weights\)"):
        evaluation.main(["--agent", str(ckpt), "--env", FAKE_ENV, "--out-dir", str(ckpt)])  # (said: a training run)
    with pytest.raises(SystemExit, match=r"^eval.py: --merge-lora: --agent expert is not a checkpoint"):
        evaluation.main(["--agent", "expert", "--env", "shop", "--merge-lora", str(tmp_path / "m")])
    with pytest.raises(SystemExit, match=r"^eval.py: --merge-lora: --num-tasks, --temperature has no effect: "):
        evaluation.main(["--agent", "expert", "--merge-lora", str(tmp_path / "m"), "--num-tasks", "3",
                         "--temperature", "0.7"])
    # a run directory, or one of its checkpoints, given as a model: the line says where its model is
    step = run / "checkpoints" / "step-000001"
    with pytest.raises(SystemExit, match=rf"^eval.py: --agent: {re.escape(str(run))}: a run directory of grpo.py, not a "
                       rf"model: give one of its checkpoints' model, e.g. {re.escape(str(step / 'model'))}$"):
        evaluation.main(["--agent", str(run), "--env", FAKE_ENV, "--out-dir", str(tmp_path / "e")])
    with pytest.raises(SystemExit, match=rf"^grpo.py: --init-from: {re.escape(str(step))}: a checkpoint of grpo.py, "
                       rf"not a model directory: its model is {re.escape(str(step / 'model'))}$"):
        grpo.main(grpo_args(step, tmp_path / "r2"))
    mine = tmp_path / "mine"  # a user's own files of the names eval writes: refused, untouched
    mine.mkdir()
    for name in evaluation.WRITES:
        (mine / name).write_text(f"my {name}")
    for kept in (evaluation.WRITES, ("results.md",)):
        for name in set(evaluation.WRITES) - set(kept):
            (mine / name).unlink(missing_ok=True)
        with pytest.raises(SystemExit, match=r"holds .*results.md, which no evaluation wrote"):
            evaluation.main(["--agent", str(ckpt), "--env", "tests.fake_env:FakeEnv", "--num-tasks", "1",
                             "--out-dir", str(mine)])
        assert all((mine / name).read_text() == f"my {name}" for name in kept)
    again = ["--agent", str(ckpt), "--env", "tests.fake_env:FakeEnv", "--num-tasks", "1", "--max-new-tokens", "8",
             "--out-dir", str(tmp_path / "ev")]
    evaluation.main(again)
    evaluation.main(again)  # an earlier evaluation's directory: replaced, as before


def test_a_launcher_that_dies_takes_its_single_process_run_with_it(tmp_path):
    """`accelerate launch` with one process dies of SIGTERM without passing it on: the run gets SIGTERM itself."""
    import subprocess
    import sys
    import time

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    child = (f"import sys, signal, time; sys.path.insert(0, {root!r}); from plumbing import stopping; "
             f"signal.signal(signal.SIGTERM, lambda *a: (open({str(tmp_path / 'got')!r}, 'w').write('SIGTERM'), "
             "sys.exit(0))); stopping.follow_launcher(); print('ready', flush=True); time.sleep(60)")
    launcher = tmp_path / "accelerate-launch.py"  # its command line names accelerate, as the real one's does
    launcher.write_text(f"import subprocess, sys; subprocess.run([sys.executable, '-c', {child!r}])")
    p = subprocess.Popen([sys.executable, str(launcher)], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    p.kill()  # SIGKILL: the launcher passes nothing on
    p.wait()
    deadline = time.monotonic() + 20
    while not (tmp_path / "got").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert (tmp_path / "got").read_text() == "SIGTERM"


def test_a_signal_inherited_as_ignored_stays_ignored():
    """`nohup` and the background jobs of a script start with SIGINT (or SIGHUP) ignored: muarl leaves it so."""
    from plumbing import stopping

    old = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with stopping.StopOnInterrupt("grpo"):
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, old)


def test_a_stop_signal_that_lands_in_a_finalizer_is_not_lost():
    """A SIGTERM whose handler ran inside a __del__ (which the garbage collector runs anywhere) raised Abandoned there,
    where Python prints and drops it: an evaluation then ran on to its end (a user-style probe, 1 timing in 4). The
    signal is sent again and lands in the work itself."""
    from plumbing import stopping

    class Finalized:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGTERM)  # the handler runs here, in the finalizer's frame
            time.sleep(0.01)

    with stopping.StopOnInterrupt("grpo") as stop, stop.abandoning("SIGTERM"):
        with pytest.raises(stopping.Abandoned, match="SIGTERM"):
            Finalized()  # dropped at once: its __del__ runs
            t0 = time.time()
            while time.time() - t0 < 5:  # the work: the signal sent again must stop it
                time.sleep(0.01)
        assert time.time() - t0 < 2 and stop.asked == "SIGTERM"


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (self.marker,)


@pytest.mark.parametrize("planted", ["custom_checkpoint_0.pkl", "random_states_0.pkl"])
def test_resuming_a_run_directory_never_runs_code_planted_in_it(tmp_path, ckpt, planted):
    import pickle

    run = tmp_path / "run"
    grpo.main(grpo_args(ckpt, run, "--steps", "1"))
    state = run / "checkpoints" / "step-000001" / "accelerate"
    assert (state / "scheduler.json").exists() and not (state / "custom_checkpoint_0.pkl").exists()
    if planted == "custom_checkpoint_0.pkl":  # where older checkpoints kept the scheduler
        (state / "scheduler.json").unlink()
    marker = tmp_path / "pwned"
    (state / planted).write_bytes(pickle.dumps(_Payload(str(marker))))
    with pytest.raises(SystemExit, match="it was not loaded \\(it could run code\\)"):
        grpo.main(["--resume", str(run), "--env", FAKE_ENV, "--steps", "2"])
    assert not marker.exists()


def test_a_run_directory_never_chooses_code_to_import(tmp_path, ckpt):
    """A checkpoint's saved settings naming "env": "this:s" made --resume import any installed module and call one of
    its attributes (round 3). Only the environments muarl ships are taken from a run directory; a plug-in one is
    named again on the command line (then it is the user's choice, as when the run started)."""
    import sys

    run = tmp_path / "run"
    grpo.main(grpo_args(ckpt, run, "--steps", "1"))
    saved = run / "checkpoints" / "step-000001" / "model" / "muarl_config.json"
    settings = json.loads(saved.read_text())
    settings["grpo"]["env"] = "this:s"
    saved.write_text(json.dumps(settings))
    sys.modules.pop("this", None)
    for argv in (["--resume", str(run), "--steps", "2"], ["--resume", str(run), "--env", FAKE_ENV, "--steps", "2"]):
        with pytest.raises(SystemExit, match=r"the run's environment, 'this:s' in its saved settings, is not one muarl "
                                             r"ships .* name it again on the command line, --resume .* --env this:s"):
            grpo.main(argv)
    young = tmp_path / "young"  # a run stopped before its first checkpoint: its config.json is what --resume reads
    young.mkdir()
    (young / "config.json").write_text(json.dumps({**json.loads((run / "config.json").read_text()), "env": "this:s"}))
    with pytest.raises(SystemExit, match=r"the run's environment, 'this:s' in its saved settings, is not one muarl"):
        grpo.main(["--resume", str(young)])
    assert "this" not in sys.modules  # nothing was imported
    settings["grpo"]["env"] = FAKE_ENV  # the run's own plug-in, named again: resumes
    saved.write_text(json.dumps(settings))
    with pytest.raises(SystemExit, match=r"'tests.fake_env:FakeEnv' in its saved settings, is not one muarl ships"):
        grpo.main(["--resume", str(run), "--steps", "2"])
    grpo.main(["--resume", str(run), "--env", FAKE_ENV, "--steps", "2"])
    assert steps_logged(run) == [1, 2]


def test_eval_env_evaluates_on_another_environment_and_a_resume_names_a_plug_in_one_again(tmp_path, ckpt, capsys):
    """--eval-env: the held-out evaluations (before, after, --eval-every) run on its test split, not --env's (train
    with shop:static, measure against shop's dynamic user). Like --env, a plug-in one is taken from a run directory
    only when named again on the command line."""
    other = "tests.fake_env:OtherEnv"
    run = tmp_path / "run"
    grpo.main(grpo_args(ckpt, run, "--steps", "1", "--eval-tasks", "3", "--eval-env", other))
    for tag in ("before", "after"):
        ids = [json.loads(line)["task_id"] for line in open(run / f"eval-{tag}.jsonl")]
        assert sorted(ids) == ["other-test-0", "other-test-1", "other-test-2"]
    assert f"eval (before) on 3 test tasks of {other}" in capsys.readouterr().out
    with pytest.raises(SystemExit, match=r"the run's evaluations' environment, 'tests.fake_env:OtherEnv' in its saved "
                                         r"settings, is not one muarl ships .* --resume .* --eval-env tests.fake_env"):
        grpo.main(["--resume", str(run), "--env", FAKE_ENV, "--steps", "2"])
    grpo.main(["--resume", str(run), "--env", FAKE_ENV, "--eval-env", other, "--steps", "2"])
    assert steps_logged(run) == [1, 2]
    with pytest.raises(SystemExit, match=r"grpo.py: --eval-env nope: unknown environment 'nope'"):
        grpo.main(grpo_args(ckpt, tmp_path / "bad", "--eval-env", "nope"))
    with pytest.raises(SystemExit, match=r"^grpo.py: --eval-env tau2:mock \(its 'test' split\): unknown split 'test'"):
        grpo.main(grpo_args(ckpt, tmp_path / "bad", "--eval-env", "tau2:mock"))  # (it said "--eval-env test")


def test_damaged_state_files_and_a_checkpoint_outside_the_run_are_named_in_one_line(tmp_path, ckpt, capsys):
    """latest.json naming another run's checkpoint by absolute path made --resume train and write into that run,
    exit 0 (round 3): only a step-N beside it is taken, else the newest complete step of this run, saying so. A
    trainer_state.json whose step is not a number and a cut-short scheduler.json stop the resume in one line."""
    other, run = tmp_path / "other", tmp_path / "run"
    grpo.main(grpo_args(ckpt, other, "--steps", "1"))
    grpo.main(grpo_args(ckpt, run, "--steps", "1"))
    before = {p: p.stat().st_mtime_ns for p in other.rglob("*") if p.is_file()}
    (run / "checkpoints" / "latest.json").write_text(json.dumps(
        {"checkpoint": str(other / "checkpoints" / "step-000001")}))
    grpo.main(["--resume", str(run), "--env", FAKE_ENV, "--steps", "2"])
    assert "is not a checkpoint of this run (a step-N directory beside it); using the newest complete checkpoint, " \
           "step-000001" in capsys.readouterr().out
    assert steps_logged(run) == [1, 2] and steps_logged(other) == [1]
    assert {p: p.stat().st_mtime_ns for p in other.rglob("*") if p.is_file()} == before  # the other run untouched
    state = run / "checkpoints" / "step-000002" / "trainer_state.json"
    good = state.read_text()
    state.write_text(good.replace('"step": 2', '"step": "abc"'))
    with pytest.raises(SystemExit, match=r"trainer_state.json holds step 'abc' and data position .*, not whole numbers"):
        grpo.main(["--resume", str(run), "--env", FAKE_ENV, "--steps", "3"])
    for step in (7, 1):  # a step its directory does not name: steps 3-7 skipped, or step 2 trained twice
        state.write_text(good.replace('"step": 2', f'"step": {step}'))
        with pytest.raises(SystemExit, match=rf"trainer_state.json says step {step}, its directory step-000002: the "
                           r"checkpoint is damaged"):
            grpo.main(["--resume", str(run), "--env", FAKE_ENV, "--steps", "8"])
    state.write_text(good)
    scheduler = run / "checkpoints" / "step-000002" / "accelerate" / "scheduler.json"
    scheduler.write_text(scheduler.read_text()[:10])
    with pytest.raises(SystemExit, match=r"scheduler.json is unreadable \(JSONDecodeError: .*the checkpoint is damaged"):
        grpo.main(["--resume", str(run), "--env", FAKE_ENV, "--steps", "3"])


DAMAGE = {  # what is done to the run's only checkpoint -> the line --resume stops with
    "no trainer_state.json": (lambda c: (c / "trainer_state.json").unlink(),
                              r"latest.json names step-000002, which is not a complete checkpoint, and .* holds no "
                              r"complete checkpoint .*: to train the run again from step 0, give its command with "
                              r"--overwrite"),
    "no step directory": (lambda c: shutil.rmtree(c), r"latest.json names step-000002, which is not a complete "
                          r"checkpoint, and .* holds no complete checkpoint"),
    "no scheduler.json": (lambda c: (c / "accelerate" / "scheduler.json").unlink(),
                          r"scheduler.json is missing: the checkpoint is incomplete"),
    "optimizer cut short": (lambda c: cut(c / "accelerate" / "optimizer.bin"),
                            r"accelerate could not be loaded \(\w+: .*\): the checkpoint is damaged; move it away"),
    "weights cut short": (lambda c: cut(c / "accelerate" / "model.safetensors"),
                          r"accelerate could not be loaded \(\w+: .*\): the checkpoint is damaged; move it away"),
    "RNG cut short": (lambda c: cut(c / "accelerate" / "random_states_0.pkl"),
                      r"accelerate could not be loaded \(\w+: .*\): the checkpoint is damaged; move it away"),
    "settings cut short": (lambda c: cut(c / "model" / "muarl_config.json"),
                           r"muarl_config.json is unreadable \(JSONDecodeError: .*\): the run's saved settings are "
                           r"damaged"),
    "a setting of the wrong type": (lambda c: settings(c, lr="abc"), r"the settings saved in .*muarl_config.json: "
                                    r"its lr is 'abc', not a number \(saved by another version of muarl, or damaged\)$"),
    "a setting out of range": (lambda c: settings(c, group_size=-2), r"its group_size is -2, outside \[2, inf\)"),
    "a setting muarl lacks": (lambda c: settings(c, frobnicate=1), r"it holds 'frobnicate', which Config has no "
                              r"setting for"),
}


def settings(checkpoint, **changes):
    """The checkpoint's saved settings with `changes` written over them."""
    path = checkpoint / "model" / "muarl_config.json"
    saved = json.loads(path.read_text())
    saved["grpo"].update(changes)
    path.write_text(json.dumps(saved))


def cut(path):
    path.write_bytes(path.read_bytes()[:len(path.read_bytes()) // 2])


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_or_incomplete_checkpoint_stops_the_resume_in_one_line_and_is_never_taken_for_none(
        tmp_path, ckpt, damage):
    """A run's only checkpoint, damaged: --resume stops in one line naming the file, never a traceback, and never
    takes the run for one that saved nothing (which starts again from step 0, dropping what was trained)."""
    run = tmp_path / "run"
    grpo.main(grpo_args(ckpt, run, "--save-every", "2"))
    do, words = DAMAGE[damage]
    do(run / "checkpoints" / "step-000002")
    with pytest.raises(SystemExit, match=rf"^grpo.py: --resume: .*{words}"):
        grpo.main(["--resume", str(run), "--env", FAKE_ENV, "--steps", "3"])
    assert steps_logged(run) == [1, 2]  # nothing cut or started again


def test_a_saved_setting_out_of_range_is_named_and_a_resume_may_mend_one_it_may_change(tmp_path, ckpt):
    run = tmp_path / "run"
    grpo.main(grpo_args(ckpt, run, "--save-every", "2"))
    settings(run / "checkpoints" / "step-000002", save_every=0,  # outside [1, inf): saved by another version, say
             user_base_url="http://localhost:1/v1")  # ignored by the scripted user, as runs begun before it was refused
    with pytest.raises(SystemExit, match=r"^grpo.py: --resume: the settings saved in .*muarl_config.json: its "
                       r"save_every is 0, outside \[1, inf\) \(saved by another version of muarl, or damaged\)$"):
        grpo.main(["--resume", str(run), "--env", FAKE_ENV, "--steps", "3"])
    grpo.main(["--resume", str(run), "--env", FAKE_ENV, "--steps", "3", "--save-every", "1"])  # --save-every may change
    assert steps_logged(run) == [1, 2, 3]


def test_a_model_and_a_run_are_never_taken_for_each_other(tmp_path, ckpt, monkeypatch):
    """A model's directory given as a run's (--out-dir, even with --overwrite; --resume) is refused before anything
    is written, naming --init-from: a run's config.json would replace the model's. And a run's directory given to
    sft.py as --out with --overwrite keeps the run's config.json."""
    monkeypatch.setattr(models, "load_model", lambda *args, **kwargs: pytest.fail("a model was loaded"))
    model = tmp_path / "model"
    shutil.copytree(ckpt, model)
    config = (model / "config.json").read_text()
    for extra in ([], ["--overwrite"]):
        with pytest.raises(SystemExit, match=rf"^grpo.py: --out-dir: {re.escape(str(model))} holds a model, not a run "
                           rf".*: choose another --out-dir; to train from it, --init-from {re.escape(str(model))}$"):
            grpo.main(grpo_args(ckpt, model, *extra))
    with pytest.raises(SystemExit, match=rf"^grpo.py: --resume: {re.escape(str(model))} is a model, not a run of "
                       rf"grpo.py or one of its checkpoints: to train from it, --init-from {re.escape(str(model))}$"):
        grpo.main(["--resume", str(model)])
    assert (model / "config.json").read_text() == config and not (model / "run.lock").exists()
    run = tmp_path / "run"  # a run that stopped at its start: its settings only
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"steps": 2, "lr": 0.01}))
    with pytest.raises(SystemExit, match=r"^sft.py: --out: .*run holds files that are not a checkpoint's \(config.json "
                       r"\(a grpo.py run's settings\)\)"):
        sft.main(["--out", str(run), "--overwrite", "--num-tasks", "2"])
    assert json.loads((run / "config.json").read_text()) == {"steps": 2, "lr": 0.01}


@pytest.mark.parametrize("value", ["abc", "-1", "1.5"])
def test_muarl_threads_that_is_no_whole_number_is_refused_in_one_line(monkeypatch, value):
    monkeypatch.setenv("MUARL_THREADS", value)
    with pytest.raises(SystemExit, match=rf"^MUARL_THREADS='{re.escape(value)}': must be a whole number of threads"):
        cli.make_accelerator()


def test_an_accelerate_configuration_that_cannot_start_here_stops_in_one_line(monkeypatch):
    """As an FSDP configuration did under `accelerate launch --config_file` on a machine without a GPU."""
    import accelerate

    def refuse(*args, **kwargs):
        raise RuntimeError("There are currently no available devices found, must be one of 'XPU', 'CUDA', or 'NPU'.")

    monkeypatch.setattr(accelerate, "Accelerator", refuse)
    with pytest.raises(SystemExit, match=r"^Accelerate cannot start with this launch's configuration here \(There are "
                       r"currently no available devices found.*\): see `accelerate env`"):
        cli.make_accelerator()


def test_muarl_cache_set_but_empty_is_the_default_not_the_working_directory():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    said = subprocess.run([sys.executable, "-c", "from plumbing import models; print(models.CACHE_DIR)"], cwd=root,
                          env={**os.environ, "MUARL_CACHE": ""}, capture_output=True, text=True, check=True).stdout
    assert said.strip() == os.path.expanduser("~/.cache/muarl")


# What a full disk raises while a checkpoint is written, as each writer words it (the words measured by the next test)
DISK_FULL = {"os": (OSError, "[Errno 28] No space left on device"),
             "torch": (RuntimeError, "[enforce fail at inline_container.cc:672] . unexpected pos 5142976 vs 5142868"),
             "safetensors": (RuntimeError, "Error while serializing: I/O error: No space left on device (os error 28)")}


@pytest.mark.parametrize("writer", sorted(DISK_FULL))
def test_a_full_disk_while_saving_stops_in_one_line_and_leaves_a_run_that_resumes(tmp_path, ckpt, monkeypatch, writer):
    import errno

    from plumbing import checkpoints

    real = checkpoints._save
    kind, words = DISK_FULL[writer]

    def full(acc, run, step, final, tmp):
        if step == 2:
            (tmp / "accelerate").mkdir(parents=True)
            (tmp / "accelerate" / "optimizer.bin").write_bytes(b"\0" * 1000)  # half written when the disk filled
            raise OSError(errno.ENOSPC, "No space left on device") if kind is OSError else kind(words)
        return real(acc, run, step, final, tmp)

    monkeypatch.setattr(checkpoints, "_save", full)
    run = tmp_path / "run"
    with pytest.raises(SystemExit, match=rf"writing the checkpoint of step 2 .*{re.escape(words[-20:])} \(is the disk "
                       r"full or read-only\?\)\. The partial copy was removed; the newest checkpoint, step-000001, is "
                       r"untouched\. Make room, then: accelerate launch grpo.py --resume"):
        grpo.main(grpo_args(ckpt, run, "--steps", "3", "--save-every", "1"))
    assert not (run / "checkpoints" / "step-000002.tmp").exists()
    monkeypatch.undo()
    grpo.main(["--resume", str(run), "--env", FAKE_ENV])
    assert steps_logged(run) == [1, 2, 3]


def test_a_checkpoint_the_disk_has_no_room_for_is_refused_before_its_first_byte(tmp_path, ckpt, monkeypatch):
    """Less room on the disk than the newest checkpoint took: the next save stops at once, in one line naming the room
    and the need, having written nothing (under DeepSpeed, whose save has collectives after its writes, a refusal
    mid-save would leave the other processes waiting); the run resumes. The first save's need, from the trained
    weights, is a lower bound of what it took."""
    from plumbing import checkpoints, disk

    needs, real = [], checkpoints.room_needed

    def spy(run, final):
        needs.append(real(run, final))
        return needs[-1]

    monkeypatch.setattr(checkpoints, "room_needed", spy)
    monkeypatch.setattr(disk, "free_bytes", lambda path: needs[-1][0] // 2 if len(needs) == 2 else 1 << 50)
    run = tmp_path / "run"
    with pytest.raises(SystemExit, match=r"writing the checkpoint of step 2 into .*checkpoints failed: .* free on the "
                       r"disk of .*checkpoints, and it needs at least .* \(what step-000001 took\) \(is the disk full "
                       r"or read-only\?\)\. Nothing was written; the newest checkpoint, step-000001, is untouched\. "
                       r"Make room, then: accelerate launch grpo.py --resume"):
        grpo.main(grpo_args(ckpt, run, "--steps", "3", "--save-every", "1"))
    first = disk.tree_bytes(run / "checkpoints" / "step-000001")
    assert "trained weights and their optimizer state" in needs[0][1] and 0 < needs[0][0] <= first
    assert needs[1][0] == first
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest.json", "step-000001"]
    monkeypatch.undo()
    grpo.main(["--resume", str(run), "--env", FAKE_ENV])
    assert steps_logged(run) == [1, 2, 3]


def test_a_disk_short_of_room_first_loses_the_checkpoints_keep_checkpoints_would_prune_never_the_newest(
        tmp_path, ckpt, monkeypatch, capsys):
    """--keep-checkpoints 2 and room for two: the third save removes step 1 (which it prunes once written) before it
    writes, says so, and goes on; --keep-checkpoints 1 never removes the only one before the new one is written."""
    from plumbing import checkpoints, disk

    run, room_for = tmp_path / "run", [2]

    def free(path):  # room for room_for[0] checkpoints
        held = checkpoints.complete(run / "checkpoints")
        return 1 << 50 if len(held) < room_for[0] else disk.tree_bytes(held[-1]) // 2

    monkeypatch.setattr(disk, "free_bytes", free)
    grpo.main(grpo_args(ckpt, run, "--steps", "3", "--save-every", "1", "--keep-checkpoints", "2"))
    assert "too little room for the checkpoint of step 3: removed step-000001 first, which --keep-checkpoints 2 " \
           "removes once it is written" in capsys.readouterr().out
    assert [p.name for p in checkpoints.complete(run / "checkpoints")] == ["step-000002", "step-000003"]
    run, room_for[0] = tmp_path / "one", 1
    with pytest.raises(SystemExit, match=r"checkpoint of step 2 .* needs at least .* Nothing was written; the newest "
                       r"checkpoint, step-000001, is untouched"):
        grpo.main(grpo_args(ckpt, run, "--steps", "3", "--save-every", "1", "--keep-checkpoints", "1"))
    assert [p.name for p in checkpoints.complete(run / "checkpoints")] == ["step-000001"]
    monkeypatch.undo()  # a resume from step 1 of a run that holds steps 2 and 3, which it abandons
    run = tmp_path / "three"
    grpo.main(grpo_args(ckpt, run, "--steps", "3", "--save-every", "1"))
    monkeypatch.setattr(disk, "free_bytes", lambda path: 1000)
    with pytest.raises(SystemExit, match=r"checkpoint of step 2 .* Nothing was written"):
        grpo.main(["--resume", str(run / "checkpoints" / "step-000001"), "--env", FAKE_ENV, "--keep-checkpoints", "2"])
    assert (run / "checkpoints" / "step-000001" / "trainer_state.json").exists()  # never made room of


def test_work_whose_result_cannot_fit_is_refused_before_it_starts(tmp_path, ckpt, monkeypatch):
    """A new GRPO run whose first checkpoint, or an SFT whose checkpoint, cannot fit on its disk stops at start in one
    line naming the room and the need, before any evaluation, step or training; the run directory is left without a
    run in it, --out is never made. --overwrite counts the old run's checkpoints as room (they go first)."""
    from plumbing import disk

    monkeypatch.setattr(disk, "free_bytes", lambda path: 1000)
    run = tmp_path / "run"
    with pytest.raises(SystemExit, match=r"^grpo.py: --out-dir .*run: 1000 bytes free on the disk of .*run, and it needs "
                       r"at least .* \(its first checkpoint: [\d,]+ trained weights and their optimizer state\)\. "
                       r"Nothing was done: make room, or choose another --out-dir$"):
        grpo.main(grpo_args(ckpt, run, "--steps", "1"))
    assert not (run / "config.json").exists() and not (run / "metrics.jsonl").exists()
    monkeypatch.undo()
    grpo.main(grpo_args(ckpt, run, "--steps", "1", "--overwrite"))
    held = disk.tree_bytes(run / "checkpoints")  # a disk with 1000 bytes free beside the old run's checkpoints
    monkeypatch.setattr(disk, "free_bytes", lambda path: 1000 + held - disk.tree_bytes(run / "checkpoints"))
    grpo.main(grpo_args(ckpt, run, "--steps", "1", "--overwrite"))  # its old checkpoint makes the room
    assert disk.tree_bytes(run / "checkpoints") == held and held > 1000
    data = tmp_path / "c.jsonl"
    data.write_text(conv(U, A) + "\n")
    out = tmp_path / "sft"
    with pytest.raises(SystemExit, match=r"^sft.py: --out .*sft: 1000 bytes free on the disk of .*, and it needs at least "
                       r".* \([\d,]+ trained weights at 4 bytes each\)\. Nothing was trained: make room, or choose "
                       r"another --out$"):
        sft.main(["--data", str(data), "--model", str(ckpt), "--out", str(out), "--epochs", "1", "--batch-size", "1",
                  "--micro-batch-size", "1"])
    assert not out.exists()


def test_a_full_disk_at_latest_after_the_rename_says_the_checkpoint_is_whole_and_resumes_from_it(tmp_path, ckpt,
                                                                                                 monkeypatch):
    """The disk fills at latest.json, after step 2's checkpoint was renamed into place whole: the line says so (not
    "the partial copy was removed"), and the --resume it gives continues from step 2, not from the step latest.json
    still names."""
    import errno

    real = disk.write_json_atomic

    def full(path, obj):
        if os.path.basename(path) == "latest.json" and obj == {"checkpoint": "step-000002"}:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, obj)

    monkeypatch.setattr(disk, "write_json_atomic", full)
    run = tmp_path / "run"
    with pytest.raises(SystemExit, match=rf"^grpo.py: writing {re.escape(str(run))}/checkpoints/latest.json after "
                       r"step-000002 failed: \[Errno 28\] No space left on device \(is the disk full or read-only\?\)\. "
                       r"step-000002 was saved whole, but latest.json names the checkpoint before it; the newest "
                       rf"checkpoint, step-000002, is untouched\. Make room, then: accelerate launch grpo.py --resume "
                       rf"{re.escape(str(run))}/checkpoints/step-000002$"):
        grpo.main(grpo_args(ckpt, run, "--steps", "3", "--save-every", "1"))
    monkeypatch.undo()
    grpo.main(["--resume", str(run / "checkpoints" / "step-000002"), "--env", FAKE_ENV])
    assert steps_logged(run) == [1, 2, 3]


class HalfWritten:
    """A file whose disk fills at the first line starting with `at`: half of that line is written, then ENOSPC."""

    def __init__(self, f, at: str):
        self.f, self.at = f, at

    def write(self, s):
        if s.startswith(self.at):
            self.f.write(s[:len(s) // 2])
            self.f.flush()
            raise OSError(errno.ENOSPC, "No space left on device")
        return self.f.write(s)

    def writelines(self, lines):
        for line in lines:
            self.write(line)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


def fills_at(module, monkeypatch, name: str, at: str) -> None:
    """`module`'s open() gives the file called `name` a disk that fills at its first line starting with `at`."""
    import builtins

    def opener(path, mode="r", **kw):
        f = builtins.open(path, mode, **kw)
        return HalfWritten(f, at) if os.path.basename(path) == name else f

    monkeypatch.setattr(module, "open", opener, raising=False)


@pytest.mark.parametrize("log", ["metrics.jsonl", "episodes.jsonl"])
def test_a_full_disk_while_logging_a_step_cuts_the_log_back_and_stops_in_one_line(tmp_path, ckpt, monkeypatch, log):
    """The disk fills while step 2's line is written, half of it on disk: the log is cut back to step 1's lines, the
    run stops in one line naming the log and the newest checkpoint, and a --resume logs every step once."""
    from plumbing import rundir

    fills_at(rundir, monkeypatch, log, '{"step": 2,')
    run = tmp_path / "run"
    with pytest.raises(SystemExit, match=rf"grpo.py: writing step 2's \w+ to .*run/{log} failed: \[Errno 28\] No space "
                       r"left on device \(is the disk full or read-only\?\)\. The log was cut back to where it was; "
                       r"the newest checkpoint, step-000001, is untouched\. Make room, then: accelerate launch grpo.py "
                       r"--resume"):
        grpo.main(grpo_args(ckpt, run, "--steps", "3", "--save-every", "1", "--log-episodes", "2"))
    assert sorted(set(steps_logged(run, log))) == [1]  # every line whole: steps_logged parses each
    monkeypatch.undo()
    grpo.main(["--resume", str(run), "--env", FAKE_ENV])
    assert sorted(set(steps_logged(run, log))) == [1, 2, 3] and not (run / f"{log}.cut").exists()


def test_a_refused_log_line_after_a_stop_signal_in_the_evaluation_saves_no_checkpoint_and_says_the_disk(
        tmp_path, ckpt, monkeypatch):
    """A stop signal leaves step 2's evaluation, then the disk refuses step 2's metrics: the run stops on the disk's
    line. No checkpoint is saved: step 2's update is in the weights while its logs are not, and a checkpoint of
    step 1 holding them would train step 2 twice on --resume."""
    from plumbing import pipeline, rundir, stopping

    real = pipeline.evaluate

    def stopped_at_step_2(run, tag):
        if tag == "step2":
            raise stopping.Abandoned("SIGINT")
        return real(run, tag)

    monkeypatch.setattr(pipeline, "evaluate", stopped_at_step_2)
    fills_at(rundir, monkeypatch, "metrics.jsonl", '{"step": 2,')
    run = tmp_path / "run"
    with pytest.raises(SystemExit, match=r"grpo.py: writing step 2's metrics .* No space left on device .* no "
                       r"checkpoint was saved before it\. Make room, then: accelerate launch grpo.py --resume"):
        grpo.main(grpo_args(ckpt, run, "--steps", "3", "--save-every", "5", "--eval-tasks", "1", "--eval-every", "1"))
    assert steps_logged(run) == [1] and not list((run / "checkpoints").glob("step-*"))


def test_the_disk_line_of_a_weights_only_run_names_a_new_run_from_its_weights(tmp_path):
    """--save-weights-only checkpoints cannot be resumed: the line says how to go on from them instead."""
    import errno

    (tmp_path / "checkpoints" / "step-000004" / "model").mkdir(parents=True)
    line = str(disk.refused(tmp_path, "writing x", OSError(errno.ENOSPC, "No space left on device"), "Undone").code)
    assert line.endswith(f"the newest checkpoint, step-000004, is untouched. Make room, then: train on from its "
                         f"weights in a new run: --init-from {tmp_path}/checkpoints/step-000004/model"), line
    (tmp_path / "checkpoints" / "step-000004" / "accelerate").mkdir()
    line = str(disk.refused(tmp_path, "writing x", OSError(errno.ENOSPC, "No space left on device"), "Undone").code)
    assert line.endswith(f"Make room, then: accelerate launch grpo.py --resume {tmp_path}"), line


def test_a_full_disk_at_the_summary_stops_in_one_line_and_a_resume_writes_it(tmp_path, ckpt, monkeypatch):
    """The last step is saved, then the disk fills while summary.json is written (half of it reaches its temporary
    copy): the copy is removed, the run stops in one line, and a --resume evaluates again and writes the summary."""
    import errno
    from pathlib import Path

    real = Path.write_text

    def full(self, text, *a, **kw):
        if self.name == "summary.json.tmp":
            real(self, text[:len(text) // 2], *a, **kw)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, text, *a, **kw)

    monkeypatch.setattr(Path, "write_text", full)
    run = tmp_path / "run"
    with pytest.raises(SystemExit, match=r"grpo.py: writing summary.json failed: \[Errno 28\] No space left on device "
                       r"\(is the disk full or read-only\?\)\. Every step was saved \(--resume evaluates\); "
                       r"the newest checkpoint, step-000002, is untouched\. Make room, then: accelerate launch grpo.py "
                       r"--resume"):
        grpo.main(grpo_args(ckpt, run))
    assert not (run / "summary.json.tmp").exists() and not (run / "summary.json").exists()
    monkeypatch.undo()
    grpo.main(["--resume", str(run), "--env", FAKE_ENV])
    assert json.loads((run / "summary.json").read_text())["steps"] == 2 and steps_logged(run) == [1, 2]


def test_a_full_disk_while_a_model_is_written_removes_the_partial_copy_and_stops_every_writer_in_one_line(
        tmp_path, ckpt, monkeypatch):
    """The weights are written, then the disk fills (at muarl_config.json): sft.py stops in one line with no partial
    copy left and no --out made; grpo.py's checkpoint through the same writer says which checkpoint is untouched."""
    import errno

    real, stop_at = disk.write_json_atomic, {"sft"}

    def full(path, obj):
        if path.name == "muarl_config.json" and any(part in str(path) for part in stop_at):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, obj)

    monkeypatch.setattr(disk, "write_json_atomic", full)
    data = tmp_path / "data.jsonl"
    data.write_text(conv(U, A) + "\n")
    out = tmp_path / "sft"
    with pytest.raises(disk.Refused, match=rf"^writing {re.escape(str(out))} failed: \[Errno 28\] No space left "
                       r"on device \(is the disk full or read-only\?\)\. The partial copy was removed; make room, "
                       r"then run the same command again$"):
        sft.main(["--model", str(ckpt), "--data", str(data), "--out", str(out), "--batch-size", "1"])
    assert not out.exists() and not (tmp_path / "sft.tmp").exists()
    kept = tmp_path / "kept.jsonl"  # the data was written before the model: the line says to train from it
    with pytest.raises(disk.Refused, match=rf"make room, then train from the data written: --data "
                       rf"{re.escape(str(kept))}$"):
        sft.main(["--model", str(ckpt), "--data", str(data), "--data-out", str(kept), "--out", str(out),
                  "--batch-size", "1"])
    assert kept.exists() and not out.exists()
    stop_at = {"step-000002"}
    with pytest.raises(SystemExit, match=r"^grpo.py: writing the checkpoint of step 2 into .* failed: \[Errno 28\] No "
                       r"space left on device \(is the disk full or read-only\?\)\. The partial copy was removed; the "
                       r"newest checkpoint, step-000001, is untouched\. Make room, then: accelerate launch grpo.py "):
        grpo.main(grpo_args(ckpt, tmp_path / "run", "--save-every", "1"))
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["latest.json", "step-000001"]


def test_a_full_disk_at_the_curves_leaves_no_half_picture_and_says_how_to_draw_it(tmp_path, ckpt, monkeypatch):
    from matplotlib.figure import Figure

    def full(self, path, **kw):
        with open(path, "wb") as f:
            f.write(b"\x89PNG\r\n")  # a picture cut short
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Figure, "savefig", full)
    run = tmp_path / "run"
    with pytest.raises(SystemExit, match=r"grpo.py: drawing curves.png failed: \[Errno 28\] No space left on device \(is "
                       r"the disk full or read-only\?\)\. summary.json holds the results; the newest checkpoint, "
                       rf"step-000002, is untouched\. Make room, then: python eval.py --plot {re.escape(str(run))}$"):
        grpo.main(grpo_args(ckpt, run))
    assert (run / "summary.json").exists() and not list(run.glob("curves.png*"))
    monkeypatch.undo()
    evaluation.main(["--plot", str(run)])
    assert (run / "curves.png").read_bytes()[:4] == b"\x89PNG"


def _du(path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def test_a_real_full_disk_stops_the_save_in_one_line_and_the_resume_frees_what_a_cut_short_save_left(tmp_path, ckpt,
                                                                                                     monkeypatch):
    """On a real small filesystem (a tmpfs, where this process may mount one, as root can): the second checkpoint
    does not fit. With the room check blind (as on a filesystem that does not say its free space), the run stops
    mid-save in one line and removes its partial copy; a --resume on the disk still full first removes a cut-short
    save (as a kill -9 mid-save leaves), then the room check stops it before the save's first byte, in one line; with
    room made, it finishes."""
    from plumbing import disk as disks

    if os.geteuid() != 0:
        pytest.skip("mounting a small filesystem needs root")
    sizing = tmp_path / "sizing"
    grpo.main(grpo_args(ckpt, sizing, "--steps", "1", "--save-every", "1"))
    one = _du(sizing / "checkpoints" / "step-000001")
    disk = tmp_path / "disk"
    disk.mkdir()
    size = (_du(sizing) + one // 2) // 4096 * 4096  # room for the run and its first checkpoint, half the second's
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(disk)]).returncode:
        pytest.skip("no tmpfs could be mounted here")
    try:
        run = disk / "run"
        monkeypatch.setattr(disks, "free_bytes", lambda path: None)
        with pytest.raises(SystemExit, match=r"writing the checkpoint of step 2 .* \(is the disk full or read-only\?\)\. "
                           r"The partial copy was removed; the newest checkpoint, step-000001, is untouched"):
            grpo.main(grpo_args(ckpt, run, "--steps", "3", "--save-every", "1"))
        monkeypatch.undo()
        assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest.json", "step-000001"]
        cut_short = run / "checkpoints" / "step-000002.tmp"  # what a kill -9 mid-save leaves
        shutil.copytree(run / "checkpoints" / "step-000001" / "model", cut_short / "model")
        fill = disk / "fill"
        with open(fill, "wb") as f:  # the rest of the disk
            try:
                while True:
                    f.write(b"\0" * 65536)
                    f.flush()
            except OSError:
                pass
        with pytest.raises(SystemExit, match=r"writing the checkpoint of step 2 .* free on the disk of .*, and it needs "
                           r"at least .* \(what step-000001 took\) .*Nothing was written; the newest checkpoint, "
                           r"step-000001, is untouched"):
            grpo.main(["--resume", str(run), "--env", FAKE_ENV])
        assert not cut_short.exists() and steps_logged(run) == [1, 2]  # the log is cut back on the next resume
        fill.unlink()
        subprocess.run(["mount", "-o", f"remount,size={size + 3 * one}", str(disk)], check=True)  # room made
        grpo.main(["--resume", str(run), "--env", FAKE_ENV])
        assert steps_logged(run) == [1, 2, 3]
    finally:
        subprocess.run(["umount", "-l", str(disk)])


def test_a_disk_that_fills_at_any_write_stops_the_run_in_one_line_and_its_command_then_finishes_it(tmp_path, ckpt,
                                                                                                    monkeypatch):
    """On real small filesystems (tmpfs, as root can mount), from one page to most of what a run writes, so that the
    disk fills at each of its writes in turn (config.json, the evaluations' episodes, a step's logs, a checkpoint):
    every run stops in one line, and the command that line names finishes it once room is made, each step logged
    once. The room checks are blind for the sweep (as on a filesystem that does not say its free space, or one that
    others fill while the run goes): with them, a disk without room for the first checkpoint stops the run at start,
    and the same command finishes it once room is made."""
    from plumbing import disk as disks

    if os.geteuid() != 0:
        pytest.skip("mounting a small filesystem needs root")
    args = ("--steps", "2", "--save-every", "1", "--eval-tasks", "1", "--eval-every", "1")
    grpo.main(grpo_args(ckpt, tmp_path / "sizing", *args))
    total, stopped_at = _du(tmp_path / "sizing"), []
    disk = tmp_path / "checked"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4096", "tmpfs", str(disk)]).returncode:
        pytest.skip("no tmpfs could be mounted here")
    try:
        with pytest.raises(SystemExit, match=r"^grpo.py: --out-dir .*: .* free on the disk of .*, and it needs at least "
                           r".*\. Nothing was done: make room, or choose another --out-dir$"):
            grpo.main(grpo_args(ckpt, disk / "run", *args))
        subprocess.run(["mount", "-o", f"remount,size={3 * total}", str(disk)], check=True)  # room made
        grpo.main(grpo_args(ckpt, disk / "run", *args))
        assert steps_logged(disk / "run") == [1, 2]
    finally:
        subprocess.run(["umount", "-l", str(disk)])
    monkeypatch.setattr(disks, "free_bytes", lambda path: None)
    for size in sorted({4096 * 2 ** k for k in range(6)} | {total * 9 // 10 // 4096 * 4096}):  # 4 KiB..128 KiB, 90%
        disk = tmp_path / f"disk{size}"
        disk.mkdir()
        if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(disk)]).returncode:
            pytest.skip("no tmpfs could be mounted here")
        try:
            run = disk / "run"
            with pytest.raises(SystemExit) as stop:
                grpo.main(grpo_args(ckpt, run, *args))
            line = str(stop.value.code)
            assert re.fullmatch(r"grpo.py: writing (.+) failed: .* \(is the disk full or read-only\?\)\. .*; "
                                r"(the newest checkpoint, step-\d+, is untouched|no checkpoint was saved before it)\. "
                                r"Make room, then: (accelerate launch grpo.py --resume .*|run the same command again)",
                                line), line
            stopped_at.append(line.split(" failed")[0].removeprefix("grpo.py: writing "))
            subprocess.run(["mount", "-o", f"remount,size={3 * total}", str(disk)], check=True)  # room made
            grpo.main(["--resume", str(run), "--env", FAKE_ENV] if "--resume" in line else grpo_args(ckpt, run, *args))
            assert steps_logged(run) == [1, 2] and json.loads((run / "summary.json").read_text())["steps"] == 2, line
            assert not list(run.rglob("*.tmp")), line
        finally:
            subprocess.run(["umount", "-l", str(disk)])
    kinds = {k for k in ("config.json", "evaluation", "step 1's", "checkpoint") if any(k in w for w in stopped_at)}
    assert len(kinds) == 4, stopped_at  # each kind of write met a full disk at some size


def test_the_writers_own_words_for_a_refused_write_are_recognised(tmp_path):
    """torch's zip writer and safetensors word a short write in their own ways, not as an OSError: each is made to
    fail for real (a file-size limit in a child process, what a full disk does to a write) and must read as a disk
    that refused the bytes."""
    code = ("import resource, signal, sys, torch; from safetensors.torch import save_file; "
            "from plumbing import disk; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
            "resource.setrlimit(resource.RLIMIT_FSIZE, (100000, 100000))\n"
            "for name, write in (('torch', lambda p: torch.save({'w': torch.zeros(100000)}, p)), "
            "('safetensors', lambda p: save_file({'w': torch.zeros(100000)}, p))):\n"
            "    try:\n        write(sys.argv[1] + '/' + name)\n        print(name, 'wrote')\n"
            "    except Exception as e:\n        print(name, disk.out_of_room(e), type(e).__name__, str(e)[:120])\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=root, capture_output=True, text=True,
                         timeout=120)
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines())
    assert set(lines) == {"torch", "safetensors"}, out.stdout + out.stderr
    assert all(v.startswith("True ") for v in lines.values()), lines


def test_a_resume_on_a_full_disk_frees_the_cut_short_save_first_and_else_stops_in_one_line(tmp_path, ckpt,
                                                                                          monkeypatch):
    import errno

    from plumbing import rundir

    run = tmp_path / "run"
    grpo.main(grpo_args(ckpt, run, "--steps", "2", "--save-every", "1"))
    (run / "checkpoints" / "step-000003.tmp" / "accelerate").mkdir(parents=True)  # a save that never finished
    (run / "checkpoints" / "step-000003.tmp" / "accelerate" / "optimizer.bin").write_bytes(b"\0" * 1000)
    logs = {n: (run / n).read_bytes() for n in rundir.LOGS}
    real = rundir.cut_log

    def full(path, last_step):
        assert not (run / "checkpoints" / "step-000003.tmp").exists(), "the cut-short save must go before the logs"
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(rundir, "cut_log", full)
    with pytest.raises(SystemExit, match=r"--resume: cannot rewrite the logs of .*run: No space left on device \(is "
                       r"the disk full or read-only\?\)\. The logs and checkpoints are as they were\. Make room"):
        grpo.main(["--resume", str(run), "--env", FAKE_ENV, "--steps", "3"])
    assert {n: (run / n).read_bytes() for n in rundir.LOGS} == logs
    monkeypatch.setattr(rundir, "cut_log", real)
    grpo.main(["--resume", str(run), "--env", FAKE_ENV, "--steps", "3"])
    assert steps_logged(run) == [1, 2, 3]


def test_cutting_a_log_on_a_full_disk_changes_nothing_and_leaves_nothing(tmp_path):
    """The log is rewritten beside itself; a write refused half way (a file-size limit in a child process) leaves the
    log, its .cut and the directory as they were, so that the next try cuts the same lines once."""
    log = tmp_path / "episodes.jsonl"
    log.write_text("".join(json.dumps({"step": s, "text": "x" * 2000}) + "\n" for s in range(1, 101)))
    (tmp_path / "episodes.jsonl.cut").write_text('{"step": 7}\n')
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    code = ("import resource, signal, sys; from pathlib import Path; from plumbing import disk, rundir; "
            "signal.signal(signal.SIGXFSZ, signal.SIG_IGN); resource.setrlimit(resource.RLIMIT_FSIZE, (50000, 50000))"
            "\ntry:\n    rundir.cut_log(Path(sys.argv[1]), 60)\nexcept OSError as e:\n"
            "    print('refused', disk.out_of_room(e))\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code, str(log)], cwd=root, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "refused True", out.stdout + out.stderr
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    from plumbing import rundir

    assert rundir.cut_log(log, 60) == 40
    assert [json.loads(line)["step"] for line in (tmp_path / "episodes.jsonl.cut").open()] == [7] + list(range(61, 101))


def test_a_reward_that_is_not_a_number_is_the_evaluators_failure():
    """A plug-in's reward that is a string or None killed the run mid-step with a TypeError traceback (a user-style
    probe): it is the evaluator's failure, the episode's infra_error, named; numpy's numbers are numbers."""
    import numpy as np

    from envs import Termination, score

    class Session:
        def __init__(self, reward):
            self.value = reward

        def reward(self, messages):
            return self.value, {}

    for bad in ("1", None, [1.0]):
        reward, info, end = score(Session(bad), [], Termination.USER_STOP)
        assert (reward, end) == (0.0, Termination.INFRA_ERROR) and "not a number" in info["error"], bad
    assert score(Session(np.float32(1.0)), [], Termination.USER_STOP)[:3:2] == (1.0, Termination.USER_STOP)


def test_a_split_without_tasks_or_with_one_id_for_two_tasks_is_refused_in_one_line(tmp_path, ckpt):
    """A plug-in split with no tasks gave an IndexError (grpo.py) or "none of the 0 episodes was scored" (eval.py); two
    tasks of one id were silently one task with twice the trials in eval.py's pass^k (a user-style probe)."""
    from envs import load_tasks
    from tests.fake_env import FakeEnv

    class Empty(FakeEnv):
        def tasks(self, split):
            return []

    class Twice(FakeEnv):
        def tasks(self, split):
            return super().tasks(split)[:1] * 3

    class Slips(FakeEnv):
        def tasks(self, split):
            return [float("x")]  # the plug-in's own ValueError: named where it raised, not only as --split's

    def tools(given):  # a plug-in whose tools() gives what the template cannot render as function schemas
        return type("Tools", (FakeEnv,), {"tools": lambda self, task: given})

    import tests.fake_env as fake

    echo = {"type": "function", "function": {"name": "echo"}}
    for name, cls, said in (("Empty", Empty, r"--split test: tests.fake_env:Empty has no tasks in split 'test'$"),
                            ("Twice", Twice, r"--split test: tests.fake_env:Twice gives 1 task id\(s\) to more than "
                                             r"one task \(test-0\): each task"),
                            ("NoFunction", tools([{"type": "function", "name": "echo"}]),
                             r"--env tests.fake_env:NoFunction: the tools of task test-0: tool 0 is not a function "),
                            ("Twice2", tools([echo, echo]), r"--env .*Twice2: the tools of task test-0: tool 'echo' is listed 2 times"),
                            ("NotJson", tools([{**echo, "x": type}]), r"--env .*NotJson: the tools of task test-0: not JSON"),
                            ("Dict", tools({"echo": echo}), r"--env .*Dict: the tools of task test-0: a dict, not a list"),
                            ("Slips", Slips, r"--split test: could not convert string to float: 'x' \(raised at "
                                             r".*test_failures.py:\d+\)$")):
        setattr(fake, name, cls)
        try:
            with pytest.raises(SystemExit, match=rf"^eval.py: {said}"):
                load_tasks(f"tests.fake_env:{name}", "test", "eval.py")
        finally:
            delattr(fake, name)
