"""What changes with several processes or a GPU, checked on this CPU with what a GPU or a launcher would give faked:
the user endpoint's concurrency shared by the processes, the CUDA allocator's default, the two activation
checkpointings refused together, and sft.py's memory estimate at start (docs/gpus.md)."""
import os
import re
from types import SimpleNamespace

import pytest
import torch

from plumbing import cli, memory
import eval as evaluation
import grpo
import sft
from plumbing.users import make_user_sim, user_concurrency_share, user_sim_options
from fake_env import choice_conversation
from plumbing.options import check_activation_checkpointing


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
    monkeypatch.setattr(cli, "make_accelerator", lambda *a, **k: both)  # grpo.py checks it in pipeline.start
    args = ["--init-from", str(ckpt), "--env", "tests.fake_env:FakeEnv", "--out-dir", str(tmp_path / "run")]
    with pytest.raises(SystemExit, match="grpo.py: --gradient-checkpointing with FSDP"):
        grpo.main([*args, "--gradient-checkpointing"])


# ---- sft.py's memory estimate at start ----
def estimate(out: str) -> dict:
    """The estimate line's figures, in MiB."""
    line = next(x for x in out.splitlines() if x.startswith("[sft] estimated memory per GPU"))
    return {k: float(v) * (1024 if unit == "GiB" else 1) for k, v, unit in
            re.findall(r"(\w+) ([\d.]+) (MiB|GiB)", line)}


def test_sft_prints_its_memory_estimate_with_no_rollout(tmp_path, ckpt, capsys):
    data = [choice_conversation("left")] * 2
    sft.train(sft.SFTConfig(model=str(ckpt), out=str(tmp_path / "sft"), batch_size=2, micro_batch_size=2), data)
    out = capsys.readouterr().out
    assert "[sft] estimated memory per GPU (one process)" in out
    est = estimate(out)
    assert est["kv_cache"] == est["reference"] == est["prefill"] == est["host_kv_cache"] == 0
    assert est["master_weights"] > 0 and est["optimizer"] == pytest.approx(2 * est["master_weights"], abs=0.2)
    assert (tmp_path / "sft" / "model.safetensors").exists()  # and it trained on


def test_sft_stops_on_a_gpu_it_cannot_fit_before_loading(tmp_path, ckpt, monkeypatch, capsys):
    class Loaded(Exception):
        pass

    def load_model(*args, **kwargs):
        raise Loaded

    monkeypatch.setattr(sft.models, "load_model", load_model)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=2**16))
    gpu, data = fake_accelerator(device="cuda:0"), [choice_conversation("left")] * 2
    cfg = sft.SFTConfig(model=str(ckpt), out=str(tmp_path / "sft"), batch_size=2, lora_rank=4)
    with pytest.raises(SystemExit) as e:
        sft.train(cfg, data, accelerator=gpu)
    message = str(e.value)
    assert message.startswith("sft.py: the estimated training peak") and "exceeds this GPU's 0.1 MiB" in message
    assert "--lora-rank" in message and "--no-memory-check" in message and "--rollout-batch" not in message
    assert "LoRA adapters of" in capsys.readouterr().out
    cfg.memory_check = False  # --no-memory-check: printed, then loaded
    with pytest.raises(Loaded):
        sft.train(cfg, data, accelerator=gpu)
    assert "[sft] estimated memory per GPU" in capsys.readouterr().out
    assert "--no-memory-check" in _sft_help(capsys)


def test_sft_is_stopped_on_its_training_peaks_not_a_rollouts(ckpt, monkeypatch, capsys):
    """Sharded SFT gathers one layer at a time and never the whole model, as a rollout does: a GPU that holds the
    loading and the update is enough, where check_memory (GRPO's, with its rollout) would stop."""
    cfg = SimpleNamespace(lora_rank=0, bf16=True, memory_check=True)
    opts = dict(world=8, sharded=True, device="cuda:0")
    gpu = SimpleNamespace(total_memory=2**40)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: gpu)
    est = memory.check_training(str(ckpt), cfg, **opts)
    training = max(est["load_peak"], est["update_peak"])
    assert training < est["rollout_peak"] == est["peak"]
    gpu.total_memory = (training + est["peak"]) // 2
    memory.check_training(str(ckpt), cfg, **opts)
    with pytest.raises(SystemExit):
        memory.check_memory(memory.read_config(str(ckpt)), bf16=True, reference=False, max_context=0, episodes=0,
                            **opts)
    assert "estimated memory per GPU (sharded over 8)" in capsys.readouterr().out


def _sft_help(capsys) -> str:
    with pytest.raises(SystemExit):
        sft.main(["--help"])
    return capsys.readouterr().out


def test_sft_estimate_for_qwen3_8b_full_fine_tuning():
    """The figures docs/gpus.md gives: Qwen3-8B's shape (nothing downloaded), bf16, 8 GPUs. Under DDP every GPU holds
    the fp32 weights, gradients (twice: DDP's buckets) and AdamW state, far past 80 GB; FSDP2 divides them by 8."""
    from transformers import Qwen3Config

    config = Qwen3Config(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False)
    n, unit = memory.count_params(config), memory.largest_unit(memory.meta_model(config))
    ddp = memory.memory_estimate(n, world=8, bf16=True, reference=False)
    fsdp = memory.memory_estimate(n, world=8, sharded=True, bf16=True, reference=False, unit=unit)
    ddp_peak, fsdp_peak = (max(e["load_peak"], e["update_peak"]) for e in (ddp, fsdp))  # memory.check_training's
    print(f"Qwen3-8B SFT on 8 GPUs: DDP {memory.gib(ddp_peak)}, FSDP2 {memory.gib(fsdp_peak)}")
    assert ddp["reference"] == ddp["kv_cache"] == 0
    assert ddp_peak > 150 * 2**30 and fsdp_peak < 20 * 2**30
