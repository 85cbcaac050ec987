"""BFCL-V3 multi-turn through bfcl-eval: the ground truth of every entry scores 1 through the environment, a changed
call scores 0, model output never reaches the executor's eval unchecked, and episodes never share state."""
import copy
import json
import time

import pytest

from envs import make_env, play

bfcl = pytest.importorskip("envs.bfcl")  # bfcl-eval comes from requirements-nodeps.txt


@pytest.fixture(scope="module")
def env():
    return make_env("bfcl:multi_turn")


def by_id(env, task_id):
    return next(t for t in env.tasks("test") if t.id == task_id)


def test_tasks_and_names(env):
    tasks = env.tasks("test")
    assert len(tasks) == 800 and len({t.id for t in tasks}) == 800
    assert {t.meta["category"] for t in tasks} == set(bfcl.CATEGORIES)
    assert len(make_env("bfcl:miss_func").tasks("test")) == 200
    assert [t.id for t in make_env("bfcl:multi_turn_base").tasks("test")] == [t.id for t in tasks[:200]]
    with pytest.raises(ValueError, match="unknown BFCL category"):
        make_env("bfcl:simple")
    with pytest.raises(ValueError, match="only 'test'"):
        env.tasks("train")


def test_tools_are_openai_schemas(env):
    for task in env.tasks("test")[::50]:
        for tool in env.tools(task):
            fn = tool["function"]
            assert tool["type"] == "function" and fn["parameters"]["type"] == "object"
            assert "response" not in fn
            types = json.dumps(fn["parameters"])
            assert '"dict"' not in types and '"float"' not in types and '"tuple"' not in types


def test_gold_replay_conformance(env):
    """Every entry of the four categories: its ground truth, played through the environment (scripted user,
    BFCL's executor, BFCL's checker), scores 1; the same with one call changed scores 0."""
    t0, ok, broken, changed = time.time(), {}, {}, 0
    for task in env.tasks("test"):
        messages, reward, info, termination = play(env, task, env.expert(task), max_turns=100)
        assert termination == "user_stop"
        ok[task.meta["category"]] = ok.get(task.meta["category"], 0) + (reward == 1.0)
        # One changed call: the last call of the last turn with ground truth gets a wrong last argument value.
        gold = copy.deepcopy(task.data["ground_truth"])
        turn = max(i for i, calls in enumerate(gold) if calls)
        name, args = bfcl.parse_call(gold[turn][-1], env.methods(task.data["entry"]["involved_classes"]))
        if not args:
            continue
        key = list(args)[-1]
        args[key] = "zzz_changed" if isinstance(args[key], str) else [] if isinstance(args[key], list) else -987654
        gold[turn][-1] = f"{name}({','.join(f'{k}={v!r}' for k, v in args.items())})"
        agent = bfcl.GoldAgent(env, task, ground_truth=gold)
        _, reward, _, _ = play(env, task, agent, max_turns=100)
        changed += 1
        broken[task.meta["category"]] = broken.get(task.meta["category"], 0) + (reward == 0.0)
    print(f"\nBFCL gold replay scoring 1: {ok} ({sum(ok.values())}/800); one call changed scoring 0: {broken} "
          f"({sum(broken.values())}/{changed}) in {time.time() - t0:.1f} s")
    assert ok == {c: 200 for c in bfcl.CATEGORIES}
    # The checker compares state and results only: a change it cannot see passes (7 of base's 173, e.g. another
    # message text to customer support, whose answer does not depend on it, or an empty grep's pattern).
    assert sum(broken.values()) >= 0.9 * changed


def test_changed_call_scores_zero(env):
    task = by_id(env, "multi_turn_base_0")
    gold = copy.deepcopy(task.data["ground_truth"])
    first = next(i for i, calls in enumerate(gold) if calls)
    gold[first][0] = gold[first][0].replace("'", "'x_", 1)  # a different argument in the first call
    _, reward, info, _ = play(env, task, bfcl.GoldAgent(env, task, ground_truth=gold), max_turns=100)
    assert reward == 0.0 and not info["valid"] and info["error_type"]
    _, reward, info, _ = play(env, task, env.expert(task), max_turns=100)
    assert reward == 1.0 and info["valid"]


