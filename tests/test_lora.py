"""LoRA adapters (--lora-rank, lora.py) end to end on the toy environment: only the adapters train (GRPO and SFT),
the reference is the base with them off (kl exactly 0 at step 1), adapter checkpoints resume exactly, evaluate,
start new runs and merge; bad options and backends are refused at start, by name. The two-process DDP test and
the learning test with LoRA are in test_sharding.py and test_learning.py."""
import json
from types import SimpleNamespace

import pytest
import torch

from plumbing import coldstart, lora, models
import eval as evaluation
import grpo
import muarl
import sft
from fast.batched_rollout import RolloutConfig, rollout
from plumbing.users import make_user_sim
from envs import make_env
from fake_env import choice_conversation
from fast.logprobs import token_logprobs

FAKE_ENV = "tests.fake_env:FakeEnv"  # a plug-in environment is named again on --resume


def lora_args(start, out, *extra):
    return ["--init-from", str(start), "--env", "tests.fake_env:FakeEnv", "--steps", "2", "--tasks-per-step", "2",
            "--group-size", "4", "--max-new-tokens", "48", "--max-context", "512", "--eval-tasks", "0",
            "--lr", "1e-2", "--micro-batch-size", "3", "--temperature", "1.0", "--out-dir", str(out),
            "--lora-rank", "4", *extra]


def split(model):
    """(the base's weights under the plain model's names, the adapters' weights) of a peft model."""
    base, adapters = {}, {}
    for name, t in model.get_base_model().state_dict().items():
        if ".lora_" in name:
            adapters[name] = t.detach().clone()
        else:
            base[name.replace(".base_layer", "")] = t.detach().clone()
    return base, adapters


def metrics(run_dir):
    return [json.loads(line) for line in open(run_dir / "metrics.jsonl")]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, ckpt):
    """A two-step GRPO run with adapters of rank 4 (kl coefficient 0.1, so the KL term weighs in the update)."""
    out = tmp_path_factory.mktemp("lora") / "run"
    res = grpo.main(lora_args(ckpt, out, "--kl-coef", "0.1"))
    return SimpleNamespace(out=out, model=res.model, ckpt=out / "checkpoints" / "step-000002" / "model")


def test_grpo_with_lora_trains_the_adapters_only(lora_run, start_lm):
    base, adapters = split(lora_run.model)
    start = {k: v for k, v in start_lm.state_dict().items()}
    assert base.keys() == start.keys()
    for name, w in start.items():  # the frozen base: bit-identical
        assert torch.equal(w, base[name]), f"base weight {name} moved"
    assert len(adapters) == 2 * 7 * 2  # A and B on 7 projections of 2 layers
    for name, w in adapters.items():  # B starts at 0: each one moved (A: the next test)
        if ".lora_B." in name:
            assert w.abs().sum() > 0, f"{name} did not move"
    assert all(p.dtype == torch.float32 for n, p in lora_run.model.named_parameters() if p.requires_grad)
    rows = metrics(lora_run.out)
    assert rows[0]["kl"] == 0.0  # the reference is the policy with its adapters off, and B = 0 at step 1
    assert rows[1]["kl"] > 0
    assert rows[0]["logprob_gap"] < 1e-4  # the rollout decodes with the adapters on, as the trainer scores


def test_lora_adapters_that_got_a_gradient_moved(lora_run, ckpt):
    """After step 2 every A moved too (its gradient is 0 at step 1, where B is 0): compared with the adapters a run
    starts from (same seed, same init)."""
    first = grpo.main(lora_args(ckpt, lora_run.out.parent / "one-step", "--kl-coef", "0.1", "--steps", "1",
                                "--lr", "1e-12"))
    _, start_adapters = split(first.model)
    _, adapters = split(lora_run.model)
    moved = [n for n in adapters if not torch.allclose(adapters[n], start_adapters[n], atol=1e-9, rtol=0)]
    assert sorted(moved) == sorted(adapters), sorted(set(adapters) - set(moved))


