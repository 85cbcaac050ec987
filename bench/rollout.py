"""Rollout throughput: cross-turn KV-cache reuse vs re-encoding every turn vs one episode at a time.

    ./run python bench/rollout.py                      # 8 tasks x 4 samples, 12 turns, tiny model, CPU
    ./run python bench/rollout.py --tasks 16 --rounds 3

One workload, three ways, in one process, after a warm-up, interleaved round by round (this CPU pages idle
memory out and is shared, so absolute speeds drift; ratios within a round are what to read):
  cache     RolloutConfig(reuse_cache=True)                  all episodes in one batch, only deltas prefilled
  reencode  RolloutConfig(reuse_cache=False)                 all episodes in one batch, whole context each turn
  single    RolloutConfig(reuse_cache=True, max_batch=1)     one episode at a time (same cache reuse)
  sync      RolloutConfig(refill_below=0)                    (not by default) as cache, with synchronous turns

The model is `muarl.load_model("tiny")` (random weights) on the shop domain with its scripted user, which keeps
talking to an agent that makes no sense, so every episode runs to max_turns. A random model almost never samples
its end-of-turn token, so its output-embedding row is pushed up (`end_turns_sooner`) until turns average ~`--turn`
tokens. Sampling is seeded per variant; the variants' samples differ, so throughput is reported per generated
token (tokens/s), with the tokens and context lengths of each run.

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

import muarl  # noqa: E402
from rollout import RolloutConfig, make_user_sim, rollout  # noqa: E402


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
def step_cost(model, batch: int, context: int, steps: int = 30) -> float:
    """Seconds per decoding step of `batch` rows over `context` cached tokens: how much batching can buy on this
    device at all (on a small CPU a step's cost grows with the batch; on a GPU it stays nearly flat)."""
    from transformers.cache_utils import Cache

    from rollout import _BufferLayer

    c = model.config
    kv = lambda: torch.randn(batch, c.num_key_value_heads, context + steps + 8, c.head_dim, device=model.device)
    cache = Cache(layers=[_BufferLayer(kv(), kv(), context) for _ in range(c.num_hidden_layers)])
    mask = torch.ones(batch, context, dtype=torch.long, device=model.device)
    tok = torch.zeros(batch, 1, dtype=torch.long, device=model.device)
    for i in range(steps + 3):
        if i == 3:
            t = time.perf_counter()
        mask = torch.cat([mask, mask.new_ones(batch, 1)], 1)
        h = model.get_decoder()(input_ids=tok, attention_mask=mask, position_ids=torch.full_like(tok, context + i),
                                past_key_values=cache).last_hidden_state
        torch.multinomial(torch.softmax(model.get_output_embeddings()(h[:, -1]).float(), -1), 1)
    return (time.perf_counter() - t) / steps


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", type=int, default=8)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--turns", type=int, default=12, help="max_turns; the scripted user never stops first")
    ap.add_argument("--turn", type=float, default=40, help="mean agent turn length to aim for (tokens)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave torch's default)")
    ap.add_argument("--variants", default="cache,reencode,single")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from envs.shop import ShopEnv

    model, tok = muarl.load_model("tiny", seed=0)
    env = KeepTalking(ShopEnv())
    tasks = env.tasks("train")[:args.tasks]
    prompts = [muarl.prompt_ids(tok, [{"role": "system", "content": env.system_prompt(t)},
                                      {"role": "user", "content": env.scripted_user(t).opening()}], env.tools(t))
               for t in tasks[:1]] * 4
    end_turns_sooner(model, tok, prompts, args.turn)
    base = dict(max_new_tokens=512, max_turns=args.turns)
    variants = {"cache": RolloutConfig(**base), "reencode": RolloutConfig(**base, reuse_cache=False),
                "single": RolloutConfig(**base, max_batch=1), "sync": RolloutConfig(**base, refill_below=0)}
    variants = {k: variants[k] for k in args.variants.split(",")}
    print(f"device {model.device}, {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params, "
          f"torch threads {torch.get_num_threads()}, {len(tasks)} tasks x {args.group} samples, max_turns {args.turns}")

    decode = dict(steps=0, rows=0, context=0)

    def count_steps(module, args, kwargs):  # a forward of one new token per row is a decoding step
        if kwargs["input_ids"].shape[1] == 1:
            decode["steps"] += 1
            decode["rows"] += kwargs["input_ids"].shape[0]
            decode["context"] += int(kwargs["attention_mask"].sum())

    model.get_decoder().register_forward_pre_hook(count_steps, with_kwargs=True)

    def run(name, cfg, seed):
        gen = torch.Generator(device=model.device).manual_seed(seed)
        decode.update(steps=0, rows=0, context=0)
        t = time.perf_counter()
        eps = rollout(model, tok, env, tasks, args.group, make_user_sim("scripted"), cfg, generator=gen)
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
    # warm-up: a small run of each variant (allocator, kernels, paged-out memory)
    for name, cfg in variants.items():
        gen = torch.Generator(device=model.device).manual_seed(0)
        rollout(model, tok, env, tasks[:2], 2, make_user_sim("scripted"),
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