def test_injection_is_an_error_observation_and_runs_nothing(env, tmp_path):
    """Names and argument names are checked before BFCL's executor builds its eval string."""
    marker = tmp_path / "pwned"
    session = env.start(by_id(env, "multi_turn_base_0"))
    attempts = [
        (f"__import__('os').system", {"command": f"touch {marker}"}),
        ("ls", {"a=__import__('os').system('touch " + str(marker) + "'),b": 1}),
        ("ls", {"1x": 1}),
        ("ls", {"lambda": 1}),
        ("_load_scenario", {"scenario": {}}),
        ("eval", {"source": "1"}),
        ("cd", {"folder": float("nan")}),
        ("cd", "{not json"),
        ("cd", ["document"]),
    ]
    for name, args in attempts:
        result = session.call_tool(name, args)
        assert result.error and result.content.startswith("Error:"), (name, args, result)
    assert not marker.exists()
    assert session.calls == []  # nothing reached the executor
    # A value is a literal however it looks: it reaches the file system as text.
    session.call_tool("cd", {"folder": "document"})
    result = session.call_tool("touch", {"file_name": f"x'); __import__('os').system('touch {marker}'); ('"})
    assert not marker.exists() and len(session.calls) == 2
    # A wrong argument name that is an identifier runs and fails inside the method, as an observation.
    result = session.call_tool("cd", {"directory": "x"})
    assert result.error and "unexpected keyword argument" in result.content


def test_fresh_state_per_episode_and_freed_after_scoring(env):
    """The same entry twice, and two sessions side by side: each starts from the initial state, and the executor's
    cache holds nothing of an episode once it is scored."""
    from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_utils

    task = by_id(env, "multi_turn_base_0")
    a, b = env.start(task), env.start(task)
    assert a.call_tool("mkdir", {"dir_name": "only_in_a"}).error is False
    assert "only_in_a" in a.call_tool("ls", {}).content
    assert "only_in_a" not in b.call_tool("ls", {}).content
    for _ in range(2):
        session = env.start(task)
        assert "only_in_a" not in session.call_tool("ls", {}).content
        messages, reward, _, _ = play(env, task, env.expert(task), max_turns=100, session=session)
        assert reward == 1.0
        assert not [k for k in vars(multi_turn_utils) if k.startswith(session.model_name)]
        assert session.reward(messages)[0] == 1.0  # scoring again replays from the initial state
    for s in (a, b):
        s.reward([])
        assert not [k for k in vars(multi_turn_utils) if k.startswith(s.model_name)]


def test_scripted_user_and_miss_func(env):
    """The user is the data: one question per turn, BFCL's held-out-function prompt at a miss_func turn, a stop
    marker after the last; API agents get the revealed tools from then on."""
    task = by_id(env, "multi_turn_miss_func_0")
    entry = task.data["entry"]
    held = entry["missed_function"]["3"][0]["name"]
    assert held not in {t["function"]["name"] for t in env.tools(task)}
    messages, reward, _, _ = play(env, task, env.expert(task), max_turns=100)
    assert reward == 1.0
    users = [m["content"] for m in messages if m["role"] == "user"]
    assert len(users) == len(entry["question"]) + 1 and users[-1] == "###STOP###"
    assert users[0] == entry["question"][0][0]["content"]
    assert "I have updated some more functions" in users[3] and f"'name': '{held}'" in users[3]
    before = messages[:messages.index(next(m for m in messages if m.get("content") == users[3]))]
    assert held not in {t["function"]["name"] for t in env.tools_at(task, before)}
    assert held in {t["function"]["name"] for t in env.tools_at(task, messages)}


def test_step_limit_and_early_end(env):
    """More than 20 steps in one turn is BFCL's force quit; an episode that ends before the last turn fails."""
    task = by_id(env, "multi_turn_base_0")
    session = env.start(task)
    messages, _, _, _ = play(env, task, env.expert(task), max_turns=100, session=session)
    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    looping = [{"role": "assistant", "content": "", "tool_calls": [{"id": f"l{i}", "type": "function",
                "function": {"name": "pwd", "arguments": "{}"}}]} for i in range(21)]
    reward, info = env.start(task).reward(messages[:first] + looping + messages[first:])
    assert reward == 0.0 and info["force_quit"] and info["steps"] == [21]
    reward, info = env.start(task).reward(messages[:first] + looping[:19] + messages[first:])
    assert reward == 1.0 and not info["force_quit"]  # extra harmless steps within the limit are fine
    cut = messages[:[i for i, m in enumerate(messages) if m["role"] == "user"][2]]
    reward, info = env.start(task).reward(cut)
    assert reward == 0.0 and info["error_type"] == "multi_turn:force_terminated"


