"""The decoding step over fixed buffers, so that CUDA can capture it once as a graph and replay it every step.

Eagerly, a decoding step of a small model is ~1,700 kernel launches with Python around each (59 a layer; 1,120 ops
a step at Qwen3-0.6B's shape once cuts.py fused each norm and made the mask once a step, counted on an H200, fewer
since it halved the rotary's), tens of times the time its arithmetic and memory reads take on a GPU. A CUDA graph
replays all of a step's kernels in one launch, but only over the memory it was captured with, at the shapes it was
captured with. So the step is written here as a body that reads only fixed buffers: per bucket of rows and columns
(`row_bucket`, `col_bucket`), the tokens, lengths and seeds of its rows ([Bb]), the pool's key and value buffers, the
model's weights. A batch of B
rows fills the first B of a bucket's Bb; the padding rows get the last column of the pool (`capacity - 1`, scratch:
never a real token's, pool.SlotPool) as their length, so their keys and values go only there. The columns the
attention reads are rounded up to the bucket's Lb; the mask keeps each row's own length, so a row's result is the
eager step's. Rows, columns, mask and positions are computed from the lengths inside the body, and the draw is the
counter-based one (decode._sample over uniform_noise: no generator state), so nothing in the body reads the host.
With the groups' openings held apart (decode_share_opening), a bucket is also keyed by the batch's groups G and a
width w (each group's rows in cells 0..w-1 of its own, the padding rows in cells no row holds): the openings'
attention reads the openings' pool and the bucket's `Members` buffers, and positions count each row's opening.

On CUDA (`capture`) each bucket is captured at its first use, after one eager run of the body (which writes the same
keys and values the replay then writes again), into one memory pool shared by the buckets, and replayed from then
on; where a capture fails it warns once and the step runs eagerly. On the CPU the same body runs eagerly: the tests
compare its tokens with the engine's eager step. The graphs live as long as their pool, which the process keeps
from one rollout to the next (pool.rollout_pool), and are replayed again in the next rollout when the weights they
read are where they were (`weights_key`: every parameter and buffer at the same address; LoRA's adapters folded into
the base in place keep them, FSDP2's gathered weights may not), and never when autocast casts the weights (its copies
live only as long as one rollout's autocast): then, for another sampling, and when the openings' pool they read is
not the one kept beside the rows', they are captured again.
"""
from __future__ import annotations

import itertools
import time
import warnings
import weakref

import torch

from fast import cuts, decode
from fast.decode import _sample, decode_logits
from fast.engine import _cache, _View
from fast.opening import Members

COLUMN_STEP = 128  # the columns a bucket reads are rounded up to a multiple of this, or of an eighth of their octave


def row_bucket(rows: int, slots: int) -> int:
    """The rows a bucket decodes: the next power of two (at least 2), at most the pool's slots."""
    b = 2
    while b < rows:
        b *= 2
    return min(b, slots)


