"""The simulated user: one interface, three backends (scripted rules here; an OpenAI-compatible LLM and a local HF
model in envs/llm_users.py).

    sim = ScriptedUserSim()            # or envs.llm_users' OpenAIUserSim(model="gpt-4o"), HFUserSim(model, tok)
    opening = await sim.opening(env, task)                   # once per task, shared by the task's G episodes
    state = sim.start(env, task, session, opening)           # one episode's side of the conversation
    replies = await sim.replies(states, conversations)       # every episode waiting on its user, at once
    user = sim.sync_user(env, task, session)                 # the same user, text level, for envs.play

Why here, in envs/: the user is part of the world the agent talks to, not of the agent's machinery. It reads the
task's scenario and message history, it ends the dialogue with tau2's stop markers, and in dual-control domains
(tau2 telecom) it calls its own tools on the episode's environment session. The rollouts (rollout.py,
batched_rollout.py) and the text-level driver (envs.play) only ask it for messages. Like the rest of envs/ it imports
nothing of the agent side: the hf backend is handed a loaded model (plumbing.users.make_user_sim loads one by name).

The user-simulator prompt (tau2's guidelines + the task's scenario) and tau2's opening greeting are defined here
once; envs/tau2.py uses them.

A benchmark may bring its own user, in task.meta["user_sim"]: its prompt, greeting and end phrase ("system_prompt",
"greeting", "stop": ACEBench's), or "scripted": the data is the user (BFCL's questions), which DataUserSim leaves to
env.scripted_user whichever LLM user was chosen.
"""
from __future__ import annotations

import asyncio
import contextlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from envs import USER_STOP_MARKERS, message_history


class UserSimError(RuntimeError):
    """The user simulator could not answer (endpoint down after retries): an infrastructure failure."""


# tau2's orchestrator opens with this agent greeting; an LLM user needs something to answer to.
GREETING = "Hi! How can I help you today?"
# tau2's UserSimulator system prompt (tau2/user/user_simulator.py, which imports litellm, so it is restated here;
# tests/test_tau2.py checks it is verbatim).
USER_SYSTEM_PROMPT = """
{global_user_sim_guidelines}

<scenario>
{instructions}
</scenario>
""".strip()
_GUIDELINES = """# User Simulation Guidelines
You are playing the role of a customer contacting a customer service agent. Follow the scenario below.
- Write one message at a time, as the customer would; never act as the agent.
- Reveal information only when the agent asks for it; never make up information the scenario does not give.
- When the task is complete, write ###STOP### to end the conversation. If you are transferred to another
  agent, write ###TRANSFER###. If the scenario does not cover what is happening, write ###OUT-OF-SCOPE###."""


def user_guidelines(with_tools: bool = False) -> str:
    """tau2's simulation guidelines (the tool-using variant where the user has tools) when the tau2 package is
    installed (read as data: importing its user simulator pulls litellm), else a short built-in version of them."""
    import importlib.util

    spec = importlib.util.find_spec("tau2")
    if spec and spec.submodule_search_locations:
        name = "simulation_guidelines_tools.md" if with_tools else "simulation_guidelines.md"
        path = Path(list(spec.submodule_search_locations)[0]) / "data" / "tau2" / "user_simulator" / name
        if path.exists():
            return path.read_text()
    return _GUIDELINES


def user_system_prompt(task, with_tools: bool = False) -> str:
    """The LLM user's system prompt, as tau2 builds it: the guidelines, then the task's scenario; or the benchmark's
    own user prompt where the task carries one (task.meta["user_sim"]["system_prompt"]: ACEBench's)."""
    own = (task.meta.get("user_sim") or {}).get("system_prompt")
    return own or USER_SYSTEM_PROMPT.format(global_user_sim_guidelines=user_guidelines(with_tools),
                                            instructions=task.user_scenario)


