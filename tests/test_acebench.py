"""ACEBench Agent from a checkout, on a small checkout in ACEBench's layout that the tests write themselves (the
real one is not on PyPI and nothing is downloaded): data and answers, scenario classes, prompts and SAVED_CLASS
are read from it; the reward is ACEBench's end-to-end state check; the Agent score is the mean of the two kinds."""
import asyncio
import json
import re
import textwrap

import pytest

from envs import make_env, play
from envs.acebench import FINISH, GREETING, AceBenchEnv

BASE_API = '''
class BaseApi:
    def __init__(self):
        self.wifi = False
        self.logged_in = True

    def _load_scenario(self, scenario: dict, long_context=False) -> None:
        self.wifi = scenario.get("wifi", False)
        self.logged_in = scenario.get("logged_in", True)

    def turn_on_wifi(self):
        self.wifi = True
        return {"status": True, "message": "Wi-Fi has been turned on"}
'''
MESSAGE_API = '''
from model_inference.{kind}.scenariosen.phone_platform.base_api import BaseApi


class MessageApi(BaseApi):
    def __init__(self):
        super().__init__()
        self.user_list = {{"Eve": "USR100", "Frank": "USR101"}}
        self.inbox = {{1: {{"sender_id": "USR101", "receiver_id": "USR100", "message": "hello"}}}}
        self.message_id_counter = 1

    def send_message(self, sender_name: str, receiver_name: str, message: str):
        if not self.wifi:
            return {{"status": False, "message": "Wi-Fi is turned off, cannot send messages at this time"}}
        if sender_name not in self.user_list or receiver_name not in self.user_list:
            return {{"status": False, "message": "Sender or receiver does not exist"}}
        self.message_id_counter += 1
        self.inbox[self.message_id_counter] = {{"sender_id": self.user_list[sender_name],
                                               "receiver_id": self.user_list[receiver_name], "message": message}}
        return {{"status": True, "message": f"Message successfully sent to {{receiver_name}}."}}
'''
FUNCTIONS = [
    {"name": "turn_on_wifi", "description": "Turn on WiFi connection.",
     "parameters": {"type": "dict", "required": [], "properties": {}}},
    {"name": "send_message", "description": "Send a message from one user to another.",
     "parameters": {"type": "dict", "required": ["sender_name", "receiver_name", "message"], "properties": {
         "sender_name": {"type": "string", "description": "The sender."},
         "receiver_name": {"type": "string", "description": "The receiver."},
         "message": {"type": "string", "description": "The content."}}}},
]
USER_PROMPT = "You are a user interacting with an agent.\n\nInstruction: {instruction}\n\nRules:\n- When done, say 'finish conversation'."
IDS = {"Eve": "USR100", "Frank": "USR101"}


def answer(sender, receiver, text, wifi=True):
    inbox = {"1": {"sender_id": "USR101", "receiver_id": "USR100", "message": "hello"},
             "2": {"sender_id": IDS[sender], "receiver_id": IDS[receiver], "message": text}}
    return [{"BaseApi": {"wifi": wifi, "logged_in": True}}, {"MessageApi": {"inbox": inbox}}]


def entry(id_, question):
    return {"id": id_, "question": question, "initial_config": {"BaseApi": {"wifi": False, "logged_in": True}},
            "path": [], "function": FUNCTIONS, "involved_classes": ["BaseApi", "MessageApi"]}


def write_checkout(root):
    """A checkout in ACEBench's layout: one multi-turn entry, two multi-step ones."""
    data = root / "data_all" / "data_en"
    (data / "possible_answer").mkdir(parents=True)
    turn = [entry("agent_multi_turn_0", "Your name is Frank. You want to send 'lunch?' to Eve.")]
    step = [entry("agent_multi_step_0", "Send 'hi' from Eve to Frank."),
            entry("agent_multi_step_1", "Send 'bye' from Frank to Eve.")]
    answers = {"multi_turn": [{"id": "agent_multi_turn_0", "ground_truth": answer("Frank", "Eve", "lunch?"),
                               "mile_stone": []}],
               "multi_step": [{"id": "agent_multi_step_0", "ground_truth": answer("Eve", "Frank", "hi"),
                               "mile_stone": []},
                              {"id": "agent_multi_step_1", "ground_truth": answer("Frank", "Eve", "bye"),
                               "mile_stone": []}]}
    for kind, entries in (("multi_turn", turn), ("multi_step", step)):
        (data / f"data_agent_{kind}.json").write_text("".join(json.dumps(e) + "\n" for e in entries))
        (data / "possible_answer" / f"data_agent_{kind}.json").write_text(
            "".join(json.dumps(a) + "\n" for a in answers[kind]))
        scenarios = root / "model_inference" / kind / "scenariosen" / "phone_platform"
        scenarios.mkdir(parents=True)
        (scenarios / "base_api.py").write_text(BASE_API)
        (scenarios / "message.py").write_text(MESSAGE_API.format(kind=kind))
    inference = root / "model_inference"
    (inference / "prompt_en.py").write_text(
        'BASE_PROMPT_EN = """The current time is June 11, 2024. You are a mobile assistant."""\n'
        'TRAVEL_PROMPT_EN = """You are an airline agent."""\n')
    # These two import what is not installed: they are read, never run.
    (inference / "multi_turn" / "APIModel_user.py").write_text(
        f"import not_installed_anywhere\nSYSTEM_PROMPT_BASE_EN = {USER_PROMPT!r}\n"
        "SYSTEM_PROMPT_TRAVEL_EN = 'Travel user. Instruction: {instruction}'\n")
    (inference / "apimodel_inference.py").write_text(textwrap.dedent('''
        import not_installed_anywhere
        SAVED_CLASS = {"BaseApi": ["wifi", "logged_in"], "MessageApi": ["inbox"], "Travel": ["users"]}
        '''))
    return root


