"""shop: a small, procedurally generated customer-service domain that a tiny model can learn on a CPU.

In the spirit of tau2-bench retail, scaled down for a ~1-3M-parameter transformer trained from scratch
(cold-start SFT on the expert's dialogues, then GRPO against the scripted user; the default run's cold start
imitates an imperfect version of the expert, `ShopEnv.expert(task, skip_confirm=...)`, whose skipped confirmations
GRPO learns to make from the reward: bench/README.md). The design:
a short policy, six tools with compact schemas, short JSON tool outputs, and formulaic-but-varied user
phrasing. System prompt + tool schemas + a whole dialogue stay around 2,700 characters (about 1,000 tokens).

    env = ShopEnv(n_train=5000, n_test=100, seed=0)
    task = env.tasks("train")[0]
    messages, reward, info, termination = play(env, task, env.expert(task))   # reward 1.0

Each task has its own small database (the customer, two other customers, a product catalog) generated from
the task's seed; train and test seeds are disjoint. The customer wants one thing: cancel a pending order,
return or exchange an item of a delivered order, or something the policy does not allow (transfer to a human).
Where the agent can fail, on purpose:
  - acting before authenticating (the tools refuse), or looking the user up by name without the zip
    (a second customer of the same name exists in some tasks);
  - picking the wrong order: the order list is shuffled, and a user who does not know the order id
    describes it by an item, so the agent has to look orders up until it finds that item;
  - not checking the order status (cancelling a delivered order, returning a pending one -> transfer);
  - writing without an explicit "yes" (reward 0, see `ShopSession.reward`);
  - not adapting when the user changes its mind at the first confirmation (~40% of write tasks);
  - ending too early, or doing more than asked (an extra write or transfer changes the database).
"""
from __future__ import annotations

import copy
import json
import random
import re

from envs import Task, ToolResult, play

PRODUCTS = ["mug", "lamp", "pen", "shirt", "bag", "hat", "clock", "kettle", "scarf", "chair"]
COLORS = ["red", "blue", "green", "black", "white", "gray"]
ITEMS = [f"{c} {p}" for p in PRODUCTS for c in COLORS]  # every item name any task can contain
# Few enough names that each full name ("Hugo Silva", one token of the tiny tokenizer) is seen often in training.
FIRST = ["Anna", "Ben", "Carla", "David", "Emma", "Felix", "Grace", "Hugo", "Iris", "Jonas"]
LAST = ["Lee", "Smith", "Garcia", "Khan", "Novak", "Silva"]
ZIPS = [str(z) for z in sorted(random.Random(5).sample(range(10000, 100000), 30))]  # the towns customers live in
MAILS = ["@mail.com", "@post.net", "@inbox.org"]
WRITE_TOOLS = ("cancel_order", "return_item", "exchange_item")
OTHER_TOPICS = {"address": "I want to change the shipping address of an order.",
                "compensation": "My order came late. I want compensation.",
                "card": "I want to pay for an order with another card."}

POLICY = """You are a shop support agent.
- First find the user by email, or by name and zip. Help only with their own orders.
- Cancel only pending orders. Return or exchange only items of delivered orders, for another color of the same product.
- Before you cancel, return or exchange, state the action and get an explicit yes.
- One tool call at a time.
- If the request is anything else or not allowed, transfer to a human agent."""

# name -> (description, the accepted sets of string arguments). Short on purpose: with a byte-level BPE every
# schema costs ~45 tokens of JSON scaffolding plus its words, in every prompt (one lookup tool, not two, for that).
TOOL_SPECS = {
    "find_user": ("Find a user by email, or by name and zip.", [["email"], ["name", "zip"]]),
    "get_order": ("Get an order.", [["order_id"]]),
    "cancel_order": ("Cancel a pending order.", [["order_id"]]),
    "return_item": ("Return an item of a delivered order.", [["order_id", "item"]]),
    "exchange_item": ("Exchange an item of a delivered order for another color.", [["order_id", "item", "new_item"]]),
    "transfer_to_human_agents": ("Transfer the user to a human agent.", [[]]),
}
TOOLS = [{"type": "function", "function": {
    "name": name, "description": desc,
    "parameters": {"type": "object", "properties": {p: {"type": "string"} for ps in sets for p in ps},
                   "required": sets[0] if len(sets) == 1 else []}}}
    for name, (desc, sets) in TOOL_SPECS.items()]

ORDER_RE = re.compile(r"\bo\d{2}\b")
HINT_RE = re.compile(r"order with the ([a-z]+ [a-z]+)")
CONFIRM = " Confirm (yes/no)?"


