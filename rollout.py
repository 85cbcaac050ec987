"""The multi-turn rollout engine: G episodes per task, the agent talking to a simulated user and to tools.

    from rollout import RolloutConfig, make_user_sim, rollout
    episodes = rollout(model, tokenizer, env, tasks, group_size=8, user_sim=make_user_sim("scripted"),
                       cfg=RolloutConfig())          # len(episodes) == 8 * len(tasks), a task's 8 consecutive

Turn order (as in the paper and tau2): the system prompt (with the tools, rendered by the chat template) and the
user's first message open an episode. The agent speaks. A message with tool calls runs them against the episode's
own environment session and the agent speaks again on the results; a message without tool calls goes to the user
simulator, whose reply comes back. The episode ends when the user says a USER_STOP_MARKER, the agent calls a
STOP_TOOLS tool, after `max_turns` agent messages, at the context cap, when an agent turn hits `max_new_tokens`
without its end-of-turn token, or when the user simulator's endpoint keeps failing (then `infra_failed`, which
training leaves out instead of scoring as 0).

Generation is hand-written batched decoding over the model's forward with a transformers KV Cache. All live
episodes decode together; a row that ends its turn leaves the batch at once (its cache rows are copied out, minus
padding holes, and parked on the episode), so a long turn never makes short ones pay. The cache is kept across
turns: at the next turn only the tokens not yet in it (the agent's last sampled token and the delta of tool
results or user reply) are prefilled. `reuse_cache=False` re-encodes the whole conversation every turn instead;
with greedy decoding both give the same tokens (invariant 5, tested). Only full-attention models are supported
(a sliding window would count padding slots).

Turns are asynchronous per episode (continuous batching): a batch decodes until fewer than half its rows
(`refill_below`) are still in their turn; the rest are parked mid-turn (cache, partial turn, last sampled token as
pending input), the rows that ended their turn run their tools and get their user replies (concurrently), and the
next batch stacks them back together with the parked rows. So the batch stays at least half full instead of
draining to the longest turn. Simplification: decoding waits while those user replies run (no overlap with an
LLM user's latency). bench/rollout.py measures batch occupancy.
"""
from __future__ import annotations

import asyncio
import copy
import json
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicLayer

from envs import STOP_TOOLS, USER_STOP_MARKERS, message_history, user_speaks_next
from muarl import Episode, delta_ids, end_of_turn_id, parse_assistant, prompt_ids, template_kwargs

log = logging.getLogger("muarl.rollout")
# Terminations that count as the dialogue ending normally; any other ending scores 0.
DONE = ("user_stop", "transfer")


@dataclass
class RolloutConfig:
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
    reuse_cache: bool = True
    """keep each episode's KV cache across turns and prefill only the new tokens; False re-encodes every turn"""
    max_batch: int = 0
    """at most this many episodes decode in one batch (0: all); bounds GPU memory; 1 = one episode at a time"""
    refill_below: float = 0.5
    """a decoding batch stops when fewer than this fraction of its rows are still in their turn, parks those
    mid-turn, and lets the rows that ended their turn rejoin after their tools / user reply (continuous batching;
    0: turns are synchronous, 1: re-stack whenever a row ends its turn); greedy tokens never depend on it"""


# ---------------------------------------------------------------------------------------------------------
# Batched decoding with a per-episode KV cache
# ---------------------------------------------------------------------------------------------------------
@dataclass
class _Row:
    """A live episode: its record, environment session, user-simulator state and parked KV cache."""

    ep: Episode
    session: Any
    user: Any
    kv: list | None = None  # per layer (keys, values), each [kv_heads, kv_len, head_dim], no padding holes
    new_ids: list[int] = field(default_factory=list)  # this turn's sampled tokens
    new_logprobs: list[float] = field(default_factory=list)
    stop: str = ""  # why this turn's decoding stopped: eot | max_new_tokens | context
    delta: list = field(default_factory=list)  # non-agent messages to append before the next turn

    @property
    def kv_len(self) -> int:
        return 0 if self.kv is None else self.kv[0][0].shape[-2]


