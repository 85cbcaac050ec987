"""bench/gpu.py: one command that checks the GPU paths on one GPU, offline, and writes what it found.

    python3 bench/gpu.py --out $OUT/gpu                 # on the lent GPU machine, with its own Python (offline)
    ./run python bench/gpu.py --cpu --out /tmp/report   # the same checks at toy size on the CPU (in the test suite)

The models are built from configs, never downloaded: Qwen3's architecture at the 0.6B shape (28 layers, hidden 1024,
16 heads, 8 KV heads) and at the 8B attention shape with 4 layers (hidden 4096, 32 heads, 8 KV heads), with the tiny
tokenizer; on the CPU a 2-layer toy of the same architecture. Random weights, with the end-of-turn logit set so that
greedy turns end at ~1 in 12 positions (`greedy_turns_end`), so that greedy comparisons cover many-token turns. The
environment is the shop domain with its scripted user. Only report.md and report.json go to --out; models and runs
(gigabytes of checkpoints at the 0.6B shape) to --work.

Checks, in order; each is PASS, FAIL or SKIP (with why) and its figures, in OUT/report.md (and OUT/report.json):
  versions   torch, transformers, accelerate, the device, flash-attn, deepspeed
  engine     the engine's greedy episodes equal reference_rollout's (ids and loss masks), fp32 sdpa, with max_batch
             0 and 2, with parking in host memory on and off, with the prefill in chunks, and with a user whose
             replies take 10-90 ms, fetched while the other episodes decode (invariant 5, on this device), and
             with the decoding step replayed as CUDA graphs (--decode-graphs on; on the CPU, their body); the
             parked caches' host blocks page-locked (pool._host_block)
  flash      bf16: the trainer's log-probs of the same episodes with flash-attn against sdpa (the rollout's own
             attention is decode.py's either way)
  kv_peak    peak GPU memory of a rollout at long contexts against memory.memory_estimate (weights + KV cache), on
             8B's attention with 4 layers and on 8B's KV cache shape with all 36 layers (narrow MLPs)
  decode     the engine's decode tokens/s against a bare greedy loop over the same model and batch (a ratio), the
             stop tokens' output rows zeroed so that every row decodes to its cap, each side's prefill untimed
  roofline   the engine's decoding step (bench/rollout.py's step_cost: decode_logits and the sampler) against its
             memory roofline, the weights and the live KV cache read once over the measured copy bandwidth, with the
             grouped attention eager as before issue 52 (no kernel cuts) and now, graphed with and without the cuts
             (--decode-graphs: captured as CUDA graphs; on the CPU its body run eagerly), the model's attention at the
             first point, compiled at the target's point after the grid (a compile takes minutes there); bf16,
             Qwen3's 0.6B and 8B shapes (151,936 tokens), batches 16 and 64, contexts 1k and 8k; greedy too at the
             first point; capture seconds and replays; at the target's point the attention alone and the GEMMs alone
             in GB/s. PASS when the graphed step at 8B, batch 16, 8k is within 1.5x of its roofline (the target; on
             the CPU, toy size: figures only)
  train      2 SFT steps, then 2 GRPO steps (bf16 and gradient checkpointing on a GPU): kl 0 at step 1, a finite
             gradient norm, no skipped update, logprob_gap ~0, the peak memory against the start-up estimate; then
             --resume for one more step
  lora       the same GRPO steps with --lora-rank 16 (the base frozen in bf16 on a GPU, fp32 adapters, the reference
             the base with the adapters off): kl 0 at step 1, the base bit-identical after, adapter-only
             checkpoints, --resume; the peak memory reported beside the start-up estimate with its LoRA terms; and
             greedy decoding with rank-64 adapters, unmerged against folded into the base (--lora-decode): tokens/s
  decode_layouts  issue 53's decoding layouts at the 0.6B shape, one group of 8 with a 4k opening, episodes to 5k:
             each row's copy of the opening, the opening held once, held once in slots sized by need, and the
             first two through the graphed step: tokens/s, pools' bytes, cache read a step, each against its
             roofline; the same episodes token for token (required in fp32, on the CPU)
  share_opening  bench/train_step.py's tau2-shaped update with and without each group's opening computed once
             (bf16, gradient checkpointing, micro-batches of 4 and 1): seconds, peak memory, decoder tokens; bf16
             gradients of a group against float32, shared and whole (on the CPU: toy size, figures only)
  head_grad  the output layer's weight gradient at Qwen3-8B's vocabulary and width in bf16: accumulated into float32
             in one GEMM a block of rows (CUDA) against cast-and-add, their errors, transient memory (bounded by
             the block) and time
  fsdp2      the same GRPO steps under `accelerate launch` with FSDP2, one process, then --resume (sharded
             checkpoints) (GPU)
  zero3      the same with DeepSpeed ZeRO-3 where deepspeed imports (GPU)
  fsdp2_x2   fsdp2 with two processes and CPU-RAM-efficient loading on (transformers 5.17 zeroes weights off the first
             process without muarl's guard): kl exactly 0 at step 1; SKIP, saying so, where there is one GPU
A failing check does not stop the others; the exit status is 1 when any failed.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from plumbing import models  # noqa: E402
import muarl  # noqa: E402
import toolcall  # noqa: E402

SHAPES = {  # name -> Qwen3Config overrides (vocabulary: the tiny tokenizer's)
    "toy": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16),
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128),
    "qwen3-8b-attn-4l": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=4, num_attention_heads=32,
                             num_key_value_heads=8, head_dim=128),
    # Qwen3-8B's KV cache (36 layers of 8 key-value heads of 128) behind narrow layers: the cache's memory at 8B
    "qwen3-8b-kv-36l": dict(hidden_size=1024, intermediate_size=2048, num_hidden_layers=36, num_attention_heads=32,
                            num_key_value_heads=8, head_dim=128),
}


def build(tok, shape: str, device, dtype=torch.float32, attn="sdpa", seed=0):
    """A random Qwen3-architecture model of `shape` whose turns end after ~12 tokens."""
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = models.tiny_config(len(tok), arch="qwen3", pad_token_id=tok.pad_token_id, tie_word_embeddings=False,
                            eos_token_id=muarl.end_of_turn_id(tok), max_position_embeddings=40960, **SHAPES[shape])
    cfg._attn_implementation = attn
    model = Qwen3ForCausalLM(cfg).to(device=device, dtype=dtype).eval()
    return model


def openings(tok, env, tasks) -> list[list[int]]:
    return [muarl.prompt_ids(tok, [{"role": "system", "content": env.system_prompt(t)},
                                   {"role": "user", "content": env.scripted_user(t).opening()}], env.tools(t))
            for t in tasks]


@torch.no_grad()
def greedy_turns_end(model, tok, env, tasks, rate: float = 1 / 12) -> None:
    """Move the output row of the end-of-turn token (in place) so that it is the argmax at about `rate` of the
    positions after real openings: greedy turns then run ~1/rate tokens (rate 0: it is pushed ~100 below, never
    chosen). A random model's logits are nearly flat: raising that row for sampling makes greedy pick it at once,
    and turns of one token test nothing."""
    eot = muarl.end_of_turn_id(tok)
    ids = [o[-256:] for o in openings(tok, env, tasks[:4])]
    width = min(len(i) for i in ids)
    x = torch.tensor([i[-width:] for i in ids], device=model.device)
    h = model.get_decoder()(input_ids=x).last_hidden_state[:, -128:].flatten(0, 1).float()
    w = model.get_output_embeddings().weight
    logits = h @ w.float().T
    logits[:, eot] = -1e9
    best = logits.max(-1).values
    u = h.mean(0)
    proj = h @ u / (u @ u)
    base = h @ w[eot].float()
    lo, hi = -100.0, 100.0
    for _ in range(60):
        c = (lo + hi) / 2
        lo, hi = (c, hi) if ((base + c * proj > best).float().mean() < rate) else (lo, c)
    w[eot] += (c * u / (u @ u)).to(w.dtype)


def sampled_turns_end(model, tok, env, tasks, mean_turn: float = 12.0, tail: int | None = 200) -> None:
    """As greedy_turns_end, for sampling at temperature 1: turns average ~mean_turn tokens (bench/rollout.py's
    end_turns_sooner), fitted after the openings' last `tail` tokens (None: the whole openings, at the positions
    where the episodes decode: a fit at positions 0-263 does not hold at 4,000). For the training check,
    whose episodes are sampled and score only when the dialogue ends."""
    contexts = [o[-tail:] if tail else o for o in openings(tok, env, tasks[:4])]
    bench_rollout().end_turns_sooner(model, tok, contexts, mean_turn)


def bench_rollout(name: str = "rollout"):
    """bench/rollout.py (or bench/NAME.py) as a module, loaded from its file (`rollout` is the project's module)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


PROGRESS = lambda figures: None  # noqa: E731  (Report.run points it at the check that runs)
CHECKS = ("versions", "engine", "flash", "kv_peak", "decode", "roofline", "decode_layouts", "head_grad",
          "share_opening", "train", "lora", "fsdp2", "zero3", "fsdp2_x2")


class Padded:
    """An environment whose system prompt is padded by `n` words: openings near a long context cap."""

    def __init__(self, env, n: int):
        self.env, self.n = env, n

    def __getattr__(self, name):
        return getattr(self.env, name)

    def system_prompt(self, task):
        return self.env.system_prompt(task) + "\n" + " ".join(["note"] * self.n)


class Report:
    def __init__(self, out: Path):
        self.out, self.rows, self.partial = out, [], {}

    def progress(self, name: str, figures: dict) -> None:
        """A long check's figures so far, written as a RUNNING row: a run cut off keeps them, and so does a check
        that fails after them."""
        self.partial = dict(figures)
        self.write(extra=[{"check": name, "status": "RUNNING", **figures}])

    def run(self, name, fn, *args):
        t0, self.partial = time.time(), {}
        global PROGRESS
        PROGRESS = lambda figures: self.progress(name, figures)  # noqa: E731
        try:
            status, figures = fn(*args)
        except Exception as e:  # a check that crashed is a FAIL with its error; the others still run
            status, figures = "FAIL", {**self.partial, "error": f"{e.__class__.__name__}: {e}"[:600],
                                       "trace": traceback.format_exc()[-1500:]}
        figures["seconds"] = round(time.time() - t0, 1)
        self.rows.append({"check": name, "status": status, **figures})
        print(f"[gpu] {name}: {status} {json.dumps({k: v for k, v in figures.items() if k != 'trace'})[:400]}",
              flush=True)
        self.write()

    def write(self, extra: list | None = None):
        self.out.mkdir(parents=True, exist_ok=True)
        rows = self.rows + (extra or [])
        (self.out / "report.json").write_text(json.dumps(rows, indent=2, default=str))
        lines = ["# bench/gpu.py report", "", "| check | status | figures |", "|---|---|---|"]
        for r in rows:
            figs = "; ".join(f"{k} {v}" for k, v in r.items() if k not in ("check", "status", "trace"))
            lines.append(f"| {r['check']} | {r['status']} | {figs.replace('|', '/')} |")
        (self.out / "report.md").write_text("\n".join(lines) + "\n")


# ---- the checks ---------------------------------------------------------------------------------------------------

@contextlib.contextmanager
def kernel_cuts(on: bool):
    """cuts.ON set to `on` for the block (the eager twin of the step's kernel cuts when False), and back on
    after, also when the block raises."""
    from fast import cuts

    cuts.ON = on
    try:
        yield
    finally:
        cuts.ON = True

def versions(device):
    import accelerate
    import transformers

    figs = {"torch": torch.__version__, "transformers": transformers.__version__, "accelerate": accelerate.__version__,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    for pkg in ("flash_attn", "deepspeed"):
        try:
            figs[pkg] = __import__(pkg).__version__
        except Exception as e:  # not installed, or a build that does not import
            figs[pkg] = f"no ({e.__class__.__name__})"
    return "PASS", figs


def engine(model, tok, env, tasks, device):
    """Greedy: the engine (batched, KV cache across turns) plays exactly the reference rollout's episodes, with the
    kernel cuts and without them (cuts.ON), with its decoding step replayed as CUDA graphs, and with the
    groups' openings held apart (--decode-share-opening), eagerly and graphed."""
    from fast import pool as pool_module  # the kept pool; the parked caches' host blocks: page-locked in place
    from fast.batched_rollout import RolloutConfig, rollout
    from plumbing.users import make_user_sim
    from rollout import reference_rollout

    base = RolloutConfig(greedy=True, max_new_tokens=24, max_turns=4, max_context=2048)
    sim = make_user_sim("scripted")
    ref = [reference_rollout(model, tok, env, t, sim, base) for t in tasks]
    figs, ok = {"episodes": len(ref), "turns": sum(e.turns for e in ref)}, True
    slow = bench_rollout().SlowUser(sim, 0.05, 0.04)  # replies fetched from the user thread while others decode
    def with_(**kw):
        return RolloutConfig(**{**base.__dict__, **kw})

    where = str(pool_module._compute_dtype_device(model)[1])  # the kept pool's key: the weights' device, "cuda:0"
    for name, cfg, user in (("all", base, sim), ("uncut", base, sim), ("max_batch 2", with_(max_batch=2), sim),
                            ("parked", with_(max_batch=2, park_device="cpu"), sim),
                            ("prefill chunks", with_(prefill_tokens=256), sim), ("slow user", base, slow),
                            ("graphed", with_(decode_graphs="on"), sim),  # captured CUDA graphs (CPU: their body)
                            ("graphed again", with_(decode_graphs="on"), sim),  # the kept pool, its graphs replayed
                            ("shared", with_(decode_share_opening=True), sim),  # the openings held apart (fused kernel)
                            ("shared graphed", with_(decode_share_opening=True, decode_graphs="on"), sim)):
        kept = getattr(pool_module._KEPT.get(where), "graphs", None)  # what an earlier rollout captured, replayed
        had = (kept, len(kept.buckets), kept.replays) if kept is not None else (None, 0, 0)
        t = time.perf_counter()
        with kernel_cuts(name != "uncut"):  # the cuts off: the model's norms, SDPA's own mask conversion
            eps = rollout(model, tok, env, tasks, 1, user, cfg)
        same = sum(a.input_ids == b.input_ids and a.loss_mask == b.loss_mask for a, b in zip(eps, ref))
        figs[name] = f"{same}/{len(ref)} equal"
        ok &= same == len(ref)
        if name.startswith("graphed"):  # what keeping the pool saves: the first rollout captures, the next replays
            took = time.perf_counter() - t
            steps = pool_module._KEPT[where].graphs
            old = had[1:] if steps is had[0] else (0, 0)  # this rollout's own: buckets captured anew, replays
            figs[f"{name}: time"] = (f"{took:.2f} s, {len(steps.buckets) - old[0]} new bucket(s)"
                                     + (" beside the kept graphs'" if old[0] else "")
                                     + f", {steps.replays - old[1]} replays"
                                     + (f", failed: {steps.failed[:80]}" if steps.failed else ""))
        PROGRESS(figs)

    for tag in ("", ":openings"):  # the kept pools and their graphs let go: later checks measure their own memory
        pool_module.let_go(model, tag)
    blocks = [b for free in pool_module._HOST_BLOCKS.values() for b in free]
    pinned = sum(b.is_pinned() and b.data_ptr() % 4096 == 0 for b in blocks)  # cudaHostRegister'd in place
    figs["parked host blocks"] = f"{len(blocks)}, {pinned} page-aligned and page-locked"
    ok &= bool(blocks) and (pinned == len(blocks) or device.type != "cuda")  # (a pool on the CPU pins nothing)
    return ("PASS" if ok else "FAIL"), figs


def flash(tok, env, tasks, device, shape):
    """bf16, the same weights with sdpa and with flash-attn: the trainer's log-probs of the same episodes (the
    rollout's engine attends through decode.grouped_decode_attention whatever the model's implementation, so
    flash-attn is the trainer's: its forwards and the reference's) against sdpa's, over the sampled tokens."""
    if device.type != "cuda":
        return "SKIP", {"why": "needs CUDA"}
    try:
        import flash_attn  # noqa: F401
    except ImportError as e:
        return "SKIP", {"why": f"flash-attn does not import ({e})"}
    from fast.batched_rollout import RolloutConfig, rollout
    from plumbing.users import make_user_sim
    from fast.logprobs import token_logprobs

    cfg = RolloutConfig(greedy=True, max_new_tokens=64, max_turns=3, max_context=4096)
    lps, eps = {}, None
    for attn in ("sdpa", "flash_attention_2"):
        model = build(tok, shape, device, torch.bfloat16, attn)
        greedy_turns_end(model, tok, env, tasks)
        if eps is None:
            eps = rollout(model, tok, env, tasks, 1, make_user_sim("scripted"), cfg)
        with torch.no_grad():
            lps[attn] = [token_logprobs(model, torch.tensor([e.input_ids], device=device),
                                        torch.ones(1, len(e.input_ids), dtype=torch.long, device=device))[0]
                         for e in eps]
        del model
        torch.cuda.empty_cache()
    gaps = torch.cat([(a - b).abs()[torch.tensor(e.loss_mask, device=device) > 0]
                      for a, b, e in zip(lps["sdpa"], lps["flash_attention_2"], eps)])
    return "PASS", {"sampled_tokens": len(gaps), "logprob_gap_mean": float(gaps.mean()),
                    "logprob_gap_max": float(gaps.max())}


def kv_peak(tok, env, tasks, device, shapes):
    """A rollout's peak GPU memory at long contexts against the estimate's weights + KV cache; `shapes`: model shape
    -> contexts (the engine's slots hold every decoding episode at max_context: the estimate's KV term exactly)."""
    if device.type != "cuda":
        return "SKIP", {"why": "needs CUDA"}
    figs, decoded = {}, True
    for shape, contexts in shapes.items():
        ok, more = _kv_peak(tok, env, tasks, device, shape, contexts)
        decoded &= ok
        figs.update({f"{shape} {k}": v for k, v in more.items()})
    return ("PASS" if decoded else "FAIL"), figs


def _kv_peak(tok, env, tasks, device, shape, contexts):
    from plumbing import memory
    from fast.batched_rollout import RolloutConfig, rollout
    from plumbing.users import make_user_sim

    model = build(tok, shape, device, torch.bfloat16)
    greedy_turns_end(model, tok, env, tasks)
    n_params = sum(p.numel() for p in model.parameters())
    per_word = len(toolcall.encode_text(tok, " note" * 100)) / 100  # tokens a padding word costs
    base = max(len(o) for o in openings(tok, env, tasks))
    figs, decoded = {}, True
    for ctx in contexts:
        # the system prompt padded so that every episode opens ~600 tokens below the cap: the KV cache's worst case
        long_env = Padded(env, max(0, int((ctx - 600 - base) / per_word)))
        cfg = RolloutConfig(greedy=True, max_new_tokens=64, max_turns=2, max_context=ctx)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        eps = rollout(model, tok, long_env, tasks, 1, make_user_sim("scripted"), cfg)
        peak = torch.cuda.max_memory_allocated(device)
        prefill = memory.prefill_bytes(model.config, True, min(cfg.prefill_tokens, ctx * len(tasks)), ctx)
        est = memory.memory_estimate(n_params, bf16=True, kv_bytes_per_token=memory.kv_bytes_per_token(model.config, True),
                                    max_context=cfg.max_context, episodes=len(tasks), inference=True, prefill=prefill)
        decoded &= all(e.gen_tokens > 0 for e in eps)
        figs[f"ctx {ctx}"] = (f"peak {memory.gib(peak)}, estimate {memory.gib(est['rollout_peak'])} (weights + KV + a prefill chunk, no other "
                              f"activations beyond one prefill chunk's), ratio {peak / est['rollout_peak']:.2f}; of "
                              f"which prefill {memory.gib(prefill)}; longest episode "
                              f"{max(len(e.input_ids) for e in eps)} tokens, {sum(e.gen_tokens for e in eps)} sampled")
    # PASS when every episode decoded at every context; the ratio is the finding
    del model
    torch.cuda.empty_cache()
    return decoded, figs


@torch.no_grad()
def never_stops(model, tok) -> None:
    """Zero the output rows of every token that ends a turn (muarl.stop_token_ids), in place: their logits are then
    exactly 0 at every position, below the largest of the vocabulary's other logits (a random model's are spread
    around 0), so greedy decoding runs every row to its cap. A calibration fitted on some positions can flip at
    others: the H200 run's "50 tokens/s" was every row stopping at its first token at the engine's positions (641+)
    after greedy_turns_end had pushed the row down at positions 0-255."""
    for t in muarl.stop_token_ids(model, tok):
        model.get_output_embeddings().weight[t] = 0


def decode(model, tok, env, tasks, device, batch, new_tokens):
    """The engine's greedy decode speed against a bare loop (one forward per token, transformers' DynamicCache, no
    stopping) over the same model, batch and number of new tokens: what the engine's bookkeeping costs. Each side's
    prefill is outside its timing: the engine's decoding time is a rollout of new_tokens a row minus one of 1 token a
    row (prefill and one step); the bare loop times new_tokens - 1 steps after its prefill. The tokens decoded and why
    the episodes stopped are reported: every row must run to new_tokens, else the figure is not the speed it names."""
    from collections import Counter

    from transformers import DynamicCache

    from fast.batched_rollout import RolloutConfig, rollout
    from plumbing.users import make_user_sim
    from fast.decode import with_cache

    import copy

    model = copy.deepcopy(model)
    never_stops(model, tok)
    picked = (tasks * batch)[:batch]
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    cfg = RolloutConfig(greedy=True, max_new_tokens=new_tokens, max_turns=1, max_context=4096)
    one = RolloutConfig(greedy=True, max_new_tokens=1, max_turns=1, max_context=4096)

    def timed(c):
        sync()
        t0 = time.time()
        eps = rollout(model, tok, env, picked, 1, make_user_sim("scripted"), c)
        sync()
        return time.time() - t0, eps

    timed(cfg), timed(one)  # warm-up
    (t_full, eps), (t_one, _) = timed(cfg), timed(one)
    t_engine, n_engine = max(t_full - t_one, 1e-9), sum(e.gen_tokens for e in eps) - len(eps)
    prompt = [e.input_ids[:len(e.input_ids) - e.gen_tokens] for e in eps]
    width = max(len(p) for p in prompt)
    ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in prompt], device=device)
    attn = (torch.arange(width, device=device)[None] >= torch.tensor([width - len(p) for p in prompt],
                                                                      device=device)[:, None]).long()
    steps = new_tokens - 1
    for _ in (1, 2):  # the first is a warm-up
        cache, mask = DynamicCache(), attn
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, **with_cache(model, cache))  # prefill
        x, pos = out.logits[:, -1].argmax(-1, keepdim=True), pos[:, -1:] + 1
        sync()
        t0 = time.time()
        for _ in range(steps):
            mask = torch.cat([mask, mask.new_ones(len(prompt), 1)], 1)
            out = model(input_ids=x, attention_mask=mask, position_ids=pos, **with_cache(model, cache))
            x, pos = out.logits[:, -1].argmax(-1, keepdim=True), pos + 1
        sync()
        t_bare = time.time() - t0
    n_bare = steps * len(prompt)
    ratio = (n_engine / t_engine) / (n_bare / t_bare)
    figs = {"engine_tokens_per_s": round(n_engine / t_engine, 1), "bare_tokens_per_s": round(n_bare / t_bare, 1),
            "engine_over_bare": round(ratio, 3), "batch": len(prompt), "prefill_s": round(t_one, 3),
            "tokens": f"{sum(e.gen_tokens for e in eps)} of {batch * new_tokens}",
            "ends": dict(Counter(str(e.termination) for e in eps))}  # response_truncated: cut at new_tokens
    if device.type == "cuda":  # host syncs a decode step: CUDA's sync debug mode warns once per synchronizing call
        import warnings

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                rollout(model, tok, env, picked, 1, make_user_sim("scripted"), cfg)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs = sum("synchroniz" in str(w.message) for w in caught)
        figs["engine_host_syncs_per_step"] = round(syncs / max(1, new_tokens), 2)
    if sum(e.gen_tokens for e in eps) < batch * new_tokens:  # a row that stopped early: not the speed it names
        return "FAIL", {**figs, "why": "rows stopped before new_tokens: not the decode speed it names"}
    return "PASS", figs


