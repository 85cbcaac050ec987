"""What changes with several processes or a GPU, checked on this CPU with what a GPU or a launcher would give faked:
the user endpoint's concurrency shared by the processes, the CUDA allocator's default, the two activation
checkpointings refused together, and sft.py's memory estimate at start (docs/gpus.md)."""
import os
import re
from types import SimpleNamespace

import pytest
import torch

import eval as evaluation
import grpo
import sft
from batched_rollout import make_user_sim, user_concurrency_share, user_sim_options


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
