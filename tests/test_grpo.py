"""The GRPO math (loss.py, imported here through grpo.py as users do) against plain Python loops and finite differences."""

import math

import os

import pytest
import torch
import torch.nn.functional as F

from fast.logprobs import entropy_of_logits, logprobs_from_hidden, masked_token_entropy, token_logprobs
from loss import AGGS, CORRECTIONS, CREDIT, group_advantages, grpo_loss, kl_k3

# ---- plain-Python references: slow, obvious, one scalar at a time ----


def loop_advantages(rewards, group_size, scale=True, eps=1e-6, valid=None):
    valid = valid or [True] * len(rewards)
    out = []
    for g in range(0, len(rewards), group_size):
        rs = [r for r, v in zip(rewards[g:g + group_size], valid[g:g + group_size]) if v]
        mean = sum(rs) / len(rs) if rs else 0.0
        std = math.sqrt(sum((r - mean) ** 2 for r in rs) / (len(rs) - 1)) if len(rs) > 1 else 0.0
        for r, v in zip(rewards[g:g + group_size], valid[g:g + group_size]):
            if not v or len(rs) < 2 or max(rs) == min(rs):
                out.append(0.0)
            else:
                out.append((r - mean) / (std + eps) if scale else r - mean)
    return out


def loop_k3(lp, ref):
    x = ref - lp
    return math.exp(x) - x - 1


def loop_loss(logp, old, ref, adv, mask, clip_low=0.2, clip_high=0.2, dual_clip=3.0, kl_coef=0.001,
              agg="token-mean", max_len=None, weights=None):
    """adv: one per episode, or a list per episode (one per token); weights: one per token, on the policy term."""
    per_seq, n_tok, n_seq, total = [], 0, 0, 0.0
    for b in range(len(logp)):
        s, n = 0.0, 0
        for t in range(len(logp[b])):
            if not mask[b][t]:
                continue
            r, a = math.exp(logp[b][t] - old[b][t]), adv[b][t] if isinstance(adv[b], list) else adv[b]
            pg = max(-a * r, -a * min(max(r, 1 - clip_low), 1 + clip_high))
            if dual_clip is not None and a < 0:
                pg = min(pg, -a * dual_clip)
            if weights is not None:
                pg *= weights[b][t]
            if ref is not None:
                pg += kl_coef * loop_k3(logp[b][t], ref[b][t])
            s, n = s + pg, n + 1
        n_tok += n
        total += s
        if n:
            n_seq += 1
            per_seq.append(s / n if agg == "seq-mean-token-mean" else s / (max_len or 1))
    if agg == "token-mean":
        return total / max(n_tok, 1)
    return sum(per_seq) / max(n_seq, 1)


def random_batch(B=6, T=9, dtype=torch.float64, seed=0, spread=0.4):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=dtype) * 3
    logp = old + (torch.rand(B, T, generator=g, dtype=dtype) - 0.5) * 2 * spread
    ref = old + (torch.rand(B, T, generator=g, dtype=dtype) - 0.5)
    adv = torch.randn(B, generator=g, dtype=dtype)
    mask = torch.rand(B, T, generator=g) < 0.7
    mask[0] = False                     # an empty row
    mask[1, -1] = True
    return logp, old, ref, adv, mask


def tiny_model(dtype=torch.float64, arch="qwen3", seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(seed)
    common = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  pad_token_id=0, eos_token_id=0)
    if arch == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=16, **common))
    else:
        model = LlamaForCausalLM(LlamaConfig(tie_word_embeddings=True, **common))
    return model.to(dtype).eval()