def copy_bandwidth(device, nbytes: int) -> float:
    """Bytes a second that a device-to-device copy of `nbytes` reads and writes (the roofline's bandwidth)."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    for i in range(6):
        if i == 2:
            sync(device)
            t = time.perf_counter()
        b.copy_(a)
    sync(device)
    return 2 * nbytes * 4 / (time.perf_counter() - t)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def ops_a_step(model, batch: int, context: int, cfg) -> int:
    """The aten ops one eager decoding step of `batch` rows over `context` positions dispatches, views left out: the
    kernels it launches, about (a graph replays them all in one launch). torch's rms_norm is one op where the device
    has a fused kernel for it (CUDA) and its decomposition elsewhere (the CPU)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from fast.decode import decode_attention, decode_step
    from fast.engine import _cache, _mask, _View
    from fast.pool import SlotPool

    pool, dev, n = SlotPool(model, batch, context + 8), model.device, [0]
    view, lens = _View(pool, 0), torch.full((batch,), context, device=dev)

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            n[0] += not func.is_view
            return func(*args, **(kwargs or {}))

    with torch.no_grad(), decode_attention(model, cfg.decode_attention):
        view.set(lens, 1, context + 1)
        with Count():
            decode_step(model, _cache([view]), torch.zeros(batch, 1, dtype=torch.long, device=dev),
                        _mask(lens, 1, view.seen, pool, cfg), lens[:, None], torch.arange(batch, device=dev), cfg)
    return n[0]


