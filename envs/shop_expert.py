"""The shop domain's scripted expert: it follows the policy and reads everything it knows from the conversation.
It writes the cold-start data (coldstart.make_cold_start) and the text the tiny tokenizer is trained on
(ShopEnv.corpus).

Its own file, apart from envs/shop.py (the domain: tools, database, reward) and envs/shop_tasks.py (its tasks and
formats), because it is a player of the domain rather than part of it: the agent's expert counterpart of the scripted
user. It reads the domain's formats (order ids, item names, the confirmation question) from envs/shop_tasks.py;
ShopEnv.expert imports it.
"""
from __future__ import annotations

import json
import random
import re

from envs.shop_tasks import (CHOICES, CONFIRM, GOODS, HINT_RE, ORDER_RE, WRITE_TOOLS, choice_named, decision_of,
                             items_in, proposed)


class ShopExpert:
    """The cold-start teacher. It never peeks at the task: every decision is re-derived from the messages
    (what the user said, what the tools returned), so its dialogues are ones a model could produce.
    Its phrasing is fixed and short because a tiny model imitates it.

    `skip_confirm`: the probability that, in this conversation, it writes without asking first (a coin drawn once
    from `seed`): an imperfect teacher, as LLM-written demonstrations are. Such a conversation breaks the policy's
    confirmation rule (reward 0) while its database is right whenever the user would not have changed its mind.
    `skip_ask`: likewise, the probability that it never asks what the user wants of a decision (where a refund goes,
    how a new item ships): it names what the user said unasked (a static user's), else nothing, and the write does
    the default (the original payment, standard shipping). Under a policy without the decisions (shop:old) it is 1:
    it never asks and never names one.
    `skip_status`: likewise, the probability that it does not read the order's status before a write: it goes through
    the write's flow (its questions, proposal and yes), and when the tool refuses (a pending order's return, a
    delivered order's cancellation) it transfers, as the policy wants: a slip and its recovery, so that an agent which
    met the refusal knows what follows it (bench/README.md, "The default run's recipe")."""

    def __init__(self, goods: str = "shop", skip_confirm: float = 0.0, skip_ask: float = 0.0, seed: int = 0,
                 skip_status: float = 0.0):
        for name, p in (("skip_confirm", skip_confirm), ("skip_ask", skip_ask), ("skip_status", skip_status)):
            if not 0.0 <= p <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {p}")
        self.goods = GOODS[goods]
        self.skips = random.Random(seed).random() < skip_confirm
        self.skips_ask = random.Random(f"refund-{seed}").random() < skip_ask
        self.skips_status = random.Random(f"status-{seed}").random() < skip_status

    def act(self, messages: list[dict]) -> dict:
        s = _read(messages, self.goods)
        n_calls = sum(len(m.get("tool_calls") or []) for m in messages)

        def call(tool, **args):
            return {"role": "assistant", "content": "", "tool_calls": [{"id": f"call_{n_calls + 1}", "type": "function",
                    "function": {"name": tool, "arguments": json.dumps(args)}}]}

        def say(text):
            return {"role": "assistant", "content": text}

        if s["user"] is None:
            if s["email"] and s["email"] not in s["tried"]:
                return call("find_user", email=s["email"])
            if s["name"] and s["zip"] and (s["name"], s["zip"]) not in s["tried"]:
                return call("find_user", name=s["name"], zip=s["zip"])
            return say("Sure. First, what is your email, or your name and zip code?")
        if s["last_write"]:
            return say("Done. Anything else?")
        action = s["action"]
        if action is None:
            return say("Thanks. How can I help you today?")
        if action == "other":
            return call("transfer_to_human_agents")
        order = s["order"]
        if order is None and s["hint"]:
            order = next((o for o in s["orders"] if s["hint"] in s["fetched"].get(o, {}).get("items", [])), None)
            unfetched = [o for o in s["orders"] if o not in s["fetched"]]
            if order is None and unfetched:
                return call("get_order", order_id=unfetched[0])
        if order is None:
            return say("What is the order id?")
        if order not in s["fetched"]:
            return call("get_order", order_id=order)
        o = s["fetched"][order]
        if o["status"] != self.goods.status["pending" if action == "cancel" else "delivered"] and (
                not self.skips_status or s["refused"]):
            return call("transfer_to_human_agents")
        mine = [x for x in s["mentions"] if x in o["items"]]
        item = mine[-1] if mine and action != "cancel" else None
        news = [x for x in s["mentions"] if item and x not in o["items"] and x.split()[1] == item.split()[1]]
        new = news[-1] if news else None
        if action == "return" and item is None:
            return say("Which item do you want to return?")
        if action == "exchange" and item is None:
            return say("Which item do you want to exchange, and for which color?")
        if action == "exchange" and new is None:
            return say("Which color do you want instead?")
        decision = decision_of(action)
        wanted = s[decision]
        if wanted is None and not self.skips_ask:
            return say(QUESTIONS[decision])
        named = {decision: wanted} if wanted else {}
        said = proposed(decision, wanted) if wanted else ""
        tool, args, text = {
            "cancel": ("cancel_order", {"order_id": order, **named}, f"I will cancel order {order}{said}."),
            "return": ("return_item", {"order_id": order, "item": item, **named},
                       f"I will return the {item} from order {order}{said}."),
            "exchange": ("exchange_item", {"order_id": order, "item": item, "new_item": new, **named},
                         f"I will exchange the {item} for the {new} in order {order}{said}."),
        }[action]
        if (self.skips and not s["wrote"]) or (s["said_yes"] and s["last_agent_text"] == text + CONFIRM):
            return call(tool, **args)
        return say(text + CONFIRM)


