"""The environment interface every domain implements, and `make_env` to pick one by name.

An environment is a set of tasks plus the means to play one episode of a task:

    env = make_env("tau2:retail")            # or "tau2:airline", "tau2:telecom", "tau2:mock", "shop", "bfcl:multi_turn"
    task = env.tasks("train")[0]
    session = env.start(task)                # fresh state: its own copy of the database (docs/invariants.md, 4)
    env.system_prompt(task), env.tools(task) # what the agent is shown (policy text, OpenAI tool schemas)
    session.call_tool("get_order_details", {"order_id": "#W1"})   # -> ToolResult(content, error)
    reward, info = session.reward(messages)  # at the end, from the episode's OpenAI-format messages

`messages` is the conversation as the agent sees it, in OpenAI chat format:
    {"role": "system", "content": ...}
    {"role": "user", "content": ...}
    {"role": "assistant", "content": ..., "tool_calls": [{"id", "type": "function",
                                                          "function": {"name", "arguments": <JSON str>}}]}
    {"role": "tool", "tool_call_id": ..., "name": ..., "content": ...}
Tool traffic of the *user* (dual-control domains such as tau2 telecom) never appears there: the agent does not
see it. A session records the user's tool calls itself (with the number of agent-visible messages at the time
of each call) so that `reward` can rebuild the full trajectory.

A task may continue an earlier conversation (tau2's `initial_state.message_history`): `message_history(env, task)`
gives it in this format, the episode starts as [system] + history, and whoever's turn it is speaks next
(`user_speaks_next`): the user after the agent's text message, otherwise the agent. Without a history the user
opens. The history is prompt: never trained on, the same for every episode of a task.

The episode rule (`next_turn`, `score`): an episode ends when the user says a stop marker, the agent runs a
STOP_TOOLS tool, or a cap cuts it off; only the first two can score, as in tau2. Every way of playing an episode
uses it: the rollouts (rollout.py, fast/batched_rollout.py) and `play`, the text-level driver of scripted experts, API
agents (envs/api_agent.py) and cold-start synthesis. The simulated users live in envs/users.py and envs/llm_users.py:
they are part of the world the agent talks to.

This package is the world; it imports nothing of the agent's side (tests/test_layout.py).
"""
from __future__ import annotations

import copy
import json
import math
import numbers
import os
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Protocol

# Tool names that end the episode when the agent calls them (after the call has run), as in tau2.
STOP_TOOLS = frozenset({"transfer_to_human_agents"})
# Markers a user simulator puts in its message to end the dialogue (tau2's set).
USER_STOP_MARKERS = ("###STOP###", "###TRANSFER###", "###OUT-OF-SCOPE###")


@dataclass
class Task:
    id: str
    user_scenario: str  # instructions for an LLM user simulator: who they are, what they want, what to reveal
    data: Any = None  # the environment's own task object (a tau2 Task, a shop task dict, ...)
    meta: dict = field(default_factory=dict)


@dataclass
class ToolResult:
    content: str  # the text the caller sees (a tool's error text when `error`)
    error: bool = False


class ScriptedUser(Protocol):
    """A rule-based user for one episode. Deterministic given the task and the conversation."""

    def opening(self) -> str | None:
        """The first user message. Identical for every episode of a task (the group shares it). None when the
        task's message history ends on the user's turn, so the agent speaks first."""

    def reply(self, messages: list[dict]) -> str:
        """The next user message given the agent-visible conversation so far (ends with the agent's message).
        Contains one of USER_STOP_MARKERS when the user is done."""


class ScriptedAgent(Protocol):
    """An expert policy for one episode (cold-start data, solvability tests)."""

    def act(self, messages: list[dict]) -> dict:
        """The next assistant message ({"role": "assistant", "content", "tool_calls"?}) for the conversation."""


