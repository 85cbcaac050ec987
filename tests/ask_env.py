"""The paper's mechanism in one decision: a refund whose destination only the user knows.

The user wants a refund. Where it goes is the user's: the default (the card it paid with) for half the users, another
destination for the other half (`OTHER`). The agent has one tool, `refund(to)`, and two ways to play:

    ask:     "Where should the refund go?" -> the user answers -> refund(to=<what the user said>) -> "Done."
    act:     refund(to="card") at once (or a guessed destination)                                -> "Done."

The reward is 1 only when the refund went where the user wants. A refund is final (a second one is refused), and a
text message that names a destination the user does not want ends the dialogue ("No." and the stop marker), so
guessing and flipping scores no better than not asking. The destination reaches the agent only in the user's text,
and the refund must copy it.

The users (one environment class each, so that `--env tests.ask_env:<Class>` picks one):
- `AskEnv`, **dynamic**: opens "I want a refund for order N." and says where only when asked (any text of the agent
  before the refund is a question it answers).
- `AskStaticEnv`, **static**: says where in its opening; to a question it says the same again (nothing new).
- `AskReplayEnv`, **a replay of the teacher**: replays the user's side of the cold-start teacher's own conversation
  for the task (the teacher asks in ~30% of them), whatever the agent says: the paper's pre-scripted data.
- `AskControlEnv` / `AskStaticControlEnv`, **the negative control**: every user wants the default, so asking can
  change nothing.

With the dynamic user asking earns 1 and not asking 0.5; with the static user both earn 1; with the replay asking earns
~0.3 (it is answered only where the teacher asked) and not asking 0.5; in the control both earn 1. So GRPO with the
dynamic user alone can teach asking (tests/test_mechanism.py; bench/mechanism.py over seeds).
"""
from __future__ import annotations

import json
import random
import re

from envs import Task, ToolResult

DEFAULT = "card"
OTHER = ("voucher", "bank")  # the destinations other than the default, each wanted by a quarter of the users
QUESTION = "Where should the refund go?"
TEACHER_ASKS = 0.3  # the share of its conversations in which the cold-start teacher asks
TOOLS = [{"type": "function", "function": {
    "name": "refund", "description": "Refund the order to a destination.",
    "parameters": {"type": "object", "properties": {"to": {"type": "string", "description": "where the money goes"}},
                   "required": ["to"]}}}]
SYSTEM = "You refund orders. The refund goes where the user wants."
N_TASKS = {"train": 256, "test": 64}
# Stand-ins for a destination in the cold start's copy drills (bench/mechanism.py): a model that must copy any of
# them learns to copy, where three destinations alone could be told apart without copying anything.
DRILL_WORDS = [f"{a}{b}" for a in ("ko", "ma", "pi", "ru", "se", "ta", "vo", "zu") for b in ("bel", "dor", "fin",
                                                                                          "gar", "lum", "nix")]


def refunds(messages: list[dict]) -> list[str]:
    """The destinations of the agent's refund calls, in order (an unreadable call counts as an empty destination)."""
    out = []
    for m in messages:
        for c in (m.get("tool_calls") or []) if m["role"] == "assistant" else []:
            if c["function"]["name"] == "refund":
                args = c["function"]["arguments"]
                try:
                    out.append(str((json.loads(args) if isinstance(args, str) else args).get("to", "")))
                except (ValueError, AttributeError, TypeError):
                    out.append("")
    return out


def asked(messages: list[dict]) -> bool:
    """Did the agent hand the turn to the user before its first refund (a message without a tool call: a question,
    a proposal, whatever its words, even none)? That is what the user answers."""
    for m in messages:
        if m["role"] == "assistant":
            if any(c["function"]["name"] == "refund" for c in m.get("tool_calls") or []):
                return False
            if not m.get("tool_calls"):
                return True
    return False


def heard(said: str) -> str:
    """What a careful agent refunds to: the destination the user named, else the default."""
    return next((d for d in OTHER if d in said), DEFAULT)