def naive_logprobs(model, ids, attn, temperature=1.0):
    pos = (attn.long().cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=attn, position_ids=pos).logits
    lp = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature, -1)
    out = lp[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    ent = -(lp.exp() * lp).sum(-1)[:, :-1]
    zeros = out.new_zeros(ids.shape[0], 1)
    return torch.cat([zeros, out], 1), torch.cat([zeros, ent], 1)


# ---- group_advantages ----


@pytest.mark.parametrize("scale", [True, False])
def test_group_advantages_matches_loop(scale):
    rewards = torch.tensor([1., 0., 0., 1., 0.5, 0.2, 0.9, 0.3, 1., 1., 1., 1.], dtype=torch.float64)
    got = group_advantages(rewards, 4, scale=scale)
    assert torch.allclose(got, torch.tensor(loop_advantages(rewards.tolist(), 4, scale), dtype=torch.float64))


def test_group_advantages_sample_std_and_binary_rewards():
    # one of 8 right: mean 1/8, sample std sqrt(1/8) -> (7/8)/sqrt(1/8)
    r = torch.tensor([1., 0, 0, 0, 0, 0, 0, 0])
    assert group_advantages(r, 8)[0].item() == pytest.approx((7 / 8) / math.sqrt(1 / 8), rel=1e-5)
    ints = group_advantages(torch.tensor([1, 0, 1, 0]), 2)      # integer rewards are accepted
    assert ints.dtype == torch.float32 and torch.allclose(ints, torch.tensor([0.7071, -0.7071, 0.7071, -0.7071]), atol=1e-3)


def test_group_advantages_all_equal_groups_are_exact_zeros():
    r = torch.tensor([0.1] * 8 + [1.0] * 8 + [0.0] * 8)
    for scale in (True, False):
        adv = group_advantages(r, 8, scale=scale)
        assert not torch.isnan(adv).any() and (adv == 0).all()


def test_group_advantages_bad_group_size():
    with pytest.raises(ValueError, match="groups of 3"):
        group_advantages(torch.zeros(8), 3)
    with pytest.raises(ValueError):
        group_advantages(torch.zeros(2, 4), 4)


def test_group_advantages_valid_mask():
    r = [1., 0., 0., 1., 0., 1., 1., 1., 0., 0., 1., 1.]
    valid = [True, True, False, True, True, True, True, False, False, False, False, True]
    got = group_advantages(torch.tensor(r, dtype=torch.float64), 4, valid=torch.tensor(valid))
    assert torch.allclose(got, torch.tensor(loop_advantages(r, 4, valid=valid), dtype=torch.float64))
    assert (got[[2, 7, 8, 9, 10]] == 0).all()          # invalid episodes: 0
    # 0, 1, 1 valid: mean 2/3, sample std sqrt(1/3)
    assert torch.allclose(got[4:8], torch.tensor([-1.1547, 0.5774, 0.5774, 0.], dtype=torch.float64), atol=1e-4)
    assert got[11] == 0                                  # a lone valid episode has no baseline
    # the failed episode's reward (0) does not drag the mean: same as the group without it
    assert torch.allclose(got[[0, 1, 3]], group_advantages(torch.tensor([1., 0., 1.], dtype=torch.float64), 3))


# ---- kl_k3 ----


def test_kl_k3_matches_loop_and_is_nonnegative():
    logp, _, ref, _, _ = random_batch()
    got = kl_k3(logp, ref)
    want = torch.tensor([[loop_k3(a, b) for a, b in zip(r1, r2)] for r1, r2 in zip(logp.tolist(), ref.tolist())],
                        dtype=torch.float64)
    assert torch.allclose(got, want)
    x = torch.tensor([-1e4, -50, -1e-3, -1e-8, 0, 1e-8, 1e-3, 50, 1e4, float("inf"), -float("inf")])
    out = kl_k3(torch.zeros_like(x), x)
    assert torch.isfinite(out).all() and (out >= 0).all()
    assert out[5].item() == pytest.approx(1e-16 / 2, rel=1e-3)     # expm1: no cancellation near 0


def test_kl_k3_gradcheck():
    logp, _, ref, _, _ = random_batch(B=3, T=4)
    assert torch.autograd.gradcheck(kl_k3, (logp.requires_grad_(), ref.requires_grad_()))


# ---- grpo_loss ----


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("dual_clip,kl_coef,ref_on", [(3.0, 0.001, True), (None, 0.0, True), (1.5, 0.1, False)])
def test_grpo_loss_matches_loop(agg, dual_clip, kl_coef, ref_on):
    logp, old, ref, adv, mask = random_batch(spread=1.5)          # wide spread: every clip region occurs
    ref = ref if ref_on else None
    loss, _ = grpo_loss(logp, old, ref, adv, mask, clip_low=0.2, clip_high=0.28, dual_clip=dual_clip,
                        kl_coef=kl_coef, agg=agg, max_len=16)
    want = loop_loss(logp.tolist(), old.tolist(), None if ref is None else ref.tolist(), adv.tolist(),
                     mask.tolist(), 0.2, 0.28, dual_clip, kl_coef if ref_on else 0.0, agg, 16)
    assert loss.item() == pytest.approx(want, rel=1e-10, abs=1e-12)


@pytest.mark.parametrize("agg", AGGS)
def test_grpo_loss_gradcheck(agg):
    logp, old, ref, adv, mask = random_batch(B=4, T=5, spread=1.5)
    # finite differences need smooth points: keep every ratio 1e-3 away from the clip boundaries
    ratio = (logp - old).exp()
    for edge in (0.8, 1.2, 3.0):
        near = (ratio - edge).abs() < 1e-3
        logp = torch.where(near, logp + 0.01, logp)
    logp.requires_grad_()
    f = lambda lp: grpo_loss(lp, old, ref, adv, mask, kl_coef=0.1, agg=agg, max_len=8)[0]
    assert torch.autograd.gradcheck(f, (logp,))


def test_grpo_loss_clip_regions_values_gradients_and_fractions():
    # one token per row; (advantage, ratio) -> (loss, is its gradient zero?)
    cases = [
        (+1.0, 1.1, -1.1, False),     # A>0 inside the trust region
        (+1.0, 1.5, -1.2, True),      # A>0, ratio > 1+eps: clipped high, no gradient
        (+1.0, 0.5, -0.5, False),     # A>0, ratio < 1-eps: unclipped (pessimistic branch)
        (-1.0, 0.9, 0.9, False),      # A<0 inside
        (-1.0, 0.5, 0.8, True),       # A<0, ratio < 1-eps: clipped low, no gradient
        (-1.0, 2.0, 2.0, False),      # A<0, 1+eps < ratio < dual_clip: unclipped
        (-1.0, 5.0, 3.0, True),       # A<0, ratio > dual_clip: dual-clipped, no gradient
        (0.0, 1.7, 0.0, True),        # A=0: no signal
    ]
    adv = torch.tensor([c[0] for c in cases], dtype=torch.float64)
    old = torch.full((len(cases), 1), -1.0, dtype=torch.float64)
    logp = (old + torch.tensor([[math.log(c[1])] for c in cases], dtype=torch.float64)).requires_grad_()
    mask = torch.ones(len(cases), 1, dtype=torch.bool)
    loss, m = grpo_loss(logp, old, None, adv, mask, agg="seq-mean-token-mean", normalizer=1)
    per_token = torch.autograd.grad(loss, logp)[0].squeeze(1)
    assert loss.item() == pytest.approx(sum(c[2] for c in cases))
    for (a, r, _, flat), g in zip(cases, per_token.tolist()):
        if flat:
            assert g == 0.0
        else:
            assert g == pytest.approx(-a * r)            # d(-A * ratio)/d logp = -A * ratio
    n = len(cases)
    assert m["clip_frac_high"].item() == pytest.approx(1 / n)
    assert m["clip_frac_low"].item() == pytest.approx(1 / n)
    assert m["dual_clip_frac"].item() == pytest.approx(1 / n)
    assert m["ratio_max"].item() == pytest.approx(5.0)
    assert m["ratio_mean"].item() == pytest.approx(sum(c[1] for c in cases) / n)
    assert m["n_tokens"].item() == n
    # without the dual clip, the A<0 ratio-5 token is unbounded and does get a gradient
    loss2, m2 = grpo_loss(logp, old, None, adv, mask, dual_clip=None, agg="seq-mean-token-mean", normalizer=1)
    assert torch.autograd.grad(loss2, logp)[0][6].item() == pytest.approx(5.0)
    assert loss2.item() == pytest.approx(loss.item() + 2.0) and m2["dual_clip_frac"].item() == 0


@pytest.mark.parametrize("agg", AGGS)
def test_grpo_loss_microbatches_equal_whole_batch(agg):
    logp, old, ref, adv, mask = random_batch(B=7, T=11, spread=1.0, seed=3)
    kw = dict(kl_coef=0.05, agg=agg, max_len=20)
    whole = logp.clone().requires_grad_()
    loss, _ = grpo_loss(whole, old, ref, adv, mask, **kw)
    loss.backward()

    if agg == "token-mean":
        normalizer = int(mask.sum())
    else:
        normalizer = int((mask.sum(1) > 0).sum())        # episodes with at least one loss token
    parts = logp.clone().requires_grad_()
    total = 0.0
    for rows in ([0, 1, 2], [3], [4, 5, 6]):
        # each micro-batch also trims its padding differently: the answer must not care
        width = int(mask[rows].nonzero()[:, 1].max()) + 1 if mask[rows].any() else 1
        sl = (rows, slice(0, width))
        l, _ = grpo_loss(parts[sl], old[sl], ref[sl], adv[rows], mask[sl], normalizer=normalizer, **kw)
        l.backward()
        total += l.item()
    assert total == pytest.approx(loss.item(), rel=1e-12)
    assert torch.allclose(parts.grad, whole.grad, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("agg", AGGS)
def test_grpo_loss_empty_mask(agg):
    logp, old, ref, adv, _ = random_batch()
    logp = logp.clone()
    logp[:, 3] = -float("inf")                 # garbage at masked positions must not leak NaN
    logp.requires_grad_()
    mask = torch.zeros_like(logp, dtype=torch.bool)
    for normalizer in (None, 0):
        loss, m = grpo_loss(logp, old, ref, adv, mask, agg=agg, max_len=10, normalizer=normalizer,
                            entropy=torch.rand(*logp.shape))
        (g,) = torch.autograd.grad(loss, logp)
        assert loss.item() == 0 and (g == 0).all()
        assert all(torch.isfinite(v) and v.item() == 0 for v in m.values()), m


def test_grpo_loss_empty_row_does_not_dilute_seq_mean():
    logp, old, ref, adv, mask = random_batch()
    assert not mask[0].any()
    for agg in AGGS[1:]:
        a, _ = grpo_loss(logp, old, ref, adv, mask, agg=agg, max_len=10)
        b, _ = grpo_loss(logp[1:], old[1:], ref[1:], adv[1:], mask[1:], agg=agg, max_len=10)
        assert a.item() == pytest.approx(b.item())


def test_grpo_loss_metrics_match_loop():
    logp, old, ref, adv, mask = random_batch(spread=1.5, seed=5)
    logits = torch.randn(*logp.shape, 13, dtype=torch.float64)
    _, m = grpo_loss(logp, old, ref, adv, mask, entropy=entropy_of_logits(logits.reshape(-1, 13)).view(logp.shape))
    pts = [(b, t) for b in range(mask.shape[0]) for t in range(mask.shape[1]) if mask[b, t]]
    L, O, R = logp.tolist(), old.tolist(), ref.tolist()
    ratio = [math.exp(L[b][t] - O[b][t]) for b, t in pts]
    kl = sum(loop_k3(L[b][t], R[b][t]) for b, t in pts) / len(pts)
    approx = sum(r - 1 - math.log(r) for r in ratio) / len(pts)
    low = sum(adv[b] < 0 and r < 0.8 for (b, _), r in zip(pts, ratio)) / len(pts)
    high = sum(adv[b] > 0 and r > 1.2 for (b, _), r in zip(pts, ratio)) / len(pts)
    dual = sum(adv[b] < 0 and r > 3.0 for (b, _), r in zip(pts, ratio)) / len(pts)
    ent = 0.0
    for b, t in pts:
        z = logits[b, t].tolist()
        zmax = max(z)
        ps = [math.exp(v - zmax) for v in z]
        s = sum(ps)
        ent -= sum(p / s * math.log(p / s) for p in ps)
    ent /= len(pts)
    assert m["n_tokens"].item() == len(pts)
    assert m["kl"].item() == pytest.approx(kl, rel=1e-5)
    assert m["approx_kl"].item() == pytest.approx(approx, rel=1e-5)
    assert m["clip_frac_low"].item() == pytest.approx(low) and low > 0
    assert m["clip_frac_high"].item() == pytest.approx(high) and high > 0
    assert m["dual_clip_frac"].item() == pytest.approx(dual)
    assert m["ratio_mean"].item() == pytest.approx(sum(ratio) / len(ratio), rel=1e-5)
    assert m["ratio_max"].item() == pytest.approx(max(ratio), rel=1e-5)
    assert m["entropy"].item() == pytest.approx(ent, rel=1e-5)
    assert all(v.dim() == 0 and not v.requires_grad for v in m.values())
    # chunking the entropy changes nothing
    assert masked_token_entropy(logits, mask, chunk_size=3).item() == pytest.approx(ent, rel=1e-5)


def test_grpo_loss_counts_end_of_turn_token_when_pad_equals_eos():
    """pad == eos: the agent's sampled end-of-turn token has the pad id, and must still be trained."""
    eos = pad = 0
    model = tiny_model()
    prompt, sampled = [5, 17, 42, 9], [33, 71, 8, eos]         # the agent's turn ends with eos == pad
    T = len(prompt) + len(sampled) + 3                        # right-padded with the same id
    ids = torch.full((2, T), pad)
    ids[0, :8] = torch.tensor(prompt + sampled)
    ids[1, :6] = torch.tensor([5, 17, 60, 61, 62, eos])
    attn = torch.zeros(2, T, dtype=torch.long)
    attn[0, :8], attn[1, :6] = 1, 1
    # the loss mask comes from the episode structure (which span the agent sampled), not token ids
    mask = torch.zeros(2, T, dtype=torch.bool)
    mask[0, 4:8], mask[1, 2:6] = True, True
    assert ids[0, 7] == pad and mask[0, 7]
    logp = token_logprobs(model, ids, attn, chunk_size=4)
    logp_train = logp.detach().clone().requires_grad_()
    loss, m = grpo_loss(logp_train, logp.detach(), None, torch.tensor([1.0, -1.0]), mask)
    (g,) = torch.autograd.grad(loss, logp_train)
    assert m["n_tokens"].item() == 8
    assert g[0, 7] != 0 and g[1, 5] != 0              # the eos/pad-id tokens the agent sampled: trained
    assert (g[~mask] == 0).all()                      # the padding after them (same id): not trained


# ---- token_logprobs / logprobs_from_hidden ----


def test_logprobs_from_hidden_matches_loop_and_gradcheck():
    g = torch.Generator().manual_seed(1)
    h = torch.randn(2, 5, 6, generator=g, dtype=torch.float64)
    w = torch.randn(11, 6, generator=g, dtype=torch.float64)
    b = torch.randn(11, generator=g, dtype=torch.float64)
    y = torch.randint(0, 11, (2, 5), generator=g)
    got, ent = logprobs_from_hidden(h, w, y, 0.7, chunk_size=3, bias=b, return_entropy=True)
    for i in range(2):
        for t in range(5):
            z = [(sum(h[i, t, k].item() * w[v, k].item() for k in range(6)) + b[v].item()) / 0.7 for v in range(11)]
            lse = math.log(sum(math.exp(x) for x in z))
            assert got[i, t].item() == pytest.approx(z[y[i, t]] - lse, rel=1e-9)
            assert ent[i, t].item() == pytest.approx(-sum(math.exp(x - lse) * (x - lse) for x in z), rel=1e-9)
    f = lambda hh, ww, bb: logprobs_from_hidden(hh, ww, y, 0.7, chunk_size=3, bias=bb)
    assert torch.autograd.gradcheck(f, (h.requires_grad_(), w.requires_grad_(), b.requires_grad_()))


@pytest.mark.parametrize("arch", ["qwen3", "llama-tied"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_matches_naive_log_softmax(arch, temperature):
    model = tiny_model(torch.float64, arch)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(1, 512, (3, 13), generator=g)
    attn = torch.ones_like(ids)
    attn[1, 9:] = 0          # right padding
    attn[2, :4] = 0          # left padding: default position ids restart at the first real token
    want, want_ent = naive_logprobs(model, ids, attn, temperature)
    got, ent = token_logprobs(model, ids, attn, temperature=temperature, chunk_size=5, return_entropy=True)
    assert got.shape == ids.shape and (got[:, 0] == 0).all()
    real = attn.bool()
    real[:, 0] = True
    real[2, 4] = False       # the first real token after left padding has no real predecessor
    assert torch.allclose(got[real], want[real], rtol=0, atol=1e-10)
    assert torch.allclose(ent[real], want_ent[real], rtol=0, atol=1e-10)
    # and the gradient through the whole model
    upstream = torch.randn(ids.shape, generator=g, dtype=torch.float64) * real
    (want * upstream).sum().backward()
    naive_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    (token_logprobs(model, ids, attn, temperature=temperature, chunk_size=5) * upstream).sum().backward()
    for n, p in model.named_parameters():
        assert torch.allclose(p.grad, naive_grads[n], rtol=1e-8, atol=1e-11), n


def test_token_logprobs_float32_and_chunk_size_invariance():
    model = tiny_model(torch.float32)
    ids = torch.randint(0, 512, (2, 17), generator=torch.Generator().manual_seed(4))
    attn = torch.ones_like(ids)
    want, _ = naive_logprobs(model, ids, attn)
    for chunk in (1, 7, 32, 1000):
        got = token_logprobs(model, ids, attn, chunk_size=chunk)
        assert got.dtype == torch.float32 and torch.allclose(got, want, atol=1e-5)


def test_logprobs_from_hidden_bf16_and_frozen_head():
    """bf16 weights: matmul in bf16, softmax in float32 (like the sampler), dW accumulated in float32."""
    g = torch.Generator().manual_seed(5)
    h = torch.randn(3, 10, 16, generator=g).bfloat16()
    w = (torch.randn(40, 16, generator=g) / 4).bfloat16()
    y = torch.randint(0, 40, (3, 10), generator=g)
    up = torch.randn(3, 10, generator=g)

    def naive(hh, ww):
        return torch.log_softmax((hh @ ww.T).float() / 0.9, -1).gather(-1, y[..., None]).squeeze(-1)

    h1, w1 = h.clone().requires_grad_(), w.clone().requires_grad_()
    want = naive(h1, w1)
    (want * up).sum().backward()
    h2, w2 = h.clone().requires_grad_(), w.clone().requires_grad_()
    got = logprobs_from_hidden(h2, w2, y, 0.9, chunk_size=7)
    (got * up).sum().backward()
    assert got.dtype == torch.float32 and torch.allclose(got, want, atol=1e-5)
    assert w2.grad.dtype == torch.bfloat16 and torch.allclose(w2.grad.float(), w1.grad.float(), rtol=2e-2, atol=2e-2)
    assert torch.allclose(h2.grad.float(), h1.grad.float(), rtol=2e-2, atol=2e-2)
    # a frozen output layer (e.g. LoRA): only the hidden states get a gradient
    h3 = h.clone().requires_grad_()
    (logprobs_from_hidden(h3, w, y, 0.9, chunk_size=7) * up).sum().backward()
    assert torch.equal(h3.grad, h2.grad)


def test_the_head_gradient_accumulates_block_by_block(monkeypatch):
    """accumulate_weight_grad goes over the vocabulary a block of rows at a time (its transient bounded by the block,
    not the vocabulary): with blocks that do not divide it, every row gets its product once, as one call over the
    whole matrix gives; by the cast and add (the CPU's default), by the one-GEMM path (emulated here, as the CPU has
    no out_dtype addmm: float32 products written into the block's rows), and when that path fails on a later block
    (the rest fall back, and the device is remembered as without it)."""
    from fast import logprobs

    g = torch.Generator().manual_seed(7)
    dz, h = torch.randn(5, 37, generator=g).bfloat16(), torch.randn(5, 6, generator=g).bfloat16()
    start = torch.randn(37, 6, generator=g)
    rounded = start + torch.mm(dz.t(), h).float()  # the product rounded to bf16, then added
    exact = start + dz.float().t() @ h.float()  # the one-GEMM path's: accumulated in float32
    assert not torch.allclose(rounded, exact, atol=1e-4)  # the two paths are told apart below
    real_addmm, calls = torch.addmm, []

    def addmm(inp, a, b, *, out_dtype=None, out=None, fail_after=None):
        calls.append(a.shape[0])
        if fail_after is not None and len(calls) > fail_after:
            raise RuntimeError("no such kernel")
        return out.copy_(real_addmm(inp, a.float(), b.float()))

    for fused, fail_after, want in ((False, None, rounded), (True, None, exact), (True, 2, None)):
        for block in (6, 48, 10**6):  # a row a block, 8 rows (the last block 5), everything in one
            calls.clear()
            monkeypatch.setitem(logprobs._FUSED, "cpu", fused)
            monkeypatch.setattr(torch, "addmm", lambda *a, **k: addmm(*a, **k, fail_after=fail_after))
            grad = start.clone()
            logprobs.accumulate_weight_grad(grad, dz, h, block=block)
            rows = max(1, block // 6)
            n = -(-37 // rows)
            if want is not None:
                assert torch.allclose(grad, want, atol=1e-6)
                assert calls == ([min(rows, 37 - s) for s in range(0, 37, rows)] if fused else [])
            else:  # blocks before the failure exact, the failing one and the rest rounded, none twice
                done = min(2, n) * rows
                assert torch.allclose(grad[:done], exact[:done], atol=1e-6)
                assert torch.allclose(grad[done:], rounded[done:], atol=1e-6)
                assert len(calls) == min(3, n)
            assert logprobs._FUSED["cpu"] is (fused and (fail_after is None or n <= 2))
    monkeypatch.setattr(torch, "addmm", real_addmm)
    grad = start.clone()  # float32 operands: one GEMM over everything, as before
    logprobs.accumulate_weight_grad(grad, dz.float(), h.float(), block=6)
    assert torch.allclose(grad.double(), start.double() + dz.double().t() @ h.double(), atol=1e-5)


def test_logprobs_from_hidden_follows_autocast():
    """fp32 master weights under autocast(bf16), as GRPO and SFT train with --bf16: the head's matmuls run in bf16 like
    a plain F.linear head (logits rounded to bf16), the log-softmax in float32, gradients come back float32 for the
    float32 weights; without autocast the float32 path is untouched. CPU autocast runs bf16 too."""
    g = torch.Generator().manual_seed(6)
    h = torch.randn(3, 10, 16, generator=g)
    w = torch.randn(40, 16, generator=g) / 4
    b = torch.randn(40, generator=g) / 4
    y = torch.randint(0, 40, (3, 10), generator=g)
    up = torch.randn(3, 10, generator=g)

    def run(fn, autocast):
        hh, ww, bb = h.clone().requires_grad_(), w.clone().requires_grad_(), b.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = fn(hh, ww, bb)
        (out * up).sum().backward()
        return out.detach(), hh.grad, ww.grad, bb.grad

    def naive(hh, ww, bb):  # what a model's own lm_head gives under autocast: bf16 logits, float32 softmax
        return torch.log_softmax(F.linear(hh, ww, bb).float() / 0.9, -1).gather(-1, y[..., None]).squeeze(-1)

    chunked = lambda hh, ww, bb: logprobs_from_hidden(hh, ww, y, 0.9, chunk_size=7, bias=bb)
    want, got = run(naive, True), run(chunked, True)
    assert got[0].dtype == torch.float32 and all(x.dtype == torch.float32 for x in got[1:])
    assert torch.allclose(got[0], want[0], atol=1e-5)  # the same bf16 logits; dW, db are summed in float32 here
    for a, e in zip(got[1:], want[1:]):
        assert torch.allclose(a, e, rtol=2e-2, atol=2e-2)
    fp32_want, fp32_got = run(naive, False), run(chunked, False)
    for a, e in zip(fp32_got, fp32_want):
        assert torch.allclose(a, e, atol=1e-5)
    assert (got[0] - fp32_got[0]).abs().max() > 1e-3  # the bf16 path really ran in bf16


def test_token_logprobs_under_autocast_matches_model_logits():
    model = tiny_model(torch.float32)
    ids = torch.randint(0, 512, (2, 17), generator=torch.Generator().manual_seed(7))
    attn = torch.ones_like(ids)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, _ = naive_logprobs(model, ids, attn)
        got = token_logprobs(model, ids, attn, chunk_size=5)
    assert got.dtype == torch.float32 and torch.allclose(got, want.float(), atol=2e-2)
    assert (got - token_logprobs(model, ids, attn, chunk_size=5)).abs().max() > 1e-4


# ---- the variants a fork reaches for first: GSPO's sequence-level ratio, DAPO's dynamic-sampling filter ----


def loop_gspo(logp, old, adv, mask, clip_low, clip_high):
    """GSPO as its paper writes it, one sequence at a time: s_i = (pi(y_i) / pi_old(y_i)) ** (1 / |y_i|),
    loss = mean over sequences of -min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i)."""
    terms = []
    for b in range(len(logp)):
        idx = [t for t in range(len(logp[b])) if mask[b][t]]
        if not idx:
            continue
        s = torch.exp(sum(logp[b][t] - old[b][t] for t in idx) / len(idx))
        a = adv[b]
        terms.append(-torch.minimum(s * a, s.clamp(1 - clip_low, 1 + clip_high) * a))
    return sum(terms) / len(terms)


@pytest.mark.parametrize("clip", [(0.2, 0.2), (3e-4, 4e-4)])
def test_sequence_ratio_is_gspo_against_a_plain_loop(clip):
    logp, old, _, adv, mask = random_batch(B=7, T=11, seed=3, spread=0.05)
    logp.requires_grad_(True)
    loss, met = grpo_loss(logp, old, None, adv, mask, clip_low=clip[0], clip_high=clip[1], dual_clip=None,
                          kl_coef=0.0, agg="seq-mean-token-mean", ratio_level="sequence")
    ref_logp = logp.detach().clone().requires_grad_(True)
    ref_loss = loop_gspo(ref_logp, old, adv, mask, *clip)
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-10, abs=1e-12)
    loss.backward()
    ref_loss.backward()
    torch.testing.assert_close(logp.grad, ref_logp.grad, rtol=1e-9, atol=1e-12)
    if clip[0] < 1e-3:  # GSPO's tight ranges clip whole sequences: some get no gradient at all
        clipped = [b for b in range(7) if mask[b].any() and logp.grad[b].abs().sum() == 0]
        assert clipped and met["clip_frac_low"] + met["clip_frac_high"] > 0


def test_token_and_sequence_ratios_agree_on_one_token_sequences():
    logp, old, ref, adv, _ = random_batch(B=5, T=6, seed=4)
    mask = torch.zeros(5, 6, dtype=torch.bool)
    mask[:, 2] = True
    grads = []
    for level in ("token", "sequence"):
        x = logp.clone().requires_grad_(True)
        loss = grpo_loss(x, old, ref, adv, mask, ratio_level=level)[0]
        loss.backward()
        grads.append((loss.item(), x.grad))
    assert grads[0][0] == pytest.approx(grads[1][0], rel=1e-12)
    torch.testing.assert_close(grads[0][1], grads[1][1], rtol=1e-12, atol=0)


def test_sequence_ratio_beyond_the_clamp_has_no_gradient():
    logp, old, _, adv, mask = random_batch(B=4, T=5, seed=6)
    old = old.clone()
    old[2] -= 30.0  # episode 2's log-ratio is +30, beyond LOG_RATIO_CLAMP
    adv = -adv.abs()  # negative advantages: no clip would stop the gradient without the clamp
    x = logp.clone().requires_grad_(True)
    grpo_loss(x, old, None, adv, mask, dual_clip=None, kl_coef=0.0, ratio_level="sequence")[0].backward()
    assert x.grad[2].abs().sum() == 0 and x.grad[[1, 3]].abs().sum() > 0


def test_uniform_groups_against_a_loop():
    from loss import uniform_groups

    g = torch.Generator().manual_seed(5)
    for _ in range(20):
        G = int(torch.randint(2, 5, (1,), generator=g))
        rewards = torch.randint(0, 2, (G * 6,), generator=g).float()
        valid = torch.rand(G * 6, generator=g) > 0.2
        want = []
        for s in range(0, len(rewards), G):
            rs = [float(r) for r, v in zip(rewards[s:s + G], valid[s:s + G]) if v]
            want += [len(rs) < 2 or max(rs) == min(rs)] * G
        assert uniform_groups(rewards, G, valid).tolist() == want


def _episodes(rewards, G=4, seed=0):
    """Episodes of random tokens whose rewards are given (consecutive groups of G), with the sampler's log-probs."""
    import muarl

    g = torch.Generator().manual_seed(seed)
    eps = []
    for i, r in enumerate(rewards):
        n = int(torch.randint(6, 14, (1,), generator=g))
        ids = torch.randint(1, 500, (n,), generator=g).tolist()
        mask = [0] * 3 + [int(x) for x in (torch.rand(n - 3, generator=g) < 0.8)]
        ep = muarl.Episode(task_id=f"t{i // G}", sample=i % G, input_ids=ids, loss_mask=mask,
                           logprobs=[-1.0 * m for m in mask], reward=float(r))
        eps.append(ep)
    return eps


def _one_step(episodes, **options):
    import copy

    from plumbing import cli
    import grpo

    torch.manual_seed(0)
    model = tiny_model(dtype=torch.float32)
    policy, ref = copy.deepcopy(model).train(), copy.deepcopy(model)
    cfg = grpo.Config(**{**dict(group_size=4, micro_batch_size=3, optimizer="sgd", lr=0.5, temperature=1.0,
                                max_context=64), **options})
    opt = torch.optim.SGD(policy.parameters(), lr=cfg.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    out = grpo.train_on_episodes(episodes, policy, ref, opt, sched, cli.make_accelerator(), cfg, pad_id=0)
    return policy, out, model


def test_drop_uniform_groups_trains_as_if_those_groups_were_absent():
    rewards = [1, 0, 1, 0,  1, 1, 1, 1,  0, 0, 1, 0,  0, 0, 0, 0]  # groups 2 and 4 are uniform
    eps = _episodes(rewards)
    dropped, m1, _ = _one_step(eps, drop_uniform_groups=True)
    absent, m2, _ = _one_step(eps[:4] + eps[8:12])  # the same step without the uniform groups at all
    kept, m3, start = _one_step(eps)
    for (name, a), b, c, s in zip(dropped.named_parameters(), absent.parameters(), kept.parameters(),
                                  start.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=name)
        assert not torch.equal(a, s), name  # it trained
    assert any(not torch.equal(a, c) for a, c in zip(dropped.parameters(), kept.parameters()))  # and it matters
    assert (m1["dropped_groups"], m2["dropped_groups"], m3["dropped_groups"]) == (2, 0, 0)
    assert m1["trained_tokens"] == m2["trained_tokens"] < m3["trained_tokens"]
    assert m1["loss"] == pytest.approx(m2["loss"], rel=1e-5)


def test_drop_uniform_groups_with_every_group_uniform_makes_no_update():
    eps = _episodes([1, 1, 1, 1, 0, 0, 0, 0])
    policy, m, start = _one_step(eps, drop_uniform_groups=True)
    assert all(torch.equal(a, b) for a, b in zip(policy.parameters(), start.parameters()))
    assert m["dropped_groups"] == 2 and m["trained_tokens"] == 0 and "grad_norm" not in m


def test_the_loss_gets_every_algorithm_option_from_the_call_site(monkeypatch):
    """train_on_episodes passes each loss option of the Config to grpo_loss by name, visibly at its call site; a bad
    value fails at start naming the option."""
    import grpo
    from plumbing import options

    seen = []

    def spy(*args, **kw):
        seen.append(kw)
        return grpo_loss(*args, **kw)
    monkeypatch.setattr(grpo, "grpo_loss", spy)
    cfg = dict(ratio_level="sequence", clip_low=0.1, clip_high=0.3, dual_clip=2.0, kl_coef=0.5, agg="seq-mean-token-mean",
               policy_loss="cispo")
    _one_step(_episodes([1, 0, 1, 0]), **cfg)
    assert seen and all({k: kw[k] for k in cfg} == cfg for kw in seen)
    with pytest.raises(SystemExit, match="--ratio-level: ratio_level must be one of"):
        options.validate(grpo.Config(ratio_level="episode"), 1)
    with pytest.raises(SystemExit, match="--policy-loss: policy_loss must be one of"):
        options.validate(grpo.Config(policy_loss="reinforce"), 1)
    with pytest.raises(SystemExit, match="--advantage: 'vtrace' is not one of"):
        options.validate(grpo.Config(advantage="vtrace"), 1)
    with pytest.raises(SystemExit, match="--no-scale-advantages: only the 'grpo' advantage"):
        options.validate(grpo.Config(advantage="rloo", scale_advantages=False), 1)


def test_rloo_advantages_match_a_loop():
    """RLOO: each reward minus the mean of the other valid rewards of its group; 0 for invalid episodes, groups with
    one valid episode, and groups whose rewards are all equal."""
    from loss import ADVANTAGES, rloo_advantages

    g = torch.Generator().manual_seed(0)
    rewards = torch.randint(0, 2, (24,), generator=g).float() * torch.rand(24, generator=g)
    rewards[8:12] = 1.0                              # a uniform group
    valid = torch.rand(24, generator=g) > 0.2
    valid[16:20] = torch.tensor([True, False, False, False])  # one valid episode
    want = []
    for k in range(0, 24, 4):
        r, v = rewards[k:k + 4].tolist(), valid[k:k + 4].tolist()
        live = [x for x, ok in zip(r, v) if ok]
        for x, ok in zip(r, v):
            if not ok or len(live) < 2 or max(live) == min(live):
                want.append(0.0)
            else:
                want.append(x - (sum(live) - x) / (len(live) - 1))
    got = rloo_advantages(rewards, 4, valid=valid)
    assert got.tolist() == pytest.approx(want, abs=1e-6)
    assert torch.equal(ADVANTAGES["rloo"](rewards, 4, valid, True), got)
    full = torch.tensor([1.0, 0.0, 0.0, 0.0])  # n / (n - 1) times GRPO's unscaled advantage
    assert rloo_advantages(full, 4).tolist() == pytest.approx((group_advantages(full, 4, scale=False) * 4 / 3).tolist())


def test_cispo_matches_a_loop_and_keeps_every_token_s_gradient():
    """CISPO: the loss is -sg(clip(ratio, 1 - clip_low, 1 + clip_high)) * A * (logp - old) per token, token-mean; its
    gradient per token is -clip(ratio) * A / n, even where PPO's clip gives none."""
    g = torch.Generator().manual_seed(1)
    logp = (-torch.rand(3, 5, generator=g) * 3).requires_grad_(True)
    old = logp.detach() + torch.randn(3, 5, generator=g) * 0.5
    adv = torch.tensor([1.0, -2.0, 0.5])
    mask = (torch.rand(3, 5, generator=g) > 0.3).float()
    loss, _ = grpo_loss(logp, old, None, adv, mask, clip_low=0.2, clip_high=0.28, kl_coef=0.0, policy_loss="cispo")
    loss.backward()
    n = int(mask.sum())
    want_loss, want_grad = 0.0, torch.zeros(3, 5)
    for i in range(3):
        for t in range(5):
            if mask[i, t]:
                x = logp[i, t].item() - old[i, t].item()
                w = min(max(math.exp(x), 0.8), 1.28)
                want_loss += -w * adv[i].item() * x / n
                want_grad[i, t] = -w * adv[i].item() / n
    assert loss.item() == pytest.approx(want_loss, rel=1e-5, abs=1e-7)
    assert torch.allclose(logp.grad, want_grad, atol=1e-6)
    ppo = logp.detach().clone().requires_grad_(True)
    grpo_loss(ppo, old, None, adv, mask, clip_low=0.2, clip_high=0.28, kl_coef=0.0)[0].backward()
    clipped = (ppo.grad == 0) & mask.bool()
    assert clipped.any() and (logp.grad[clipped] != 0).all()  # PPO clipped these tokens; CISPO still trains them


def test_the_update_runs_in_train_mode_and_unknown_metrics_are_refused():
    from plumbing import metrics

    from plumbing import cli
    import grpo

    eps = _episodes([1, 0, 1, 0])

    model = tiny_model(dtype=torch.float32).eval()  # as the rollout and the evaluation leave it
    modes = []
    model.register_forward_pre_hook(lambda module, args: modes.append(module.training))
    cfg = grpo.Config(group_size=4, micro_batch_size=4, optimizer="sgd", lr=0.1, max_context=64, kl_coef=0.0)
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    out = grpo.train_on_episodes(eps, model, None, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0),
                                 cli.make_accelerator(), cfg, pad_id=0)
    assert modes and all(modes)  # gradient checkpointing only runs in train mode
    assert "kl" not in out and "entropy" in out  # no reference: no kl, rather than a 0
    with pytest.raises(KeyError, match="'new_metric' has no kind"):
        metrics.Accumulator().add({"new_metric": 1.0}, 3)


def test_the_update_reads_nothing_back_per_micro_batch(monkeypatch):
    """Every read of a tensor's value on the host (item, float, tolist, bool) waits for the device; inside the
    micro-batch loop it would keep the next micro-batch from being queued. The update's reads do not grow with its
    micro-batches, and its metrics are the same however the step is split."""
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    reads = []  # the project's own reads (transformers' sdpa mask check reads one per forward: its own, left alone)

    def counted(real):
        def read(self, *args):
            caller = sys._getframe(1).f_code.co_filename
            if caller.startswith(root) and "/tests/" not in caller:
                reads.append(caller)
            return real(self, *args)
        return read
    for name in ("item", "tolist", "__float__", "__bool__", "__int__"):
        monkeypatch.setattr(torch.Tensor, name, counted(getattr(torch.Tensor, name)))
    eps = _episodes([1, 0, 1, 0, 0, 1, 1, 0])
    counts, outs = [], []
    for micro in (8, 1):
        reads.clear()
        outs.append(_one_step(eps, micro_batch_size=micro)[1])
        counts.append(len(reads))
    assert counts[0] == counts[1] > 0, counts  # 1 micro-batch or 8
    assert outs[0].keys() == outs[1].keys()
    for k in outs[0]:
        assert outs[0][k] == pytest.approx(outs[1][k], rel=1e-5, abs=1e-7), k


def test_every_metric_the_loss_returns_is_named_in_metrics():
    from plumbing import metrics

    logp, old, ref, adv, mask = random_batch()
    _, met = grpo_loss(logp, old, ref, adv, mask, entropy=torch.rand(*logp.shape, dtype=logp.dtype))
    logged = set(metrics.TOKEN_MEANS + metrics.MAXES + metrics.SUMS)
    assert set(met) - {"n_tokens"} <= logged, set(met) - logged
    assert all(metrics.documented(k) for k in logged)


def test_normalizer_count_is_what_each_aggregation_divides_by():
    """token-mean: the masked tokens; the per-episode aggregations: the episodes with at least one masked token. The
    counts of micro-batches add up to the count of the whole step, so one normalizer serves every micro-batch."""
    from loss import normalizer_count

    masks = [[0, 1, 1, 0], [0, 0, 0], [1, 0, 1, 1, 1], []]
    assert normalizer_count(masks, "token-mean") == 6
    for agg in ("seq-mean-token-mean", "seq-mean-token-sum-norm"):
        assert normalizer_count(masks, agg) == 2
        assert normalizer_count(masks[:2], agg) + normalizer_count(masks[2:], agg) == normalizer_count(masks, agg)
    for agg in AGGS:  # the count grpo_loss makes of a call that is the whole step
        mask = torch.tensor([m + [0] * (5 - len(m)) for m in masks], dtype=torch.float32)
        logp = torch.randn(len(masks), 5, generator=torch.Generator().manual_seed(0)).requires_grad_(True)
        mine, _ = grpo_loss(logp, logp.detach(), None, torch.ones(len(masks)), mask, kl_coef=0.0, agg=agg, max_len=5,
                            normalizer=normalizer_count(masks, agg))
        own, _ = grpo_loss(logp, logp.detach(), None, torch.ones(len(masks)), mask, kl_coef=0.0, agg=agg, max_len=5)
        assert mine.item() == pytest.approx(own.item())


# ---- credit per turn, and the sampler's mismatch corrected ----


def test_turn_discounted_matches_a_loop():
    """A token of agent turn k of K gets the episode's advantage times gamma ** (K - 1 - k); outside the turns the
    value is never trained (loss mask 0). Gamma 1 gives every token exactly the episode's advantage."""
    from loss import turn_discounted

    adv = torch.tensor([0.7, -1.3, 0.0, 2.0], dtype=torch.float64)
    turns = [[0, 0, -1, 1, 1, -1, 2, -1], [-1, 0, 0, 0, -1, -1, -1, -1], [-1] * 8, [0, -1, 1, -1, 2, -1, 3, 3]]
    turn = torch.tensor(turns, dtype=torch.float32)
    for gamma in (1.0, 0.9, 0.5):
        got = turn_discounted(adv, turn, gamma)
        for b, row in enumerate(turns):
            last = max(row)
            for t, k in enumerate(row):
                if k >= 0:
                    assert got[b, t].item() == pytest.approx(adv[b].item() * gamma ** (last - k), rel=1e-12)
    assert torch.equal(turn_discounted(adv, turn, 1.0), adv[:, None].expand(4, 8))
    from types import SimpleNamespace  # --credit picks them by name; 'episode' is the paper's
    assert torch.equal(CREDIT["episode"](adv, turn, None), adv[:, None].expand(4, 8))
    assert torch.equal(CREDIT["turn-discount"](adv, turn, SimpleNamespace(turn_discount=0.5)),
                       turn_discounted(adv, turn, 0.5))


def test_grpo_loss_takes_one_advantage_per_token():
    logp, old, ref, adv, mask = random_batch(spread=1.5, seed=3)
    per_token = adv[:, None] * torch.linspace(0.2, 1.0, logp.shape[1], dtype=adv.dtype)
    loss, _ = grpo_loss(logp, old, ref, per_token, mask, kl_coef=0.01)
    want = loop_loss(logp.tolist(), old.tolist(), ref.tolist(), per_token.tolist(), mask.tolist(), kl_coef=0.01)
    assert loss.item() == pytest.approx(want, rel=1e-10, abs=1e-12)
    same = grpo_loss(logp, old, ref, adv[:, None].expand_as(logp), mask)[0]
    assert same.item() == grpo_loss(logp, old, ref, adv, mask)[0].item()


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_truncated_importance_weights_match_a_loop(level):
    """--correction tis --tis-cap C: each token's policy term times min(exp(old - sampler), C) (per episode: exp of the
    summed log-ratios), detached; the KL term unweighted; where the sampler agrees with the trainer, nothing changes."""
    logp, old, ref, adv, mask = random_batch(spread=1.5, seed=4)
    g = torch.Generator().manual_seed(9)
    sampler = old + (torch.rand(old.shape, generator=g, dtype=old.dtype) - 0.5) * 1.2
    cap, L, O, S, M = 1.5, logp.tolist(), old.tolist(), sampler.tolist(), mask.tolist()
    if level == "token":
        w = [[min(math.exp(O[b][t] - S[b][t]), cap) for t in range(len(L[b]))] for b in range(len(L))]
    else:
        raw = [math.exp(sum(O[b][t] - S[b][t] for t in range(len(L[b])) if M[b][t])) for b in range(len(L))]
        ranked = sorted(r for b, r in enumerate(raw) if any(M[b]))
        cap = (ranked[1] + ranked[2]) / 2  # some episodes capped, some not, none at the cap itself
        w = [[min(raw[b], cap)] * len(L[b]) for b in range(len(L))]
    from types import SimpleNamespace

    from loss import truncated_is

    weights = CORRECTIONS["tis"](old, sampler, mask, SimpleNamespace(tis_cap=cap, tis_level=level))
    assert torch.equal(weights, truncated_is(old, sampler, mask, cap, level))
    pts = [(b, t) for b in range(len(L)) for t in range(len(L[b])) if M[b][t]]
    assert all(weights[b, t].item() == pytest.approx(w[b][t], rel=1e-12) for b, t in pts)
    capped = sum(w[b][t] >= cap for b, t in pts) / len(pts)
    assert 0 < capped < 1 and sum(weights[b, t].item() >= cap for b, t in pts) / len(pts) == capped
    logp.requires_grad_()
    loss, m = grpo_loss(logp, old, ref, adv, mask, kl_coef=0.05, weights=weights.requires_grad_())
    want = loop_loss(L, O, ref.tolist(), adv.tolist(), M, kl_coef=0.05, weights=w)
    assert loss.item() == pytest.approx(want, rel=1e-10, abs=1e-12)
    assert m["correction_weight_mean"].item() == pytest.approx(sum(w[b][t] for b, t in pts) / len(pts), rel=1e-6)
    (g_tis, g_w) = torch.autograd.grad(loss, [logp, weights], allow_unused=True)  # the weights are detached
    assert g_w is None
    f = lambda lp: grpo_loss(lp, old, ref, adv, mask, kl_coef=0.05, weights=weights)[0]
    smooth = logp.detach().clone()
    for edge in (0.8, 1.2, 3.0):  # finite differences need every ratio 1e-3 away from the clip boundaries
        smooth = torch.where(((smooth - old).exp() - edge).abs() < 1e-3, smooth + 0.01, smooth)
    assert torch.autograd.gradcheck(f, (smooth.requires_grad_(),))
    agree, _ = grpo_loss(logp, old, ref, adv, mask, weights=truncated_is(old, old, mask, cap, level))
    assert agree.item() == pytest.approx(grpo_loss(logp, old, ref, adv, mask)[0].item(), rel=1e-12)
    assert torch.isfinite(g_tis).all()
