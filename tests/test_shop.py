"""The shop domain: solvable by its expert on every task, a dynamic but deterministic scripted user, a strict
reward (perturbed trajectories get 0), fresh state per episode, tools that never raise."""
import json
import re
import statistics
from collections import Counter

import pytest

from envs import STOP_TOOLS, ToolResult, make_env, play
from envs.shop import ShopEnv
from envs.shop_expert import ShopExpert
from envs import shop_tasks
from envs.shop_tasks import ORDER_RE, SHOP, choice_named, make_task

ITEMS = SHOP.items
from envs.shop_user import ShopUser

AUTH_ASK = "Sure. First, what is your email, or your name and zip code?"


@pytest.fixture(scope="module")
def env():
    return ShopEnv(n_train=500, n_test=100, seed=0)


def episodes(env, split, n=None):
    for task in env.tasks(split)[:n]:
        yield task, play(env, task, env.expert(task))


def replay(env, task, messages):
    """A fresh session with the conversation's tool calls run again, in order."""
    session = env.start(task)
    for m in messages:
        for c in m.get("tool_calls") or []:
            session.call_tool(c["function"]["name"], json.loads(c["function"]["arguments"]))
    return session


def write_call(name, n=99, **args):
    return {"role": "assistant", "content": "",
            "tool_calls": [{"id": f"call_{n}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}]}


def test_expert_solves_every_task(env):
    for split in ("train", "test"):
        solved, kinds, terminations = 0, Counter(), Counter()
        for task, (messages, reward, info, termination) in episodes(env, split):
            assert reward == 1.0, (task.id, info, termination)
            json.dumps(info)
            solved += 1
            kinds[(task.meta["kind"], task.meta["change"])] += 1
            terminations[termination] += 1
        print(f"\n{split}: expert solved {solved}/{len(env.tasks(split))}; terminations {dict(terminations)}")
        print(f"{split} task kinds: {dict(sorted(kinds.items(), key=str))}")
        assert solved == len(env.tasks(split))


def test_dialogue_length(env):
    """Characters the model reads per episode: system prompt + tool schemas + every message (tool calls as
    JSON). With the tiny BPE, tokens are ~chars/3.6."""
    prompt = len(env.system_prompt(None)) + sum(len(json.dumps(t)) for t in env.tools(None))
    lengths, turns = [], []
    for task, (messages, *_rest) in episodes(env, "train", 300):
        body = sum(len(str(m.get("content") or "")) + sum(len(json.dumps(c["function"])) for c in m.get("tool_calls") or [])
                   for m in messages[1:])
        lengths.append(prompt + body)
        turns.append(sum(m["role"] == "assistant" for m in messages))
    lengths.sort()
    print(f"\nprompt (policy + schemas) {prompt} chars; episode total chars: mean {statistics.mean(lengths):.0f}, "
          f"median {lengths[len(lengths) // 2]}, p90 {lengths[int(0.9 * len(lengths))]}, max {lengths[-1]}; "
          f"agent turns mean {statistics.mean(turns):.1f}, max {max(turns)}")
    assert lengths[-1] < 5000


def test_splits_disjoint_and_generator_deterministic(env):
    train = {t.meta["seed"] for t in env.tasks("train")}
    test = {t.meta["seed"] for t in env.tasks("test")}
    assert len(train) == 500 and len(test) == 100 and not train & test
    again = ShopEnv(n_train=20, n_test=5, seed=0)
    for a, b in zip(env.tasks("train")[:20] + env.tasks("test")[:5], again.tasks("train") + again.tasks("test")):
        assert (a.id, a.user_scenario, json.dumps(a.data, sort_keys=True)) == (b.id, b.user_scenario, json.dumps(b.data, sort_keys=True))
    other = ShopEnv(n_train=20, n_test=0, seed=1)
    assert [t.data for t in other.tasks("train")] != [t.data for t in again.tasks("train")]
    with pytest.raises(ValueError, match="train"):
        env.tasks("dev")
    assert make_env("shop", n_train=3, n_test=1).tasks("test")[0].data == make_task("test", 0).data
    assert env.user_tools(env.tasks("train")[0]) == []
    assert ShopEnv(n_train=1, n_test=0).corpus(5) == ShopEnv(n_train=2, n_test=0).corpus(5)


def test_episodes_are_deterministic(env):
    for task in env.tasks("train")[:30]:
        assert play(env, task, env.expert(task)) == play(env, task, env.expert(task))
        user = env.scripted_user(task)
        assert user.opening() == ShopUser(task).opening()


def test_user_withholds_details_until_asked(env):
    for task in env.tasks("train")[:200]:
        d, user = task.data, env.scripted_user(task)
        u = d["db"]["users"][d["user_id"]]
        secrets = [u["email"], u["zip"], *d["db"]["orders"]] + ITEMS
        opening = user.opening()
        assert not any(s in opening for s in secrets) and not re.search(r"cancel|return|exchange", opening)
        start = [{"role": "system", "content": ""}, {"role": "user", "content": opening}]
        vague = user.reply(start + [{"role": "assistant", "content": "How can I help you today?"}])
        assert not any(s in vague for s in secrets), vague  # the kind of request only
        ident = user.reply(start + [{"role": "assistant", "content": AUTH_ASK}])
        assert (u["email"] in ident) == d["knows_email"] and (u["zip"] in ident) != d["knows_email"], ident
        assert not ORDER_RE.search(ident) and not any(i in ident for i in ITEMS)
        order = user.reply(start + [{"role": "assistant", "content": "What is the order id?"}])
        assert (d["goal"]["order"] in order) == d["knows_order_id"], order
        assert u["email"] not in order and u["zip"] not in order


def _proposal(want):
    return {"cancel": f"I will cancel order {want['order']}.",
            "return": f"I will return the {want['item']} from order {want['order']}.",
            "exchange": f"I will exchange the {want['item']} for the {want['new']} in order {want['order']}."}[want["action"]] \
        + " Confirm (yes/no)?"


def test_user_changes_its_mind_and_confirms_truthfully(env):
    changed = 0
    for task in env.tasks("train"):
        d, user = task.data, env.scripted_user(task)
        if d["goal"]["action"] == "other" or task.meta["kind"] == "transfer":
            continue
        start = [{"role": "system", "content": ""}, {"role": "user", "content": user.opening()}]
        first = user.reply(start + [{"role": "assistant", "content": _proposal(d["goal"])}])
        if d["change"]:
            changed += 1
            assert not first.lower().startswith("yes") and "###STOP###" not in first
            # later, it says yes to the new request and no (restating it) to the old one
            convo = start + [{"role": "assistant", "content": _proposal(d["goal"])}, {"role": "user", "content": first}]
            assert user.reply(convo + [{"role": "assistant", "content": _proposal(d["change"])}]).startswith("Yes")
            again = user.reply(convo + [{"role": "assistant", "content": _proposal(d["goal"])}])
            assert again.startswith("No.")
            assert (d["change"]["order"] if d["knows_order_id"] else d["change"]["hint"]) in again
        else:
            assert first.startswith("Yes"), first
            wrong = dict(d["goal"], order="o000")
            assert user.reply(start + [{"role": "assistant", "content": _proposal(wrong)}]).startswith("No.")
    assert changed > 50
    print(f"\n{changed} train tasks change their mind")


def test_user_stops_when_done_or_transferred(env):
    task = env.tasks("train")[0]
    user = env.scripted_user(task)
    base = [{"role": "user", "content": user.opening()}]
    assert "###STOP###" in user.reply(base + [{"role": "assistant", "content": "I will transfer you to a human agent."}])
    messages, reward, info, termination = play(env, task, env.expert(task))
    assert messages[-1]["content"].endswith("###STOP###") and termination == "user_stop"
    transfer = next(t for t in env.tasks("train") if t.meta["kind"] == "transfer")
    messages, reward, info, termination = play(env, transfer, env.expert(transfer))
    assert termination == "transfer" and reward == 1.0
    assert messages[-2]["tool_calls"][0]["function"]["name"] in STOP_TOOLS


def test_static_user_says_everything_at_once_and_never_changes_its_mind():
    static = make_env("shop:static", n_train=300, n_test=0)
    dynamic = make_env("shop", n_train=300, n_test=0)
    for task, same in zip(static.tasks("train"), dynamic.tasks("train")):
        assert task.data == same.data  # same tasks, gold and database
        messages, reward, info, termination = play(static, task, static.expert(task))
        assert reward == 1.0, (task.id, info)
        users = [str(m["content"]) for m in messages if m["role"] == "user"]
        u = task.data["db"]["users"][task.data["user_id"]]
        assert (u["email"] if task.data["knows_email"] else u["zip"]) in users[0]
        if task.meta["kind"] != "transfer":
            final = task.data["change"] or task.data["goal"]
            assert final["order"] in users[0] or final["hint"] in users[0], (task.id, users[0])
        assert not any(x.startswith(("No", "Hmm")) for x in users), (task.id, users)
        assert sum(m["role"] == "assistant" for m in messages) <= sum(m["role"] == "assistant" for m in
                                                                    play(dynamic, same, dynamic.expert(same))[0])
    # An LLM user simulator reads the scenario: the static one says everything at once and never changes its mind.
    changing = next(t for t in static.tasks("train") if t.data["change"])
    assert "first message" in changing.user_scenario and "change your mind:" not in changing.user_scenario
    assert "change your mind:" in next(t for t in dynamic.tasks("train") if t.id == changing.id).user_scenario
    with pytest.raises(ValueError, match="user 'lazy'"):
        ShopEnv(n_train=1, n_test=1, user="lazy")


def test_told_user_is_the_dynamic_user_who_says_its_wish_unasked():
    """shop:told: the dynamic user's opening and answers, with what it wants of its request's decision added to
    every message that says what it wants done; the expert then never asks and scores 1, in no more turns."""
    told = make_env("shop:told", n_train=200, n_test=0)
    dynamic = make_env("shop", n_train=200, n_test=0)
    for task, same in zip(told.tasks("train"), dynamic.tasks("train")):
        assert task.data == same.data
        messages, reward, info, _ = play(told, task, told.expert(task))
        assert reward == 1.0, (task.id, info)
        ref = play(dynamic, same, dynamic.expert(same))[0]
        users, theirs = [m["content"] for m in messages if m["role"] == "user"], [m["content"] for m in ref
                                                                                   if m["role"] == "user"]
        assert users[0] == theirs[0]  # the same vague opening
        decision = task.meta["decision"]
        asked = [m["content"] for m in messages if m["role"] == "assistant" and m["content"] and
                 shop_tasks.is_question(decision, m["content"].lower())] if decision else []
        assert not asked, (task.id, asked)  # nothing left to ask
        if decision and task.meta["kind"] != "transfer":
            wish = {"refund": "refund it", "shipping": "send the new one", None: ""}[
                shop_tasks.decision_of(task.data["goal"]["action"])]  # (its first request, before any change)
            first = next(u for u in users if any(w in u.lower() for w in ("cancel", "return", "exchange")))
            assert wish in first, (task.id, first)  # said with its first request, unasked
        assert len(messages) <= len(ref)
    changing = next(t for t in told.tasks("train") if t.data["change"])
    assert "unasked" in changing.user_scenario and "change your mind:" in changing.user_scenario


def test_imperfect_teacher_skips_confirmation_in_a_share_of_conversations(env):
    """`expert(task, skip_confirm=p)`: in about p of the write tasks it writes without asking (reward 0, the
    database right unless the user would have changed its mind), the user then ends the conversation at once, and
    every other conversation is the perfect expert's, message for message."""
    counts = Counter()
    for task in env.tasks("train")[:300]:
        teacher = env.expert(task, skip_confirm=0.5)
        messages, reward, info, termination = play(env, task, teacher)
        if task.meta["kind"] == "transfer" or not teacher.skips:
            assert (messages, reward) == play(env, task, env.expert(task))[:2], task.id
            counts["same"] += 1
            continue
        counts["skipped"] += 1
        assert reward == 0.0 and len(info["unconfirmed_writes"]) == 1 and termination == "user_stop", (task.id, info)
        assert not any("yes/no" in str(m.get("content")) for m in messages)
        assert messages[-2]["content"] == "Done. Anything else?" and messages[-1]["content"].endswith("###STOP###")
        assert info["db_match"] == (task.meta["change"] is None), task.id
    writes = sum(t.meta["kind"] != "transfer" for t in env.tasks("train")[:300])
    assert 0.4 < counts["skipped"] / writes < 0.6, counts
    with pytest.raises(ValueError, match="skip_confirm"):
        env.expert(env.tasks("train")[0], skip_confirm=1.5)


def test_imperfect_teacher_writes_before_the_status_and_transfers_when_refused(env):
    """`expert(task, skip_status=p)`: in about p of the transfers a wrong status forces (a pending order's return, a
    delivered order's cancellation), the teacher goes through the write's flow, is refused by the tool and then
    transfers (reward 1: a refused write changes nothing); every other conversation is the perfect expert's."""
    counts = Counter()
    for task in env.tasks("train")[:600]:
        teacher = env.expert(task, skip_status=0.5)
        messages, reward, info, termination = play(env, task, teacher)
        if task.meta["topic"] not in ("return_pending", "cancel_delivered") or not teacher.skips_status:
            assert (messages, reward) == play(env, task, env.expert(task))[:2], task.id
            continue
        counts["slipped"] += 1
        assert reward == 1.0 and termination == "transfer", (task.id, info)
        refused = [i for i, m in enumerate(messages) if m["role"] == "tool" and m["content"].startswith("Error")]
        assert len(refused) == 1 and "only" in messages[refused[0]]["content"], task.id
        proposal, answer = messages[refused[0] - 3]["content"], messages[refused[0] - 2]["content"]
        assert "yes/no" in str(proposal) and answer.startswith("Yes"), task.id
        assert [c["function"]["name"] for c in messages[refused[0] + 1]["tool_calls"]] == ["transfer_to_human_agents"]
    wrong = sum(t.meta["topic"] in ("return_pending", "cancel_delivered") for t in env.tasks("train")[:600])
    assert wrong >= 30 and 0.3 < counts["slipped"] / wrong < 0.7, (counts, wrong)
    with pytest.raises(ValueError, match="skip_status"):
        env.expert(env.tasks("train")[0], skip_status=-0.1)


def test_cold_start_with_an_imperfect_teacher_keeps_what_has_the_right_database():
    from plumbing import coldstart
    import sft
    from envs.shop import gold_db, unconfirmed_writes

    kept = coldstart.make_cold_start(sft.SFTConfig(env="shop", num_tasks=60, teacher_skips_confirm=0.5))
    env = make_env("shop")
    tasks = {t.id: t for t in env.tasks("train")}
    unasked = [c for c in kept if unconfirmed_writes(c["messages"])]
    assert 0 < len(unasked) < len(kept) < 60  # the skips whose user would have changed its mind are dropped
    for c in kept:
        assert replay(env, tasks[c["task_id"]], c["messages"]).db == gold_db(tasks[c["task_id"]]), c["task_id"]
    with pytest.raises(SystemExit, match=r"--teacher-skips-confirm 1.5: must be in \[0, 1\]"):
        coldstart.make_cold_start(sft.SFTConfig(env="shop", num_tasks=1, teacher_skips_confirm=1.5))
    with pytest.raises(SystemExit, match="--teacher-skips-confirm 0.5: only the scripted expert"):
        coldstart.make_cold_start(sft.SFTConfig(env="shop", teacher="gpt-4o", teacher_skips_confirm=0.5))


class SkipConfirmation:
    """The expert, except that it writes where it would ask for confirmation."""

    def __init__(self):
        self.expert = ShopExpert()

    def act(self, messages):
        m = self.expert.act(messages)
        text = m.get("content") or ""
        refund = {"refund": r} if (r := choice_named("refund", text)) else {}
        shipping = {"shipping": r} if (r := choice_named("shipping", text)) else {}
        if cancel := re.match(r"I will cancel order (o\d+)[ .]", text):
            return write_call("cancel_order", order_id=cancel.group(1), **refund)
        if ret := re.match(r"I will return the (\w+ \w+) from order (o\d+)[ .]", text):
            return write_call("return_item", order_id=ret.group(2), item=ret.group(1), **refund)
        if ex := re.match(r"I will exchange the (\w+ \w+) for the (\w+ \w+) in order (o\d+)[ .]", text):
            return write_call("exchange_item", order_id=ex.group(3), item=ex.group(1), new_item=ex.group(2), **shipping)
        return m


class NoAction:
    """The expert, except that it claims success instead of writing."""

    def __init__(self):
        self.expert = ShopExpert()

    def act(self, messages):
        m = self.expert.act(messages)
        if any(c["function"]["name"] in ("cancel_order", "return_item", "exchange_item") for c in m.get("tool_calls") or []):
            return {"role": "assistant", "content": "Done. Anything else?"}
        return m


def test_perturbed_trajectories_get_zero(env):
    writes = [t for t in env.tasks("train")[:150] if t.meta["kind"] != "transfer"]
    for task in writes:
        _, reward, info, _ = play(env, task, SkipConfirmation())
        assert reward == 0.0 and info["unconfirmed_writes"], (task.id, info)
        _, reward, info, _ = play(env, task, NoAction())
        assert reward == 0.0 and not info["db_match"], (task.id, info)
    for task, (messages, reward, info, _) in episodes(env, "train", 150):
        assert replay(env, task, messages).reward(messages)[0] == 1.0
        # one write too many (confirmed, even) or a transfer nobody needed
        d = task.data
        others = [o for o in d["db"]["users"][d["user_id"]]["orders"] if d["db"]["orders"][o]["status"] == "pending"
                  and o != (d["change"] or d["goal"])["order"]]
        if others:
            extra = messages + [{"role": "user", "content": "Yes."}, write_call("cancel_order", order_id=others[0])]
            session = replay(env, task, extra)
            reward, info = session.reward(extra)
            assert reward == 0.0 and info["differ"] == [f"orders.{others[0]}"], info
        if task.meta["kind"] != "transfer":
            extra = messages + [write_call("transfer_to_human_agents")]
            reward, info = replay(env, task, extra).reward(extra)
            assert reward == 0.0 and info["differ"] == ["transfers"], info


def test_wrong_order_cancelled_gets_zero(env):
    n = 0
    for task in env.tasks("train"):
        d = task.data
        want = d["change"] or d["goal"]
        if want["action"] != "cancel" or task.meta["kind"] == "transfer":
            continue
        wrong = [o for o in d["db"]["users"][d["user_id"]]["orders"] if o != want["order"] and d["db"]["orders"][o]["status"] == "pending"]
        if not wrong:
            continue
        n += 1
        user = env.scripted_user(task)
        u = d["db"]["users"][d["user_id"]]
        messages = [{"role": "user", "content": user.opening()},
                    write_call("find_user", 1, email=u["email"]),
                    {"role": "assistant", "content": f"I will cancel order {wrong[0]}. Confirm (yes/no)?"}]
        answer = user.reply(messages)
        assert not answer.startswith("Yes")
        messages += [{"role": "user", "content": "Yes."}, write_call("cancel_order", 2, order_id=wrong[0])]
        reward, info = replay(env, task, messages).reward(messages)
        assert reward == 0.0 and f"orders.{wrong[0]}" in info["differ"] and f"orders.{want['order']}" in info["differ"]
    assert n > 10


def test_fresh_state_per_episode(env):
    task = next(t for t in env.tasks("train") if t.meta["kind"] == "cancel")
    before = json.dumps(task.data["db"], sort_keys=True)
    a, b = env.start(task), env.start(task)
    u = task.data["db"]["users"][task.data["user_id"]]
    assert not a.call_tool("find_user", {"email": u["email"]}).error
    assert not a.call_tool("cancel_order", {"order_id": task.data["goal"]["order"]}).error
    assert a.db != b.db and json.dumps(task.data["db"], sort_keys=True) == before
    assert b.call_tool("get_order", {"order_id": task.data["goal"]["order"]}).error  # b has not authenticated
    assert env.start(task).reward([])[0] == 0.0
    # a whole group of episodes of one task: identical rewards, nothing carried over
    assert {play(env, task, env.expert(task))[1] for _ in range(4)} == {1.0}


def test_tool_errors_never_raise(env):
    task = next(t for t in env.tasks("train") if t.meta["kind"] == "return")
    d = task.data
    u = d["db"]["users"][d["user_id"]]
    order, item = d["goal"]["order"], d["goal"]["item"]
    other_user_order = next(o for o, v in d["db"]["orders"].items() if v["user_id"] != d["user_id"])
    s = env.start(task)
    bad = [("nope", {}), ("get_order", {"order_id": order}),  # before authenticating
           ("find_user", "not a dict"), ("find_user", {}), ("find_user", {"email": 3}),
           ("find_user", {"name": u["name"]}), ("find_user", {"email": "x@y.z"}),
           ("find_user", {"name": u["name"], "zip": "00000"}), ("find_user", {"email": u["email"], "zip": u["zip"]})]
    after_login = [("get_order", {"order_id": "o000"}), ("get_order", {"order_id": other_user_order}),
                   ("get_order", {"order_id": None}), ("get_order", {"order_id": order, "extra": "1"}),
                   ("cancel_order", {"order_id": order}),  # delivered
                   ("return_item", {"order_id": order, "item": "gold watch"}),
                   ("exchange_item", {"order_id": order, "item": item, "new_item": item}),
                   ("exchange_item", {"order_id": order, "item": item, "new_item": "purple " + item.split()[1]}),
                   ("exchange_item", {"order_id": order, "item": item, "new_item": "red unicorn"}),
                   ("exchange_item", {"order_id": order, "item": item, "new_item": ""}),
                   ("transfer_to_human_agents", {"summary": "x"})]
    for name, args in bad:
        r = s.call_tool(name, args)
        assert isinstance(r, ToolResult) and r.error and r.content.startswith("Error"), (name, args, r)
    assert not s.call_tool("find_user", {"name": u["name"].upper(), "zip": u["zip"]}).error
    for name, args in after_login:
        r = s.call_tool(name, args)
        assert r.error and r.content.startswith("Error"), (name, args, r)
    assert s.db == d["db"]  # no failed call wrote anything
    assert not s.call_tool("return_item", {"order_id": order, "item": item}).error
    assert s.call_tool("return_item", {"order_id": order, "item": item}).error  # not twice

    class Garbage:
        def act(self, messages):
            return {"role": "assistant", "content": "", "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_order", "arguments": "{not json"}}]}

    messages, reward, info, termination = play(env, task, Garbage(), max_turns=3)
    assert termination == "max_turns" and reward == 0.0 and messages[-1]["content"].startswith("Error")