def replayed_ms(fn, device, reps: int = 10) -> float:
    """Milliseconds one call of `fn` takes, captured as a CUDA graph and replayed (on the CPU: called)."""
    fn()
    run = fn
    if device.type == "cuda":
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        run = graph.replay
    run()
    sync(device)
    t = time.perf_counter()
    for _ in range(reps):
        run()
    sync(device)
    return (time.perf_counter() - t) / reps * 1e3


def step_parts(model, batch: int, context: int, bandwidth: float, device) -> dict:
    """Where a decoding step's time goes, each part alone and replayed as a graph: every layer's grouped attention
    over `context` cached columns (one [batch, kv heads, context, head] cache a layer, read through the step's own
    attention function and mask), and every layer's seven projections and the output layer at `batch` rows. Each as
    ms and GB/s of what it must read (the cache; the weights), against the copy bandwidth: {part: (line, ms)}."""
    from fast.decode import grouped_decode_attention

    c, dtype = model.config, next(model.parameters()).dtype
    layers, kvh, d = c.num_hidden_layers, c.num_key_value_heads, c.head_dim
    cache = torch.randn(2, layers, batch, kvh, context, d, device=device, dtype=dtype)
    q = torch.randn(batch, c.num_attention_heads, 1, d, device=device, dtype=dtype)
    seen = torch.ones(batch, 1, 1, context, dtype=torch.bool, device=device)
    attn = model.model.layers[0].self_attn

    def attention():
        for i in range(layers):
            grouped_decode_attention(attn, q, cache[0, i], cache[1, i], seen, scaling=d ** -0.5)

    mats = [m.weight for layer in model.model.layers for m in (
        layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.self_attn.o_proj,
        layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj)] + [model.lm_head.weight]
    inputs = {w.shape[1]: torch.randn(batch, w.shape[1], device=device, dtype=dtype) for w in mats}

    def gemms():
        for w in mats:
            torch.nn.functional.linear(inputs[w.shape[1]], w)

    with torch.no_grad():
        a_ms, g_ms = replayed_ms(attention, device), replayed_ms(gemms, device)
    read_a = cache.numel() * cache.element_size()
    read_g = sum(w.numel() * w.element_size() for w in mats)
    return {name: (f"{ms:.2f} ms, {read / ms / 1e6:.0f} GB/s ({read / ms / 1e6 / (bandwidth / 1e9):.0%} of the "
                   "copy's)", ms) for name, ms, read in (("attention", a_ms, read_a), ("gemms", g_ms, read_g))}


