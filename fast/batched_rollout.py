"""fast/batched_rollout.py: many episodes at once over the batched engine (engine.py), the agent talking to simulated
users and tools: the fast twin of rollout.reference_rollout, tested to give its tokens and masks under greedy
decoding (tests/test_rollout.py). Machinery: skip it on a first read.

    from fast.batched_rollout import RolloutConfig, rollout
    from plumbing.users import make_user_sim
    episodes = rollout(model, tokenizer, env, tasks, group_size=8, user_sim=make_user_sim("scripted"),
                       cfg=RolloutConfig())          # len(episodes) == 8 * len(tasks), a task's 8 consecutive

All live episodes decode together; a row that ends its turn leaves the batch at once (it trades its cache slot with
the batch's last row: pool.SlotPool), so a long turn never makes short ones pay. The cache is kept across turns,
in the episode's slot: at the next turn only the tokens not yet in it (the agent's last sampled token and the delta
of tool results or user reply) are prefilled. `reuse_cache=False` re-encodes the whole conversation every turn
instead; with greedy decoding both give the same tokens (docs/invariants.md, 5, tested). Only full-attention models
are supported (a sliding window is refused past its width).

Turns are asynchronous per episode (continuous batching): a batch decodes until fewer than half its rows
(`refill_below`) are still in their turn; the rest stop mid-turn (cache, partial turn, last sampled token as
pending input, all kept in place), the rows that ended their turn run their tools, and the next batch takes them
back together with the rows mid-turn. So the batch stays at least half full instead of draining to the longest
turn.

A user behind an endpoint never stalls decoding: a row whose turn ends with a message to the user leaves the batch,
its reply is requested at once from a thread of the user simulator's own (userloop.py, an event loop: the
endpoint's concurrency limit applies there), and the row rejoins the next batch once the reply is in; a batch also
returns early when enough replies have arrived to be worth taking in. The model runs only in the caller's thread.
Tool calls run between batches, in the decoding thread (local database calls), unless the environment says they
are slow (`slow_tools = True`: a remote service); then they run from the user thread too while others decode. Not
overlapped: a user that is local (`UserSim.local`: the scripted user, which answers at once, and an hf user, which
computes on the same device and is asked for all waiting replies in one batch). Each episode samples from its own
generator (`episode_seed`), so its tokens do not depend on which rows shared its batches or when replies came back.
The G episodes of a task share their opening: it is prefilled once and its cache given to each (`_prefill_openings`).
A user simulator whose endpoint keeps failing ends the episode as infra_error (`infra_failed`: training leaves it
out instead of scoring it 0). bench/rollout.py measures batch occupancy and how much of a slow user's latency is
hidden.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import logging
import time
from dataclasses import dataclass

import torch

from fast.deadlines import guard
from fast.engine import _prefill_openings, _Row, admit, generate_turn
from fast.graphs import graphs_on, step_graphs
from fast.pool import SlotPool, Tiers, _compute_dtype_device, let_go, parse_slots, rollout_pool
from fast.userloop import UserLoop
from envs import Speaker, Termination, next_turn, opening_messages
from envs.users import UserSimError, opening_retries, reply_problem, retries_of
from muarl import Episode, TurnEnd, prompt_ids, stop_token_ids
from rollout import (Sampling, add_to_conversation, agent_turn, append_delta, end_episode, record_turn,
                     reference_rollout, run_tool_calls)

log = logging.getLogger("muarl.rollout")


@dataclass
class RolloutConfig(Sampling):
    """Sampling, and how the batched engine decodes (none of it changes the tokens of greedy decoding)."""
    tool_timeout: float = 30.0
    """seconds one tool call may run (0: none); an overrun is an error tool message the agent reads (deadlines.py)"""
    reuse_cache: bool = True
    """keep each episode's KV cache across turns and prefill only the new tokens; False re-encodes every turn"""
    max_batch: int = 0
    """at most this many episodes decode in one batch (0: all); bounds GPU memory; 1 = one episode at a time"""
    park_device: str = ""
    """where an episode's KV cache goes when its slot is needed by another (with max_batch, the pool has max_batch
    slots): '' the model's device; 'cpu' pinned host memory, so that with max_batch only the decoding batch's caches
    are on the GPU (an episode crosses the bus only when it loses its slot and when it gets one back)"""
    refill_below: float = 0.5
    """a decoding batch stops when fewer than this fraction of its rows are still in their turn, stops those
    mid-turn, and lets the rows that ended their turn rejoin after their tools / user reply (continuous batching;
    0: turns are synchronous, 1: refill whenever a row ends its turn); greedy tokens never depend on it"""
    decode_attention: str = "grouped"
    """the engine's attention (prefill and decoding steps): 'grouped' reads each row's cache once whatever the query
    heads per key-value head (decode.grouped_decode_attention); 'model' the model's own sdpa or eager attention with
    an additive mask, which copies the cache to every query head first (repeat_kv)"""
    compile_decode: str = "off"
    """'on': the decoder's forward for one token a row through torch.compile (decode.decode_step; the draw stays
    eager); 'auto': on a GPU only; 'off' (the default until it is timed on a GPU: on this project's CPU it gains
    ~1.1x a rollout after a compile of 10-45 s, bench/README.md)"""
    decode_graphs: str = "off"
    """'on': the decoding step over fixed buffers by bucket of rows and columns (graphs.py), captured as CUDA graphs
    on a GPU and replayed, run eagerly on the CPU (the same tokens); 'auto': on a GPU only; 'off' (the default until
    its tokens and memory through a real run are checked on a GPU; timed on an H200: bench/README.md)"""
    decode_share_opening: bool = False
    """hold each group's opening once, in a pool of its own, and let its rows' slots hold only what follows it: the
    opening's keys and values are read once per group a decoding step (opening.opening_attention, with
    decode_attention 'grouped'); False: every row's slot holds a copy of its opening (the twin)"""
    decode_slots: str = ""
    """slots sized by need: SLOTSxPOSITIONS, comma-separated (pool.parse_slots, pool.Tiers; decode_attention 'grouped',
    not graphed, not compiled); '': one size, max_context (or max_batch slots of it)"""
    reference: bool = False
    """play every episode with rollout.reference_rollout instead, one at a time with model.generate (--rollout
    reference): the loop a reader read, for an experiment on the turn loop; the same greedy episodes, slower, and
    sampled ones drawn otherwise (by generate, from each episode's own seed)"""
    prefill_tokens: int = 8192
    """at most this many tokens (rows x columns) in one prefill forward: a long prefill runs in column chunks that
    append to the cache, so its activations stay those of one chunk (bench/README.md, kv_peak); 0: one forward"""

    @classmethod
    def from_options(cls, opts, on_gpu: bool) -> RolloutConfig:
        """The rollout an entry point's options.SamplingOptions ask for; temperature 0 is greedy. With rollout_batch
        on a GPU, the caches of the episodes that lose their slot wait in pinned host memory."""
        if opts.decode_attention not in ("grouped", "model"):
            raise SystemExit(f"--decode-attention: {opts.decode_attention!r} is not 'grouped' or 'model'")
        if opts.decode_attention == "model" and getattr(opts, "attn", "sdpa") == "flash":
            raise SystemExit("--decode-attention model: the model's attention under --attn flash cannot take the "
                             "engine's 4-D mask; give --decode-attention grouped (the default)")
        if opts.decode_share_opening and (opts.decode_attention != "grouped" or opts.compile_decode != "off"):
            raise SystemExit("--decode-share-opening: the opening held apart is read by --decode-attention grouped "
                             "only, and not yet through --compile-decode (give --compile-decode off)")
        if opts.decode_slots:
            try:
                parse_slots(opts.decode_slots, opts.max_context)
            except ValueError as e:
                raise SystemExit(str(e)) from None
            if opts.decode_attention != "grouped" or opts.compile_decode != "off":
                raise SystemExit("--decode-slots: slots of several sizes are read by --decode-attention grouped only, "
                                 "and not yet through --compile-decode (give --compile-decode off)")
        for name in ("compile_decode", "decode_graphs"):
            if getattr(opts, name) not in ("auto", "on", "off"):
                raise SystemExit(f"--{name.replace('_', '-')}: {getattr(opts, name)!r} is not 'auto', 'on' or 'off'")
        if opts.rollout not in ("engine", "reference"):
            raise SystemExit(f"--rollout: {opts.rollout!r} is not 'engine' or 'reference'")
        return cls(temperature=opts.temperature or 1e-5, top_p=opts.top_p, greedy=opts.temperature == 0,
                   max_new_tokens=opts.max_new_tokens, max_context=opts.max_context, max_turns=opts.max_turns,
                   tool_timeout=opts.tool_timeout, decode_attention=opts.decode_attention,
                   compile_decode=opts.compile_decode, decode_graphs=opts.decode_graphs,
                   decode_share_opening=opts.decode_share_opening, decode_slots=opts.decode_slots,
                   reuse_cache=opts.reuse_cache, max_batch=opts.rollout_batch, reference=opts.rollout == "reference",
                   park_device="cpu" if opts.rollout_batch and on_gpu else "")


