"""The batched decoding engine under batched_rollout.rollout: each live episode (a row) keeps its KV cache across turns,
the rows decode together, and a row that ends its turn leaves the batch with its cache.

`generate_turn` decodes the current agent turn of a batch of rows: it prefills what each row has not seen (in
column chunks of `prefill_tokens`), stacks the rows' parked caches into preallocated buffers (`_stack_cache`,
`_BufferLayer`), decodes one column a step, and parks a row's cache (`_park`, without padding holes) when it stops
or when the call returns. `_prefill_openings` prefills a task's opening once for its group. Each decoding step
(the decoder's forward for one token a row, its attention, the draw) is decode.py's. The episode loop that drives
it (tools, users, rewards) is batched_rollout.py; the settings are batched_rollout.RolloutConfig (read here by
attribute).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicLayer

from decode import decode_attention, decode_step, with_cache


# ---------------------------------------------------------------------------------------------------------
# Batched decoding with a per-episode KV cache
# ---------------------------------------------------------------------------------------------------------
@dataclass
class _Row:
    """A live episode: its record, environment session, user-simulator state and parked KV cache."""

    ep: Any  # muarl.Episode
    session: Any
    user: Any
    kv: list | None = None  # per layer (keys, values), each [kv_heads, kv_len, head_dim], no padding holes
    new_ids: list[int] = field(default_factory=list)  # this turn's sampled tokens
    new_logprobs: list[float] = field(default_factory=list)
    stop: str = ""  # why this turn's decoding stopped: eot (any stop token) | max_new_tokens | context
    seed: int = 0  # this episode's sampling seed (batched_rollout.episode_seed): its noise is uniform_noise(seed, pos)
    retries_seen: int = 0  # the user state's retry count already added to ep.user_retries

    @property
    def kv_len(self) -> int:
        return 0 if self.kv is None else self.kv[0][0].shape[-2]


class _BufferLayer(DynamicLayer):
    """A cache layer that writes into a preallocated [batch, kv_heads, capacity, head_dim] buffer. transformers'
    DynamicLayer concatenates at every step, i.e. reallocates and copies the whole batch's cache per sampled token,
    which made batched decoding memory-bound here; the buffer is sized for the whole turn when it is stacked.
    The layer's keys and values are the view kbuf[:, :, start:n]: `start` moves right (drop_left) when the rows
    still decoding no longer need the leading padding columns, so attention stops paying for them."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, length: int):
        super().__init__()
        self.kbuf, self.vbuf, self.start, self.n = keys, values, 0, length
        self.dtype, self.device, self.is_initialized = keys.dtype, keys.device, True
        self._view()

    def _view(self):
        self.keys, self.values = self.kbuf[:, :, self.start:self.n], self.vbuf[:, :, self.start:self.n]

    def update(self, key_states, value_states, *args, **kwargs):
        q = key_states.shape[-2]
        if self.n + q > self.kbuf.shape[-2]:  # not expected (the turn's budget is known); grow by doubling
            pad = torch.zeros_like(self.kbuf[:, :, :max(q, self.kbuf.shape[-2])])
            self.kbuf, self.vbuf = torch.cat([self.kbuf, pad], 2), torch.cat([self.vbuf, pad], 2)
        self.kbuf[:, :, self.n:self.n + q] = key_states
        self.vbuf[:, :, self.n:self.n + q] = value_states
        self.n += q
        self._view()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.n - self.start

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the rows `indices`, in that order, in the first len(indices) rows of the buffer (a view). Only rows
        that change place are copied (transformers' default copies the whole cache each time a row leaves, which
        cost here about a third of what attention did); _fill_holes gives an order that moves few."""
        moved = [p for p, i in enumerate(indices.tolist()) if p != i]
        if moved:
            src, used = indices[moved], slice(self.start, self.n)
            self.kbuf[moved, :, used] = self.kbuf[src, :, used]
            self.vbuf[moved, :, used] = self.vbuf[src, :, used]
        self.kbuf, self.vbuf = self.kbuf[:len(indices)], self.vbuf[:len(indices)]
        self._view()

    def drop_left(self, columns: int) -> None:
        """Forget the first `columns` cache positions (padding that no remaining row attends to)."""
        self.start += columns
        self._view()


def _fill_holes(n: int, done: list[int]) -> list[int]:
    """Which of n batch rows to keep, in what order, when the rows `done` leave: kept rows stay in their place and
    the last kept rows move into the holes that leaving rows open in front of them (one row copied per leaver)."""
    keep = [j for j in range(n) if j not in done]
    order = list(range(len(keep)))
    holes = [j for j in done if j < len(keep)]
    for hole, j in zip(holes, [j for j in keep if j >= len(keep)]):
        order[hole] = j
    return order


def _stack_cache(model, rows: list[_Row], pending: list[list[int]], room: int, eot: int):
    """One cache for a batch of rows, and the inputs that feed it each row's pending tokens. Returns the cache, the
    input ids [B, W], the attention mask [B, L + W] and the positions [B, W]. Batch layout, row i, along the cache
    axis (positions are explicit, per row, so padding costs no position):
        [0 .. 0 | parked cache (kv_len_i) | pending (P_i) | pad .. pad | `room` columns for sampled tokens]
    Zeros rather than garbage left of a parked cache (masked out, but 0 * NaN would poison attention). The pending
    tokens are right-padded so that a pad slot always sees real tokens of its row (else a NaN query). Each row's
    parked copy of a layer is released as soon as it is in the buffer, so that the parked copies and the buffers
    are not both held whole: the peak is the buffers plus one layer of copies (the rows' kv is consumed)."""
    cfg = model.config.get_text_config(decoder=True)
    if any(t != "full_attention" for t in getattr(cfg, "layer_types", None) or []):
        raise NotImplementedError("rollout's padded KV cache supports full-attention models only")
    lens, (dtype, device) = [r.kv_len for r in rows], _compute_dtype_device(model)
    L, W, B = max(lens), max(len(p) for p in pending), len(rows)
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    layers = []
    for layer in range(cfg.num_hidden_layers):
        keys = torch.zeros(B, kv_heads, L + W + room, head_dim, dtype=dtype, device=device)
        values = torch.zeros_like(keys)
        for i, r in enumerate(rows):
            if lens[i]:
                keys[i, :, L - lens[i]:L] = r.kv[layer][0]
                values[i, :, L - lens[i]:L] = r.kv[layer][1]
                r.kv[layer] = None  # in the buffer now: free the copy before the next layer's buffer is made
        layers.append(_BufferLayer(keys, values, L))
    ids = torch.full((B, W), eot, dtype=torch.long)
    mask = torch.zeros(B, L + W, dtype=torch.long)
    for i, p in enumerate(pending):
        ids[i, :len(p)] = torch.tensor(p)
        mask[i, L - lens[i]:L + len(p)] = 1
    pos = torch.tensor(lens)[:, None] + torch.arange(W)[None, :]
    return Cache(layers=layers), ids.to(device), mask.to(device), pos.to(device)


def _compute_dtype_device(model) -> tuple[torch.dtype, torch.device]:
    """The dtype attention's keys and values are used in, and the device: autocast's dtype when it is on (a --bf16
    run keeps fp32 master weights and computes in bf16, so a parameter's dtype would make its cache fp32, twice the
    memory), else the weights' dtype as the forward sees them (under FSDP2, gathered in the mixed-precision dtype)."""
    weight = model.get_input_embeddings().weight
    if torch.is_autocast_enabled(weight.device.type):
        return torch.get_autocast_dtype(weight.device.type), weight.device
    return weight.dtype, weight.device


def _park(row: _Row, cache: Cache, mask: torch.Tensor, j: int, device: str = "") -> None:
    """Copy batch row j's cache out to the row, without its holes (onto `device` when given:
    RolloutConfig.park_device)."""
    real = mask[j].nonzero().squeeze(1)  # one host sync a row (a boolean index would sync once per tensor)
    move = (lambda t: t.to(device)) if device else (lambda t: t)
    row.kv = [(move(lay.keys[j].index_select(1, real)), move(lay.values[j].index_select(1, real)))
              for lay in cache.layers]


def _prefill(model, rows: list[_Row], pending: list[list[int]], cfg, eot: int,
             park_device: str = "") -> None:
    """Feed each row its pending tokens (none sampled: the cache only), in one batch, in column chunks of at most
    cfg.prefill_tokens tokens a forward, and park each row's cache on it."""
    dec = model.get_decoder()
    cache, ids, mask, pos = _stack_cache(model, rows, pending, 0, eot)
    L, W = mask.shape[1] - ids.shape[1], ids.shape[1]
    step = max(1, cfg.prefill_tokens // len(rows)) if cfg.prefill_tokens else W
    for c in range(0, W, step):  # each chunk attends to the cache so far and to itself (causally)
        dec(input_ids=ids[:, c:c + step], attention_mask=mask[:, :L + c + step], position_ids=pos[:, c:c + step],
            **with_cache(dec, cache))
    for j, r in enumerate(rows):
        _park(r, cache, mask, j, park_device)


@torch.no_grad()
def _prefill_openings(model, groups: list[list[_Row]], cfg, eot: int) -> None:
    """Each task's opening (system prompt with tools, first user message: ~4.7k tokens for tau2 retail with Qwen3)
    is prefilled once for its group: the first episode's cache is computed, its siblings get the same tensors
    (read-only: stacking copies them into the decoding buffers), and every episode starts by decoding."""
    leaders = [g[0] for g in groups if len(g[0].ep.input_ids) > 1]
    n = cfg.max_batch or max(1, len(leaders))
    for i in range(0, len(leaders), n):
        part = leaders[i:i + n]
        _prefill(model, part, [r.ep.input_ids[:-1] for r in part], cfg, eot, cfg.park_device)
    for g in groups:
        if g[0].kv is not None:
            for r in g[1:]:
                r.kv = list(g[0].kv)


@torch.no_grad()
def generate_turn(model, rows: list[_Row], cfg, stops: list[int], ready=None) -> None:
    """Decode the current agent turn of every row, together, until fewer than cfg.refill_below of the rows are
    still decoding. A row whose turn ends gets row.stop; a row still mid-turn keeps stop == "" and its partial
    new_ids / new_logprobs, and the next call continues it (its last sampled token is its pending input). Either
    way the row's cache (everything but its last sampled token) is parked in row.kv.

    The rows with more than one pending token (a new turn: the last sampled token and the tool results or user
    reply) are prefilled first, all but that last token, in a batch of their own, so that the rows continuing
    mid-turn (one pending token) pay no padding for them. Then all rows decode together, one column per step;
    a row that stops leaves the batch (Cache.batch_select_indices). A turn ends on any token of `stops`
    (muarl.stop_token_ids: the end-of-turn token first, which also fills padding slots, then the model's
    generation-config eos ids). `ready` (a callable: how many other rows are ready to join) also ends the call
    when at least max(1, refill_below x the rows still decoding) could join it (the caller re-stacks them in)."""
    eot, stops = stops[0], set(stops)
    for r in rows:  # a row whose previous turn ended (stop set) starts a new one
        if r.stop:
            r.new_ids, r.new_logprobs, r.stop = [], [], ""
    pending = [(r.ep.input_ids + r.new_ids)[r.kv_len:] for r in rows]
    new = [(r, p[:-1]) for r, p in zip(rows, pending) if len(p) > 1]
    if new:  # (its buffers are freed before the decoding batch's are allocated)
        _prefill(model, [r for r, _ in new], [p for _, p in new], cfg, eot)
    budget = [min(cfg.max_new_tokens, cfg.max_context - len(r.ep.input_ids)) for r in rows]
    room = max(b - len(r.new_ids) for b, r in zip(budget, rows))
    cache, tok, mask, pos = _stack_cache(model, rows, [p[-1:] for p in pending], room, eot)
    for r in rows:  # the batch's buffers hold the caches now; each row is parked again when it leaves the batch
        r.kv = None
    active, B = list(range(len(rows))), len(rows)  # batch position -> index into rows
    seeds = torch.tensor([r.seed for r in rows], device=tok.device)  # each row's noise: its seed, the position drawn
    with decode_attention(model, cfg.decode_attention):  # the decoding steps' attention (prefill keeps its own)
        while True:
            tok, lp = decode_step(model, cache, tok, mask, pos, seeds, cfg)
            done = []
            # one device-to-host copy a step (token ids are exact in float32): the loop's only per-step host sync
            drawn, logps = torch.stack([tok.float(), lp]).tolist()
            for j, (t, l) in enumerate(zip(map(int, drawn), logps)):
                r = rows[active[j]]
                r.new_ids.append(t)
                r.new_logprobs.append(l)
                if t in stops:
                    r.stop = "eot"
                elif len(r.new_ids) >= budget[active[j]]:
                    full = len(r.ep.input_ids) + len(r.new_ids) >= cfg.max_context
                    r.stop = "context" if full else "max_new_tokens"
                if r.stop:
                    done.append(j)
            still = len(active) - len(done)
            refill = not still or still < cfg.refill_below * B  # return, parking the rest mid-turn
            if not refill and ready is not None and cfg.refill_below > 0:  # or when enough rows wait to join
                joinable = min(ready(), (cfg.max_batch or 1 << 30) - still)
                refill = joinable >= max(1.0, cfg.refill_below * still)
            for j in range(len(active)) if refill else done:
                _park(rows[active[j]], cache, mask, j, cfg.park_device)
            if refill:
                return
            if done:
                keep = _fill_holes(len(active), done)
                keep_t = torch.tensor(keep, device=tok.device)
                cache.batch_select_indices(keep_t)
                mask, tok, pos, seeds = mask[keep_t], tok[keep_t], pos[keep_t], seeds[keep_t]
                active = [active[j] for j in keep]
                first = int(mask.any(0).nonzero()[0])  # leading columns that are padding in every remaining row
                if first:
                    mask = mask[:, first:]
                    for lay in cache.layers:
                        lay.drop_left(first)
            pos = pos[:, -1:] + 1  # every row still here took one token: computed on the device, no host copy
            mask, tok = torch.cat([mask, mask.new_ones(len(active), 1)], dim=1), tok[:, None]
