"""Sharded training (FSDP2, DeepSpeed ZeRO-2 and -3): gradients, the gathered rollout, the backends refused at
start, the memory estimate.

The two-process FSDP2 tests run tests/fsdp2_worker.py under torchrun on 2 CPU processes over gloo, and shard the
model with raw `fully_shard` over `init_device_mesh("cpu", (2,))`, exactly the calls Accelerate's FSDP2 makes on a
model. The DeepSpeed tests run tests/deepspeed_worker.py the same way, with an engine from `deepspeed.initialize`
on DeepSpeed's CPU accelerator (skipped when deepspeed is not installed: it is not in requirements.txt). What they
do not cover: Accelerate's own FSDP and DeepSpeed branches (`acc.prepare` with an FSDP2 or DeepSpeed plugin, its
auto-wrap policy, mixed-precision policy, CPU-RAM-efficient loading, zero.Init and sharded checkpoints), because
Accelerate 1.15 silently ignores those plugins when cpu=True; bf16; and anything CUDA/NCCL. The Accelerator in the
workers is the MULTI_CPU one grpo.main makes here, so `acc.clip_grad_norm_` and `acc.reduce` are Accelerate's own
code on DTensor gradients.
"""
import importlib.util
import json
import os
import re
import warnings
from types import SimpleNamespace

import pytest
import torch

from plumbing import memory, shard

import two_procs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_worker(mode, tmp_path, port, worker="fsdp2_worker.py", args=(), env=None):
    out = tmp_path / f"{mode}.json"
    # The timeout is the hang detector: a rollout whose processes block in a collective never returns.
    r = two_procs.torchrun([os.path.join(ROOT, "tests", worker), mode, *args, str(out)], port, 300, env)
    # Once in ~6 full-suite runs on this loaded 2-core machine, rank 0 aborted in gloo's teardown ("terminate called
    # without an active exception", after destroy_process_group) once its results were written: that teardown is
    # not what these tests examine, so it is reported, not failed; any other failure, or no results, fails.
    teardown_abort = "terminate called without an active exception" in r.stderr and out.exists()
    assert r.returncode == 0 or teardown_abort, r.stderr[-3000:]
    if r.returncode:
        warnings.warn(f"{worker} {mode}: the processes aborted in teardown after writing their results")
    return json.loads(out.read_text())


@pytest.mark.versions
def test_fsdp2_gradients_equal_one_process(tmp_path):
    """GRPO loss over token_logprobs (run inside the sharded forward) with a sharded reference: the gradients and
    their norm over 2 processes x 2 micro-batches equal one process's on all rows, tied and untied output layer,
    sharded by the plain recipe and as Accelerate's FSDP2 does (the output layer in a unit of its own, whose forward
    never runs: the chunked head reads its weight), before and after an AdamW step."""
    res = run_worker("grads", tmp_path, 29541)
    assert len(res) == 4
    for layout in res:  # tied and untied output layer; the plain layout and Accelerate's (fsdp2_worker.fsdp2)
        for it in ("iter0", "iter1"):
            r = res[layout][it]
            assert r["grads_are_dtensors"], layout  # really sharded
            assert r["grad_scale"] > 0.01 and r["grad_diff"] < 1e-5 * max(1.0, r["grad_scale"]), (layout, it, r)
            assert r["norm"][0] == pytest.approx(r["norm"][1], rel=1e-5), (layout, it)
            assert r["ref_logp_diff"] < 1e-5, (layout, it)


@pytest.mark.versions
def test_fsdp2_rollout_with_unequal_steps_then_a_training_step(tmp_path):
    """Inside shard.full_weights the two processes decode different numbers of steps (different per-turn caps), with
    plain tensors through no FSDP hook, and finish, with the unsharded model's greedy tokens; grpo.train_on_episodes
    after it (FSDP2, no no_sync, sharded reference) gives the one-process loss, gradient norm and clipped update on
    both processes' episodes."""
    r = run_worker("rollout", tmp_path, 29543)
    # decoded by a model without FSDP's hooks (shard.plain_twin): one forward through the units, full_weights' first
    assert r["plain_decoder"] and r["fsdp_forwards"] == 1, r
    check_rollout_then_train(r)


@pytest.mark.versions
def test_fsdp2_with_checkpointing_and_two_updates_a_batch_equals_one_process(tmp_path):
    """What a GPU run configures besides, under Accelerate's unit layout: gradient checkpointing on the sharded policy
    and --updates-per-batch 2 (old log-probs scored once, two clipped steps), two micro-batches a process; the mean
    loss, mean gradient norm and the weights after both steps equal one process's."""
    r = run_worker("recipe", tmp_path, 29561)
    assert r["checkpointing"]
    check_rollout_then_train(r)


