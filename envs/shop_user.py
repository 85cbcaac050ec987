"""The shop domain's scripted users (the rule-based counterparts of an LLM user simulator; envs/shop_tasks.py holds
the instructions an LLM user gets, `scenario`): dynamic and static (ShopUser), and replayed (ReplayUser). Their own
file, as the expert has (envs/shop_expert.py): players of the domain rather than part of it. They read the domain's
formats from envs/shop_tasks.py; ShopEnv.scripted_user imports them.
"""
from __future__ import annotations

import random

from envs import Task
from envs.shop_tasks import (CHOICES, GOODS, ORDER_RE, OTHER_TOPICS, REFUND_SAID, SHIPPING_SAID, choice_named,
                             decision_of, is_proposal, is_question, items_in)

# Wrong proposals ("I will return the red mug from order o12", when the user wants another item or order) the user
# corrects before giving up. Without a limit, a policy that keeps proposing the same wrong action talked until the
# context cap: such episodes were 40% of the cold start's samples, ~16 turns each, and their repeated proposals
# pushed GRPO's gradient against the confirmation phrasing itself (bench/README.md).
PATIENCE = 2
ANSWERS = {"original": ["To my original payment, please.", "The original payment."],
           "voucher": ["As a voucher, please.", "A voucher, please."],
           "standard": ["Standard is fine.", "Standard shipping, please."],
           "express": ["Express, please.", "Express shipping, please."]}  # what the user wants, when asked


