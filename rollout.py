"""rollout.py: one episode, played turn by turn: the agent talking to a simulated user and to tools, token in, token
out. Read after muarl.py; fast/batched_rollout.py plays many at once (training's default), held to the same tokens.

    episode = reference_rollout(model, tokenizer, env, task, user_sim, Sampling(greedy=True))

The system prompt (with the tools) and the user's first message open an episode. The agent speaks: a message with
tool calls runs them against the episode's own environment session and the agent speaks again on the results; a
message without tool calls goes to the simulated user (envs/users.py), whose reply comes back. The episode rule
(envs.next_turn) ends it: the user says a stop marker, the agent calls a stop tool, or `max_turns` agent messages
were said; or a cap of the sampler (`max_context`, `max_new_tokens`) cuts it. Then it is scored (envs.score): 1 only
when the task is done. Each agent turn enters the token stream as the ids `model.generate` sampled (loss mask 1,
with their log-probs), everything else as a chat-template delta (loss mask 0; muarl.py).
"""
from __future__ import annotations

import contextlib
import json
import logging
from dataclasses import dataclass
from typing import NamedTuple

import torch

from envs import STOP_TOOLS, Speaker, Termination, next_turn, opening_messages, score
from envs.users import UserSimError
from muarl import Episode, TurnEnd, delta_ids, prompt_ids, stop_token_ids
from toolcall import parse_assistant

log = logging.getLogger("muarl.rollout")


@dataclass
class Sampling:
    """How the agent samples, and the caps of an episode."""
    temperature: float = 1.0
    """sampling temperature (paper: 1.0); recorded logprobs are log_softmax(logits / temperature)"""
    top_p: float = 1.0
    """nucleus sampling; applies to *which* token is drawn only, the recorded logprob stays the full tempered one"""
    greedy: bool = False
    """argmax decoding (evaluation, the cache-equality test); logprobs are still recorded as above"""
    max_new_tokens: int = 1024
    """per-turn cap on sampled tokens (paper: 1024); hitting it ends the episode as response_truncated"""
    max_context: int = 32768
    """cap on an episode's total tokens (paper: 32k); reaching it ends the episode as context_limit"""
    max_turns: int = 30
    """cap on agent messages per episode (paper: 30)"""


@torch.no_grad()
def reference_rollout(model, tokenizer, env, task, user_sim, cfg: Sampling | None = None, *, session=None,
                      seed: int | None = None, sample: int = 0) -> Episode:
    """Play one episode of `task`: the oracle batched_rollout.rollout is held to (tests/test_rollout.py), and what
    training and evaluation play with --rollout reference. Each agent turn is one `model.generate` call over the
    whole conversation so far. `session`: the episode's environment state (default env.start(task); the rollouts
    pass one whose tool calls run under --tool-timeout); `seed`: the episode's own draws (default torch's global
    RNG). A user simulator that fails ends the episode as INFRA_ERROR: not the agent's 0, left out of training."""
    cfg = cfg or Sampling()
    eot_ids = stop_token_ids(model, tokenizer)
    session = env.start(task) if session is None else session  # fresh state per episode (docs/invariants.md, 4)
    user = user_sim.sync_user(env, task, session)
    ep = Episode(task_id=task.id, sample=sample, tools=env.tools(task))
    with own_rng(seed, model.device):
        try:
            ep.messages = opening_messages(env, task, user.opening())
            ep.append(prompt_ids(tokenizer, ep.messages, ep.tools), agent=False)
            status = Speaker.AGENT if len(ep.input_ids) < cfg.max_context else Termination.CONTEXT_LIMIT
            while status == Speaker.AGENT:
                ids, logprobs = generate(model, ep.input_ids, cfg, eot_ids, tokenizer.pad_token_id)
                end = (TurnEnd.EOT if ids[-1] in eot_ids else TurnEnd.CONTEXT
                       if len(ep.input_ids) + len(ids) >= cfg.max_context else TurnEnd.MAX_NEW_TOKENS)
                status = agent_turn(ep, session, tokenizer, ids, logprobs, end, cfg.max_turns)
                if status == Speaker.USER:
                    ep.messages.append({"role": "user", "content": user.reply(ep.messages)})
                    status = next_turn(ep.messages, ep.turns, cfg.max_turns)
                if status == Speaker.AGENT and not append_delta(ep, tokenizer, cfg.max_context):
                    status = Termination.CONTEXT_LIMIT
        except UserSimError as e:
            log.warning("user simulator failed for task %s: %s", task.id, e)
            ep.reward_info, status = {"error": str(e)}, Termination.INFRA_ERROR
    end_episode(ep, session, status)
    return ep


