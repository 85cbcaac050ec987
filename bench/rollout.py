"""Rollout throughput: cross-turn KV-cache reuse vs re-encoding every turn vs one episode at a time.

    ./run python bench/rollout.py                      # 8 tasks x 4 samples, 12 turns, tiny model, CPU
    ./run python bench/rollout.py --tasks 16 --rounds 3

One workload, three ways, in one process, after a warm-up, interleaved round by round (this CPU pages idle
memory out and is shared, so absolute speeds drift; ratios within a round are what to read):
  cache     RolloutConfig(reuse_cache=True)                  all episodes in one batch, only deltas prefilled
  reencode  RolloutConfig(reuse_cache=False)                 all episodes in one batch, whole context each turn
  single    RolloutConfig(reuse_cache=True, max_batch=1)     one episode at a time (same cache reuse)
  sync      RolloutConfig(refill_below=0)                    (not by default) as cache, with synchronous turns
  old       RolloutConfig(decode_attention="model")          (not by default) as cache, the decoding steps through
            the model's own attention (sdpa with a padding mask) instead of decode.grouped_decode_attention
  compiled  RolloutConfig(compile_decode="on")               (not by default) as cache, the decoder's step through
            torch.compile (off by default; its compile time is spent in the warm-up)
  graphs    RolloutConfig(decode_graphs="on")                (not by default) as cache, the step over fixed buffers
            by bucket (fast/graphs.py): on the CPU the body a GPU captures, run eagerly
  lora      as cache, on the model with LoRA adapters of rank 16 on every projection, unmerged (grpo.py
            --lora-decode unmerged), not by default; B = 0, so it plays the very same tokens: the ratio is the cost
            of the adapters' extra matmuls
  lora-merged  the same adapters folded into the base for the rollout (grpo.py's default, --lora-decode merged;
            lora.merged_for_decoding), the fold and the base's restore inside the timing

The model is `models.load_model("tiny")` (random weights) on the shop domain with its scripted user, which keeps
talking to an agent that makes no sense, so every episode runs to max_turns. A random model almost never samples
its end-of-turn token, so its output-embedding row is pushed up (`end_turns_sooner`) until turns average ~`--turn`
tokens. Sampling is seeded per variant; the variants' samples differ, so throughput is reported per generated
token (tokens/s), with the tokens and context lengths of each run.

With --deadline it measures what the tool deadline costs (fast/deadlines.py): the same workload as the latency bench
below, with an instant user, each round once with grpo.py's --tool-timeout 30 and once with 0, which goes first
alternating; the median of --rounds (at least 3) each way, and how many tool calls went through the deadline.

With --user-latency S [--user-jitter J] it measures instead how much of a slow user's latency the engine hides.
Workload: the default run's cold start (`--agent`, default: grpo.py's own cold start, made and cached if missing)
on 8 shop tasks x 4 samples, up to 14 turns (`--tasks`, `--group`, `--turns` change it), sampling at grpo.py's
temperature 0.7, 128 new tokens a turn; its scripted user waits S +- J seconds (uniform, seeded per episode and
reply) before each reply. Interleaved round by round in one process: the wall time with an instant user, the wall
time at S, the wall time at S with the user asked between decoding batches while decoding waits (`local`: how the
engine worked before it overlapped replies with decoding), and the critical-path bound: for each episode, its sampled tokens x the instant run's time per decoding
step plus its own waits; the bound is the largest of those and the instant run's wall time. Nothing can finish
sooner than its longest episode's chain of decoding steps and replies, so wall / bound is the latency not hidden.

Rows that end their turn rejoin the batch mid-way through the others' turns (continuous batching, see rollout.py),
so the batch stays at least half full. Each run reports its mean decode batch (rows per decoding step) and the mean
cache length a step attends over; the last line prices a decode step at that batch and context against batch 1,
which bounds what batching alone can give over "single" on this device.
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

from plumbing import models  # noqa: E402
import muarl  # noqa: E402
from fast.batched_rollout import RolloutConfig, rollout  # noqa: E402
from plumbing.users import make_user_sim  # noqa: E402
from plumbing.lora import merged_for_decoding  # noqa: E402


def end_turns_sooner(model, tokenizer, contexts: list[list[int]], mean_turn: float) -> None:
    """Raise the end-of-turn logit of a random model (in place) so that, sampling at temperature 1 after
    `contexts` (real prompts) and random tokens, its probability is about 1/mean_turn: the row of the output
    embedding moves along the mean hidden state."""
    eot = muarl.end_of_turn_id(tokenizer)
    g = torch.Generator().manual_seed(0)
    ids = torch.tensor([c + torch.randint(0, len(tokenizer), (64,), generator=g).tolist() for c in contexts])
    with torch.no_grad():
        h = model.get_decoder()(input_ids=ids.to(model.device)).last_hidden_state[:, -64:].flatten(0, 1).float()
        w = model.get_output_embeddings().weight
        u = h.mean(0)
        logits, proj = h @ w.float().T, h @ u / (u @ u)
        lo, hi = 0.0, 50.0
        for _ in range(40):
            c = (lo + hi) / 2
            shifted = logits.clone()
            shifted[:, eot] += c * proj
            lo, hi = (c, hi) if torch.softmax(shifted, -1)[:, eot].mean() < 1 / mean_turn else (lo, c)
        w[eot] += (c * u / (u @ u)).to(w.dtype)


class KeepTalking:
    """The shop domain with a user that never ends the dialogue: random text often contains "transfer" or
    "goodbye", on which the shop user would stop; here it asks again, so every episode runs to max_turns."""

    def __init__(self, env):
        self.env = env

    def __getattr__(self, name):
        return getattr(self.env, name)

    def scripted_user(self, task):
        user = self.env.scripted_user(task)

        class User:
            opening = user.opening

            def reply(self, messages):
                text = user.reply(messages)
                return "Sorry, I still need help with my order." if "###" in text else text

        return User()


@torch.no_grad()
def step_cost(model, batch: int, context: int, steps: int = 30, cfg: RolloutConfig | None = None,
              seen: dict | None = None) -> float:
    """Seconds per decoding step (decode.decode_step: the decoder's forward for one token a row, and the draw) of
    `batch` rows over `context` cached tokens: how much batching can buy on this device at all (on a small CPU a
    step's cost grows with the batch; on a GPU it stays nearly flat). `cfg`: its decode_attention, compile_decode,
    decode_graphs (the step over fixed buffers, graphs.py: captured on a GPU, its capture in the warm-up steps).
    `seen`, if given, gets the first step's seconds (`first_s`: its capture, where graphed) and the graphs' replays."""
    from fast.decode import decode_attention, decode_step
    from fast.engine import _cache, _mask, _View
    from fast.graphs import graphs_on, step_graphs
    from fast.pool import SlotPool

    cfg = cfg or RolloutConfig(compile_decode="off")
    dev = model.device
    pool = SlotPool(model, batch, context + steps + 8)
    for buf in pool.k + pool.v:
        buf.normal_()
    lens = torch.full((batch,), context, device=dev)
    tok = torch.zeros(batch, 1, dtype=torch.long, device=dev)
    seeds = torch.arange(batch, device=dev)
    view = _View(pool, 0)
    cache = _cache([view])
    graphs = step_graphs(model, pool, cfg) if graphs_on(cfg, dev, batch) else None
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    t = time.perf_counter()
    with decode_attention(model, cfg.decode_attention):
        for i in range(steps + 3):
            if i == 1 and seen is not None:
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                seen["first_s"] = time.perf_counter() - t
            if i == 3:
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                t = time.perf_counter()
            if graphs is not None:
                tok = graphs.step(tok, lens, seeds, context + i + 1)[0][:, None]
            else:
                view.set(lens, 1, context + i + 1)
                tok = decode_step(model, cache, tok, _mask(lens, 1, view.seen, pool, cfg), lens[:, None],
                                  seeds, cfg)[0][:, None]
            lens = lens + 1
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    if seen is not None:
        seen["replays"], seen["buckets"] = (graphs.replays, len(graphs.buckets)) if graphs is not None else (0, 0)
    return (time.perf_counter() - t) / steps


class SlowUser:
    """A user simulator that waits `latency` +- `jitter` seconds (asyncio.sleep: it holds no thread) before each of
    its wrapped simulator's replies, and records every wait by episode (start order)."""

    def __init__(self, sim, latency: float, jitter: float, seed: int = 0, local: bool = False):
        self.sim, self.latency, self.jitter, self.seed = sim, latency, jitter, seed
        self.local = local  # True: the rollout asks between decoding batches and waits (no overlap), for comparison
        self.waits: list[list[float]] = []

    async def opening(self, env, task):
        return await self.sim.opening(env, task)

    def start(self, env, task, session, opening):
        self.waits.append([])
        return len(self.waits) - 1, self.sim.start(env, task, session, opening)

    async def replies(self, states, conversations):
        import asyncio
        import random

        async def one(state, messages):
            k, inner = state
            rng = random.Random(f"{self.seed}/{k}/{len(self.waits[k])}")
            wait = max(0.0, self.latency + rng.uniform(-self.jitter, self.jitter))
            self.waits[k].append(wait)
            await asyncio.sleep(wait)
            return (await self.sim.replies([inner], [messages]))[0]

        return list(await asyncio.gather(*(one(s, m) for s, m in zip(states, conversations))))


def latency_bench(args):
    """--user-latency: the wall time with an instant and a slow user against the critical-path bound."""
    from envs import make_env

    agent = args.agent or default_agent()
    env = make_env("shop")
    model, tok = models.load_model(agent, env=env)
    tasks = env.tasks("train")[:args.tasks]
    cfg = RolloutConfig(temperature=0.7, max_new_tokens=128, max_turns=args.turns)
    steps = [0]
    model.get_decoder().register_forward_pre_hook(
        lambda m, a, kw: steps.__setitem__(0, steps[0] + (kw["input_ids"].shape[1] == 1)), with_kwargs=True)
    print(f"agent {agent}; {len(tasks)} shop tasks x {args.group}, max_turns {args.turns}, temperature 0.7; "
          f"user latency {args.user_latency:g} s +- {args.user_jitter:g} s; torch threads {torch.get_num_threads()}")

    def play(latency, seed, local=False):
        user = SlowUser(make_user_sim("scripted"), latency, args.user_jitter if latency else 0.0, seed, local)
        steps[0] = 0
        t = time.perf_counter()
        eps = rollout(model, tok, env, tasks, args.group, user, cfg, seed=seed)
        return eps, time.perf_counter() - t, steps[0], user.waits

    play(0.0, 0)  # warm-up
    ratios = []
    for r in range(args.rounds):
        eps0, wall0, steps0, _ = play(0.0, 1 + r)
        eps, wall, _, waits = play(args.user_latency, 1 + r)
        _, wall_blocking, _, _ = play(args.user_latency, 1 + r, local=True)
        per_step = wall0 / max(1, steps0)
        chains = [e.gen_tokens * per_step + sum(w) for e, w in zip(eps, waits)]
        bound = max(wall0, max(chains))
        ratios.append(wall / bound)
        replies = sum(len(w) for w in waits)
        same = sum(a.input_ids == b.input_ids for a, b in zip(eps0, eps))
        print(f"round {r}: instant user {wall0:.1f} s ({steps0} decoding steps, {per_step * 1e3:.1f} ms each); "
              f"user at {args.user_latency:g} s {wall:.1f} s ({replies} replies, longest episode's waits "
              f"{max(sum(w) for w in waits):.1f} s); bound {bound:.1f} s -> wall / bound {wall / bound:.2f}x "
              f"(target <= 1.3x); {same}/{len(eps)} episodes token-identical to the instant run's; the same user "
              f"asked between decoding batches, decoding waiting on it (UserSim.local, the engine's way before it "
              f"overlapped): {wall_blocking:.1f} s, {wall_blocking / bound:.2f}x the bound", flush=True)
    print(f"mean wall / bound over {args.rounds} rounds: {sum(ratios) / len(ratios):.2f}x")
    opens = [e.loss_mask.index(1) - 1 for e in eps0[::args.group] if 1 in e.loss_mask]  # prefilled opening tokens
    print(f"group openings prefilled once: {sum(opens)} tokens for {len(opens)} tasks, instead of "
          f"{sum(opens) * args.group} for their {len(opens) * args.group} episodes")


def deadline_bench(args):
    """--deadline: the rollout with every tool call under the deadline (--tool-timeout 30, grpo.py's default) against
    none (0), interleaved round by round, on the latency bench's workload with an instant user."""
    import statistics

    from envs import make_env
    from fast import deadlines

    agent = args.agent or default_agent()
    env = make_env("shop")
    deadlines.prepare(env)  # as grpo.py and eval.py do: the keeper forked before the model loads
    model, tok = models.load_model(agent, env=env)
    tasks = env.tasks("train")[:args.tasks]
    cfg = dict(temperature=0.7, max_new_tokens=128, max_turns=args.turns)
    calls = [0]
    real = deadlines.DeadlineSession.call_tool

    def counted(self, *a, **kw):  # the calls that went through the deadline (none may be exempted)
        calls[0] += 1
        return real(self, *a, **kw)
    deadlines.DeadlineSession.call_tool = counted
    print(f"agent {agent}; {len(tasks)} shop tasks x {args.group}, max_turns {args.turns}, temperature 0.7, "
          f"scripted user; torch threads {torch.get_num_threads()}")

    def play(timeout, seed):
        calls[0] = 0
        t = time.perf_counter()
        eps = rollout(model, tok, env, tasks, args.group, make_user_sim("scripted"),
                      RolloutConfig(**cfg, tool_timeout=timeout), seed=seed)
        return time.perf_counter() - t, sum(sum(e.tool_calls.values()) for e in eps), calls[0]

    play(30.0, 0)  # warm-up, both ways
    play(0.0, 0)
    walls = {30.0: [], 0.0: []}
    for r in range(args.rounds):
        for timeout in ((30.0, 0.0) if r % 2 == 0 else (0.0, 30.0)):  # which goes first alternates
            wall, n, guarded = play(timeout, 1 + r)
            walls[timeout].append(wall)
            print(f"round {r} --tool-timeout {timeout:g}: {wall:.2f} s, {n} tool calls, {guarded} of them through "
                  "the deadline", flush=True)
    on, off = statistics.median(walls[30.0]), statistics.median(walls[0.0])
    print(f"median over {args.rounds} rounds: {on:.2f} s with the deadline, {off:.2f} s without -> {on / off:.3f}x "
          "(target <= 1.05x)")


def default_agent() -> str:
    import grpo
    import sft

    cfg = grpo.Config()  # grpo.py's own cold start
    return sft.cold_start("tiny", "shop", "train", cfg.seed, False, cfg.cold_start_skips_confirm,
                          cfg.cold_start_skips_ask, cfg.cold_start_skips_status)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", type=int, default=8)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--turns", type=int, default=None,
                    help="max_turns (default 12; 14 for the latency bench); the throughput bench's user never stops")
    ap.add_argument("--turn", type=float, default=40, help="mean agent turn length to aim for (tokens)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave torch's default)")
    ap.add_argument("--variants", default="cache,reencode,single")
    ap.add_argument("--user-latency", type=float, default=None, help="seconds a user reply takes (the latency bench)")
    ap.add_argument("--user-jitter", type=float, default=0.5, help="+- seconds around --user-latency (uniform)")
    ap.add_argument("--agent", default="", help="the latency and deadline benches' agent (default: grpo.py's cold "
                    "start)")
    ap.add_argument("--deadline", action="store_true", help="the rollout with the tool deadline against without")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    args.turns = args.turns or (14 if args.user_latency is not None or args.deadline else 12)
    if args.deadline:
        return deadline_bench(args)
    if args.user_latency is not None:
        if args.user_latency < 0 or args.user_jitter < 0:
            ap.error("--user-latency and --user-jitter must be >= 0")
        return latency_bench(args)
    from envs.shop import ShopEnv

    model, tok = models.load_model("tiny", seed=0, env=ShopEnv())
    env = KeepTalking(ShopEnv())
    tasks = env.tasks("train")[:args.tasks]
    prompts = [muarl.prompt_ids(tok, [{"role": "system", "content": env.system_prompt(t)},
                                      {"role": "user", "content": env.scripted_user(t).opening()}], env.tools(t))
               for t in tasks[:1]] * 4
    end_turns_sooner(model, tok, prompts, args.turn)
    base = dict(max_new_tokens=512, max_turns=args.turns)
    variants = {"cache": RolloutConfig(**base), "reencode": RolloutConfig(**base, reuse_cache=False),
                "single": RolloutConfig(**base, max_batch=1), "sync": RolloutConfig(**base, refill_below=0),
                "old": RolloutConfig(**base, decode_attention="model", compile_decode="off"),
                "compiled": RolloutConfig(**base, compile_decode="on"),
                "graphs": RolloutConfig(**base, decode_graphs="on")}
    adapted = [k for k in ("lora", "lora-merged") if k in args.variants.split(",")]
    variants = {k: variants[k] for k in args.variants.split(",") if k not in adapted}
    nets = {k: model for k in variants}
    if adapted:
        import copy

        from plumbing import lora

        peft_model = lora.add_adapters(copy.deepcopy(model), rank=16, alpha=0, dropout=0.0,
                                       targets=lora.DEFAULT_TARGETS, base="tiny").eval()
        for k in adapted:
            variants[k], nets[k] = RolloutConfig(**base), peft_model
    print(f"device {model.device}, {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params, "
          f"torch threads {torch.get_num_threads()}, {len(tasks)} tasks x {args.group} samples, max_turns {args.turns}")

    decode = dict(steps=0, rows=0, context=0)

    def count_steps(module, args, kwargs):  # a forward of one new token per row is a decoding step
        if kwargs["input_ids"].shape[1] == 1:
            decode["steps"] += 1
            decode["rows"] += kwargs["input_ids"].shape[0]
            decode["context"] += int(kwargs["attention_mask"].sum())

    for m in {id(m): m for m in nets.values()}.values():
        m.get_decoder().register_forward_pre_hook(count_steps, with_kwargs=True)

    def run(name, cfg, seed):
        gen = torch.Generator(device=model.device).manual_seed(seed)
        decode.update(steps=0, rows=0, context=0)
        t = time.perf_counter()
        with merged_for_decoding(nets[name], enabled=name == "lora-merged") as net:
            eps = rollout(net, tok, env, tasks, args.group, make_user_sim("scripted"), cfg, generator=gen)
        dt = time.perf_counter() - t
        toks = sum(e.gen_tokens for e in eps)
        ctx = sorted(len(e.input_ids) for e in eps)
        turns = sorted(e.turns for e in eps)
        return dict(name=name, s=dt, tokens=toks, tps=toks / dt, episodes=len(eps), turns=(turns[0], turns[-1]),
                    ctx=(ctx[0], ctx[len(ctx) // 2], ctx[-1]), terms=sorted({e.termination for e in eps}),
                    batch=decode["rows"] / max(decode["steps"], 1), attended=decode["context"] / max(decode["rows"], 1))

    for ctx in (1, 1300):
        costs = {b: step_cost(model, b, ctx) for b in (1, 8, args.tasks * args.group)}
        print(f"decode step at context {ctx}: " + ", ".join(
            f"batch {b} {t * 1e3:.1f} ms ({t / b * 1e3:.2f} ms/token)" for b, t in costs.items())
              + f" -> {max(costs)} rows decoding together give at most {costs[1] * max(costs) / costs[max(costs)]:.1f}x")
    steps = {"old": RolloutConfig(decode_attention="model", compile_decode="off"),  # the engine before the grouped
             "grouped": RolloutConfig(compile_decode="off"), "compiled": RolloutConfig(compile_decode="on")}
    step_cost(model, 2, 64, steps=2, cfg=steps["compiled"])  # compiles (printing how long) before any timing
    for ctx in (256, 1300):  # the decoding step three ways, interleaved, twice each
        for b in (1, 16):
            ms = {k: [] for k in steps}
            for _ in "ab":
                for k, cfg in steps.items():
                    ms[k].append(step_cost(model, b, ctx, cfg=cfg) * 1e3)
            ms = {k: sum(v) / len(v) for k, v in ms.items()}
            print(f"decode step, batch {b}, context {ctx}: " + ", ".join(f"{k} {v:.2f} ms" for k, v in ms.items())
                  + f" -> compiled {ms['old'] / ms['compiled']:.2f}x the old step", flush=True)
    # warm-up: a small run of each variant (allocator, kernels, paged-out memory)
    for name, cfg in variants.items():
        gen = torch.Generator(device=model.device).manual_seed(0)
        rollout(nets[name], tok, env, tasks[:2], 2, make_user_sim("scripted"),
                RolloutConfig(**{**cfg.__dict__, "max_turns": 2}), generator=gen)
    results = {k: [] for k in variants}
    for r in range(args.rounds):
        for name, cfg in variants.items():
            res = run(name, cfg, seed=1 + r)
            results[name].append(res)
            print(f"round {r} {name:9s} {res['s']:7.1f} s  {res['tokens']:6d} tokens  {res['tps']:7.1f} tok/s  "
                  f"episodes {res['episodes']} turns {res['turns']} context min/median/max {res['ctx']} "
                  f"ends {res['terms']}; mean decode batch {res['batch']:.1f}, attended context {res['attended']:.0f}",
                  flush=True)
        if "cache" in variants:
            c = results["cache"][-1]["tps"]
            print(f"round {r} ratios: " + ", ".join(f"cache/{k} {c / results[k][-1]['tps']:.2f}x"
                                                    for k in variants if k != "cache"), flush=True)
    if "cache" in variants:
        tot = {k: sum(x["tokens"] for x in v) / sum(x["s"] for x in v) for k, v in results.items()}
        print("overall tok/s: " + ", ".join(f"{k} {v:.1f}" for k, v in tot.items()))
        print("overall ratios: " + ", ".join(f"cache/{k} {tot['cache'] / v:.2f}x" for k, v in tot.items() if k != "cache")
              + "   (targets: reencode >= 3x, single >= 5x)")
        batch = sum(x["batch"] for x in results["cache"]) / args.rounds
        context = round(sum(x["attended"] for x in results["cache"]) / args.rounds)
        b = max(1, round(batch))
        one, many = step_cost(model, 1, context), step_cost(model, b, context)
        print(f"cache decoded {batch:.1f} rows per step on average (of {args.tasks * args.group}) "
              f"over {context} cached tokens: a step costs {one * 1e3:.1f} ms at batch 1, {many * 1e3:.1f} ms at batch "
              f"{b} -> batching at that occupancy gives at most {one * b / many:.1f}x over single")


if __name__ == "__main__":
    main()
