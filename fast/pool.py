"""The decoding rows' KV caches: one preallocated pool of slots (`SlotPool`), host blocks for the caches of rows
without a slot, and the process's pool kept from one rollout to the next (`rollout_pool`).

`SlotPool` holds, per layer, one buffer [slots, kv_heads, capacity, head_dim]; a row's cache lies at the left of its
slot, with its own length, so a row joins or leaves a batch without the others' caches being stacked, parked or
copied, and the cache exists once (the memory estimate's kv_cache term, memory.py, is the pool). A batch is slots
0..B-1: `place` moves only the rows that are not there yet (a row waiting on its user keeps its slot until another
row needs it; with fewer slots than rows, a displaced row's cache spills to `spill_device`, pinned host memory on a
GPU, with asynchronous copies). engine.py reads and writes the slots.

A pool lives as long as its rollout, unless the decoding step is graphed (graphs.py): a CUDA graph replays over the
memory it was captured with, so the pool, the step's buffers and its graphs are kept for the next rollout of the
same shape (`rollout_pool`), and the graphs are replayed again when the weights they read have not moved
(graphs.weights_key). What that costs is memory: the pool is held through the update too, and the start-up estimate
counts it there (memory.memory_estimate's kept_pool).
"""
from __future__ import annotations

import mmap
import torch


# Host memory for the caches of rows without a slot: blocks of one size, one a row (every layer's keys and values at
# the pool's capacity), taken back when the row gets a slot again and kept for the next rollout. A cache of n
# positions fills the front of its block contiguously ([layers, 2, kv_heads, n, head_dim]): a copy between a GPU and
# a strided host view goes through a pageable temporary and waits, so only a contiguous one is asynchronous. Pinned
# blocks are page-locked in place (cudaHostRegister): torch's pinned allocator rounds every block up to a power of two
# (up to twice the bytes) and keeps freed blocks by size, so caches spilled at many lengths would hold more than the
# estimate's host_kv_cache.
_HOST_BLOCKS: dict[tuple, list[torch.Tensor]] = {}  # free blocks by (elements, dtype, pinned)