class EnvSession(Protocol):
    """One episode's environment state."""

    def call_tool(self, name: str, arguments: dict, requestor: str = "assistant",
                  n_messages: int | None = None) -> ToolResult:
        """Run a tool against this episode's database. Never raises for bad input: an unknown tool, bad
        arguments or a tool that raises come back as ToolResult(error text, error=True). A user's call
        (requestor="user", dual-control domains) passes `n_messages`: how many agent-visible messages the
        conversation had when the user made it (its place in the trajectory)."""

    def reward(self, messages: list[dict]) -> tuple[float, dict]:
        """The episode's reward and its breakdown (JSON-serializable), computed at the end."""


class Environment(Protocol):
    """What an environment gives (README.md, "Add an environment"). Required: name, tasks, system_prompt, tools,
    user_tools, start. Optional, each looked up with getattr and skipped where absent: slow_tools, message_history,
    scripted_user, expert, corpus, tokenizer_words."""
    name: str
    # slow_tools = True when a tool call takes time or acts on a remote service: the rollout then runs tool calls
    # from its user thread while other episodes decode, and the tool deadline (fast/deadlines.py) does not try a
    # call first on a copy of the session in another process (a remote call is not safe to make twice). Default
    # False: every call runs twice, once on the probe's copy (made by start(task) and the calls so far), whose
    # effects are thrown away, then for real.

    def tasks(self, split: str) -> list[Task]:
        """Tasks of a split ("train", "test", ...). Raises ValueError naming the known splits."""

    def system_prompt(self, task: Task) -> str: ...

    def tools(self, task: Task) -> list[dict]:
        """The agent's tools as OpenAI function schemas: {"type": "function", "function": {...}}."""

    def user_tools(self, task: Task) -> list[dict]:
        """The user's tools (dual-control domains); [] when the user has none."""

    def start(self, task: Task) -> EnvSession: ...

    def message_history(self, task: Task) -> list[dict]:
        """Optional: the conversation the task starts from (OpenAI format, agent-visible); see the module doc."""

    def scripted_user(self, task: Task) -> ScriptedUser:
        """A rule-based user for the task; raises NotImplementedError where the domain has none."""

    def expert(self, task: Task) -> ScriptedAgent:
        """Optional: a scripted expert, the teacher of the cold start (sft.py) and eval.py --agent expert."""

    def corpus(self) -> list[str]:
        """Optional: texts the `tiny` model's BPE tokenizer is trained on (policy, tool schemas, expert dialogues)."""

    def tokenizer_words(self) -> list[str]:
        """Optional: identifiers the `tiny` tokenizer keeps as single tokens (order ids, emails)."""


REQUIRED = ("name", "tasks", "system_prompt", "tools", "user_tools", "start")  # what Environment's doc requires


def make_env(name: str, **options) -> Environment:
    """Build an environment from its command-line name: "shop" ("shop:static", "shop:replay", "shop:garden", ...:
    envs.shop.from_name), "tau2:<domain>", "bfcl:<category>" (BFCL-V3
    multi-turn), "acebench:<agent|multi_turn|multi_step>" (ACEBench, from a checkout: root=, or ACEBENCH_ROOT),
    or "package.module:Class"."""
    if name == "shop" or name.startswith("shop:"):
        from envs.shop import from_name

        return from_name(name, **options)
    if name.startswith("tau2:"):
        from envs.tau2 import Tau2Env

        return Tau2Env(name.split(":", 1)[1], **options)
    if name.startswith("bfcl:"):
        from envs.bfcl import BfclEnv

        return BfclEnv(name.split(":", 1)[1], **options)
    if name.startswith("acebench:"):
        from envs.acebench import AceBenchEnv

        return AceBenchEnv(name.split(":", 1)[1], **options)
    if ":" in name and not name.startswith("tau2"):  # your own: "package.module:ClassName"
        import importlib

        module, cls = name.split(":", 1)
        try:
            found = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name != module and not module.startswith(f"{e.name}."):
                raise  # the module exists but imports something missing: its own traceback says what
            raise ValueError(f"unknown environment {name!r}: there is no module {module!r}") from None
        if not hasattr(found, cls):
            raise ValueError(f"unknown environment {name!r}: {module} has no {cls!r}")
        if not isinstance(getattr(found, cls), type):
            raise ValueError(f"{module}.{cls} is a {type(getattr(found, cls)).__name__}, not a class: name an "
                             "Environment class (README.md, \"Add an environment\")")
        env = getattr(found, cls)(**options)
        lacks = [a for a in REQUIRED if not hasattr(env, a)]
        if lacks:
            raise ValueError(f"{module}.{cls} is no Environment: it lacks {', '.join(lacks)} (README.md, \"Add an "
                             "environment\")")
        return env
    raise ValueError(f"unknown environment {name!r}: use 'shop', 'tau2:<retail|airline|telecom|mock>', "
                     "'bfcl:<multi_turn|multi_turn_base|...>', 'acebench:agent' or 'package.module:ClassName'")