def _json(obj) -> str:
    return json.dumps(obj, separators=(",", ":"))


def id_tokens() -> list[str]:
    """Every value the domain can generate that an agent must copy: full names, item names, names and email
    parts, zips, order and user ids. The tiny tokenizer makes each one a single token (`models.env_tokenizer`).

    Full names ("Jonas Silva") and items ("white shirt") are one token each because a model trained from scratch
    copies a single token by its content long before it learns to copy the token *after* the one it just copied
    (an induction head): with names and items as two tokens, the cold-started agent copied the first name and
    wrote the most frequent last name ("Jonas Lee"), and wrote "red bag" for every item."""
    return ([f"{a} {b}" for a in FIRST for b in LAST] + ITEMS
            + FIRST + LAST + [n.lower() for n in FIRST + LAST] + MAILS + ZIPS
            + [f"o{n}" for n in range(10, 100)] + [f"u{n}" for n in range(10, 100)])


def _items_in(text: str) -> list[str]:
    """Item names mentioned in `text`, in order of appearance."""
    found = [(m.start(), item) for item in ITEMS for m in re.finditer(rf"\b{item}\b", text)]
    return [item for _, item in sorted(found)]


# ---------------------------------------------------------------------------------------------------------
# Task generation: one seed -> one task with its own database
# ---------------------------------------------------------------------------------------------------------
def make_task(split: str, index: int, seed: int = 0) -> Task:
    """Train seeds are seed*1e6 + index, test seeds seed*1e6 + 500,000 + index: disjoint for index < 500,000."""
    task_seed = seed * 1_000_000 + (500_000 if split == "test" else 0) + index
    rng = random.Random(task_seed)
    catalog = {p: sorted(rng.sample(COLORS, 3)) for p in PRODUCTS}
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
        db["orders"][oid] = {"user_id": uid, "status": status, "items": items}
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
    gold = {"cancel": [["cancel_order", {"order_id": final["order"]}]],
            "return": [["return_item", {"order_id": final["order"], "item": final["item"]}]],
            "exchange": [["exchange_item", {"order_id": final["order"], "item": final["item"],
                                            "new_item": final["new"]}]],
            }.get(final["action"]) if kind != "transfer" else [["transfer_to_human_agents", {}]]
    user = db["users"][uid]
    data = {"seed": task_seed, "db": db, "user_id": uid, "kind": kind, "goal": goal, "change": change,
            "change_type": change_type, "knows_email": rng.random() < 0.6, "knows_order_id": rng.random() < 0.6,
            "gold": gold}
    task = Task(id=f"shop-{split}-{index}", user_scenario="", data=data,
                meta={"kind": kind, "change": change_type, "topic": topic, "seed": task_seed})
    task.user_scenario = _scenario(data, user)
    return task


def _describe(want: dict, knows_id: bool) -> str:
    ref = f"order {want['order']}" if knows_id else f"the order with the {want['hint']} (you do not know its id)"
    if want["action"] == "other":
        return {"address": "change the shipping address of an order", "card": "pay for an order with another card",
                "compensation": "get compensation because an order came late"}[want["topic"]]
    return {"cancel": f"cancel {ref}", "return": f"return the {want['item']} from {ref}",
            "exchange": f"exchange the {want['item']} from {ref} for the {want['new']}"}[want["action"]]


SCENARIO_END = ("Say yes only to exactly the action you want. When it is done, thank the agent and end with "
                "###STOP###; also end with ###STOP### if the agent transfers you.")


def _scenario(d: dict, user: dict, static: bool = False) -> str:
    email = f"your email is {user['email']}" if d["knows_email"] else "you do not remember your email"
    text = f"You are {user['name']}, a shop customer; {email}; your zip code is {user['zip']}. "
    if static:  # shop:static: everything at once, the final request, no change of mind
        return text + (f"You want to {_describe(d['change'] or d['goal'], d['knows_order_id'])}. In your first "
                       "message say who you are (your email, or name and zip) and exactly what you want; never change "
                       "your mind. " + SCENARIO_END)
    text += (f"You want to {_describe(d['goal'], d['knows_order_id'])}. Start by saying only that you need help "
             "with an order. Give your email (or name and zip), the order and the item only when the agent asks. ")
    if d["change"]:
        text += (f"When the agent first asks you to confirm an action, say no and change your mind: you now want to "
                 f"{_describe(d['change'], d['knows_order_id'])}. ")
    return text + SCENARIO_END


