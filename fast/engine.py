"""The batched decoding engine under batched_rollout.rollout: each live episode (a row) keeps its KV cache in a slot
of one preallocated pool across turns (pool.SlotPool; or of a few sizes, pool.Tiers: then each size's rows are one
part of the batch, placed by `admit` and `_arrange`), and the rows decode together. Each row writes its new keys
and values at its own length (`_SlotLayer`), and attends through a boolean mask [B, 1, W, L] built from the
lengths, with decode.py's attention.

`generate_turn` decodes the current agent turn of a batch: it prefills what each row has not seen (all rows at once,
each from its own length, in column chunks of `prefill_tokens`), then decodes one token a row a step; a row that
stops leaves the batch by trading slots with the last row of its pool. `_prefill_openings` prefills a task's opening
once for its group. Each decoding step (the decoder's forward, the draw) is decode.py's, or graphs.py's over fixed
buffers. The episode loop that drives it (tools, users, rewards) is batched_rollout.py; the settings are
batched_rollout.RolloutConfig.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicLayer

from fast.cuts import cut_kernels
from fast.decode import Parts, decode_attention, decode_step, with_cache
from fast.opening import Members
from fast.pool import Opening, SlotPool, Tiers, _Spilled
from muarl import TurnEnd


# ---------------------------------------------------------------------------------------------------------
# A row, and what a forward over slots reads and writes
# ---------------------------------------------------------------------------------------------------------
@dataclass(eq=False)
class _Row:
    """A live episode: its record, environment session, user-simulator state and where its KV cache is."""

    ep: Any  # muarl.Episode
    session: Any
    user: Any
    pool: Any = None  # the SlotPool its cache lives in, once it has one
    slot: int = -1  # its slot in the pool (-1: none: its cache is spilled or empty)
    kv_len: int = 0  # positions of the conversation in its cache
    spilled: _Spilled | None = None  # its cache while it has no slot
    new_ids: list[int] = field(default_factory=list)  # this turn's sampled tokens
    new_logprobs: list[float] = field(default_factory=list)
    turn_end: TurnEnd | None = None  # why this turn's decoding stopped; None while the turn goes on
    seed: int = 0  # this episode's sampling seed (batched_rollout.episode_seed): its noise is uniform_noise(seed, pos)
    retries_seen: int = 0  # the user state's retry count already added to ep.user_retries
    opening: Opening | None = None  # its group's opening when held once (decode_share_opening): its slot holds the rest

    @property
    def base(self) -> int:
        """Positions before the row's own slot: its group's opening when held apart, else none."""
        return self.opening.kv_len if self.opening is not None else 0

    @property
    def held(self) -> int:
        """Positions in the row's own slot (what the pool moves, spills and brings back)."""
        return self.kv_len - self.base

    def free_cache(self, ended: bool = True) -> None:
        """Forget the cache: the slot is free. `ended`: the episode ended (it lets go of its group's opening too); else
        its next turn re-encodes the conversation (after the opening, when it is held apart)."""
        if self.slot >= 0:
            self.pool.owner[self.slot] = None
        if self.spilled is not None:
            self.spilled.drop()
        self.slot, self.spilled = -1, None
        if self.opening is not None and ended:
            self.opening.release()
            self.opening = None
        self.kv_len = self.base


class _View:
    """Where a forward over slots lo..lo+B-1 of `pool` writes and what it reads (`set` before each forward): rows
    [B, 1] (slot indices), cols [B, W] (each row's columns for its W new positions, the padding's past capacity sent
    to the scratch column) and the L leading columns the attention sees. `at`: which rows of the forward's batch
    these are (with slots sized by need, each tier's rows are one view)."""

    def __init__(self, pool: SlotPool, lo: int, at: slice = slice(None)):
        self.pool, self.lo, self.at = pool, lo, at

    def set(self, lens: torch.Tensor, width: int, seen: int) -> _View:
        self.rows = torch.arange(self.lo, self.lo + len(lens), device=lens.device)[:, None]
        self.cols = (lens[:, None] + torch.arange(width, device=lens.device)).clamp(max=self.pool.capacity - 1)
        self.hi, self.seen = self.lo + len(lens), min(seen, self.pool.capacity)
        return self