@pytest.mark.versions
def test_fsdp2_checkpoints_are_written_by_every_process_and_gathered_on_the_writer_only(tmp_path):
    """Under FSDP2, save_state writes each process's shards of the weights and AdamW moments
    (torch.distributed.checkpoint, whatever the accelerate config's state_dict_type), which load back exactly into a
    fresh sharded model and optimizer; the model directory's full weights are gathered on the main process only (the
    other gets nothing). Accelerate's own save and load functions, with the plugin cli.sharded_checkpoints sets."""
    main, other = run_worker("checkpoint", tmp_path, 29563)
    assert main["state_dict_type"] == other["state_dict_type"] == "StateDictType.SHARDED_STATE_DICT"
    assert main["differed"] and main["weights"] == other["weights"] == 0.0
    assert main["moments"] == other["moments"] == 0.0
    assert any(f.startswith("pytorch_model_fsdp_0/") for f in main["files"])
    assert any(f.startswith("optimizer_0/") for f in main["files"])
    assert not any(f.endswith(".bin") for f in main["files"])  # no full state dict saved by one process
    assert len(main["whole"]) == main["params"] and other["whole"] == {}
    assert all(dev == "cpu" and diff == 0.0 for _, dev, diff in main["whole"].values())


@pytest.mark.versions
def test_fsdp2_a_shard_one_processs_disk_refuses_stops_every_process_at_the_same_place_in_one_line(tmp_path):
    """Process 1's disk refuses its shard of an FSDP2 checkpoint: torch.distributed.checkpoint raises on both
    processes alike (a CheckpointException, a BaseException), which disk.agreed takes for a refused write on
    each, and the line names process 1's own error, not the exception's wrapper."""
    main, other = run_worker("refused", tmp_path, 29565)
    assert main["raised"] == other["raised"] == "CheckpointException"
    assert re.match(r"grpo.py: writing the checkpoint failed: \[Errno 28\] No space left on device \(is the disk full "
                    r"or read-only\?\)\. The partial copy was removed", main["line"]), main["line"]
    assert main["line"] == other["line"]


def check_rollout_then_train(r):
    """What both backends' rollout workers measured: unequal decoding, the same tokens, then the one-process step."""
    assert r["steps"][0] != r["steps"][1], r["steps"]
    assert r["same_tokens"] and r["episodes"] == 4 and r["logprob_diff"] < 1e-5
    assert r["skipped"] == 0
    assert r["grad_norm"][0] == pytest.approx(r["grad_norm"][1], rel=1e-5) and r["grad_norm"][1] > 0.5  # clipped
    assert r["loss"][0] == pytest.approx(r["loss"][1], rel=1e-5, abs=1e-7)
    assert r["weight_diff"] < 1e-5
    # each group's two episodes (one micro-batch each) scored through their opening computed once, none unshared
    assert r["shared"] > 0 and r["unshared_groups"] == 0, r


@pytest.mark.parametrize("kind, version, stage, named", [
    ("FSDP", 1, None, "FSDP1"), ("DEEPSPEED", None, 1, "stage 1"), ("DEEPSPEED", None, 0, "stage 0"),
    ("XLA", None, None, "XLA"), ("MEGATRON_LM", None, None, "MEGATRON_LM"),
])
def test_unsupported_backends_fail_at_start_naming_them(kind, version, stage, named):
    with pytest.raises(SystemExit) as e:
        shard.check_backend(kind, version, zero_stage=stage)
    assert named in str(e.value)
    assert any(s in str(e.value) for s in ("fsdp_version 2", "fsdp_version: 2", "zero_stage 3"))


def test_sft_refuses_what_it_does_not_implement_too():
    """The cold start's loop accumulates like GRPO's, through the same shard functions: the same backends are
    refused there, by name."""
    from types import SimpleNamespace

    import sft

    def acc(kind, fsdp=None, ds=None):
        return SimpleNamespace(distributed_type=kind, state=SimpleNamespace(fsdp_plugin=fsdp, deepspeed_plugin=ds))

    for refused, named in ((acc("DEEPSPEED", ds=SimpleNamespace(zero_stage=1)), "stage 1"),
                           (acc("FSDP", fsdp=SimpleNamespace(fsdp_version=1)), "FSDP1")):
        with pytest.raises(SystemExit, match="sft.py") as e:
            sft.check_backend(refused)
        assert named in str(e.value)
    sft.check_backend(acc("FSDP", fsdp=SimpleNamespace(fsdp_version=2)))
    sft.check_backend(acc("DEEPSPEED", ds=SimpleNamespace(zero_stage=2)))
    zero3 = acc("DEEPSPEED", ds=SimpleNamespace(zero_stage=3))
    if importlib.util.find_spec("deepspeed") is not None:
        sft.check_backend(zero3)
    else:  # the ZeRO-3 rollout needs DeepSpeed's gather: said at start
        with pytest.raises(SystemExit, match="deepspeed=="):
            sft.check_backend(zero3)