def _scores(env, agent_of) -> dict:
    """{task id: reward} of the agent `agent_of(env, task)` on the environment's test tasks."""
    return {t.id: play(env, t, agent_of(env, t))[1] for t in env.tasks("test")}


SAYS = {"voucher": " Please refund it as a voucher.", "original": " Please refund it to my original payment.",
        "express": " Please send the new one with express shipping.",
        "standard": " Please send the new one with standard shipping."}


class Guess:
    """The expert that never asks: it proposes the non-default of the task's decision (a voucher, express shipping),
    as if the user had said so in its opening, and, if `flip`, the default once a proposal of its guess was refused
    and the conversation went on (guess and flip)."""

    def __init__(self, env, task, flip=True):
        self.expert, self.flip = env.expert(task, skip_ask=1.0), flip

    def act(self, messages):
        refused = self.flip and any(m["role"] == "user" and m["content"].startswith("No") and
                                    re.search("voucher|express", messages[i - 1].get("content") or "")
                                    for i, m in enumerate(messages))
        said = (SAYS["original"] + SAYS["standard"]) if refused else (SAYS["voucher"] + SAYS["express"])
        first = next(i for i, m in enumerate(messages) if m["role"] == "user")
        told = [dict(m, content=m["content"] + said) if i == first else m for i, m in enumerate(messages)]
        return self.expert.act(told)


