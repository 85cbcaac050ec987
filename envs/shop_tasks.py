"""The shop domain's tasks: its goods, the formats its players read, and one seed -> one task with its own database.

The world is a family of stores that share one tool API (find a customer, get an order, cancel, return, exchange,
transfer) and one refund rule, and differ in their goods, the words of their order statuses and the wording of their
policy (`Goods`): `shop` itself and two siblings, `garden` and `sport`. The tiny base is pretrained on the siblings'
conversations only (sft.pretrain_tiny), as Qwen3 arrives having seen other stores' conversations but not tau2's.

Where a refund goes is the decision only a user who answers what it is asked can teach (bench/ablation.py): every
cancel and return draws a destination, the original payment or a voucher (a voucher `voucher_share` of the time). The
dynamic user says it only when asked about the refund, and says yes to a proposal that names none, which writes the
default (the original payment): so an agent that never asks is right on `1 - voucher_share` of those tasks with the
dynamic user, and on all of them with a static user (who says it in its first message) or a replayed one (whose
turns include the answer whatever the agent asked). `voucher_share=0` is the negative control: no user needs asking.
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass

from envs import Task

FIRST = ["Anna", "Ben", "Carla", "David", "Emma", "Felix", "Grace", "Hugo", "Iris", "Jonas"]
LAST = ["Lee", "Smith", "Garcia", "Khan", "Novak", "Silva"]
ZIPS = [str(z) for z in sorted(random.Random(5).sample(range(10000, 100000), 30))]  # the towns customers live in
MAILS = ["@mail.com", "@post.net", "@inbox.org"]
WRITE_TOOLS = ("cancel_order", "return_item", "exchange_item")
OTHER_TOPICS = {"address": "I want to change the shipping address of an order.",
                "compensation": "My order came late. I want compensation.",
                "card": "I want to pay for an order with another card."}
REFUNDS = ("original", "voucher")  # where a refund goes; the first is what a write that names none does
REFUND_SAID = {"original": "to your original payment", "voucher": "as a voucher"}  # in the agent's proposal
VOUCHER_SHARE = 0.44  # so that never asking is right on ~56% of refund tasks with the dynamic user


@dataclass(frozen=True)
class Goods:
    """What one store of the family sells and how it words its statuses and its policy. `status` maps the API's
    states (pending, delivered, cancelled, returning, exchanging) to this store's words."""
    name: str
    products: tuple
    colors: tuple
    status: dict
    policy: str

    @property
    def items(self) -> list[str]:
        return [f"{c} {p}" for p in self.products for c in self.colors]


SHOP = Goods("shop", ("mug", "lamp", "pen", "shirt", "bag", "hat", "clock", "kettle", "scarf", "chair"),
             ("red", "blue", "green", "black", "white", "gray"),
             {s: s for s in ("pending", "delivered", "cancelled", "returning", "exchanging")},
             """You are a shop support agent.
- First find the user by email, or by name and zip. Help only with their own orders.
- Cancel only pending orders. Return or exchange only items of delivered orders, for another color of the same product.
- Before a cancel or a return, ask where the refund goes: the original payment or a voucher.
- Before you cancel, return or exchange, state the action and get an explicit yes.
- One tool call at a time.
- If the request is anything else or not allowed, transfer to a human agent.""")
GARDEN = Goods("garden", ("rake", "hose", "shovel", "pot", "glove", "bench", "lantern", "bucket", "fence", "swing"),
               ("orange", "yellow", "brown", "pink", "purple", "silver"),
               {"pending": "processing", "delivered": "received", "cancelled": "voided", "returning": "refunding",
                "exchanging": "swapping"},
               """You help customers of a garden store.
- Identify the customer by email, or by name plus zip, before anything else. Only their own orders.
- An order can be cancelled while processing. Items of a received order can be returned, or swapped for another color.
- For a cancel or a return, first ask if the refund should go to the original payment or to a voucher.
- Say exactly what you will do and wait for a clear yes before you do it.
- Call one tool at a time.
- Anything else, or anything these rules forbid: transfer to a human agent.""")
SPORT = Goods("sport", ("ball", "racket", "helmet", "bottle", "towel", "jersey", "mat", "cap", "sock", "skate"),
              ("navy", "gold", "teal", "beige", "maroon", "olive"),
              {"pending": "open", "delivered": "arrived", "cancelled": "closed", "returning": "sent_back",
               "exchanging": "replacing"},
              """Sport store support.
- Find the customer (email, or name and zip) first; act on their orders only.
- Open orders may be cancelled; items of arrived orders may be returned or exchanged for another color.
- Ask before a cancel or a return whether to refund the original payment or give a voucher.
- Describe the action and get an explicit yes first.
- One tool call per turn.
- Other requests, or ones not allowed: transfer to a human agent.""")
GOODS = {g.name: g for g in (SHOP, GARDEN, SPORT)}
SIBLINGS = ("garden", "sport")  # the stores the tiny base is pretrained on (never shop)

