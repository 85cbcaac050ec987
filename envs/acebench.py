"""ACEBench Agent (multi-turn and multi-step) from a checkout of its repository, behind muarl's interface.

    git clone https://github.com/ACEBench/ACEBench        # MIT; not on PyPI
    env = make_env("acebench:agent", root="ACEBench")     # or ACEBENCH_ROOT=...; "acebench:multi_turn" / ":multi_step"
    task = env.tasks("test")[0]                            # 30 multi-turn + 20 multi-step entries (English)
    reward, info = env.start(task).reward(messages)        # ACEBench's end-to-end state check

Everything benchmark-specific is read from the checkout: the entries and their answers
(data_all/data_en/data_agent_{multi_turn,multi_step}.json and possible_answer/), the simulated APIs
(model_inference/<multi_turn|multi_step>/scenariosen/, standard library only), the agent's domain prompts
(model_inference/prompt_en.py), the user simulator's prompts (model_inference/multi_turn/APIModel_user.py) and
which attributes of each API are scored (SAVED_CLASS, model_inference/apimodel_inference.py). Prompts and
SAVED_CLASS are read as literals from the source (ast), without running those files (they import openai).

* Multi-turn entries have an LLM user (eval.py --user-sim openai | hf) playing ACEBench's user prompt with the
  entry's instruction, opening on ACEBench's greeting; its "finish conversation" ends the dialogue. Multi-step
  entries have no user: the question opens the episode and the agent's first answer without a tool call ends it
  (ACEBench ends on the agent's "finish conversation"); they are played from the data whichever user simulator is
  chosen (meta["user_sim"]["scripted"]).
* Execution as ACEBench's executor does it: every involved API is built fresh per episode and loaded with its own
  config, then with BaseApi's; a call runs on every involved API that has the method, the last one's return is
  the result. Here the method is called directly (no eval); the name must be a public method of an involved API.
* Reward: ACEBench's end-to-end check. The scored attributes of every involved API (SAVED_CLASS), after a JSON
  round trip (its answers went through JSON files: integer keys are strings there), against the answer: as many
  APIs as the answer has, and for each of the model's attributes, equal to the answer's, or, where the answer's is
  a dict, equal on every key of the answer's. An answer API that names no involved API is not checked (ACEBench's
  checker then reuses the previous API's verdict; two answers of the real data misspell a class name:
  "Reminderpi", "BaseAPI"). An episode in which no call ran has no state to score and fails, as in ACEBench.
* The Agent score is the unweighted mean of the two categories' accuracies (eval.py: category_mean).

Not the same as ACEBench's own runs, stated here: its agent protocol is text calls (`[f(a='x')]` parsed from the
reply) with the whole history as one prompt; here the agent uses native tool calls and a chat, so scores are not
strictly comparable with the paper's. Its prompt's text-call rules are left out; the domain prompt (multi-turn)
and the step-by-step rules (multi-step) are kept. A batch of calls that raises counts as not run in ACEBench even
for the calls before the failure; here each call counts on its own.
"""
from __future__ import annotations

import ast
import copy
import importlib
import inspect
import json
import os
import sys
from pathlib import Path

from envs import Task, ToolResult, openai_schema

KINDS = ("multi_turn", "multi_step")
# ACEBench's class name -> module under model_inference/<kind>/scenariosen/
MODULES = {"BaseApi": "phone_platform.base_api", "MessageApi": "phone_platform.message",
           "ReminderApi": "phone_platform.reminder", "FoodPlatform": "phone_platform.food_services",
           "Travel": "travel"}
# ACEBench's multi-turn user opens on this agent greeting (APIModel_user.get_init_prompt); its end marker.
GREETING = "Is there anything you need help with today?"
FINISH = "finish conversation"
# Multi-step: ACEBench's agent rules without the text-call format (its prompt is only the format and these).
MULTI_STEP_PROMPT = """You are an AI system that completes the user's task with the provided tools.
- If a task requires multiple steps (with strict sequential relationships between steps), execute them step by step, \
and decide how to proceed based on the results returned from each execution.
- Generally do not use parallel calls: call one function at a time.
- When you believe the task is completed, reply without a tool call."""


def literals(path: Path, names: list[str]) -> dict:
    """Module-level constants of a Python file, read with ast (the file is not run). Raises naming what is missing."""
    if not path.exists():
        raise FileNotFoundError(f"ACEBench checkout: {path} is missing")
    found = {}
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            if node.targets[0].id in names:
                found[node.targets[0].id] = ast.literal_eval(node.value)
    missing = [n for n in names if n not in found]
    if missing:
        raise ValueError(f"ACEBench checkout: {path} does not define {', '.join(missing)}")
    return found


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        raise FileNotFoundError(f"ACEBench checkout: {path} is missing")
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