# ---------------------------------------------------------------------------------------------------------
# One episode's state: a private copy of the task's database, the tools, the reward
# ---------------------------------------------------------------------------------------------------------
class ToolError(Exception):
    pass


class ShopSession:
    def __init__(self, task: Task):
        self.task = task
        self.db = copy.deepcopy(task.data["db"])  # docs/invariants.md, 4: nothing leaks between episodes
        self.user_id = None  # set by a successful find_user; the order tools refuse to work without it

    def call_tool(self, name: str, arguments: dict, requestor: str = "assistant") -> ToolResult:
        if name not in TOOL_SPECS:
            return ToolResult(f"Error: unknown tool {name!r}", error=True)
        sets = TOOL_SPECS[name][1]
        if not isinstance(arguments, dict) or sorted(arguments) not in [sorted(ps) for ps in sets]:
            accepted = " or ".join("(" + ", ".join(ps) + ")" for ps in sets)
            return ToolResult(f"Error: {name} takes arguments {accepted}", error=True)
        if not all(isinstance(v, str) for v in arguments.values()):
            return ToolResult(f"Error: {name} arguments must be strings", error=True)
        try:
            return ToolResult(_json(getattr(self, "_" + name)(**arguments)))
        except ToolError as e:
            return ToolResult(f"Error: {e}", error=True)
        except Exception as e:  # a bug in a tool must not end the rollout
            return ToolResult(f"Error: {type(e).__name__}: {e}", error=True)

    def _login(self, uid: str | None) -> dict:
        if uid is None:
            raise ToolError("user not found")
        self.user_id = uid
        return {"user_id": uid, "orders": self.db["users"][uid]["orders"]}

    def _find_user(self, email=None, name=None, zip=None):
        if email is not None:
            match = lambda u: u["email"] == email.strip().lower()
        else:  # two customers may share a name: the zip is what tells them apart
            match = lambda u: u["name"].lower() == name.strip().lower() and u["zip"] == zip.strip()
        return self._login(next((k for k, u in self.db["users"].items() if match(u)), None))

    def _order(self, order_id: str) -> dict:
        if self.user_id is None:
            raise ToolError("authenticate the user first")
        order = self.db["orders"].get(order_id)
        if order is None or order["user_id"] != self.user_id:
            raise ToolError(f"order {order_id} not found for this user")
        return order

    def _get_order(self, order_id):
        return {"order_id": order_id, **{k: v for k, v in self._order(order_id).items() if k != "user_id"}}

    def _done(self, order_id):  # write results are short: the agent has seen the order already
        return {"order_id": order_id, "status": self.db["orders"][order_id]["status"]}

    def _cancel_order(self, order_id):
        order = self._order(order_id)
        if order["status"] != "pending":
            raise ToolError(f"order {order_id} is {order['status']}, only pending orders can be cancelled")
        order["status"] = "cancelled"
        return self._done(order_id)

    def _delivered_item(self, order_id, item) -> dict:
        order = self._order(order_id)
        if order["status"] != "delivered":
            raise ToolError(f"order {order_id} is {order['status']}, only delivered orders allow returns and exchanges")
        if item not in order["items"]:
            raise ToolError(f"order {order_id} has no {item}")
        return order

    def _return_item(self, order_id, item):
        order = self._delivered_item(order_id, item)
        order["status"], order["return"] = "returning", item
        return self._done(order_id)

    def _exchange_item(self, order_id, item, new_item):
        order = self._delivered_item(order_id, item)
        color, _, product = new_item.strip().partition(" ")
        if product != item.split()[1] or color == item.split()[0] or color not in self.db["products"][product]:
            raise ToolError(f"{new_item} is not another color of the {item}")
        order["status"], order["exchange"] = "exchanging", [item, new_item.strip()]
        return self._done(order_id)

    def _transfer_to_human_agents(self):
        # Recorded in the database so that a needed transfer (and an unneeded one) shows in the DB reward.
        self.db["transfers"].append(self.user_id)
        return {"status": "transferred"}

    def reward(self, messages: list[dict]) -> tuple[float, dict]:
        """1.0 iff the database equals the gold replay's AND every write call came right after a user "yes".

        The second condition is a policy check tau2 leaves out; without it an agent that skips confirmation
        is right on every task where the user does not change its mind, and a tiny model learns to skip it."""
        gold = gold_db(self.task)
        differ = []
        for table in sorted(set(gold) | set(self.db)):
            a, b = gold.get(table), self.db.get(table)
            if isinstance(a, dict) and isinstance(b, dict):
                differ += [f"{table}.{k}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
            elif a != b:
                differ.append(table)
        unconfirmed = unconfirmed_writes(messages)
        ok = not differ and not unconfirmed
        return float(ok), {"db_match": not differ, "differ": differ, "unconfirmed_writes": unconfirmed}


def gold_db(task: Task) -> dict:
    """The database after the task's gold actions, replayed on a fresh copy as the authenticated user."""
    session = ShopSession(task)
    session.user_id = task.data["user_id"]
    for name, args in task.data["gold"]:
        result = session.call_tool(name, args)
        assert not result.error, (task.id, name, result.content)
    return session.db


def unconfirmed_writes(messages: list[dict]) -> list[str]:
    """Write calls not licensed by a user message starting with "yes" since the previous write call."""
    licensed, bad = False, []
    for m in messages:
        if m.get("role") == "user":
            licensed = str(m.get("content") or "").strip().lower().startswith("yes")
        elif m.get("role") == "assistant":
            for call in m.get("tool_calls") or []:
                name = (call.get("function") or {}).get("name")
                if name in WRITE_TOOLS:
                    if not licensed:
                        bad.append(name)
                    licensed = False
    return bad


# ---------------------------------------------------------------------------------------------------------
# The environment
# ---------------------------------------------------------------------------------------------------------
class ShopEnv:
    """`user="static"` (`make_env("shop:static")`): the scripted user states who it is and its final request in its
    first message and never changes its mind; same tasks, tools, gold and reward (bench/ablation.py's arm 4: GRPO
    against a user that still answers, but with nothing to ask and nothing that changes)."""
    name = "shop"

    def __init__(self, n_train: int = 5000, n_test: int = 100, seed: int = 0, user: str = "dynamic"):
        assert n_train <= 500_000 and n_test <= 500_000, "train and test seeds would overlap"
        if user not in ("dynamic", "static"):
            raise ValueError(f"shop: user {user!r} is not 'dynamic' or 'static'")
        self.seed, self.user = seed, user
        self._splits = {"train": [make_task("train", i, seed) for i in range(n_train)],
                        "test": [make_task("test", i, seed) for i in range(n_test)]}
        if user == "static":  # an LLM user simulator reads the scenario: it must be the static one too
            for task in self._splits["train"] + self._splits["test"]:
                task.user_scenario = _scenario(task.data, task.data["db"]["users"][task.data["user_id"]], static=True)

    def tasks(self, split: str) -> list[Task]:
        if split not in self._splits:
            raise ValueError(f"unknown split {split!r}: shop has {', '.join(self._splits)}")
        return self._splits[split]

    def system_prompt(self, task: Task) -> str:
        return POLICY

    def tools(self, task: Task) -> list[dict]:
        return copy.deepcopy(TOOLS)

    def user_tools(self, task: Task) -> list[dict]:
        return []

    def start(self, task: Task) -> ShopSession:
        return ShopSession(task)

    def scripted_user(self, task: Task):
        from envs.shop_user import ShopUser  # here, not at the top: the user imports this module's formats

        return ShopUser(task, static=self.user == "static")

    def expert(self, task: Task, skip_confirm: float = 0.0):
        """The scripted teacher; with `skip_confirm` > 0 it writes without asking in that share of conversations
        (drawn per task, from its seed)."""
        from envs.shop_expert import ShopExpert  # here, not at the top: the expert imports this module's formats

        return ShopExpert(skip_confirm, seed=task.data["seed"] if skip_confirm else 0)

    def tokenizer_words(self) -> list[str]:
        """The domain's identifiers, each one token of the tiny tokenizer (id_tokens)."""
        return id_tokens()

    def corpus(self, n_tasks: int = 300) -> list[str]:
        """Texts to train the tiny BPE tokenizer on: the text of expert episodes on the first `n_tasks` train
        seeds (independent of n_train, so the tokenizer is too), each with the policy and the tool schemas as
        the prompt shows them, so that BPE merges are weighted the way the model will read text."""
        texts = []
        for i in range(n_tasks):
            task = make_task("train", i, self.seed)
            messages, _, _, _ = play(self, task, self.expert(task))
            texts += [POLICY] + [json.dumps(t) for t in TOOLS]
            for m in messages[1:]:
                texts.append(str(m.get("content") or ""))
                for c in m.get("tool_calls") or []:
                    texts.append(json.dumps({"name": c["function"]["name"],
                                             "arguments": json.loads(c["function"]["arguments"])}))
        return [t for t in texts if t]
