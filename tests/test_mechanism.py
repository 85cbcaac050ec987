"""The paper's mechanism, as tests: only a user who answers what it is asked makes asking pay, and GRPO with that
user, and only with it, teaches a tiny model to ask (tests/ask_env.py, bench/mechanism.py).

The reward table holds the environment to what the learning test relies on: scripted agents that each play one way,
against every user. The learning test trains the same cold start with each user and measures the held-out asking
rate (sampled, against the dynamic user and the real mix of destinations) before and after."""
import json
import sys
from pathlib import Path

import pytest

from envs import play
from tests import ask_env
from tests.ask_env import heard

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import mechanism  # noqa: E402


def call(to):
    return {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "refund", "arguments": json.dumps({"to": to})}}]}


class Scripted:
    """One way of playing: `first` is the agent's first message (a question, a proposal, or a refund), then it refunds
    to `pick(what the user said)` and says it is done."""

    def __init__(self, first=None, pick=None, twice=False):
        self.first, self.pick, self.twice = first, pick, twice

    def act(self, messages):
        said = " ".join(m["content"] for m in messages if m["role"] == "user")
        made = ask_env.refunds(messages)
        if made and not (self.twice and len(made) == 1):
            return {"role": "assistant", "content": "Done."}
        if made:  # refunds again, to what the user said
            return call(heard(said))
        if self.first and sum(m["role"] == "assistant" for m in messages) == 0:
            return {"role": "assistant", "content": self.first}
        return call(self.pick(said))


AGENTS = {
    "asks and copies": Scripted(ask_env.QUESTION, heard),
    "acts at once (the default)": Scripted(None, heard),
    "guesses voucher, flips if refused": Scripted("Shall I refund it to your voucher?", heard),
    "asks, then writes the default": Scripted(ask_env.QUESTION, lambda said: ask_env.DEFAULT),
    "asks, then writes a slip": Scripted(ask_env.QUESTION,
                                         lambda said: "vouchers" if "voucher" in said else heard(said)),
    "refunds the default, then what it hears": Scripted(None, lambda said: ask_env.DEFAULT, twice=True),
}
USERS = {"dynamic": ask_env.AskEnv, "static": ask_env.AskStaticEnv, "replay": ask_env.AskReplayEnv,
         "control": ask_env.AskControlEnv, "static-control": ask_env.AskStaticControlEnv}


def success(env_class, agent) -> float:
    env = env_class()
    tasks = env.tasks("test")
    return sum(play(env, t, agent, max_turns=6)[1] for t in tasks) / len(tasks)


def test_the_reward_table_of_single_way_agents_against_every_user():
    table = {(a, u): success(e, agent) for a, agent in AGENTS.items() for u, e in USERS.items()}
    for a in AGENTS:
        print(f"{a:42s}", " ".join(f"{u} {table[a, u]:.2f}" for u in USERS))
    ask, act, guess = "asks and copies", "acts at once (the default)", "guesses voucher, flips if refused"
    # the dynamic user alone makes asking pay: asking 1, acting at once half (it loses the other destinations)
    assert table[ask, "dynamic"] == 1.0 and table[act, "dynamic"] == 0.5
    # the static user told it all in the opening: both ways earn everything
    assert table[ask, "static"] == table[act, "static"] == 1.0
    # the teacher's replay answers a question only where the teacher asked (~30%): asking earns less than acting
    asks = sum(t.data["teacher_asks"] for t in ask_env.AskEnv().tasks("test")) / 64
    assert 0.2 <= asks <= 0.45
    assert table[ask, "replay"] < table[act, "replay"] == 0.5
    # the negative control: every user wants the default, so nothing depends on asking
    for u in ("control", "static-control"):
        assert table[ask, u] == table[act, u] == 1.0
    # no leak: naming a destination the user does not want ends the dialogue, so guessing is no better than acting
    assert table[guess, "dynamic"] <= table[act, "dynamic"]
    assert table[guess, "dynamic"] == 0.25  # right only for the voucher quarter
    # the refund must copy what the user said, and once: a slip or a second refund scores 0 where it matters
    assert table["asks, then writes the default", "dynamic"] == 0.5
    assert table["asks, then writes a slip", "dynamic"] == 0.75
    assert table["refunds the default, then what it hears", "dynamic"] == 0.5


def test_the_destination_reaches_the_agent_only_in_the_user_s_text():
    env = ask_env.AskEnv()
    task = next(t for t in env.tasks("train") if t.data["wanted"] != ask_env.DEFAULT)
    seen = env.system_prompt(task) + json.dumps(env.tools(task)) + env.scripted_user(task).opening()
    assert task.data["wanted"] not in seen
    messages, reward, info, _ = play(env, task, AGENTS["asks and copies"], max_turns=6)
    assert reward == 1.0 and info["asked"] and f"To my {task.data['wanted']}." in messages[3]["content"]


@pytest.fixture(scope="module")
def cold(tmp_path_factory):
    out = tmp_path_factory.mktemp("mechanism")
    start = mechanism.cold_start(out / "start", SEED, mechanism.TEST)
    return start, mechanism.measure(start, out / "eval-cold", SEED, mechanism.TEST)


SEED = 0


def test_grpo_with_the_dynamic_user_alone_teaches_asking(cold, tmp_path):
    """The claim in one decision: from a cold start that asks in ~30% of its episodes, GRPO with the dynamic user
    raises the held-out asking rate by at least 0.3 and by at least 0.3 more than GRPO with the static user or with
    every user wanting the default (the negative control, dynamic and static). Those three have nothing to teach
    about asking, but they still move it: a group with one failed episode (a slip in the refund) pushes whatever its
    other episodes did, and Adam makes such rare updates full-sized. Measured over seeds 0-3 at these settings
    (bench/README.md, "The mechanism in one decision"): dynamic +0.51 to +0.68, the static user and the controls
    -0.10 to +0.14 (at twice the learning rate: dynamic +0.61 to +0.74, the controls -0.24 to +0.19); hence the bound
    of 0.2 on those, where a control that learns nothing would stay within sampling noise (~0.05)."""
    start, before = cold
    assert 0.15 <= before["asking"] <= 0.45, f"the cold start should ask ~30% of the time, asks {before['asking']:.2f}"
    after = {}
    for arm in ("dynamic", "static", "control", "static-control"):
        ckpt, _ = mechanism.train(start, arm, tmp_path / arm, SEED, mechanism.TEST)
        after[arm] = mechanism.measure(ckpt, tmp_path / f"eval-{arm}", SEED, mechanism.TEST)
    change = {arm: round(r["asking"] - before["asking"], 3) for arm, r in after.items()}
    print(f"asking {before['asking']:.2f} ->", {a: f"{r['asking']:.2f}" for a, r in after.items()})
    assert change["dynamic"] >= 0.3, f"the dynamic user did not teach asking: {change}"
    for arm in ("static", "control", "static-control"):
        assert change["dynamic"] - change[arm] >= 0.3, f"{arm} taught asking as well as the dynamic user: {change}"
        assert abs(change[arm]) <= 0.2, f"{arm} moved asking although it has nothing to teach about it: {change}"
    # and the asking was put to use: the tasks whose user wants another destination than the default are now won
    assert after["dynamic"]["pass^1_other"] - before["pass^1_other"] >= 0.3, (before, after["dynamic"])