ORDER_RE = re.compile(r"\bo\d{2}\b")
HINT_RE = re.compile(r"order with the ([a-z]+ [a-z]+)")
CONFIRM = " Confirm (yes/no)?"


def id_tokens() -> list[str]:
    """Every value the stores can generate that an agent must copy: full names, item names, names and email parts,
    zips, order and user ids. The tiny tokenizer makes each one a single token (`models.env_tokenizer`).

    Full names ("Jonas Silva") and items ("white shirt") are one token each because a model trained from scratch
    copies a single token by its content long before it learns to copy the token *after* the one it just copied
    (an induction head): with names and items as two tokens, the cold-started agent copied the first name and
    wrote the most frequent last name ("Jonas Lee"), and wrote "red bag" for every item."""
    return ([f"{a} {b}" for a in FIRST for b in LAST] + [i for g in GOODS.values() for i in g.items]
            + FIRST + LAST + [n.lower() for n in FIRST + LAST] + MAILS + ZIPS
            + [f"o{n}" for n in range(10, 100)] + [f"u{n}" for n in range(10, 100)])


def items_in(text: str, goods: Goods = SHOP) -> list[str]:
    """Item names of `goods` mentioned in `text`, in order of appearance."""
    found = [(m.start(), item) for item in goods.items for m in re.finditer(rf"\b{item}\b", text)]
    return [item for _, item in sorted(found)]


def relabel_goods(conversation: dict, goods: Goods, rng: random.Random) -> dict:
    """The conversation with the items of `goods` renamed, consistently, to the items of a store drawn at random
    (products to products, colors to colors, so an exchange stays one for another color of the same product): the
    drills of the tiny base's first stage (sft.pretrain_tiny) then copy every store's item names, as an LLM's
    pretraining has seen the word "mug", while its whole conversations stay the siblings' own."""
    store = rng.choice(list(GOODS.values()))
    products = dict(zip(goods.products, rng.sample(store.products, len(goods.products))))
    colors = dict(zip(goods.colors, rng.sample(store.colors, len(goods.colors))))
    names = {f"{c} {p}": f"{colors[c]} {products[p]}" for c in goods.colors for p in goods.products}
    pattern = re.compile(r"\b(" + "|".join(map(re.escape, sorted(names, key=len, reverse=True))) + r")\b")
    sub = lambda text: pattern.sub(lambda m: names[m.group(1)], text)  # noqa: E731
    messages = []
    for m in conversation["messages"]:
        m = dict(m, content=sub(m["content"])) if isinstance(m.get("content"), str) else dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [dict(c, function=dict(c["function"], arguments=sub(c["function"]["arguments"])))
                               for c in m["tool_calls"]]
        messages.append(m)
    return dict(conversation, messages=messages)


def refund_named(text: str) -> str | None:
    """The refund destination a message names: "voucher", "original", None, or "both" (an agent's question)."""
    low = text.lower()
    named = [r for r in REFUNDS if r in low]
    return "both" if len(named) > 1 else named[0] if named else None


def is_proposal(text: str) -> bool:
    """An agent message the user takes as a proposal to confirm (it answers yes or no)."""
    return "yes/no" in text.lower() or "confirm" in text.lower()


