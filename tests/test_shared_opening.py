"""logprobs.shared_opening_logprobs: a GRPO group's opening computed once, its keys and values shared by every row's
remainder, against token_logprobs on the whole rows: the same log-probs and the same gradients, the opening's layers
trained through its keys and values alone."""
import copy

import pytest
import torch

import models
from conftest import TEST_CORPUS
from logprobs import shared_opening_logprobs, token_logprobs


@pytest.mark.versions
@pytest.mark.parametrize("arch, checkpointing, rows", [("llama", False, 3), ("qwen3", False, 8), ("llama", True, 3),
                                                       ("qwen3", True, 1)])
def test_the_opening_once_gives_the_log_probs_and_gradients_of_every_row_whole(arch, checkpointing, rows):
    tok = models.tiny_tokenizer(TEST_CORPUS, vocab_size=512, split_digits=False)
    torch.manual_seed(0)
    cfg = models.tiny_config(len(tok), arch=arch, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    whole = __import__("transformers").AutoModelForCausalLM.from_config(cfg).train()
    if checkpointing:  # transformers drops a cache under checkpointing unless the layer may keep it
        whole.gradient_checkpointing_enable()
    shared = copy.deepcopy(whole)
    g = torch.Generator().manual_seed(1)
    O, T = 11, 25
    opening = torch.randint(0, len(tok), (O,), generator=g)
    ids = torch.cat([opening.expand(rows, O), torch.randint(0, len(tok), (rows, T - O), generator=g)], 1)
    attn = torch.ones(rows, T, dtype=torch.long)
    attn[1:, 15 + torch.arange(rows - 1) % 9] = 0  # right padding of several lengths
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


def test_a_grpo_step_sharing_each_groups_opening_equals_one_without(monkeypatch):
    """grpo.train_on_episodes with --share-opening (micro-batches of one group, its opening computed once) and
    without: the same weights after the step, the same loss, KL and metrics; a group whose episodes begin
    differently falls back to whole rows."""
    import muarl
    from test_grpo import _one_step

    g = torch.Generator().manual_seed(3)
    eps = []
    for task, rewards in enumerate(([1, 0, 1, 0], [0, 1, 1, 1], [1, 0, 0, 0])):
        opening = torch.randint(1, 500, (9,), generator=g).tolist()
        for k, r in enumerate(rewards):
            n = int(torch.randint(4, 12, (1,), generator=g))
            ids = opening + torch.randint(1, 500, (n,), generator=g).tolist()
            if task == 2 and k == 1:
                ids[3] += 1  # this group's openings differ: it falls back
            mask = [0] * 9 + [int(x) for x in (torch.rand(n, generator=g) < 0.8)]
            eps.append(muarl.Episode(task_id=f"t{task}", sample=k, input_ids=ids, loss_mask=mask,
                                     logprobs=[-1.0 * m for m in mask], reward=float(r)))
    seen = []
    import grpo
    real = grpo.shared_opening_logprobs
    monkeypatch.setattr(grpo, "shared_opening_logprobs", lambda *a, **k: seen.append(a[3]) or real(*a, **k))
    whole, m2, start = _one_step(eps, share_opening=False, micro_batch_size=3, kl_coef=0.1)
    for size, openings in ((4, {9, 3}), (3, {9})):  # a group in one micro-batch; split over two (3 + 1 episodes)
        seen.clear()
        shared, m1, _ = _one_step(eps, share_opening=True, micro_batch_size=size, kl_coef=0.1)
        # 9 shared tokens; 3 in the group where one episode differs at token 3; a lone episode is scored whole
        assert set(seen) == openings, (size, seen)
        for (name, a), b, s in zip(shared.named_parameters(), whole.parameters(), start.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=name)
            assert not torch.equal(a, s), name
        for k in m2:
            assert m1[k] == pytest.approx(m2[k], rel=1e-4, abs=1e-6), (size, k)
