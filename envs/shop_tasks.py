"""The shop domain's tasks: its goods, the formats its players read, and one seed -> one task with its own database.

The world is a family of stores that share one tool API (find a customer, get an order, cancel, return, exchange,
transfer) and one set of rules, and differ in their goods, the words of their order statuses and the wording of their
policy (`Goods`): `shop` itself and two siblings, `garden` and `sport`. The tiny base is pretrained on the siblings'
conversations and on shop's under its old policy (`old`: no choices, so the base knows the procedure and never the
question; sft.pretrain_tiny), as Qwen3 arrives having seen support conversations and then meets tau2's policy.

Two decisions only a user who answers what it is asked can teach (bench/ablation.py): where the refund of a cancel or
a return goes (the original payment, or a voucher) and how an exchange's new item ships (standard, or express). Each
user wants the non-default `nondefault_share` of the time (half by default; 0 is the negative control: no user needs
asking). The dynamic user says what it wants only when asked about it and says yes to a proposal that names nothing,
which writes the default; it ends the conversation at a proposal that names what it does not want (strict: guessing
and flipping scores like not asking). So an agent that never asks is right on about half the decision tasks with the
dynamic user, and on all of them with a static user (who says it in its first message) or a replayed one.

How much procedure a task asks of the agent is `Procedure`: by default every user knows its email and order id, a
change of mind is rare and exchanges (whose item names are the hardest to copy) are fewer; `HARD` is the domain as
the ablation of bench/ablation-mixed met it (identity by name + zip, orders described by an item, 40% changes).
"""
from __future__ import annotations

import json
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
REFUND_SAID = {"original": "to your original payment", "voucher": "as a voucher"}  # as the user says it
SHIPPINGS = ("standard", "express")  # how an exchange's new item ships; the first is the default
SHIPPING_SAID = {"standard": "with standard shipping", "express": "with express shipping"}
CHOICES = {"refund": REFUNDS, "shipping": SHIPPINGS}  # decision -> its options, the default first
NONDEFAULT_SHARE = 0.5  # the share of users who want the non-default, for each decision


def proposed(decision: str, value: str) -> str:
    """How the agent's proposal names what the user wants ("... order o12 (refund: voucher). Confirm (yes/no)?"): the
    user's own word, where the model writes it next, so that naming it is a copy (a phrase chosen before the word,
    "as a voucher" against "to your original payment", was a decision the tiny cold start did not learn to make)."""
    return f" ({decision}: {value})"


def decision_of(action: str | None) -> str | None:
    """The decision a write carries: where the refund goes (cancel, return), how the new item ships (exchange)."""
    return {"cancel": "refund", "return": "refund", "exchange": "shipping"}.get(action)


@dataclass(frozen=True)
class Procedure:
    """How much procedure shop's tasks ask of the agent (ShopEnv's `procedure`; from_name's "hard", "name-zip",
    "hints"). The default is within a ~1M-parameter model's reach, so that a decision, not the procedure, is what a
    base misses; HARD keeps the domain the ablation of bench/ablation-mixed met (the same draws: its tasks as they
    were). `kinds` weighs the task kinds; the shares are probabilities drawn per task."""
    knows_email: float = 1.0  # else the user gives its name and zip, and a namesake may exist
    knows_order_id: float = 1.0  # else the user describes the order by an item, and the agent looks orders up
    change: float = 0.15  # write tasks where the user changes its mind at the first confirmation
    kinds: tuple = (("cancel", 3), ("return", 3), ("exchange", 2), ("transfer", 2))


HARD = Procedure(knows_email=0.6, knows_order_id=0.6, change=0.4,
                 kinds=(("cancel", 3), ("return", 3), ("exchange", 3), ("transfer", 2)))


@dataclass(frozen=True)
class Goods:
    """What one store of the family sells and how it words its statuses and its policy. `status` maps the API's
    states (pending, delivered, cancelled, returning, exchanging) to this store's words; `asks`, the policy's lines
    on the two decisions, stand at its "{asks}" (`rules`)."""
    name: str
    products: tuple
    colors: tuple
    status: dict
    policy: str
    asks: str

    def rules(self, old: bool = False) -> str:
        """The policy the agent reads; `old`: before the decisions existed (no lines on them)."""
        return self.policy.replace("{asks}\n", "" if old else self.asks + "\n")

    @property
    def items(self) -> list[str]:
        return [f"{c} {p}" for p in self.products for c in self.colors]


