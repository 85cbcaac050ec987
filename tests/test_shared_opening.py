"""opening.shared_opening_logprobs: a GRPO group's opening computed once, its keys and values shared by every row's
remainder, against token_logprobs on the whole rows: the same log-probs and the same gradients, the opening's layers
trained through its keys and values alone."""
import copy

import pytest
import torch

from plumbing import models
from conftest import TEST_CORPUS
from fast.logprobs import token_logprobs
from fast.opening import Opening, shared_opening_logprobs


@pytest.mark.versions
@pytest.mark.parametrize("arch, checkpointing, rows, O", [("llama", False, 3, 11), ("qwen3", False, 8, 11),
                                                          ("llama", True, 3, 11), ("qwen3", True, 1, 11),
                                                          ("qwen3", False, 3, 18)])
def test_the_opening_once_gives_the_log_probs_and_gradients_of_every_row_whole(arch, checkpointing, rows, O,
                                                                                monkeypatch):
    """An opening shorter than the remainders (11 of 25) goes through opening.remainder_attention (one causal SDPA
    call, queries padded in front), a longer one (18) through the mask transformers builds, as do layers replayed
    under activation checkpointing."""
    from transformers import AttentionInterface

    from fast.opening import REMAINDER, remainder_attention

    calls = []
    monkeypatch.setitem(AttentionInterface._global_mapping, REMAINDER,
                        lambda *a, **k: calls.append(1) or remainder_attention(*a, **k))
    tok = models.tiny_tokenizer(TEST_CORPUS, vocab_size=512, split_digits=False)
    torch.manual_seed(0)
    cfg = models.tiny_config(len(tok), arch=arch, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    whole = __import__("transformers").AutoModelForCausalLM.from_config(cfg).train()
    if checkpointing:  # transformers drops a cache under checkpointing unless the layer may keep it
        whole.gradient_checkpointing_enable()
    shared = copy.deepcopy(whole)
    g = torch.Generator().manual_seed(1)
    T = 25
    opening = torch.randint(0, len(tok), (O,), generator=g)
    ids = torch.cat([opening.expand(rows, O), torch.randint(0, len(tok), (rows, T - O), generator=g)], 1)
    attn = torch.ones(rows, T, dtype=torch.long)
    attn[1:, O + 4 + torch.arange(rows - 1) % (T - O - 4)] = 0  # right padding of several lengths
    attn = attn.cummin(1).values
    mask = attn.clone()
    mask[:, :O] = 0  # the opening is never trained
    weights = torch.randn(rows, T, generator=g)
    a = token_logprobs(whole, ids, attn, temperature=0.7)
    (a * mask * weights).sum().backward()
    b = shared_opening_logprobs(shared, ids, attn, O, temperature=0.7)
    (b * mask * weights).sum().backward()
    assert ((a - b) * mask).abs().max() < 1e-5
    assert (b[:, :O] == 0).all()
    for (name, p), q in zip(whole.named_parameters(), shared.parameters()):
        assert p.grad is not None and q.grad is not None, name
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5, msg=name)
    first = whole.model.layers[0].self_attn.k_proj.weight.grad
    assert first.abs().max() > 0  # the first layer's keys are trained, through the remainders' attention
    # (not under checkpointing: a layer's replay in the backward runs the model's own sdpa, and must save alike)
    assert len(calls) == (cfg.num_hidden_layers if O - 1 < T - O + 1 and not checkpointing else 0)