def test_lora_checkpoint_is_peft_format_and_small(lora_run, ckpt, start_lm):
    from peft import PeftModel
    from safetensors.torch import load_file

    files = sorted(p.name for p in lora_run.ckpt.iterdir())
    assert "adapter_config.json" in files and "adapter_model.safetensors" in files
    assert "model.safetensors" not in files and "README.md" not in files
    assert json.loads((lora_run.ckpt / "adapter_config.json").read_text())["base_model_name_or_path"] == \
        str(ckpt.resolve())
    # Accelerate's state holds the adapters only (the base is the run's start, on disk already).
    state = load_file(str(lora_run.ckpt.parent / "accelerate" / "model.safetensors"))
    assert state and all(".lora_" in k for k in state)
    # Loadable with PEFT's own API on the base loaded separately.
    from transformers import AutoModelForCausalLM
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(ckpt), str(lora_run.ckpt))
    ours, theirs = split(lora_run.model)[1], split(loaded)[1]
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_lora_reference_is_the_base_loaded_separately(lora_run, ckpt, tiny_tok):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, len(tiny_tok), (3, 40), generator=g)
    attn = torch.ones_like(ids)
    attn[1, 30:] = 0
    base, _ = models.load_model(str(ckpt), device="cpu", dtype=torch.float32)
    model = lora_run.model
    with torch.no_grad():
        with lora.adapters_off(model):
            ref = token_logprobs(model, ids, attn)
        on = token_logprobs(model, ids, attn)
        alone = token_logprobs(base, ids, attn)
    assert torch.equal(ref * attn, alone * attn)
    assert not torch.equal(on * attn, alone * attn)  # the adapters are back on after the `with`


def test_lora_resume_continues_exactly(tmp_path, ckpt):
    full = grpo.main(lora_args(ckpt, tmp_path / "a", "--steps", "4", "--save-every", "2"))
    grpo.main(lora_args(ckpt, tmp_path / "b", "--steps", "2", "--save-every", "2"))
    resumed = grpo.main(["--resume", str(tmp_path / "b"), "--env", FAKE_ENV, "--steps", "4"])
    a, b = full.model.state_dict(), resumed.model.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    la, lb = metrics(tmp_path / "a"), metrics(tmp_path / "b")
    assert [r["loss"] for r in la] == [r["loss"] for r in lb]
    assert [r["kl"] for r in la] == [r["kl"] for r in lb]


def test_lora_state_of_other_settings_is_refused_on_load(lora_run, tmp_path):
    """An Accelerate state whose file does not hold exactly this run's adapters stops the resume, naming the file."""
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    model = lora.add_adapters(models.load_model(str(lora_run.ckpt), device="cpu", merge_adapters=True)[0], rank=8,
                              alpha=0, dropout=0.0, targets="q_proj", base="x")
    model = acc.prepare(model)
    lora.checkpoint_hooks(acc)
    with pytest.raises(SystemExit, match="other weights than this run's adapters"):
        acc.load_state(str(lora_run.ckpt.parent / "accelerate"))


def test_eval_and_merge_an_adapter_checkpoint(lora_run, tmp_path, tiny_tok):
    evaluation.main(["--agent", str(lora_run.ckpt), "--env", "tests.fake_env:FakeEnv", "--num-tasks", "3",
                     "--max-new-tokens", "8", "--out-dir", str(tmp_path / "ev")])
    assert json.loads((tmp_path / "ev" / "summary.json").read_text())["episodes"] == 3
    out = tmp_path / "merged"
    evaluation.main(["--agent", str(lora_run.ckpt), "--merge-lora", str(out)])
    assert (out / "config.json").exists() and (out / "model.safetensors").exists()
    assert not (out / "adapter_config.json").exists()
    adapted, tok = models.load_model(str(lora_run.ckpt), device="cpu")
    merged, _ = models.load_model(str(out), device="cpu")
    assert lora.is_adapted(adapted) and not lora.is_adapted(merged)
    env = make_env("tests.fake_env:FakeEnv")
    greedy = RolloutConfig(greedy=True, max_new_tokens=24, max_context=512, max_turns=4)
    a = rollout(adapted, tok, env, env.tasks("test")[:4], 1, make_user_sim("scripted"), greedy, seed=0)
    b = rollout(merged, tok, env, env.tasks("test")[:4], 1, make_user_sim("scripted"), greedy, seed=0)
    assert sum(len(e.input_ids) for e in a) > 4 * 40
    assert [e.input_ids for e in a] == [e.input_ids for e in b]
    with pytest.raises(SystemExit) as e:  # never over what is there
        evaluation.main(["--agent", str(lora_run.ckpt), "--merge-lora", str(out)])
    assert str(e.value).startswith(f"eval.py: --merge-lora: {out} already holds a checkpoint; choose another")
    with pytest.raises(SystemExit, match="not an adapter checkpoint"):
        evaluation.main(["--agent", str(out), "--merge-lora", str(tmp_path / "again")])