def load_tasks(name: str, split: str, program: str, option: str = "--env", **options) -> tuple[Environment, list[Task]]:
    """make_env(name) and its split's tasks, at an entry point's start: an environment or split it does not know stops
    `program` in one line naming the option (`option`, --split) and the known values."""
    try:
        env = make_env(name, **options)
    except ValueError as e:
        raise SystemExit(f"{program}: {option} {name}: {e}") from None
    except TypeError as e:  # an option this environment does not take (--env-reward is tau2's)
        if not options:
            raise
        given = ", ".join(f"--env-{k.replace('_', '-')} {v}" for k, v in options.items())
        raise SystemExit(f"{program}: {given}: {option} {name} takes no such option ({e})") from None
    where = f"--split {split}" if option == "--env" else f"{option} {name} (its {split!r} split)"
    try:
        tasks = env.tasks(split)
    except ValueError as e:  # an unknown split, as the environments say; a plug-in's own slip, where it raised
        import traceback

        at = traceback.extract_tb(e.__traceback__)[-1]
        mine = os.path.dirname(os.path.abspath(at.filename)) == os.path.dirname(os.path.abspath(__file__))
        raise SystemExit(f"{program}: {where}: {e}" + ("" if mine else f" (raised at {at.filename}:{at.lineno})")) \
            from None
    if not tasks:
        raise SystemExit(f"{program}: {where}: {name} has no tasks in split {split!r}")
    seen: set = set()
    twice = sorted({t.id for t in tasks if t.id in seen or seen.add(t.id)})
    if twice:  # a task's samples are grouped, and its pass^k computed, by id: two tasks of one id would be one
        raise SystemExit(f"{program}: {where}: {name} gives {len(twice)} task id(s) to more than one task "
                         f"({', '.join(map(str, twice[:5]))}): each task needs an id of its own")
    for task in tasks[:16]:  # what the template shows the agent: schemas it can render, not whatever tools() gives
        problem = tools_problem(env.tools(task))
        if problem:
            raise SystemExit(f"{program}: {option} {name}: the tools of task {task.id}: {problem}")
    return env, tasks


def tools_problem(tools) -> str:
    """What keeps an environment's tools (env.tools(task)) from being function schemas the chat template renders
    ('' when nothing): a list of {"type": "function", "function": {"name": ..., ...}}, each name once, all JSON."""
    if not isinstance(tools, list):
        return f"a {type(tools).__name__}, not a list of function schemas"
    names = []
    for k, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            return (f"tool {k} is not a function schema ({{\"type\": \"function\", \"function\": {{\"name\": ...}}}}): "
                    f"{str(t)[:80]}")
        names.append(fn["name"])
    twice = [n for n in dict.fromkeys(names) if names.count(n) > 1]
    if twice:
        return f"tool {twice[0]!r} is listed {names.count(twice[0])} times"
    try:
        json.dumps(tools)
    except (TypeError, ValueError) as e:
        return f"not JSON ({e})"
    return ""


# Parameter type names of BFCL-style function docs (BFCL, ACEBench) -> JSON Schema's, which OpenAI tools use.
JSON_TYPES = {"dict": "object", "float": "number", "tuple": "array", "list": "array", "any": "string",
              "bool": "boolean", "int": "integer", "str": "string"}