class UserSim:
    """The interface. `opening` runs once per task; `start` makes one episode's state; `replies` answers every
    episode waiting on its user at once (list in, list out; a failure comes back as a UserSimError in its slot).

    `local` False (an LLM behind an endpoint): the rollout asks it from a thread of its own, one episode at a time,
    and decodes the other episodes while it answers. True (answers at once, or computes on the agent's device): the
    rollout asks it for every waiting episode at once, between decoding batches."""

    local = False

    async def aclose(self) -> None:
        """Release what the simulator holds on the running event loop (an HTTP client); the rollout calls it before
        the loop of its user thread closes."""

    async def opening(self, env, task) -> str | None:
        """The user's first message; None when the task's message history leaves the agent to speak first."""
        raise NotImplementedError

    def start(self, env, task, session, opening: str | None) -> Any:
        raise NotImplementedError

    async def reply(self, state, messages: list[dict]) -> str:
        raise NotImplementedError

    def sync_user(self, env, task, session):
        """This simulator as a ScriptedUser (opening() / reply(messages)) for the text-level driver envs.play,
        which cold-start synthesis and API-model evaluation use. Failures raise UserSimError."""
        return _SyncUser(self, env, task, session)

    async def replies(self, states: list, conversations: list[list[dict]]) -> list:
        out = await asyncio.gather(*(self.reply(s, m) for s, m in zip(states, conversations)),
                                   return_exceptions=True)
        return list(out)


MAX_REPLY_CHARS = 100_000
"""The longest user message an episode takes, in characters: about 25k tokens of English, most of the paper's whole
context (32k tokens), and far beyond what a person or an LLM user writes in one turn. A longer one is a broken
simulator, refused before it is tokenized (a 10 MB reply took 2.2 GB of memory on its way to context_limit)."""
_SURROGATE = re.compile("[\ud800-\udfff]")


def reply_problem(text) -> str:
    """What makes a user message unfit for an episode ("" when it is fit): it says nothing (not a string, or blank),
    is longer than MAX_REPLY_CHARS, or holds an unpaired surrogate (an endpoint's escape like "\\ud800", which is not
    a character: no tokenizer takes it). Such a reply is an infrastructure failure of its episode (OpenAIUserSim
    retries it first), never a turn to score and train on."""
    if not isinstance(text, str) or not text.strip():
        return f"is empty ({text!r:.80})"
    if len(text) > MAX_REPLY_CHARS:
        return f"has {len(text):,} characters, more than a user says (at most {MAX_REPLY_CHARS:,}: MAX_REPLY_CHARS)"
    bad = _SURROGATE.search(text)
    if bad:
        return f"is not text: an unpaired surrogate (\\u{ord(bad.group()):04x}) at character {bad.start()}"
    return ""


async def close_user_sim(sim) -> None:
    """sim.aclose(), where it has one: a simulator written without subclassing UserSim holds nothing to release."""
    close = getattr(sim, "aclose", None)
    if close is not None:
        await close()


class _SyncUser:
    def __init__(self, sim, env, task, session):
        self.sim, self.env, self.task, self.session, self.state = sim, env, task, session, None

    def opening(self) -> str | None:
        text = asyncio.run(self.sim.opening(self.env, self.task))
        if text is not None and reply_problem(text):
            raise UserSimError(f"the user simulator's opening {reply_problem(text)}")
        self.state = self.sim.start(self.env, self.task, self.session, text)
        return text

    def reply(self, messages: list[dict]) -> str:
        text = asyncio.run(self.sim.reply(self.state, messages))
        if reply_problem(text):
            raise UserSimError(f"the user simulator's reply {reply_problem(text)}")
        return text


class ScriptedUserSim(UserSim):
    """The environment's rule-based user (env.scripted_user): deterministic, free, for tests and tiny runs. local:
    it answers at once, so the rollout asks it between decoding batches rather than from a thread of its own."""

    local = True

    async def opening(self, env, task) -> str:
        with _user_code("opening", task):
            return env.scripted_user(task).opening()

    def start(self, env, task, session, opening):
        user = env.scripted_user(task)
        try:
            with _user_code("opening", task):
                user.opening()  # a scripted user may keep state; its opening equals the shared one by contract
        except UserSimError as e:
            return e  # the episode's first reply is this failure
        return user

    async def reply(self, user, messages):
        if isinstance(user, UserSimError):
            raise user
        with _user_code("reply", None):
            return user.reply(messages)


@contextlib.contextmanager
def _user_code(what: str, task):
    """An environment's own scripted user that raises (a bug in a plug-in domain) fails its episode as an
    infrastructure failure, as a failing endpoint does, instead of ending the run; a stop signal (not an Exception)
    passes through."""
    try:
        yield
    except UserSimError:
        raise
    except Exception as e:
        where = f" of task {task.id}" if task is not None else ""
        raise UserSimError(f"the scripted user's {what}{where} raised {type(e).__name__}: {str(e)[:300]}") from e