def names_unwanted(text: str, wanted: str) -> bool:
    """Does the agent's text name a destination the user does not want (a whole word: "discard" names none)? Listing
    the options ("card, voucher or bank?") names two unwanted ones: the strict user ends the dialogue at that too."""
    return any(re.search(rf"\b{d}\b", text.lower()) for d in (DEFAULT, *OTHER) if d != wanted)


class _Session:
    def __init__(self, task):
        self.wanted = task.data["wanted"]
        self.done: list[str] = []

    def call_tool(self, name, arguments, requestor="assistant", n_messages=None):
        if name != "refund":
            return ToolResult(f"Error: unknown tool {name}", error=True)
        if self.done:
            return ToolResult("Error: the order was already refunded", error=True)
        to = str(arguments.get("to", "")) if isinstance(arguments, dict) else ""
        self.done.append(to)
        return ToolResult(f"Refunded to {to}.")

    def reward(self, messages):
        # what the database holds: the first refund (a second one is refused), and where it went
        return float(self.done == [self.wanted]), {"asked": asked(messages), "refunds": list(self.done),
                                                   "wanted_default": self.wanted == DEFAULT}


class DynamicUser:
    """Says where the refund goes only when asked; ends the dialogue at a proposal of a destination it does not want."""

    def __init__(self, task):
        self.wanted, self.order = task.data["wanted"], task.data["order"]

    def opening(self):
        return f"I want a refund for order {self.order}."

    def reply(self, messages):
        said = messages[-1].get("content") or ""
        if names_unwanted(said, self.wanted):
            return "No. ###STOP###"
        if refunds(messages):
            return "Thanks. ###STOP###"
        return self.answer()

    def answer(self):
        return f"To my {self.wanted}."


class StaticUser(DynamicUser):
    """Everything in its opening; a question gets nothing new: the opening's words again. (Answered "Please go
    ahead." instead, asking cost the agent a copy from further back, and GRPO with this user drove asking from 0.23 to
    0.02 at seed 0 of bench/mechanism.py: a cost of asking, not the absence of its reward, which is what this user is
    here to show.)"""

    def opening(self):
        return f"I want a refund for order {self.order} to my {self.wanted}."

    def answer(self):
        return f"As I said, to my {self.wanted}."


class ReplayUser:
    """The user's side of the teacher's conversation for this task, replayed whatever the agent says."""

    def __init__(self, env, task):
        self.said = [m["content"] for m in teacher_conversation(env, task)["messages"] if m["role"] == "user"]

    def opening(self):
        return self.said[0]

    def reply(self, messages):
        n = sum(m["role"] == "user" for m in messages)
        return self.said[n] if n < len(self.said) else "###STOP###"


class Teacher:
    """The cold-start teacher: asks when `ask`, otherwise refunds to what the opening says, or to the default."""

    def __init__(self, ask: bool):
        self.ask = ask

    def act(self, messages):
        users = [m["content"] for m in messages if m["role"] == "user"]
        if refunds(messages):
            return {"role": "assistant", "content": "Done."}
        if self.ask and len(users) == 1:
            return {"role": "assistant", "content": QUESTION}
        to = heard(" ".join(users))
        return {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "refund", "arguments": json.dumps({"to": to})}}]}