def test_grpo_from_an_adapter_checkpoint_starts_from_it_merged(lora_run, tmp_path):
    """--init-from an adapter checkpoint: the start (and so the reference) is it merged into its base, and new
    adapters train on top: kl 0 at step 1 again, and the base equals the checkpoint merged."""
    res = grpo.main(lora_args(lora_run.ckpt, tmp_path / "run", "--steps", "1"))
    assert metrics(tmp_path / "run")[0]["kl"] == 0.0
    merged, _ = models.load_model(str(lora_run.ckpt), device="cpu", dtype=torch.float32, merge_adapters=True)
    base, _ = split(res.model)
    for name, w in merged.state_dict().items():
        assert torch.equal(w, base[name]), name
    new = json.loads((tmp_path / "run" / "checkpoints" / "step-000001" / "model" / "adapter_config.json").read_text())
    assert new["base_model_name_or_path"] == str(lora_run.ckpt.resolve())
    again, _ = models.load_model(str(tmp_path / "run" / "checkpoints" / "step-000001" / "model"), device="cpu")
    assert lora.is_adapted(again)  # its base (adapters on their base) loads in turn


def test_sft_with_lora_trains_the_adapters_only(tmp_path, ckpt, start_lm):
    data = [choice_conversation("left") for _ in range(16)]
    out = sft.train(sft.SFTConfig(model=str(ckpt), out=str(tmp_path / "sft"), epochs=4, batch_size=8, lr=1e-2,
                                  lora_rank=4), data)
    assert (out / "adapter_config.json").exists() and not (out / "model.safetensors").exists()
    model, tok = models.load_model(str(out), device="cpu")
    base, adapters = split(model)
    for name, w in start_lm.state_dict().items():
        assert torch.equal(w, base[name]), f"base weight {name} moved"
    assert all(adapters[k].abs().sum() > 0 for k in adapters if ".lora_B." in k)
    # It learned: the agent's tokens are likelier with the adapters than without.
    ids, _, mask = muarl.collate(coldstart.encode(tok, data[:2], 4096)[0], tok.pad_token_id)
    with torch.no_grad():
        on = (token_logprobs(model, ids, (ids != -1).long()) * mask).sum()
        with lora.adapters_off(model):
            off = (token_logprobs(model, ids, (ids != -1).long()) * mask).sum()
    assert on > off + 1.0
    # SFT then GRPO with adapters, the paper's pipeline: GRPO starts from the cold start merged.
    grpo.main(lora_args(out, tmp_path / "grpo", "--steps", "1"))
    assert metrics(tmp_path / "grpo")[0]["kl"] == 0.0


@pytest.mark.parametrize("argv, option, shown", [
    (["--lora-target-modules", "attn_proj,v_proj"], "--lora-target-modules", "gate_proj"),
    (["--lora-rank", "-1"], "--lora-rank", "must be in [0, inf)"),
    (["--lora-dropout", "1.5"], "--lora-dropout", "[0, 1)"),
    (["--freeze", "embed"], "--freeze", "only the adapters train"),
    (["--lora-rank", "0", "--lora-alpha", "32"], "--lora-alpha", "no effect without --lora-rank"),
    (["--lora-target-modules", "q_proj,lm_head"], "--lora-target-modules", "lm_head is the output layer"),
    (["--lora-decode", "fused"], "--lora-decode", "is not 'merged' or 'unmerged'"),
    (["--lora-rank", "0", "--lora-decode", "unmerged"], "--lora-decode", "no effect without --lora-rank"),
])
def test_bad_lora_options_fail_at_start_naming_them(tmp_path, ckpt, argv, option, shown):
    with pytest.raises(SystemExit) as e:
        grpo.main(lora_args(ckpt, tmp_path / "run", *argv))
    assert option in str(e.value) and shown in str(e.value)
    assert not (tmp_path / "run").exists()  # nothing written