def _host_block(numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """A free block of `numel` elements, 1-D, starting on a page boundary; page-locked when `pin`."""
    free = _HOST_BLOCKS.setdefault((numel, dtype, pin), [])
    if free:
        return free.pop()
    nbytes = -(-numel * dtype.itemsize // 4096) * 4096  # whole pages
    # An anonymous mapping starts on a page, and so does the tensor's storage: torch asks whether memory is pinned
    # at the storage's start (Tensor.is_pinned), which for an aligned slice of a larger block lies outside the pages
    # registered, and it would answer no for memory that is page-locked. The mapping is shared (mmap's default) on
    # purpose: if this process is forked while the block lives, writes to it copy no pages (private memory's
    # would), and fork does not copy it eagerly as it does private pages pinned for DMA. The tensor keeps the mmap
    # object alive; nothing else holds it, so nothing can close it under the tensor.
    block = torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8).view(dtype)[:numel]
    if pin:  # never unregistered: a block is reused, and kept until the process ends, as torch keeps pinned blocks
        err = int(torch.cuda.cudart().cudaHostRegister(block.data_ptr(), nbytes, 1))  # 1: cudaHostRegisterPortable
        if err:  # no fallback: the failed call leaves its error pending, and the next kernel launch would raise it
            raise RuntimeError(
                f"engine: page-locking {nbytes / 2**30:.2f} GiB of host memory for a waiting episode's KV cache failed "
                f"(cudaHostRegister: cudaError {err}). Fewer episodes wait off the GPU with a larger --rollout-batch "
                "(0: every episode decodes in a slot of its own), a lower --max-context or --tasks-per-step.")
    return block


class _Spilled:
    """One cache out of its slot, the front of a block (host memory, or spill_device's), read by `users` rows (a
    group's opening is spilled once for the siblings that found no slot); the block is free again when each has let
    go. `kv` per layer (keys, values), each [kv_heads, n, head_dim], contiguous."""

    rescued = 0  # blocks given back by the garbage collector, not by drop() (a rollout that raised): 0 normally

    def __init__(self, block: torch.Tensor, shape: tuple, users: int, free: list | None):
        self.packed = block[:torch.Size(shape).numel()].view(shape)  # [layers, 2, kv_heads, n, head_dim]
        self.kv = [(layer[0], layer[1]) for layer in self.packed]
        self.block, self.users, self.free = block, users, free

    def drop(self) -> None:
        self.users -= 1
        if self.users == 0 and self.free is not None:
            self.free.append(self.block)

    def __del__(self):
        if self.users > 0 and self.free is not None:
            self.users = 0
            self.free.append(self.block)
            _Spilled.rescued += 1


class SlotPool:
    """Every decoding row's KV cache, in `slots` slots of `capacity` positions (max_context) per layer. A real token
    is written at most at position max_context - 2 (the last sampled token is never fed), so the last column is
    scratch, where the padding of a prefill goes when it would run past the slot. Rows without a slot keep
    their cache in host memory (`spill_device`: pinned when the pool is on a GPU, copied asynchronously in the
    stream's order) until `place` gives them one back."""

    def __init__(self, model, slots: int, capacity: int, spill_device: str = ""):
        cfg = model.config.get_text_config(decoder=True)
        if any(t != "full_attention" for t in getattr(cfg, "layer_types", None) or []):
            raise NotImplementedError("rollout's KV cache slots support full-attention models only")
        self.shape = self.shape_for(model, slots, capacity, spill_device)
        layers, _, kv_heads, _, head_dim, self.dtype, self.device, self.spill_device = self.shape
        # zeros, not garbage: a masked column is still multiplied (0 x NaN would poison attention)
        shape = (slots, kv_heads, capacity, head_dim)
        self.k = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(layers)]
        self.v = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(layers)]
        self.capacity, self.owner = capacity, [None] * slots
        self.graphs = None  # the decoding step by bucket over this pool (graphs.StepGraphs), when --decode-graphs
        self.opens = None  # the pool of the groups' openings, when held apart from the rows (decode_share_opening)
        self.pin = self.spill_device.type == "cpu" and self.device.type == "cuda"

    @staticmethod
    def shape_for(model, slots: int, capacity: int, spill_device: str = "") -> tuple:
        """What a pool for `model` is made of: (layers, slots, kv_heads, capacity, head_dim, dtype, device, spill
        device)."""
        cfg = model.config.get_text_config(decoder=True)
        dtype, device = _compute_dtype_device(model)
        kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        spill = torch.device(spill_device) if spill_device else device
        return cfg.num_hidden_layers, slots, kv_heads, capacity, head_dim, dtype, device, spill

    def take(self, row, slot: int) -> None:
        """Give `row` the free `slot`, bringing its cache there (from its old slot, in this pool or another tier's,
        or back from host memory)."""
        assert self.owner[slot] is None, "take: the slot is not free"
        n = row.held
        if row.slot >= 0:
            for (k, v), (sk, sv) in zip(zip(self.k, self.v), zip(row.pool.k, row.pool.v)):
                k[slot, :, :n], v[slot, :, :n] = sk[row.slot, :, :n], sv[row.slot, :, :n]
            row.pool.owner[row.slot] = None
        elif row.spilled is not None:
            for (k, v), (hk, hv) in zip(zip(self.k, self.v), row.spilled.kv):
                k[slot, :, :n].copy_(hk, non_blocking=True)
                v[slot, :, :n].copy_(hv, non_blocking=True)
        if row.spilled is not None:  # its block is the next spill's (in the stream's order: read before rewritten)
            row.spilled.drop()
        row.pool, row.slot, row.spilled, self.owner[slot] = self, slot, None, row

    def copy_slot(self, src: int, dst: int, n: int, into: SlotPool | None = None) -> None:
        """The first n positions of slot `src` copied to slot `dst` of `into` (another tier; default: this pool)."""
        into = into or self
        for k, v, dk, dv in zip(self.k, self.v, into.k, into.v):
            dk[dst, :, :n], dv[dst, :, :n] = k[src, :, :n], v[src, :, :n]

    def spill(self, row) -> None:
        """Move `row`'s cache out of its slot to spill_device; the slot is free."""
        row.spilled = self.copy_out(row.slot, row.held, 1)
        self.owner[row.slot], row.slot = None, -1

    def copy_out(self, slot: int, n: int, users: int) -> _Spilled:
        """The first n positions of `slot`, every layer, copied to a block of spill_device for `users` rows."""
        layers, kv_heads, capacity, head_dim = len(self.k), *self.k[0].shape[1:]
        shape = (layers, 2, kv_heads, n, head_dim)
        if self.spill_device.type == "cpu":
            numel = layers * 2 * kv_heads * capacity * head_dim
            block, free = _host_block(numel, self.dtype, self.pin), _HOST_BLOCKS[(numel, self.dtype, self.pin)]
        else:  # on a device: from its caching allocator, freed with the spill (held only while the row waits)
            block, free = torch.empty(torch.Size(shape).numel(), dtype=self.dtype, device=self.spill_device), None
        spilled = _Spilled(block, shape, users, free)
        for (k, v), (hk, hv) in zip(zip(self.k, self.v), spilled.kv):
            hk.copy_(k[slot, :, :n], non_blocking=self.pin)
            hv.copy_(v[slot, :, :n], non_blocking=self.pin)
        return spilled

    def swap(self, a: int, b: int) -> None:
        """Trade the contents and owners of slots a and b (one row's cache of one layer held twice, at most)."""
        ra, rb = self.owner[a], self.owner[b]
        na, nb = (ra.held if ra else 0), (rb.held if rb else 0)
        for buf in self.k + self.v:
            tmp = torch.empty_like(buf[a, :, :na]).copy_(buf[a, :, :na])
            buf[a, :, :nb] = buf[b, :, :nb]
            buf[b, :, :na] = tmp
        self.owner[a], self.owner[b] = rb, ra
        for r, s in ((ra, b), (rb, a)):
            if r is not None:
                r.slot = s

    def place(self, rows: list) -> list:
        """Put `rows` in slots 0..len(rows)-1, moving as few caches as it can: a row already there stays, the other
        rows there go to a free slot beyond (else spill), and each row of `rows` outside (in a slot beyond, in
        another tier's slot, spilled, or new) takes a freed slot. Returns `rows` in slot order."""
        n, inside = len(rows), {id(r) for r in rows}
        if n > len(self.owner):
            raise ValueError(f"a batch of {n} rows in a pool of {len(self.owner)} slots")
        for s in range(n):  # a row in the way trades places with a row of the batch beyond, else moves or spills
            other = self.owner[s]
            if other is None or id(other) in inside:
                continue
            beyond = next((r.slot for r in rows if r.pool is self and r.slot >= n), None)
            free = next((t for t in range(n, len(self.owner)) if self.owner[t] is None), None)
            if beyond is not None:
                self.swap(s, beyond)
            elif free is not None:
                self.take(other, free)
            else:
                self.spill(other)
        free = [s for s in range(n) if self.owner[s] is None]
        for r in rows:
            if r.pool is not self or not 0 <= r.slot < n:
                self.take(r, free.pop())
        return sorted(rows, key=lambda r: r.slot)

    def acquire(self, row) -> bool:
        """A free slot for `row` (which has none), if there is one."""
        free = next((s for s, o in enumerate(self.owner) if o is None), None)
        if free is not None:
            self.take(row, free)
        return free is not None