class _BufferLayer(DynamicLayer):
    """A cache layer that writes into a preallocated [batch, kv_heads, capacity, head_dim] buffer. transformers'
    DynamicLayer concatenates at every step, i.e. reallocates and copies the whole batch's cache per sampled token,
    which made batched decoding memory-bound here; the buffer is sized for the whole turn when it is stacked.
    The layer's keys and values are the view kbuf[:, :, start:n]: `start` moves right (drop_left) when the rows
    still decoding no longer need the leading padding columns, so attention stops paying for them."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, length: int):
        super().__init__()
        self.kbuf, self.vbuf, self.start, self.n = keys, values, 0, length
        self.dtype, self.device, self.is_initialized = keys.dtype, keys.device, True
        self._view()

    def _view(self):
        self.keys, self.values = self.kbuf[:, :, self.start:self.n], self.vbuf[:, :, self.start:self.n]

    def update(self, key_states, value_states, *args, **kwargs):
        q = key_states.shape[-2]
        if self.n + q > self.kbuf.shape[-2]:  # not expected (the turn's budget is known); grow by doubling
            pad = torch.zeros_like(self.kbuf[:, :, :max(q, self.kbuf.shape[-2])])
            self.kbuf, self.vbuf = torch.cat([self.kbuf, pad], 2), torch.cat([self.vbuf, pad], 2)
        self.kbuf[:, :, self.n:self.n + q] = key_states
        self.vbuf[:, :, self.n:self.n + q] = value_states
        self.n += q
        self._view()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.n - self.start

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the rows `indices`, in that order, in the first len(indices) rows of the buffer (a view). Only rows
        that change place are copied (transformers' default copies the whole cache each time a row leaves, which
        cost here about a third of what attention did); _fill_holes gives an order that moves few."""
        moved = [p for p, i in enumerate(indices.tolist()) if p != i]
        if moved:
            src, used = indices[moved], slice(self.start, self.n)
            self.kbuf[moved, :, used] = self.kbuf[src, :, used]
            self.vbuf[moved, :, used] = self.vbuf[src, :, used]
        self.kbuf, self.vbuf = self.kbuf[:len(indices)], self.vbuf[:len(indices)]
        self._view()

    def drop_left(self, columns: int) -> None:
        """Forget the first `columns` cache positions (padding that no remaining row attends to)."""
        self.start += columns
        self._view()


def _fill_holes(n: int, done: list[int]) -> list[int]:
    """Which of n batch rows to keep, in what order, when the rows `done` leave: kept rows stay in their place and
    the last kept rows move into the holes that leaving rows open in front of them (one row copied per leaver)."""
    keep = [j for j in range(n) if j not in done]
    order = list(range(len(keep)))
    holes = [j for j in done if j < len(keep)]
    for hole, j in zip(holes, [j for j in keep if j >= len(keep)]):
        order[hole] = j
    return order


def _stack_cache(model, rows: list[_Row], pending: list[list[int]], room: int, eot: int):
    """One cache for a batch of rows, and the inputs that feed it each row's pending tokens. Returns the cache, the
    input ids [B, W], the attention mask [B, L + W] and the positions [B, W]. Batch layout, row i, along the cache
    axis (positions are explicit, per row, so padding costs no position):
        [0 .. 0 | parked cache (kv_len_i) | pending (P_i) | pad .. pad | `room` columns for sampled tokens]
    Zeros rather than garbage left of a parked cache (masked out, but 0 * NaN would poison attention). The pending
    tokens are right-padded so that a pad slot always sees real tokens of its row (else a NaN query)."""
    cfg = model.config.get_text_config(decoder=True)
    if any(t != "full_attention" for t in getattr(cfg, "layer_types", None) or []):
        raise NotImplementedError("rollout's padded KV cache supports full-attention models only")
    lens, param = [r.kv_len for r in rows], next(model.parameters())
    L, W, B = max(lens), max(len(p) for p in pending), len(rows)
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    layers = []
    for layer in range(cfg.num_hidden_layers):
        keys = param.new_zeros(B, kv_heads, L + W + room, head_dim)
        values = torch.zeros_like(keys)
        for i, r in enumerate(rows):
            if lens[i]:
                keys[i, :, L - lens[i]:L] = r.kv[layer][0]
                values[i, :, L - lens[i]:L] = r.kv[layer][1]
        layers.append(_BufferLayer(keys, values, L))
    ids = torch.full((B, W), eot, dtype=torch.long)
    mask = torch.zeros(B, L + W, dtype=torch.long)
    for i, p in enumerate(pending):
        ids[i, :len(p)] = torch.tensor(p)
        mask[i, L - lens[i]:L + len(p)] = 1
    pos = torch.tensor(lens)[:, None] + torch.arange(W)[None, :]
    return Cache(layers=layers), ids.to(param.device), mask.to(param.device), pos.to(param.device)


