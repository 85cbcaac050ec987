"""shop: a small, procedurally generated customer-service domain that a tiny model can learn on a CPU.

In the spirit of tau2-bench retail, scaled down for a ~1-3M-parameter transformer trained from scratch: a short
policy, six tools with compact schemas, short JSON tool outputs, formulaic-but-varied user phrasing; system prompt +
tool schemas + a whole dialogue stay around 3,000 characters (about 1,000 tokens). The tasks, the goods of shop and of
its two sibling stores, and the refund decision are in envs/shop_tasks.py; the scripted users in envs/shop_user.py;
the scripted teacher in envs/shop_expert.py.

    env = ShopEnv(n_train=5000, n_test=256, seed=0)       # make_env("shop"), "shop:static", "shop:replay", ...
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
  - not asking where a refund goes or how an exchange's new item ships (the write then does the default: wrong
    for the half of the users who want a voucher, or express shipping, which the dynamic user says only when
    asked; a proposal that names what the user does not want ends the conversation);
  - writing without an explicit "yes" (reward 0, see `ShopSession.reward`);
  - not adapting when the user changes its mind at the first confirmation (15% of write tasks; 40% in "hard");
  - ending too early, or doing more than asked (an extra write or transfer changes the database).
"""
from __future__ import annotations

import copy
import json
from dataclasses import asdict, replace

from envs import Task, ToolResult, play
from envs.shop_tasks import (CHOICES, GOODS, HARD, NONDEFAULT_SHARE, REFUNDS, SHIPPINGS, SIBLINGS, WRITE_TOOLS,
                             Procedure, id_tokens, is_question, make_task, scenario)

USERS = ("dynamic", "static", "told", "replay", "teacher")
# The ablation's cold-start teacher (bench/ablation.py; grpo.py's --cold-start-skips-ask, while its
# --cold-start-skips-confirm is 0.6): it writes without a yes in this share of its conversations and never asks what
# the user wants in this one. The "teacher" user
# replays the dynamic user's side of its conversations: the paper's pre-scripted (static) data.
COLD_TEACHER = {"skip_confirm": 0.3, "skip_ask": 0.7}

# name -> (description, the accepted sets of string arguments). Short on purpose: with a byte-level BPE every
# schema costs ~45 tokens of JSON scaffolding plus its words, in every prompt (one lookup tool, not two, for that).
TOOL_SPECS = {
    "find_user": ("Find a user by email, or by name and zip.", [["email"], ["name", "zip"]]),
    "get_order": ("Get an order.", [["order_id"]]),
    "cancel_order": ("Cancel an order; refund: original (default) or voucher.", [["order_id"], ["order_id", "refund"]]),
    "return_item": ("Return an item; refund: original (default) or voucher.",
                    [["order_id", "item"], ["order_id", "item", "refund"]]),
    "exchange_item": ("Exchange an item for another color; shipping: standard (default) or express.",
                      [["order_id", "item", "new_item"], ["order_id", "item", "new_item", "shipping"]]),
    "transfer_to_human_agents": ("Transfer the user to a human agent.", [[]]),
}
TOOLS = [{"type": "function", "function": {
    "name": name, "description": desc,
    "parameters": {"type": "object", "properties": {p: {"type": "string"} for ps in sets for p in ps},
                   "required": sets[0] if len(sets) == 1 else sorted(set.intersection(*map(set, sets)))}}}
    for name, (desc, sets) in TOOL_SPECS.items()]


def _json(obj) -> str:
    return json.dumps(obj, separators=(",", ":"))


# ---------------------------------------------------------------------------------------------------------
# One episode's state: a private copy of the task's database, the tools, the reward
# ---------------------------------------------------------------------------------------------------------
class ToolError(Exception):
    pass