def roofline(device, cpu: bool):
    """The decoding step's seconds against the time to read its weights and live KV cache once at the copy
    bandwidth: eager (the grouped attention) as before issue 52 (no kernel cuts) and now, graphed with and without
    the cuts (cuts.ON: each norm fused, the mask made once a step), the model's own attention at the first
    point, and compiled at the target's point after the grid; in bf16 (CPU: fp32 toy), sampling at temperature 1,
    and greedy at the first point. At the target's point, the step's attention alone and its GEMMs alone."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from fast.batched_rollout import RolloutConfig as cfg
    from fast.graphs import col_bucket

    step_cost = bench_rollout().step_cost
    eager, graphed = cfg(compile_decode="off"), cfg(compile_decode="off", decode_graphs="on")
    variants = {"eager uncut": eager, "eager": eager, "graphed": graphed, "graphed uncut": graphed}
    uncut = ("eager uncut", "graphed uncut")  # cuts.ON off: the step as it was before issue 52

    def step_ms(model, how, c, batch, context, seen=None):
        with kernel_cuts(how not in uncut):
            return min(step_cost(model, batch, context, steps=STEPS, cfg=c, seen=seen) for _ in range(2)) * 1e3

    STEPS = 10  # a step's time is the best of two runs of STEPS, over a pool of context + STEPS + 8 columns

    dtype = torch.float32 if cpu else torch.bfloat16
    shapes = {"toy": dict(SHAPES["toy"], vocab_size=4096)} if cpu else {
        "qwen3-0.6b": dict(SHAPES["qwen3-0.6b"], vocab_size=151936, tie_word_embeddings=True),
        "qwen3-8b": dict(SHAPES["qwen3-8b-attn-4l"], num_hidden_layers=36, vocab_size=151936)}
    grid = [(b, c) for b in ((4, 16) if cpu else (16, 64)) for c in ((128, 512) if cpu else (1024, 8192))]
    target_point = grid[-1] if cpu else (16, 8192)
    bandwidth = copy_bandwidth(device, (64 if cpu else 2048) << 20)
    figs, target = {"copy_GB_per_s": round(bandwidth / 1e9, 1)}, None
    for name, shape in shapes.items():
        torch.manual_seed(0)
        mc = Qwen3Config(**shape, max_position_embeddings=40960)
        mc._attn_implementation = "sdpa"
        before = torch.get_default_dtype()
        torch.set_default_dtype(dtype)  # made in bf16 on the device: 8B in float32 first would need 32 GB more
        try:
            with torch.device(device):
                model = Qwen3ForCausalLM(mc).eval()
        finally:
            torch.set_default_dtype(before)
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        per_token = 2 * mc.num_hidden_layers * mc.num_key_value_heads * mc.head_dim * torch.finfo(dtype).bits // 8
        for batch, context in grid:
            cache = batch * (context + 64) * per_token
            free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 1 << 40
            key = f"{name} b{batch} ctx{context}"
            if 1.3 * cache + (1 << 30) > free:  # the buffers, the model attention's copies of one layer, logits
                figs[key] = f"skipped: its {cache / 2**30:.0f} GiB cache does not fit"
                continue
            seen, ms = {}, {}
            for how, c in variants.items():
                ms[how] = step_ms(model, how, c, batch, context, seen if how == "graphed" else None)
            if (batch, context) == grid[0]:  # the engine before issue 37, once
                ms["model's attention"] = step_ms(model, "model", cfg(decode_attention="model", compile_decode="off"),
                                                  batch, context)
            bound = (weights + batch * context * per_token) / bandwidth * 1e3
            # the columns the graphed step's bucket reads at its last step, capped by step_cost's pool
            cols = col_bucket(context + STEPS + 3, context + STEPS + 8)
            bucket_bound = (weights + batch * cols * per_token) / bandwidth * 1e3
            best = ms["graphed"]
            figs[key] = (", ".join(f"{k} {v:.2f} ms" for k, v in ms.items()) + f"; roofline {bound:.2f} ms: graphed "
                         f"{best / bound:.2f}x the roofline ({best / bucket_bound:.2f}x at the {cols} columns its "
                         f"bucket reads), {batch / best * 1e3:.0f} tokens/s, {ms['eager uncut'] / best:.1f}x the "
                         f"eager step's before issue 52 ({ms['eager'] / best:.1f}x with the cuts), the cuts "
                         f"{ms['graphed uncut'] / best:.2f}x graphed; first step (its capture) {seen['first_s']:.2f} "
                         f"s, {seen['replays']} replays in {seen['buckets']} bucket(s)")
            if (batch, context) == grid[0]:  # greedy too, and the step's ops (~kernels), with and without the cuts
                g = {how: step_ms(model, how, dataclasses.replace(variants[how], greedy=True), batch, context)
                     for how in ("eager uncut", "graphed")}
                figs[f"{key} greedy"] = (f"eager uncut {g['eager uncut']:.2f} ms, graphed {g['graphed']:.2f} ms: "
                                         f"{g['eager uncut'] / g['graphed']:.1f}x")
                for how, c in (("greedy", dataclasses.replace(eager, greedy=True)), ("sampled top-p 0.9",
                               dataclasses.replace(eager, greedy=False, temperature=0.7, top_p=0.9))):
                    for cuts in (True, False):
                        with kernel_cuts(cuts):
                            figs[f"{name} ops a step, {how}{'' if cuts else ', uncut'}"] = ops_a_step(
                                model, batch, context, c)
            if (name == "qwen3-8b" or cpu) and (batch, context) == target_point:
                target = best / bound
                parts = step_parts(model, batch, cols, bandwidth, device)  # (the columns the graphed step reads)
                if device.type == "cuda":
                    torch.cuda.empty_cache()  # its 18 GiB cache at 8B, lest the next point read it as taken
                figs[f"{key} alone"] = {**{k: line for k, (line, _) in parts.items()}, "the rest": (
                    f"{best - sum(ms for _, ms in parts.values()):.2f} ms of the graphed step's {best:.2f} (norms, "
                    "rotary, cache writes, activations, the draw, and the parts' overlap)")}
            PROGRESS(figs)  # each point written as it is measured
        # compiled last, at the target's point only (the toy's first on the CPU): on an H200 one compile of the 0.6B
        # step took 114 s and one of the 8B step 130 s, so it must not hold back the graphed figures
        if cpu or name == "qwen3-8b":
            point = grid[0] if cpu else target_point
            start = time.perf_counter()
            first = step_ms(model, "compiled", cfg(compile_decode="on"), *point)
            figs[f"{name} b{point[0]} ctx{point[1]} compiled"] = (
                f"{first:.2f} ms a step; its compile and two timed calls {time.perf_counter() - start:.0f} s")
            PROGRESS(figs)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if cpu:
        return "PASS", figs
    figs["target"] = "graphed step within 1.5x of the roofline at qwen3-8b, batch 16, context 8192"
    return ("PASS" if target is not None and target <= 1.5 else "FAIL"), figs


def save_start(model, tok, env, tasks, work: Path) -> Path:
    """The runs' starting checkpoint: a CPU copy of `model` (kept out of the GPU's peak) whose sampled turns end."""
    import copy

    from tests.fake_env import HalfUniformEnv

    start = work / "start"
    model = copy.deepcopy(model).to("cpu")
    fake = HalfUniformEnv()  # the runs' environment: calibrated on its openings (the shop's left 0.6B turns running
    sampled_turns_end(model, tok, fake, fake.tasks("train"), 8.0)  # past 48 tokens on an H100: nothing scored)
    model.save_pretrained(start)
    tok.save_pretrained(start)
    return start


def train(model, tok, env, tasks, device, work: Path, bf16: bool):
    """2 SFT steps, 2 GRPO steps, --resume for a third, on the saved model; the run's own checks and figures."""
    import grpo
    from plumbing import memory
    import sft

    start = save_start(model, tok, env, tasks, work)
    common = ["--bf16"] if bf16 else []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    sft.main(["--model", str(start), "--env", "shop", "--num-tasks", "8", "--batch-size", "4", "--micro-batch-size",
              "2", "--epochs", "1", "--gradient-checkpointing", "--out", str(work / "sft"), "--overwrite", *common])
    run = work / "grpo"
    # GRPO on a toy environment of the tests with one mixed group a step (rewards 1, 0 in turn): a real gradient
    # from the built model, whose turns end (two SFT steps at the tiny model's lr undo that calibration)
    args = ["--init-from", str(start), "--env", "tests.fake_env:HalfUniformEnv", "--steps", "2", "--tasks-per-step",
            "2", "--group-size", "4", "--max-new-tokens", "48", "--max-turns", "4", "--max-context", "2048",
            "--eval-tasks", "0", "--micro-batch-size", "2", "--gradient-checkpointing", "--save-every", "1",
            "--out-dir", str(run), "--overwrite", "--temperature", "1.0", *common]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    grpo.main(args)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    grpo.main(["--resume", str(run), "--env", "tests.fake_env:HalfUniformEnv", "--steps", "3"])
    rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
    n = sum(p.numel() for p in model.parameters())
    est = memory.memory_estimate(n, bf16=bf16, kv_bytes_per_token=memory.kv_bytes_per_token(model.config, bf16),
                                max_context=2048, episodes=8)
    checks = {"steps logged once": [r["step"] for r in rows] == [1, 2, 3],
              "kl 0 at step 1": "kl" in rows[0] and abs(rows[0]["kl"]) < 1e-6,
              "finite, non-zero grad norm": all(0 < r.get("grad_norm", float("nan")) < float("inf") for r in rows),
              "no skipped update": all(r["skipped_updates"] == 0 for r in rows),
              # bf16 on an H100 measured 0.001-0.003 one process, up to 0.0096 under FSDP2 / ZeRO-3; fp32 ~2e-7
              "logprob_gap small": all(r.get("logprob_gap", 0) < (2e-2 if bf16 else 1e-4) for r in rows)}
    figs = {k: v for k, v in checks.items()}
    figs.update(kl=[r.get("kl") for r in rows], grad_norm=[r.get("grad_norm") for r in rows],
                logprob_gap=[r.get("logprob_gap") for r in rows])
    if peak:
        figs["peak"] = f"{memory.gib(peak)} vs estimate {memory.gib(est['peak'])} (activations not in the estimate)"
    return ("PASS" if all(checks.values()) else "FAIL"), figs