# The questions name no option: the user's answer is then the one place near the proposal where its word stands,
# and naming it is a copy (asked "original payment or voucher?", the tiny cold start named either, as if at random).
QUESTIONS = {"refund": "Where should the refund go?", "shipping": "How should the new item ship?"}


def _read(messages: list[dict], goods) -> dict:
    """What the expert knows: identity details, the user's current request, what it wants of the decisions (where a
    refund goes, how a new item ships), and what the tools returned."""
    s = {"email": None, "name": None, "zip": None, "user": None, "orders": [], "fetched": {}, "tried": set(),
         "action": None, "order": None, "hint": None, "mentions": [], "last_write": False, "wrote": False,
         "said_yes": False, "last_agent_text": None, "refund": None, "shipping": None,
         "refused": False}
    calls = {}
    for m in messages:
        role, text = m.get("role"), str(m.get("content") or "")
        s["last_write"] = False
        if role == "user":
            s["said_yes"] = text.lower().startswith("yes")
            if e := re.search(r"[\w.]+@[\w.]+\w", text):
                s["email"] = e.group(0)
            if z := re.search(r"\b\d{5}\b", text):
                s["zip"] = z.group(0)
                if n := re.search(r"\b[A-Z][a-z]+ [A-Z][a-z]+\b", text):
                    s["name"] = n.group(0)
            low = text.lower()
            for action, words in (("cancel", ["cancel"]), ("return", ["return"]), ("exchange", ["exchange"]),
                                  ("other", ["address", "compensation", "card"])):
                if any(w in low for w in words):
                    s["action"] = action
            if h := HINT_RE.search(low):
                s["hint"], s["order"] = h.group(1), None
                low = low.replace(h.group(0), "")
            if ids := ORDER_RE.findall(low):
                s["order"], s["hint"] = ids[-1], None
            s["mentions"] += items_in(low, goods)
            for decision, options in CHOICES.items():
                if (named := choice_named(decision, low)) in options:
                    s[decision] = named
        elif role == "assistant":
            if not m.get("tool_calls"):
                s["last_agent_text"] = text
            for c in m.get("tool_calls") or []:
                f = c.get("function") or {}
                try:
                    args = json.loads(f.get("arguments") or "{}")
                except (TypeError, ValueError):
                    args = {}
                calls[c.get("id")] = f.get("name")
                s["wrote"] = s["wrote"] or f.get("name") in WRITE_TOOLS
                if f.get("name") == "find_user" and isinstance(args, dict):
                    s["tried"].add(args.get("email") or (args.get("name"), args.get("zip")))
        elif role == "tool" and text.startswith("Error"):
            s["refused"] = s["refused"] or calls.get(m.get("tool_call_id")) in WRITE_TOOLS
        elif role == "tool":
            name, result = calls.get(m.get("tool_call_id")), json.loads(text)
            if name == "find_user":
                s["user"], s["orders"] = result["user_id"], result["orders"]
            elif name == "get_order":
                s["fetched"][result["order_id"]] = result
            s["last_write"] = name in WRITE_TOOLS
    return s
