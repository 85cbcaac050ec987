"""BFCL-V3 multi-turn (the Berkeley Function-Calling Leaderboard's multi-turn categories) behind muarl's interface.

    env = make_env("bfcl:multi_turn")          # all four categories; or "bfcl:multi_turn_base", "bfcl:miss_func", ...
    task = env.tasks("test")[0]                # BFCL has no training split: "test" is every entry
    session = env.start(task)
    session.call_tool("cd", {"folder": "document"})
    reward, info = session.reward(messages)    # BFCL's multi-turn checker on the episode's calls, turn by turn

Everything benchmark-specific is BFCL's own, from the `bfcl-eval` package (installed --no-deps; its executor and
checker need only mpmath and filelock): the entries of multi_turn_{base,miss_func,miss_param,long_context} (200
each) and their ground truth, the function docs, the simulated APIs (file system, trading bot, travel booking, ...),
the executor that runs calls against them, and the checker the leaderboard scores with. What this module adds:

* Tools: BFCL's function docs as OpenAI function schemas (BFCL's type names mapped to JSON Schema's).
* The user is the data: each user turn's question, given when the agent answers without a tool call (that is how
  BFCL ends a turn); "###STOP###" after the last one. A miss_func entry holds some functions back until a later
  turn, whose user message is then BFCL's "I have updated some more functions ..." prompt with the held-out docs
  in it: what the leaderboard does for local models (the tool list in the system prompt stays fixed, since the
  prompt is the cached prefix of the episode). eval.py's API agents also get them as tools from then on
  (`tools_at`), as BFCL does for API models. The user is scripted whichever user simulator is chosen.
* Execution through BFCL's executor, which builds a Python call string and `eval`s it. Model output never reaches
  it unchecked: the tool name must be a public method of one of the entry's classes, every argument name an
  identifier, every value JSON data (written into the string with repr, so it stays a literal). Anything else is
  an error observation and nothing runs.
* State: the executor keeps each episode's API instances in its module globals under a name; every session uses
  a fresh unique name (fresh state per episode, parallel episodes apart) and deletes its instances after scoring.
* Reward = BFCL's multi_turn_checker verdict: the episode's calls, grouped by user turn and by step (one step per
  assistant message with calls), replayed from the initial state next to the ground truth; after every turn with
  ground truth, every simulated API's public state must be equal and the ground truth's results contained in the
  model's. The leaderboard's headline is the unweighted mean over the four categories (eval.py: category_mean).

Simplifications, stated where they are made:
* BFCL force-quits an entry after more than 20 steps in one turn (MAXIMUM_STEP_LIMIT). A session cannot end an
  episode, so the limit is applied at scoring, as BFCL's evaluation sees it: the turn that went over keeps its
  first 21 steps and the turns after it are dropped (a turn count short of the ground truth's fails).
* A malformed call (bad JSON, unknown tool) makes BFCL's inference end the turn; here it is an error observation
  the agent can recover from (muarl's rule for every environment), and it is left out of the scored calls.
"""
from __future__ import annotations

import ast
import copy
import inspect
import json
import keyword
import math
import os
import uuid
import weakref
from pathlib import Path

from envs import USER_STOP_MARKERS, Task, ToolResult, openai_schema

# Importing bfcl_eval creates result/, score/ and .file_locks/ under its project root, which defaults to the
# package's own directory inside site-packages.
os.environ.setdefault("BFCL_PROJECT_ROOT", str(Path(os.environ.get("MUARL_CACHE") or Path.home() / ".cache" / "muarl")
                                              / "bfcl"))
try:
    Path(os.environ["BFCL_PROJECT_ROOT"]).mkdir(parents=True, exist_ok=True)
except OSError as e:  # make_env turns this into one line naming --env
    raise ValueError(f"BFCL's working directory {os.environ['BFCL_PROJECT_ROOT']} (under MUARL_CACHE, or "
                     f"BFCL_PROJECT_ROOT) cannot be made: {e.strerror or e}; set MUARL_CACHE to a writable "
                     "directory") from None