class AskEnv:
    """The dynamic user (module doc). `control`: every user wants the default."""

    name = "ask"
    user = "dynamic"
    control = False

    def tasks(self, split):
        if split not in N_TASKS:
            raise ValueError(f"unknown split {split!r}: {', '.join(N_TASKS)}")
        rng = random.Random(f"ask-{split}")
        out = []
        for i in range(N_TASKS[split]):
            # half the users want the default, the others one of OTHER: by the task's index, so every split is even
            wanted = DEFAULT if self.control or i % 2 == 0 else OTHER[(i // 2) % len(OTHER)]
            tid = f"{split}-{i}"
            out.append(Task(id=tid, user_scenario=f"You want a refund to your {wanted}; say so only when asked.",
                            data={"wanted": wanted, "order": rng.randrange(10, 100),
                                  "teacher_asks": rng.random() < TEACHER_ASKS},
                            meta={"wants": "default" if wanted == DEFAULT else "other"}))
        return out

    def system_prompt(self, task):
        return SYSTEM

    def tools(self, task):
        return TOOLS

    def user_tools(self, task):
        return []

    def start(self, task):
        return _Session(task)

    def scripted_user(self, task):
        if self.user == "static":
            return StaticUser(task)
        if self.user == "replay":
            return ReplayUser(self, task)
        return DynamicUser(task)

    def corpus(self):
        """Text for the tiny tokenizer (models.env_tokenizer): the teacher's conversations and the tool."""
        return [m.get("content") or json.dumps(m.get("tool_calls")) for c in cold_start_data(64)
                for m in c["messages"]] + [json.dumps(TOOLS)]

    def tokenizer_words(self):
        return [DEFAULT, *OTHER, *DRILL_WORDS]

    def expert(self, task):
        """The teacher that asks in about TEACHER_ASKS of its conversations (by the task)."""
        return Teacher(task.data["teacher_asks"])


class AskStaticEnv(AskEnv):
    user = "static"


class AskReplayEnv(AskEnv):
    user = "replay"


class AskControlEnv(AskEnv):
    control = True


class AskStaticControlEnv(AskStaticEnv):
    control = True


def teacher_conversation(env: AskEnv, task: Task, ask: bool | None = None, user: str | None = None) -> dict:
    """The teacher's conversation for a task (SFT data: {"messages", "tools", "prompt_messages"}), with the dynamic
    user unless `user` is "static"; `ask` overrides the task's own coin."""
    from envs import play

    who = StaticUser(task) if (user or ("static" if env.user == "static" else "dynamic")) == "static" \
        else DynamicUser(task)
    teacher = Teacher(task.data["teacher_asks"] if ask is None else ask)
    messages, _, _, _ = play(env, task, teacher, user=who, max_turns=6)
    return {"messages": messages, "tools": TOOLS, "prompt_messages": 2}


def copy_drills(n: int, seed: int = 0) -> list[dict]:
    """n short exchanges (no system prompt, as coldstart.windows' drills) in which the user names a destination, drawn
    from DRILL_WORDS and the real ones, and the agent's refund copies it: the skill the decision needs, taught on
    words that cannot be memorized."""
    rng = random.Random(f"drills-{seed}")
    out = []
    for i in range(n):
        to = rng.choice(DRILL_WORDS + [DEFAULT, *OTHER])
        said = f"To my {to}." if i % 2 else f"I want a refund for order {rng.randrange(10, 100)} to my {to}."
        call = {"id": "call_1", "type": "function", "function": {"name": "refund", "arguments": json.dumps({"to": to})}}
        out.append({"messages": [{"role": "user", "content": said},
                                 {"role": "assistant", "content": "", "tool_calls": [call]}],
                    "tools": [], "prompt_messages": 1})
    return out


def cold_start_data(n: int, seed: int = 0) -> list[dict]:
    """n teacher conversations over train tasks, half with the dynamic user and half with the static one, the teacher
    asking in TEACHER_ASKS of them (which ones drawn by `seed`, whatever the task's own coin)."""
    env, rng = AskEnv(), random.Random(seed)
    tasks = env.tasks("train")
    asks = [i < round(TEACHER_ASKS * n) for i in range(n)]  # exactly that share, in a random order
    rng.shuffle(asks)
    # the user by the parity of i, the task by i // 2: every destination with either user
    return [teacher_conversation(env, tasks[(i // 2) % len(tasks)], ask=asks[i],
                                 user="static" if i % 2 else "dynamic") for i in range(n)]