def test_zero3_without_init_flag_is_said_at_start(capsys):
    """Without Accelerate's zero3_init_flag the engine puts the whole model on every GPU before partitioning it."""
    from types import SimpleNamespace

    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed")
    ds = SimpleNamespace(zero_stage=3, zero3_init_flag=False)
    shard.check_accelerator(SimpleNamespace(distributed_type="DEEPSPEED", state=SimpleNamespace(
        fsdp_plugin=None, deepspeed_plugin=ds)))
    assert "zero3_init_flag" in capsys.readouterr().out
    ds.zero3_init_flag = True
    shard.check_accelerator(SimpleNamespace(distributed_type="DEEPSPEED", state=SimpleNamespace(
        fsdp_plugin=None, deepspeed_plugin=ds)))
    assert "zero3_init_flag" not in capsys.readouterr().out


def test_sft_batch_must_split_evenly_over_processes():
    """Unequal micro-batch counts would hang sharded backward (each one is a collective): refused at start."""
    import sft

    sft.check_batch(128, 8)
    for batch, procs in ((10, 4), (2, 4)):
        with pytest.raises(SystemExit, match="--batch-size"):
            sft.check_batch(batch, procs)


def test_supported_backends_pass():
    from accelerate.utils import DistributedType

    for kind, version, stage in [("NO", None, None), (DistributedType.MULTI_GPU, None, None), ("MULTI_CPU", None, None),
                                 ("FSDP", 2, None), ("DEEPSPEED", None, 2), ("DEEPSPEED", None, 3)]:
        shard.check_backend(kind, version, zero_stage=stage)


def test_deepspeed_config_is_set_from_the_options_and_brings_no_optimizer():
    """The engine clips at --grad-clip and takes --micro-batch-size, one micro-batch a step (the loop sets the
    boundary); a config with its own optimizer or scheduler is refused, naming the section."""
    from types import SimpleNamespace

    config = {"zero_optimization": {"stage": 3}, "gradient_clipping": "auto", "train_micro_batch_size_per_gpu": "auto"}
    acc = SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=SimpleNamespace(deepspeed_config=config)),
                          num_processes=4)
    shard.configure_deepspeed(acc, micro_batch_size=2, grad_clip=0.7)
    assert (config["gradient_clipping"], config["train_micro_batch_size_per_gpu"],
            config["gradient_accumulation_steps"], config["train_batch_size"]) == (0.7, 2, 1, 8)
    assert config["communication_data_type"] == "fp32"  # gradients reduced in fp32, as under DDP and FSDP2
    config["scheduler"] = {"type": "WarmupLR"}
    with pytest.raises(SystemExit, match="'scheduler' section"):
        shard.configure_deepspeed(acc, micro_batch_size=2, grad_clip=0.7)
    shard.configure_deepspeed(SimpleNamespace(state=SimpleNamespace()), micro_batch_size=2, grad_clip=0.7)  # no-op


