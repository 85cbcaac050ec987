"""How many Qwen3-8B episodes decode at once on one 80 GB GPU at tau2 retail's lengths, with every slot --max-context
long (the one-size pool) and with slots sized by need (--decode-slots, pool.Tiers), with and without the group's
opening held once (--decode-share-opening): counted by the pool's own code, not by a formula.

The lengths (bench/tau2-lengths.json) are tau2 retail's tasks' gold conversations (envs.tau2_gold: system prompt
with the policy, the tools' schemas, the opening, each gold tool call and its result, the closing message) in
Qwen's BPE (151,643 tokens; the chat template's markers one token each), written once by `--measure`. A gold
conversation has no small talk and no agent's prose, so a real episode is longer: the run below adds a margin
(`--grow`: the part after the opening x a uniform draw in [1, 2]) and a turn's --max-new-tokens before it fits a
row.

The run: pools of SlotPool/Tiers at Qwen3-8B's shapes on the meta device (shapes, no memory), sized to the room that
plumbing/memory.py's estimate leaves on 80 GiB beside the weights and one prefill (with its measured margin); one
rollout's episodes (16 tasks drawn from the lengths, 8 episodes each), each at its longest (every one at its last
turn) and again each at a point of its life drawn uniformly, offered in that order to the pool's `admit`, whose
`arrange` then puts them in slots: the episodes decoding at once are those it took. The sizes: slots holding the
median and the 95th percentile of what an episode needs at its longest (their numbers in the episodes' proportions)
and two of --max-context, filling the same room as the one-size pool's --max-context slots.

    ./run python bench/slots.py                  # the table (bench/README.md, "Slots sized by need")
    PYTHONPATH=/tmp/tk ./run python bench/slots.py --measure --tiktoken qwen.tiktoken   # the lengths, once
    (tiktoken: pip install --target /tmp/tk tiktoken; qwen.tiktoken: the file in the dashscope wheel's
    dashscope/resources/; or --tokenizer Qwen/Qwen3-8B where a model hub is reachable)
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from plumbing import memory  # noqa: E402

LENGTHS = Path(__file__).with_name("tau2-lengths.json")
QWEN3_8B = dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False)


def measure(args) -> None:
    """Each tau2 retail task's opening and gold conversation in Qwen tokens, to LENGTHS."""
    from envs.tau2 import Tau2Env
    from envs.tau2_gold import gold_messages
    from toolcall import TOOL_CHAT_TEMPLATE
    from jinja2 import Template

    if args.tokenizer:
        from transformers import AutoTokenizer
        hf = AutoTokenizer.from_pretrained(args.tokenizer)
        count, source = (lambda text: len(hf(text, add_special_tokens=False).input_ids)), args.tokenizer
    else:
        import base64

        import tiktoken
        ranks = {base64.b64decode(tok): int(rank) for tok, rank in (line.split() for line in open(args.tiktoken))}
        pattern = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
                   r"""\s*[\r\n]+|\s+(?!\S)|\s+""")  # Qwen's pre-tokenizer: digits one by one
        markers = {m: len(ranks) + i for i, m in enumerate(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])}
        enc = tiktoken.Encoding("qwen", pat_str=pattern, mergeable_ranks=ranks, special_tokens=markers)
        count, source = (lambda text: len(enc.encode(text, allowed_special="all"))), f"{Path(args.tiktoken).name} (Qwen's BPE, as the dashscope wheel ships it)"
    template = Template(TOOL_CHAT_TEMPLATE)
    env, rows = Tau2Env("retail"), []
    for split in ("train", "test"):
        for task in env.tasks(split):
            if task.data.evaluation_criteria is None:
                continue
            messages = gold_messages(env.start(task))
            first = next(i for i, m in enumerate(messages) if m["role"] == "assistant" and m.get("tool_calls")
                         or i > 0 and m["role"] == "user")  # the opening: up to the first user message
            first += messages[first]["role"] == "user"
            tools = env.tools(task)
            opening = count(template.render(messages=messages[:first], tools=tools, add_generation_prompt=False))
            total = count(template.render(messages=messages, tools=tools, add_generation_prompt=False))
            rows.append({"task": task.id, "split": split, "opening": opening, "gold": total})
    head = json.dumps({"tokenizer": source, "template": "toolcall.TOOL_CHAT_TEMPLATE (Qwen's layout)"})[:-1]
    LENGTHS.write_text(head + ', "tasks": [\n' + ",\n".join(json.dumps(r) for r in rows) + "\n]}\n")
    print(f"{len(rows)} tasks -> {LENGTHS}")


def meta_model():
    from transformers import Qwen3Config
    return memory.meta_model(Qwen3Config(**QWEN3_8B, torch_dtype=torch.bfloat16)).to(torch.bfloat16)


