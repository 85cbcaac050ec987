"""What changes with several processes or a GPU, checked on this CPU with what a GPU or a launcher would give faked:
the user endpoint's concurrency shared by the processes, the CUDA allocator's default, the two activation
checkpointings refused together, and sft.py's memory estimate at start (docs/gpus.md)."""
import os
import re
from types import SimpleNamespace

import pytest
import torch

import cli
import eval as evaluation
import grpo
import sft
from batched_rollout import make_user_sim, user_concurrency_share, user_sim_options
from fake_env import choice_conversation
from options import check_activation_checkpointing


# ---- --user-concurrency is the total over all processes ----
def test_user_concurrency_is_shared_by_the_processes(monkeypatch, capsys):
    cfg = grpo.Config(user_sim="openai", user_base_url="http://127.0.0.1:9/v1", user_concurrency=10)
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert user_sim_options(cfg)["max_concurrency"] == 3  # ceil(10 / 4)
    assert "--user-concurrency 10 over 4 processes: 3 requests in flight per process" in capsys.readouterr().out
    assert make_user_sim("openai", **user_sim_options(cfg)).sim.max_concurrency == 3
    capsys.readouterr()
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert user_sim_options(cfg)["max_concurrency"] == 10
    assert "--user-concurrency" not in capsys.readouterr().out  # one process: nothing to say
    monkeypatch.delenv("WORLD_SIZE")  # a plain `python grpo.py`
    assert user_sim_options(cfg)["max_concurrency"] == 10
    assert user_sim_options(cfg, processes=4)["max_concurrency"] == 3
    assert user_concurrency_share(1, 8) == 1 and user_concurrency_share(64, 8) == 8
    monkeypatch.setenv("WORLD_SIZE", "4")  # sft.py's teacher and eval.py's user read the same option the same way
    for config in (sft.SFTConfig(user_sim="openai", user_concurrency=10),
                   evaluation.EvalConfig(user_sim="openai", user_concurrency=10)):
        assert user_sim_options(config)["max_concurrency"] == 3


# ---- expandable segments unless the user set the allocator ----
ALLOCATOR = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF")


@pytest.fixture
def cuda_build(monkeypatch):
    """A CUDA build of torch whose CUDA is not started yet, with no allocator setting (restored after the test)."""
    for name in ALLOCATOR:
        monkeypatch.setenv(name, "")  # recorded, so that whatever the test sets is undone
        monkeypatch.delenv(name)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)


def test_cuda_allocator_gets_expandable_segments_unless_the_user_set_it(cuda_build, monkeypatch):
    assert cli.cuda_allocator_defaults() == "expandable_segments:True"
    assert os.environ["PYTORCH_ALLOC_CONF"] == os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    for name in ALLOCATOR:  # a user's setting, under any of the names torch reads, is left exactly as it is
        for other in ALLOCATOR:
            monkeypatch.delenv(other, raising=False)
        monkeypatch.setenv(name, "max_split_size_mb:128")
        assert cli.cuda_allocator_defaults() is None
        assert {n: os.environ.get(n) for n in ALLOCATOR} == {n: "max_split_size_mb:128" if n == name else None
                                                              for n in ALLOCATOR}
    for name in ALLOCATOR:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)  # too late: the allocator has read it
    assert cli.cuda_allocator_defaults() is None and "PYTORCH_ALLOC_CONF" not in os.environ
    monkeypatch.setattr(torch.version, "cuda", None)  # a CPU build
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert cli.cuda_allocator_defaults() is None and "PYTORCH_ALLOC_CONF" not in os.environ


@pytest.mark.parametrize("main", [grpo.main, sft.main, evaluation.main])
def test_every_entry_point_sets_the_allocator_first(main, monkeypatch):
    class Called(Exception):
        pass

    def first(*args):
        raise Called

    monkeypatch.setattr(cli, "cuda_allocator_defaults", first)
    with pytest.raises(Called):  # before the options are even parsed, so before anything can start CUDA
        main(["--no-such-option"])


# ---- FSDP's activation checkpointing and --gradient-checkpointing: one of them ----
def fake_accelerator(fsdp=None, device="cpu"):
    return SimpleNamespace(distributed_type="FSDP" if fsdp else "NO", num_processes=1, process_index=0,
                           device=torch.device(device), state=SimpleNamespace(fsdp_plugin=fsdp, deepspeed_plugin=None))


def test_two_activation_checkpointings_are_refused_at_start(tmp_path, ckpt, monkeypatch):
    both = fake_accelerator(SimpleNamespace(fsdp_version=2, activation_checkpointing=True))
    for program in ("grpo.py", "sft.py"):
        with pytest.raises(SystemExit) as e:
            check_activation_checkpointing(both, True, program)
        message = str(e.value)
        assert message.startswith(f"{program}: --gradient-checkpointing with FSDP's activation checkpointing")
        assert "fsdp_activation_checkpointing" in message and "\n" not in message
    check_activation_checkpointing(both, False, "grpo.py")  # FSDP's alone
    check_activation_checkpointing(fake_accelerator(SimpleNamespace(fsdp_version=2, activation_checkpointing=False)),
                                   True, "grpo.py")  # muarl's alone
    check_activation_checkpointing(fake_accelerator(), True, "sft.py")  # no FSDP: no plugin
    with pytest.raises(SystemExit, match="sft.py: --gradient-checkpointing with FSDP"):
        sft.check_backend(both, gradient_checkpointing=True)
    sft.check_backend(both)
    with pytest.raises(SystemExit, match="sft.py: --gradient-checkpointing with FSDP"):  # sft.train checks it
        sft.train(sft.SFTConfig(model=str(ckpt), out=str(tmp_path / "sft"), gradient_checkpointing=True),
                  [choice_conversation("left")] * 2, accelerator=both)
    monkeypatch.setattr(cli, "make_accelerator", lambda *a, **k: both)  # grpo.py checks it in pipeline.set_up
    args = ["--init-from", str(ckpt), "--env", "tests.fake_env:FakeEnv", "--out-dir", str(tmp_path / "run")]
    with pytest.raises(SystemExit, match="grpo.py: --gradient-checkpointing with FSDP"):
        grpo.main([*args, "--gradient-checkpointing"])