@dataclass
class _ChatState:
    """An LLM user's side of one episode: its own conversation, roles flipped, including its own tool traffic."""

    history: list[dict]
    session: Any
    tools: list[dict]
    seen: int  # agent-visible messages already mirrored into history
    stop: str = ""  # the benchmark's own way for the user to end (ACEBench: "finish conversation")
    retries: int = 0  # requests to the endpoint retried so far in this episode (OpenAIUserSim)

    def said(self, text: str) -> str:
        """The user's message as the episode records it: a stop marker added when it ends the benchmark's way, so
        that the episode rule (envs.next_turn) sees the end."""
        if self.stop and self.stop in text and not any(m in text for m in USER_STOP_MARKERS):
            return f"{text} {USER_STOP_MARKERS[0]}"
        return text


def _user_view(task, history: list[dict], with_tools: bool) -> list[dict]:
    """What the user has seen before its first message, roles flipped (the agent speaks as `user`): the task's
    message history without the agent's tool traffic, as tau2 shows it, or else the greeting (tau2's, or the
    benchmark's own: task.meta["user_sim"]["greeting"])."""
    said = [m for m in history if m["role"] in ("user", "assistant") and not m.get("tool_calls")]
    flip = {"user": "assistant", "assistant": "user"}
    greeting = (task.meta.get("user_sim") or {}).get("greeting") or GREETING
    return [{"role": "system", "content": user_system_prompt(task, with_tools)}] + [
        {"role": flip[m["role"]], "content": m.get("content") or ""}
        for m in said or [{"role": "assistant", "content": greeting}]]


def _chat_state(env, task, session, opening: str | None, tools: list[dict]) -> _ChatState:
    history = message_history(env, task)
    view = _user_view(task, history, bool(tools))
    if opening is not None:
        view.append({"role": "assistant", "content": opening})
    seen = 1 + len(history) + (opening is not None)  # system + history + opening
    return _ChatState(view, session, tools, seen, (task.meta.get("user_sim") or {}).get("stop", ""))


def _flip_new(state: _ChatState, messages: list[dict]) -> None:
    """Mirror what the agent said to the user since the last reply: its text messages, as `user`. The agent's
    tool calls and tool results are not the user's business and are never shown."""
    for m in messages[state.seen:]:
        if m["role"] == "assistant" and not m.get("tool_calls"):
            state.history.append({"role": "user", "content": m.get("content") or ""})
    state.seen = len(messages)


class _Retries:
    retries = 0


def opening_retries(sim, task) -> int:
    """Retried requests of `task`'s opening so far (OpenAIUserSim; 0 for the others), taken out of the count."""
    return (getattr(sim, "opening_retries", None) or {}).pop(task.id, 0)


def retries_of(state) -> int:
    """Endpoint retries so far in an episode's user state (a DataUserSim state is (simulator, state))."""
    if isinstance(state, tuple):
        state = state[-1]
    return getattr(state, "retries", 0)


class DataUserSim(UserSim):
    """`sim` for most tasks, but env.scripted_user for tasks whose user is written in the data
    (task.meta["user_sim"]["scripted"]: BFCL's questions, ACEBench's multi-step entries, which have no user).
    plumbing.users.make_user_sim wraps every LLM user in one."""

    def __init__(self, sim: UserSim):
        self.sim, self.scripted = sim, ScriptedUserSim()

    def __getattr__(self, name):  # the wrapped simulator's own attributes (model, _generate, ...)
        if name == "sim":
            raise AttributeError(name)
        return getattr(self.sim, name)

    @property
    def local(self) -> bool:  # the scripted user it also asks is local: the wrapped simulator decides
        return self.sim.local

    async def aclose(self) -> None:
        await close_user_sim(self.sim)

    def _pick(self, task) -> UserSim:
        return self.scripted if (task.meta.get("user_sim") or {}).get("scripted") else self.sim

    async def opening(self, env, task):
        return await self._pick(task).opening(env, task)

    def start(self, env, task, session, opening):
        sim = self._pick(task)
        return sim, sim.start(env, task, session, opening)

    async def reply(self, state, messages):
        out = (await self.replies([state], [messages]))[0]
        if isinstance(out, BaseException):
            raise out
        return out

    async def replies(self, states, conversations):
        out = [None] * len(states)
        for sim in (self.scripted, self.sim):
            mine = [i for i, (s, _) in enumerate(states) if s is sim]
            if mine:
                got = await sim.replies([states[i][1] for i in mine], [conversations[i] for i in mine])
                for i, text in zip(mine, got):
                    out[i] = text
        return out