class AceBenchEnv:
    """ACEBench's agent entries: "agent" (both kinds), "multi_turn" or "multi_step". `root`: the checkout
    (default: $ACEBENCH_ROOT)."""

    def __init__(self, category: str = "agent", root: str | None = None):
        kinds = {"agent": KINDS, "multi_turn": ("multi_turn",), "multi_step": ("multi_step",)}
        if category not in kinds:
            raise ValueError(f"unknown ACEBench category {category!r}: use agent, multi_turn or multi_step")
        root = root or os.environ.get("ACEBENCH_ROOT")
        if not root:
            raise ValueError("acebench needs a checkout of github.com/ACEBench/ACEBench: pass --acebench-root DIR "
                             "(eval.py) or set ACEBENCH_ROOT")
        self.root, self.kinds, self.name = Path(root), kinds[category], f"acebench:{category}"
        if not (self.root / "data_all" / "data_en").is_dir():
            raise FileNotFoundError(f"{self.root} is not an ACEBench checkout: data_all/data_en/ is missing")
        inference = self.root / "model_inference"
        self.prompts = literals(inference / "prompt_en.py", ["BASE_PROMPT_EN", "TRAVEL_PROMPT_EN"])
        self.user_prompts = literals(inference / "multi_turn" / "APIModel_user.py",
                                     ["SYSTEM_PROMPT_BASE_EN", "SYSTEM_PROMPT_TRAVEL_EN"])
        self.saved = literals(inference / "apimodel_inference.py", ["SAVED_CLASS"])["SAVED_CLASS"]
        self._classes: dict[tuple[str, str], type] = {}
        self._tasks: list[Task] | None = None

    # ---- what the agent and the user simulator are shown
    def tasks(self, split: str) -> list[Task]:
        if split != "test":
            raise ValueError(f"unknown split {split!r} for {self.name}: ACEBench has only 'test'")
        if self._tasks is None:
            self._tasks = []
            data = self.root / "data_all" / "data_en"
            for kind in self.kinds:
                answers = {a["id"]: a for a in read_jsonl(data / "possible_answer" / f"data_agent_{kind}.json")}
                for entry in read_jsonl(data / f"data_agent_{kind}.json"):
                    if entry["id"] not in answers:
                        raise ValueError(f"ACEBench checkout: no answer for {entry['id']}")
                    self._tasks.append(self._task(kind, entry, answers[entry["id"]]))
        return self._tasks

    def _task(self, kind: str, entry: dict, answer: dict) -> Task:
        classes = entry["involved_classes"]
        if kind == "multi_step":
            user = {"scripted": True}  # no user: the question, then the agent alone
        else:  # ACEBench's user prompt: the phone-platform one wherever BaseApi is involved, else the travel one
            template = self.user_prompts["SYSTEM_PROMPT_BASE_EN" if "BaseApi" in classes else "SYSTEM_PROMPT_TRAVEL_EN"]
            user = {"system_prompt": template.format(instruction=entry["question"]), "greeting": GREETING,
                    "stop": FINISH}
        truth = answer["ground_truth"]
        return Task(id=entry["id"], user_scenario=entry["question"],
                    data={"kind": kind, "entry": entry, "ground_truth": truth if isinstance(truth, list) else [truth]},
                    meta={"category": f"agent_{kind}", "user_sim": user})

    def system_prompt(self, task: Task) -> str:
        if task.data["kind"] == "multi_step":
            return MULTI_STEP_PROMPT
        classes = task.data["entry"]["involved_classes"]  # ACEBench appends the travel, then the phone prompt
        parts = [self.prompts["TRAVEL_PROMPT_EN"]] * ("Travel" in classes) + [self.prompts["BASE_PROMPT_EN"]] * (
            "BaseApi" in classes)
        return "\n\n".join(p.strip() for p in parts)

    def tools(self, task: Task) -> list[dict]:
        return [openai_schema(doc) for doc in task.data["entry"]["function"]]

    def user_tools(self, task: Task) -> list[dict]:
        return []

    def scripted_user(self, task: Task) -> AceBenchStepUser:
        if task.data["kind"] == "multi_turn":
            raise NotImplementedError("ACEBench's multi-turn entries need an LLM user: --user-sim openai or hf")
        return AceBenchStepUser(task.data["entry"]["question"])

    # ---- episodes
    def start(self, task: Task) -> AceBenchSession:
        return AceBenchSession(self, task)

    def scenario_class(self, kind: str, name: str) -> type:
        """An ACEBench API class from the checkout. Its modules import each other as `model_inference...`, so the
        checkout is on sys.path while they load; they are then dropped from sys.modules, so that another checkout
        (or a test's fixture) can load its own."""
        if (kind, name) not in self._classes:
            if name not in MODULES:
                raise ValueError(f"unknown ACEBench API class {name!r}: known are {', '.join(MODULES)}")
            others = _pop_modules()
            sys.path.insert(0, str(self.root))
            try:
                module = importlib.import_module(f"model_inference.{kind}.scenariosen.{MODULES[name]}")
                self._classes[kind, name] = getattr(module, name)
            finally:
                sys.path.remove(str(self.root))
                _pop_modules()
                sys.modules.update(others)
        return self._classes[kind, name]