def is_refund_question(text: str) -> bool:
    """An agent message the dynamic user takes as a question about the refund (and answers with its destination):
    it speaks of the refund and is neither a proposal nor an ending (a transfer, a goodbye, "done")."""
    low = text.lower()
    return "refund" in low and not is_proposal(low) and not any(w in low for w in ("transfer", "goodbye", "done"))


def make_task(split: str, index: int, seed: int = 0, goods: Goods = SHOP, voucher_share: float = VOUCHER_SHARE
              ) -> Task:
    """Train seeds are seed*1e6 + index, test seeds seed*1e6 + 500,000 + index: disjoint for index < 500,000. A
    sibling store's seeds are offset too, so that no sibling task is a shop task with other words."""
    task_seed = seed * 1_000_000 + (500_000 if split == "test" else 0) + index
    rng = random.Random(task_seed if goods is SHOP else f"{goods.name}-{task_seed}")
    st = goods.status
    catalog = {p: sorted(rng.sample(goods.colors, 3)) for p in goods.products}
    pool = [f"{c} {p}" for p, cs in catalog.items() for c in cs]
    rng.shuffle(pool)  # items are drawn from the pool without replacement: no item is in two orders
    order_ids = iter(f"o{n}" for n in rng.sample(range(10, 100), 12))
    user_ids = [f"u{n}" for n in rng.sample(range(10, 100), 3)]
    db = {"users": {}, "orders": {}, "products": catalog, "transfers": []}

    def add_order(uid, status, n_items):
        # One item per product in an order, so "the red mug" -> "the blue mug" is never ambiguous.
        items = []
        for _ in range(n_items):
            items.append(next(x for x in reversed(pool) if x.split()[1] not in {i.split()[1] for i in items}))
            pool.remove(items[-1])
        oid = next(order_ids)
        db["orders"][oid] = {"user_id": uid, "status": st[status], "items": items}
        return oid

    kind = rng.choice(["cancel"] * 3 + ["return"] * 3 + ["exchange"] * 3 + ["transfer"] * 2)
    change_type = None
    if kind != "transfer" and rng.random() < 0.4:
        change_type = {"cancel": "other_order", "exchange": "to_return",
                       "return": rng.choice(["other_item", "to_exchange"])}[kind]
    uid = user_ids[0]
    topic = None
    if kind == "transfer":
        topic = rng.choice(["address", "compensation", "card", "cancel_delivered", "return_pending"])
        status = ({"cancel_delivered": "delivered", "return_pending": "pending"}.get(topic)
                  or rng.choice(["pending", "delivered"]))
        target = add_order(uid, status, rng.randint(1, 3))
    else:
        n_items = 2 if change_type == "other_item" else 1
        target = add_order(uid, "pending" if kind == "cancel" else "delivered", rng.randint(n_items, 3))
    mine = [target]
    alt = add_order(uid, "pending", rng.randint(1, 2)) if change_type == "other_order" else None
    if alt:
        mine.append(alt)
    for _ in range(rng.randint(0, 2 if alt is None else 1)):
        mine.append(add_order(uid, rng.choice(["pending", "delivered", "cancelled"]), rng.randint(1, 2)))
    rng.shuffle(mine)  # the order the user means is not always first in the list

    first, last = rng.choice(FIRST), rng.choice(LAST)
    same_name = rng.random() < 0.3  # a second customer of the same name: the zip matters
    zips = rng.sample(ZIPS, 3)  # distinct: customers of the same name are told apart by their zip
    for i, u in enumerate(user_ids):
        name = f"{first} {last}" if i == 0 or (i == 1 and same_name) else f"{rng.choice(FIRST)} {rng.choice(LAST)}"
        taken = {x["email"] for x in db["users"].values()}
        email = next(e for e in (name.replace(" ", ".").lower() + m for m in rng.sample(MAILS, 3)) if e not in taken)
        orders = mine if i == 0 else [add_order(u, rng.choice(["pending", "delivered"]), 1)
                                      for _ in range(rng.randint(1, 2))]
        db["users"][u] = {"name": name, "email": email, "zip": zips[i], "orders": orders}

    items = db["orders"][target]["items"]
    item = rng.choice(items)
    product = item.split()[1]
    new = f"{rng.choice([c for c in catalog[product] if c != item.split()[0]])} {product}"
    action = {"transfer": {"cancel_delivered": "cancel", "return_pending": "return"}.get(topic, "other")
              }.get(kind, kind)
    # Drawn from its own stream, so that adding the refund left every other draw of a task as it was.
    refund = "voucher" if random.Random(f"refund-{goods.name}-{task_seed}").random() < voucher_share else "original"
    goal = {"action": action, "order": target, "hint": item, "item": item if action in ("return", "exchange") else None,
            "new": new if action == "exchange" else None, "topic": topic}
    change = None
    if change_type == "other_order":
        change = dict(goal, order=alt, hint=db["orders"][alt]["items"][0])
    elif change_type == "other_item":
        change = dict(goal, item=rng.choice([x for x in items if x != item]))
    elif change_type == "to_exchange":
        change = dict(goal, action="exchange", new=new)
    elif change_type == "to_return":
        change = dict(goal, action="return", new=None)
    final = change or goal
    gold = {"cancel": [["cancel_order", {"order_id": final["order"], "refund": refund}]],
            "return": [["return_item", {"order_id": final["order"], "item": final["item"], "refund": refund}]],
            "exchange": [["exchange_item", {"order_id": final["order"], "item": final["item"],
                                            "new_item": final["new"]}]],
            }.get(final["action"]) if kind != "transfer" else [["transfer_to_human_agents", {}]]
    refund_task = kind != "transfer" and final["action"] in ("cancel", "return")
    data = {"seed": task_seed, "goods": goods.name, "db": db, "user_id": uid, "kind": kind, "goal": goal,
            "change": change, "change_type": change_type, "knows_email": rng.random() < 0.6,
            "knows_order_id": rng.random() < 0.6, "refund": refund, "gold": gold}
    prefix = "shop" if goods is SHOP else f"shop-{goods.name}"
    task = Task(id=f"{prefix}-{split}-{index}", user_scenario="", data=data,
                meta={"kind": kind, "change": change_type, "topic": topic, "seed": task_seed,
                      "refund": refund if refund_task else None})
    task.user_scenario = scenario(data, db["users"][uid])
    return task


