"""Which values does a tiny base copy? Its loss on each copied token of held-out drills, by kind of value.

    ./run python bench/copies.py assets/tiny-base [OTHER_CHECKPOINT ...] [--tasks 40]

The drills are the base's own (coldstart.windows of the expert's conversations on the test tasks of each store of
sft.BASE_STORES, items renamed as drawn: envs.shop_tasks.relabel_goods), and a copied token is one of the stores'
identifiers (envs.shop_tasks.id_tokens: one token each), or an item (one token, in a base made before items were
split) or an item's color or product word, that the agent writes and that already stood earlier in the drill, as
`coldstart.copy_loss` counts them. For each kind (ids, emails, items, item words, full names, other words) it prints
the mean loss in nats, the number of copies, the share below even odds (probability under 1/2) and the token the
model puts first most often where it misses: what `pretrain_tiny`'s single held-out copy loss averages over.
"""
from __future__ import annotations

import argparse
import collections
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

import sft  # noqa: E402
from envs import make_env  # noqa: E402
from envs.shop_tasks import GOODS, relabel_goods  # noqa: E402
from fast.logprobs import token_logprobs  # noqa: E402
from muarl import collate  # noqa: E402
from plumbing.coldstart import encode, make_cold_start, repeated, windows  # noqa: E402
from plumbing.models import load_model  # noqa: E402

ITEMS = {i for g in GOODS.values() for i in g.items}
ITEM_WORDS = {w for g in GOODS.values() for w in (*g.colors, *g.products)}


def kind(word: str) -> str:
    if word[:1] in "ou" and word[1:].isdigit():
        return "id"
    if "@" in word or "." in word:
        return "email"
    return ("item" if word in ITEMS else "item word" if word in ITEM_WORDS else "full name" if " " in word else
            "word")


def value_tokens(tok) -> dict[int, str]:
    """The tokens of the values an agent copies, by id: the environment's identifiers, and items, which are one
    token each (a base made before the tokenizer split them) or their color and product words (since)."""
    words = {}
    for w in [*make_env("shop").tokenizer_words(), *ITEMS]:
        if len(ids := tok(w, add_special_tokens=False)["input_ids"]) == 1:
            words[ids[0]] = w
    for w in ITEM_WORDS:
        if len(ids := tok(" " + w, add_special_tokens=False)["input_ids"]) == 1:
            words[ids[0]] = w
    return words


def drills(tasks: int, seed: int = 1) -> list[dict]:
    convs = [c for store in sft.BASE_STORES for c in make_cold_start(sft.SFTConfig(
        env=store, split="test", num_tasks=tasks, teacher="expert", user_sim="scripted"))]
    rng = random.Random(seed)
    return windows([relabel_goods(c, rng) for c in convs])


def copies_by_kind(model, tok, data: list[dict], batch: int = 32) -> dict[str, dict]:
    words = value_tokens(tok)
    encoded = encode(tok, data, 10**6)[0]
    stats = collections.defaultdict(lambda: {"nll": 0.0, "n": 0, "missed": 0, "instead": collections.Counter()})
    model.eval()
    for k in range(0, len(encoded), batch):
        ids, attn, mask = collate(encoded[k:k + batch], tok.pad_token_id, "cpu")
        with torch.no_grad():
            nll = -token_logprobs(model, ids, attn).double()
            first = model(input_ids=ids, attention_mask=attn).logits.argmax(-1)  # first[t]: the guess for t + 1
        for b, t in zip(*torch.nonzero(mask.bool() & repeated(ids, attn), as_tuple=True)):
            word = words.get(int(ids[b, t]))
            if word is None:
                continue
            s = stats[kind(word)]
            s["nll"] += float(nll[b, t])
            s["n"] += 1
            if float(nll[b, t]) > 0.6931:  # below even odds
                s["missed"] += 1
                s["instead"][tok.decode([int(first[b, t - 1])]).strip()] += 1
    return {k: {"nll": s["nll"] / s["n"], "copies": s["n"], "missed": s["missed"] / s["n"],
                "instead": s["instead"].most_common(1)[0][0] if s["instead"] else ""} for k, s in stats.items()}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("agents", nargs="+", help="checkpoint directories of the shop family's tiny tokenizer")
    p.add_argument("--tasks", type=int, default=40, help="test tasks of each store the expert plays")
    args = p.parse_args(argv)
    data = drills(args.tasks)
    for agent in args.agents:
        model, tok = load_model(agent, device="cpu", dtype=torch.float32)
        print(f"{agent}: {len(data)} held-out drills")
        for k, s in sorted(copies_by_kind(model, tok, data).items()):
            print(f"  {k:10s} {s['nll']:6.3f} nats a copy over {s['copies']:4d} copies, {s['missed']:.0%} below even "
                  f"odds{', most often written instead: ' + repr(s['instead']) if s['instead'] else ''}")


if __name__ == "__main__":
    main()
