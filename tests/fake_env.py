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


class NanEnv(FakeEnv):
    """Two tasks; train-0 returns a NaN reward."""

    def __init__(self, **kw):
        super().__init__(n_tasks=2, nan_task="train-0", **kw)
