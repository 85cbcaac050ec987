"""One episode, every way of playing it. The episode rule (envs.next_turn, envs.score) ends and scores the episodes
of the batched rollout, the reference rollout, envs.play (scripted experts), API agents (eval.py) and cold-start
synthesis (sft.py); an episode a cap cut off scores 0 whichever of them played it, as tau2 scores it."""
import pytest
import torch

from plumbing import coldstart
import eval as evaluation
import sft
from fast.batched_rollout import RolloutConfig, rollout
from plumbing.users import make_user_sim
from conftest import ChatServer
from envs import make_env, play

MAX_TURNS = 4  # cold-start synthesis plays with envs.play's default, 30: CappedEnv's user outlasts both


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("name, expected", [("RightEnv", (1.0, "user_stop")), ("CappedEnv", (0.0, "max_turns"))])
def test_every_way_of_playing_an_episode_scores_it_alike(name, expected, lm, tiny_tok, monkeypatch):
    """tests/fake_env.py: the database is right from the start; RightEnv's user stops after two replies, CappedEnv's
    never does, so its episodes end at the turn cap (MAX_TURNS; envs.play's 30 for the cold start). The environment says 1 for all of them; the rule says 0 for the
    cut-off ones, on every path."""
    env = make_env(f"tests.fake_env:{name}", n_tasks=2)
    tasks = env.tasks("train")
    cfg = RolloutConfig(greedy=True, max_new_tokens=256, max_turns=MAX_TURNS, max_context=4096)
    outcomes = {"rollout": [(e.reward, e.termination, e.reward_info)
                            for e in rollout(lm, tiny_tok, env, tasks, 2, make_user_sim("scripted"), cfg)],
                "expert (envs.play)": [(r, term, info) for _, r, info, term in
                                       (play(env, t, env.expert(t), max_turns=MAX_TURNS) for t in tasks)]}
    monkeypatch.setenv("OPENAI_API_KEY", "k")
    server = ChatServer(lambda body, n: (200, {"content": "Anything else?"}))  # an API model that never stops
    try:
        api = evaluation.run_api_agent(evaluation.EvalConfig(agent="openai:m", agent_base_url=server.url,
                                                             max_turns=MAX_TURNS), env, tasks)
    finally:
        server.close()
    outcomes["API agent (eval.py)"] = [(e["reward"], e["termination"], e["reward_info"]) for e in api]
    for path, results in outcomes.items():
        for reward, termination, info in results:
            assert (reward, termination) == expected, path
            if termination == "max_turns":
                assert info["env_reward"] == 1.0 and info["ended_early"] == "max_turns", path
    kept = coldstart.make_cold_start(sft.SFTConfig(env=f"tests.fake_env:{name}", num_tasks=2))
    assert len(kept) == (2 if expected[0] == 1.0 else 0)  # only finished episodes are cold-start data


def test_the_episode_vocabulary_is_typed_and_reads_as_before():
    """Who speaks next (envs.Speaker), why an episode ended (envs.Termination) and why a turn stopped sampling
    (muarl.TurnEnd) are separate typed words; each still compares, formats and serializes as the plain string the
    logs, metrics and episodes.jsonl have always held, and every ending is one the metric table names."""
    import json

    from envs import STOP_TOOLS, USER_STOP_MARKERS, Speaker, Termination, next_turn
    from muarl import TurnEnd
    from plumbing.metrics import METRICS

    user, text = {"role": "user", "content": "hi"}, {"role": "assistant", "content": "Which order?"}
    tool = {"role": "tool", "tool_call_id": "c", "name": "get_order", "content": "{}"}
    assert next_turn([user], 0, 30) is Speaker.AGENT
    assert next_turn([{"role": "user", "content": f"bye {USER_STOP_MARKERS[0]}"}], 3, 30) is Termination.USER_STOP
    assert next_turn([user, text], 1, 30) is Speaker.USER
    assert next_turn([user, text, tool], 1, 30) is Speaker.AGENT
    assert next_turn([user, text, tool], 1, 30, stop_tool_ran=True) is Termination.TRANSFER and STOP_TOOLS
    assert next_turn([user, text], 30, 30) is Termination.MAX_TURNS
    assert not set(Speaker) & set(Termination) and not set(map(str, TurnEnd)) & set(map(str, Termination))
    for word in [*Speaker, *Termination, *TurnEnd]:
        assert word == word.value and f"{word}" == str(word) == word.value
        assert json.loads(json.dumps({"termination": word})) == {"termination": word.value}
    described = METRICS["termination/<reason>"]
    assert all(t.value in described for t in Termination), described
