"""fast/decode.py: one decoding step of the batch, the rows' next tokens from their caches (engine.py drives it).

`decode_step` runs the decoder's forward for one new token a row (`decode_logits`) and draws each row's token
(`_sample`). The engine's attention is `grouped_decode_attention`, registered with transformers and switched on for
the engine's forwards only (`decode_attention`): each row attends to its own slot of the cache (pool.SlotPool)
through a boolean mask, and the query heads that share a key-value head read its cache once, where transformers'
padded sdpa and eager paths first copy the cache to every query head. The draw inverts each row's
cumulative distribution at a uniform that is a function of the episode's seed and the position drawn
(`uniform_noise`, counter-based), so a batch draws in a few kernels and an episode samples the same tokens however
it was batched; nucleus sampling finds its cut in one sort of each row (`top_p_keep`); `compile_decode`: decode_step.
"""
from __future__ import annotations

import contextlib
import inspect
import sys
import time
import warnings

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache

from fast import cuts
from fast.cuts import cut_kernels, once


# ---------------------------------------------------------------------------------------------------------
# Attention: each row's cache read once, whatever the number of query heads per key-value head
# ---------------------------------------------------------------------------------------------------------
GROUPED = "muarl_grouped_decode"


def grouped_decode_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention of each row's W new tokens over its slot of the cache (engine.py), for prefill and the decoding
    steps (RolloutConfig.decode_attention "grouped"). With a padding mask, transformers 5.17's sdpa path (the GPU
    machines'; 5.24 packs one query token's heads itself) and every version's eager path copy each key-value head to
    its n_rep query heads (repeat_kv) before attending: the cache is read and written n_rep + 2 times a step (4-10x
    for Qwen3's 2-8 query heads per key-value head). Here the n_rep query heads that share a key-value head are the
    query rows of one SDPA call over that head's keys, so each row's cache is read once, by torch's fused kernels,
    which accumulate in float32 as the trainer's attention does. query [B, H, W, D] (head h reads key-value head
    h // n_rep, as repeat_kv orders them); key, value [B, KVH, L, D]; attention_mask [B, 1, W, L] booleans, True
    where the query sees the column (each row's own length: engine._mask). Returns [B, W, H, D], as the other
    attention functions do. A sliding window is refused past its width (the slots have no per-row window)."""
    if isinstance(key, Parts):  # rows in several tiers of slots (pool.Tiers): each tier's rows over its own slots
        return torch.cat([grouped_decode_attention(module, query[at], k, v, attention_mask[at, ..., :k.shape[2]],
                                                   scaling, dropout, **kwargs)[0] for at, k, v in key]), None
    for name in ("softcap", "s_aux"):
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"decode_attention 'grouped' does not support {name} ({type(module).__name__}):"
                                      " use --decode-attention model")
    (B, H, W, D), (kvh, L) = query.shape, key.shape[1:3]
    if H % kvh or attention_mask is None or attention_mask.dtype != torch.bool or attention_mask.dim() != 4:
        raise ValueError(f"grouped attention takes whole groups of heads and a [B, 1, W, L] boolean mask, got query "
                         f"{tuple(query.shape)} over key {tuple(key.shape)}, mask "
                         f"{None if attention_mask is None else (attention_mask.dtype, tuple(attention_mask.shape))}")
    if dropout and module.training:
        raise ValueError("grouped decode attention is for decoding: the model is in training mode with dropout")
    window = kwargs.get("sliding_window")
    if window is not None and L > window:
        raise NotImplementedError(f"sliding-window attention ({window} positions) over a cache of {L}: the rollout's "
                                  "cache slots have no per-row window; use --max-context of at most the window")
    n_rep = H // kvh
    q = query.reshape(B, kvh, n_rep * W, D)  # row r * W + w of head group g: query head g * n_rep + r, token w
    mask = attention_mask.repeat(1, 1, n_rep, 1) if W > 1 else _additive(attention_mask, q.dtype) if cuts.ON \
        else attention_mask
    out = torch.nn.functional.scaled_dot_product_attention(q, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(B, H, W, D).transpose(1, 2), None


AttentionInterface.register(GROUPED, grouped_decode_attention)


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A decoding step's [B, 1, 1, L] boolean mask as the additive one SDPA makes of it in every layer, made at the
    step's first layer (every layer is handed the same mask object): 0 where seen, else the dtype's lowest (finite,
    as cuDNN needs; each row sees its newest token, so unseen columns weigh exactly 0 as with -inf)."""
    dev = mask.device.type
    dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else dtype  # (what SDPA would cast to)
    return once((mask, dtype, "additive"), lambda: torch.full(mask.shape, torch.finfo(dtype).min, dtype=dtype,
                                                              device=mask.device).masked_fill_(mask, 0))


class Parts(list):
    """The keys and values of a batch whose rows lie in several tiers of slots (pool.Tiers), as engine._SlotLayer
    returns them: (rows, keys, values) a tier, `rows` the slice of the batch in it, keys and values [b, KVH, L_t, D]
    (L_t: that tier's longest row). The attention functions here attend each part over its own slots."""


SCORES_BYTES = 1 << 28  # attend_lse written out: at most this many bytes of float32 scores at once
FUSED_LSE = True  # attend_lse through torch's fused kernels where they hold (False: the arithmetic written out)
FUSED_HOLDS: dict = {}  # (device type, dtype, head size) -> whether the fused kernel gives the written-out numbers


def attend_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sees: torch.Tensor, scale: float
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q [N, Hk, Q, D] over k, v [N, Hk, L, D] where `sees` ([N | 1, 1, Q | 1, L] booleans) allows, and
    each query's log-sum-exp of its scores (float32, [N, Hk, Q]): what two parts of one softmax need to be joined
    exactly. A fused kernel computes both where torch has one that returns the log-sum-exp (its public SDPA returns
    the output only): the CPU's flash kernel, CUDA's memory-efficient one, each checked once (`fused_holds`); q is
    cast to the cache's dtype first, as SDPA under autocast does. Elsewhere, or where the kernel raises, the
    arithmetic written out, in float32, in passes of queries whose scores fit SCORES_BYTES (a prefill chunk of 1k
    tokens over a 8k cache would otherwise hold gigabytes of scores)."""
    key = (q.device.type, k.dtype, q.shape[-1])
    if FUSED_LSE and k.dtype == v.dtype and key[0] in ("cpu", "cuda") and fused_holds(*key):
        try:
            return _fused(q.to(k.dtype), k, v, sees, scale)
        except torch.OutOfMemoryError:
            raise
        except RuntimeError as e:  # (a shape the check did not meet)
            _refuse(key, f"it raised {type(e).__name__}: {str(e)[:200]}")
    return _written(q, k, v, sees, scale)


def _fused(q, k, v, sees, scale):
    L, cpu = k.shape[2], q.device.type == "cpu"
    # the memory-efficient kernel reads a bias whose rows start at a multiple of 16 elements (SDPA pads it so too)
    # and returns the log-sum-exp over a query axis padded to a multiple of 32; the bias made once a step
    bias = once((sees, q.dtype), lambda: torch.zeros(*sees.shape[:-1], L if cpu else -(-L // 16) * 16, dtype=q.dtype,
                                                     device=q.device)[..., :L].masked_fill_(~sees, -torch.inf))
    if cpu:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=bias, scale=scale)[:2]
        return out.float(), lse
    out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, bias.expand(*q.shape[:3], L), True,
                                                                      scale=scale)[:2]
    return out.float(), lse[..., :q.shape[2]].float()


def _written(q, k, v, sees, scale):
    (N, Hk, Q, _), L = q.shape, k.shape[2]
    step = max(1, SCORES_BYTES // (N * Hk * L * 4))  # queries a pass: a prefill's scores in float32 kept bounded
    outs, lses = [], []
    with torch.autocast(q.device.type, enabled=False):  # (a rollout under autocast would round these to bf16)
        kf, vf = k.float().transpose(-1, -2), v.float()
        hidden = once((sees, "hidden"), lambda: ~sees)  # (made once a step)
        for i in range(0, Q, step):
            part = hidden[:, :, i:i + step] if sees.shape[2] > 1 else hidden
            scores = (torch.matmul(q[:, :, i:i + step].float(), kf) * scale).masked_fill(part, -torch.inf)
            lses.append(torch.logsumexp(scores, -1))
            outs.append(torch.matmul(torch.exp(scores - lses[-1][..., None]), vf))
    return torch.cat(outs, 2), torch.cat(lses, 2)


def fused_holds(device: str, dtype: torch.dtype, head: int) -> bool:
    """Whether the fused kernel gives the written-out arithmetic's output and log-sum-exp (natural log) on this
    device type, dtype and head size: checked once, on a small random case with columns masked and a row that sees
    none (an empty opening: weight 0 either way), outside any graph capture (the graphed step runs its body eagerly
    before capturing it). Where it does not, or raises, one warning, and the arithmetic is written out from then on."""
    key = (device, dtype, head)
    if key not in FUSED_HOLDS:
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(3, 2, n, head, generator=g).to(device, dtype) for n in (3, 40, 40))
        sees = (torch.arange(40) < torch.tensor([[17], [40], [0]]))[:, None, None].to(device)  # [3, 1, 1, 40]
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        try:
            (o, lse), (o_ref, lse_ref) = (_empty(*f(q, k, v, sees, head ** -0.5), sees) for f in (_fused, _written))
            FUSED_HOLDS[key] = torch.allclose(o, o_ref, atol=tol, rtol=tol) and torch.allclose(lse, lse_ref, atol=tol)
            if not FUSED_HOLDS[key]:
                _refuse(key, f"its numbers differ (output by {(o - o_ref).abs().max():.3g}, log-sum-exp by "
                             f"{(lse - lse_ref).nan_to_num().abs().max():.3g})")
        except Exception as e:  # noqa: BLE001 (a kernel missing, a keyword this torch lacks: written out instead)
            _refuse(key, f"it raised {type(e).__name__}: {str(e)[:200]}")
    return FUSED_HOLDS[key]


def _refuse(key: tuple, why: str) -> None:
    warnings.warn(f"the openings' attention: torch's fused kernel on {key[0]} at {key[1]}, head size {key[2]}, is not "
                  f"used ({why}); its two parts are written out in float32")
    FUSED_HOLDS[key] = False


def _empty(out: torch.Tensor, lse: torch.Tensor, sees: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A query that sees no column (an empty opening) as weight 0: its output 0, its log-sum-exp -inf (the written
    arithmetic gives NaN there, the CPU's flash kernel 0 and 0: a weight of e^0 to a zero output)."""
    none = once((sees, "none"), lambda: ~sees.any(-1))  # [N | 1, 1, Q | 1]
    return out.masked_fill(none[..., None], 0), lse.masked_fill(none, -torch.inf)


OPENING = "muarl_opening_decode"  # fast/opening.py's opening_decode_attention, registered there
_OPENINGS: list = []  # while the engine's forward runs over rows whose openings are held apart: (keys, values, Members)


@contextlib.contextmanager
def decode_attention(model, name: str, openings: tuple | None = None):
    """The decoder's attention implementation set to `name` for the rollout engine's forwards, prefill and decoding
    ("model": left as it is, sdpa or eager, which take the engine's 4-D mask as an additive float mask), and put
    back after, also when decoding raises. With `openings` ((keys, values) per layer of the batch's openings, and
    their `Members`), "grouped" reads each row's group's opening held apart (opening_decode_attention)."""
    cfg = model.get_decoder().config
    if openings is not None and name != "grouped":
        raise ValueError(f"the openings held apart are read by decode_attention 'grouped' only, not {name!r}")
    if name == "model":
        if cfg._attn_implementation not in ("sdpa", "eager"):
            raise NotImplementedError(f"--decode-attention model takes the engine's 4-D mask, which "
                                      f"{cfg._attn_implementation} does not: use --decode-attention grouped")
        if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True):
            raise NotImplementedError("--decode-attention model: the engine's 4-D mask would skip the model's "
                                      f"sliding window ({cfg.sliding_window}): use --decode-attention grouped")
        yield
        return
    if name != "grouped":
        raise ValueError(f"unknown decode_attention {name!r}: use 'grouped' or 'model'")
    if getattr(cfg, "attn_logit_softcapping", None):
        raise NotImplementedError(f"decode_attention 'grouped' does not softcap attention logits ({cfg.model_type}): "
                                  "use --decode-attention model")
    before = cfg._attn_implementation_internal  # (set and put back on this config alone: the modules read it)
    cfg._attn_implementation_internal = GROUPED if openings is None else OPENING
    _OPENINGS.append(openings)
    try:
        with cut_kernels(model):
            yield
    finally:
        cfg._attn_implementation_internal = before
        _OPENINGS.pop()


# ---------------------------------------------------------------------------------------------------------
# The draw and the step
# ---------------------------------------------------------------------------------------------------------
def _signed(x: int) -> int:
    """A 64-bit constant as the int64 torch computes with (two's complement: its products wrap as uint64's do)."""
    return x - (1 << 64) if x >= 1 << 63 else x


_GOLDEN, _MIX1, _MIX2 = map(_signed, (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


def _shr(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic: it copies the sign bit)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer: a bijection of 64-bit words whose every output bit depends on every input bit."""
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    return z ^ _shr(z, 31)


def uniform_noise(seeds: torch.Tensor, counters: torch.Tensor, n: int) -> torch.Tensor:
    """[B, n] float64 uniforms in (0, 1), a pure function of each row's (seed, counter) and the column: counter-based
    noise, as Philox is, made of integer ops over the whole batch at once. A row's draws do not depend on the other
    rows, nor on how many draws came before: the rollout passes the episode's seed and the position of the token
    being drawn, so an episode samples the same tokens however it was batched. 53 random bits each."""
    key = _mix(seeds.long() + counters.long() * _GOLDEN)
    z = _mix(key[:, None] + torch.arange(1, n + 1, device=seeds.device) * _GOLDEN)
    return (_shr(z, 11).double() + 0.5) * 2.0 ** -53


def top_p_keep(p: torch.Tensor, top_p: float) -> torch.Tensor:
    """Which tokens nucleus sampling keeps, [B, V] boolean: every token at least as probable as the cut, the
    probability at which the row's mass, summed from the most probable token down, first reaches top_p (the smallest
    set by probability that reaches top_p). Tokens tied at the cut are all kept (a sort that stops at top_p keeps those
    first in its order). One sort of each row and a cumulative sum: ~7 kernels whatever the vocabulary, where a
    bisection for the cut took 2 passes over [B, V] per halving (~370 kernels for 40)."""
    p = p.double()
    desc = p.sort(-1, descending=True).values
    reached = desc.cumsum(-1) >= top_p
    reached[:, -1] = True  # (a row whose mass rounds below top_p keeps every token it can draw)
    return p >= desc.gather(-1, reached.byte().argmax(-1, keepdim=True))


def _sample(logits: torch.Tensor, cfg, seeds: torch.Tensor | None = None,
            counters: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [B, V] float32 -> (token ids [B], recorded logprobs [B]), on the logits' device, for the whole batch
    in a few kernels (no host sync, no per-row launch).

    The recorded logprob is log_softmax(logits / temperature) of the drawn token: the distribution a trainer
    recomputes with one forward pass. top_p truncation changes what is drawn, not what is recorded, so that
    old and new policy logprobs in the GRPO ratio mean the same thing. A token is drawn by inverting the
    cumulative distribution (in vocabulary order, float64: a token ~20 nats below the top one keeps its 2e-9 of
    the interval) at one uniform a row, uniform_noise(seeds[i], counters[i]) (the episode's seed and the position
    drawn; None: torch's global generator): one random number a row, and ~5 passes over the vocabulary (plus
    top_p_keep's sort when top_p < 1)."""
    logp = torch.log_softmax(logits / cfg.temperature, dim=-1)
    if cfg.greedy:
        tok = logits.argmax(dim=-1)
    else:
        p = logp.double().exp()
        if cfg.top_p < 1.0:
            p = torch.where(top_p_keep(p, cfg.top_p), p, 0.0)
        cdf = p.cumsum(-1)
        if seeds is None:
            u = torch.rand(len(p), 1, device=p.device, dtype=torch.float64)
        else:
            u = uniform_noise(seeds, counters, 1)
        tok = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(1)  # the first token whose cdf passes u
        last = torch.where(p > 0, torch.arange(p.shape[-1], device=p.device), 0).amax(-1)
        tok = torch.minimum(tok, last)  # u x mass rounded up to the whole mass: the last token that can be drawn
    return tok, logp.gather(-1, tok[:, None]).squeeze(1)


def with_cache(decoder, cache: Cache) -> dict:
    """The keyword arguments that hand `cache` to `decoder`'s forward: `cache=` where its forward takes that name
    (newer transformers, which warns on the old name and drops it in 5.40), else `past_key_values=` (5.17, whose
    forward would pass an unknown `cache=` on into **kwargs and ignore it: each turn would decode without its past)."""
    cls = type(decoder)
    if cls not in _CACHE_KEYWORD:  # asked once per class: inspect.signature costs as much as a small op
        _CACHE_KEYWORD[cls] = "cache" if "cache" in inspect.signature(cls.forward).parameters else "past_key_values"
    return {_CACHE_KEYWORD[cls]: cache, "use_cache": True}


_CACHE_KEYWORD: dict[type, str] = {}


def decode_logits(model, cache: Cache, tok: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """One decoding step of the batch: tok [B, 1] in, each row's next-token logits [B, V] (float32) out, its keys
    and values written to `cache` (engine._SlotLayer). mask [B, 1, 1, L] booleans: the columns each row attends to
    (transformers hands a 4-D mask to the attention function as it is); pos [B, 1]: each row's position."""
    dec = model.get_decoder()
    h = dec(input_ids=tok, position_ids=pos, attention_mask=mask, **with_cache(dec, cache)).last_hidden_state
    return model.get_output_embeddings()(h[:, -1]).float()


_COMPILED: dict = {}  # "logits": decode_logits under torch.compile; "failed": why compiling it failed; "timed": its s


def decode_step(model, cache: Cache, tok, mask, pos, seeds, cfg) -> tuple[torch.Tensor, torch.Tensor]:
    """One decoding step of the batch and its draw: each row's next token [B] and its recorded logprob [B], on the
    device. The decoder's forward goes through torch.compile where cfg.compile_decode asks for it ('on'; 'auto': on
    a GPU; off by default until bench/gpu.py's roofline check has timed it on one): inductor fuses its ~60 small
    kernels a layer. Shapes are dynamic (batch, cache length), so a rollout compiles a few times at most, the first
    time printing how long it took (inductor also caches on disk for the next process); past dynamo's recompile
    limit it runs the step eagerly, with its own warning. The draw stays eager: inductor's CPU kernel for an earlier
    draw (an argmax over float64 rows whose length is not a multiple of its vector width) stopped the process on an
    index past the row (torch 2.13). Where compiling fails (dynamo or inductor raising: no compiler, an unsupported
    model) it warns once and decodes eagerly from then on (the eager call rewrites the step's keys and values in the
    same columns); any other error is raised."""
    on = cfg.compile_decode == "on" or cfg.compile_decode == "auto" and tok.device.type == "cuda"
    if not on or "failed" in _COMPILED:
        return _sample(decode_logits(model, cache, tok, mask, pos), cfg, seeds, pos[:, -1] + 1)
    if "logits" not in _COMPILED:
        _COMPILED["logits"] = torch.compile(decode_logits, dynamic=True)
    t = time.perf_counter()
    try:
        logits = _COMPILED["logits"](model, cache, tok, mask, pos)
    except torch._dynamo.exc.TorchDynamoException as e:  # (dynamo's and inductor's; anything else is not compile's)
        _COMPILED["failed"] = f"{type(e).__name__}: {e}"  # (the cache's writes are redone by the eager call)
        warnings.warn(f"compiling the decoding step failed ({_COMPILED['failed'][:300]}); decoding eagerly from now "
                      "on (--compile-decode off skips the attempt)")
        logits = decode_logits(model, cache, tok, mask, pos)
    if "timed" not in _COMPILED and "failed" not in _COMPILED:
        _COMPILED["timed"] = time.perf_counter() - t
        print(f"[rollout] decoding step compiled in {_COMPILED['timed']:.1f} s (torch.compile)", file=sys.stderr)
    return _sample(logits, cfg, seeds, pos[:, -1] + 1)