def held_at_once(pool, episodes: list[tuple[int, int, int]], shared: bool, max_new: int) -> list:
    """The episodes ((group, opening, longest) tokens each, in queue order) the pool takes into one batch, each at
    its longest with a whole turn's budget before it, placed in slots by the pool's own admit and arrange."""
    from fast.engine import admit, _arrange
    openings = {g: SimpleNamespace() for g, _, _ in episodes}  # a group's opening (pool.Opening's stand-in)
    rows = [SimpleNamespace(ep=SimpleNamespace(input_ids=range(n - max_new)), base=o - 1 if shared else 0,
                            pool=None, slot=-1, spilled=None, kv_len=0, held=0, group=g,
                            opening=openings[g] if shared else None) for g, o, n in episodes]
    batch, _ = admit(pool, rows)
    return [r for _, part in _arrange(pool, batch) for r in part]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--measure", action="store_true", help="write the lengths (needs tau2 and a Qwen tokenizer)")
    p.add_argument("--tiktoken", default="", help="Qwen's BPE as a tiktoken file (qwen.tiktoken)")
    p.add_argument("--tokenizer", default="", help="or a transformers tokenizer (Qwen/Qwen3-8B)")
    p.add_argument("--gpu-gib", type=float, default=80.0)
    p.add_argument("--max-context", type=int, default=32768)
    p.add_argument("--max-new-tokens", type=int, default=1024)
    p.add_argument("--grow", type=float, default=2.0, help="a real episode's part after its opening: gold's x a "
                   "uniform draw between 1 and this")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--groups", type=int, default=16, help="tasks a rollout plays (--tasks-per-step)")
    args = p.parse_args(argv)
    if args.measure:
        if not (args.tiktoken or args.tokenizer):
            raise SystemExit("bench/slots.py --measure: give --tiktoken FILE or --tokenizer NAME")
        return measure(args)
    from fast.pool import SlotPool, Tiers

    data = json.loads(LENGTHS.read_text())
    tasks, rng, episodes = data["tasks"], random.Random(0), []
    for g in range(args.groups):  # one rollout's GRPO groups
        t = rng.choice(tasks)
        for _ in range(args.group_size):
            rest = int(rng.uniform(1.0, args.grow) * (t["gold"] - t["opening"]))
            episodes.append((g, t["opening"], min(t["opening"] + rest + args.max_new_tokens, args.max_context)))
    model = meta_model()
    kv = memory.kv_bytes_per_token(model.config, bf16=True)
    n_params = sum(q.numel() for q in model.parameters())
    base = memory.memory_estimate(n_params, bf16=True, inference=True, kv_bytes_per_token=kv, episodes=0,
                                  prefill=memory.rollout_prefill(model.config, True, 8192, args.max_context, 1))
    room = int(args.gpu_gib * 2**30 / memory.ESTIMATE_MISSES) - base["peak"]
    longest, openings = sorted(n for _, _, n in episodes), sorted(o for _, o, _ in episodes)
    print(f"tau2 retail, {len(tasks)} tasks ({data['tokenizer']}): opening median {statistics.median(openings):,} "
          f"(max {openings[-1]:,}); an episode at its longest (gold's rest x U(1, {args.grow:g}), + one turn's "
          f"{args.max_new_tokens}) median {statistics.median(longest):,}, 95th percentile "
          f"{longest[int(0.95 * len(longest))]:,}, max {longest[-1]:,}")
    print(f"Qwen3-8B, bf16: {kv:,} B a token of KV cache; {args.gpu_gib:g} GiB less the weights and one prefill "
          f"(memory.py, with its {memory.ESTIMATE_MISSES}x margin): {room / 2**30:.1f} GiB for the cache\n")
    # a second queue: the same episodes at a point of their lives drawn uniformly (a batch mid-rollout)
    midway = [(g, o, rng.randint(min(o + args.max_new_tokens, n), n)) for g, o, n in episodes]
    print("| layout | slots | GiB held | episodes decoding at once: each at its longest | at a random point |")
    print("|---|---|---|---|---|")
    one = room // (kv * args.max_context)
    flat = [len(held_at_once(SlotPool(model, one, args.max_context), q, False, args.max_new_tokens))
            for q in (episodes, midway)]
    print(f"| one size (today's default) | {one}x{args.max_context} | {one * args.max_context * kv / 2**30:.1f} | "
          f"{flat[0]} | {flat[1]} |")
    for shared in (False, True):
        for quantiles in ((0.95,), (0.5, 0.95)):
            need = sorted(n - (o - 1 if shared else 0) + 1 for _, o, n in episodes)
            sizes = [-(-need[int(q * len(need))] // 1024) * 1024 for q in quantiles]  # whole thousands of positions
            shares = [b - a for a, b in zip((0.0, *quantiles), quantiles)]  # the episodes each size is for
            top = 2 * args.max_context  # and two slots of max_context for the longest
            counts = lambda n: [max(1, round(n * f / quantiles[-1])) for f in shares]  # noqa: E731
            # the openings' pool as batched_rollout makes it: a slot for each group the slots hold whole, and two
            groups_at_once = lambda n: min(-(-(sum(counts(n)) + 2) // args.group_size) + 2, args.groups)  # noqa
            openings_held = lambda n: groups_at_once(n) * (openings[-1] + 1) if shared else 0  # noqa: E731
            n = room // kv // min(sizes)
            while n > 1 and sum(c * z for c, z in zip(counts(n), sizes)) + top + openings_held(n) > room // kv:
                n -= 1
            spec = list(zip(counts(n), sizes)) + [(2, args.max_context)]

            def tiers():
                made = Tiers([SlotPool(model, c, z) for c, z in spec], args.max_new_tokens, args.max_context)
                made.max_openings = groups_at_once(n) if shared else 0
                return made
            got = [held_at_once(tiers(), q, shared, args.max_new_tokens) for q in (episodes, midway)]
            held = (sum(c * z for c, z in spec) + openings_held(n)) * kv / 2**30
            name = f"{len(sizes) + 1} sizes" + (f" + the opening held once ({groups_at_once(n)} openings' slots)" if shared else "")
            print(f"| {name} | {','.join(f'{c}x{z}' for c, z in spec)} | {held:.1f} | {len(got[0])} "
                  f"({len(got[0]) / flat[0]:.2f}x) | {len(got[1])} ({len(got[1]) / flat[1]:.2f}x) |")


if __name__ == "__main__":
    main()