class Slip:
    """The expert with one mistake: `where` "proposal" (its first proposal names another of the user's orders, and
    it goes on as the expert once corrected) or "write" (its first write names another order)."""

    def __init__(self, env, task, where):
        self.expert, self.where, self.task, self.done = env.expert(task), where, task, False

    def other(self, order):
        d = self.task.data
        return next(o for o in d["db"]["users"][d["user_id"]]["orders"] + sorted(d["db"]["orders"]) if o != order)

    def act(self, messages):
        m = self.expert.act(messages)
        if self.done:
            return m
        text = m.get("content") or ""
        if self.where == "proposal" and "yes/no" in text:
            self.done = True
            order = ORDER_RE.findall(text)[0]
            return dict(m, content=text.replace(order, self.other(order)))
        calls = m.get("tool_calls") or []
        if self.where == "write" and calls and calls[0]["function"]["name"] in ("cancel_order", "return_item",
                                                                                 "exchange_item"):
            self.done = True
            args = json.loads(calls[0]["function"]["arguments"])
            args["order_id"] = self.other(args["order_id"])
            return write_call(calls[0]["function"]["name"], **args)
        return m


def test_reward_table_of_single_mistakes_against_every_user():
    """The decisions only a user who answers what it is asked can teach (envs/shop_tasks.py). Scripted agents that
    make one kind of mistake each, on 300 test tasks:
    - the expert, which asks, scores 1 with every user;
    - never asking (it names what it was told, else nothing, and the write does the default) loses only with the
      dynamic user (the told user says it unasked), exactly the decision tasks whose user wants the non-default (about half of them);
    - guessing the non-default and flipping when refused is no better than not asking (the strict user ends the
      conversation at a proposal it does not want: no "No." gives the answer away);
    - skipping the yes, or a slip in the write after it, loses every write task with every user (the positive
      control); one slip in a proposal, corrected, costs nothing with a dynamic, static or told user;
    - the replay of the cold-start teacher's conversations rewards not asking over asking;
    - with every user wanting the default (":default", the negative control) not asking costs nothing."""
    envs = {u: make_env(f"shop:{u}", n_train=0, n_test=300) for u in ("dynamic", "static", "told", "replay")}
    tasks = envs["dynamic"].tasks("test")
    wants = {t.id: t.meta["wants"] for t in tasks}
    writes = {t.id for t in tasks if t.meta["kind"] != "transfer"}
    table = {}
    for user, env in envs.items():
        assert all(r == 1.0 for r in _scores(env, lambda e, t: e.expert(t)).values()), user
        table[user, "not asking"] = _scores(env, lambda e, t: e.expert(t, skip_ask=1.0))
        table[user, "no yes"] = _scores(env, lambda e, t: e.expert(t, skip_confirm=1.0))
        table[user, "write slip"] = _scores(env, lambda e, t: Slip(e, t, "write"))
        if user != "replay":
            table[user, "proposal slip"] = _scores(env, lambda e, t: Slip(e, t, "proposal"))
    table["dynamic", "guess and flip"] = _scores(envs["dynamic"], lambda e, t: Guess(e, t))
    table["dynamic", "guess"] = _scores(envs["dynamic"], lambda e, t: Guess(e, t, flip=False))
    on = lambda name, ids: sum(table[name][i] for i in ids) / len(ids)  # noqa: E731
    decided = [i for i, w in wants.items() if w]
    print("\n" + "\n".join(f"{u:8} {m:15} all {on((u, m), list(wants)):.3f} decision tasks {on((u, m), decided):.3f}"
                           for u, m in table))
    assert {i for i, r in table["dynamic", "not asking"].items() if r != 1.0} == {
        i for i, w in wants.items() if w == "non-default"}
    assert 0.4 < on(("dynamic", "not asking"), decided) < 0.6 and len(decided) > 200
    assert all(r == 1.0 for u in ("static", "told", "replay") for r in table[u, "not asking"].values())
    # The flip never helps (on a change of mind the user's "No, wait." is about the request, not the guess).
    steady = [t.id for t in tasks if not t.data["change"]]
    assert [table["dynamic", "guess and flip"][i] for i in steady] == [table["dynamic", "guess"][i] for i in steady]
    assert abs(on(("dynamic", "guess and flip"), decided) - on(("dynamic", "not asking"), decided)) < 0.1
    assert abs(on(("dynamic", "guess"), decided) - on(("dynamic", "not asking"), decided)) < 0.1
    for mistake in ("no yes", "write slip"):  # every user: the same loss, task for task, every write task
        assert table["dynamic", mistake] == table["static", mistake] == table["told", mistake] == \
            table["replay", mistake], mistake
        assert all(table["dynamic", mistake][i] == 0.0 for i in writes), mistake
    assert all(r == 1.0 for u in ("dynamic", "static", "told") for r in table[u, "proposal slip"].values())
    # The replay of the cold-start teacher's own conversations (the paper's static data) does not reward asking: its
    # turns follow a teacher that asks in 30% of them, so an agent that asks falls out of step more often.
    teacher = make_env("shop:teacher", n_train=0, n_test=300)
    asks = _scores(teacher, lambda e, t: e.expert(t))
    quiet = _scores(teacher, lambda e, t: e.expert(t, skip_ask=1.0))
    print(f"teacher  asks {sum(asks[i] for i in decided) / len(decided):.3f}, never asks "
          f"{sum(quiet[i] for i in decided) / len(decided):.3f} on the decision tasks")
    assert sum(asks[i] for i in decided) < sum(quiet[i] for i in decided)
    control = make_env("shop:dynamic:default", n_train=0, n_test=300)
    assert {t.meta["wants"] for t in control.tasks("test")} <= {"default", None}
    assert all(r == 1.0 for r in _scores(control, lambda e, t: e.expert(t, skip_ask=1.0)).values())