SHOP = Goods("shop", ("mug", "lamp", "pen", "shirt", "bag", "hat", "clock", "kettle", "scarf", "chair"),
             ("red", "blue", "green", "black", "white", "gray"),
             {s: s for s in ("pending", "delivered", "cancelled", "returning", "exchanging")},
             """You are a shop support agent.
- First find the user by email, or by name and zip. Help only with their own orders.
- Cancel only pending orders. Return or exchange only items of delivered orders, for another color of the same product.
{asks}
- Before you cancel, return or exchange, state the action and get an explicit yes.
- One tool call at a time.
- If the request is anything else or not allowed, transfer to a human agent.""",
             """- Before a cancel or a return, ask where the refund goes: the original payment or a voucher.
- Before an exchange, ask how the new item ships: standard or express.""")
GARDEN = Goods("garden", ("rake", "hose", "shovel", "pot", "glove", "bench", "lantern", "bucket", "fence", "swing"),
               ("orange", "yellow", "brown", "pink", "purple", "silver"),
               {"pending": "processing", "delivered": "received", "cancelled": "voided", "returning": "refunding",
                "exchanging": "swapping"},
               """You help customers of a garden store.
- Identify the customer by email, or by name plus zip, before anything else. Only their own orders.
- An order can be cancelled while processing. Items of a received order can be returned, or swapped for another color.
{asks}
- Say exactly what you will do and wait for a clear yes before you do it.
- Call one tool at a time.
- Anything else, or anything these rules forbid: transfer to a human agent.""",
               """- For a cancel or a return, first ask if the refund should go to the original payment or to a voucher.
- For an exchange, first ask if the new item should ship standard or express.""")
SPORT = Goods("sport", ("ball", "racket", "helmet", "bottle", "towel", "jersey", "mat", "cap", "sock", "skate"),
              ("navy", "gold", "teal", "beige", "maroon", "olive"),
              {"pending": "open", "delivered": "arrived", "cancelled": "closed", "returning": "sent_back",
               "exchanging": "replacing"},
              """Sport store support.
- Find the customer (email, or name and zip) first; act on their orders only.
- Open orders may be cancelled; items of arrived orders may be returned or exchanged for another color.
{asks}
- Describe the action and get an explicit yes first.
- One tool call per turn.
- Other requests, or ones not allowed: transfer to a human agent.""",
              """- Ask before a cancel or a return whether to refund the original payment or give a voucher.
- Ask before an exchange whether the new item ships standard or express.""")
GOODS = {g.name: g for g in (SHOP, GARDEN, SPORT)}
SIBLINGS = ("garden", "sport")  # the stores the tiny base is pretrained on, beside shop's old policy

ORDER_RE = re.compile(r"\bo\d{2}\b")
HINT_RE = re.compile(r"order with the ([a-z]+ [a-z]+)")
CONFIRM = " Confirm (yes/no)?"


def id_tokens() -> list[str]:
    """The values the stores generate that an agent must copy and that the tiny tokenizer makes one token each
    (`models.env_tokenizer`): full names, names and email parts, zips, order and user ids. Items ("white shirt")
    are not among them: their color and product are words of their own.

    Full names ("Jonas Silva") are one token because a model trained from scratch copies a single token by its content
    long before it learns to copy the token *after* the one it just copied (an induction head): with names as two
    tokens, the cold-started agent copied the first name and wrote the most frequent last name ("Jonas Lee"). Items
    were one token too, for the same reason, until the base's drills (items renamed as drawn) showed that one-token
    items are never copied, at any width: 5.4-5.6 nats a copy, chance among the 180 items, one item written in every
    slot (bench/copies.py; bench/README.md, the gates' try 9), which failed every return and exchange. As two words
    of a few dozen, seen everywhere, they are copied: the base then passed its gate."""
    return ([f"{a} {b}" for a in FIRST for b in LAST]
            + FIRST + LAST + [n.lower() for n in FIRST + LAST] + MAILS + ZIPS
            + [f"o{n}" for n in range(10, 100)] + [f"u{n}" for n in range(10, 100)])