def _park(row: _Row, cache: Cache, mask: torch.Tensor, j: int) -> None:
    """Copy batch row j's cache out to the row, without its holes."""
    real = mask[j].bool()
    row.kv = [(lay.keys[j][:, real], lay.values[j][:, real]) for lay in cache.layers]


def _sample(logits: torch.Tensor, cfg: RolloutConfig, generator) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [B, V] float32 -> (token ids [B], recorded logprobs [B]).

    The recorded logprob is log_softmax(logits / temperature) of the drawn token: the distribution a trainer
    recomputes with one forward pass. top_p truncation changes what is drawn, not what is recorded, so that
    old and new policy logprobs in the GRPO ratio mean the same thing."""
    logp = torch.log_softmax(logits / cfg.temperature, dim=-1)
    if cfg.greedy:
        tok = logits.argmax(dim=-1)
    else:
        probs = logp.exp()
        if cfg.top_p < 1.0:
            sorted_p, order = probs.sort(dim=-1, descending=True)
            drop = sorted_p.cumsum(-1) - sorted_p > cfg.top_p  # keep the smallest prefix reaching top_p
            probs = probs.scatter(-1, order, sorted_p.masked_fill(drop, 0.0))
        tok = torch.multinomial(probs, 1, generator=generator).squeeze(1)
    return tok, logp.gather(-1, tok[:, None]).squeeze(1)


@torch.no_grad()
def generate_turn(model, rows: list[_Row], cfg: RolloutConfig, eot: int, generator=None) -> None:
    """Decode the current agent turn of every row, together, until fewer than cfg.refill_below of the rows are
    still decoding. A row whose turn ends gets row.stop; a row still mid-turn keeps stop == "" and its partial
    new_ids / new_logprobs, and the next call continues it (its last sampled token is its pending input). Either
    way the row's cache (everything but its last sampled token) is parked in row.kv.

    The rows with more than one pending token (a new turn: the last sampled token and the tool results or user
    reply) are prefilled first, all but that last token, in a batch of their own, so that the rows continuing
    mid-turn (one pending token) pay no padding for them. Then all rows decode together, one column per step;
    a row that stops leaves the batch (Cache.batch_select_indices)."""
    dec, lm_head = model.get_decoder(), model.get_output_embeddings()
    fwd = lambda cache, ids, mask, pos: dec(input_ids=ids, attention_mask=mask, position_ids=pos,
                                            past_key_values=cache, use_cache=True).last_hidden_state
    for r in rows:  # a row whose previous turn ended (stop set) starts a new one
        if r.stop:
            r.new_ids, r.new_logprobs, r.stop = [], [], ""
    pending = [(r.ep.input_ids + r.new_ids)[r.kv_len:] for r in rows]
    new = [(r, p[:-1]) for r, p in zip(rows, pending) if len(p) > 1]
    if new:
        cache, ids, mask, pos = _stack_cache(model, [r for r, _ in new], [p for _, p in new], 0, eot)
        fwd(cache, ids, mask, pos)
        for j, (r, _) in enumerate(new):
            _park(r, cache, mask, j)
    budget = [min(cfg.max_new_tokens, cfg.max_context - len(r.ep.input_ids)) for r in rows]
    room = max(b - len(r.new_ids) for b, r in zip(budget, rows))
    cache, tok, mask, pos = _stack_cache(model, rows, [p[-1:] for p in pending], room, eot)
    active, B = list(range(len(rows))), len(rows)  # batch position -> index into rows
    while True:
        tok, lp = _sample(lm_head(fwd(cache, tok, mask, pos)[:, -1]).float(), cfg, generator)
        done = []
        for j, (t, l) in enumerate(zip(tok.tolist(), lp.tolist())):
            r = rows[active[j]]
            r.new_ids.append(t)
            r.new_logprobs.append(l)
            if t == eot:
                r.stop = "eot"
            elif len(r.new_ids) >= budget[active[j]]:
                full = len(r.ep.input_ids) + len(r.new_ids) >= cfg.max_context
                r.stop = "context" if full else "max_new_tokens"
            if r.stop:
                done.append(j)
        still = len(active) - len(done)
        refill = not still or still < cfg.refill_below * B  # return, parking the rest mid-turn
        for j in range(len(active)) if refill else done:
            _park(rows[active[j]], cache, mask, j)
        if refill:
            return
        if done:
            keep = _fill_holes(len(active), done)
            keep_t = torch.tensor(keep, device=tok.device)
            cache.batch_select_indices(keep_t)
            mask, tok = mask[keep_t], tok[keep_t]
            active = [active[j] for j in keep]
            first = int(mask.any(0).nonzero()[0])  # leading columns that are padding in every remaining row
            if first:
                mask = mask[:, first:]
                for lay in cache.layers:
                    lay.drop_left(first)
        pos = torch.tensor([[len(rows[i].ep.input_ids) + len(rows[i].new_ids) - 1] for i in active], device=tok.device)
        mask, tok = torch.cat([mask, mask.new_ones(len(active), 1)], dim=1), tok[:, None]


# ---------------------------------------------------------------------------------------------------------
# The episode loop
# ---------------------------------------------------------------------------------------------------------
def run_tool_calls(ep: Episode, session, text: str) -> tuple[dict, list[dict], bool]:
    """Parse the agent's decoded turn and run its tool calls.
    Returns (assistant message, tool messages, whether a STOP_TOOLS tool ran).

    Never raises on model output: a malformed call (parse error) or a failing call (unknown tool, bad arguments,
    a tool that raised: the env's ToolResult(error=True)) becomes an error tool message the agent can read and
    recover from, counted in ep.tool_errors. Call ids carry the turn number, so they are unique in the episode."""
    parsed = parse_assistant(text, call_id_prefix=f"call_{ep.turns}")
    msg = {"role": "assistant", "content": parsed.content}
    if parsed.tool_calls:
        msg["tool_calls"] = parsed.tool_calls
    results, stop = [], False
    for i, call in enumerate(parsed.tool_calls):
        name = call["function"]["name"]
        if i in parsed.errors:
            content, error = parsed.errors[i], True
        else:
            res = session.call_tool(name, json.loads(call["function"]["arguments"]))
            content, error = res.content, res.error
            ep.tool_calls[name] += 1
            stop = stop or name in STOP_TOOLS
        ep.tool_errors += int(error)
        results.append({"role": "tool", "tool_call_id": call["id"], "name": name, "content": content})
    return msg, results, stop


def _finish(row: _Row, termination: str, infra: bool = False) -> None:
    row.ep.termination, row.ep.infra_failed = termination, infra
    row.kv = None  # free its cache now


def rollout(model, tokenizer, env, tasks: list, group_size: int, user_sim, cfg: RolloutConfig | None = None,
            generator: torch.Generator | None = None) -> list[Episode]:
    """Play `group_size` episodes of every task; returns them task by task, a group's episodes consecutive.

    Pass the unwrapped model (under Accelerate each process rolls out its own share of tasks). `generator`
    (on the model's device) makes sampling reproducible; None uses torch's global RNG (seed_everything)."""
    cfg = cfg or RolloutConfig()
    was_training = model.training
    model.eval()
    try:
        return asyncio.run(_rollout(model, tokenizer, env, tasks, group_size, user_sim, cfg, generator))
    finally:
        model.train(was_training)


async def _rollout(model, tok, env, tasks, group_size, user_sim, cfg, generator) -> list[Episode]:
    eot = end_of_turn_id(tok)
    # The first user message is generated once per task and shared by its group: the G episodes differ only by
    # the agent's samples, which is what the group-relative advantage compares. A task that continues an earlier
    # conversation (tau2's message history) starts from it, as prompt; the opening is None when the agent is next.
    openings = await asyncio.gather(*(user_sim.opening(env, t) for t in tasks), return_exceptions=True)
    rows = []
    for task, opening in zip(tasks, openings):
        if isinstance(opening, BaseException) and not isinstance(opening, UserSimError):
            raise opening
        tools = env.tools(task)
        opening_msgs = [{"role": "system", "content": env.system_prompt(task)}] + message_history(env, task)
        if isinstance(opening, str):
            opening_msgs.append({"role": "user", "content": opening})
        opening_ids = [] if isinstance(opening, UserSimError) else prompt_ids(tok, opening_msgs, tools)
        for g in range(group_size):
            ep = Episode(task_id=task.id, sample=g, tools=tools)
            session = env.start(task)  # fresh state per episode (invariant 4)
            row = _Row(ep, session, None)
            rows.append(row)
            if isinstance(opening, UserSimError):
                _finish(row, "infra_error", infra=True)
                ep.reward_info = {"error": str(opening)}
                continue
            ep.messages = copy.deepcopy(opening_msgs)  # the group's episodes share no mutable message
            ep.append(opening_ids, agent=False)
            row.user = user_sim.start(env, task, session, opening)
            if len(ep.input_ids) >= cfg.max_context:
                _finish(row, "context_limit")
    live = [r for r in rows if not r.ep.termination]

    while live:
        # Continuous batching: the batch decodes until half its rows have ended their turn (refill_below); those
        # run their tools or get their user's reply and rejoin, next to the rows parked mid-turn, at the next call.
        batch = live[:cfg.max_batch or len(live)]
        generate_turn(model, batch, cfg, eot, generator)
        parked = [r for r in batch if not r.stop]
        to_user, next_live = [], []
        for r in (r for r in batch if r.stop):
            ep = r.ep
            ep.append(r.new_ids, agent=True, logprobs=r.new_logprobs)
            ep.turns += 1
            text = tok.decode(r.new_ids[:-1] if r.stop == "eot" else r.new_ids, skip_special_tokens=False)
            if not cfg.reuse_cache:
                r.kv = None  # the next turn re-encodes the whole conversation
            if r.stop != "eot":  # cut off mid-message: keep the text, run nothing
                ep.messages.append({"role": "assistant", "content": text})
                _finish(r, "response_truncated" if r.stop == "max_new_tokens" else "context_limit")
                continue
            msg, results, stop = run_tool_calls(ep, r.session, text)
            ep.messages += [msg] + results
            if stop:
                _finish(r, "transfer")
            elif ep.turns >= cfg.max_turns:
                _finish(r, "max_turns")
            elif results:
                r.delta = results
                next_live.append(r)
            else:
                to_user.append(r)
        # The user replies of the rows that ended their turn run concurrently (an LLM endpoint is the slow part).
        replies = await user_sim.replies([r.user for r in to_user], [r.ep.messages for r in to_user])
        for r, reply in zip(to_user, replies):
            if isinstance(reply, UserSimError):
                log.warning("user simulator failed for task %s: %s", r.ep.task_id, reply)
                r.ep.reward_info = {"error": str(reply)}
                _finish(r, "infra_error", infra=True)
                continue
            if isinstance(reply, BaseException):
                raise reply
            msg = {"role": "user", "content": reply}
            r.ep.messages.append(msg)
            if any(m in reply for m in USER_STOP_MARKERS):
                _finish(r, "user_stop")
            else:
                r.delta = [msg]
                next_live.append(r)
        # Next in line: the rows parked mid-turn, those that waited (max_batch), then those starting a new turn.
        live = parked + live[len(batch):]
        for r in next_live:
            ids = delta_ids(tok, r.delta)
            if len(r.ep.input_ids) + len(ids) >= cfg.max_context:
                _finish(r, "context_limit")  # no room left to answer: nothing more to append
            else:
                r.ep.append(ids, agent=False)
                live.append(r)

    for r in rows:
        if r.ep.infra_failed:
            continue
        try:
            r.ep.reward, r.ep.reward_info = r.session.reward(r.ep.messages)
        except Exception as e:  # a broken evaluator is not the policy's fault: leave the episode out
            log.warning("reward failed for task %s: %r", r.ep.task_id, e)
            r.ep.reward, r.ep.reward_info, r.ep.infra_failed = 0.0, {"error": repr(e)}, True
            continue
        if not math.isfinite(r.ep.reward):  # a broken evaluator, not the policy's doing: leave it out, loudly
            r.ep.reward_info = {**r.ep.reward_info, "error": f"non-finite reward {r.ep.reward}"}
            r.ep.reward, r.ep.infra_failed, r.ep.termination = 0.0, True, "infra_error"
        elif r.ep.termination not in DONE:
            # As tau2 scores it: an episode cut off (turn, context or response cap) did not finish its task,
            # whatever state the database happens to be in.
            r.ep.reward_info = {**r.ep.reward_info, "env_reward": r.ep.reward, "ended_early": r.ep.termination}
            r.ep.reward = 0.0
    return [r.ep for r in rows]


# ---------------------------------------------------------------------------------------------------------
# User simulators: one interface, three backends
# ---------------------------------------------------------------------------------------------------------
class UserSimError(RuntimeError):
    """The user simulator could not answer (endpoint down after retries): an infrastructure failure."""


# tau2's orchestrator opens with this agent greeting; an LLM user needs something to answer to.
GREETING = "Hi! How can I help you today?"
_GUIDELINES = """# User Simulation Guidelines
You are playing the role of a customer contacting a customer service agent. Follow the scenario below.
- Write one message at a time, as the customer would; never act as the agent.
- Reveal information only when the agent asks for it; never make up information the scenario does not give.
- When the task is complete, write ###STOP### to end the conversation. If you are transferred to another
  agent, write ###TRANSFER###. If the scenario does not cover what is happening, write ###OUT-OF-SCOPE###."""


def user_guidelines(with_tools: bool = False) -> str:
    """tau2's simulation guidelines when the tau2 package is installed (read as data: importing its user
    simulator pulls litellm), else a short built-in version of them."""
    import importlib.util

    spec = importlib.util.find_spec("tau2")
    if spec and spec.submodule_search_locations:
        name = "simulation_guidelines_tools.md" if with_tools else "simulation_guidelines.md"
        path = Path(list(spec.submodule_search_locations)[0]) / "data" / "tau2" / "user_simulator" / name
        if path.exists():
            return path.read_text()
    return _GUIDELINES


def user_system_prompt(task, with_tools: bool = False) -> str:
    """tau2's guidelines and the task's scenario; or the benchmark's own user prompt where the task carries one
    (task.meta["user_sim"]["system_prompt"]: ACEBench's)."""
    own = (task.meta.get("user_sim") or {}).get("system_prompt")
    return own or f"{user_guidelines(with_tools)}\n\n<scenario>\n{task.user_scenario}\n</scenario>"


class UserSim:
    """The interface. `opening` runs once per task; `start` makes one episode's state; `replies` answers every
    episode waiting on its user at once (list in, list out; a failure comes back as a UserSimError in its slot)."""

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


class _SyncUser:
    def __init__(self, sim, env, task, session):
        self.sim, self.env, self.task, self.session, self.state = sim, env, task, session, None

    def opening(self) -> str | None:
        text = asyncio.run(self.sim.opening(self.env, self.task))
        self.state = self.sim.start(self.env, self.task, self.session, text)
        return text

    def reply(self, messages: list[dict]) -> str:
        return asyncio.run(self.sim.reply(self.state, messages))


class ScriptedUserSim(UserSim):
    """The environment's rule-based user (env.scripted_user): deterministic, free, for tests and tiny runs."""

    async def opening(self, env, task) -> str:
        return env.scripted_user(task).opening()

    def start(self, env, task, session, opening):
        user = env.scripted_user(task)
        user.opening()  # a scripted user may keep state; its opening equals the shared one by contract
        return user

    async def reply(self, user, messages):
        return user.reply(messages)


@dataclass
class _ChatState:
    """An LLM user's side of one episode: its own conversation, roles flipped, including its own tool traffic."""

    history: list[dict]
    session: Any
    tools: list[dict]
    seen: int  # agent-visible messages already mirrored into history
    stop: str = ""  # the benchmark's own way for the user to end (ACEBench: "finish conversation")

    def said(self, text: str) -> str:
        """The user's message as the episode records it: a stop marker added when it ends the benchmark's way."""
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


class OpenAIUserSim(UserSim):
    """An LLM user behind any OpenAI-compatible chat endpoint (the paper: GPT-4o for training, temperature 0).

    Retries timeouts, connection errors, 408/409/429 and 5xx with exponential backoff (backoff * 2**attempt
    seconds), itself: the client's own retries are off so that the policy is visible here and testable. After
    `max_retries` retries the episode ends as infra_error."""

    RETRY_STATUS = {408, 409, 429}

    def __init__(self, model: str | None = None, base_url: str | None = None, api_key: str | None = None,
                 temperature: float = 0.0, max_tokens: int | None = None, max_concurrency: int = 32,
                 max_retries: int = 5, backoff: float = 1.0, timeout: float = 120.0, max_tool_rounds: int = 10):
        self.model = model or os.environ.get("MUARL_USER_MODEL", "gpt-4o")
        self.base_url = base_url or os.environ.get("OPENAI_BASE_URL")
        self.api_key = api_key or os.environ.get("OPENAI_API_KEY") or "EMPTY"  # local servers ignore it
        self.temperature, self.max_tokens = temperature, max_tokens
        self.max_concurrency, self.max_retries, self.backoff, self.timeout = max_concurrency, max_retries, backoff, timeout
        self.max_tool_rounds = max_tool_rounds
        self._loop = None

    def _client(self):
        # An async client (and semaphore) belongs to the event loop it first ran on; each rollout() is its own
        # asyncio.run, so make them per loop.
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            from openai import AsyncOpenAI

            self._openai = AsyncOpenAI(base_url=self.base_url, api_key=self.api_key, max_retries=0,
                                       timeout=self.timeout)
            self._sem, self._loop = asyncio.Semaphore(self.max_concurrency), loop
        return self._openai

    async def _complete(self, messages: list[dict], tools: list[dict]):
        import openai

        client = self._client()
        kwargs = dict(model=self.model, messages=messages, temperature=self.temperature)
        if self.max_tokens:
            kwargs["max_tokens"] = self.max_tokens
        if tools:
            kwargs["tools"] = tools
        for attempt in range(self.max_retries + 1):
            try:
                async with self._sem:
                    resp = await client.chat.completions.create(**kwargs)
                return resp.choices[0].message
            except (openai.APIConnectionError, openai.APIStatusError) as e:  # timeouts are connection errors
                status = getattr(e, "status_code", None)
                retriable = status is None or status >= 500 or status in self.RETRY_STATUS
                if not retriable or attempt == self.max_retries:
                    raise UserSimError(f"user simulator endpoint failed after {attempt + 1} attempts: {e!r}") from e
                await asyncio.sleep(self.backoff * 2 ** attempt)
            except openai.OpenAIError as e:
                raise UserSimError(f"user simulator endpoint failed: {e!r}") from e

    async def opening(self, env, task) -> str | None:
        # Shared by the group before any session exists, so the opening runs no user tools.
        history = message_history(env, task)
        if not user_speaks_next(history):
            return None
        return (await self._complete(_user_view(task, history, bool(env.user_tools(task))), [])).content or ""

    def start(self, env, task, session, opening):
        return _chat_state(env, task, session, opening, env.user_tools(task))

    async def reply(self, state: _ChatState, messages):
        _flip_new(state, messages)
        for _ in range(self.max_tool_rounds + 1):
            msg = await self._complete(state.history, state.tools)
            if not (state.tools and msg.tool_calls):
                state.history.append({"role": "assistant", "content": msg.content or ""})
                return state.said(msg.content or "")
            # User-side tools (tau2 telecom): run them on the episode's session, loop until the user talks.
            calls = [{"id": c.id, "type": "function",
                      "function": {"name": c.function.name, "arguments": c.function.arguments}} for c in msg.tool_calls]
            state.history.append({"role": "assistant", "content": msg.content or "", "tool_calls": calls})
            for c in calls:
                try:
                    args = json.loads(c["function"]["arguments"] or "{}")
                except (json.JSONDecodeError, TypeError) as e:
                    content = f"Error: arguments are not a JSON object: {e}"
                else:  # n_messages: the call's place in the conversation, just before this reply
                    content = state.session.call_tool(c["function"]["name"], args, requestor="user",
                                                      n_messages=len(messages)).content
                state.history.append({"role": "tool", "tool_call_id": c["id"], "content": content})
        raise UserSimError(f"user simulator made more than {self.max_tool_rounds} rounds of tool calls")


class HFUserSim(UserSim):
    """A local transformers chat model as the user, for offline runs: plain HF generate over the flipped
    conversations of all waiting episodes in one left-padded batch. User-side tools are not supported."""

    def __init__(self, model="smollm2-135m", tokenizer=None, max_new_tokens: int = 256, temperature: float = 0.0,
                 device=None):
        if isinstance(model, str):
            from muarl import load_model

            model, tokenizer = load_model(model, device=device)
        self.model, self.tok = model.eval(), tokenizer
        self.max_new_tokens, self.temperature = max_new_tokens, temperature

    @torch.no_grad()
    def _generate(self, conversations: list[list[dict]]) -> list[str]:
        texts = [self.tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True, **template_kwargs(self.tok))
                 for c in conversations]
        batch = self.tok(texts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
        batch = batch.to(next(self.model.parameters()).device)
        sampling = dict(do_sample=True, temperature=self.temperature) if self.temperature > 0 else dict(do_sample=False)
        out = self.model.generate(**batch, max_new_tokens=self.max_new_tokens, pad_token_id=self.tok.pad_token_id,
                                  eos_token_id=end_of_turn_id(self.tok), **sampling)
        return [s.strip() for s in self.tok.batch_decode(out[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)]

    async def opening(self, env, task) -> str | None:
        history = message_history(env, task)
        if not user_speaks_next(history):
            return None
        return self._generate([_user_view(task, history, False)])[0]

    def start(self, env, task, session, opening):
        if env.user_tools(task):
            raise NotImplementedError("the hf user simulator does not run user-side tools; use openai")
        return _chat_state(env, task, session, opening, [])

    async def replies(self, states, conversations):
        if not states:
            return []
        for s, m in zip(states, conversations):
            _flip_new(s, m)
        texts = self._generate([s.history for s in states])
        for s, t in zip(states, texts):
            s.history.append({"role": "assistant", "content": t})
        return [s.said(t) for s, t in zip(states, texts)]


class DataUserSim(UserSim):
    """`sim` for most tasks, but env.scripted_user for tasks whose user is written in the data
    (task.meta["user_sim"]["scripted"]: BFCL's questions, ACEBench's multi-step entries, which have no user)."""

    def __init__(self, sim: UserSim):
        self.sim, self.scripted = sim, ScriptedUserSim()

    def __getattr__(self, name):  # the wrapped simulator's own attributes (model, _generate, ...)
        if name == "sim":
            raise AttributeError(name)
        return getattr(self.sim, name)

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


def make_user_sim(name: str, **options) -> UserSim:
    """"scripted" (env.scripted_user), "openai" (any OpenAI-compatible endpoint), "hf" (a local model). An LLM user
    leaves the tasks whose user is the data to the environment's script (DataUserSim)."""
    sims = {"scripted": ScriptedUserSim, "openai": OpenAIUserSim, "hf": HFUserSim}
    if name not in sims:
        raise ValueError(f"unknown user simulator {name!r}: use one of {sorted(sims)}")
    return sims[name](**options) if name == "scripted" else DataUserSim(sims[name](**options))