def test_dynamic_user_says_what_it_wants_only_when_asked_and_ends_at_a_proposal_it_does_not_want():
    env = make_env("shop", n_train=0, n_test=300)
    seen = Counter()
    for task in env.tasks("test"):
        messages = play(env, task, env.expert(task, skip_ask=1.0))[0]
        decision, d = task.meta["decision"], task.data
        if not decision:
            continue
        for m in messages:
            if m["role"] == "user":
                assert not re.search(r"voucher|original|refund|express|standard|ship", m["content"]), (task.id, m)
        if task.data["change"]:
            continue
        seen[decision] += 1
        user = env.scripted_user(task)
        start = [{"role": "user", "content": user.opening()}]
        question = {"refund": "Where should the refund go?", "shipping": "How should the new item ship?"}
        for asked, q in question.items():
            answer = user.reply(start + [{"role": "assistant", "content": q}])
            assert (d[asked] in answer.lower()) == (asked == decision), (task.id, q, answer)
        # a proposal that names what the user does not want, or both options, ends the conversation
        right = _proposal(d["goal"])
        other = {"voucher": " and refund it to your original payment", "original": " and refund it as a voucher",
                 "express": " with standard shipping", "standard": " with express shipping"}[d[decision]]
        both = {"refund": " and refund it as a voucher or to your original payment",
                "shipping": " with standard or express shipping"}[decision]
        for text in (right.replace(". Confirm", other + ". Confirm"), right.replace(". Confirm", both + ". Confirm")):
            no = user.reply(start + [{"role": "assistant", "content": text}])
            assert no.startswith("No") and no.endswith("###STOP###"), (task.id, text, no)
            assert not re.search(r"voucher|original|express|standard", no.lower()), (task.id, text, no)
        named = right.replace(". Confirm", {"refund": " and refund it " + ("as a voucher" if d["refund"] == "voucher"
                                                                            else "to your original payment"),
                                            "shipping": f" with {d['shipping']} shipping"}[decision] + ". Confirm")
        assert user.reply(start + [{"role": "assistant", "content": named}]).startswith("Yes"), (task.id, named)
    assert seen["refund"] > 100 and seen["shipping"] > 30, seen