from bfcl_eval import utils as bfcl_utils  # noqa: E402
from bfcl_eval.constants.default_prompts import (  # noqa: E402
    DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_PROMPTING,
    MAXIMUM_STEP_LIMIT,
    PROMPT_STYLE_TEMPLATES,
)
from bfcl_eval.constants.executable_backend_config import CLASS_FILE_PATH_MAPPING  # noqa: E402
from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_utils  # noqa: E402
from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker import multi_turn_checker  # noqa: E402

CATEGORIES = ("multi_turn_base", "multi_turn_miss_func", "multi_turn_miss_param", "multi_turn_long_context")
# No system prompt comes with BFCL's multi-turn entries, and its function-calling handlers add none; muarl's
# episodes open with one, so it says what a turn is: BFCL's own words for prompting models, without the part about
# the output format (the tools here are native).
_STYLE = PROMPT_STYLE_TEMPLATES["classic"]
SYSTEM_PROMPT = f"{_STYLE['persona']} {_STYLE['task']}\n\n{_STYLE['multiturn_behavior']}"


def category_of(name: str) -> list[str]:
    """The BFCL categories an environment name covers: "multi_turn" (all four), "multi_turn_base", or "base"."""
    if name == "multi_turn":
        return list(CATEGORIES)
    full = name if name.startswith("multi_turn_") else f"multi_turn_{name}"
    if full not in CATEGORIES:
        raise ValueError(f"unknown BFCL category {name!r}: use 'multi_turn' or one of {', '.join(CATEGORIES)} "
                         "(the 'multi_turn_' prefix may be left out)")
    return [full]