class Opening:
    """A group's opening held once (RolloutConfig.decode_share_opening): a row of the openings' pool (its keys and
    values in a slot there, or spilled like any row's), read by `users` episodes, whose own slots hold what follows
    it. Its slot is free once the last of them has ended."""

    base = 0  # (as a row's: no positions before its slot)

    @property
    def held(self) -> int:
        return self.kv_len

    def __init__(self):
        self.pool, self.slot, self.kv_len, self.spilled, self.users = None, -1, 0, None, 0

    def release(self) -> None:
        self.users -= 1
        if self.users == 0:
            if self.slot >= 0:
                self.pool.owner[self.slot] = None
            if self.spilled is not None:
                self.spilled.drop()
            self.slot, self.spilled = -1, None


def parse_slots(spec: str, max_context: int) -> list[tuple[int, int]]:
    """--decode-slots "12x4096,2x32768" as [(slots, capacity)] by capacity: 12 slots of 4,096 positions and 2 of
    32,768. The largest must hold a whole episode (max_context), or an episode that grows to it could never decode."""
    sizes = []
    for part in spec.split(","):
        n, _, cap = part.strip().partition("x")
        if not (n.isdigit() and cap.isdigit() and int(n) > 0 and int(cap) > 1):
            raise ValueError(f"--decode-slots: {part.strip()!r} is not SLOTSxPOSITIONS (e.g. 12x4096), both whole "
                             "numbers above 0")
        sizes.append((int(n), int(cap)))
    sizes.sort(key=lambda t: t[1])
    if sizes[-1][1] < max_context:
        raise ValueError(f"--decode-slots {spec}: the largest slots ({sizes[-1][1]} positions) must hold an episode at "
                         f"--max-context ({max_context})")
    return sizes