def test_replay_user_plays_the_experts_user_turns_whatever_the_agent_says():
    replay, dynamic = make_env("shop:replay", n_train=0, n_test=40), make_env("shop", n_train=0, n_test=40)
    for task, same in zip(replay.tasks("test"), dynamic.tasks("test")):
        assert task.data == same.data and task.meta["user_sim"] == {"scripted": True}
        expert = [m["content"] for m in play(dynamic, same, dynamic.expert(same))[0] if m["role"] == "user"]
        user = replay.scripted_user(task)
        assert user.opening() == expert[0]
        nonsense = [{"role": "user", "content": expert[0]}]
        for k in range(1, len(expert) + 2):  # any text gets the next turn; the last one again once they run out
            nonsense.append({"role": "assistant", "content": f"blah {k}"})
            assert user.reply(nonsense) == expert[min(k, len(expert) - 1)]
            nonsense.append({"role": "user", "content": user.reply(nonsense)})
    with pytest.raises(ValueError, match="'lazy' is not a shop user"):
        make_env("shop:lazy")
    with pytest.raises(ValueError, match="nondefault_share"):
        ShopEnv(n_train=1, n_test=1, nondefault_share=2.0)
    with pytest.raises(ValueError, match="'hardest' is not a shop user .* one of default, old, hard, name-zip, hints"):
        make_env("shop:hardest")