# ---------------------------------------------------------------------------------------------------------
# The episode loop
# ---------------------------------------------------------------------------------------------------------
def _finish(row: _Row, termination: Termination) -> None:
    end_episode(row.ep, row.session, termination)
    row.free_cache()  # its slot is free now


def episode_seed(base: int, task_id, sample: int) -> int:
    """The seed of one episode's sampler: a stable hash of the rollout's base seed, the task and the sample index,
    so that an episode draws the same tokens whichever episodes shared its batches (tests/test_rollout.py)."""
    digest = hashlib.blake2b(f"{base}/{task_id}/{sample}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def rollout(model, tokenizer, env, tasks: list, group_size: int, user_sim, cfg: RolloutConfig | None = None,
            generator: torch.Generator | None = None, seed: int | None = None) -> list[Episode]:
    """Play `group_size` episodes of every task; returns them task by task, a group's episodes consecutive.

    Pass the unwrapped model (under Accelerate each process rolls out its own share of tasks; a sharded model
    only inside shard.full_weights, since processes decode different numbers of steps). Each episode samples from
    its own noise, seeded by episode_seed(seed, task, sample index); `seed` None draws it from `generator`
    (None: torch's global RNG, which seed_everything seeds), so a run's rollouts are reproducible and an episode's
    tokens do not depend on the batches it shared (up to the numerics of batched matmuls)."""
    cfg = cfg or RolloutConfig()
    if seed is None:  # drawn the same on every process (seed_everything): the process index makes them differ
        where = generator.device if generator is not None else "cpu"
        seed = int(torch.randint(0, 2**62, (1,), generator=generator, device=where))
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        seed = episode_seed(seed, f"process {rank}", 0)
    was_training = model.training
    model.eval()
    # A user simulator that answers at once (scripted) or on this device (hf) is asked between decoding batches, in
    # this thread; any other (an LLM endpoint) from a thread of its own, so that decoding goes on while it answers,
    # and so are the tools of an environment that says they are slow (env.slow_tools: a remote service).
    local, slow_tools = getattr(user_sim, "local", False), getattr(env, "slow_tools", False)
    users = None if local and not slow_tools or cfg.reference else UserLoop(user_sim)
    try:
        if cfg.reference:  # --rollout reference: rollout.py's loop, each episode alone, under the same guarantees
            return [reference_rollout(model, tokenizer, env, task, user_sim, cfg, sample=g,
                                      session=guard(env, task, cfg.tool_timeout, remote=slow_tools),
                                      seed=episode_seed(seed, f"{i}:{task.id}", g))
                    for i, task in enumerate(tasks) for g in range(group_size)]
        return _rollout(model, tokenizer, env, tasks, group_size, user_sim, cfg, seed, users, local, slow_tools)
    finally:
        try:
            if users is not None:
                users.close()
        finally:
            model.train(was_training)