@pytest.mark.parametrize("kind, named", [("FSDP", "FSDP2"), ("DEEPSPEED", "DeepSpeed")])
def test_lora_with_a_sharding_backend_is_refused_by_name(kind, named):
    acc = SimpleNamespace(distributed_type=kind)
    for program in ("grpo.py", "sft.py"):
        with pytest.raises(SystemExit) as e:
            lora.check_backend(acc, program)
        assert f"{program}: --lora-rank with {named} is not supported" in str(e.value)
    for fine in ("NO", "MULTI_GPU", "MULTI_CPU"):
        lora.check_backend(SimpleNamespace(distributed_type=fine))


def test_lora_memory_estimate_for_qwen3_8b_rank_64_on_one_80gb_gpu():
    """The README's figure: Qwen3-8B's shape (the config written out: nothing downloaded) with adapters of rank 64 on
    every projection, bf16, one process, 8 episodes decoding at the paper's 32k context (--recipe paper's
    --rollout-batch 8). Full fine-tuning needs ~4x the GPU; with LoRA the peak fits one 80 GB GPU."""
    from transformers import Qwen3Config

    from plumbing import memory

    config = Qwen3Config(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False)
    meta = memory.meta_model(config)
    n = sum(p.numel() for p in meta.parameters())
    adapters = lora.adapter_params(meta, 64)
    assert 8.1e9 < n < 8.3e9 and 170e6 < adapters < 180e6  # 174.6M: rank x (in + out) of 252 projections
    kv = memory.kv_bytes_per_token(config, bf16=True)
    common = dict(bf16=True, kv_bytes_per_token=kv, max_context=32768, episodes=8,
                  prefill=memory.prefill_bytes(config, True, 8192, 32768))
    with_lora = memory.memory_estimate(n, lora=adapters, reference=True, **common)
    full = memory.memory_estimate(n, reference=True, **common)
    four = memory.memory_estimate(n, lora=adapters, reference=True, **{**common, "episodes": 4})  # --rollout-batch 4
    print(f"Qwen3-8B rank 64: LoRA peak {memory.gib(with_lora['peak'])} (4 decoding: {memory.gib(four['peak'])}), "
          f"full {memory.gib(full['peak'])}")
    assert with_lora["reference"] == 0 and with_lora["weights"] == 2 * n
    assert with_lora["optimizer"] == 8 * adapters and with_lora["gradients"] == 4 * adapters
    assert with_lora["peak"] < 75 * 2**30 < full["peak"]
    # --lora-decode merged (the default) keeps a host copy of the adapted base weights: 6.9B parameters in bf16
    adapted = lora.adapted_base_params(meta)
    merged = memory.memory_estimate(n, lora=adapters, reference=True, lora_base=adapted, **common)
    assert merged["host_base"] == 2 * adapted and 6.8e9 < adapted < 7.0e9 and merged["peak"] == with_lora["peak"]
    assert merged["host_peak"] == max(merged["host_load"], merged["host_base"] + merged["host_kv_cache"] + merged["host_save"])


