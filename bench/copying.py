"""Can the tiny model learn to copy? The diagnostic behind README "Status" (why it solves no shop task).

    ./run python bench/copying.py                        # all three probes, 600 steps each
    ./run python bench/copying.py --probes induction --steps 2500

Each probe trains a fresh `models.load_model("tiny")` (fp32, CPU) from scratch and prints the loss on the tokens it
must copy, on each step's fresh batch before its update, against chance (the log of the number of choices):
  offset     random 32-token sequences repeated right after themselves: the copy is always 33 tokens back, so a
             head that attends to a fixed relative position solves it
  induction  each row repeats its own random sequence of 8-40 tokens, at a random place: no fixed offset helps;
             copying needs content-addressed attention (an induction head: find the earlier occurrence of the
             current token, copy what followed it). Every token of the repeat after its first is trained.
  shop       dialogues in the shop domain's own format, dense in copying: the user gives an email, name and zip,
             or an order id or item, and the agent's next message is the tool call with those values. Loss on the
             agent's tokens, split into digits, first and last names, and everything else.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from plumbing import models  # noqa: E402
import muarl  # noqa: E402
from envs import make_env  # noqa: E402
from envs.shop_tasks import FIRST, LAST, SHOP  # noqa: E402

ITEMS = SHOP.items
from fast.logprobs import token_logprobs  # noqa: E402

SYMBOLS = 200  # random-token alphabet of the offset and induction probes


def offset_batch(tok, g, B=64, n=32):
    sep = muarl.end_of_turn_id(tok)
    x = torch.randint(300, 300 + SYMBOLS, (B, n), generator=g)
    ids = torch.cat([torch.full((B, 1), sep), x, torch.full((B, 1), sep), x], 1)
    mask = torch.zeros_like(ids)
    mask[:, n + 2:] = 1
    return ids, mask, {"copied": mask.bool()}


def induction_batch(tok, g, B=32, nmax=40):
    sep, T = muarl.end_of_turn_id(tok), 2 * nmax + 2
    ids, mask = torch.full((B, T), sep), torch.zeros(B, T, dtype=torch.long)
    for b in range(B):
        n = int(torch.randint(8, nmax + 1, (1,), generator=g))
        pre = int(torch.randint(0, T - 2 * n - 1, (1,), generator=g))
        x = torch.randint(300, 300 + SYMBOLS, (n,), generator=g)
        row = torch.cat([torch.randint(300, 300 + SYMBOLS, (pre,), generator=g), torch.tensor([sep]), x,
                         torch.tensor([sep]), x])
        ids[b, :len(row)] = row
        mask[b, pre + n + 3:pre + 2 * n + 2] = 1  # the repeat, from its second token
    return ids, mask, {"copied": mask.bool()}


def _call(tool, **args):
    return {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": tool, "arguments": json.dumps(args)}}]}


def _exchange(r):
    first, last = r.choice(FIRST), r.choice(LAST)
    zip_code, order = "".join(r.choice("0123456789") for _ in range(5)), f"o{r.randrange(1000):03d}"
    email, item = f"{first.lower()}.{last.lower()}{r.randrange(10, 100)}@mail.com", r.choice(ITEMS)
    return r.choice([
        [{"role": "user", "content": f"My name is {first} {last} and my zip is {zip_code}."},
         _call("find_user", name=f"{first} {last}", zip=zip_code)],
        [{"role": "user", "content": f"Sure, {email}."}, _call("find_user", email=email)],
        [{"role": "user", "content": f"It is order {order}."}, _call("get_order", order_id=order)],
        [{"role": "user", "content": f"The {item} from order {order}."}, _call("return_item", order_id=order, item=item)],
        [{"role": "user", "content": f"Please cancel order {order}."},
         {"role": "assistant", "content": f"I will cancel order {order}. Confirm (yes/no)?"}]])


def shop_batch(tok, words, r, B=32):
    convs = []
    for _ in range(B):
        msgs = [{"role": "system", "content": "You are a shop support agent."}]
        for _ in range(r.randrange(3, 9)):
            msgs += _exchange(r)
            if msgs[-1].get("tool_calls"):
                msgs.append({"role": "tool", "tool_call_id": "c", "content": '{"ok":true}'})
        convs.append(muarl.encode_conversation(tok, msgs[:-1] if msgs[-1]["role"] == "tool" else msgs))
    ids, _, mask = muarl.collate(convs, tok.pad_token_id, "cpu")
    kind = torch.tensor([[1 if words[t].isdigit() else 2 if words[t] in FIRST + LAST else 0 for t in row] for row in ids.tolist()])
    m = mask.bool()
    return ids, mask, {"digits": m & (kind == 1), "names": m & (kind == 2), "other": m & (kind == 0)}


def run(probe: str, steps: int, lr: float, seed: int) -> None:
    model, tok = models.load_model("tiny", device="cpu", seed=seed, env=make_env("shop"))
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    g, r = torch.Generator().manual_seed(seed + 1), random.Random(seed + 1)
    batch = {"offset": lambda: offset_batch(tok, g), "induction": lambda: induction_batch(tok, g),
             "shop": lambda: shop_batch(tok, words, r)}[probe]
    words = [tok.decode([t]).strip() for t in range(len(tok))]
    chance = {"offset": {"copied": math.log(SYMBOLS)}, "induction": {"copied": math.log(SYMBOLS)},
              "shop": {"digits": math.log(10), "names": (math.log(len(FIRST)) + math.log(len(LAST))) / 2, "other": None}}[probe]
    t0 = time.time()
    for step in range(steps + 1):
        ids, mask, classes = batch()
        logp = token_logprobs(model, ids, torch.ones_like(ids) if probe != "shop" else (ids != tok.pad_token_id).long())
        if step % max(1, steps // 6) == 0 or step == steps:
            with torch.no_grad():
                parts = [f"{k} {-(logp[m]).mean().item():.3f}" + (f" (chance {chance[k]:.2f})" if chance[k] else "")
                         for k, m in classes.items()]
            print(f"{probe:9s} step {step:5d}  " + ", ".join(parts) + f"  [{time.time() - t0:.0f}s]", flush=True)
        if step == steps:
            break
        loss = -(logp * mask).sum() / mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--probes", default="offset,induction,shop")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(f"tiny model, lr {args.lr}, {args.steps} steps per probe, torch threads {torch.get_num_threads()}")
    for probe in args.probes.split(","):
        run(probe, args.steps, args.lr, args.seed)


if __name__ == "__main__":
    main()
