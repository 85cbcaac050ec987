"""decode.py's decoding step: grouped-query decode attention (each row's cache read once, no repeat_kv) and the
batch sampler's counter-based noise and sort-free nucleus."""
import copy

import pytest
import torch

from fast import cuts, decode, opening
from fast.batched_rollout import RolloutConfig, rollout
from plumbing.users import make_user_sim
from test_rollout import FakeEnv


def _sdpa_with_repeat(q, k, v, mask):
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2)


@pytest.mark.parametrize("heads,kv_heads,width", [(8, 2, 1), (4, 4, 1), (6, 1, 1), (8, 2, 5), (6, 3, 3)])
def test_grouped_decode_attention_is_attention(heads, kv_heads, width):
    """W query tokens a row (1: a decoding step; more: prefill) over each row's slot, seeing columns up to its own
    position (rows of different lengths), against torch's SDPA on keys and values copied to every query head (what
    transformers does with a padding mask): equal in float32, within bf16's noise in bf16."""
    torch.manual_seed(0)
    B, L, D = 5, 37, 16
    q, k, v = torch.randn(B, heads, width, D), torch.randn(B, kv_heads, L, D), torch.randn(B, kv_heads, L, D)
    pos = torch.tensor([30, 12, 25, 31, 8])[:, None] + torch.arange(width)  # row i's queries: its own positions
    mask = (torch.arange(L)[None, None, :] <= pos[:, :, None])[:, None]
    module = torch.nn.Module()
    out, weights = decode.grouped_decode_attention(module, q, k, v, mask, scaling=D ** -0.5)
    want = _sdpa_with_repeat(q, k, v, mask)
    assert weights is None and out.shape == (B, width, heads, D)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    half, _ = decode.grouped_decode_attention(module, q.bfloat16(), k.bfloat16(), v.bfloat16(), mask, None)
    assert half.dtype == torch.bfloat16 and (half.float() - want).abs().max() < 0.05
    # columns a query does not see weigh nothing: large keys and values there change nothing (finite ones: as in any
    # SDPA, a NaN there would poison the row, which is why the engine's slots start as zeros)
    k2, v2 = k.clone(), v.clone()
    for i in range(B):
        k2[i, :, int(pos[i, -1]) + 1:], v2[i, :, int(pos[i, -1]) + 1:] = 1e4, 1e6
    garbage, _ = decode.grouped_decode_attention(module, q, k2, v2, mask, scaling=D ** -0.5)
    torch.testing.assert_close(garbage, out)


def _attention_over_opening_and_own(q, k, v, mask, open_k, open_v, groups, lengths, scale):
    """Each row's keys and values written out whole, [its group's opening; its own], one softmax in float64."""
    B, H, W, _ = q.shape
    rep, out = H // k.shape[1], []
    for b, g in enumerate(groups):
        keys = torch.cat([open_k[g, :, :lengths[g]], k[b]], 1).double().repeat_interleave(rep, 0)
        values = torch.cat([open_v[g, :, :lengths[g]], v[b]], 1).double().repeat_interleave(rep, 0)
        sees = torch.cat([torch.ones(W, lengths[g], dtype=torch.bool), mask[b, 0]], 1)
        scores = (q[b].double() @ keys.transpose(-1, -2) * scale).masked_fill(~sees, -torch.inf)
        out.append((scores.softmax(-1) @ values).transpose(0, 1))
    return torch.stack(out)


@pytest.mark.parametrize("fused", [True, False, "passes"])
@pytest.mark.parametrize("heads,kv_heads,width", [(8, 2, 1), (4, 4, 1), (6, 3, 3)])
def test_attention_over_a_group_opening_held_once_is_attention_over_each_row_whole(heads, kv_heads, width, fused,
                                                                                    monkeypatch):
    """opening.opening_attention: rows of three groups (ragged: 3, 1 and 1 rows, in no order), openings of different
    lengths, one empty, in a buffer longer than any (its tail large garbage) and one more opening than the groups,
    against each row's whole keys and values in float64: equal to float32's precision; in bf16 within its noise.
    Fused (CPU), written out, and written out one query a pass (a prefill's scores bounded by SCORES_BYTES)."""
    monkeypatch.setattr(decode, "FUSED_LSE", fused is True)
    if fused == "passes":
        monkeypatch.setattr(decode, "SCORES_BYTES", 1)
    torch.manual_seed(0)
    B, L, P, D = 5, 7, 9, 16
    groups, lengths = [1, 0, 1, 2, 1], [9, 4, 0]  # (an empty opening: its row attends to its own part alone)
    q, k, v = torch.randn(B, heads, width, D), torch.randn(B, kv_heads, L, D), torch.randn(B, kv_heads, L, D)
    open_k, open_v = torch.randn(4, kv_heads, P, D), torch.randn(4, kv_heads, P, D)
    for g, n in enumerate(lengths):
        open_k[g, :, n:], open_v[g, :, n:] = 1e4, 1e6
    pos = torch.tensor([3, 5, 6, 2, 4])[:, None] + torch.arange(width)  # in each row's own part
    mask = (torch.arange(L)[None, None, :] <= pos[:, :, None])[:, None]
    members = opening.Members.of(groups, lengths)
    out = opening.opening_attention(q, k, v, mask, open_k, open_v, members, D ** -0.5)
    assert all(key[0].shape[-2] == 1 for key, _ in cuts._ONCE)  # a prefill's masks (width > 1) are not kept
    want = _attention_over_opening_and_own(q, k, v, mask, open_k, open_v, groups, lengths, D ** -0.5)
    assert out.shape == (B, width, heads, D) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    open_k[:3, :, 9:], open_v[:3, :, 9:] = 0, 0  # (no garbage: bf16 would round 1e6)
    half = opening.opening_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), mask, open_k.bfloat16(),
                                    open_v.bfloat16(), members, D ** -0.5)
    assert half.dtype == torch.bfloat16 and (half.double() - want).abs().max() < 0.05