def lora_steps(model, tok, env, tasks, device, work: Path, bf16: bool):
    """The train check's GRPO steps with LoRA adapters of rank 16 on every projection, then --resume for a third."""
    import grpo
    from plumbing import lora
    from plumbing import memory

    start, run = work / "start", work / "grpo-lora"
    args = ["--init-from", str(start), "--env", "tests.fake_env:HalfUniformEnv", "--steps", "2", "--tasks-per-step",
            "2", "--group-size", "4", "--max-new-tokens", "48", "--max-turns", "4", "--max-context", "2048",
            "--eval-tasks", "0", "--micro-batch-size", "2", "--gradient-checkpointing", "--save-every", "1",
            "--out-dir", str(run), "--overwrite", "--temperature", "1.0", "--lora-rank", "16", "--lr", "1e-3",
            *(["--bf16"] if bf16 else [])]
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    res = grpo.main(args)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    base, _ = models.load_model(str(start), device="cpu", dtype=torch.bfloat16 if bf16 else torch.float32)
    trained = {k.replace(".base_layer", ""): v for k, v in res.model.get_base_model().state_dict().items()
               if ".lora_" not in k}
    base_same = all(torch.equal(v, trained[k].cpu()) for k, v in base.state_dict().items())
    adapters_fp32 = all(p.dtype == torch.float32 for p in res.model.parameters() if p.requires_grad)
    del res, trained
    grpo.main(["--resume", str(run), "--env", "tests.fake_env:HalfUniformEnv", "--steps", "3"])
    rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
    ckpt = run / "checkpoints" / "step-000003" / "model"
    n = sum(p.numel() for p in model.parameters())
    est = memory.memory_estimate(n, bf16=bf16, kv_bytes_per_token=memory.kv_bytes_per_token(model.config, bf16),
                                max_context=2048, episodes=8, lora=lora.adapter_params(model, 16),
                                prefill=memory.prefill_bytes(model.config, bf16, 8 * 2048, 2048))
    checks = {"steps logged once": [r["step"] for r in rows] == [1, 2, 3],
              # exactly 0 on the CPU (a fresh adapter's B is 0); a GPU may pick other kernels with and without grad
              "kl 0 at step 1": "kl" in rows[0] and abs(rows[0]["kl"]) < 1e-6,
              "kl > 0 after": all(r.get("kl", 0) > 0 for r in rows[1:]),
              "finite, non-zero grad norm": all(0 < r.get("grad_norm", float("nan")) < float("inf") for r in rows),
              "no skipped update": all(r["skipped_updates"] == 0 for r in rows),
              "logprob_gap small": all(r.get("logprob_gap", 0) < (2e-2 if bf16 else 1e-4) for r in rows),
              "base bit-identical": base_same, "adapters fp32": adapters_fp32,
              "adapter-only checkpoint": (ckpt / "adapter_model.safetensors").exists()
              and not (ckpt / "model.safetensors").exists()}
    figs = dict(checks)
    figs.update(kl=[r.get("kl") for r in rows], grad_norm=[r.get("grad_norm") for r in rows],
                logprob_gap=[r.get("logprob_gap") for r in rows],
                checkpoint_mb=round(sum(f.stat().st_size for f in ckpt.iterdir()) / 2**20, 1))
    if peak:
        figs["peak"] = f"{memory.gib(peak)} vs estimate {memory.gib(est['peak'])} (activations not in the estimate)"
    cuda = device.type == "cuda"
    figs.update(lora_decode(model, tok, env, tasks, device, bf16, rank=64 if cuda else 4,
                            new_tokens=128 if cuda else 16))
    return ("PASS" if all(checks.values()) else "FAIL"), figs