def _rollout(model, tok, env, tasks, group_size, user_sim, cfg, seed, users, local, slow_tools) -> list[Episode]:
    eot_ids = stop_token_ids(model, tok)
    run = (lambda coro: users.submit(coro).result()) if users is not None else asyncio.run
    # The first user message is generated once per task and shared by its group: the G episodes differ only by
    # the agent's samples, which is what the group-relative advantage compares. A task that continues an earlier
    # conversation (tau2's message history) starts from it, as prompt; the opening is None when the agent is next.
    openings = run(_gather(*(user_sim.opening(env, t) for t in tasks)))
    rows, groups = [], []
    for i, (task, opening) in enumerate(zip(tasks, openings)):
        if isinstance(opening, BaseException) and not isinstance(opening, UserSimError):
            raise opening
        if opening is not None and not isinstance(opening, UserSimError) and reply_problem(opening):
            opening = UserSimError(f"the user simulator's opening {reply_problem(opening)}")
        tools = env.tools(task)
        failed = isinstance(opening, UserSimError)
        if failed:
            log.warning("user simulator failed to open task %s: %s", task.id, opening)
        opening_ids = [] if failed else prompt_ids(tok, opening_messages(env, task, opening), tools)
        group, retried = [], opening_retries(user_sim, task)
        for g in range(group_size):
            ep = Episode(task_id=task.id, sample=g, tools=tools, user_retries=retried if g == 0 else 0)
            # fresh state per episode (docs/invariants.md, 4); its tool calls under a deadline
            session = guard(env, task, cfg.tool_timeout, remote=getattr(env, "slow_tools", False))
            # by the task's place in `tasks` too: a task drawn twice in a step gets two different groups
            row = _Row(ep, session, None, seed=episode_seed(seed, f"{i}:{task.id}", g))
            rows.append(row)
            if failed:
                ep.reward_info = {"error": str(opening)}
                _finish(row, Termination.INFRA_ERROR)
                continue
            ep.messages = opening_messages(env, task, opening)  # the group's episodes share no mutable message
            ep.append(opening_ids, agent=False)
            row.user = user_sim.start(env, task, session, opening)
            if len(ep.input_ids) >= cfg.max_context:
                _finish(row, Termination.CONTEXT_LIMIT)
            else:
                group.append(row)
        groups.append(group)
    live = [r for r in rows if not r.ep.termination]
    # every live episode's cache in a slot of max_context positions, or max_batch slots and the others spilled; with
    # the graphed step, the process's pool (kept for the next rollout with its graphs: a slot for every episode,
    # live or not, so that the next rollout of the run has the same shape)
    every = min(cfg.max_batch or len(rows), len(rows))
    graphed = graphs_on(cfg, _compute_dtype_device(model)[1], every)
    slots = every if graphed else min(cfg.max_batch or len(live), len(live)) or 1
    opening_lens = [len(g[0].ep.input_ids) - 1 for g in groups if g]  # each group's opening: all but its last token
    shared = cfg.decode_share_opening and bool(opening_lens)  # each row's slot then holds what follows its opening
    if shared and (cfg.decode_attention != "grouped" or cfg.compile_decode != "off"):
        raise ValueError("decode_share_opening: the opening held apart is read by decode_attention 'grouped' only, "
                         "and not yet through compile_decode")
    step = 256 if graphed else 1  # (graphed: pools sized in steps of 256, found again by the next rollouts)
    if cfg.decode_slots:  # slots sized by need: a few sizes, each episode in the smallest that holds its turn
        if cfg.decode_attention != "grouped" or cfg.compile_decode != "off":
            raise ValueError("decode_slots: slots of several sizes are read by decode_attention 'grouped' only, and "
                             "not yet through compile_decode")
        pool = Tiers([SlotPool(model, n, cap, cfg.park_device) for n, cap in parse_slots(cfg.decode_slots,
                                                                                           cfg.max_context)],
                     cfg.max_new_tokens, cfg.max_context)
    else:
        pool = rollout_pool(model, slots, cfg.max_context - (min(opening_lens) // step * step if shared else 0),
                            cfg.park_device, keep=graphed)
    if shared:  # a slot for each group that can decode at once, as long as the longest opening (+ the scratch column)
        if isinstance(pool, Tiers):  # as many groups as the slots hold whole, and two more (Tiers.admit holds to it)
            slots = pool.max_openings = -(-len(pool.owner) // max(map(len, groups))) + 2
        room = -(-(max(opening_lens) + 1) // step) * step
        pool.opens = rollout_pool(model, min(slots, len(opening_lens)), room, cfg.park_device, graphed, ":openings")
    else:
        let_go(model, ":openings")  # (an openings' pool an earlier rollout kept)
    pool.graphs = step_graphs(model, pool, cfg) if graphed else None  # (after the openings' pool: it reads them)
    _prefill_openings(model, pool, [g for g in groups if g], cfg, eot_ids[0])
    waiting: dict[concurrent.futures.Future, _Row] = {}  # rows whose tools or user reply are on their way

    def rejoin(r: _Row, status: Speaker | Termination) -> None:  # what was said appended, the row in line; or ended
        if status == Speaker.AGENT and not append_delta(r.ep, tok, cfg.max_context):
            status = Termination.CONTEXT_LIMIT
        if status == Speaker.AGENT:
            live.append(r)
        else:
            _finish(r, status)

    def ask(rows: list[_Row]) -> None:  # rows whose turn went to the user
        if local:  # a user that answers at once (scripted) or computes on this device (hf): here, in one call
            for r, (reply, seconds) in zip(rows, asyncio.run(_ask_all(user_sim, rows))):
                rejoin(r, _take_reply(r, reply, seconds, cfg))
        else:
            for r in rows:
                waiting[users.submit(_ask(user_sim, r))] = r

    while live or waiting:
        if not live:  # every episode waits on its user or tools: wait for the first (all, for synchronous turns)
            users.wait(list(waiting), first=cfg.refill_below > 0)
        else:
            # Continuous batching: the batch decodes until half its rows have ended their turn (refill_below), or
            # until enough replies have arrived to be worth taking in; the rows that ended run their tools
            # here (in the user thread when the environment says its tools are slow) and rejoin, or wait for their
            # user's reply, which is on its way while the next batches decode.
            batch, rest = admit(pool, live, cfg.max_batch)
            # (rows in line for a place, `rest`, are not counted: refilling for them would spill the caches of the
            # rows still decoding to host memory under park_device, at every turn's end)
            generate_turn(model, pool, batch, cfg, eot_ids, ready=(lambda: sum(f.done() for f in waiting))
                          if users is not None else None)
            live = [r for r in batch if r.turn_end is None] + rest  # those mid-turn first, then those in line
            to_user = []
            for r in (r for r in batch if r.turn_end is not None):
                if slow_tools and r.turn_end == TurnEnd.EOT:  # its tools run in the user thread: no status yet
                    text = record_turn(r.ep, tok, r.new_ids, r.new_logprobs, r.turn_end)
                    waiting[users.submit(_tools(r, text))] = r
                    status = None
                else:
                    status = agent_turn(r.ep, r.session, tok, r.new_ids, r.new_logprobs, r.turn_end, cfg.max_turns)
                if not cfg.reuse_cache:
                    r.free_cache(ended=False)  # the next turn re-encodes the whole conversation (after its opening)
                if status == Speaker.USER:
                    to_user.append(r)
                elif status is not None:
                    rejoin(r, status)
            ask(to_user)
            if cfg.refill_below == 0 and waiting:  # synchronous turns: the next batch starts when all are back
                users.wait(list(waiting), first=False)
        to_user = []
        for f in [f for f in waiting if f.done()]:  # replies and tool results that arrived, in the order asked
            r = waiting.pop(f)
            kind, *out = f.result()
            if kind == "tools":
                status = add_to_conversation(r.ep, out[0], cfg.max_turns)
                if status == Speaker.USER:
                    to_user.append(r)
                else:
                    rejoin(r, status)
            else:
                rejoin(r, _take_reply(r, *out, cfg))
        ask(to_user)
    return [r.ep for r in rows]


async def _tools(r: _Row, text: str) -> tuple:
    """One episode's tool calls (an environment with slow_tools: a remote service), in a worker thread of the user
    thread's loop so that the loop keeps serving the other requests; the decoding thread appends the results."""
    return "tools", await asyncio.to_thread(run_tool_calls, r.ep, r.session, text)


async def _ask(user_sim, r: _Row) -> tuple:
    """One episode's user reply (a UserSimError in its place when the simulator failed) and the seconds it took.
    In the user thread, the user simulator alone touches the row (its own state and, for user-side tools, the
    episode's session); the episode's tokens and messages are written back in the decoding thread."""
    t0 = time.perf_counter()
    reply = (await user_sim.replies([r.user], [r.ep.messages]))[0]
    return "user", reply, time.perf_counter() - t0


async def _ask_all(user_sim, rows: list[_Row]) -> list[tuple]:
    """Every row's reply in one call (a batched simulator answers them together), with the call's seconds."""
    t0 = time.perf_counter()
    replies = await user_sim.replies([r.user for r in rows], [r.ep.messages for r in rows]) if rows else []
    return [(reply, time.perf_counter() - t0) for reply in replies]


async def _gather(*coros) -> list:
    return list(await asyncio.gather(*coros, return_exceptions=True))


def _take_reply(r: _Row, reply, seconds: float, cfg: RolloutConfig) -> Speaker | Termination:
    """Put the user's reply into the episode; returns what follows (the agent, or why the episode ends)."""
    r.ep.user_seconds.append(round(seconds, 4))
    retried = retries_of(r.user)  # the episode's count so far; ep.user_retries also holds its opening's
    r.ep.user_retries += retried - r.retries_seen
    r.retries_seen = retried
    if isinstance(reply, UserSimError):
        log.warning("user simulator failed for task %s: %s", r.ep.task_id, reply)
        r.ep.reward_info = {"error": str(reply)}
        return Termination.INFRA_ERROR
    if isinstance(reply, BaseException):
        raise reply
    problem = reply_problem(reply)
    if problem:  # an empty, endless or broken user turn is a broken user, not a dialogue to score
        log.warning("user simulator's reply for task %s %s", r.ep.task_id, problem)
        r.ep.reward_info = {"error": f"the user simulator's reply {problem}"}
        return Termination.INFRA_ERROR
    r.ep.messages.append({"role": "user", "content": reply})
    return next_turn(r.ep.messages, r.ep.turns, cfg.max_turns)