@pytest.mark.parametrize("fused", [True, False])
def test_attention_over_a_group_opening_reads_it_once_a_group(fused, monkeypatch):
    """The opening's keys and values are read once per group a step, whatever the group's rows: every operation
    that touches the opening buffers is recorded (torch's dispatch), and the ones that compute (not views) read the
    batch's two openings once, for 6 rows; on the fused path (CPU) and on the one written out."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Reads(TorchDispatchMode):
        def __init__(self, buffers):
            super().__init__()
            self.ptrs, self.read = {b.untyped_storage().data_ptr() for b in buffers}, []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            for a in torch.utils._pytree.tree_leaves((args, kwargs)):
                if isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() in self.ptrs:
                    self.read.append((func.__name__, a.numel()))
            return func(*args, **(kwargs or {}))

    monkeypatch.setattr(decode, "FUSED_LSE", fused)
    torch.manual_seed(0)
    B, H, kvh, L, P, D = 6, 8, 2, 5, 12, 4
    q, k, v = torch.randn(B, H, 1, D), torch.randn(B, kvh, L, D), torch.randn(B, kvh, L, D)
    open_k, open_v = torch.randn(3, kvh, P, D), torch.randn(3, kvh, P, D)
    mask = torch.ones(B, 1, 1, L, dtype=torch.bool)
    with Reads([open_k, open_v]) as reads:
        opening.opening_attention(q, k, v, mask, open_k, open_v, opening.Members.of([0, 0, 0, 1, 1, 1], [12, 10]),
                                 D ** -0.5)
    views = ("slice", "view", "transpose", "expand", "select", "alias", "as_strided", "t.", "permute")
    computed = [(f, n) for f, n in reads.read if not f.startswith(views)]
    assert computed and all(n == 2 * kvh * P * D for _, n in computed), reads.read  # 2 openings, not 6 rows' copies
    assert len(computed) == 2, reads.read  # keys once, values once (one op, or one each)


def test_a_fused_kernel_is_used_only_where_it_gives_the_written_out_numbers(monkeypatch):
    """decode.attend_lse takes a fused kernel only after checking it once (device, dtype, head size) against the
    arithmetic written out (the CPU's flash kernel holds); a kernel whose log-sum-exp is off (here: in base 2, as some
    kernels keep it), or that raises in the check or on a later shape, is not used (again): one warning, then the
    arithmetic written out, the same numbers."""
    import warnings

    torch.manual_seed(1)
    q, k, v = torch.randn(3, 2, 4, 16), torch.randn(3, 2, 9, 16), torch.randn(3, 2, 9, 16)
    sees = (torch.arange(9) < torch.tensor([[4], [9], [1]]))[:, None, None]
    want = decode._written(q, k, v, sees, 0.25)
    monkeypatch.setattr(decode, "FUSED_HOLDS", {})
    got = decode.attend_lse(q, k, v, sees, 0.25)
    assert decode.FUSED_HOLDS == {("cpu", torch.float32, 16): True}
    assert torch.allclose(got[0], want[0], atol=1e-5) and torch.allclose(got[1], want[1], atol=1e-5)
    real = decode._fused
    def raises(*a):
        raise RuntimeError("no kernel for this shape")

    for broken in (lambda *a: (real(*a)[0], real(*a)[1] / 0.6931471805599453), raises,
                   lambda *a: raises() if a[0].shape[2] == 4 else real(*a)):  # (the check's 3 queries pass)
        monkeypatch.setattr(decode, "FUSED_HOLDS", {})
        monkeypatch.setattr(decode, "_fused", broken)
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            got = [decode.attend_lse(q, k, v, sees, 0.25) for _ in range(2)]
        assert decode.FUSED_HOLDS == {("cpu", torch.float32, 16): False}
        assert len([w for w in said if "fused kernel on cpu" in str(w.message)]) == 1
        assert all(torch.equal(g[0], want[0]) and torch.equal(g[1], want[1]) for g in got)


def test_a_sliding_window_is_refused_past_its_width():
    """Mistral's configs carry a sliding window: within it nothing changes; past it the slots (no per-row window)
    refuse, naming the option that avoids it, rather than attend to what the model would not."""
    q, k = torch.randn(2, 4, 1, 8), torch.randn(2, 2, 20, 8)
    mask = torch.ones(2, 1, 1, 20, dtype=torch.bool)
    out, _ = decode.grouped_decode_attention(torch.nn.Module(), q, k, k, mask, None, sliding_window=64)
    torch.testing.assert_close(out, _sdpa_with_repeat(q, k, k, mask))
    with pytest.raises(NotImplementedError, match="--max-context"):
        decode.grouped_decode_attention(torch.nn.Module(), q, k, k, mask, None, sliding_window=6)


def test_grouped_decode_attention_refuses_what_it_does_not_compute():
    q, k = torch.randn(1, 4, 1, 8), torch.randn(1, 2, 3, 8)
    mask = torch.ones(1, 1, 1, 3, dtype=torch.bool)
    with pytest.raises(NotImplementedError, match="softcap"):
        decode.grouped_decode_attention(torch.nn.Module(), q, k, k, mask, None, softcap=30.0)
    with pytest.raises(ValueError, match="boolean"):
        decode.grouped_decode_attention(torch.nn.Module(), q, k, k, mask.float(), None)
    with pytest.raises(ValueError, match="boolean"):
        decode.grouped_decode_attention(torch.nn.Module(), q, k, k, mask[:, 0, 0], None)
    with pytest.raises(ValueError, match="whole groups"):
        decode.grouped_decode_attention(torch.nn.Module(), torch.randn(1, 3, 1, 8), k, k, mask, None)


@pytest.mark.versions
def test_decode_attention_is_put_back(lm):
    """The decoder's attention implementation is switched for the decoding steps only, and put back when they raise."""
    before = lm.get_decoder().config._attn_implementation
    with pytest.raises(RuntimeError, match="boom"):
        with decode.decode_attention(lm, "grouped"):
            assert lm.get_decoder().config._attn_implementation == decode.GROUPED
            raise RuntimeError("boom")
    assert lm.get_decoder().config._attn_implementation == before
    with pytest.raises(ValueError, match="unknown decode_attention 'fast'"):
        with decode.decode_attention(lm, "fast"):
            pass
    cfg = lm.get_decoder().config  # the model's own attention must take the engine's 4-D mask: flash-attn does not
    cfg._attn_implementation_internal = "flash_attention_2"
    try:
        with pytest.raises(NotImplementedError, match="--decode-attention grouped"):
            with decode.decode_attention(lm, "model"):
                pass
    finally:
        cfg._attn_implementation_internal = before