def openai_schema(doc: dict) -> dict:
    """A BFCL-style function doc ({"name", "description", "parameters": {"type": "dict", ...}, "response"?}) as an
    OpenAI tool: parameters in JSON Schema's type names; "response" left out (an OpenAI function has no such field)."""
    def convert(schema):
        if not isinstance(schema, dict):
            return schema
        out = {}
        for k, v in schema.items():
            if k == "type" and isinstance(v, str):
                out[k] = JSON_TYPES.get(v, v)
            elif k == "properties" and isinstance(v, dict):
                out[k] = {name: convert(p) for name, p in v.items()}
            elif k == "items":
                out[k] = convert(v)
            else:
                out[k] = copy.deepcopy(v)
        return out

    parameters = convert(doc.get("parameters") or {"type": "object", "properties": {}})
    parameters["type"] = "object"
    return {"type": "function", "function": {"name": doc["name"], "description": doc.get("description", ""),
                                             "parameters": parameters}}


def message_history(env: Environment, task: Task) -> list[dict]:
    """The earlier conversation `task` continues ([] for most tasks, and for environments without the method)."""
    get = getattr(env, "message_history", None)
    return get(task) if get is not None else []


def user_speaks_next(messages: list[dict]) -> bool:
    """Whose turn it is after `messages` (a message history): the user's after the agent's text message (or when
    nothing was said yet), the agent's after a user message or a tool result. tau2's orchestrator rule."""
    last = messages[-1] if messages else {"role": "assistant"}
    return last["role"] == "assistant" and not last.get("tool_calls")


def opening_messages(env: Environment, task: Task, opening: str | None) -> list[dict]:
    """How every episode of `task` starts: the system prompt, the task's message history, then the user's opening
    (None when the history leaves the agent to speak first). Fresh objects: episodes share no mutable message."""
    messages = [{"role": "system", "content": env.system_prompt(task)}] + copy.deepcopy(message_history(env, task))
    if opening is not None:
        messages.append({"role": "user", "content": opening})
    return messages


# ---------------------------------------------------------------------------------------------------------
# The episode rule: when an episode ends, and what it scores. Every way of playing an episode uses these two
# functions: the batched rollout and its reference (fast/batched_rollout.py, rollout.py), and `play` below (scripted
# experts, API agents, cold-start synthesis), so a reward means the same thing whoever played the episode.
# ---------------------------------------------------------------------------------------------------------
class _Word(str, Enum):
    """A word of the episode's vocabulary: compares, formats and serializes as its plain string value."""
    __str__, __format__ = str.__str__, str.__format__


class Speaker(_Word):
    """Who speaks next while the episode goes on."""
    AGENT = "agent"      # the agent samples a turn (after the user's message, or to read its tool results)
    USER = "user"        # the simulated user answers the agent's text


class Termination(_Word):
    """Why an episode ended (Episode.termination; the metrics' termination/<reason>)."""
    USER_STOP = "user_stop"                     # the user said a USER_STOP_MARKER
    TRANSFER = "transfer"                       # the agent ran a STOP_TOOLS tool
    MAX_TURNS = "max_turns"                     # the agent's max_turns-th message was said
    CONTEXT_LIMIT = "context_limit"             # the episode's tokens reached the context cap
    RESPONSE_TRUNCATED = "response_truncated"   # a turn reached the per-turn cap on new tokens
    INFRA_ERROR = "infra_error"                 # an endpoint or the evaluator failed: not scored, not trained


# The endings where the dialogue finished. Any other (the turn, context or response cap, an infrastructure
# failure) scores 0 whatever the database says, as in tau2: an episode cut off did not finish its task.
FINISHED = (Termination.USER_STOP, Termination.TRANSFER)