class Tiers:
    """Slots sized by need (RolloutConfig.decode_slots): a few SlotPools ("tiers") of growing capacity. A row decodes
    in the smallest tier whose slots hold all its turn can reach (its conversation and the turn's budget of new
    tokens, capped at max_context, less its opening when held apart: `need`), and moves up, its cache copied once,
    when a turn would outgrow its slot. A batch is each tier's rows in that tier's slots 0..b-1, tier after tier
    (`arrange`); a row for which no slot that fits is left in this batch waits for the next (`admit`), as rows
    beyond max_batch do, and so does a row whose group's opening (held apart) would be one more than max_openings.
    The pool's capacity is then spent on what the episodes reach, not max_context a row."""

    def __init__(self, pools: list[SlotPool], max_new_tokens: int, max_context: int):
        self.pools = sorted(pools, key=lambda p: p.capacity)
        self.max_new_tokens, self.max_context = max_new_tokens, max_context
        self.device, self.dtype, self.capacity = pools[0].device, pools[0].dtype, self.pools[-1].capacity
        self.opens, self.graphs = None, None
        self.max_openings = 0  # with the openings held apart: the most groups a batch may hold (their pool's slots)

    @property
    def owner(self) -> list:
        """Every tier's slots' rows, tier after tier (as a SlotPool's: None for a free slot)."""
        return [o for p in self.pools for o in p.owner]

    def need(self, row) -> int:
        """The columns of its own slot that `row`'s turn can reach, and the scratch column: a turn that ends at
        position `end` caches positions up to end - 2 (its last token is drawn, never fed), so the scratch is column
        end - 1 - base, as a one-size pool's slot of max_context columns holds an episode of max_context tokens."""
        end = min(len(row.ep.input_ids) + self.max_new_tokens, self.max_context)
        return end - row.base

    def _assign(self, rows: list, limit: int) -> tuple[list[tuple[int, object]], list]:
        """(tier, row) for the rows that decode now, in `rows`' order (a row stays in its tier when it fits there
        and that tier has room; else the smallest that fits and has room), and the rows that wait."""
        room, chosen, rest, groups = [len(p.owner) for p in self.pools], [], [], set()
        for r in rows:
            fits = [t for t, p in enumerate(self.pools) if p.capacity >= self.need(r) and room[t]]
            t = next((t for t in fits if self.pools[t] is r.pool), fits[0] if fits else None)
            group = id(r.opening) if r.opening is not None else None  # (its opening's slot: one a group)
            crowded = self.max_openings and group is not None and group not in groups and \
                len(groups) >= self.max_openings
            if t is None or len(chosen) >= limit or crowded:
                rest.append(r)
            else:
                room[t] -= 1
                chosen.append((t, r))
                groups.add(group)
        return chosen, rest

    def admit(self, rows: list, limit: int = 0) -> tuple[list, list]:
        """The rows (in order) that decode together in this batch, at most `limit` (0: any), and those that wait."""
        chosen, rest = self._assign(rows, limit or len(rows))
        return [r for _, r in chosen], rest

    def arrange(self, rows: list) -> list[tuple[SlotPool, list]]:
        """Each tier with rows of the batch and those rows, placed in its slots 0..b-1 (SlotPool.place)."""
        chosen, rest = self._assign(rows, len(rows))
        if rest:
            raise ValueError(f"a batch of {len(rows)} rows of which {len(rest)} fit no free slot (Tiers.admit first)")
        return [(p, p.place([r for u, r in chosen if u == t])) for t, p in enumerate(self.pools)
                if any(u == t for u, _ in chosen)]

    def acquire(self, row) -> bool:
        """A free slot that fits `row` (which has none), in the smallest tier that has one."""
        for p in self.pools:
            if p.capacity >= self.need(row) and p.acquire(row):
                return True
        return False