def _pop_modules() -> dict:
    return {k: sys.modules.pop(k) for k in list(sys.modules) if k.split(".")[0] == "model_inference"}


class AceBenchStepUser:
    """Multi-step entries: the question, then nothing to add (the episode ends when the agent answers)."""

    def __init__(self, question: str):
        self.question = question

    def opening(self) -> str:
        return self.question

    def reply(self, messages: list[dict]) -> str:
        return "###STOP###"


class AceBenchSession:
    """One episode: fresh instances of the entry's APIs."""

    def __init__(self, env: AceBenchEnv, task: Task):
        self.env, self.task = env, task
        entry, kind = task.data["entry"], task.data["kind"]
        config = entry.get("initial_config") or {}
        self.apis = {}
        for name in entry["involved_classes"]:
            api = env.scenario_class(kind, name)()
            # ACEBench's executor: the class's own config, then BaseApi's (a second _load_scenario call)
            api._load_scenario(copy.deepcopy(config.get(name, {})), long_context=False)
            api._load_scenario(copy.deepcopy(config.get("BaseApi", {})), long_context=False)
            self.apis[name] = api
        self.ran = 0  # calls that ran without raising

    def methods(self) -> set[str]:
        return {m for api in self.apis.values() for m, _ in inspect.getmembers(api, inspect.ismethod)
                if not m.startswith("_")}

    def call_tool(self, name: str, arguments, requestor: str = "assistant",
                  n_messages: int | None = None) -> ToolResult:
        """Run a call on every involved API that has the method; the last one's return is the result. Never raises
        on bad input: errors come back as observations."""
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError as e:
                return ToolResult(f"Error: tool arguments are not valid JSON: {e}", error=True)
        if not isinstance(arguments, dict):
            return ToolResult(f"Error: tool arguments must be a JSON object, not {type(arguments).__name__}",
                              error=True)
        methods = self.methods()
        if not isinstance(name, str) or name not in methods:
            return ToolResult(f"Error: unknown tool {name!r}; the tools are {', '.join(sorted(methods))}", error=True)
        try:
            for api in self.apis.values():
                if name in dict(inspect.getmembers(api, inspect.ismethod)):
                    result = getattr(api, name)(**arguments)
        except Exception as e:  # a wrong argument, or the API raised
            return ToolResult(f"Error during execution: {e}", error=True)
        self.ran += 1
        if isinstance(result, str):
            return ToolResult(result)
        try:
            return ToolResult(json.dumps(result) if isinstance(result, dict) else str(result))
        except (TypeError, ValueError):
            return ToolResult(str(result))

    def state(self) -> list[dict]:
        """The scored attributes of every API, as ACEBench saves them (through JSON); [] when no call ran."""
        if not self.ran:
            return []
        saved = [{name: {k: v for k, v in vars(api).items() if k in self.env.saved.get(name, [])}}
                 for name, api in self.apis.items()]
        return json.loads(json.dumps(saved, default=str))

    def reward(self, messages: list[dict]) -> tuple[float, dict]:
        """ACEBench's end-to-end check of the final state against the answer (module docstring)."""
        model, answer = self.state(), self.task.data["ground_truth"]
        errors, unchecked = [], []
        if len(model) != len(answer):
            errors.append(f"wrong number of classes: {len(model)} in the state, {len(answer)} in the answer")
        else:
            for expected in answer:
                name = next(iter(expected))
                got = next((m for m in model if set(m) == set(expected)), None)
                if got is None:  # as ACEBench: not checked (two answers name classes that do not exist)
                    unchecked.append(name)
                    continue
                errors += check_class(name, got[name], expected[name])
        reward = float(not errors)
        return reward, {"category": self.task.meta["category"], "valid": not errors, "errors": errors,
                        "unchecked_classes": unchecked, "calls_run": self.ran}


def check_class(name: str, got: dict, expected: dict) -> list[str]:
    """ACEBench's agent_checker for one API: each of the model's attributes must be in the answer and equal to it;
    where the answer's value is a dict, equal on each of the answer's keys."""
    errors = []
    for attr, value in got.items():
        if attr not in expected:
            errors.append(f"class({name}) attributes({attr}) missing in the answer")
        elif isinstance(expected[attr], dict):
            for key, want in expected[attr].items():
                if not isinstance(value, dict) or key not in value:
                    errors.append(f"class({name}) attributes({attr}) wrong: no {key!r}")
                elif value[key] != want:
                    errors.append(f"class({name}) attributes({attr}.{key}) wrong: expected {want!r}, "
                                  f"got {value[key]!r}")
        elif value != expected[attr]:
            errors.append(f"class({name}) attributes({attr}) wrong: expected {expected[attr]!r}, got {value!r}")
    return errors