@contextlib.contextmanager
def own_rng(seed: int | None, device: torch.device):
    """Draws from the episode's own seed inside, torch's global RNG left as it was (None: the global RNG itself)."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else [], enabled=seed is not None):
        if seed is not None:
            torch.manual_seed(seed)
        yield


def generate(model, input_ids: list[int], cfg: Sampling, eot_ids: list[int], pad: int) -> tuple[list[int], list[float]]:
    """One agent turn by `model.generate`: (sampled ids, ending with a stop token unless cut off; their logprobs,
    log_softmax(logits / temperature) of each drawn token, which is what the trainer recomputes)."""
    ids = torch.tensor([input_ids], device=model.device)
    sampling = dict(do_sample=False) if cfg.greedy else dict(do_sample=True, temperature=cfg.temperature,
                                                            top_p=cfg.top_p, top_k=0)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), eos_token_id=eot_ids, pad_token_id=pad,
                         max_new_tokens=min(cfg.max_new_tokens, cfg.max_context - len(input_ids)),
                         output_logits=True, return_dict_in_generate=True, **sampling)
    new = out.sequences[0, len(input_ids):]
    logp = torch.log_softmax(torch.cat(out.logits).float() / cfg.temperature, -1)   # [new tokens, V]
    return new.tolist(), logp.gather(-1, new[:, None])[:, 0].tolist()


# ---------------------------------------------------------------------------------------------------------
# One turn of the agent (batched_rollout.py uses the same helpers)
# ---------------------------------------------------------------------------------------------------------
def agent_turn(ep: Episode, session, tokenizer, ids: list[int], logprobs: list[float], end: TurnEnd,
               max_turns: int) -> Speaker | Termination:
    """Record a sampled turn and act on it: its ids enter the episode verbatim, its text becomes the assistant
    message and its tool calls run. `end` is why sampling stopped. Returns who speaks next (the agent, to read its
    tool results, or the user) or why the episode ended."""
    text = record_turn(ep, tokenizer, ids, logprobs, end)
    if text is None:  # cut off mid-message: its text kept, nothing run
        return Termination.RESPONSE_TRUNCATED if end == TurnEnd.MAX_NEW_TOKENS else Termination.CONTEXT_LIMIT
    return add_to_conversation(ep, run_tool_calls(ep, session, text), max_turns)


def record_turn(ep: Episode, tokenizer, ids: list[int], logprobs: list[float], end: TurnEnd) -> str | None:
    """The sampled ids enter the episode (loss mask 1); returns their text without the stop token, or None when
    sampling was cut off (max_new_tokens, context), the text then recorded as the agent's message."""
    ep.append(ids, agent=True, logprobs=logprobs)
    ep.turns += 1
    text = tokenizer.decode(ids[:-1] if end == TurnEnd.EOT else ids, skip_special_tokens=False)
    if end != TurnEnd.EOT:
        ep.messages.append({"role": "assistant", "content": text})
        return None
    return text


class ToolOutcome(NamedTuple):
    """What a turn's text became: the assistant message, one tool message per call, and whether a STOP_TOOLS tool
    ran (it ends the episode)."""
    message: dict
    results: list[dict]
    stop_tool_ran: bool


def run_tool_calls(ep: Episode, session, text: str) -> ToolOutcome:
    """Parse the agent's turn and run its tool calls against the episode's session. Never raises on model output:
    a malformed call or a failing one (unknown tool, bad arguments, a tool that raised) becomes an error tool
    message the agent can read and recover from, counted in ep.tool_errors. Call ids carry the turn number."""
    parsed = parse_assistant(text, call_id_prefix=f"call_{ep.turns}")
    msg = {"role": "assistant", "content": parsed.content}
    if parsed.tool_calls:
        msg["tool_calls"] = parsed.tool_calls
    results, stop_tool_ran = [], False
    for i, call in enumerate(parsed.tool_calls):
        name = call["function"]["name"]
        if i in parsed.errors:
            content, error = parsed.errors[i], True
        else:
            res = session.call_tool(name, json.loads(call["function"]["arguments"]))
            content, error = res.content, res.error
            ep.tool_calls[name] += 1
            stop_tool_ran = stop_tool_ran or name in STOP_TOOLS
        ep.tool_errors += int(error)
        results.append({"role": "tool", "tool_call_id": call["id"], "name": name, "content": content})
    return ToolOutcome(msg, results, stop_tool_ran)


def add_to_conversation(ep: Episode, outcome: ToolOutcome, max_turns: int) -> Speaker | Termination:
    """The turn's message and its tool results enter the conversation; returns what follows (as agent_turn)."""
    ep.messages += [outcome.message] + outcome.results
    return next_turn(ep.messages, ep.turns, max_turns, outcome.stop_tool_ran)


def append_delta(ep: Episode, tokenizer, max_context: int) -> bool:
    """Append what was said since the agent's last message (tool results or the user's reply) as a chat-template
    delta (loss mask 0) ending with the generation prompt. False, appending nothing, when that would leave the
    agent no room to answer: the episode then ends as context_limit."""
    last = max(i for i, m in enumerate(ep.messages) if m["role"] == "assistant")
    # the turn's last token is the stop token it ended on: the delta closes the turn as the template would
    ids = delta_ids(tokenizer, ep.messages[last + 1:], ended_with=ep.input_ids[-1])
    if len(ep.input_ids) + len(ids) >= max_context:
        return False
    ep.append(ids, agent=False)
    return True


def end_episode(ep: Episode, session, termination: Termination) -> None:
    """Score the ended episode by the episode rule (envs.score); an episode lost to infrastructure is not scored
    (infra_failed: training leaves it out instead of scoring it 0)."""
    if termination != Termination.INFRA_ERROR:
        ep.reward, ep.reward_info, termination = score(session, ep.messages, termination)
        if termination == Termination.INFRA_ERROR:
            log.warning("reward failed for task %s: %s", ep.task_id, ep.reward_info.get("error"))
    ep.termination, ep.infra_failed = termination, termination == Termination.INFRA_ERROR