def _count_repeat_kv(monkeypatch, model):
    """Calls of transformers' repeat_kv made inside a decoding step (one new token a row), and outside."""
    import importlib

    calls = {"decode": 0, "other": 0}
    state = {"decoding": False}
    for name in ("transformers.integrations.sdpa_attention", type(model).__module__):
        mod = importlib.import_module(name)
        if hasattr(mod, "repeat_kv"):
            real = mod.repeat_kv

            def counted(*a, real=real, **k):
                calls["decode" if state["decoding"] else "other"] += 1
                return real(*a, **k)

            monkeypatch.setattr(mod, "repeat_kv", counted)
    dec = model.get_decoder()
    handles = [dec.register_forward_pre_hook(
                   lambda m, a, kw: state.__setitem__("decoding", kw["input_ids"].shape[1] == 1), with_kwargs=True),
               dec.register_forward_hook(lambda m, a, out: state.__setitem__("decoding", False))]
    return calls, handles


@pytest.mark.versions
def test_repeat_kv_is_never_called_while_decoding(lm, tiny_tok, monkeypatch):
    """With decode_attention 'grouped' (the default) the rollout never copies the cache to the query heads, in
    prefill or in a decoding step. The model's own eager attention ('model') does at every step:
    the counter counts (transformers >= 5.2x's sdpa packs the heads of one query token itself; 5.17's, on the GPU
    machines, copies). Both play the same greedy tokens."""
    calls, handles = _count_repeat_kv(monkeypatch, lm)
    env, before = FakeEnv(n_tasks=3), lm.config._attn_implementation
    try:
        played = {}
        for how, implementation in (("grouped", "sdpa"), ("model", "eager")):
            calls.update(decode=0, other=0)
            lm.config._attn_implementation = implementation
            cfg = RolloutConfig(greedy=True, max_new_tokens=24, max_turns=3, decode_attention=how)
            played[how] = [e.input_ids for e in rollout(lm, tiny_tok, env, env.tasks(), 2, make_user_sim("scripted"),
                                                        cfg)]
            played[how + " calls"] = dict(calls)
    finally:
        lm.config._attn_implementation = before
        for h in handles:
            h.remove()
    assert played["grouped"] == played["model"]
    assert played["grouped calls"] == {"decode": 0, "other": 0}
    assert played["model calls"]["other"] > 0 and played["model calls"]["decode"] > 0  # prefill and every step


def test_the_noise_is_splitmix64():
    """Known answers: uniform_noise's int64 torch ops give splitmix64's outputs, computed here in Python's unbounded
    integers modulo 2^64 (so a device or a compiler that did not wrap its products would be caught)."""
    M = (1 << 64) - 1

    def mix(z):
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M
        return z ^ (z >> 31)

    for seed, counter in ((0, 0), (7, 100), ((1 << 63) - 1, 123456), (987654321, 1 << 40)):
        key = mix((seed + counter * 0x9E3779B97F4A7C15) & M)
        want = [((mix((key + (v + 1) * 0x9E3779B97F4A7C15) & M) >> 11) + 0.5) * 2.0 ** -53 for v in range(5)]
        got = decode.uniform_noise(torch.tensor([seed]), torch.tensor([counter]), 5)[0].tolist()
        assert got == want


def test_the_noise_is_a_function_of_seed_counter_and_column():
    """uniform_noise: the same (seed, counter) gives the same row whatever else is in the batch; another seed or
    counter gives another row; the values are uniform on (0, 1) (moments and a 20-bin histogram over 2M draws) and
    neighbouring columns and counters are uncorrelated."""
    seeds, counters = torch.tensor([7, 8, 7, 7]), torch.tensor([100, 100, 100, 101])
    u = decode.uniform_noise(seeds, counters, 1000)
    assert u.dtype == torch.float64 and u.shape == (4, 1000)
    assert torch.equal(u[0], u[2]) and not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[3])
    assert torch.equal(decode.uniform_noise(seeds[2:3], counters[2:3], 1000), u[:1])
    big = decode.uniform_noise(torch.arange(2000) * 977, torch.arange(2000) % 13, 1000)
    assert 0 < big.min() and big.max() < 1
    assert abs(big.mean() - 0.5) < 1e-3 and abs(big.var() - 1 / 12) < 1e-3
    hist = torch.histc(big.float(), bins=20, min=0, max=1)
    chi2 = ((hist - big.numel() / 20) ** 2 / (big.numel() / 20)).sum()
    assert chi2 < 43.8  # the 99.9th percentile of chi-square with 19 degrees of freedom
    c = big - 0.5
    assert abs((c[:, 1:] * c[:, :-1]).mean() / c.var()) < 0.01
    assert abs((c[1:] * c[:-1]).mean() / c.var()) < 0.01