class _SlotLayer(DynamicLayer):
    """One layer of the pool as transformers' cache layer: update() writes each row's new keys and values at its own
    columns and returns the batch's slots, L columns wide (the mask says which columns each query sees); with rows
    in several tiers (pool.Tiers), each tier's slots as decode.Parts, which decode.py's attention reads part by part."""

    def __init__(self, parts: list[tuple[torch.Tensor, torch.Tensor, _View]]):
        super().__init__()
        self.parts = parts
        self.dtype, self.device, self.is_initialized = parts[0][0].dtype, parts[0][0].device, True

    def update(self, key_states, value_states, *args, **kwargs):
        out = Parts()
        for kbuf, vbuf, v in self.parts:
            kbuf[v.rows, :, v.cols] = key_states[v.at].transpose(1, 2).to(self.dtype)  # [B, W, kv_heads, head_dim]
            vbuf[v.rows, :, v.cols] = value_states[v.at].transpose(1, 2).to(self.dtype)
            out.append((v.at, kbuf[v.lo:v.hi, :, :v.seen], vbuf[v.lo:v.hi, :, :v.seen]))
        if len(out) == 1:
            self.keys, self.values = out[0][1:]
            return self.keys, self.values
        return out, out

    def get_seq_length(self) -> int:
        return max(v.seen for _, _, v in self.parts)


def _cache(views: list[_View]) -> Cache:
    """The cache a forward over `views` (one a tier with rows in the batch) writes and reads."""
    return Cache(layers=[_SlotLayer([(v.pool.k[i], v.pool.v[i], v) for v in views])
                         for i in range(len(views[0].pool.k))])


def _mask(lens: torch.Tensor, width: int, seen: int, pool: SlotPool, cfg) -> torch.Tensor:
    """[B, 1, W, L] booleans: query w of row i (position lens[i] + w) sees columns up to its own position; for the
    model's own attention (decode_attention "model": sdpa, eager) as an additive mask in the cache's dtype."""
    q = lens[:, None, None] + torch.arange(width, device=lens.device)[None, :, None]
    mask = (torch.arange(seen, device=lens.device)[None, None, :] <= q)[:, None]
    if cfg.decode_attention == "model":
        return torch.zeros(mask.shape, dtype=pool.dtype, device=mask.device).masked_fill(~mask, torch.finfo(
            pool.dtype).min)
    return mask