def test_memory_estimate_worked_example():
    """8B parameters, bf16, a reference, KV 147,456 B/token (Qwen3-8B: 36 layers x 8 kv heads x 128 x 2 x 2 bytes),
    32k context, 4 live episodes per process."""
    n, kv = 8 * 10**9, 2 * 36 * 8 * 128 * 2
    ddp = memory.memory_estimate(n, world=8, sharded=False, bf16=True, reference=True, kv_bytes_per_token=kv,
                                max_context=32768, episodes=4)
    assert (ddp["weights"], ddp["master_weights"], ddp["gradients"], ddp["optimizer"], ddp["reference"]) == (
        2 * n, 4 * n, 8 * n, 8 * n, 4 * n)  # the reference in fp32, as the policy's master weights
    assert ddp["kv_cache"] == kv * 32768 * 4
    sized = memory.memory_estimate(n, world=8, sharded=False, bf16=True, reference=True, kv_bytes_per_token=kv,
                                   max_context=32768, episodes=4, slot_positions=12 * 8192 + 2 * 32768)
    assert sized["kv_cache"] == kv * (12 * 8192 + 2 * 32768)  # --decode-slots: the slots as allocated
    assert sized["rollout_peak"] - ddp["rollout_peak"] == sized["kv_cache"] - ddp["kv_cache"]
    assert "slots of 163,840 positions in all" in memory.slots_said(4, 32768, 12 * 8192 + 2 * 32768)
    assert ddp["update_peak"] == 4 * n + 8 * n + 8 * n + 4 * n + 2 * n
    fsdp = memory.memory_estimate(n, world=8, sharded=True, bf16=True, reference=True, kv_bytes_per_token=kv,
                                 max_context=32768, episodes=4)
    assert (fsdp["weights"], fsdp["master_weights"], fsdp["gradients"], fsdp["optimizer"], fsdp["reference"]) == (
        2 * n, n // 2, n // 2, n, n // 2)
    assert fsdp["rollout_peak"] == 2 * n + n // 2 + n + n // 2 + kv * 32768 * 4
    assert fsdp["peak"] == max(fsdp["rollout_peak"], fsdp["update_peak"], fsdp["load_peak"]) < ddp["peak"]
    # ZeRO-2: the weights whole in bf16 (the engine's), master weights, gradients and AdamW state / 8, the
    # reference whole in bf16 (its own stage-0 engine); the writer gathers the fp32 weights for the model directory
    z2 = memory.memory_estimate(n, world=8, zero2=True, bf16=True, reference=True)
    assert (z2["weights"], z2["master_weights"], z2["gradients"], z2["optimizer"], z2["reference"]) == (
        2 * n, n // 2, n // 2, n, 2 * n)
    assert z2["update_peak"] == n // 2 + n + 2 * n + n // 2 + 2 * n < ddp["update_peak"]
    assert z2["host_save"] == 4 * n + memory.MODEL_FILE_BYTES
    one = memory.memory_estimate(10, reference=False)  # fp32, one process: the weights are the master weights
    assert (one["weights"], one["master_weights"], one["gradients"], one["reference"]) == (0, 40, 40, 0)


def test_prefill_activations_are_in_the_rollout_peak(tiny_lm):
    """One prefill chunk's activations (memory.prefill_bytes: the MLP's intermediates, ~4 hidden-size tensors, the
    attention mask over the keys) are held beside the KV cache: the rollout peak counts them, training or not."""
    cfg = tiny_lm.config
    h, i, n_rep = cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads // cfg.num_key_value_heads
    assert memory.prefill_bytes(cfg, bf16=True, tokens=100, context=1000) == (100 * (4 * h + 3 * i) * 2
                                                                             + 100 * 1000 * (1 + n_rep * 3))
    for inference in (False, True):
        a = memory.memory_estimate(10**6, kv_bytes_per_token=64, max_context=1000, episodes=2, inference=inference)
        b = memory.memory_estimate(10**6, kv_bytes_per_token=64, max_context=1000, episodes=2, inference=inference,
                                  prefill=12345)
        assert b["prefill"] == 12345 and b["rollout_peak"] == a["rollout_peak"] + 12345


def test_an_evaluation_on_a_gpu_decodes_as_many_episodes_as_fit():
    """eval.py --rollout-batch 0 on a GPU: the most episodes whose estimated peak fits the GPU decode at once (the
    documented `--trials 4` on tau2 retail, 160 episodes of Qwen3-8B at 32k on one 80 GB GPU, was refused before)."""
    from transformers import Qwen3Config

    cfg = Qwen3Config(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False)
    gpu, kv = 80 * 2**30, memory.kv_bytes_per_token(cfg, True)
    n = memory.fitting_batch(cfg, live=160, device_bytes=gpu, bf16=True, max_context=32768, prefill_tokens=8192)

    def peak(episodes):
        return memory.memory_estimate(memory.count_params(cfg), bf16=True, reference=False, kv_bytes_per_token=kv,
                                      max_context=32768, episodes=episodes, inference=True,
                                      prefill=memory.prefill_bytes(cfg, True, 8192, 32768))["peak"]
    assert 1 < n < 160 and peak(n) * memory.ESTIMATE_MISSES <= gpu < peak(n + 1) * memory.ESTIMATE_MISSES, n
    assert memory.fitting_batch(cfg, live=3, device_bytes=gpu, bf16=True, max_context=32768,
                                prefill_tokens=8192) == 3  # all fit
    assert memory.fitting_batch(cfg, live=9, device_bytes=2**30, bf16=True, max_context=32768) == 1  # none: 1


@pytest.mark.versions
def test_the_plain_twin_computes_what_the_model_does_on_the_same_tensors(tiny_lm):
    """shard.plain_twin (the FSDP2 rollout's decoder): the model built anew, holding the very tensors of the model it
    copies, layers wrapped by FSDP's activation checkpointing (accelerate config) included; the checkpoint's own
    generation config (its stop tokens: Qwen3's generation_config.json stops at two tokens, its config.json at one)."""
    import copy

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = copy.deepcopy(tiny_lm).eval()
    model.generation_config.eos_token_id = [model.config.eos_token_id, 7]
    model.model.layers[0] = checkpoint_wrapper(model.model.layers[0])
    twin = shard.plain_twin(model)
    assert not any("_checkpoint_wrapped_module" in n for n, _ in twin.named_parameters())
    mine = {id(t) for t in [*model.parameters(), *model.buffers()]}
    assert all(id(t) in mine for t in [*twin.parameters(), *twin.buffers()])  # nothing copied
    assert twin.generation_config.eos_token_id == [model.config.eos_token_id, 7]
    ids = torch.randint(0, tiny_lm.config.vocab_size, (2, 9))
    with torch.no_grad():
        assert torch.equal(twin(ids).logits, tiny_lm(ids).logits)


@pytest.mark.versions
def test_an_fsdp2_checkpoint_saved_whole_is_read_whole_and_the_run_saves_sharded_after(tmp_path):
    """A checkpoint written before save_state was sharded holds pytorch_model_fsdp.bin: checkpoints.load reads it
    with the full state dict, then sets the plugin back to sharded for this run's own saves."""
    from accelerate import FullyShardedDataParallelPlugin

    from plumbing import checkpoints

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    state = tmp_path / "step-000002" / "accelerate"
    state.mkdir(parents=True)
    torch.save({"python": 1}, state / "random_states_0.pkl")
    (state / "scheduler.json").write_text("{}")  # (a checkpoint without it is refused: the schedule would restart)
    (state.parent / "trainer_state.json").write_text('{"step": 2, "data_position": 8}')
    seen = []
    acc = SimpleNamespace(process_index=0, state=SimpleNamespace(fsdp_plugin=plugin),
                          load_state=lambda path: seen.append(str(plugin.state_dict_type)))
    sched = SimpleNamespace(load_state_dict=lambda state: None)
    for whole in (False, True):
        if whole:
            (state / "pytorch_model_fsdp.bin").write_bytes(b"")
        assert checkpoints.load(acc, state.parent, 4, sched) == 2
        assert str(plugin.state_dict_type) == "StateDictType.SHARDED_STATE_DICT"
    assert seen == ["StateDictType.SHARDED_STATE_DICT", "StateDictType.FULL_STATE_DICT"]


def test_kv_bytes_per_token_from_config(tiny_lm):
    cfg = tiny_lm.config  # 2 layers, 2 kv heads, head_dim 16
    assert memory.kv_bytes_per_token(cfg, bf16=False) == 2 * 2 * 2 * 16 * 4
    assert memory.count_params(cfg) == sum(p.numel() for p in tiny_lm.parameters())


def test_kv_cache_in_the_compute_dtype(tiny_lm):
    """Under bf16 autocast the rollout's cache is bf16 (half the memory), though the weights are fp32 masters."""
    from fast.engine import SlotPool

    assert SlotPool(tiny_lm, 2, 8).k[0].dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        pool = SlotPool(tiny_lm, 2, 8)
    assert pool.k[0].dtype == torch.bfloat16 and next(tiny_lm.parameters()).dtype == torch.float32


def test_token_logprobs_puts_back_the_forward(tiny_lm):
    """The redirected forward is temporary, and a forward Accelerate had put on the instance survives it."""
    from fast.logprobs import token_logprobs

    ids = torch.tensor([[1, 5, 7, 9]])
    token_logprobs(tiny_lm, ids, torch.ones_like(ids))
    assert "forward" not in tiny_lm.__dict__
    marker = tiny_lm.forward
    tiny_lm.forward = marker
    try:
        token_logprobs(tiny_lm, ids, torch.ones_like(ids))
        assert tiny_lm.__dict__["forward"] is marker
    finally:
        del tiny_lm.forward


def test_memory_check_stops_on_a_gpu_it_cannot_fit(tiny_lm, monkeypatch, capsys):
    from types import SimpleNamespace

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=2**20))
    opts = dict(world=2, sharded=False, bf16=True, reference=True, max_context=4096, episodes=32, device="cuda:0")
    with pytest.raises(SystemExit) as e:
        memory.check_memory(tiny_lm.config, **opts)
    assert "--max-context" in str(e.value) and "--no-memory-check" in str(e.value) and "DDP" in str(e.value)
    assert "estimated memory per GPU (DDP)" in capsys.readouterr().out
    memory.check_memory(tiny_lm.config, **opts, check=False)  # --no-memory-check: printed, not stopped