def _json_data(value) -> bool:
    """True for JSON data (what a parsed tool call's argument can hold), whose repr is a Python literal."""
    if value is None or isinstance(value, (bool, int, str)):
        return True
    if isinstance(value, float):
        return math.isfinite(value)  # repr(nan) is the name `nan`, not a literal
    if isinstance(value, list):
        return all(_json_data(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _json_data(v) for k, v in value.items())
    return False


def _class_methods(classes: list[str]) -> dict[str, inspect.Signature]:
    """Public method name -> signature, over the entry's classes, as BFCL's executor maps names (the last class
    with a name wins)."""
    import importlib

    methods = {}
    for class_name in classes:
        cls = getattr(importlib.import_module(CLASS_FILE_PATH_MAPPING[class_name]), class_name)
        for name, fn in inspect.getmembers(cls, predicate=inspect.isfunction):
            if not name.startswith("_"):
                methods[name] = inspect.signature(fn)
    return methods


class BfclEnv:
    """BFCL-V3 multi-turn: one category, or all four ("multi_turn")."""

    def __init__(self, category: str = "multi_turn"):
        self.categories = category_of(category)
        self.name = f"bfcl:{category}"
        self._tasks: list[Task] | None = None
        self._methods: dict[tuple, dict] = {}  # involved classes -> their public methods

    # ---- what the agent is shown
    def tasks(self, split: str) -> list[Task]:
        if split != "test":
            raise ValueError(f"unknown split {split!r} for {self.name}: BFCL has only 'test' (every entry)")
        if self._tasks is None:
            self._tasks = []
            for category in self.categories:
                entries = bfcl_utils.load_dataset_entry(category)
                truth = {g["id"]: g["ground_truth"] for g in bfcl_utils.load_ground_truth_entry(category)}
                for entry in entries:
                    questions = [" ".join(m["content"] for m in turn) for turn in entry["question"]]
                    self._tasks.append(Task(
                        id=entry["id"], user_scenario="\n".join(q for q in questions if q),
                        data={"entry": entry, "ground_truth": truth[entry["id"]]},
                        # category: eval.py reports pass^1 per category and their mean; user_sim: the data is the user
                        meta={"category": category, "user_sim": {"scripted": True}}))
        return self._tasks

    def system_prompt(self, task: Task) -> str:
        return SYSTEM_PROMPT

    def tools(self, task: Task) -> list[dict]:
        return [openai_schema(doc) for doc in task.data["entry"]["function"]]

    def tools_at(self, task: Task, messages: list[dict]) -> list[dict]:
        """The tools after `messages`: those of the start plus the miss_func functions revealed so far (for API
        agents, whose tool list can change between calls)."""
        held = task.data["entry"].get("missed_function") or {}
        asked = sum(m["role"] == "user" for m in messages)
        revealed = [doc for turn, docs in held.items() if int(turn) < asked for doc in docs]
        return self.tools(task) + [openai_schema(doc) for doc in revealed]

    def user_tools(self, task: Task) -> list[dict]:
        return []

    def scripted_user(self, task: Task) -> BfclUser:
        return BfclUser(task.data["entry"])

    def expert(self, task: Task) -> GoldAgent:
        """The ground truth as an agent: each turn's calls in one message, then a short text answer."""
        return GoldAgent(self, task)

    # ---- episodes
    def start(self, task: Task) -> BfclSession:
        return BfclSession(self, task)

    def methods(self, classes: list[str]) -> dict[str, inspect.Signature]:
        key = tuple(classes)
        if key not in self._methods:
            self._methods[key] = _class_methods(classes)
        return self._methods[key]


def turn_message(entry: dict, turn: int) -> str:
    """The user's message that opens `turn`: the question, or for a miss_func turn that reveals held-out functions,
    BFCL's prompt with their docs (as it gives them to local models)."""
    held = (entry.get("missed_function") or {}).get(str(turn))
    if held:
        return DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_PROMPTING.format(functions=held)
    return "\n".join(m["content"] for m in entry["question"][turn])


class BfclUser:
    """The entry's questions, one per user turn; a stop marker after the last."""

    def __init__(self, entry: dict):
        self.entry = entry

    def opening(self) -> str:
        return turn_message(self.entry, 0)

    def reply(self, messages: list[dict]) -> str:
        asked = sum(m["role"] == "user" for m in messages)
        if asked >= len(self.entry["question"]):
            return "###STOP###"
        return turn_message(self.entry, asked)


def parse_call(text: str, methods: dict[str, inspect.Signature]) -> tuple[str, dict]:
    """A BFCL call string ("sort('a.pdf')", "cd(folder='x')") as (name, keyword arguments): positional arguments
    get their parameter names from the method's signature. Values must be literals."""
    node = ast.parse(text, mode="eval").body
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
        raise ValueError(f"not a function call: {text!r}")
    name = node.func.id
    params = [p for p in methods[name].parameters if p != "self"]
    args = {params[i]: ast.literal_eval(a) for i, a in enumerate(node.args)}
    args.update({k.arg: ast.literal_eval(k.value) for k in node.keywords})
    return name, args


class GoldAgent:
    """Plays the ground truth: at each user turn, all its calls in one assistant message (one step, as the checker
    would run them in order), then "Done." once the results are back (or at once for a turn without calls)."""

    def __init__(self, env: BfclEnv, task: Task, ground_truth: list[list[str]] | None = None):
        self.task, self.n = task, 0
        self.ground_truth = task.data["ground_truth"] if ground_truth is None else ground_truth
        self.methods = env.methods(task.data["entry"]["involved_classes"])

    def act(self, messages: list[dict]) -> dict:
        turn = sum(m["role"] == "user" for m in messages) - 1
        calls = self.ground_truth[turn] if 0 <= turn < len(self.ground_truth) else []
        if messages[-1]["role"] == "tool" or not calls:
            return {"role": "assistant", "content": "Done."}
        tool_calls = []
        for text in calls:
            self.n += 1
            name, args = parse_call(text, self.methods)
            tool_calls.append({"id": f"gold_{self.n}", "type": "function",
                               "function": {"name": name, "arguments": json.dumps(args)}})
        return {"role": "assistant", "content": "", "tool_calls": tool_calls}


def _free(prefix: str) -> None:
    """Delete the executor's cached API instances whose names start with `prefix`."""
    store = vars(multi_turn_utils)
    for key in [k for k in store if k.startswith(prefix)]:
        del store[key]


class BfclSession:
    """One episode: its own instances of the entry's simulated APIs, under a name no other episode uses."""

    def __init__(self, env: BfclEnv, task: Task):
        self.env, self.task = env, task
        self.entry, self.category = task.data["entry"], task.meta["category"]
        self.model_name = f"muarl_{uuid.uuid4().hex}"  # the executor's key for this episode's instances
        self.methods = env.methods(self.entry["involved_classes"])
        self.calls: list[str] = []  # call strings executed, in order
        # Frees the instances if the episode is dropped unscored (an infrastructure failure).
        self._finalizer = weakref.finalize(self, _free, self.model_name + "_")

    def call_string(self, name, arguments) -> str:
        """The Python call BFCL's executor will eval, built only from checked parts. Raises ValueError naming the
        problem."""
        if not isinstance(name, str) or name not in self.methods:
            raise ValueError(f"unknown tool {name!r}; the tools are {', '.join(sorted(self.methods))}")
        if not isinstance(arguments, dict):
            raise ValueError(f"tool arguments must be a JSON object, not {type(arguments).__name__}")
        for key, value in arguments.items():
            if not (isinstance(key, str) and key.isidentifier() and not keyword.iskeyword(key)):
                raise ValueError(f"argument name {key!r} is not a Python identifier")
            if not _json_data(value):
                raise ValueError(f"argument {key!r} is not JSON data")
        # As BFCL turns a function-calling model's call into the string it executes.
        return f"{name}({','.join(f'{k}={v!r}' for k, v in arguments.items())})"

    def call_tool(self, name: str, arguments, requestor: str = "assistant",
                  n_messages: int | None = None) -> ToolResult:
        """Run one call through BFCL's executor on this episode's instances. Never raises on bad input: a bad name,
        arguments or a call that raised come back as an error observation."""
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError as e:
                return ToolResult(f"Error: tool arguments are not valid JSON: {e}", error=True)
        try:
            call = self.call_string(name, arguments)
        except ValueError as e:
            return ToolResult(f"Error: {e}", error=True)
        self.calls.append(call)
        results, _ = multi_turn_utils.execute_multi_turn_func_call(
            [call], self.entry["initial_config"], self.entry["involved_classes"], self.model_name, self.entry["id"],
            long_context="long_context" in self.category)
        return ToolResult(results[0], error=results[0].startswith("Error during execution"))

    def model_turns(self, messages: list[dict]) -> tuple[list[list[list[str]]], bool]:
        """The episode's calls as BFCL's checker takes them: per user turn, per step (an assistant message with
        calls), the call strings; calls that could not run are left out. Applies BFCL's step limit (module doc).
        Returns (turns, whether the limit cut the episode)."""
        turns: list[list[list[str]]] = []
        for m in messages:
            if m["role"] == "user":
                if any(marker in (m.get("content") or "") for marker in USER_STOP_MARKERS):
                    break
                turns.append([])
            elif m["role"] == "assistant" and m.get("tool_calls") and turns:
                step = []
                for c in m["tool_calls"]:
                    try:
                        args = c["function"].get("arguments") or "{}"
                        step.append(self.call_string(c["function"]["name"],
                                                     json.loads(args) if isinstance(args, str) else args))
                    except (ValueError, TypeError, KeyError):
                        continue
                if step:
                    turns[-1].append(step)
                    if len(turns[-1]) > MAXIMUM_STEP_LIMIT:
                        return turns, True
        return turns, False

    def reward(self, messages: list[dict]) -> tuple[float, dict]:
        """1.0 when BFCL's multi-turn checker accepts the episode, else 0.0; the checker's verdict as the info.
        Frees the episode's instances (the session is done once scored; scoring again replays from scratch)."""
        turns, force_quit = self.model_turns(messages)
        ground_truth = self.task.data["ground_truth"]
        info = {"category": self.category, "turns": len(turns), "gold_turns": len(ground_truth),
                "steps": [len(t) for t in turns], "force_quit": force_quit}
        try:
            if len(turns) != len(ground_truth):
                # BFCL's evaluation: an entry whose inference stopped early fails without a replay.
                info.update(valid=False, error_type="multi_turn:force_terminated")
                return 0.0, info
            for side in ("_eval_", "_ground_truth_eval_"):  # the checker's replays start from the initial state
                _free(self.model_name + side)
            verdict = multi_turn_checker(turns, ground_truth, copy.deepcopy(self.entry), self.category,
                                         self.model_name)
        finally:
            _free(self.model_name + "_")
        info.update(valid=bool(verdict["valid"]), error_type=verdict.get("error_type", ""),
                    error_message=verdict.get("error_message", ""))
        return float(verdict["valid"]), info