def describe(want: dict, knows_id: bool) -> str:
    ref = f"order {want['order']}" if knows_id else f"the order with the {want['hint']} (you do not know its id)"
    if want["action"] == "other":
        return {"address": "change the shipping address of an order", "card": "pay for an order with another card",
                "compensation": "get compensation because an order came late"}[want["topic"]]
    return {"cancel": f"cancel {ref}", "return": f"return the {want['item']} from {ref}",
            "exchange": f"exchange the {want['item']} from {ref} for the {want['new']}"}[want["action"]]


SCENARIO_END = ("Say yes only to exactly the action you want. When it is done, thank the agent and end with "
                "###STOP###; also end with ###STOP### if the agent transfers you.")


def scenario(d: dict, user: dict, static: bool = False) -> str:
    """The instructions an LLM user simulator gets (the scripted users, envs/shop_user.py, act them out)."""
    email = f"your email is {user['email']}" if d["knows_email"] else "you do not remember your email"
    text = f"You are {user['name']}, a shop customer; {email}; your zip code is {user['zip']}. "
    refund = f"You want any refund {REFUND_SAID[d['refund']]}."
    if static:  # everything at once, the final request, no change of mind
        return text + (f"You want to {describe(d['change'] or d['goal'], d['knows_order_id'])}. {refund} In your "
                       "first message say who you are (your email, or name and zip), exactly what you want and where "
                       "a refund goes; never change your mind. " + SCENARIO_END)
    text += (f"You want to {describe(d['goal'], d['knows_order_id'])}. Start by saying only that you need help "
             "with an order. Give your email (or name and zip), the order and the item only when the agent asks. "
             f"{refund} Say where the refund goes only when the agent asks about the refund; say yes to a "
             "proposal that does not say where the refund goes. ")
    if d["change"]:
        text += (f"When the agent first asks you to confirm an action, say no and change your mind: you now want to "
                 f"{describe(d['change'], d['knows_order_id'])}. ")
    return text + SCENARIO_END