def test_a_sliding_window_keeps_the_remainders_on_the_models_own_mask():
    """A model whose layers attend through a sliding window (here 6 positions) is shared through transformers' mask,
    which carries the window: its log-probs equal the whole rows' (the fused causal call would see past it)."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    model = MistralForCausalLM(MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, sliding_window=6,
                                             attn_implementation="sdpa")).eval()
    ids = torch.cat([torch.randint(0, 64, (1, 8)).expand(2, 8), torch.randint(0, 64, (2, 22))], 1)
    attn = torch.ones(2, 30, dtype=torch.long)
    attn[1, 25:] = 0
    with torch.no_grad():
        whole, shared = token_logprobs(model, ids, attn), shared_opening_logprobs(model, ids, attn, 8)
    assert ((whole - shared)[:, 8:] * attn[:, 8:]).abs().max() < 1e-5


def test_what_sharing_cannot_do_is_refused_by_name():
    """Reentrant checkpointing runs each layer under no_grad (the opening's keys and values would get no gradient);
    dropout draws other masks in the split group's recomputed opening; softcapped logits are not lm_head(hidden)."""
    torch.manual_seed(0)
    cfg = models.tiny_config(300, arch="qwen3", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    model = __import__("transformers").AutoModelForCausalLM.from_config(cfg).train()
    model.gradient_checkpointing_enable({"use_reentrant": True})
    ids = torch.randint(0, 300, (2, 12))
    flags = [m.__dict__.get("_can_checkpoint_with_cache") for m in model.modules()]
    with pytest.raises(ValueError, match="use_reentrant=True.*--no-share-opening"):
        shared_opening_logprobs(model, ids, torch.ones_like(ids), 6)
    assert [m.__dict__.get("_can_checkpoint_with_cache") for m in model.modules()] == flags  # left as they were
    with torch.no_grad():  # nothing to train: scored as well
        assert shared_opening_logprobs(model, ids, torch.ones_like(ids), 6).shape == (2, 12)

    model.gradient_checkpointing_disable()
    model.config.attention_dropout = 0.1  # a split group's recomputed opening would draw other dropout masks
    with pytest.raises(ValueError, match="dropout.*--no-share-opening"):
        shared_opening_logprobs(model, ids, torch.ones_like(ids), 6)
    model.config.attention_dropout = 0.0
    model.config.final_logit_softcapping = 30.0  # logits that are not lm_head(hidden), as token_logprobs refuses
    with pytest.raises(NotImplementedError, match="final_logit_softcapping=30.0"):
        shared_opening_logprobs(model, ids, torch.ones_like(ids), 6)


def _groups(g):
    """Four GRPO groups of 4 episodes with 9-token openings: two alike, one where an episode differs at token 3 (3
    shared), one where an episode differs at token 0 (nothing shared: it falls back)."""
    import muarl

    eps = []
    for task, rewards in enumerate(([1, 0, 1, 0], [0, 1, 1, 1], [1, 0, 0, 0], [0, 0, 1, 0])):
        opening = torch.randint(1, 500, (9,), generator=g).tolist()
        for k, r in enumerate(rewards):
            n = int(torch.randint(4, 12, (1,), generator=g))
            ids = opening + torch.randint(1, 500, (n,), generator=g).tolist()
            if k == 1 and task in (2, 3):
                ids[(3, 0)[task - 2]] += 1
            mask = [0] * 9 + [int(x) for x in (torch.rand(n, generator=g) < 0.8)]
            eps.append(muarl.Episode(task_id=f"t{task}", sample=k, input_ids=ids, loss_mask=mask,
                                     logprobs=[-1.0 * m for m in mask], reward=float(r)))
    return eps


def test_a_grpo_step_sharing_each_groups_opening_equals_one_without(monkeypatch):
    """grpo.train_on_episodes with --share-opening and without: the same weights after the step, the same loss, KL
    and metrics, whether a group is one micro-batch or split over two or four (its opening computed once for all of
    them: the reference's and the old policy's once, the policy's twice an update); a group whose episodes begin
    differently shares what they have in common; one that shares nothing falls back, and is counted."""
    from fast import opening
    from test_grpo import _one_step

    eps = _groups(torch.Generator().manual_seed(3))
    made = []
    Recording, Shared = opening._opening_layers()

    class Counted(Recording):
        def __init__(self):
            super().__init__()
            made.append(1)
    monkeypatch.setattr(opening, "_opening_layers", lambda: (Counted, Shared))
    options = dict(kl_coef=0.1, updates_per_batch=2, clip_low=0.1, clip_high=0.1)
    whole, m2, start = _one_step(eps, share_opening=False, micro_batch_size=3, **options)
    assert not made and m2["unshared_groups"] == 0
    for size in (4, 3, 1):  # a group in one micro-batch; split in two (3 + 1 episodes); in four
        made.clear()
        shared, m1, _ = _one_step(eps, share_opening=True, micro_batch_size=size, **options)
        per_update = 1 if size == 4 else 2
        # three groups share an opening (9, 9 and 3 tokens): reference, old policy, two updates; 2 layers each
        assert len(made) == 3 * (1 + 1 + 2 * per_update) * 2, (size, len(made))
        assert m1.pop("unshared_groups") == 1
        for (name, a), b, s in zip(shared.named_parameters(), whole.parameters(), start.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=name)
            assert not torch.equal(a, s), name
        for k in m2:
            if k != "unshared_groups":
                assert m1[k] == pytest.approx(m2[k], rel=1e-4, abs=1e-6), (size, k)


def test_lora_adapters_trained_through_a_shared_opening_equal_those_trained_whole():
    """--lora-rank: the policy's adapters after one step, and the KL to the reference (the policy, adapters off,
    through the same shared opening), with each group's opening computed once (one micro-batch a group; split in
    two) equal those without."""
    from plumbing import cli
    import lora_ddp_worker

    acc = cli.make_accelerator()
    whole = lora_ddp_worker.one_step(acc, share_opening=False)
    for size in (2, 1):
        shared = lora_ddp_worker.one_step(acc, micro_batch_size=size)
        assert shared["unshared_groups"] == 0 and shared["kl"] == pytest.approx(whole["kl"], rel=1e-5)
        for name, after in whole["after"].items():
            a, b, start = (torch.tensor(x) for x in (after, shared["after"][name], whole["before"][name]))
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=name)
            assert not torch.equal(a, start), name


def test_under_bf16_autocast_sharing_is_as_close_to_float32_as_the_whole_rows_are():
    """bf16 rounds differently along the two paths: measured against float32, the shared opening's log-probs and
    gradients are as close as the whole rows' (within twice their error)."""
    tok_n, rows, O, T = 400, 6, 13, 31
    torch.manual_seed(0)
    cfg = models.tiny_config(tok_n, arch="qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    exact = __import__("transformers").AutoModelForCausalLM.from_config(cfg).train()
    g = torch.Generator().manual_seed(2)
    ids = torch.cat([torch.randint(0, tok_n, (O,), generator=g).expand(rows, O),
                     torch.randint(0, tok_n, (rows, T - O), generator=g)], 1)
    attn = torch.ones_like(ids)
    attn[::2, 25:] = 0  # right padding
    mask = attn.clone()
    mask[:, :O] = 0
    weights = torch.randn(rows, T, generator=g)

    def run(how, bf16):
        model, carry, lps = copy.deepcopy(exact), Opening(), []
        for k, rows_ in enumerate(((slice(0, rows),) if how != "split" else (slice(0, 2), slice(2, 3), slice(3, 6)))):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                if how == "whole":
                    lp = token_logprobs(model, ids[rows_], attn[rows_], temperature=0.9)
                else:
                    lp = shared_opening_logprobs(model, ids[rows_], attn[rows_], O, temperature=0.9, carry=carry,
                                                 last=how != "split" or k == 2)
            (lp * mask[rows_] * weights[rows_]).sum().backward()
            lps.append(lp.detach())
        return torch.cat(lps) * mask, torch.cat([p.grad.flatten() for p in model.parameters()])

    lp32, g32 = run("whole", False)
    lp_whole, g_whole = run("whole", True)
    lp_split32, g_split32 = run("split", False)  # float32: the same as whole, the opening's gradient carried
    torch.testing.assert_close(lp_split32, lp32, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(g_split32, g32, rtol=1e-4, atol=1e-6)
    for how in ("one", "split"):  # the group in one micro-batch; split in three (its opening's gradient carried)
        lp_shared, g_shared = run(how, True)
        assert lp_shared.dtype == torch.float32
        err_whole, err_shared = (lp_whole - lp32).abs().max(), (lp_shared - lp32).abs().max()
        assert 0 < err_whole < 0.1 and err_shared <= 2 * err_whole, (how, err_whole, err_shared)
        gerr_whole, gerr_shared = ((g - g32).norm() / g32.norm() for g in (g_whole, g_shared))
        assert 0 < gerr_whole < 0.1 and gerr_shared <= 2 * gerr_whole, (how, gerr_whole, gerr_shared)


@pytest.mark.parametrize("options", [dict(drop_uniform_groups=True), dict(ratio_level="sequence",
                                     agg="seq-mean-token-mean"), dict(agg="seq-mean-token-sum-norm"),
                                     dict(policy_loss="cispo", updates_per_batch=2)])
def test_what_the_step_supports_trains_alike_through_a_shared_opening(options):
    """--drop-uniform-groups, GSPO's sequence ratio, each aggregation, CISPO: the same weights and metrics with each
    group's opening computed once (split over two micro-batches) as without."""
    from test_grpo import _one_step

    eps = _groups(torch.Generator().manual_seed(5))
    for e in eps[4:8]:  # a uniform group, for --drop-uniform-groups to drop
        e.reward = 1.0
    whole, m2, start = _one_step(eps, share_opening=False, micro_batch_size=3, kl_coef=0.1, **options)
    shared, m1, _ = _one_step(eps, share_opening=True, micro_batch_size=3, kl_coef=0.1, **options)
    for (name, a), b, s in zip(shared.named_parameters(), whole.parameters(), start.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=name)
        assert not torch.equal(a, s), name
    assert m1.pop("unshared_groups") == 1 and m2.pop("unshared_groups") == 0
    assert set(m1) == set(m2) and all(m1[k] == pytest.approx(m2[k], rel=1e-4, abs=1e-6) for k in m2), (m1, m2)
    assert m1["dropped_groups"] == (1 if options.get("drop_uniform_groups") else 0)