class ShopSession:
    def __init__(self, task: Task):
        self.task = task
        self.status = GOODS[task.data["goods"]].status
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

    def _choice(self, decision: str, value: str) -> str:
        if value not in CHOICES[decision]:
            raise ToolError(f"{decision} must be {' or '.join(CHOICES[decision])}, not {value!r}")
        return value

    def _cancel_order(self, order_id, refund=REFUNDS[0]):
        order, refund = self._order(order_id), self._choice("refund", refund)
        if order["status"] != self.status["pending"]:
            raise ToolError(f"order {order_id} is {order['status']}, only {self.status['pending']} orders can be "
                            "cancelled")
        order["status"], order["refund"] = self.status["cancelled"], refund
        return self._done(order_id)

    def _delivered_item(self, order_id, item) -> dict:
        order = self._order(order_id)
        if order["status"] != self.status["delivered"]:
            raise ToolError(f"order {order_id} is {order['status']}, only {self.status['delivered']} orders allow "
                            "returns and exchanges")
        if item not in order["items"]:
            raise ToolError(f"order {order_id} has no {item}")
        return order

    def _return_item(self, order_id, item, refund=REFUNDS[0]):
        order, refund = self._delivered_item(order_id, item), self._choice("refund", refund)
        order["status"], order["return"], order["refund"] = self.status["returning"], item, refund
        return self._done(order_id)

    def _exchange_item(self, order_id, item, new_item, shipping=SHIPPINGS[0]):
        order, shipping = self._delivered_item(order_id, item), self._choice("shipping", shipping)
        color, _, product = new_item.strip().partition(" ")
        if product != item.split()[1] or color == item.split()[0] or color not in self.db["products"][product]:
            raise ToolError(f"{new_item} is not another color of the {item}")
        order["status"], order["exchange"] = self.status["exchanging"], [item, new_item.strip()]
        order["shipping"] = shipping
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
        info = {"db_match": not differ, "differ": differ, "unconfirmed_writes": unconfirmed}
        if self.task.meta.get("decision"):  # the decision the user in the loop teaches, recorded where it arises
            info["asked"] = asked(messages, self.task.meta["decision"])
        return float(ok), info