# ---------------------------------------------------------------------------------------------------------
# The scripted user: keyword rules on the agent's last message, replayed from the start each call
# ---------------------------------------------------------------------------------------------------------
class ShopUser:
    """Dynamic like the paper's simulated user: vague opening, details only when asked, an optional change of
    mind at the first confirmation request, truthful yes/no, ###STOP### when done or transferred, when the agent
    says it is done before any yes, or when the agent proposes a wrong action for the third time (it corrects the
    first two). Where a refund goes (how a new item ships) it says only when asked about the refund (shipping); a
    proposal that names neither gets its yes, and the write then does the default; a proposal that names what it
    does not want ends the conversation (strict: a guess costs what not asking costs, and no "No." gives the answer
    away). `static=True` (shop:static): identity, final request and what it wants in the opening, no change of
    mind. `told=True` (shop:told): the dynamic user who says what it wants of its request's decision unasked, in
    every message that says what it wants done: the decision's information without a question, all else the same.

    Stateless: `reply` replays the user's rules over every agent text message of the conversation, so the
    answer depends only on the task and the conversation. Phrasing varies per task and turn (seeded)."""

    def __init__(self, task: Task, static: bool = False, told: bool = False):
        self.d = task.data
        self.user = self.d["db"]["users"][self.d["user_id"]]
        self.static, self.told = static, told
        self.goods = GOODS[self.d["goods"]]

    def _pick(self, options: list[str], turn: int) -> str:
        return random.Random(f"{self.d['seed']}-{turn}").choice(options)

    def opening(self) -> str:
        if self.static:  # who it is and its final request at once; it will not change its mind
            u = self.user
            who = f"My email is {u['email']}." if self.d["knows_email"] else f"I'm {u['name']}, zip code {u['zip']}."
            want = self.d["change"] or self.d["goal"]
            return f"Hi. {who} {self._restate(want)}{self._wish(want)}"
        return self._pick(["Hi, I need help with an order.", "Hello, can you help me with my order?",
                          "Hi there, I have a problem with an order."], 0)

    def reply(self, messages: list[dict]) -> str:
        state = {"changed": False, "accepted": False, "told": False, "wrong": 0}
        text, turn = "", 0
        for m in messages:
            if m.get("role") == "assistant" and not m.get("tool_calls"):
                turn += 1
                text = self._respond(str(m.get("content") or "").lower(), state, turn)
                if self.told and state.pop("stated", False) and not text.endswith("###STOP###"):
                    want = self.d["change"] if state["changed"] else self.d["goal"]
                    wish = self._wish(want)
                    text += wish if wish.strip() and wish.strip().lower() not in text.lower() else ""
        return text

    def _ref(self, want: dict) -> str:
        return f"order {want['order']}" if self.d["knows_order_id"] else f"the order with the {want['hint']}"

    def _wish(self, want: dict) -> str:
        """What the static user wants of its request's decision, said up front ("" when it carries none)."""
        decision = decision_of(want["action"])
        if decision == "refund":
            return f" Please refund it {REFUND_SAID[self.d['refund']].replace('your', 'my')}."
        return f" Please send the new one {SHIPPING_SAID[self.d['shipping']]}." if decision == "shipping" else ""

    def _restate(self, want: dict) -> str:
        ref = self._ref(want)
        return {"cancel": f"I want to cancel {ref}.", "return": f"I want to return the {want['item']} from {ref}.",
                "exchange": f"I want to exchange the {want['item']} for the {want['new']} from {ref}.",
                "other": OTHER_TOPICS.get(want["topic"], "")}[want["action"]]

    def _matches(self, t: str, want: dict) -> bool:
        """Does the agent's proposal `t` name exactly the action the user wants now?"""
        if [a for a in ("cancel", "return", "exchange") if a in t] != [want["action"]]:
            return False
        if set(ORDER_RE.findall(t)) != {want["order"]}:
            return False
        items = items_in(t, self.goods)
        return {"cancel": True, "return": items == [want["item"]],
                "exchange": items == [want["item"], want["new"]]}.get(want["action"], False)

    def _respond(self, t: str, state: dict, turn: int) -> str:
        d, u = self.d, self.user
        want = d["change"] if state["changed"] or (self.static and d["change"]) else d["goal"]
        if state["accepted"]:
            return self._pick(["Thanks, that's all.", "Great, thank you!", "Perfect, thanks."], turn) + " ###STOP###"
        if "transfer" in t or "goodbye" in t:
            return "Okay, thank you. ###STOP###"
        if is_proposal(t):
            no = self._pick(["No, wait.", "No, sorry.", "Hmm, no."], turn)
            if d["change"] and not state["changed"] and not self.static:
                state["changed"] = state["stated"] = True
                c = d["change"]
                return no + " " + {"other_order": f"Actually, please cancel {self._ref(c)} instead.",
                                   "other_item": f"I want to return the {c['item']} instead.",
                                   "to_exchange": f"I'd rather exchange it for the {c['new']}.",
                                   "to_return": "I'd rather just return it."}[d["change_type"]]
            decision = decision_of(want["action"])
            named = choice_named(decision, t) if decision else None
            if named not in (None, d.get(decision)):  # strict: it names what the user does not want (or both)
                return "No, that is not what I want. I will call back later. ###STOP###"
            if self._matches(t, want):  # nothing named: the default, a yes
                state["accepted"] = True
                return self._pick(["Yes, please.", "Yes.", "Yes, go ahead."], turn)
            state["wrong"] += 1
            if state["wrong"] > PATIENCE:
                return "No, that is still wrong. I will call back later. ###STOP###"
            state["stated"] = True
            return "No. " + self._restate(want) + (self._wish(want) if self.static else "")
        if "done" in t:  # the agent says it acted before the user said yes: nothing left to ask for
            return "Oh, okay. Thanks. ###STOP###"
        parts = []
        if "email" in t and d["knows_email"]:
            parts.append(self._pick([f"My email is {u['email']}.", f"It's {u['email']}.",
                                     f"Sure, {u['email']}."], turn))
        elif "email" in t or ("name" in t and "zip" in t):
            sorry = "I don't remember my email. " if "email" in t else ""
            parts.append(sorry + self._pick([f"My name is {u['name']} and my zip is {u['zip']}.",
                                             f"I'm {u['name']}, zip code {u['zip']}."], turn))
        # Answers restate what the user wants ("I want to return an item from order o42"), as people do: every
        # decision of the agent then rests on the last user message, not on one said several turns before, which
        # a ~1M-parameter model trained from scratch does not learn to look back for (README "Status").
        if "order id" in t or "which order" in t:
            ref = f"order {want['order']}" if d["knows_order_id"] else f"the order with the {want['hint']}"
            what = {"cancel": f"I want to cancel {ref}.", "return": f"I want to return an item from {ref}.",
                    "exchange": f"I want to exchange an item from {ref}."}.get(want["action"], f"It is {ref}.")
            parts.append(what if d["knows_order_id"] else "I don't know the order id. " + what)
            state["stated"] = True
        if ("which item" in t or "color" in t) and want["action"] in ("return", "exchange"):
            parts.append(self._restate(want))
            state["stated"] = True
        elif "which item" in t:
            parts.append("I want to cancel the whole order.")
        elif "color" in t:
            parts.append("I don't want another color.")
        for decision in CHOICES:  # asked where the refund goes, or how the new item ships
            if not is_question(decision, t):
                continue
            if decision_of(want["action"]) == decision:  # and what it wants, restated as above
                restated = self._restate(want)
                parts.append(self._pick(ANSWERS[d[decision]], turn) + ("" if restated in parts else " " + restated))
            else:
                parts.append({"refund": "I don't need a refund.", "shipping": "Nothing needs to ship."}[decision])
        if parts:
            return " ".join(parts)
        if not state["told"]:  # the first open question gets only the kind of request, no details
            state["told"] = state["stated"] = True
            if want["action"] == "other":
                return OTHER_TOPICS[want["topic"]]
            return self._pick({"cancel": ["I want to cancel an order.", "I'd like to cancel one of my orders."],
                               "return": ["I want to return something.", "I'd like to return an item."],
                               "exchange": ["I want to exchange an item.", "Can I exchange something I bought?"],
                               }[want["action"]], turn)
        state["stated"] = True
        return self._restate(want)


class ReplayUser:
    """The paper's pre-scripted interaction (shop:replay): the dynamic user's messages from the expert's conversation
    on the task, the opening first and then one per agent text message, in order, whatever the agent says; the last
    one (its ###STOP###) again once they run out."""

    def __init__(self, turns: list[str]):
        self.turns = turns

    def opening(self) -> str:
        return self.turns[0]

    def reply(self, messages: list[dict]) -> str:
        said = sum(m.get("role") == "assistant" and not m.get("tool_calls") for m in messages)
        return self.turns[min(said, len(self.turns) - 1)]