def lora_decode(model, tok, env, tasks, device, bf16: bool, rank: int = 64, new_tokens: int = 128):
    """Greedy decoding of the same 16 prompts with adapters of `rank` on every projection (B random, so they change
    the policy), peft's unmerged layers at every step against lora.merged_for_decoding (grpo.py's default),
    interleaved twice after a warm-up: tokens/s each, and the share of episodes whose tokens agree (bf16 rounds the
    merged weights once, so a near-tie can go the other way)."""
    import copy

    from plumbing import lora
    from fast.batched_rollout import RolloutConfig, rollout
    from plumbing.users import make_user_sim

    net = copy.deepcopy(model).to(torch.bfloat16 if bf16 else torch.float32)
    greedy_turns_end(net, tok, env, tasks, rate=0.0)
    net = lora.add_adapters(net, rank=rank, alpha=0, dropout=0.0, targets=lora.DEFAULT_TARGETS, base="bench",
                            autocast=bf16).eval()
    with torch.no_grad():
        for name, p in net.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.02, generator=torch.Generator(device=p.device).manual_seed(len(name)))
    picked, cfg = (tasks * 16)[:16], RolloutConfig(greedy=True, max_new_tokens=new_tokens, max_turns=1,
                                                  max_context=4096)
    amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)
    tps, tokens = {"unmerged": [], "merged": []}, {}
    for rnd in range(3):  # the first a warm-up
        for kind in tps:
            sync(device)
            t0 = time.time()
            with amp, lora.merged_for_decoding(net, enabled=kind == "merged") as policy:
                eps = rollout(policy, tok, env, picked, 1, make_user_sim("scripted"), cfg)
            sync(device)
            if rnd:
                tps[kind].append(sum(e.gen_tokens for e in eps) / (time.time() - t0))
            tokens[kind] = [e.input_ids for e in eps]
    same = sum(a == b for a, b in zip(tokens["merged"], tokens["unmerged"])) / len(picked)
    return {"lora_decode_tokens_per_s": {k: [round(x, 1) for x in v] for k, v in tps.items()},
            "lora_merged_over_unmerged": round(sum(tps["merged"]) / sum(tps["unmerged"]), 3),
            "lora_decode_same_episodes": same, "lora_decode_rank": rank}


def head_grad(device, vocab: int, hidden: int, tokens: int = 256):
    """The chunked output layer's weight gradient in bf16 (logprobs.accumulate_weight_grad) at Qwen3-8B's vocabulary
    and width: one chunk's dz.T @ h accumulated into the float32 buffer in one GEMM a block of rows where the device
    can (CUDA), against the product made in bf16, cast and added; the error of each against float32 arithmetic, the
    peak memory above the inputs (bounded by the blocks: at most 8 bytes a weight of one block), the time."""
    from fast import logprobs

    g = torch.Generator(device=device).manual_seed(0)
    dz = (torch.randn(tokens, vocab, device=device, generator=g) * 1e-3).bfloat16()
    h = torch.randn(tokens, hidden, device=device, generator=g).bfloat16()
    want = dz.float().t() @ h.float()
    grad = torch.zeros(vocab, hidden, device=device)
    key = str(grad.device)  # the key accumulate_weight_grad reads ("cuda:0", not "cuda")
    bound_mb = 8 * logprobs.GRAD_BLOCK / 2**20 + 1
    figs, results = {"block_weights": logprobs.GRAD_BLOCK, "transient_bound_mb": bound_mb}, {}
    for name, fused in (("fused", True), ("cast and add", False)):
        logprobs._FUSED[key] = fused and device.type == "cuda"
        for _ in range(2):  # warm-up, then the measured one
            grad.zero_()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
                base = torch.cuda.memory_allocated(device)
            t0 = time.perf_counter()
            logprobs.accumulate_weight_grad(grad, dz, h)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            took = time.perf_counter() - t0
        results[name] = logprobs._FUSED[key]  # the peak read before the error's own [V, H] temporaries are made
        transient = (torch.cuda.max_memory_allocated(device) - base) / 2**20 if device.type == "cuda" else None
        figs[name] = {"ms": round(took * 1e3, 2), "max_error": float((grad - want).abs().max()),
                      "transient_mb": None if transient is None else round(transient, 1), "one_gemm": results[name]}
    logprobs._FUSED.pop(key, None)
    if device.type != "cuda":
        return "SKIP", {"why": "the one-GEMM float32 accumulation exists on CUDA only", **figs}
    ok = results["fused"] and not results["cast and add"] \
        and figs["fused"]["max_error"] <= figs["cast and add"]["max_error"] \
        and max(figs["fused"]["transient_mb"], figs["cast and add"]["transient_mb"]) <= bound_mb
    return ("PASS" if ok else "FAIL"), figs