def asked(messages: list[dict], decision: str) -> bool:
    """Did the agent ask what the user wants of `decision` (where the refund goes, how the new item ships: a message
    the dynamic user answers with it, `is_question`) before its first write?"""
    for m in messages:
        if m.get("role") != "assistant":
            continue
        if any((c.get("function") or {}).get("name") in WRITE_TOOLS for c in m.get("tool_calls") or []):
            return False
        if is_question(decision, str(m.get("content") or "")):
            return True
    return False


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
    """One store of the family (`goods`: "shop", or a sibling, "garden" or "sport") with one kind of scripted user:
      dynamic   vague opening, details and what it wants of a decision only when asked, strict about a proposal that
                names what it does not want, a change of mind at the first confirmation in some write tasks (the
                paper's simulated user)
      static    who it is, its final request and what it wants in its first message; never changes its mind (the
                same tasks, tools, gold and reward)
      told      the dynamic user, who also says what it wants of its request's decision (where a refund goes, how a
                new item ships) unasked, whenever it says what it wants done: the decision's information without a
                question, everything else as the dynamic user's (bench/ablation.py's static arm)
      replay    the paper's pre-scripted interaction: the dynamic user's turns from the expert's conversation on that
                task, played in order whatever the agent says (task.meta["user_sim"]["scripted"]: an LLM user
                simulator leaves these tasks to the script)
      teacher   the same, from the cold-start teacher's conversation on that task (COLD_TEACHER: it asks what the user
                wants in 30% of them), as the paper's static data is the conversations its cold start was made of
    `nondefault_share`: the share of users who want a voucher (express shipping) rather than the default (0: every
    user wants the default, the negative control of bench/ablation.py). `procedure`: how much procedure the tasks ask
    (envs/shop_tasks.Procedure; HARD as the refund domain's ablation met it). `old`: the store before the decisions
    were in its policy, as the tiny base is pretrained on it: the policy says nothing of them and the expert never
    asks (it names what a user says unasked: a static user's wishes are still honoured; with ":default", every user
    wants the defaults). Command-line names: make_env("shop"), "shop:static", "shop:replay", "shop:garden",
    "shop:replay:default", "shop:hard", "shop:old" (`from_name`)."""
    name = "shop"

    def __init__(self, n_train: int = 5000, n_test: int = 256, seed: int = 0, user: str = "dynamic",
                 goods: str = "shop", nondefault_share: float = NONDEFAULT_SHARE, procedure: Procedure = Procedure(),
                 old: bool = False):
        assert n_train <= 500_000 and n_test <= 500_000, "train and test seeds would overlap"
        if user not in USERS:
            raise ValueError(f"shop: user {user!r} is not one of {', '.join(USERS)}")
        if goods not in GOODS:
            raise ValueError(f"shop: goods {goods!r} is not one of {', '.join(GOODS)}")
        if not 0 <= nondefault_share <= 1:
            raise ValueError(f"shop: nondefault_share {nondefault_share} is not in [0, 1]")
        self.seed, self.user, self.goods, self.old = seed, user, GOODS[goods], old
        self.name = "shop" if goods == "shop" else f"shop:{goods}"
        self._splits = {split: [make_task(split, i, seed, self.goods, nondefault_share, procedure) for i in range(n)]
                        for split, n in (("train", n_train), ("test", n_test))}
        self._replays: dict[str, list[str]] = {}
        for task in self._splits["train"] + self._splits["test"]:
            if user in ("static", "told"):  # an LLM user simulator reads the scenario: it must be this user's too
                task.user_scenario = scenario(task.data, task.data["db"]["users"][task.data["user_id"]],
                                              static=user == "static", told=user == "told")
            elif user in ("replay", "teacher"):
                task.meta["user_sim"] = {"scripted": True}

    def tasks(self, split: str) -> list[Task]:
        if split not in self._splits:
            raise ValueError(f"unknown split {split!r}: shop has {', '.join(self._splits)}")
        return self._splits[split]

    def system_prompt(self, task: Task) -> str:
        return self.goods.rules(self.old)

    def tools(self, task: Task) -> list[dict]:
        return copy.deepcopy(TOOLS)

    def user_tools(self, task: Task) -> list[dict]:
        return []

    def start(self, task: Task) -> ShopSession:
        return ShopSession(task)

    def scripted_user(self, task: Task):
        from envs.shop_user import ReplayUser, ShopUser  # players of the domain, loaded when asked for

        if self.user not in ("replay", "teacher"):
            return ShopUser(task, static=self.user == "static", told=self.user == "told")
        if task.id not in self._replays:  # the expert's (teacher's) conversation with the dynamic user, once per task
            teacher = self.expert(task, **(COLD_TEACHER if self.user == "teacher" else {}))
            messages = play(self, task, teacher, ShopUser(task))[0]
            self._replays[task.id] = [m["content"] for m in messages if m["role"] == "user"]
        return ReplayUser(self._replays[task.id])

    def expert(self, task: Task, skip_confirm: float = 0.0, skip_ask: float = 0.0, skip_status: float = 0.0):
        """The scripted teacher; with `skip_confirm` > 0 it writes without asking for a yes, with `skip_ask` > 0 it
        never asks what the user wants of a decision (using what the user said, else the default), with `skip_status`
        > 0 it writes before reading the order's status and transfers when refused, each in that share of
        conversations (drawn per task, from its seed). Under the old policy it never asks."""
        from envs.shop_expert import ShopExpert  # a player of the domain, loaded when asked for

        return ShopExpert(task.data["goods"], skip_confirm, 1.0 if self.old else skip_ask, seed=task.data["seed"],
                          skip_status=skip_status)

    def tokenizer_words(self) -> list[str]:
        """The stores' identifiers, each one token of the tiny tokenizer (id_tokens)."""
        return id_tokens()

    def corpus(self, n_tasks: int = 300) -> list[str]:
        """Texts to train the tiny BPE tokenizer on: the text of expert episodes on the first `n_tasks` train seeds,
        shared among shop and its siblings (so one tokenizer serves every store, and is independent of n_train and
        of the user), each with the store's policy and the tool schemas as the prompt shows them, so that BPE merges
        are weighted the way the model will read text."""
        texts = []
        stores = [ShopEnv(0, 0, self.seed, goods=g) for g in ("shop", *SIBLINGS)]
        for i in range(n_tasks):
            env = stores[i % len(stores)]
            task = make_task("train", i // len(stores), self.seed, env.goods)
            messages, _, _, _ = play(env, task, env.expert(task))
            texts += [env.goods.rules()] + [json.dumps(t) for t in TOOLS]
            for m in messages[1:]:
                texts.append(str(m.get("content") or ""))
                for c in m.get("tool_calls") or []:
                    texts.append(json.dumps({"name": c["function"]["name"],
                                             "arguments": json.loads(c["function"]["arguments"])}))
        return [t for t in texts if t]


def from_name(name: str, **options) -> ShopEnv:
    """"shop" followed by any of ":<user>" (dynamic, static, told, replay, teacher), ":<goods>" (garden, sport),
    ":default" (every user wants the defaults), ":old" (the policy without the decisions, an expert that never asks;
    `ShopEnv`), ":hard" (the procedure as the refund domain's ablation met it: envs/shop_tasks.HARD), ":name-zip"
    (users who may not know their email) and ":hints" (users who may not know their order id): "shop:static",
    "shop:old:default"."""
    parts = name.split(":")[1:]
    procedure = options.pop("procedure", Procedure())
    for part in parts:
        if part in USERS or part in GOODS:
            key = "user" if part in USERS else "goods"
            if key in options:
                raise ValueError(f"environment {name!r}: two {key}s ({options[key]}, {part})")
            options[key] = part
        elif part == "default":
            options["nondefault_share"] = 0.0
        elif part == "old":
            options["old"] = True
        elif part in HARDER:
            procedure = replace(procedure, **HARDER[part])
        else:
            raise ValueError(f"environment {name!r}: {part!r} is not a shop user ({', '.join(USERS)}), store "
                             f"({', '.join(GOODS)}) or one of default, old, {', '.join(HARDER)}")
    return ShopEnv(procedure=procedure, **options)


# The name parts that make the procedure harder (from_name).
HARDER = {"hard": asdict(HARD), "name-zip": {"knows_email": HARD.knows_email},
          "hints": {"knows_order_id": HARD.knows_order_id}}