def test_malformed_calls_in_messages_do_not_crash_scoring(env):
    task = by_id(env, "multi_turn_base_0")
    messages, _, _, _ = play(env, task, env.expert(task), max_turns=100)
    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    bad = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "b1", "type": "function", "function": {"name": "__import__('os').system", "arguments": "{}"}},
        {"id": "b2", "type": "function", "function": {"name": "ls", "arguments": "{oops"}},
        {"id": "b3", "type": "function", "function": {"name": "ls", "arguments": '{"a b": 1}'}}]}
    reward, info = env.start(task).reward(messages[:first] + [bad] + messages[first:])
    assert reward == 1.0 and info["steps"][0] == 1  # the bad step is left out; the rest still scores


def test_eval_with_an_api_agent(env, tmp_path, monkeypatch):
    """eval.py with an OpenAI-compatible agent (a local endpoint that answers with the ground truth): per-category
    pass^1 and their mean in the summary; on miss_func the held-out tool reaches the API's tool list at its turn."""
    import eval as evaluation
    from test_rollout import ChatServer

    task = by_id(env, "multi_turn_miss_func_0")
    methods = env.methods(task.data["entry"]["involved_classes"])
    seen_tools = []

    def script(body, n):
        messages = body["messages"]
        turn = sum(m["role"] == "user" for m in messages) - 1
        seen_tools.append((turn, {t["function"]["name"] for t in body["tools"]}))
        calls = task.data["ground_truth"][turn]
        if messages[-1]["role"] == "tool" or not calls:
            return 200, {"content": "Done."}
        return 200, {"content": None, "tool_calls": [
            {"id": f"c{n}_{i}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
            for i, (name, args) in enumerate(bfcl.parse_call(c, methods) for c in calls)]}

    server = ChatServer(script)
    monkeypatch.setenv("OPENAI_API_KEY", "k")
    try:
        evaluation.main(["--agent", "openai:gold", "--agent-base-url", server.url, "--env", "bfcl:miss_func",
                         "--num-tasks", "1", "--user-sim", "openai", "--user-base-url", "http://127.0.0.1:9/v1",
                         "--out-dir", str(tmp_path / "ev")])
    finally:
        server.close()
    s = json.loads((tmp_path / "ev" / "summary.json").read_text())
    assert s["pass^1"] == 1.0 and s["category_mean"] == 1.0  # the data's user, though an LLM user was asked for
    assert s["by_meta"]["category"] == {"multi_turn_miss_func": {"pass^1": 1.0, "episodes": 1, "ci95": [1.0, 1.0]}}
    assert "mean over categories" in (tmp_path / "ev" / "results.md").read_text()
    assert all(("sort" in tools) == (turn >= 3) for turn, tools in seen_tools)


def test_rollout_with_a_checkpoint_model(env, tiny_lm, tiny_tok):
    """The token-level rollout on BFCL (what eval.py runs for a checkpoint, and grpo.py trains on): a random tiny
    model talks to the data's user and BFCL's executor, and every episode gets BFCL's verdict."""
    from fast.batched_rollout import RolloutConfig, rollout
    from plumbing.users import make_user_sim

    task = by_id(env, "multi_turn_miss_func_121")  # the smallest tool list (TradingBot only)
    eps = rollout(tiny_lm, tiny_tok, env, [task], 2, make_user_sim("hf", model=tiny_lm, tokenizer=tiny_tok),
                  RolloutConfig(greedy=True, max_new_tokens=8, max_turns=3))
    for ep in eps:
        assert not ep.infra_failed and ep.reward == 0.0
        assert ep.messages[1] == {"role": "user", "content": bfcl.turn_message(task.data["entry"], 0)}
        assert ep.termination in ("max_turns", "response_truncated", "user_stop")
        assert ep.reward_info.get("category") == "multi_turn_miss_func" or "ended_early" in ep.reward_info
