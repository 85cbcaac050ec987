"""The group's opening held once while decoding (--decode-share-opening) against each row's own copy of it (the
twin), at a tau2-like shape: an opening of ~4,000 tokens (shop's system prompt padded), groups of 8, long episodes,
the tiny model.

    ./run python bench/opening.py                                         # 2 groups of 8, 2 rounds (~15 min here)
    ./run python bench/opening.py --groups 1 --turns 8 --rounds 1 --opening 600 --context 2000    # a quick look

The model is `models.load_model("tiny")` (random weights; its end-of-turn logit raised until turns average ~--turn
tokens, as bench/rollout.py does), its user keeps talking, so every episode runs to --turns or to --context. Both
layouts play the same sampled episodes (same seeds: the draw is a function of each episode's seed and position), in
one process, after a warm-up, interleaved round by round. Per layout: tokens/s; the cache the rollout's pools hold
(bytes: the rows' slots, and the openings' pool); the bytes of cache a decoding step reads, on average (each row's
whole context in the twin; each group's opening once and each row's own part when shared), counted at every
decoding forward from the rows' masks and the openings it reads.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

import muarl  # noqa: E402
import toolcall  # noqa: E402
from fast import decode  # noqa: E402
from fast.batched_rollout import RolloutConfig, rollout  # noqa: E402
from plumbing import models  # noqa: E402
from plumbing.users import make_user_sim  # noqa: E402


def _bench_rollout():
    """bench/rollout.py (whose name the root's rollout.py takes on the import path)."""
    import importlib.util

    path = os.path.join(os.path.dirname(__file__), "rollout.py")
    spec = importlib.util.spec_from_file_location("bench_rollout", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", type=int, default=2, help="tasks (each a group)")
    ap.add_argument("--group", type=int, default=8, help="episodes a task")
    ap.add_argument("--opening", type=int, default=4000, help="tokens of each opening, about")
    ap.add_argument("--turns", type=int, default=100, help="agent turns an episode, at most")
    ap.add_argument("--turn", type=float, default=40, help="mean agent turn length to aim for (tokens)")
    ap.add_argument("--context", type=int, default=15000, help="max_context")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave torch's default)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from envs.shop import ShopEnv

    from gpu import Padded  # (bench/gpu.py's: shop with its system prompt padded by so many words)

    KeepTalking, end_turns_sooner = (getattr(_bench_rollout(), n) for n in ("KeepTalking", "end_turns_sooner"))
    model, tok = models.load_model("tiny", seed=0, env=ShopEnv())
    plain = ShopEnv()
    task = plain.tasks("train")[0]
    per_word = len(toolcall.encode_text(tok, " note" * 100)) / 100
    opening = lambda env: muarl.prompt_ids(tok, [  # noqa: E731
        {"role": "system", "content": env.system_prompt(task)},
        {"role": "user", "content": env.scripted_user(task).opening()}], env.tools(task))
    env = KeepTalking(Padded(plain, max(0, round((args.opening - len(opening(plain))) / per_word))))
    tasks = env.tasks("train")[:args.groups]
    end_turns_sooner(model, tok, [opening(env)] * 4, args.turn)
    base = dict(temperature=1.0, max_new_tokens=512, max_turns=args.turns, max_context=args.context)
    layouts = {"per-row": RolloutConfig(**base), "shared": RolloutConfig(**base, decode_share_opening=True)}
    print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params, torch threads {torch.get_num_threads()}; "
          f"{args.groups} groups x {args.group}, openings of {len(opening(env))} tokens, up to {args.turns} turns, "
          f"max_context {args.context}", flush=True)
    out = compare(model, tok, env, tasks, args.group, layouts, args.rounds)
    print(f"mean over {args.rounds} rounds: shared {out['shared']['tok_s']:.1f} tok/s, per-row "
          f"{out['per-row']['tok_s']:.1f} tok/s -> {out['shared']['tok_s'] / out['per-row']['tok_s']:.2f}x "
          "(target >= 1.5x)")


def compare(model, tok, env, tasks, group: int, layouts: dict, rounds: int, log=print) -> dict:
    """The layouts (name -> RolloutConfig) playing the same sampled episodes of `tasks` x `group`, after a warm-up of
    two turns each, interleaved round by round. Per layout: mean tokens/s, the bytes its pools hold (the rows'
    slots, of every size, and the openings' pool), the bytes of cache a decoding step reads (each row's columns, and
    each group's opening once when shared; through the graphed step, its bucket's padding rows too, which read its
    columns), the decoding steps a round; and whether every layout played the first's episodes token for token."""
    from fast import pool as pools

    cfg = model.config
    per_token = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * next(model.parameters()).itemsize
    # steps, the columns the rows read, each group's opening once: counted on the device, never read back while a
    # rollout runs (a host read would sync every step, and inside a CUDA graph's capture it is refused): a graphed
    # step's counting is captured with it and replayed with it (a bucket's first step, run eagerly before its
    # capture and replayed after, is counted twice)
    counts = torch.zeros(3, dtype=torch.long, device=model.device)

    def count(module, a, kw):  # a decoding step: the columns each row reads, and each group's opening once
        if kw["input_ids"].shape[1] == 1:
            counts[0] += 1
            counts[1] += kw["attention_mask"].sum()
            if decode._OPENINGS and decode._OPENINGS[-1] is not None:
                counts[2] += decode._OPENINGS[-1][2].lengths.sum()

    hook = model.get_decoder().register_forward_pre_hook(count, with_kwargs=True)
    held, real_init = [], pools.SlotPool.__init__

    def pool_init(self, *a, **k):  # every pool a rollout makes: the rows' slots (each size) and the openings'
        real_init(self, *a, **k)
        held.append(self)

    def play(c, seed, turns=None):
        counts.zero_()
        held.clear()
        c = RolloutConfig(**{**c.__dict__, **({"max_turns": turns} if turns else {})})
        for p in pools._KEPT.values():  # each layout's own pools, made in its play (the graphed step captures in
            p.graphs = p.opens = None  # every play); the kept ones let go at once (a pool and its step point at
        pools._KEPT.clear()  # each other)
        pools.SlotPool.__init__ = pool_init
        try:
            if model.device.type == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            eps = rollout(model, tok, env, tasks, group, make_user_sim("scripted"), c, seed=seed)
            if model.device.type == "cuda":
                torch.cuda.synchronize()
            dt = time.perf_counter() - t
        finally:
            pools.SlotPool.__init__ = real_init
        nbytes = sum(b.numel() * b.element_size() for p in held for b in p.k + p.v)
        steps, rows, groups = counts.tolist()
        failed = next((p.graphs.failed for p in held if getattr(p, "graphs", None) and p.graphs.failed), None)
        capture_s = sum(p.graphs.capture_s for p in held if getattr(p, "graphs", None))  # each play captures anew:
        return eps, dt - capture_s, nbytes, (rows + groups) * per_token / max(1, steps), steps, failed, capture_s
        # its seconds set apart (one bucket ~0.2-0.4 s on a GPU; the layouts capture different numbers of buckets)

    try:
        for c in layouts.values():  # warm-up
            play(c, 0, turns=2)
        figures = {k: {"tok_s": [], "held": 0, "read": 0, "steps": 0, "graphs_failed": None} for k in layouts}
        same = True
        for r in range(rounds):
            out = {}
            for name in (layouts if r % 2 == 0 else reversed(list(layouts))):
                eps, dt, nbytes, read, steps, failed, capture_s = out[name] = play(layouts[name], 1 + r)
                toks, lens = sum(e.gen_tokens for e in eps), sorted(len(e.input_ids) for e in eps)
                f = figures[name]
                f["tok_s"].append(toks / dt)
                f.update(held=nbytes, read=read, steps=steps, graphs_failed=failed)
                f["capture_s"] = round(capture_s, 2)
                apart = f" (+{capture_s:.1f} s capturing, set apart)" if capture_s else ""
                log(f"round {r} {name:8s} {dt:7.1f} s{apart} {toks:7d} tokens {toks / dt:8.1f} tok/s; episodes of "
                    f"{lens[0]}/{lens[len(lens) // 2]}/{lens[-1]} tokens (min/median/max); pools hold "
                    f"{nbytes / 2**20:.1f} MiB; a decoding step reads {read / 2**20:.2f} MiB of cache")
            first = next(iter(layouts))
            same = same and all(a.input_ids == b.input_ids for k in layouts for a, b in zip(out[first][0], out[k][0]))
            log(f"round {r}: " + "; ".join(
                f"{k} / {first} {figures[k]['tok_s'][-1] / figures[first]['tok_s'][-1]:.2f}x tokens/s, cache held "
                f"{out[k][2] / out[first][2]:.2f}x, read a step {out[k][3] / out[first][3]:.2f}x"
                for k in list(layouts)[1:]) + f"; the same episodes token for token: {same}")
    finally:
        hook.remove()
    for f in figures.values():
        f["tok_s"] = sum(f["tok_s"]) / len(f["tok_s"])
    return {**figures, "same": same}


if __name__ == "__main__":
    main()