def test_adapters_saved_by_peft_itself_load_on_their_base(tmp_path, ckpt, start_lm):
    """Adapters from elsewhere (PeftModel.save_pretrained: no tokenizer, no muarl config) load through
    models.load_model, eval.py's loader, with their base's tokenizer, and compute base + adapters."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(3)
    theirs = get_peft_model(AutoModelForCausalLM.from_pretrained(ckpt),
                            LoraConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    theirs.save_pretrained(tmp_path / "adapters")
    assert not (tmp_path / "adapters" / "tokenizer.json").exists()
    model, tok = models.load_model(str(tmp_path / "adapters"), device="cpu", dtype=torch.float32)
    assert len(tok) == len(models.load_tokenizer(str(ckpt)))
    ids = torch.randint(0, len(tok), (2, 20), generator=torch.Generator().manual_seed(0))
    attn = torch.ones_like(ids)
    with torch.no_grad():
        assert torch.equal(token_logprobs(model, ids, attn), token_logprobs(theirs.eval(), ids, attn))
        assert not torch.equal(token_logprobs(model, ids, attn), token_logprobs(start_lm, ids, attn))


def test_full_training_from_an_adapter_checkpoint_keeps_its_adapters_in_the_reference(lora_run, tmp_path, capsys):
    """--lora-rank 0 --init-from an adapter checkpoint: the policy and the reference are both the checkpoint merged
    (a reference with the cold start's adapters switched off would pull the policy back to the base): kl is 0 at step
    1, and what merging changed is measured and said."""
    args = lora_args(lora_run.ckpt, tmp_path / "run", "--steps", "1")
    del args[args.index("--lora-rank"):args.index("--lora-rank") + 2]
    res = grpo.main(args)
    assert not lora.is_adapted(res.model)
    assert metrics(tmp_path / "run")[0]["kl"] < 1e-9
    assert "its adapters merged into the base (float32); the start's log-probs" in capsys.readouterr().out


def test_adapters_are_never_written_over_their_base(lora_run, tmp_path, ckpt):
    """sft.py --out the very model the adapters train on, or grpo.py --overwrite of the run directory that holds the
    start: refused at start (the adapters' checkpoints would name a base that is gone); a chain of bases that loops
    is refused when loading, naming it."""
    with pytest.raises(SystemExit, match="the base the adapters are trained on"):
        sft.main(["--model", str(lora_run.ckpt), "--out", str(lora_run.ckpt), "--overwrite", "--lora-rank", "2",
                  "--data", str(tmp_path / "none.jsonl")])
    assert (lora_run.ckpt / "adapter_model.safetensors").exists()
    with pytest.raises(SystemExit, match="grpo.py: --overwrite: .* the base the adapters are trained on"):
        grpo.main(lora_args(lora_run.ckpt, lora_run.out, "--overwrite"))
    assert (lora_run.ckpt / "adapter_model.safetensors").exists()
    loop = tmp_path / "loop"
    loop.mkdir()
    config = json.loads((lora_run.ckpt / "adapter_config.json").read_text())
    (loop / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": str(loop)}))
    with pytest.raises(SystemExit, match="in its own chain of bases"):
        models.load_model(str(loop), device="cpu")


def test_bf16_adapters_take_their_input_from_autocast(tiny_lm):
    """With --bf16 the base is bf16, the adapters fp32, and every forward runs under autocast, which casts the
    adapters' inputs: peft's own cast to fp32 (a copy of each adapted layer's input) is off, and the adapters still
    get fp32 gradients, equal to those with peft's cast (up to bf16 rounding)."""
    ids = torch.randint(0, tiny_lm.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))

    def grads(autocast):
        torch.manual_seed(0)
        model = lora.add_adapters(copy_of(tiny_lm).to(torch.bfloat16), rank=4, alpha=0, dropout=0.0,
                                  targets=lora.DEFAULT_TARGETS, base="x", autocast=autocast)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if ".lora_B." in name:
                    p.fill_(0.01)
        flags = {m.cast_input_dtype_enabled for m in model.modules() if hasattr(m, "cast_input_dtype_enabled")}
        with torch.autocast("cpu", dtype=torch.bfloat16):
            token_logprobs(model, ids, torch.ones_like(ids)).sum().backward()
        return flags, {n: p.grad for n, p in model.named_parameters() if p.requires_grad}

    off_flags, off = grads(True)
    on_flags, on = grads(False)
    assert off_flags == {False} and on_flags == {True}
    for name, g in off.items():
        assert g.dtype == torch.float32 and g.abs().sum() > 0, name
        assert torch.allclose(g, on[name], rtol=0.05, atol=1e-3), name


def copy_of(model):
    import copy

    return copy.deepcopy(model)


def test_lora_under_two_processes_saves_what_one_process_resumes(tmp_path, ckpt):
    """GRPO with adapters under torchrun (DDP over gloo, two CPU processes): both end with the same weights, and
    the checkpoint, saved under DDP, resumes on one process (Accelerate's state holds the adapters by their
    unwrapped names)."""
    from test_train import _torchrun

    out = tmp_path / "run"
    r = _torchrun(tmp_path, lora_args(ckpt, out), port=29533)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (out / "weights-0.sha").read_text() == (out / "weights-1.sha").read_text()
    assert [row["episodes"] for row in metrics(out)] == [8, 8]
    resumed = grpo.main(["--resume", str(out), "--env", FAKE_ENV, "--steps", "3"])
    assert lora.is_adapted(resumed.model) and [row["step"] for row in metrics(out)] == [1, 2, 3]


def test_broken_adapter_files_are_named(lora_run, tmp_path):
    """Adapter weights that are missing or cut short: one line naming the directory and the file, as a broken full
    checkpoint gets, never a library traceback about hub repository ids."""
    import shutil

    for name, damage in (("missing", lambda p: p.unlink()), ("cut", lambda p: p.write_bytes(p.read_bytes()[:40]))):
        broken = tmp_path / name
        shutil.copytree(lora_run.ckpt, broken)
        damage(broken / "adapter_model.safetensors")
        with pytest.raises(SystemExit) as e:
            evaluation.main(["--agent", str(broken), "--env", "tests.fake_env:FakeEnv", "--num-tasks", "1"])
        msg = str(e.value)
        assert msg.startswith(f"eval.py: --agent: {broken}") and "adapter" in msg and "Repo id" not in msg, msg


def test_resume_of_a_run_whose_start_moved_says_where_it_is_named(ckpt, tmp_path):
    """The start of a LoRA run is the base of its checkpoints: resumed after the start moved, the error says the path
    comes from the run's saved settings and which file holds it."""
    import shutil

    start = tmp_path / "start"
    shutil.copytree(ckpt, start)
    grpo.main(lora_args(start, tmp_path / "run", "--steps", "1"))
    start.rename(tmp_path / "moved")
    with pytest.raises(SystemExit) as e:
        grpo.main(["--resume", str(tmp_path / "run"), "--env", FAKE_ENV, "--steps", "2"])
    msg = str(e.value)
    assert msg.startswith("grpo.py: --resume: the run's start (--init-from in its saved settings, ")
    assert "muarl_config.json; if it moved, put it back or edit that entry)" in msg and str(start) in msg


def test_eval_of_chained_adapters_estimates_memory_from_the_root_model(lora_run, tmp_path, capsys):
    """Adapters on adapters (GRPO's on a LoRA cold start): eval.py reads the root model's config for its memory
    estimate, as for adapters on a full model."""
    grpo.main(lora_args(lora_run.ckpt, tmp_path / "run", "--steps", "1"))
    capsys.readouterr()
    evaluation.main(["--agent", str(tmp_path / "run" / "checkpoints" / "step-000001" / "model"), "--env",
                     "tests.fake_env:FakeEnv", "--num-tasks", "1", "--max-new-tokens", "8", "--out-dir",
                     str(tmp_path / "ev")])
    assert "[eval] estimated memory per GPU" in capsys.readouterr().out


def test_merged_decoding_plays_the_adapted_policy_without_its_adapters_and_restores_the_base_bit_for_bit(lm, tiny_tok):
    """--lora-decode merged (lora.merged_for_decoding, grpo.py's default with adapters): the rollout runs the base's
    layers only, with the adapters folded in, and plays the same greedy episodes with the same log-probs as peft's
    unmerged layers (fp32); afterwards every base weight is the one it was, bit for bit, also in bf16, where taking
    the adapters back out (W + BA - BA) would not give it."""
    import copy

    from test_rollout import FakeEnv

    model = lora.add_adapters(copy.deepcopy(lm), rank=4, alpha=8, dropout=0.0, targets=lora.DEFAULT_TARGETS,
                              base="tiny").eval()
    with torch.no_grad():  # adapters that move the policy (peft starts B at 0)
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.3)
    calls = []
    for m in lora.lora_layers(model):
        m.lora_A["default"].register_forward_hook(lambda *a: calls.append(1))
    base = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    env, cfg = FakeEnv(n_tasks=3), RolloutConfig(greedy=True, max_new_tokens=24, max_turns=4, max_context=800)
    unmerged = rollout(model, tiny_tok, env, env.tasks(), 2, make_user_sim("scripted"), cfg)
    assert calls, "the unmerged rollout runs the adapters"
    calls.clear()
    with lora.merged_for_decoding(model) as policy:
        merged = rollout(policy, tiny_tok, env, env.tasks(), 2, make_user_sim("scripted"), cfg)
    assert not calls, "the merged rollout ran an adapter layer"
    with lora.merged_for_decoding(lm) as plain:  # the adapters change the episodes: the test can tell
        assert plain is lm
        none = rollout(lm, tiny_tok, env, env.tasks(), 2, make_user_sim("scripted"), cfg)
    assert [e.input_ids for e in none] != [e.input_ids for e in unmerged]
    assert [e.input_ids for e in merged] == [e.input_ids for e in unmerged]
    for a, b in zip(merged, unmerged):
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5)
    assert all(torch.equal(p, base[n]) for n, p in model.named_parameters() if not p.requires_grad)
    held = sum(m.base_layer.weight.numel() for m in lora.lora_layers(model))  # what the host copy holds
    assert held == lora.adapted_base_params(model) == lora.adapted_base_params(lm) > 0

    model.get_base_model().to(torch.bfloat16)  # a bf16 base (the GPU recipe), adapters kept in fp32
    for m in lora.lora_layers(model):
        m.muarl_base_copy = None
        m.lora_A.float(), m.lora_B.float()
    before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    layer = lora.lora_layers(model)[0]
    w, delta = layer.base_layer.weight, layer.get_delta_weight("default")
    assert not torch.equal(((w.float() + delta).bfloat16().float() - delta).bfloat16(), w)  # subtracting drifts
    folded = (w.float() + delta).bfloat16()  # B A and the sum in float32, rounded once
    for _ in range(2):  # under autocast, as grpo.py's rollout runs: the fold stays in float32
        with torch.autocast("cpu", dtype=torch.bfloat16), lora.merged_for_decoding(model), torch.no_grad():
            assert torch.equal(layer.base_layer.weight, folded)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters() if not p.requires_grad)