def items_in(text: str, goods: Goods = SHOP) -> list[str]:
    """Item names of `goods` mentioned in `text`, in order of appearance."""
    found = [(m.start(), item) for item in goods.items for m in re.finditer(rf"\b{item}\b", text)]
    return [item for _, item in sorted(found)]


def relabel_goods(conversation: dict, rng: random.Random) -> dict:
    """The conversation (of a task of this family: its "task_id" names the store) with its store's items renamed,
    consistently, to the items of a store drawn at random (products to products, colors to colors, so an exchange
    stays one for another color of the same product): the drills of the tiny base's first stage (sft.pretrain_tiny)
    then copy every store's item names, as an LLM's pretraining has seen the word "mug"."""
    goods = GOODS.get(conversation["task_id"].split("-")[1], SHOP)  # "shop-train-3", "shop-garden-train-3"
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


# Stand-ins for a wish in the base's drills (`with_wish`): a model that must copy any of them learns to copy a wish,
# where the two options of each decision could be told apart without copying anything.
WISH_WORDS = [f"{a}{b}" for a in ("ko", "ma", "pi", "ru", "se", "ta", "vo", "zu") for b in ("bel", "dor", "fin", "lum")]
PROPOSAL_RE = re.compile(r"^I will (cancel|return|exchange) .*\. Confirm \(yes/no\)\?$")


def with_wish(window: dict, rng: random.Random) -> dict | None:
    """A drill window (coldstart.windows) that ends in a proposal, or in the write a proposal in it led to, with a wish
    added: the user message before the proposal says one (a word of WISH_WORDS or an option of the decision, "Ship it
    rubel, please."), the proposal names it as the agent names a wish (`proposed`) and the write carries it; None for
    another window. The base learns to copy a wish it hears under the old policy, where nothing ever asks for one."""
    msgs = [dict(m) for m in window["messages"]]
    at = max((i for i, m in enumerate(msgs) if m["role"] == "assistant"
              and PROPOSAL_RE.match(str(m.get("content") or ""))), default=None)
    said_at = max((i for i in range(at or 0) if msgs[i]["role"] == "user"), default=None)
    calls = msgs[-1].get("tool_calls") or []
    writes = len(calls) == 1 and calls[0]["function"]["name"] in WRITE_TOOLS
    if at is None or said_at is None or not (at == len(msgs) - 1 or (writes and at == len(msgs) - 3)):
        return None
    decision = decision_of(PROPOSAL_RE.match(msgs[at]["content"]).group(1))
    word = rng.choice(WISH_WORDS + list(CHOICES[decision]))
    said = {"refund": f"Refund it to {word}, please.", "shipping": f"Ship it {word}, please."}[decision]
    msgs[said_at]["content"] = f"{msgs[said_at]['content']} {said}"
    msgs[at]["content"] = msgs[at]["content"].replace(". Confirm", f"{proposed(decision, word)}. Confirm")
    if writes:
        args = {**json.loads(calls[0]["function"]["arguments"]), decision: word}
        msgs[-1]["tool_calls"] = [dict(calls[0], function=dict(calls[0]["function"], arguments=json.dumps(args)))]
    return dict(window, messages=msgs)


def choice_named(decision: str, text: str) -> str | None:
    """The option of `decision` a message names ("voucher", "original"; "express", "standard"), None, or "both" (an
    agent's question)."""
    low = text.lower()
    named = [c for c in CHOICES[decision] if c in low]
    return "both" if len(named) > 1 else named[0] if named else None


def is_proposal(text: str) -> bool:
    """An agent message the user takes as a proposal to confirm (it answers yes or no)."""
    return "yes/no" in text.lower() or "confirm" in text.lower()


QUESTION_WORD = {"refund": "refund", "shipping": "ship"}