def next_turn(messages: list[dict], turns: int, max_turns: int, stop_tool_ran: bool = False) -> Speaker | Termination:
    """Who speaks after `messages`, or why the episode ends there (tau2's orchestrator rules):
      after a user message: USER_STOP when it carries a USER_STOP_MARKER, else AGENT;
      after the agent's turn (its message, then its tool results if it called tools): TRANSFER when a STOP_TOOLS
      tool ran, MAX_TURNS when that was its `max_turns`-th message, else AGENT (it reads its tool results) or USER
      (the user answers its text).
    `turns` counts the agent's messages so far."""
    last = messages[-1]
    if last["role"] == "user":
        stop = any(m in (last.get("content") or "") for m in USER_STOP_MARKERS)
        return Termination.USER_STOP if stop else Speaker.AGENT
    if stop_tool_ran:
        return Termination.TRANSFER
    if turns >= max_turns:
        return Termination.MAX_TURNS
    return Speaker.AGENT if last["role"] == "tool" else Speaker.USER


def score(session: EnvSession, messages: list[dict], termination: Termination) -> tuple[float, dict, Termination]:
    """(reward, its breakdown, termination) of an ended episode. The environment scores the conversation
    (session.reward); an episode that did not end FINISHED gets 0, the environment's verdict kept in
    info["env_reward"]. An evaluator that raises or returns what is not a finite number is not the agent's doing:
    the episode ends INFRA_ERROR (training leaves it out rather than scoring it 0)."""
    try:
        reward, info = session.reward(messages)
    except Exception as e:
        return 0.0, {"error": repr(e)}, Termination.INFRA_ERROR
    if not isinstance(reward, numbers.Real):  # a string, None, a tensor: its own code's slip, named
        return 0.0, {**(info if isinstance(info, dict) else {}), "error": f"the reward is a "
                     f"{type(reward).__name__} ({str(reward)[:50]!r}), not a number"}, Termination.INFRA_ERROR
    reward = float(reward)
    if not math.isfinite(reward):
        return 0.0, {**info, "error": f"non-finite reward {reward}"}, Termination.INFRA_ERROR
    if termination not in FINISHED:
        return 0.0, {**info, "env_reward": reward, "ended_early": termination}, termination
    return reward, info, termination


def play(env: Environment, task: Task, agent: ScriptedAgent, user: ScriptedUser | None = None,
         max_turns: int = 30, session: EnvSession | None = None) -> tuple[list[dict], float, dict, str]:
    """Play one episode at the text level (no tokens): cold-start data, API-model evaluation, environment tests.

    The conversation starts as the rollout's does: system prompt, the task's message history, the user's opening
    (unless the history leaves the agent to speak first). A turn is one agent message; its tool calls run against
    the session and come back as tool messages. The episode ends and is scored by the episode rule above
    (`next_turn`, `score`). Returns (messages, reward, reward info, termination). `session` lets a user simulator
    with user-side tools (envs.users.UserSim.sync_user) act on the same episode state."""
    user = user if user is not None else env.scripted_user(task)
    session = session if session is not None else env.start(task)  # pass one to share it with the user
    messages = opening_messages(env, task, user.opening())
    turns, status = 0, Speaker.AGENT
    while isinstance(status, Speaker):
        if status == Speaker.USER:
            messages.append({"role": "user", "content": user.reply(messages)})
            status = next_turn(messages, turns, max_turns)
            continue
        message = agent.act(messages)
        messages.append(message)
        turns, stop = turns + 1, False
        for call in message.get("tool_calls") or []:
            name, arguments = call["function"]["name"], call["function"].get("arguments") or "{}"
            try:
                arguments = arguments if isinstance(arguments, dict) else json.loads(arguments)
            except (TypeError, ValueError, RecursionError):  # RecursionError: nested ~1,000 levels deep
                result = ToolResult("Error: arguments are not valid JSON", error=True)
            else:
                result = session.call_tool(name, arguments)
                stop = stop or name in STOP_TOOLS
            messages.append({"role": "tool", "tool_call_id": call["id"], "name": name, "content": result.content})
        status = next_turn(messages, turns, max_turns, stop)
    reward, info, termination = score(session, messages, status)
    return messages, reward, info, termination