def launched(kind: str, work: Path, out: Path, device, processes: int = 1):
    """The GRPO steps under `accelerate launch` with FSDP2 or ZeRO-3, then --resume for a third step (the sharded
    checkpoint written and read back). With two processes (FSDP2, where two GPUs are at hand), with the accelerate
    config's CPU-RAM-efficient loading on, which in transformers 5.17 zeroes the weights of every process but the
    first: the start-up checksum check passes and kl is exactly 0 at step 1 only if every process loaded real
    weights."""
    if device.type != "cuda":
        return "SKIP", {"why": "needs CUDA"}
    if torch.cuda.device_count() < processes:
        return "SKIP", {"why": f"needs {processes} GPUs; this machine has {torch.cuda.device_count()}, so the "
                               "multi-process checks did not run"}
    if kind == "zero3":
        try:
            import deepspeed  # noqa: F401
        except Exception as e:
            return "SKIP", {"why": f"deepspeed does not import ({e.__class__.__name__})"}
    config = work / f"{kind}-x{processes}.yaml"
    if kind == "fsdp2":  # FULL_STATE_DICT: muarl saves sharded whatever the config says (cli.sharded_checkpoints)
        config.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: FSDP\nmixed_precision: bf16\n"
                          f"num_machines: 1\nnum_processes: {processes}\nmachine_rank: 0\nuse_cpu: false\n"
                          "fsdp_config:\n  fsdp_version: 2\n  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n"
                          "  fsdp_transformer_layer_cls_to_wrap: Qwen3DecoderLayer\n"
                          "  fsdp_reshard_after_forward: true\n  fsdp_state_dict_type: FULL_STATE_DICT\n"
                          f"  fsdp_cpu_ram_efficient_loading: {'true' if processes > 1 else 'false'}\n")
    else:
        config.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: DEEPSPEED\nmixed_precision: bf16\n"
                          "num_machines: 1\nnum_processes: 1\nmachine_rank: 0\nuse_cpu: false\ndeepspeed_config:\n"
                          "  zero_stage: 3\n  zero3_init_flag: true\n  gradient_accumulation_steps: 1\n"
                          "  offload_optimizer_device: none\n  offload_param_device: none\n")
    run, name = work / f"grpo-{kind}-x{processes}", f"{kind}-x{processes}"
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), str(ROOT / "grpo.py")]
    first = ["--init-from", str(work / "start"), "--env", "tests.fake_env:HalfUniformEnv", "--steps", "2",
             "--tasks-per-step", "2", "--group-size", "4", "--max-new-tokens", "48", "--max-turns", "4",
             "--max-context", "2048", "--eval-tasks", "0", "--micro-batch-size", "2", "--bf16",
             "--gradient-checkpointing", "--save-every", "1", "--out-dir", str(run), "--overwrite"]
    out.mkdir(parents=True, exist_ok=True)
    for part, args in (("", first), ("-resume", ["--resume", str(run), "--env", "tests.fake_env:HalfUniformEnv",
                                                 "--steps", "3"])):
        r = subprocess.run(launch + args, cwd=ROOT, capture_output=True, text=True, timeout=300)
        (out / f"{name}{part}.log").write_text(r.stdout + "\n---- stderr ----\n" + r.stderr)
        if r.returncode:  # the launched process's own traceback comes before the launcher's (ChildFailedError)
            at = r.stderr.find("Traceback")
            return "FAIL", {"exit": r.returncode, "log": str(out / f"{name}{part}.log"),
                            "error": r.stderr[at:at + 3000] if at >= 0 else r.stderr[-3000:]}
    rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
    state = run / "checkpoints" / "step-000002" / "accelerate"
    checks = {"steps logged once": [r["step"] for r in rows] == [1, 2, 3],
              "kl 0 at step 1": "kl" in rows[0] and abs(rows[0]["kl"]) < 1e-6,
              "finite, non-zero grad norm": all(0 < r.get("grad_norm", 0) < float("inf") for r in rows),
              "no skipped update": all(r["skipped_updates"] == 0 for r in rows)}
    if kind == "fsdp2":  # each process wrote its own shards (torch.distributed.checkpoint), no full state dict
        checks["sharded save_state"] = (state / "pytorch_model_fsdp_0").is_dir() and not any(state.glob("*.bin"))
    figs = dict(checks)
    figs.update(kl=[r.get("kl") for r in rows], grad_norm=[r.get("grad_norm") for r in rows],
                logprob_gap=[r.get("logprob_gap") for r in rows], processes=processes)
    return ("PASS" if all(checks.values()) else "FAIL"), figs


def share_opening(tok, device, shape: str, opening: int, length: int):
    """bench/train_step.py's tau2-shaped update (2 groups of 8, `opening` of tau2 retail's opening, episodes of up to
    `length` tokens) on a Qwen3 shape, in bf16 with gradient checkpointing on a GPU: each group's opening computed once
    against every episode whole, at micro-batches of 4 and 1: seconds (median of 3 after a warm-up), peak memory,
    decoder tokens. Then 3 rows of a group, whole and shared, in bf16 against float32: the shared gradient's error at
    most twice the whole one's. PASS on a GPU also needs the shared update faster at both sizes."""
    import copy

    from fast.logprobs import token_logprobs
    from fast.opening import common_opening, shared_opening_logprobs

    ts, bf16 = bench_rollout("train_step"), device.type == "cuda"
    try:
        import envs.tau2  # noqa: F401  (the workload is tau2 retail's opening; tau2's own __init__ imports nothing)
    except ImportError as e:
        return "SKIP", {"why": f"tau2 does not import here ({e}): carry its wheels (bash bench/gpu_wheels.sh)"}
    eps, cfg = ts.tau2_workload(length, opening)[2:]
    model = build(tok, shape, device).train()
    if bf16:
        model.gradient_checkpointing_enable()
    ref = copy.deepcopy(model).eval().requires_grad_(False)
    figs, faster = {}, True
    for size in (4, 1):
        c = ts.grpo.Config(**{**cfg.__dict__, "micro_batch_size": size})
        runs = {True: [], False: []}
        for r in range(4):  # round 0 warms up
            for share in (True, False) if r % 2 else (False, True):
                out = ts.update(model, ref, eps, c, share, bf16=bf16)
                if r:
                    runs[share].append(out)
        (a, ma, ta), (b, mb, tb) = ([sorted(x)[1] for x in zip(*runs[s])] for s in (False, True))
        figs[f"micro-batches of {size}"] = {"whole_s": round(a, 3), "shared_s": round(b, 3), "x": round(a / b, 2),
                                            "tokens": [ta, tb],
                                            "peak_mb": [round(ma / 2**20), round(mb / 2**20)] if bf16 else None}
        faster &= a > b  # memory is reported, not a gate: at a micro-batch of 1 the remainders' mask may cost more
        PROGRESS(figs)
    del ref
    # one group's first three episodes, gradient checkpointing still on: in float32, sdpa's attention over 3 rows of
    # 4.5k tokens keeps 3.6 GiB of scores a layer for the backward (the H200's 139 GiB ran out at 0.6B's 28 layers)
    rows = eps[:3]
    n = min(len(e.input_ids) for e in rows)
    cut = min(n, opening + 512)
    ids = torch.tensor([e.input_ids[:cut] for e in rows], device=device)
    attn, mask = torch.ones_like(ids), torch.tensor([e.loss_mask[:cut] for e in rows], device=device)
    shared = common_opening([(e.input_ids[:cut], e.loss_mask[:cut]) for e in rows])
    grads = {}
    for name, fn, half in (("fp32", token_logprobs, False), ("whole", token_logprobs, True),
                           ("shared", shared_opening_logprobs, True)):
        model.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=half):
            lp = fn(model, ids, attn) if fn is token_logprobs else fn(model, ids, attn, shared)
        (lp * mask).sum().backward()
        grads[name] = torch.cat([p.grad.flatten().float() for p in model.parameters()])
    err = {k: float((grads[k] - grads["fp32"]).norm() / grads["fp32"].norm()) for k in ("whole", "shared")}
    figs["bf16 gradient error vs float32"] = {k: round(v, 5) for k, v in err.items()}
    exact = 0 < err["whole"] and err["shared"] <= 2 * err["whole"]
    return ("PASS" if exact and (faster or not bf16) else "FAIL"), figs