def test_sibling_stores_share_the_api_but_not_the_goods_statuses_or_policy():
    shop, garden, sport = (make_env(n, n_train=50, n_test=0) for n in ("shop", "shop:garden", "shop:sport"))
    assert shop.tools(None) == garden.tools(None) == sport.tools(None)
    prompts = {e.system_prompt(None) for e in (shop, garden, sport)}
    assert len(prompts) == 3
    shop_words = set(SHOP.items) | {"pending", "delivered"}
    for env in (garden, sport):
        for task in env.tasks("train"):
            messages, reward, _, _ = play(env, task, env.expert(task))
            assert reward == 1.0, task.id
            text = json.dumps(messages) + json.dumps(task.data)
            assert not any(re.search(rf"\b{w}\b", text) for w in shop_words), task.id


def test_the_committed_base_is_the_default_settings_own_and_reads_every_store():
    """assets/tiny-base (sft.COMMITTED_BASE) is what `--model tiny` starts from with the default settings: made with
    them, from the old stores (sft.BASE_STORES), and its tokenizer still makes every identifier of every store one token and renders
    the current tool template. Rebuild it with `./run python sft.py --pretrain-only --base-out assets/tiny-base
    --overwrite` when one of these fails."""
    import sft
    from plumbing.models import load_tokenizer
    from envs.shop_tasks import id_tokens
    from toolcall import TOOL_CHAT_TEMPLATE

    saved = json.loads((sft.COMMITTED_BASE / "muarl_config.json").read_text())
    assert saved["pretrain"]["settings"] == sft.base_settings(sft.SFTConfig())
    assert sft.pretrain_tiny(sft.SFTConfig()) == sft.COMMITTED_BASE
    tok = load_tokenizer(str(sft.COMMITTED_BASE))
    assert tok.chat_template == TOOL_CHAT_TEMPLATE
    for word in id_tokens():
        assert len(tok(word, add_special_tokens=False)["input_ids"]) == 1, word
    # items are their color and product, words of their own (a one-token item was never copied: envs.id_tokens)
    assert tok.tokenize("the black bag") == tok.tokenize("the black") + tok.tokenize(" bag")