def is_question(decision: str, text: str) -> bool:
    """An agent message the dynamic user takes as a question about `decision` (and answers with what it wants): it
    speaks of the refund (of shipping) and is neither a proposal nor an ending (a transfer, a goodbye, "done")."""
    low = text.lower()
    return (QUESTION_WORD[decision] in low and not is_proposal(low)
            and not any(w in low for w in ("transfer", "goodbye", "done")))


def make_task(split: str, index: int, seed: int = 0, goods: Goods = SHOP, nondefault_share: float = NONDEFAULT_SHARE,
              procedure: Procedure = Procedure()) -> Task:
    """Train seeds are seed*1e6 + index, test seeds seed*1e6 + 500,000 + index: disjoint for index < 500,000. A
    sibling store's seeds are offset too, so that no sibling task is a shop task with other words. Each knob of
    `procedure` is read from the draw it always was, so HARD gives the tasks of before it existed."""
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

    kind = rng.choice([k for k, weight in procedure.kinds for _ in range(weight)])
    change_type = None
    if kind != "transfer" and rng.random() < procedure.change:
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
    # Each drawn from its own stream, so that adding a decision left every other draw of a task as it was.
    refund = "voucher" if random.Random(f"refund-{goods.name}-{task_seed}").random() < nondefault_share else "original"
    shipping = ("express" if random.Random(f"shipping-{goods.name}-{task_seed}").random() < nondefault_share
                else "standard")
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
                                            "new_item": final["new"], "shipping": shipping}]],
            }.get(final["action"]) if kind != "transfer" else [["transfer_to_human_agents", {}]]
    decision = decision_of(final["action"]) if kind != "transfer" else None
    data = {"seed": task_seed, "goods": goods.name, "db": db, "user_id": uid, "kind": kind, "goal": goal,
            "change": change, "change_type": change_type, "knows_email": rng.random() < procedure.knows_email,
            "knows_order_id": rng.random() < procedure.knows_order_id, "refund": refund, "shipping": shipping,
            "gold": gold}
    prefix = "shop" if goods is SHOP else f"shop-{goods.name}"
    # "decision" and "wants" group an evaluation's pass^1 (stats.summarize's by_meta): which decision the task carries
    # and whether its user wants the default or not.
    wants = decision and ("default" if data[decision] == CHOICES[decision][0] else "non-default")
    task = Task(id=f"{prefix}-{split}-{index}", user_scenario="", data=data,
                meta={"kind": kind, "change": change_type, "topic": topic, "seed": task_seed, "decision": decision,
                      "wants": wants})
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


def scenario(d: dict, user: dict, static: bool = False, told: bool = False) -> str:
    """The instructions an LLM user simulator gets (the scripted users, envs/shop_user.py, act them out)."""
    email = f"your email is {user['email']}" if d["knows_email"] else "you do not remember your email"
    text = f"You are {user['name']}, a shop customer; {email}; your zip code is {user['zip']}. "
    wants = (f"You want any refund {REFUND_SAID[d['refund']]}, and any new item sent "
             f"{SHIPPING_SAID[d['shipping']]}.")
    strict = ("If the agent proposes a refund or a shipping you do not want, say no and end the conversation with "
              "###STOP###. ")
    if static:  # everything at once, the final request, no change of mind
        return text + (f"You want to {describe(d['change'] or d['goal'], d['knows_order_id'])}. {wants} In your "
                       "first message say who you are (your email, or name and zip), exactly what you want and where "
                       "a refund goes or how a new item ships; never change your mind. " + strict + SCENARIO_END)
    text += (f"You want to {describe(d['goal'], d['knows_order_id'])}. Start by saying only that you need help "
             "with an order. Give your email (or name and zip), the order and the item only when the agent asks. "
             f"{wants} " + ("Whenever you say what you want done, also say where a refund goes or how a new item "
                            "ships, unasked; " if told else
                            "Say where the refund goes only when the agent asks about the refund, and how the item "
                            "ships only when it asks about shipping; ") +
             "say yes to a proposal that says neither. " + strict)
    if d["change"]:
        text += (f"When the agent first asks you to confirm an action, say no and change your mind: you now want to "
                 f"{describe(d['change'], d['knows_order_id'])}. ")
    return text + SCENARIO_END