def decode_layouts(tok, device, shape: str, opening: int, context: int, group: int = 8):
    """Issue 53's decoding layouts on a Qwen3 shape (bf16 on a GPU, fp32 toy on the CPU): one group of `group`
    episodes of shop with its system prompt padded to an opening of ~`opening` tokens, its user talking on to
    `context`, sampled turns of ~40 tokens. Each row's own copy of the opening (per-row), the opening held once
    (shared), and held once with slots of two sizes (sized: group/2 slots holding the first half of an episode's own
    part beside `group` of --max-context; the rows start in the small ones and move up as they grow: what decoding
    in two sizes at once costs, not what it saves, since these episodes all run to --max-context), and per-row and
    shared through the graphed step (--decode-graphs on: CUDA graphs on a GPU, the same body eagerly on the CPU):
    bench/opening.compare's tokens/s, pools' bytes, cache read a step, and the episodes equal; and each against its
    roofline, the weights and the cache a step reads, read once at the copy bandwidth measured here. PASS: the same
    episodes token for token on the CPU (fp32), shared faster than per-row, eager and graphed, on a GPU."""
    from envs import make_env

    op = bench_rollout("opening")
    model = build(tok, shape, device, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
    plain = make_env("shop")
    task = plain.tasks("train")[0]
    per_word = len(toolcall.encode_text(tok, " note" * 100)) / 100
    first = len(openings(tok, plain, [task])[0])
    env = bench_rollout().KeepTalking(Padded(plain, max(0, round((opening - first) / per_word))))
    tasks = env.tasks("train")[:1]
    sampled_turns_end(model, tok, env, tasks, 40, tail=None)
    n = len(openings(tok, env, tasks)[0])
    base = dict(temperature=1.0, max_new_tokens=256, max_turns=400, max_context=context)
    half = (context - n) // 2 + 256 + 2
    cfg = op.RolloutConfig
    layouts = {"per-row": cfg(**base), "shared": cfg(**base, decode_share_opening=True),
               "sized": cfg(**base, decode_share_opening=True, decode_slots=f"{group // 2}x{half},{group}x{context}"),
               "per-row graphed": cfg(**base, decode_graphs="on"),
               "shared graphed": cfg(**base, decode_share_opening=True, decode_graphs="on")}
    lines = []

    def log(line):  # each layout's round as it ends, kept in the report should the command be cut off
        print(f"[gpu] {line}", flush=True)
        lines.append(line)
        PROGRESS({"rounds": lines})

    out = op.compare(model, tok, env, tasks, group, layouts, rounds=1, log=log)
    bandwidth = copy_bandwidth(device, (64 if device.type == "cpu" else 2048) << 20)
    weights = sum(q.numel() * q.element_size() for q in model.parameters())
    figs = {"opening_tokens": n, "copy_GB_per_s": round(bandwidth / 1e9, 1), "same_episodes": out["same"],
            "graphs_failed": {k: out[k]["graphs_failed"] for k in layouts if out[k]["graphs_failed"]} or None}
    for name in layouts:
        f = out[name]
        bound = (weights + f["read"]) / bandwidth  # seconds a decoding step of `group` rows, at best
        figs[name] = {"tok_s": round(f["tok_s"], 1), "pools_MiB": round(f["held"] / 2**20, 1),
                      "read_MiB_a_step": round(f["read"] / 2**20, 2), "roofline_tok_s": round(group / bound, 1),
                      "x_roofline": round(group / bound / f["tok_s"], 2)}
    from fast import decode as decode_module

    figs["fused_attention_held"] = {f"{d} {t} head {h}".replace("torch.", ""): ok
                                    for (d, t, h), ok in decode_module.FUSED_HOLDS.items()}
    figs["shared_x_per_row"] = round(out["shared"]["tok_s"] / out["per-row"]["tok_s"], 2)
    figs["graphed_shared_x_per_row"] = round(out["shared graphed"]["tok_s"] / out["per-row graphed"]["tok_s"], 2)
    # (on a GPU in bf16 the same sampled episodes are reported, not required: per-row SDPA and the two joined parts
    # round otherwise; the engine check holds the layouts' greedy episodes to the reference's in float32)
    ok = figs["shared_x_per_row"] > 1 < figs["graphed_shared_x_per_row"] if device.type == "cuda" else out["same"]
    return ("PASS" if ok else "FAIL"), figs


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu", action="store_true", help="the checks at toy size on the CPU (what the test suite runs)")
    p.add_argument("--out", default="gpu-report", help="directory for report.md and report.json")
    p.add_argument("--work", default="", help="directory for the models and runs (default: a temporary one)")
    p.add_argument("--only", default="", help=f"comma-separated checks to run (default: all of {', '.join(CHECKS)})")
    args = p.parse_args(argv)
    only = [c for c in args.only.split(",") if c] or list(CHECKS)
    if set(only) - set(CHECKS):
        p.error(f"--only: unknown check(s) {sorted(set(only) - set(CHECKS))}; the checks are {', '.join(CHECKS)}")
    from envs import make_env

    device = torch.device("cpu" if args.cpu or not torch.cuda.is_available() else "cuda")
    if not args.cpu and device.type != "cuda":
        raise SystemExit("bench/gpu.py: no CUDA device here; --cpu runs the checks at toy size on the CPU")
    out = Path(args.out)
    import tempfile

    work = Path(args.work or tempfile.mkdtemp(prefix="muarl-gpu-"))
    report = Report(out)
    env = make_env("shop")
    tok = models.load_tokenizer("tiny", env)
    tasks = env.tasks("train")[:4]
    small = "toy" if args.cpu else "qwen3-0.6b"
    model = build(tok, small, device)
    greedy_turns_end(model, tok, env, tasks)
    checks = {"versions": (versions, device),
              "engine": (engine, model, tok, env, tasks, device),
              "flash": (flash, tok, env, tasks, device, small),
              "kv_peak": (kv_peak, tok, env, tasks[:2], device, {"qwen3-8b-attn-4l": (8192, 16384, 32768),
                                                                 "qwen3-8b-kv-36l": (8192, 32768)}),
              "decode": (decode, model, tok, env, tasks, device, 4 if args.cpu else 16, 16 if args.cpu else 128),
              "roofline": (roofline, device, args.cpu),
              "decode_layouts": (decode_layouts, tok, device, small, *((300, 900) if args.cpu else (4000, 5000))),
              "head_grad": (head_grad, device, 4096 if args.cpu else 151936, 64 if args.cpu else 4096),
              "share_opening": (share_opening, tok, device, small, *((300, 700) if args.cpu else (4000, 9000))),
              "train": (train, model, tok, env, tasks, device, work, device.type == "cuda"),
              "lora": (lora_steps, model, tok, env, tasks, device, work, device.type == "cuda"),
              "fsdp2": (launched, "fsdp2", work, out, device),
              "zero3": (launched, "zero3", work, out, device),
              "fsdp2_x2": (launched, "fsdp2", work, out, device, 2)}
    assert list(checks) == list(CHECKS)
    if "train" not in only and ({"fsdp2", "zero3", "fsdp2_x2"} & set(only) and device.type == "cuda"
                                or "lora" in only):
        save_start(model, tok, env, tasks, work)  # the runs start from the checkpoint train saves
    for name in only:
        report.run(name, *checks[name])
    failed = [r["check"] for r in report.rows if r["status"] == "FAIL"]
    print(f"[gpu] report: {out / 'report.md'}; " + (f"FAILED: {', '.join(failed)}" if failed else "no check failed"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