def test_the_committed_cold_start_is_grpo_defaults_own(tmp_path, monkeypatch):
    """assets/tiny-cold (sft.COMMITTED_COLD) is what `accelerate launch grpo.py` starts from: its recorded settings
    and the digest of its very conversations are those grpo.py's defaults make today (the teacher's 1,600 tasks,
    replayed in a few seconds), on the committed base, with the base's tokenizer. Rebuild it with `./run python sft.py
    --cold-start-out assets/tiny-cold --overwrite --teacher-skips-confirm C --teacher-skips-ask A
    --teacher-skips-status S` (C, A, S: grpo.py's --cold-start-skips-*; 30-40 min here) when this fails: the domain's
    conversations changed since it was made."""
    import grpo
    import sft
    from plumbing import models

    monkeypatch.setattr(models, "CACHE_DIR", tmp_path / "unwritable-and-unused")  # nothing is made or cached
    monkeypatch.setattr(models, "check_cache", lambda program: pytest.fail("the committed cold start was not used"))
    cfg = grpo.Config()
    assert sft.cold_start("tiny", cfg.env, cfg.split, cfg.seed, cfg.bf16, cfg.cold_start_skips_confirm,
                          cfg.cold_start_skips_ask, cfg.cold_start_skips_status) == str(sft.COMMITTED_COLD)
    for name in ("tokenizer.json", "chat_template.jinja"):
        assert (sft.COMMITTED_COLD / name).read_bytes() == (sft.COMMITTED_BASE / name).read_bytes()