# ---------------------------------------------------------------------------------------------------------
# Prefill and decoding
# ---------------------------------------------------------------------------------------------------------
def _prefill(model, pool: SlotPool, rows: list[_Row], pending: list[list[int]], cfg, eot: int,
             openings: tuple | None = None) -> None:
    """Feed rows (in slots lo..lo+B-1, slot order) their pending tokens (none sampled: the cache only), all rows at
    once, each from its own length, right-padded with eot (the padding writes past the row's length, where the row's
    next tokens overwrite it), in column chunks of at most cfg.prefill_tokens tokens a forward. With `openings`
    (`_openings`: decode_share_opening), the rows' slots hold what follows their group's opening, read from there."""
    dec, lo, device = model.get_decoder(), rows[0].slot, pool.device
    W = max(len(p) for p in pending)
    ids = torch.full((len(rows), W), eot, dtype=torch.long)
    for i, p in enumerate(pending):
        ids[i, :len(p)] = torch.tensor(p, dtype=torch.long)
    ids, host = ids.to(device), [r.held for r in rows]  # each row's own columns so far
    if max(n + len(p) for n, p in zip(host, pending)) > pool.capacity - 1:  # would reach the scratch column
        raise RuntimeError(f"prefill past the cache slots' {pool.capacity} positions (max_context)")
    view = _View(pool, lo)
    cache = _cache([view])
    bases = torch.tensor([r.base for r in rows], device=device)
    step = max(1, cfg.prefill_tokens // len(rows)) if cfg.prefill_tokens else W
    with decode_attention(model, cfg.decode_attention, openings):
        for c in range(0, W, step):  # each chunk attends to the cache so far and to itself (causally)
            w = min(step, W - c)
            lens = torch.tensor([n + c for n in host], device=device)
            view.set(lens, w, max(host) + c + w)
            dec(input_ids=ids[:, c:c + w], position_ids=(lens + bases)[:, None] + torch.arange(w, device=device),
                attention_mask=_mask(lens, w, view.seen, pool, cfg), **with_cache(dec, cache))
    for r, p in zip(rows, pending):
        r.kv_len += len(p)


def _openings(opens: SlotPool | None, rows: list[_Row], place: bool = True) -> tuple | None:
    """The batch's openings (decode_share_opening), and where each row stands among them (opening.Members); None
    without. `place`: put them in the openings' pool's slots 0..G-1 (G: the groups with rows in the batch), once a
    turn; else they are there already (rows that left, or a part of the batch)."""
    if opens is None:
        return None
    if place:
        opens.place(list({id(r.opening): r.opening for r in rows}.values()))
    slots = [r.opening.slot for r in rows]
    members = Members.of(slots, [opens.owner[g].kv_len for g in range(max(slots) + 1)], opens.device)
    return opens.k, opens.v, members


@torch.no_grad()
def _prefill_openings(model, pool: SlotPool | Tiers, groups: list[list[_Row]], cfg, eot: int) -> None:
    """Each task's opening (system prompt with tools, first user message: ~4.7k tokens for tau2 retail with Qwen3)
    is prefilled once for its group, in batches of the leaders (the first episode of each group), and copied into
    each sibling's slot (or, when the pool has no slot left, spilled once and shared read-only by the siblings). With
    the openings' pool (pool.opens: decode_share_opening), into a slot of that pool instead, once for the group."""
    if pool.opens is not None:
        return _prefill_shared_openings(model, pool.opens, groups, cfg, eot)
    leaders = [g[0] for g in groups if len(g[0].ep.input_ids) > 1]
    while leaders:
        batch, leaders = admit(pool, leaders, cfg.max_batch)
        for p, part in _arrange(pool, batch):
            _prefill(model, p, part, [r.ep.input_ids[:-1] for r in part], cfg, eot)
        for g in (g for g in groups if g[0] in batch):
            left = []
            for r in g[1:]:
                r.kv_len = g[0].kv_len
                if pool.acquire(r):  # its slot gets a copy of the leader's (in the tier that fits it)
                    g[0].pool.copy_slot(g[0].slot, r.slot, r.kv_len, into=r.pool)
                else:
                    left.append(r)
            if left:  # no slot left: one copy for the group's siblings without one
                shared = g[0].pool.copy_out(g[0].slot, g[0].kv_len, len(left))
                for r in left:
                    r.spilled = shared


def _prefill_shared_openings(model, opens: SlotPool, groups: list[list[_Row]], cfg, eot: int) -> None:
    """Each group's opening (all of its first message but the last token, which each row feeds itself) prefilled
    once into the openings' pool, as many at once as it has slots; every row of the group reads it from there."""
    ids = {}
    for g in groups:
        opening = Opening()
        opening.users = len(g)
        for r in g:
            r.opening = opening
        ids[id(opening)] = g[0].ep.input_ids[:-1]
    todo = [g[0].opening for g in groups if len(g[0].ep.input_ids) > 1]
    n = max(1, min(cfg.max_batch or len(todo), len(opens.owner)))
    for i in range(0, len(todo), n):
        part = opens.place(todo[i:i + n])
        _prefill(model, opens, part, [ids[id(o)] for o in part], cfg, eot)  # (the openings attend to themselves)
    for g in groups:
        for r in g:
            r.kv_len = r.base


@torch.no_grad()
def generate_turn(model, pool: SlotPool | Tiers, rows: list[_Row], cfg, stops: list[int], ready=None) -> None:
    with cut_kernels(model, cfg.decode_attention == "grouped"):  # once a turn, not each step (decode_attention)
        _generate_turn(model, pool, rows, cfg, stops, ready)


def _generate_turn(model, pool: SlotPool | Tiers, rows: list[_Row], cfg, stops: list[int], ready=None) -> None:
    """Decode the current agent turn of every row, together, until fewer than cfg.refill_below of the rows are
    still decoding. A row whose turn ends gets row.turn_end; a row still mid-turn keeps turn_end None and its partial
    new_ids / new_logprobs, and the next call continues it (its last sampled token is its pending input). Either
    way the row's cache (everything but its last sampled token) stays in its slot.

    The rows are placed in slots 0..B-1 (and taken in slot order); those with more than one pending token (a new
    turn: the last sampled token and the tool results or user reply) are prefilled first, all but that last token,
    from the first such slot to the last (a row continuing mid-turn in between is fed padding there). Then all rows
    decode together, one token a row a step; a row that stops trades slots with the batch's last row and leaves. A
    turn ends on any token of `stops` (muarl.stop_token_ids: the end-of-turn token first, which also pads, then the
    model's generation-config eos ids). `ready` (a callable: how many other rows are ready to join) also ends the
    call when at least max(1, refill_below x the rows still decoding) could join it."""
    eot, stops = stops[0], set(stops)
    for r in rows:  # a row whose previous turn ended (turn_end set) starts a new one
        if r.turn_end is not None:
            r.new_ids, r.new_logprobs, r.turn_end = [], [], None
    parts = _arrange(pool, rows)  # [(tier, its rows in its slots 0..b-1)]: one tier unless slots are sized by need
    rows, sizes = [r for _, part in parts for r in part], [len(part) for _, part in parts]
    pending = [(r.ep.input_ids + r.new_ids)[r.kv_len:] for r in rows]
    assert all(pending), "a row with nothing to decode from"
    budget = [min(cfg.max_new_tokens, cfg.max_context - len(r.ep.input_ids)) for r in rows]
    device, B = pool.device, len(rows)
    openings = _openings(pool.opens, rows)  # the batch's openings in place for the turn
    at = 0
    for p, part in parts:  # each tier's rows with a new turn, from the first such slot to the last, in one forward
        first = next((i for i, x in enumerate(pending[at:at + len(part)]) if len(x) > 1), len(part))
        if first < len(part):
            _prefill(model, p, part[first:], [x[:-1] for x in pending[at + first:at + len(part)]], cfg, eot,
                     _openings(pool.opens, part[first:], place=False))
        at += len(part)
    tok = torch.tensor([p[-1] for p in pending], device=device)[:, None]
    lens = torch.tensor([r.held for r in rows], device=device)  # each row's own columns
    bases = torch.tensor([r.base for r in rows], device=device)  # and the positions before them (its opening's)
    seeds = torch.tensor([r.seed for r in rows], device=device)  # each row's noise: its seed, the position drawn
    while True:
        ends = [sum(sizes[:t + 1]) for t in range(len(sizes))]
        views = [_View(p, 0, slice(e - n, e)) for (p, _), n, e in zip(parts, sizes, ends) if n]
        longest = [max(r.held for r in rows[v.at]) for v in views]  # each tier's longest row
        cache = _cache(views)
        while True:  # the steps until a row leaves
            if any(n >= v.pool.capacity - 1 for n, v in zip(longest, views)):  # (not expected: budget stops it first)
                raise RuntimeError(f"decoding past the cache slots' {views[0].pool.capacity} positions (max_context)")
            with decode_attention(model, cfg.decode_attention, openings):
                if pool.graphs is not None:  # the same step over fixed buffers, replayed as a CUDA graph (graphs.py)
                    tok, lp = pool.graphs.step(tok, lens, seeds, longest[0] + 1, bases,
                                               openings[2] if openings else None)
                else:
                    for v, n in zip(views, longest):
                        v.set(lens[v.at], 1, n + 1)
                    tok, lp = decode_step(model, cache, tok, _mask(lens, 1, max(longest) + 1, pool, cfg),
                                          (lens + bases)[:, None], seeds, cfg)
            lens, longest, done = lens + 1, [n + 1 for n in longest], []
            # one device-to-host copy a step (token ids are exact in float32): the loop's only per-step host sync
            drawn, logps = torch.stack([tok.float(), lp]).tolist()
            for j, (t, l) in enumerate(zip(map(int, drawn), logps)):
                r = rows[j]
                r.kv_len += 1
                r.new_ids.append(t)
                r.new_logprobs.append(l)
                if t in stops:
                    r.turn_end = TurnEnd.EOT
                elif len(r.new_ids) >= budget[j]:
                    full = len(r.ep.input_ids) + len(r.new_ids) >= cfg.max_context
                    r.turn_end = TurnEnd.CONTEXT if full else TurnEnd.MAX_NEW_TOKENS
                if r.turn_end is not None:
                    done.append(j)
            still = len(rows) - len(done)
            refill = not still or still < cfg.refill_below * B  # return; the rows mid-turn keep their slots
            if not refill and ready is not None and cfg.refill_below > 0:  # or when enough rows wait to join
                joinable = min(ready(), (cfg.max_batch or 1 << 30) - still)
                refill = joinable >= max(1.0, cfg.refill_below * still)
            if refill:
                return
            tok = tok[:, None]
            if done:
                break
        # each leaver trades slots with the last row of its tier still decoding; that tier's rows shrink by one
        order, tier = list(range(len(rows))), [t for t, n in enumerate(sizes) for _ in range(n)]
        for j in sorted(done, reverse=True):
            t = tier[j]
            last = sum(sizes[:t + 1]) - 1
            if j != last:
                parts[t][0].swap(rows[order[j]].slot, rows[order[last]].slot)
                order[j] = order[last]
            order.pop(last)
            tier.pop(last)
            sizes[t] -= 1
        keep = torch.tensor(order, device=device)
        rows = [rows[j] for j in order]
        budget = [budget[j] for j in order]
        tok, lens, seeds, bases = tok[keep], lens[keep], seeds[keep], bases[keep]
        openings = _openings(pool.opens, rows, place=False)


def _arrange(pool: SlotPool | Tiers, rows: list[_Row]) -> list[tuple[SlotPool, list[_Row]]]:
    """`rows` placed for one forward: [(pool, its rows in its slots 0..b-1)], a tier after another (pool.Tiers)."""
    return pool.arrange(rows) if isinstance(pool, Tiers) else [(pool, pool.place(rows))]


def admit(pool: SlotPool | Tiers, rows: list[_Row], limit: int = 0) -> tuple[list[_Row], list[_Row]]:
    """The rows (in order) that decode together now, at most `limit` (0: any) and as many as the pool's slots that
    fit them hold, and the rows that wait for a later batch."""
    if isinstance(pool, Tiers):
        batch, rest = pool.admit(rows, limit)
        if rows and not batch:  # (every slot counts as room, held or not: only a row no size holds gets here)
            raise RuntimeError(f"no slot of --decode-slots holds a turn of {pool.need(rows[0])} columns (the largest: "
                               f"{pool.pools[-1].capacity})")
        return batch, rest
    n = min(limit or len(rows), len(pool.owner))
    return rows[:n], rows[n:]