@pytest.fixture
def root(tmp_path):
    return write_checkout(tmp_path / "ACEBench")


class Agent:
    """Reads "send 'x' from A to B" in the first user message; turns the Wi-Fi on first unless told not to."""

    def __init__(self, wifi=True):
        self.wifi, self.n = wifi, 0

    def act(self, messages):
        said = " ".join(m["content"] for m in messages if m["role"] == "user")
        text, sender, receiver = re.search(r"'(.*?)' from (\w+) to (\w+)", said).groups()
        done = [m["name"] for m in messages if m["role"] == "tool"]
        plan = (["turn_on_wifi"] if self.wifi else []) + ["send_message"]
        if len(done) == len(plan):
            return {"role": "assistant", "content": "Sent."}
        name = plan[len(done)]
        args = {"sender_name": sender, "receiver_name": receiver, "message": text} if name == "send_message" else {}
        self.n += 1
        return {"role": "assistant", "content": "", "tool_calls": [
            {"id": f"a{self.n}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}]}


def test_tasks_prompts_and_tools_come_from_the_checkout(root, monkeypatch):
    env = make_env("acebench:agent", root=str(root))
    tasks = env.tasks("test")
    assert [t.id for t in tasks] == ["agent_multi_turn_0", "agent_multi_step_0", "agent_multi_step_1"]
    assert [t.meta["category"] for t in tasks] == ["agent_multi_turn", "agent_multi_step", "agent_multi_step"]
    turn, step = tasks[0], tasks[1]
    assert env.system_prompt(turn) == "The current time is June 11, 2024. You are a mobile assistant."
    assert turn.meta["user_sim"] == {"system_prompt": USER_PROMPT.format(instruction=turn.user_scenario),
                                     "greeting": GREETING, "stop": FINISH}
    assert step.meta["user_sim"] == {"scripted": True} and env.scripted_user(step).opening() == step.user_scenario
    with pytest.raises(NotImplementedError, match="LLM user"):
        env.scripted_user(turn)
    tool = env.tools(step)[1]["function"]
    assert tool["name"] == "send_message" and tool["parameters"]["type"] == "object"
    assert len(make_env("acebench:multi_step", root=str(root)).tasks("test")) == 2
    monkeypatch.setenv("ACEBENCH_ROOT", str(root))
    assert len(make_env("acebench:agent").tasks("test")) == 3
    monkeypatch.delenv("ACEBENCH_ROOT")
    with pytest.raises(ValueError, match="ACEBENCH_ROOT"):
        make_env("acebench:agent")
    with pytest.raises(FileNotFoundError, match="not an ACEBench checkout"):
        make_env("acebench:agent", root=str(root / "data_all"))
    with pytest.raises(ValueError, match="unknown ACEBench category"):
        make_env("acebench:normal", root=str(root))


def test_multi_step_reward_is_the_end_to_end_state_check(root):
    env = AceBenchEnv("multi_step", root=str(root))
    task = env.tasks("test")[0]
    messages, reward, info, termination = play(env, task, Agent())
    assert termination == "user_stop" and reward == 1.0 and info["valid"], info
    # The call ran on every API with the method: MessageApi's own Wi-Fi is on too, so the message went out.
    assert [m["content"] for m in messages if m["role"] == "tool"][1].startswith('{"status": true')
    _, reward, info, _ = play(env, task, Agent(wifi=False))  # the send fails: the inbox is not the answer's
    assert reward == 0.0 and any("inbox" in e for e in info["errors"]) and any("wifi" in e for e in info["errors"])
    session = env.start(task)
    reward, info = session.reward([])  # nothing ran: no state to score
    assert reward == 0.0 and "wrong number of classes" in info["errors"][0]
    _, reward, info, _ = play(env, env.tasks("test")[1], Agent())
    assert reward == 1.0


def test_state_goes_through_json_and_sessions_are_fresh(root):
    env = AceBenchEnv("multi_step", root=str(root))
    task = env.tasks("test")[0]
    a, b = env.start(task), env.start(task)
    a.call_tool("turn_on_wifi", {})
    a.call_tool("send_message", {"sender_name": "Eve", "receiver_name": "Frank", "message": "hi"})
    assert set(a.state()[1]["MessageApi"]["inbox"]) == {"1", "2"}  # integer keys, as the answers have them
    assert set(a.apis["MessageApi"].inbox) == {1, 2}
    assert a.reward([])[0] == 1.0
    assert b.apis["MessageApi"].inbox.keys() == {1} and b.apis["BaseApi"].wifi is False
    assert env.start(task).apis["MessageApi"].inbox.keys() == {1}


def test_bad_calls_are_error_observations(root):
    session = AceBenchEnv("multi_step", root=str(root)).start(AceBenchEnv("multi_step", root=str(root)).tasks("test")[0])
    for name, args in [("__import__('os').system", {}), ("_load_scenario", {"scenario": {}}), ("nope", {}),
                       ("send_message", {"to": "x"}), ("send_message", "{bad"), ("turn_on_wifi", [])]:
        result = session.call_tool(name, args)
        assert result.error and result.content.startswith("Error"), (name, result)
    assert session.ran == 0


def test_eval_agent_score_is_the_mean_of_the_two_kinds(root, tmp_path, monkeypatch):
    """eval.py on acebench:agent with an API agent and an OpenAI-compatible user (one local endpoint plays both):
    the multi-turn user gets ACEBench's prompt and greeting and ends with 'finish conversation'; multi-step
    entries never reach it. One multi-step entry fails: pass^1 2/3, Agent score (1 + 1/2) / 2."""
    import eval as evaluation
    from test_rollout import ChatServer

    def script(body, n):
        messages = body["messages"]
        if body["model"] == "sim":  # the user: roles flipped, its own messages are `assistant`
            if len(messages) == 2:
                return 200, {"content": "Hi, please send 'lunch?' from Frank to Eve."}
            return 200, {"content": "Thanks! finish conversation"}
        said = " ".join(m["content"] for m in messages if m["role"] == "user")
        return 200, Agent(wifi="bye" not in said).act(messages)

    server = ChatServer(script)
    monkeypatch.setenv("OPENAI_API_KEY", "k")
    try:
        evaluation.main(["--agent", "openai:agent", "--agent-base-url", server.url, "--env", "acebench:agent",
                         "--acebench-root", str(root), "--user-sim", "openai", "--user-model", "sim",
                         "--user-base-url", server.url, "--out-dir", str(tmp_path / "ev")])
    finally:
        server.close()
    s = json.loads((tmp_path / "ev" / "summary.json").read_text())
    cats = s["by_meta"]["category"]
    assert {c: {k: v for k, v in r.items() if k != "ci95"} for c, r in cats.items()} == {
        "agent_multi_step": {"pass^1": 0.5, "episodes": 2}, "agent_multi_turn": {"pass^1": 1.0, "episodes": 1}}
    assert cats["agent_multi_turn"]["ci95"] == [1.0, 1.0]
    assert s["pass^1"] == pytest.approx(2 / 3) and s["category_mean"] == 0.75
    user_calls = [b for _, b in server.requests if b["model"] == "sim"]
    assert len(user_calls) == 2  # the multi-turn entry's opening and its one reply; none for multi-step
    instruction = "Your name is Frank. You want to send 'lunch?' to Eve."
    assert user_calls[0]["messages"] == [{"role": "system", "content": USER_PROMPT.format(instruction=instruction)},
                                         {"role": "user", "content": GREETING}]
    episodes = [json.loads(line) for line in (tmp_path / "ev" / "episodes.jsonl").read_text().splitlines()]
    turn = next(e for e in episodes if e["task_id"] == "agent_multi_turn_0")
    assert turn["termination"] == "user_stop" and FINISH in turn["messages"][-1]["content"]


def test_hf_user_backend_plays_acebench_user(root, tiny_lm, tiny_tok):
    from plumbing.users import make_user_sim

    env = AceBenchEnv("agent", root=str(root))
    task = env.tasks("test")[0]
    sim = make_user_sim("hf", model=tiny_lm, tokenizer=tiny_tok)
    seen = []
    sim.sim._generate = lambda convs: seen.extend(convs) or ["All done, finish conversation"] * len(convs)
    opening = asyncio.run(sim.opening(env, task))
    state = sim.start(env, task, env.start(task), opening)
    reply = asyncio.run(sim.reply(state, [{"role": "system", "content": ""}, {"role": "user", "content": opening},
                                          {"role": "assistant", "content": "Sent."}]))
    assert seen[0][0]["content"] == task.meta["user_sim"]["system_prompt"] and seen[0][1]["content"] == GREETING
    assert reply.endswith("###STOP###") and FINISH in reply