def test_the_procedure_knobs_and_the_old_policy():
    """The default procedure is the reachable one (every user knows its email and order id, few changes of mind,
    fewer exchanges); ":hard" is the domain as the refund ablation met it, drawn from the same draws, and ":name-zip"
    and ":hints" bring back one difficulty each. ":old" is shop before the decisions (the tiny base's): its policy
    says nothing of them and the expert never asks; with ":default" (every user wants the defaults) it still solves
    every task."""
    from envs.shop_tasks import HARD, Procedure

    def shares(name):
        tasks = make_env(name, n_train=400, n_test=0).tasks("train")
        writes = [t for t in tasks if t.meta["kind"] != "transfer"]
        return {"email": sum(t.data["knows_email"] for t in tasks) / len(tasks),
                "order id": sum(t.data["knows_order_id"] for t in tasks) / len(tasks),
                "change": sum(bool(t.data["change"]) for t in writes) / len(writes),
                "exchange": sum(t.meta["kind"] == "exchange" for t in tasks) / len(tasks)}

    easy, hard = shares("shop"), shares("shop:hard")
    assert easy["email"] == easy["order id"] == 1.0 and 0.08 < easy["change"] < 0.22 and easy["exchange"] < 0.27
    assert 0.5 < hard["email"] < 0.7 and 0.5 < hard["order id"] < 0.7 and 0.32 < hard["change"] < 0.48
    assert hard["exchange"] > easy["exchange"]
    name_zip, hints = shares("shop:name-zip"), shares("shop:hints")
    assert 0.5 < name_zip["email"] < 0.7 and name_zip["order id"] == 1.0 and name_zip["change"] == easy["change"]
    assert 0.5 < hints["order id"] < 0.7 and hints["email"] == 1.0
    assert make_env("shop:hard", n_train=0, n_test=3).tasks("test")[1].data == make_task("test", 1, procedure=HARD).data
    assert Procedure() != HARD
    old, new = make_env("shop:old:default", n_train=100, n_test=0), make_env("shop", n_train=100, n_test=0)
    assert "refund" in new.system_prompt(None) and "ship" in new.system_prompt(None)
    assert "refund" not in old.system_prompt(None) and "ship" not in old.system_prompt(None)
    assert old.system_prompt(None).replace("\n", "") in new.system_prompt(None).replace("\n", "") or all(
        line in new.system_prompt(None).splitlines() for line in old.system_prompt(None).splitlines())
    for task in old.tasks("train"):
        assert task.data["refund"] == "original" and task.data["shipping"] == "standard"
        messages, reward, info, _ = play(old, task, old.expert(task))
        assert reward == 1.0 and not info.get("asked"), task.id
        assert not any(re.search("refund|ship|voucher|express", str(m.get("content"))) for m in messages
                       if m["role"] == "assistant"), task.id
    # The siblings' static users say their wishes unasked, and the expert that never asks still honours them: the
    # base learns to copy a wish it hears, never to ask for one.
    static = make_env("shop:garden:static:old", n_train=100, n_test=0)
    named = 0
    for task in static.tasks("train"):
        messages, reward, info, _ = play(static, task, static.expert(task))
        assert reward == 1.0 and not info.get("asked"), task.id
        named += any(re.search(r"\((refund|shipping): (voucher|express)\)", str(m.get("content"))) for m in messages)
    assert named > 25


def test_a_wish_drill_names_in_the_proposal_and_the_write_what_the_user_said():
    """The base's drills (sft.pretrain_tiny) under the old policy: a window that ends in a proposal, or in the write
    the proposal led to, gets a wish in the user message before the proposal, and the proposal and the write carry
    exactly that word; other windows are left alone."""
    import random
    from plumbing.coldstart import windows
    from envs.shop_tasks import WISH_WORDS, with_wish

    env = make_env("shop:old:default", n_train=40, n_test=0)
    rng, seen = random.Random(0), Counter()
    for task in env.tasks("train"):
        conv = {"messages": play(env, task, env.expert(task))[0], "task_id": task.id}
        for window in windows([conv]):
            wished = with_wish(window, rng)
            last = window["messages"][-1]
            if wished is None:
                assert not re.match(r"I will (cancel|return|exchange)", str(last.get("content") or ""))
                continue
            word = re.search(r"(?:Refund it to|Ship it) (\w+), please\.", json.dumps(wished["messages"])).group(1)
            assert word in WISH_WORDS + ["original", "voucher", "standard", "express"]
            texts = [str(m.get("content") or "") for m in wished["messages"]]
            assert sum(f": {word}). Confirm (yes/no)?" in t for t in texts) == 1
            if wished["messages"][-1].get("tool_calls"):
                args = json.loads(wished["messages"][-1]["tool_calls"][0]["function"]["arguments"])
                assert word in args.values()
                seen["write"] += 1
            else:
                seen["proposal"] += 1
            assert window["messages"][-1] is last and "please." not in json.dumps(window["messages"][-1])
    assert seen["write"] > 10 and seen["proposal"] > 10, seen
