"""A tau2 task's gold conversation: its gold actions played through a session as an expert would have said them,
for the checks that hold muarl's tau2 reward to tau2's own (tests/test_tau2.py, bench/reward.py).
"""
from __future__ import annotations

import json

from envs import user_speaks_next
from envs.tau2 import Tau2Session  # first: it silences tau2's DEBUG logging
from envs.users import GREETING
from tau2.data_model.tasks import RewardType  # noqa: E402
from tau2.environment.toolkit import ToolType  # noqa: E402


def gold_messages(session: Tau2Session, actions=None) -> list[dict]:
    """Play the task's gold actions (or `actions`, e.g. with one write dropped) through `session` and return the
    agent-visible conversation an expert would have had: system prompt, the task's message history (or tau2's
    opening), one assistant tool call and its result per agent action (user actions run as the user's own
    calls), and a last assistant message saying the task's communicate_info where its reward basis asks for it."""
    task, criteria = session.task, session.task.data.evaluation_criteria
    actions = (criteria.actions or [] if criteria else []) if actions is None else actions
    messages = [{"role": "system", "content": session.env.system_prompt(task)}]
    messages += session.env.message_history(task) or [{"role": "assistant", "content": GREETING}]
    if user_speaks_next(messages):
        messages.append({"role": "user", "content": "Hi, I need help."})
    for i, action in enumerate(actions):
        if action.requestor == "user":
            session.call_tool(action.name, action.arguments, requestor="user", n_messages=len(messages))
            continue
        call_id = f"gold_{i}"
        messages.append({"role": "assistant", "content": None, "tool_calls": [{"id": call_id, "type": "function",
                         "function": {"name": action.name, "arguments": json.dumps(action.arguments)}}]})
        result = session.call_tool(action.name, action.arguments)
        messages.append({"role": "tool", "tool_call_id": call_id, "name": action.name, "content": result.content})
    said = criteria.communicate_info if criteria and RewardType.COMMUNICATE in criteria.reward_basis else None
    messages.append({"role": "assistant", "content": "Done. " + " | ".join(said or [])})
    messages.append({"role": "user", "content": "Thanks! ###STOP###"})
    return messages


def write_tools(session: Tau2Session) -> set[str]:
    """Names of the agent's and the user's tools that change state (tau2's WRITE tool type)."""
    kits = [k for k in (session.environment.tools, session.environment.user_tools) if k is not None]
    return {name for kit in kits for name in kit.tools if kit.tool_type(name) == ToolType.WRITE}