def test_parked_caches_are_counted_in_host_memory(tiny_lm, monkeypatch, capsys):
    """--rollout-batch below a process's episodes parks the others' KV caches in host memory: counted there (the
    worst case, every one at --max-context), not in the GPU's peak, and a machine that cannot hold them for all its
    processes stops the run at start, naming --rollout-batch."""
    from types import SimpleNamespace

    kv = memory.kv_bytes_per_token(tiny_lm.config, bf16=True)
    parked = memory.memory_estimate(100, bf16=True, kv_bytes_per_token=kv, max_context=4096, episodes=8, parked=24)
    alone = memory.memory_estimate(100, bf16=True, kv_bytes_per_token=kv, max_context=4096, episodes=8)
    assert parked["host_kv_cache"] == kv * 4096 * 24 and alone["host_kv_cache"] == 0
    assert parked["peak"] == alone["peak"] and parked["kv_cache"] == kv * 4096 * 8
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=2**40))
    # room for 3 processes' parked caches and the writer's checkpoint beside them (the model in fp32, under DDP): the
    # caches' host blocks stay allocated from the first rollout on (pool._host_block), saves included
    assert parked["host_save"] == 400 and parked["host_peak"] == kv * 4096 * 24 + 400
    save = 4 * sum(p.numel() for p in tiny_lm.parameters())
    monkeypatch.setattr(memory, "host_memory_bytes", lambda: kv * 4096 * 24 * 3 + save)
    opts = dict(world=4, sharded=False, bf16=True, reference=True, max_context=4096, episodes=8, parked=24,
                device="cuda:0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    memory.check_memory(tiny_lm.config, **opts)
    assert "host_kv_cache" in capsys.readouterr().out
    monkeypatch.setattr(memory, "host_memory_bytes", lambda: kv * 4096 * 24 * 3)  # the caches fit, not the save too
    with pytest.raises(SystemExit, match="writing a checkpoint needs") as e:
        memory.check_memory(tiny_lm.config, **opts)
    assert "parked KV caches" in str(e.value) and "--rollout-batch" in str(e.value)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with pytest.raises(SystemExit, match="--rollout-batch") as e:
        memory.check_memory(tiny_lm.config, **opts)
    assert "host memory" in str(e.value) and "4 on this machine" in str(e.value)
    memory.check_memory(tiny_lm.config, **opts, check=False)


@pytest.mark.versions
def test_sharded_loading_holds_shards_and_one_unit(tiny_lm, monkeypatch, capsys):
    """Under FSDP2 the model is loaded in host memory (shard.load_device) and fully_shard moves one unit at a time
    to the GPU, keeping this process's slice: loading holds the shards of policy and reference plus one unit whole,
    not the whole fp32 model on every GPU. Host memory holds one full fp32 model per process while loading: a
    machine that cannot hold that for all its processes stops at start."""
    from types import SimpleNamespace

    layer = sum(p.numel() for p in tiny_lm.model.layers[0].parameters())
    rest = sum(p.numel() for n, p in tiny_lm.named_parameters() if not n.startswith("model.layers."))
    assert memory.largest_unit(tiny_lm) == max(layer, rest)
    n, unit = 8_190_735_360, 1_244_663_808  # Qwen3-8B; its largest unit: embeddings + output layer (shard_like's root)
    fsdp = memory.memory_estimate(n, world=8, sharded=True, bf16=True, reference=True, unit=unit)
    ddp = memory.memory_estimate(n, world=8, sharded=False, bf16=True, reference=True)
    assert fsdp["load_peak"] == 2 * (4 * n // 8) + 4 * unit < fsdp["rollout_peak"]
    assert ddp["load_peak"] == 4 * n + 4 * n + 4 * n  # policy, its DDP buckets, then the reference
    assert fsdp["host_load"] == ddp["host_load"] == 4 * n == ddp["host_peak"]
    # saving: the process that writes the model directory gathers the whole fp32 model when sharded (not under DDP),
    # and serializes one file of at most 5 GB
    assert ddp["host_save"] == memory.MODEL_FILE_BYTES and fsdp["host_save"] == 4 * n + memory.MODEL_FILE_BYTES
    assert fsdp["host_peak"] == fsdp["host_save"]

    gpu = torch.device("cuda", 3)
    for fsdp2, stage, where in ((True, None, "cpu"), (False, 3, gpu), (False, 2, gpu), (False, None, gpu)):
        acc = SimpleNamespace(is_fsdp2=fsdp2, device=gpu, state=SimpleNamespace(
            deepspeed_plugin=SimpleNamespace(zero_stage=stage) if stage else None))
        assert shard.load_device(acc) == torch.device(where), (fsdp2, stage)

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=2**40))
    full = 4 * sum(p.numel() for p in tiny_lm.parameters())
    monkeypatch.setattr(memory, "host_memory_bytes", lambda: full * 2)  # room for two processes' loading
    opts = dict(world=4, sharded=True, bf16=True, reference=True, max_context=8, episodes=1, device="cuda:0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    memory.check_memory(tiny_lm.config, **opts)
    assert "host_load" in capsys.readouterr().out
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    with pytest.raises(SystemExit, match="loading needs") as e:
        memory.check_memory(tiny_lm.config, **opts)
    assert "host memory per process" in str(e.value) and "3 on this machine" in str(e.value)
    # one process writes the checkpoint: its gather is not multiplied by the processes, but must fit by itself
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setattr(memory, "host_memory_bytes", lambda: full * 3 // 2)  # loading fits, the save's gather does not
    with pytest.raises(SystemExit, match="saving a checkpoint needs") as e:
        memory.check_memory(tiny_lm.config, **opts)
    assert "the process that writes it" in str(e.value)
    memory.check_memory(tiny_lm.config, **{**opts, "sharded": False})  # DDP: nothing gathered, one file serialized


@pytest.mark.versions
def test_fsdp2_bf16_policy_leaves_outputs_in_float32(monkeypatch):
    """Accelerate's default FSDP2 policy for bf16 casts the forward's outputs to bf16, which would round the
    float32 log-probs the loss is computed from; cli.fsdp2_plugin gathers in bf16, reduces in fp32, leaves outputs."""
    from plumbing import cli

    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    policy = cli.fsdp2_plugin("bf16").mixed_precision_policy
    assert (policy.param_dtype, policy.reduce_dtype, policy.output_dtype) == (torch.bfloat16, torch.float32, None)
    assert cli.fsdp2_plugin("no") is None
    monkeypatch.setenv("FSDP_VERSION", "1")
    assert cli.fsdp2_plugin("bf16") is None  # FSDP1 is refused at start (shard.check_backend)


def run_deepspeed(mode, stage, tmp_path, port):
    if importlib.util.find_spec("deepspeed") is None:  # not imported here: only the workers use it
        pytest.skip("deepspeed is not installed (MUARL_DEEPSPEED=1 ./run true installs it)")
    return run_worker(mode, tmp_path, port, "deepspeed_worker.py", [str(stage)], {"DS_ACCELERATOR": "cpu"})


@pytest.mark.parametrize("stage", [3, 2])
def test_deepspeed_gradients_equal_one_process(tmp_path, stage):
    """A DeepSpeed engine (deepspeed.initialize with shard.configure_deepspeed's config, DeepSpeed's CPU accelerator
    over gloo) driven by shard.micro_batch / backward / optimizer_step over 2 processes x 2 micro-batches: its reduced
    gradients, their norm, the weights after its AdamW step (shard.full_state_dict, fp32) and the DeepSpeed
    reference's log-probs equal one process's on all rows, tied and untied output layer. Under ZeRO-3 the output
    layer's weight is partitioned outside forwards (0 elements), so the chunked head works only through
    shard.expose_head. Not covered: Accelerate's own DeepSpeed branch (acc.prepare ignores DeepSpeed when cpu=True),
    bf16, CUDA/NCCL."""
    res = run_deepspeed("grads", stage, tmp_path, 29545 + stage)
    for layout in ("tied=True", "tied=False"):
        assert res[layout]["head_is_partitioned"] == (stage == 3)
        for it in ("iter0", "iter1"):
            r = res[layout][it]
            assert r["grad_scale"] > 0.01 and r["grad_diff"] < 1e-5 * max(1.0, r["grad_scale"]), (layout, it, r)
            assert r["norm"][0] == pytest.approx(r["norm"][1], rel=1e-5), (layout, it)
            assert r["stepped"] and r["state_keys_match"] and r["ref_logp_diff"] < 1e-5, (layout, it, r)
            assert r["weight_diff"] < 1e-4, (layout, it, r)  # an AdamW step here moves weights by up to 1e-2


@pytest.mark.parametrize("stage", [3, 2])
def test_deepspeed_rollout_with_unequal_steps_then_a_training_step(tmp_path, stage):
    """Inside shard.full_weights (ZeRO-3: every parameter gathered, DeepSpeed's hooks off) the two processes decode
    different numbers of steps and finish, with the unsharded model's greedy tokens; the worker's config keeps
    nothing gathered between forwards, so without the gather the processes' decoding collectives mismatch (seen:
    gloo aborts). grpo.train_on_episodes with the engine and a DeepSpeed reference then gives the one-process
    loss, clipped gradient norm and SGD update. The checkpoint's fp32 weights are then whole on the main process
    only (shard.full_state_dict)."""
    r = run_deepspeed("rollout", stage, tmp_path, 29551 + stage)
    assert r["state_held"][0] > 0 and r["state_held"][1] == 0, r["state_held"]
    check_rollout_then_train(r)


def test_the_estimate_counts_parameters_under_an_active_zero3_config(tiny_lm):
    """With Accelerate's DeepSpeed ZeRO-3 config installed, transformers builds models inside deepspeed.zero.Init:
    the estimate's shapes-only model must not be partitioned (its parameters would report 0 elements), and the
    config is active again afterwards."""
    pytest.importorskip("deepspeed")
    from transformers.integrations.deepspeed import (HfDeepSpeedConfig, is_deepspeed_zero3_enabled,
                                                     unset_hf_deepspeed_config)

    keep = HfDeepSpeedConfig({"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1})
    try:
        assert is_deepspeed_zero3_enabled()
        assert memory.count_params(tiny_lm.config) == sum(p.numel() for p in tiny_lm.parameters())
        assert is_deepspeed_zero3_enabled()
    finally:
        unset_hf_deepspeed_config()
    del keep


@pytest.mark.versions
def test_lora_under_ddp_adapter_gradients_equal_one_process(tmp_path):
    """--lora-rank under DDP (two processes over gloo, each with half the groups): after one SGD step of lr 1 the
    adapters equal one process's on all the groups (so their gradients do), on both processes. B starts non-zero in
    this test so that A's gradient is not 0."""
    from plumbing import cli
    import lora_ddp_worker

    two = run_worker("step", tmp_path, 29531, worker="lora_ddp_worker.py")
    one = lora_ddp_worker.one_step(cli.make_accelerator())
    assert two["processes"] == 2 and len(set(two["hashes"])) == 1
    moved = 0
    for name, after in one["after"].items():
        a, b, start = (torch.tensor(x) for x in (after, two["after"][name], one["before"][name]))
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-5), (name, (a - b).abs().max())
        moved += not torch.equal(a, start)
    assert moved == len(one["after"]) == 28  # A and B of 7 projections in 2 layers, every one with a gradient
    assert abs(one["kl"] - two["kl"]) < 1e-6 and one["kl"] > 0
    assert one["unshared_groups"] == two["unshared_groups"] == 0  # each group's opening computed once


@pytest.mark.versions
def test_a_model_loaded_differently_on_one_process_is_refused_by_name(tmp_path, tiny_lm, tiny_tok):
    """Each process loads its own copy of eval's agent, the reference or an hf user: the copies' checksums are compared
    at start (shard.check_same_weights) and a copy that differs on one process (zeros off rank 0 under FSDP's
    CPU-RAM-efficient loading in transformers 5.17, another checkpoint) stops every process naming the model.
    Loaded with that option on, the weights are real on both processes and the option is put back afterwards."""
    ckpt = tmp_path / "ckpt"
    tiny_lm.save_pretrained(ckpt)
    tiny_tok.save_pretrained(ckpt)
    same = run_worker("same", tmp_path, 29571, worker="weights_worker.py", args=(str(ckpt),))
    want = shard.weights_checksum(tiny_lm)
    assert [r["seen"] for r in same] == ["same", "same"] and all(r["restored"] for r in same)
    assert [r["checksum"] for r in same] == pytest.approx([want, want], rel=1e-9) and want != 0
    differ = run_worker("differ", tmp_path, 29572, worker="weights_worker.py", args=(str(ckpt),))
    for r in differ:
        assert r["seen"].startswith(f"eval.py: --agent {ckpt}: its weights differ between processes"), r["seen"]
    # Without the guard: transformers 5.17 zeroes rank 1's copy (the fault, reproduced by .ci/gpu-versions), and the
    # check refuses it; later versions load both copies alike, and the check lets them through.
    raw = run_worker("raw", tmp_path, 29573, worker="weights_worker.py", args=(str(ckpt),))
    import transformers
    if transformers.__version__ == "5.17.0":
        assert raw[0]["checksum"] == pytest.approx(want, rel=1e-9) and raw[1]["checksum"] == 0.0, raw
    if raw[1]["checksum"] != pytest.approx(want, rel=1e-9):
        assert raw[1]["seen"].startswith(f"eval.py: --agent {ckpt}: its weights differ"), raw
    else:
        assert [r["seen"] for r in raw] == ["same", "same"], raw


@pytest.mark.versions
def test_models_load_with_fsdp_efficient_loading_off_and_put_it_back(tmp_path, tiny_lm, tiny_tok, monkeypatch):
    """transformers reads FSDP_CPU_RAM_EFFICIENT_LOADING while it loads: models.load_model sets it to false for that
    call (so every process gets real weights) and restores what the launcher set."""
    from transformers import AutoModelForCausalLM

    from plumbing import models

    tiny_lm.save_pretrained(tmp_path)
    tiny_tok.save_pretrained(tmp_path)
    seen, real = [], AutoModelForCausalLM.from_pretrained

    def spy(*args, **kwargs):
        seen.append(os.environ.get("FSDP_CPU_RAM_EFFICIENT_LOADING"))
        return real(*args, **kwargs)
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", spy)
    for launcher in ("true", None):
        if launcher is None:
            monkeypatch.delenv("FSDP_CPU_RAM_EFFICIENT_LOADING")
        else:
            monkeypatch.setenv("FSDP_CPU_RAM_EFFICIENT_LOADING", launcher)
        models.load_model(str(tmp_path), device="cpu")
        assert os.environ.get("FSDP_CPU_RAM_EFFICIENT_LOADING") == launcher
    assert seen == ["false", "false"]