def test_top_p_keeps_the_smallest_set_that_reaches_it():
    """top_p_keep keeps, by its definition written out token by token: every token at least as probable as the largest
    probability t whose tokens (p >= t) still hold top_p of the mass; ties at the cut are all kept (rows with many
    ties: probabilities rounded to a grid). Its kernels a call do not grow with the vocabulary."""
    from torch.utils._python_dispatch import TorchDispatchMode

    torch.manual_seed(0)
    for top_p in (0.1, 0.5, 0.9, 0.99):
        for grid in (None, 64):
            p = torch.softmax(torch.randn(40, 30) * 2, -1).double()
            if grid:
                p = (p * grid).round().clamp(min=1) / grid
                p = p / p.sum(-1, keepdim=True)
            want = torch.zeros_like(p, dtype=torch.bool)
            for r, row in enumerate(p.tolist()):
                cut = max(t for t in row if sum(x for x in row if x >= t) >= top_p)
                want[r] = torch.tensor([x >= cut for x in row])
            assert torch.equal(decode.top_p_keep(p, top_p), want), (top_p, grid)
    assert decode.top_p_keep(torch.tensor([[1.0, 0.0]]), 0.5).tolist() == [[True, False]]
    assert decode.top_p_keep(torch.tensor([[0.25, 0.25, 0.5]]), 0.6).tolist() == [[True, True, True]]

    ops = []

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(func)
            return func(*args, **(kwargs or {}))

    for vocab in (100, 20000):
        probs = torch.softmax(torch.randn(4, vocab), -1)
        with Count():
            decode.top_p_keep(probs, 0.9)
    assert len(ops) % 2 == 0 and ops[:len(ops) // 2] == ops[len(ops) // 2:] and len(ops) // 2 <= 12, ops


def test_the_draw_lands_on_a_kept_token_at_either_end_of_the_interval(monkeypatch):
    """A uniform at the very top of (0, 1) draws the last token nucleus sampling keeps (rounding must not carry it
    into the dropped tail), one at the very bottom the first kept token (token 0, e^-53 below, is dropped too)."""
    logits = torch.tensor([[-50.0, 3.0, 2.0, 1.0, -1.0, -2.0]]).repeat(2, 1)
    cfg = RolloutConfig(temperature=1.0, top_p=0.9)
    keep = decode.top_p_keep(torch.softmax(logits[:1].double(), -1), 0.9)[0]
    for u, want in ((1 - 2.0 ** -53, 3), (2.0 ** -54, 1)):
        monkeypatch.setattr(decode, "uniform_noise",
                            lambda s, c, n, u=u: torch.full((len(s), n), u, dtype=torch.float64))
        tok, _ = decode._sample(logits, cfg, torch.tensor([1, 2]), torch.tensor([0, 0]))
        assert tok.tolist() == [want, want]
    assert keep.tolist() == [False, True, True, True, False, False]


def test_sampled_episodes_do_not_depend_on_the_batch(lm, tiny_tok):
    """Sampling at temperature 0.9 with top_p 0.9: the same episodes whether all rows decode together or one at a
    time (each row's noise is its own seed and the position drawn); another seed plays other episodes."""
    env = FakeEnv(n_tasks=3)

    def run(seed, **kw):
        cfg = RolloutConfig(temperature=0.9, top_p=0.9, max_new_tokens=20, max_turns=3, **kw)
        return [e.input_ids for e in rollout(lm, tiny_tok, env, env.tasks(), 3, make_user_sim("scripted"), cfg,
                                             seed=seed)]

    base = run(3)
    assert len({tuple(x) for x in base}) > 3
    assert run(3, max_batch=1) == base and run(3, decode_attention="model") == base
    assert run(4) != base


@pytest.mark.versions
def test_the_compiled_step_plays_the_eager_tokens(lm, tiny_tok, monkeypatch):
    """compile_decode 'on' (torch.compile of the decoder's step, dynamic shapes): the greedy and the
    sampled episodes of eager decoding, rows leaving and joining mid-turn; the compile time is printed once, and
    dynamo did compile graphs (not a silent eager fallback)."""
    from torch._dynamo.utils import counters

    monkeypatch.setattr(decode, "_COMPILED", {})
    graphs = counters["stats"]["unique_graphs"]
    env = FakeEnv(n_tasks=3)

    def run(how, **kw):
        cfg = RolloutConfig(max_new_tokens=24, max_turns=3, compile_decode=how, **kw)
        return [e.input_ids for e in rollout(lm, tiny_tok, env, env.tasks(), 2, make_user_sim("scripted"), cfg,
                                             seed=5)]

    for kw in (dict(greedy=True), dict(temperature=0.9)):
        assert run("on", **kw) == run("off", **kw)
    assert "failed" not in decode._COMPILED and decode._COMPILED["timed"] > 0
    assert counters["stats"]["unique_graphs"] > graphs


def test_a_step_that_will_not_compile_warns_once_and_decodes_eagerly(lm, tiny_tok, monkeypatch):
    """Where torch.compile fails (here: its compiled function raises after writing garbage where the step's keys go),
    the rollout warns once, naming the error and the option, and decodes eagerly, which writes those columns again:
    the same episodes."""
    monkeypatch.setattr(decode, "_COMPILED", {})

    def broken(fn, **kw):
        def call(model, cache, *a):  # noqa: ARG001
            for lay in cache.layers:  # as if the failed call had written the step's columns already
                for kbuf, _, view in lay.parts:
                    kbuf[view.rows, :, view.cols] = 1e4
            raise torch._dynamo.exc.TorchDynamoException("no C++ compiler found")
        return call

    monkeypatch.setattr(decode.torch, "compile", broken)
    env = FakeEnv(n_tasks=2)
    cfg = RolloutConfig(greedy=True, max_new_tokens=24, max_turns=3)
    want = [e.input_ids for e in rollout(lm, tiny_tok, env, env.tasks(), 2, make_user_sim("scripted"), cfg)]
    with pytest.warns(UserWarning, match="no C\\+\\+ compiler found.*--compile-decode off") as caught:
        got = [e.input_ids for e in rollout(lm, tiny_tok, env, env.tasks(), 2, make_user_sim("scripted"),
                                            RolloutConfig(**{**cfg.__dict__, "compile_decode": "on"}))]
    assert got == want
    assert sum("compiling the decoding step failed" in str(w.message) for w in caught) == 1


# ---- the decoding step over fixed buffers (fast/graphs.py): everything but the capture, on the CPU ---------------
def test_the_graphed_step_plays_the_eager_tokens(lm, tiny_tok, monkeypatch):
    """--decode-graphs on (on the CPU: the body a GPU captures, run eagerly): the greedy and the sampled episodes of
    the eager step, with rows leaving and joining mid-turn and the pool smaller than the batch (max_batch), and with
    the groups' openings held apart (the bucket's rows in their groups' cells, the padding rows in free ones); the
    logprobs recorded within float32 rounding (the attention reads the bucket's columns, masked past each row)."""
    from fast import graphs

    steps = []
    real = graphs.StepGraphs.step
    monkeypatch.setattr(graphs.StepGraphs, "step", lambda self, *a: steps.append(a[-1] is not None) or real(self, *a))
    env = FakeEnv(n_tasks=3)

    def run(how, **kw):
        cfg = RolloutConfig(max_new_tokens=24, max_turns=3, decode_graphs=how, **kw)
        return rollout(lm, tiny_tok, env, env.tasks(), 2, make_user_sim("scripted"), cfg, seed=5)

    for kw in (dict(greedy=True), dict(temperature=0.9), dict(temperature=0.9, top_p=0.8, max_batch=4),
               dict(greedy=True, decode_share_opening=True), dict(temperature=0.9, decode_share_opening=True),
               dict(temperature=0.9, max_batch=3, decode_share_opening=True)):
        eager, body = run("off", **kw), run("on", **kw)
        assert [e.input_ids for e in body] == [e.input_ids for e in eager]
        for a, b in zip(body, eager):
            assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5)
    monkeypatch.setattr(decode, "FUSED_LSE", False)  # the two parts written out (where no fused kernel holds)
    kw = dict(temperature=0.9, max_batch=3, decode_share_opening=True)
    assert [e.input_ids for e in run("on", **kw)] == [e.input_ids for e in run("off", **kw)]
    assert False in steps and True in steps  # the graphed step ran ('on'), with the openings held apart too
    steps.clear()  # and 'auto' leaves the CPU's step eager
    assert [e.input_ids for e in run("auto", greedy=True)] == [e.input_ids for e in run("off", greedy=True)]
    assert not steps


