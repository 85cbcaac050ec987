"""The decoding step over fixed buffers, so that CUDA can capture it once as a graph and replay it every step.

Eagerly, a decoding step of a small model is ~1,700 kernel launches with Python around each (59 a layer), tens of
times the time its arithmetic and memory reads take on a GPU. A CUDA graph replays all of a step's kernels in one
launch, but only over the memory it was captured with, at the shapes it was captured with. So the step is written
here as a body that reads only fixed buffers: per bucket of rows and columns (`row_bucket`, `col_bucket`), the
tokens, lengths and seeds of its rows ([Bb]), the pool's key and value buffers, the model's weights. A batch of B
rows fills the first B of a bucket's Bb; the padding rows get the last column of the pool (`capacity - 1`, scratch:
never a real token's, engine.SlotPool) as their length, so their keys and values go only there. The columns the
attention reads are rounded up to the bucket's Lb; the mask keeps each row's own length, so a row's result is the
eager step's. Rows, columns, mask and positions are computed from the lengths inside the body, and the draw is the
counter-based one (decode._sample over uniform_noise: no generator state), so nothing in the body reads the host.

On CUDA (`capture`) each bucket is captured at its first use, after one eager run of the body (which writes the same
keys and values the replay then writes again), into one memory pool shared by the buckets, and replayed from then
on; where a capture fails it warns once and the step runs eagerly. On the CPU the same body runs eagerly: the tests
compare its tokens with the engine's eager step. The graphs live as long as the pool (one rollout): the weights a
graph reads (autocast's bf16 copies, LoRA's folded weights, FSDP2's gathered ones) may move between rollouts.
"""
from __future__ import annotations

import warnings

import torch

from fast.decode import _sample, decode_logits
from fast.engine import _cache, _View

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
    """One bucket's fixed buffers: inputs (tok, lens, seeds), outputs (out_tok, out_lp), and the cache view and
    the column and slot indices its body reads."""

    def __init__(self, pool, rows: int, cols: int):
        dev = pool.device
        self.rows, self.cols = rows, cols
        self.tok = torch.zeros(rows, 1, dtype=torch.long, device=dev)
        self.lens = torch.full((rows,), pool.capacity - 1, dtype=torch.long, device=dev)
        self.seeds = torch.zeros(rows, dtype=torch.long, device=dev)
        self.out_tok = torch.zeros(rows, dtype=torch.long, device=dev)
        self.out_lp = torch.zeros(rows, dtype=torch.float32, device=dev)
        self.columns = torch.arange(cols, device=dev)
        self.view = _View(pool, 0)
        self.view.rows = torch.arange(rows, device=dev)[:, None]
        self.view.hi, self.view.seen = rows, cols
        self.cache = _cache(pool, self.view)
        self.graph = None


class StepGraphs:
    """The decoding step of one pool (engine.SlotPool) by bucket: `step` copies a batch's tokens, lengths and seeds
    into its bucket's buffers, runs the body (or replays its graph) and returns the drawn tokens and their logprobs
    for the batch's rows."""

    def __init__(self, model, pool, cfg, capture: bool):
        if len(pool.owner) < 2:
            raise ValueError("the graphed decoding step needs a pool of at least 2 slots")
        self.model, self.pool, self.cfg, self.capture = model, pool, cfg, capture
        self.buckets: dict[tuple[int, int], _Bucket] = {}
        self.mempool = torch.cuda.graph_pool_handle() if capture else None
        self.failed = None  # why a capture failed: every bucket then runs eagerly
        self.replays = 0

    def _body(self, b: _Bucket) -> None:
        cap = self.pool.capacity
        b.view.cols = b.lens[:, None].clamp(max=cap - 1)  # each row's new column (padding rows: the scratch one)
        mask = (b.columns[None, None, None, :] <= b.lens[:, None, None, None])  # [Bb, 1, 1, Lb]
        logits = decode_logits(self.model, b.cache, b.tok, mask, b.lens[:, None])
        tok, lp = _sample(logits, self.cfg, b.seeds, b.lens + 1)
        b.out_tok.copy_(tok)
        b.out_lp.copy_(lp)

    def bucket(self, rows: int, seen: int) -> _Bucket:
        key = (row_bucket(rows, len(self.pool.owner)), col_bucket(seen, self.pool.capacity))
        if key not in self.buckets:
            self.buckets[key] = _Bucket(self.pool, *key)
        return self.buckets[key]

    def step(self, tok: torch.Tensor, lens: torch.Tensor, seeds: torch.Tensor, seen: int
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """tok [B, 1], lens [B] (each row's length before this token), seeds [B]; `seen`: the columns the longest
        row reads (its length + 1). Returns (tokens [B], logprobs [B])."""
        B = len(lens)
        b = self.bucket(B, seen)
        b.tok[:B].copy_(tok)
        b.lens[:B].copy_(lens)
        b.seeds[:B].copy_(seeds)
        if B < b.rows:
            b.lens[B:] = self.pool.capacity - 1
            b.tok[B:] = 0
        if not self.capture or self.failed:
            self._body(b)
        elif b.graph is None:
            self._capture(b)
        else:
            b.graph.replay()
            self.replays += 1
        return b.out_tok[:B], b.out_lp[:B]

    def _capture(self, b: _Bucket) -> None:
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


_SAID: set[str] = set()


def step_graphs(model, pool, cfg) -> StepGraphs | None:
    """The pool's graphed step when cfg.decode_graphs asks for it ('on'; 'auto': on a GPU) and the step allows it,
    else None (the eager step), saying once why not. A pool of one slot (one episode) decodes eagerly."""
    on_gpu = pool.device.type == "cuda"
    if cfg.decode_graphs == "off" or cfg.decode_graphs == "auto" and not on_gpu or len(pool.owner) < 2:
        return None
    why = ("it takes the grouped attention (--decode-attention grouped)" if cfg.decode_attention != "grouped" else
           "--compile-decode compiles the same step" if cfg.compile_decode == "on" or
           cfg.compile_decode == "auto" and on_gpu else None)
    if why:
        if why not in _SAID:
            _SAID.add(why)
            warnings.warn(f"--decode-graphs: not used: {why}; the step runs as it is")
        return None
    return StepGraphs(model, pool, cfg, capture=on_gpu)