def _compute_dtype_device(model) -> tuple[torch.dtype, torch.device]:
    """The dtype attention's keys and values are used in, and the device: autocast's dtype when it is on (a --bf16
    run keeps fp32 master weights and computes in bf16, so a parameter's dtype would make its cache fp32, twice the
    memory), else the weights' dtype as the forward sees them (under FSDP2, gathered in the mixed-precision dtype)."""
    weight = model.get_input_embeddings().weight
    if weight.device.type != "meta" and torch.is_autocast_enabled(weight.device.type):  # (meta: bench/slots.py)
        return torch.get_autocast_dtype(weight.device.type), weight.device
    return weight.dtype, weight.device


# ---------------------------------------------------------------------------------------------------------
# One pool a process, for the graphed step
# ---------------------------------------------------------------------------------------------------------
_KEPT: dict[str, SlotPool] = {}  # by device (and tag): the pools the last rollout with the graphed step kept


def rollout_pool(model, slots: int, capacity: int, spill_device: str = "", keep: bool = False,
                 tag: str = "") -> SlotPool:
    """The pool of one rollout: `slots` slots of `capacity` positions for `model`'s keys and values. With `keep`, the
    process's pool: the one an earlier rollout kept when it has this shape (the model's layers, key-value heads,
    head size, compute dtype and device; the slots, the spill device) and at least this capacity (the rows' after
    openings of other lengths; not more slots: an evaluation's pool would be held through training), its slots
    emptied and zeroed in place, its graphed step (`graphs`) kept for graphs.step_graphs to judge; else a new one,
    kept in its place once the old one is let go (its memory freed before the new one is allocated). Without `keep`,
    a new pool that lives as long as the rollout, and none is kept. `tag` names a second pool kept beside it
    (":openings": the groups')."""
    _, device = _compute_dtype_device(model)
    where = str(device) + tag
    kept = _KEPT.get(where)
    want = SlotPool.shape_for(model, slots, capacity, spill_device)
    if keep and kept is not None and kept.shape[:3] + kept.shape[4:] == want[:3] + want[4:] and \
            kept.capacity >= capacity:
        for buf in kept.k + kept.v:
            buf.zero_()  # a NaN left by an earlier rollout would poison the masked columns (0 x NaN)
        kept.owner, kept.opens = [None] * len(kept.owner), None  # (the openings' pool is the rollout's to give)
        return kept
    kept = None
    let_go(model, tag)  # the old pool, its step buffers and graphs: freed before the new pool is made
    pool = SlotPool(model, slots, capacity, spill_device)
    if keep:
        _KEPT[where] = pool
    return pool


def let_go(model, tag: str = "") -> None:
    """The pool an earlier rollout kept under `tag` (rollout_pool) let go: its memory freed now (it and its graphed
    step point at each other: unlinked, or only the cycle collector would free them)."""
    kept = _KEPT.pop(str(_compute_dtype_device(model)[1]) + tag, None)
    if kept is not None:
        kept.graphs = kept.opens = None