def test_the_graphed_step_keeps_its_pool_and_graphs_from_one_rollout_to_the_next(lm, tiny_tok, monkeypatch):
    """With --decode-graphs the process keeps one pool (pool.rollout_pool) and its graphed step: the next rollout of
    the same shape decodes in the very same buffers with the very same step (its buckets; on a GPU, their graphs)
    while the weights stay where they are, updated in place as the optimizer does, and plays the eager step's tokens
    for the new weights. A parameter moved elsewhere or another draw gives a new step; autocast casting the weights
    keeps none; a rollout of another shape gets a new pool and the old one is let go; the eager step keeps nothing."""
    import copy

    from fast import batched_rollout, graphs
    from fast import pool as pools

    model = copy.deepcopy(lm)
    made = []
    real = pools.rollout_pool
    monkeypatch.setattr(batched_rollout, "rollout_pool", lambda *a, **k: made.append(real(*a, **k)) or made[-1])
    monkeypatch.setattr(pools, "_KEPT", {})
    env = FakeEnv(n_tasks=3)

    def run(how, **kw):
        cfg = RolloutConfig(max_new_tokens=24, max_turns=3, decode_graphs=how, **kw)
        return [e.input_ids for e in rollout(model, tiny_tok, env, env.tasks(), 2, make_user_sim("scripted"), cfg,
                                             seed=5)]

    run("on", greedy=True)
    first, kept_step = made[0], made[0].graphs
    buffers, buckets = [t.data_ptr() for t in first.k + first.v], dict(kept_step.buckets)
    assert buckets and pools._KEPT == {"cpu": first}
    with torch.no_grad():  # an optimizer's step: the same tensors, new values
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    graphed = run("on", greedy=True)
    again = made[-1]
    assert again is first and again.graphs is kept_step  # the same pool and step, its buckets kept
    assert all(kept_step.buckets[k] is b for k, b in buckets.items())
    assert [t.data_ptr() for t in again.k + again.v] == buffers
    assert graphed == run("off", greedy=True)  # the new weights' tokens
    assert pools._KEPT == {}  # the eager step keeps no pool
    run("on", greedy=True)
    again = made[-1]  # a new pool (the eager run let the kept one go), kept from now on
    kept_step = again.graphs
    run("on", temperature=0.9)  # another draw: the same pool, a new step
    assert made[-1] is again and again.graphs is not kept_step
    sampled_step = again.graphs
    first_weight = next(model.parameters())
    first_weight.data = first_weight.data.clone()  # a weight moved: its graphs would read the old address
    run("on", temperature=0.9)
    assert made[-1] is again and again.graphs is not sampled_step
    run("on", greedy=True, max_batch=4)  # another shape: a new pool, the old one no longer kept
    assert made[-1] is not again and len(made[-1].owner) == 4 and pools._KEPT == {"cpu": made[-1]}
    assert all(o is None for o in made[-1].owner)  # every row gave its slot back
    # the openings held apart: their pool kept beside the rows', the step kept with both and playing eager's tokens
    run("on", greedy=True, decode_share_opening=True)
    rows, opens = made[-2:]
    assert pools._KEPT == {"cpu": rows, "cpu:openings": opens} and rows.opens is opens and rows.graphs.opens() is opens
    kept_step = rows.graphs
    graphed = run("on", greedy=True, decode_share_opening=True)
    assert made[-2:] == [rows, opens] and rows.graphs is kept_step
    assert graphed == run("off", greedy=True, decode_share_opening=True)
    run("on", greedy=True, decode_share_opening=True)
    run("on", greedy=True)  # without them: the openings' pool let go, a step that reads none
    assert pools._KEPT == {"cpu": made[-1]} and made[-1].opens is None and made[-1].graphs.opens is None
    # the autocast rule: fp32 weights cast by autocast cannot be kept; weights already in its dtype can
    assert graphs.weights_key(model) is not None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert graphs.weights_key(model) is None
        assert graphs.weights_key(copy.deepcopy(model).to(torch.bfloat16)) is not None