def test_a_run_saved_before_lora_decode_existed_resumes_as_it_ran(tmp_path):
    """--lora-decode came after runs were saved: such a run resumes decoding unmerged, as it did, unless the resume
    asks otherwise (it may: how decoding is done is not the algorithm)."""
    from plumbing import rundir

    (tmp_path / "config.json").write_text(json.dumps({"lora_rank": 4}))
    cfg = grpo.Config(lora_decode="merged")
    settings, changes = rundir.resume_settings(tmp_path, cfg, set(), rundir.RESUMABLE)
    assert settings["lora_decode"] == "unmerged" and not changes
    settings, changes = rundir.resume_settings(tmp_path, cfg, {"lora_decode"}, rundir.RESUMABLE)
    assert settings["lora_decode"] == "merged" and changes == {"lora_decode": ["unmerged", "merged"]}


def test_adapters_on_a_base_trained_again_in_place_are_refused(ckpt, tmp_path):
    """A LoRA checkpoint records its base's weights (lora.fingerprint, muarl_config.json's lora_base): once the base
    is trained again or replaced where it was, the adapters are refused wherever they load (eval.py, --resume,
    --init-from), in one line, rather than applied to weights they were never trained with."""
    import re
    import shutil

    from transformers import AutoModelForCausalLM

    start = tmp_path / "start"
    shutil.copytree(ckpt, start)
    grpo.main(lora_args(start, tmp_path / "run", "--steps", "1"))
    adapters = tmp_path / "run" / "checkpoints" / "step-000001" / "model"
    recorded = json.loads((adapters / "muarl_config.json").read_text())["lora_base"]
    assert recorded == {"path": str(start.resolve()), "fingerprint": lora.fingerprint(start)}
    models.load_model(str(adapters), device="cpu")  # the base as it was: it loads
    other = AutoModelForCausalLM.from_pretrained(start)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.01)
    other.save_pretrained(start)  # trained again, in place
    assert lora.fingerprint(start) != recorded["fingerprint"]
    with pytest.raises(SystemExit, match=rf"^{re.escape(str(adapters))}: the base these adapters were trained on, "
                       rf".*start, holds other weights now \(fingerprint \w+; {recorded['fingerprint']} when "):
        models.load_model(str(adapters), device="cpu")
    with pytest.raises(SystemExit, match=r"^grpo.py: --resume .*step-000001: the base these adapters were trained on"):
        grpo.main(["--resume", str(tmp_path / "run"), "--env", FAKE_ENV, "--steps", "2"])
    with pytest.raises(SystemExit, match="holds other weights now"):  # --init-from the adapters
        grpo.main(lora_args(adapters, tmp_path / "run2", "--steps", "1"))
