"""Cold start of the tiny model on shop: SFT on whole conversations only, against short windows first.

    ./run python bench/coldstart.py                      # both arms, ~15 minutes on 2 CPU cores
    ./run python bench/coldstart.py --window-steps 600,1000 --seed 1

The agent must copy ids (names, zips, emails, order ids) and items from the dialogue into its tool calls. A model
trained from scratch on whole ~900-token episodes does not learn that within a CPU budget; trained first on
~60-token windows of the same conversations (`sft.windows`) it does. Every arm starts from the same
initialization and trains on the same expert conversations (the cold start `grpo.py` makes); an arm with
window steps first trains that many steps on windows. Printed per arm:
  - held-out agent tokens predicted right (argmax, teacher-forced, expert conversations on test tasks), split into
    ids (single tokens of the tiny tokenizer), item words (colors, products) and the rest;
  - greedy pass^1 on the test split against the scripted user, and how it splits over task kinds.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

import muarl  # noqa: E402
import sft  # noqa: E402
from envs import play  # noqa: E402
from envs.shop import COLORS, PRODUCTS, ShopEnv, id_tokens  # noqa: E402
from eval import summarize  # noqa: E402
from rollout import RolloutConfig, make_user_sim, rollout  # noqa: E402


def token_accuracy(model, tok, convs) -> dict[str, tuple[float, int]]:
    """Per class of agent token: (fraction whose argmax prediction is right, count)."""
    ids_set = {tok.convert_tokens_to_ids(w) for w in id_tokens()}
    item_set = set()  # a color or product word, with or without its leading space
    for w in COLORS + PRODUCTS:
        for v in (w, " " + w):
            enc = tok(v, add_special_tokens=False)["input_ids"]
            if len(enc) == 1:
                item_set.add(enc[0])
    right, count = {"ids": 0, "items": 0, "other": 0}, {"ids": 0, "items": 0, "other": 0}
    with torch.no_grad():
        for k in range(0, len(convs), 8):
            ids, attn, mask = muarl.collate(convs[k:k + 8], tok.pad_token_id)
            pred = model(input_ids=ids, attention_mask=attn).logits[:, :-1].argmax(-1)
            target, m = ids[:, 1:], mask[:, 1:].bool()
            for t, p in zip(target[m].tolist(), pred[m].tolist()):
                c = "ids" if t in ids_set else "items" if t in item_set else "other"
                right[c] += t == p
                count[c] += 1
    return {c: (right[c] / max(1, count[c]), count[c]) for c in count}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--window-steps", default="0,600", help="comma-separated arms: window steps before whole conversations")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--test-tasks", type=int, default=100)
    args = ap.parse_args()
    arms = [int(x) for x in args.window_steps.split(",")]
    base = sft.SFTConfig(seed=args.seed)
    conversations = sft.make_cold_start(base)
    env = ShopEnv()
    test = env.tasks("test")[:args.test_tasks]
    held_out = []
    for t in test[:64]:
        messages, *_ = play(env, t, env.expert(t))
        held_out.append(messages)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for steps in arms:
            t0 = time.time()
            out = sft.train(sft.SFTConfig(seed=args.seed, window_steps=steps, out=f"{tmp}/arm-{steps}"), conversations)
            seconds = time.time() - t0
            model, tok = muarl.load_model(str(out), device="cpu")
            model.eval()
            acc = token_accuracy(model, tok, [muarl.encode_conversation(tok, m, env.tools(test[0])) for m in held_out])
            eps = rollout(model, tok, env, test, 1, make_user_sim("scripted"),
                          RolloutConfig(greedy=True, max_new_tokens=128, max_context=1536))
            s = summarize([e.to_json() for e in eps], 1, {t.id: t.meta for t in test})
            rows.append((steps, acc, s, seconds))
            print(f"[bench] window steps {steps}: done in {seconds:.0f}s, pass^1 {s['pass^1']:.3f}", flush=True)
    print(f"\ncold start of 'tiny' on shop, seed {args.seed}, {len(conversations)} expert conversations; "
          f"held-out tokens from {len(held_out)} test conversations, pass^1 on {len(test)} test tasks (greedy)")
    print(f"{'window steps':>12} | {'ids right':>9} | {'items right':>11} | {'other right':>11} | {'pass^1':>6} | "
          f"pass^1 by kind{'':28} | train time")
    for steps, acc, s, seconds in rows:
        kinds = ", ".join(f"{k} {v['pass^1']:.2f}" for k, v in s["by_meta"]["kind"].items())
        print(f"{steps:>12} | {acc['ids'][0]:>9.3f} | {acc['items'][0]:>11.3f} | {acc['other'][0]:>11.3f} | "
              f"{s['pass^1']:>6.3f} | {kinds:42} | {seconds:.0f}s")


if __name__ == "__main__":
    main()