def col_bucket(seen: int, capacity: int) -> int:
    """The columns a bucket reads, at least `seen`: a multiple of COLUMN_STEP, or past 1,024 of an eighth of the
    power of two below it (at most ~12% read for nothing), at most the pool's capacity."""
    step = max(COLUMN_STEP, (1 << (max(seen, 1).bit_length() - 1)) // 8)
    return min(-(-seen // step) * step, capacity)


class _Bucket:
    """One bucket's fixed buffers: inputs (tok, lens, seeds, bases: the positions before each row's own columns),
    outputs (out_tok, out_lp), and the cache view and the column and slot indices its body reads. With the groups'
    openings held apart (`groups` > 0): where each row stands among them (`members`: group, index, the openings'
    lengths), `width` cells a group, the padding rows in cells no row of the batch holds."""

    def __init__(self, pool, rows: int, cols: int, groups: int = 0, width: int = 0):
        dev = pool.device
        self.rows, self.cols = rows, cols
        self.tok = torch.zeros(rows, 1, dtype=torch.long, device=dev)
        self.lens = torch.full((rows,), pool.capacity - 1, dtype=torch.long, device=dev)
        self.bases = torch.zeros(rows, dtype=torch.long, device=dev)
        self.members = Members(torch.zeros(rows, dtype=torch.long, device=dev), torch.zeros(
            rows, dtype=torch.long, device=dev), width, torch.zeros(groups, dtype=torch.long, device=dev)) \
            if groups else None
        self.seeds = torch.zeros(rows, dtype=torch.long, device=dev)
        self.out_tok = torch.zeros(rows, dtype=torch.long, device=dev)
        self.out_lp = torch.zeros(rows, dtype=torch.float32, device=dev)
        self.columns = torch.arange(cols, device=dev)
        self.view = _View(pool, 0)
        self.view.rows = torch.arange(rows, device=dev)[:, None]
        self.view.hi, self.view.seen = rows, cols
        self.cache = _cache([self.view])
        self.graph = None


class StepGraphs:
    """The decoding step of one pool (pool.SlotPool) by bucket: `step` copies a batch's tokens, lengths and seeds
    into its bucket's buffers, runs the body (or replays its graph) and returns the drawn tokens and their logprobs
    for the batch's rows."""

    def __init__(self, model, pool, cfg, capture: bool):
        if len(pool.owner) < 2:
            raise ValueError("the graphed decoding step needs a pool of at least 2 slots")
        self.model, self.pool, self.cfg, self.capture = model, pool, cfg, capture
        self.key = graph_key(model, cfg)  # what its graphs read besides its buffers and the pool (None: unkeepable)
        self.buckets: dict[tuple[int, int], _Bucket] = {}
        self.mempool = torch.cuda.graph_pool_handle() if capture else None
        self.failed = None  # why a capture failed: every bucket then runs eagerly
        self.replays = 0
        self.capture_s = 0.0  # seconds spent capturing (each with its warm-up step), for benchmarks to set apart
        # the groups' openings' pool its graphs read (weakly: a pool replaced is freed at once, and a dead reference
        # never matches the next pool; None: not held apart)
        self.opens = weakref.ref(pool.opens) if pool.opens is not None else None
        self._cells_of: list = [None, None, None]

    def _body(self, b: _Bucket) -> None:
        cap = self.pool.capacity
        b.view.cols = b.lens[:, None].clamp(max=cap - 1)  # each row's new column (padding rows: the scratch one)
        mask = (b.columns[None, None, None, :] <= b.lens[:, None, None, None])  # [Bb, 1, 1, Lb]
        if b.members is not None:  # (the openings' attention, decode_attention(..., openings), reads the bucket's)
            decode._OPENINGS.append((self.pool.opens.k, self.pool.opens.v, b.members))
        pos = b.lens + b.bases  # (each row's position: its own columns after its opening's, when held apart)
        try:
            logits = decode_logits(self.model, b.cache, b.tok, mask, pos[:, None])
        finally:
            if b.members is not None:
                decode._OPENINGS.pop()
        tok, lp = _sample(logits, self.cfg, b.seeds, pos + 1)
        b.out_tok.copy_(tok)
        b.out_lp.copy_(lp)

    def bucket(self, rows: int, seen: int, members: Members | None = None) -> _Bucket:
        """The bucket of a batch of `rows` rows whose longest reads `seen` columns; with the openings held apart, of
        its G groups too, each `width` cells wide: the most rows a group has, or enough cells for the bucket's rows,
        rounded up to a power of two (a few buckets of groups and widths)."""
        rows = row_bucket(rows, len(self.pool.owner))  # (G up to a power of two, the extra openings empty)
        groups = min(row_bucket(len(members.lengths), 1 << 30), len(self.pool.opens.owner)) if members else 0
        width = min(row_bucket(max(members.width, -(-rows // groups)), 1 << 30), rows) if groups else 0
        key = (rows, col_bucket(seen, self.pool.capacity), groups, width)
        if key not in self.buckets:
            self.buckets[key] = _Bucket(self.pool, *key)
        return self.buckets[key]

    def _cells(self, b: _Bucket, members: Members) -> tuple[torch.Tensor, torch.Tensor]:
        """[Bb] group and index of the bucket's rows: the batch's, then each padding row in a cell none holds (made
        once a batch: the members change when rows leave or join, not every step)."""
        if self._cells_of[0] is not members or self._cells_of[1] is not b:
            groups, index = members.host
            taken = set(zip(groups, index))
            grid = itertools.product(range(len(b.members.lengths)), range(b.members.width))
            free = [cell for cell in grid if cell not in taken]
            cells = list(zip(groups, index)) + free[:b.rows - len(groups)]
            self._cells_of = [members, b, torch.tensor(cells, dtype=torch.long).T.to(b.lens.device)]
        return self._cells_of[2]

    def step(self, tok: torch.Tensor, lens: torch.Tensor, seeds: torch.Tensor, seen: int,
             bases: torch.Tensor | None = None, members: Members | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """tok [B, 1], lens [B] (each row's own length before this token), seeds [B]; `seen`: the columns the
        longest row reads (its length + 1); with the openings held apart, `bases` [B] (each row's opening length:
        positions are bases + lens) and `members` (Members). Returns (tokens [B], logprobs [B])."""
        B = len(lens)
        b = self.bucket(B, seen, members)
        b.tok[:B].copy_(tok)
        b.lens[:B].copy_(lens)
        b.seeds[:B].copy_(seeds)
        if bases is not None:
            b.bases[:B].copy_(bases)
        if members is not None:
            b.members.lengths.zero_()[:len(members.lengths)].copy_(members.lengths)
            group, index = self._cells(b, members)
            b.members.group.copy_(group)
            b.members.index.copy_(index)
        if B < b.rows:
            b.lens[B:] = self.pool.capacity - 1
            b.tok[B:] = 0
            b.bases[B:] = 0
        if not self.capture or self.failed:
            self._body(b)
        elif b.graph is None:
            self._capture(b)
        else:
            b.graph.replay()
            self.replays += 1
        return b.out_tok[:B], b.out_lp[:B]

    def _capture(self, b: _Bucket) -> None:
        torch.cuda.synchronize(self.pool.device)
        t0 = time.perf_counter()
        try:
            self._capture_timed(b)
        finally:
            torch.cuda.synchronize(self.pool.device)
            self.capture_s += time.perf_counter() - t0

    def _capture_timed(self, b: _Bucket) -> None:
        stream = torch.cuda.Stream(self.pool.device)
        stream.wait_stream(torch.cuda.current_stream(self.pool.device))
        with torch.cuda.stream(stream):
            self._body(b)  # the warm-up: this step, eagerly (the replay below writes the same keys and values)
        torch.cuda.current_stream(self.pool.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self.mempool):
                self._body(b)
        except Exception as e:  # an op the capture refuses (a host sync in a model's forward): eagerly from now on
            self.failed = f"{type(e).__name__}: {e}"
            warnings.warn(f"capturing the decoding step as a CUDA graph failed ({self.failed[:300]}); decoding "
                          "eagerly from now on (--decode-graphs off skips the attempt)")
            return
        b.graph = graph
        graph.replay()  # this step's outputs (the warm-up's, recomputed)
        self.replays += 1


def weights_key(model) -> tuple | None:
    """Where the model's weights are: every parameter's and buffer's address, dtype and shape; None when autocast
    would cast a floating parameter to its own dtype (the copies it caches go when the rollout's autocast ends)."""
    device = next(model.parameters()).device.type
    tensors = list(itertools.chain(model.parameters(), model.buffers()))
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        if any(t.is_floating_point() and t.dtype != dtype for t in model.parameters()):
            return None
    return tuple((t.data_ptr(), t.dtype, tuple(t.shape)) for t in tensors)


def graph_key(model, cfg) -> tuple | None:
    """What a kept step's graphs were captured for: the model (its weights' addresses) and the draw (the sampling
    settings are constants inside a graph); None when nothing can be kept."""
    where = weights_key(model)
    return None if where is None else (id(model), where, cfg.greedy, cfg.temperature, cfg.top_p, cuts.ON)


_SAID: set[str] = set()


def graphs_on(cfg, device: torch.device, slots: int) -> bool:
    """Whether a rollout decodes with the graphed step: cfg.decode_graphs asks for it ('on'; 'auto': on a GPU) and
    the step allows it, saying once why not. A pool of one slot (one episode) decodes eagerly."""
    on_gpu = device.type == "cuda"
    if cfg.decode_graphs == "off" or cfg.decode_graphs == "auto" and not on_gpu or slots < 2:
        return False
    why = ("it takes the grouped attention (--decode-attention grouped)" if cfg.decode_attention != "grouped" else
           "slots of several sizes (--decode-slots) are not graphed yet" if cfg.decode_slots else
           "--compile-decode compiles the same step" if cfg.compile_decode == "on" or
           cfg.compile_decode == "auto" and on_gpu else None)
    if why and why not in _SAID:
        _SAID.add(why)
        warnings.warn(f"--decode-graphs: not used: {why}; the step runs as it is")
    return not why


def step_graphs(model, pool, cfg) -> StepGraphs:
    """The pool's graphed step for this rollout: the one it kept from the last (its graphs replayed again) when that
    was captured for this model, at these weights' addresses, with this draw; else a new one (the old graphs freed)."""
    kept = pool.graphs
    opens = kept.opens() if kept is not None and kept.opens is not None else None
    if kept is not None and kept.key is not None and kept.key == graph_key(model, cfg) and opens is pool.opens:
        return kept  # (a failed one: eager; the openings' pool is one its graphs read too)
    pool.graphs = None  # its buckets and graphs go before new ones are captured
    return StepGraphs(model, pool, cfg, capture=pool.device.type == "cuda")
