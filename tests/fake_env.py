"""A deterministic toy environment for training-loop tests: any model, even a random one, gets mixed rewards.

The user opens, replies "ok" to anything, and stops after `user_turns` replies. The reward is 1 when the
agent's sampled text (all its messages) has an even number of characters: a coin flip for a random model, so
groups have both outcomes and every step has non-zero advantages. `nan_task` returns a NaN reward for one
task, to exercise the trainer's non-finite-loss guard.
"""
from envs import Task, ToolResult

TOOLS = [{"type": "function", "function": {"name": "echo", "description": "Echo the text.",
                                            "parameters": {"type": "object", "properties": {"text": {"type": "string"}}}}}]


class _User:
    def __init__(self, user_turns):
        self.user_turns = user_turns

    def opening(self):
        return "Hi, please help me."

    def reply(self, messages):
        n = sum(m["role"] == "user" for m in messages)
        return "Thanks. ###STOP###" if n >= self.user_turns else "ok"


class _Session:
    def __init__(self, task, nan):
        self.task, self.nan = task, nan

    def call_tool(self, name, arguments, requestor="assistant"):
        if name != "echo":
            return ToolResult(f"Error: unknown tool {name}", error=True)
        return ToolResult(str(arguments.get("text", "")))

    def reward(self, messages):
        if self.nan:
            return float("nan"), {"nan": True}
        n = sum(len(m.get("content") or "") for m in messages if m["role"] == "assistant")
        return float(n % 2 == 0), {"chars": n}


class FakeEnv:
    name = "fake"

    def __init__(self, n_tasks=64, user_turns=2, nan_task=""):
        self.n_tasks, self.user_turns, self.nan_task = int(n_tasks), int(user_turns), nan_task

    def tasks(self, split):
        if split not in ("train", "test"):
            raise ValueError(f"unknown split {split!r}: train, test")
        return [Task(id=f"{split}-{i}", user_scenario="You want help.") for i in range(self.n_tasks)]

    def system_prompt(self, task):
        return "You are a helpful agent."

    def tools(self, task):
        return TOOLS

    def user_tools(self, task):
        return []

    def start(self, task):
        return _Session(task, nan=task.id == self.nan_task)

    def scripted_user(self, task):
        return _User(self.user_turns)


class HalfUniformEnv(FakeEnv):
    """Two tasks; every episode of train-0 scores 0 (a uniform group whatever its episodes' endings, since one that
    runs past --max-new-tokens scores 0 too: --drop-uniform-groups leaves it out), those of train-1 score 1 and 0 in
    turn (a mixed group, unless every one of them is cut short). With two processes, one has nothing to train on in
    every step."""

    def __init__(self, **kw):
        super().__init__(n_tasks=2, **kw)
        self.started = 0

    def start(self, task):
        session = super().start(task)
        self.started += 1
        reward = 0.0 if task.id == "train-0" else float(self.started % 2)
        session.reward = lambda messages: (reward, {"chars": 0})
        return session


class NanEnv(FakeEnv):
    """Two tasks; train-0 returns a NaN reward."""

    def __init__(self, **kw):
        super().__init__(n_tasks=2, nan_task="train-0", **kw)


# ---- one learnable choice: the RL loop must find it (tests/test_learning.py) ----
CHOICE_TOOLS = [{"type": "function", "function": {"name": side, "description": f"Pick the {side} door.",
                                                   "parameters": {"type": "object", "properties": {}}}}
                for side in ("left", "right")]


class _ChoiceUser:
    def opening(self):
        return "Pick a door."

    def reply(self, messages):
        return "Thanks. ###STOP###"  # the first text message of the agent ends the episode


class _ChoiceSession:
    def __init__(self):
        self.picked = []

    def call_tool(self, name, arguments, requestor="assistant"):
        if name not in ("left", "right"):
            return ToolResult(f"Error: unknown tool {name}", error=True)
        self.picked.append(name)
        return ToolResult("opened")

    def reward(self, messages):
        # 1 only for the left door and nothing else: a right pick, two picks or no pick score 0.
        return float(self.picked == ["left"]), {"picked": list(self.picked)}


class ChoiceEnv(FakeEnv):
    """The agent calls one of two tools, `left` or `right`, then says it is done; the reward is 1 for `left`.
    The decision sits mid-episode, between scaffolding the agent does not sample (user and tool messages) and
    tokens it does (its tool call, its text, its end-of-turn tokens), so learning it needs the loss mask, the
    episode-to-advantage mapping and the sign of the update all right."""

    name = "choice"

    def system_prompt(self, task):
        return "Open one door."

    def tools(self, task):
        return CHOICE_TOOLS

    def start(self, task):
        return _ChoiceSession()

    def scripted_user(self, task):
        return _ChoiceUser()


def choice_conversation(side: str) -> dict:
    """An expert conversation of ChoiceEnv that picks `side` (SFT data for a starting policy)."""
    call = {"id": "c1", "type": "function", "function": {"name": side, "arguments": "{}"}}
    return {"messages": [{"role": "system", "content": "Open one door."}, {"role": "user", "content": "Pick a door."},
                         {"role": "assistant", "content": "", "tool_calls": [call]},
                         {"role": "tool", "tool_call_id": "c1", "name": side, "content": "opened"},
                         {"role": "assistant", "content": "Done."}],
            "tools": CHOICE_TOOLS, "prompt_messages": 2}


# ---- an episode the database calls right but a cap cuts off (tests/test_episode.py) ----
class _RightSession(_Session):
    def reward(self, messages):
        return 1.0, {"db_match": True}  # the database is right from the start: only the ending decides


class _TalkingExpert:
    """Calls `echo` once, then talks: it finishes only when the user stops."""

    def act(self, messages):
        if not any(m["role"] == "tool" for m in messages):
            return {"role": "assistant", "content": "", "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "echo", "arguments": '{"text": "hi"}'}}]}
        return {"role": "assistant", "content": "Anything else?"}


class RightEnv(FakeEnv):
    """Every episode's database is right; the user stops after `user_turns` replies. With user_turns beyond the
    turn cap, every way of playing an episode must score it 0 (cut off: it did not finish its task)."""

    name = "right"

    def start(self, task):
        return _RightSession(task, nan=False)

    def expert(self, task):
        return _TalkingExpert()


class CappedEnv(RightEnv):
    """RightEnv whose user never stops within the default turn cap (30)."""

    def __init__(self, n_tasks=64, user_turns=100, nan_task=""):
        super().__init__(n_tasks, user_turns, nan_task)


class OtherEnv(FakeEnv):
    """FakeEnv whose tasks have other ids ("other-test-0", ...): an environment told apart in what a run evaluated."""

    def tasks(self, split):
        return [Task(id=f"other-{t.id}", user_scenario=t.user_scenario) for t in super().tasks(split)]