def test_the_kept_pool_is_zeroed_and_counted_in_the_update(lm):
    """A kept pool comes back zeroed (a NaN an earlier rollout left would poison the masked columns: 0 x NaN), at
    the same addresses; one replaced is freed at once; the memory estimate counts it in the update's peak when it is
    kept."""
    import weakref

    from fast import graphs, pool as pools
    from plumbing import memory

    pools._KEPT.clear()
    a = pools.rollout_pool(lm, 3, 64, keep=True)
    a.k[0][1, 0, 5] = float("nan")
    a.owner[1] = object()
    b = pools.rollout_pool(lm, 3, 64, keep=True)
    assert b is a and not any(t.isnan().any() or t.any() for t in b.k + b.v) and b.owner == [None] * 3
    assert pools.rollout_pool(lm, 3, 32, keep=True) is a  # a pool that holds more serves (rows after longer openings)
    assert pools.rollout_pool(lm, 3, 96, keep=True) is not a and pools.rollout_pool(lm, 4, 96, keep=True) is not a
    pools.rollout_pool(lm, 3, 32, keep=False)
    assert pools._KEPT == {}
    a = pools.rollout_pool(lm, 3, 64, keep=True)  # a pool replaced is freed at once, though its step points back at it
    a.graphs, gone = graphs.StepGraphs(lm, a, RolloutConfig(), capture=False), weakref.ref(a)
    del a, b
    assert pools.rollout_pool(lm, 3, 96, keep=True) is not None and gone() is None
    pools._KEPT.clear()
    kw = dict(kv_bytes_per_token=1000, max_context=100, episodes=4)
    for lora in (0, 10):
        plain, kept = (memory.memory_estimate(10**6, lora=lora, kept_pool=k, **kw) for k in (False, True))
        assert kept["update_peak"] - plain["update_peak"] == 4 * 100 * 1000 == kept["kv_cache"]
        assert kept["rollout_peak"] == plain["rollout_peak"]


def test_the_buckets_never_exceed_the_pool_and_round_up():
    from fast.graphs import col_bucket, row_bucket

    assert [row_bucket(b, 6) for b in (1, 2, 3, 4, 5, 6)] == [2, 2, 4, 4, 6, 6]
    assert [col_bucket(s, 4096) for s in (1, 128, 129, 1000, 1025, 2000, 4000)] == [128, 128, 256, 1024, 1152,
                                                                                      2048, 4096]
    assert col_bucket(5000, 4096) == 4096 and all(col_bucket(s, 1 << 20) - s < max(128, s // 8) for s in
                                                   range(1, 40000, 37))


def _graph_body(lm, tiny_tok, rows=3, slots=4, shared=False):
    """A pool of `slots` slots with `rows` rows of different lengths, and the graphed step over it; `shared`: the
    rows follow two openings held apart (pool.opens), two rows the first and one the second."""
    from fast import graphs
    from fast.pool import SlotPool

    pool = SlotPool(lm, slots, 128)
    pool.opens = SlotPool(lm, 2, 64) if shared else None
    cfg = RolloutConfig(temperature=0.9)
    steps = graphs.StepGraphs(lm, pool, cfg, capture=False)
    lens = torch.tensor([7, 30, 12][:rows])
    return pool, steps, cfg, lens


def _body_bucket(pool, steps, lens, shared):
    """The bucket of `lens`' rows, filled as StepGraphs.step fills it, and the attention switch its body runs in."""
    members = opening.Members.of([0, 1, 0][:len(lens)], [20, 9]) if shared else None
    b = steps.bucket(len(lens), int(lens.max()) + 1, members)
    b.lens[:len(lens)] = lens
    if shared:
        b.bases[:len(lens)] = members.lengths[members.group]
        b.members.lengths.copy_(members.lengths)
        b.members.group[:], b.members.index[:] = steps._cells(b, members)
    return b, (pool.opens.k, pool.opens.v, members) if shared else None


@pytest.mark.parametrize("shared", [False, True])
def test_the_graphed_body_never_reads_the_host(lm, tiny_tok, shared, monkeypatch):
    """A CUDA graph cannot hold a host sync (an .item(), a nonzero, a data-dependent shape): the body's ops, recorded
    on the CPU by a dispatch mode, include none of them; with the openings held apart, through the two attention
    parts written out (decode.attend_lse's path where no fused kernel holds)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from fast.decode import decode_attention

    syncing = ("_local_scalar_dense", "nonzero", "item", "is_nonzero", "equal", "masked_select", "unique",
               "repeat_interleave", "_unique2", "bincount")
    seen = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func.__name__.split(".")[0])
            return func(*args, **(kwargs or {}))

    monkeypatch.setattr(decode, "FUSED_LSE", False)
    pool, steps, cfg, lens = _graph_body(lm, tiny_tok, shared=shared)
    b, openings = _body_bucket(pool, steps, lens, shared)
    with torch.no_grad(), decode_attention(lm, "grouped", openings), Record():
        steps._body(b)
    assert len(seen) > 50 and not [op for op in seen if op in syncing], sorted(set(seen))
    assert ("logsumexp" in seen) == shared  # (the parts joined, where the openings are held apart)


@pytest.mark.parametrize("shared", [False, True])
def test_every_tensor_the_graphed_body_reads_keeps_its_address(lm, tiny_tok, shared):
    """A graph replays over the memory it was captured with: every tensor the body reads that it did not make (the
    bucket's buffers, the pool's, the openings' pool's when held apart, the weights) is at the same address on every
    call of the bucket, and the body makes its outputs where the bucket keeps them."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from fast.decode import decode_attention

    def inputs():
        made, read = set(), set()

        class Record(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                flat = torch.utils._pytree.tree_leaves((args, kwargs or {}))
                read.update(t.untyped_storage().data_ptr() for t in flat if isinstance(t, torch.Tensor)
                            and t.untyped_storage().data_ptr() not in made)
                out = func(*args, **(kwargs or {}))
                made.update(t.untyped_storage().data_ptr() for t in torch.utils._pytree.tree_leaves(out)
                            if isinstance(t, torch.Tensor))
                return out

        with torch.no_grad(), decode_attention(lm, "grouped", openings), Record():
            steps._body(b)
        return read

    pool, steps, cfg, lens = _graph_body(lm, tiny_tok, shared=shared)
    b, openings = _body_bucket(pool, steps, lens, shared)
    first = inputs()
    b.lens[:3] += 1  # the next step: new values in the same buffers
    b.tok[:3] = b.out_tok[:3, None]
    garbage = [torch.randn(1000) for _ in range(20)]  # the allocator's other blocks in use
    assert inputs() == first and garbage
    held = [*pool.opens.k, *pool.opens.v, b.members.group, b.members.index, b.members.lengths] if shared else []
    fixed = {t.untyped_storage().data_ptr() for t in [b.tok, b.lens, b.bases, b.seeds, b.columns, b.view.rows,
                                                        b.out_tok, b.out_lp, *pool.k, *pool.v, *lm.parameters(), *held]}
    assert first <= fixed | {p.untyped_storage().data_ptr() for p in lm.buffers()}, "the body read a tensor it " \
        "neither made nor keeps"


@pytest.mark.parametrize("fused", [True, False])
def test_the_openings_masks_are_made_once_a_step(lm, tiny_tok, fused, monkeypatch):
    """With the openings held apart, what a step's attention makes of its mask (the openings' mask, each part's
    bias for the fused kernel, the rows that see no opening) is made at its first layer and read by the others: the
    ops that make them count the same for a model of 2 layers as for the model cut to 1, and the tokens are those of
    the step made layer by layer (every memo off)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from fast.decode import decode_attention

    monkeypatch.setattr(decode, "FUSED_LSE", fused)

    def made(model):
        ops = []

        class Ops(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                ops.append(func.__name__.split(".")[0])
                return func(*args, **(kwargs or {}))

        pool, steps, cfg, lens = _graph_body(model, tiny_tok, shared=True)
        b, openings = _body_bucket(pool, steps, lens, True)
        with torch.no_grad(), decode_attention(model, "grouped", openings), Ops():
            steps._body(b)
        return [ops.count(op) for op in ("arange", "lt", "any", "bitwise_not", "masked_fill_")], b.out_tok.clone()

    cut = copy.deepcopy(lm)
    cut.model.layers = cut.model.layers[:1]
    cut.config.num_hidden_layers = 1
    made(lm)  # (the fused kernel's one-time check, which makes its own masks)
    (two, tokens), (one, _) = made(lm), made(cut)
    assert two == one and sum(two) > 0, (two, one)
    monkeypatch.setattr(decode, "once", lambda key, make: make())  # every layer makes its own
    assert made(lm)[0] != two and torch.equal(made(lm)[1], tokens)


def test_a_decoding_step_calls_each_norm_once_and_makes_its_mask_once(lm, tiny_tok):
    """The step's kernel cuts (exact: the engine's tokens are the reference's in the rollout tests): every RMSNorm of
    the model is one call of torch's rms_norm (one fused kernel on CUDA) and the weight's product, the same numbers
    as the module's own forward; the additive mask is made once a step, not converted by every layer's SDPA; the
    modules' own forwards are back after. A norm whose code differs (Gemma's 1 + weight) keeps its own."""
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    from fast.cuts import cut_kernels
    from fast.decode import decode_attention

    calls, ops = [], []

    class Calls(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            calls.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(func.__name__.split(".")[0])
            return func(*args, **(kwargs or {}))

    pool, steps, cfg, lens = _graph_body(lm, tiny_tok)
    b = steps.bucket(len(lens), int(lens.max()) + 1)
    b.lens[:3] = lens
    norms = [m for m in lm.modules() if type(m).__name__.endswith("RMSNorm")]
    with torch.no_grad():
        x = torch.randn(3, 1, norms[0].weight.shape[0]) * 3
        own = norms[0](x)
        with decode_attention(lm, "grouped"), Calls(), Ops():
            steps._body(b)
        assert ops.count("masked_fill_") == 1  # the additive mask, once a step
        assert torch.equal(norms[0](x), own) and not any("forward" in vars(m) for m in norms)
    layers = lm.config.num_hidden_layers
    assert len(norms) == 4 * layers + 1 and calls.count("rms_norm") == len(norms) and "rsqrt" not in calls
    in_body = ops.count("where")
    ops.clear()
    with Ops():
        decode._sample(torch.randn(3, lm.config.vocab_size), cfg, b.seeds[:3], b.lens[:3])
    assert ops.count("masked_fill_") == 0 and in_body == ops.count("where")  # the draw's, none a layer
    ops.clear()

    class OnePlus(type(norms[0])):  # another norm's code: left alone
        def forward(self, hidden_states):
            return hidden_states * (1 + self.weight)

    holder = torch.nn.Sequential(OnePlus(8))
    with cut_kernels(holder):
        assert "forward" not in vars(holder[0])
    fused = lambda: ["forward" in vars(m) for m in norms]  # noqa: E731
    with cut_kernels(lm):  # the engine's, once a turn: decode_attention's inside it leaves them as they are
        with decode_attention(lm, "grouped"):
            assert all(fused())
        assert all(fused())
    with cut_kernels(lm, on=False):  # --decode-attention model: the model's own norms
        assert not any(fused())
    assert not any(fused())


@pytest.mark.versions  # (the model's code is transformers': 5.17's too, the GPU machines')
def test_the_rotary_cut_is_the_models_rotary_bitwise_in_half_the_kernels(lm):
    """cuts.rotary: the queries and keys rotated as one tensor, rotate_half's sign carried by the sine made once a
    step: bitwise the model's apply_rotary_pos_emb (float32 and bf16, one token and several, the queries and keys
    laid out as the attention makes them), in 5 kernels where the model's launches 10. cut_kernels puts it in the
    model's module while decoding (a forward's logits bitwise the model's own) and the module's own back after, when
    the last of two holders lets go."""
    import importlib

    from torch.utils._python_dispatch import TorchDispatchMode

    from fast.cuts import cut_kernels, rotary

    module = importlib.import_module(type(lm.model.layers[0].self_attn).__module__)
    own, ops = module.apply_rotary_pos_emb, []

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.extend([] if func.is_view else [func.__name__.split(".")[0]])
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        for T in (1, 5):
            q = (torch.randn(3, T, 4, 16) * 4).to(dtype).transpose(1, 2)  # [B, H, T, D], as q_proj's view makes it
            k = (torch.randn(3, T, 2, 16) * 4).to(dtype).transpose(1, 2)
            pos = torch.arange(90, 90 + T) + torch.tensor([0, 37, 501])[:, None]
            cos, sin = lm.model.rotary_emb(q, pos)
            (q1, k1), (q2, k2) = own(q, k, cos, sin), rotary(q, k, cos, sin)
            assert torch.equal(q1, q2) and torch.equal(k1, k2) and q2.shape == q.shape and k2.shape == k.shape
            assert q1.dtype == q2.dtype and (q1 != 0).all()
    q, k, (cos, sin) = q[:, :, :1], k[:, :, :1], (t[:, :1] for t in (cos, sin))  # a decoding step's one token
    for fn in (own, rotary, rotary):  # the second call of the step's: its signed sine made once
        ops.clear()
        with Ops():
            fn(q, k, cos, sin)
        if fn is own:
            assert len(ops) == 10 and ops.count("neg") == 2
    assert len(ops) == 5 and "neg" not in ops
    ids = torch.randint(0, lm.config.vocab_size, (2, 9))
    with torch.no_grad():
        plain = lm(ids).logits
        with cut_kernels(lm):
            assert module.apply_rotary_pos_emb is not own
            holder = torch.nn.Sequential(torch.nn.Linear(2, 2), lm.model.layers[0].self_attn)  # a second holder
            with cut_kernels(holder):
                pass
            assert module.apply_rotary_pos_emb is not own
            cut = lm(ids).logits
            one = lm(ids[:, :1]).logits  # one token a row: the step's shape, its signed sine made once
        assert module.apply_rotary_pos_emb is own
        assert torch.equal(plain, cut) and torch.equal(lm(ids[:, :1]).logits, one)


def _rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def _rotary_cast_first(q, k, cos, sin, unsqueeze_dim=1):
    q, k = q.float(), k.float()  # a preamble: another computation, whatever follows
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)  # noqa: F821
    k_embed = (k * cos) + (rotate_half(k) * sin)  # noqa: F821
    return q_embed, k_embed


def test_once_keeps_what_every_layer_reads_and_the_rotary_cut_takes_only_llamas_code():
    """cuts.once keeps the most recently used: the step's signed sine, read by every layer, is made once however many
    other things the layers make anew (with several sizes of slot each layer slices its mask per tier: a new key per
    tier and layer, which pushed the sine out of a first-in-first-out list of 8). A module whose rotary differs from
    Llama's anywhere (here a cast before the same statements) keeps its own."""
    import types

    from fast import cuts

    cuts._ONCE.clear()
    shared, made = torch.zeros(1, 1), []
    for _ in range(40):
        cuts.once((shared, "signed"), lambda: made.append(1) or torch.ones(1))
        for tier in range(3):
            cuts.once((torch.zeros(1, 1), tier), lambda: torch.ones(1))
    assert len(made) == 1
    cuts._ONCE.clear()
    llama = types.SimpleNamespace(apply_rotary_pos_emb=cuts.rotary, rotate_half=_rotate_half)
    assert not cuts._llama_rotary(llama)  # (cuts.rotary is not Llama's code either)
    import transformers.models.qwen3.modeling_qwen3 as qwen3
    assert cuts._llama_rotary(types.SimpleNamespace(apply_rotary_pos_emb=qwen3.apply_rotary_pos_emb,
                                                    rotate_half=_rotate_half))
    assert not cuts._llama_rotary(types.SimpleNamespace(apply_rotary_pos_emb=_rotary_cast_first,
                                                        rotate_half=_rotate_half))
