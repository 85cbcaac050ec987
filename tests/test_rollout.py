"""rollout.py: the token layout, cache reuse == re-encoding under greedy decoding, sampler logprobs, termination
reasons, tool-call errors, and the three user simulators (openai against a real local HTTP server)."""
import copy
import json

import pytest
from conftest import ChatServer
import torch

import muarl
from envs import Task, ToolResult
from fast.batched_rollout import RolloutConfig, rollout
from plumbing.users import make_user_sim
from envs.users import GREETING, UserSimError
from rollout import reference_rollout, run_tool_calls


# ---------------------------------------------------------------------------------------------------------
# A tiny fake environment: one order in a dict, two tools (+ the stop tool), a user that talks for N turns
# ---------------------------------------------------------------------------------------------------------
class FakeSession:
    def __init__(self, task):
        self.db = copy.deepcopy(task.data["db"])
        self.pad = task.data.get("pad", "")
        self.calls = []  # (name, arguments, requestor)

    def call_tool(self, name, arguments, requestor="assistant", n_messages=None):
        self.calls.append((name, arguments, requestor))
        tools = {"get_order": self._get_order, "cancel_order": self._cancel_order, "reset_router": lambda: "ok",
                 "transfer_to_human_agents": lambda: "Transfer successful", "explode": self._explode}
        if name not in tools:
            return ToolResult(f"Error: unknown tool {name}", error=True)
        try:
            return ToolResult(tools[name](**arguments))
        except Exception as e:
            return ToolResult(f"Error: {e}", error=True)

    def _get_order(self, order_id):
        return json.dumps(self.db["orders"][order_id]) + self.pad

    def _cancel_order(self, order_id):
        self.db["orders"][order_id]["status"] = "cancelled"
        return "cancelled"

    def _explode(self):
        raise RuntimeError("the tool broke")

    def reward(self, messages):
        ok = self.db["orders"]["o1"]["status"] == "cancelled"
        return float(ok), {"db_match": ok}


class FakeUser:
    """Replies whatever the agent says, until the task's number of agent text messages, then stops."""

    def __init__(self, task):
        self.task = task

    def opening(self):
        return f"Hi, please cancel order o1 ({self.task.id})."

    def reply(self, messages):
        k = sum(m["role"] == "assistant" and not m.get("tool_calls") for m in messages)
        return "Thanks. ###STOP###" if k >= self.task.meta["turns"] else f"I still need help ({k})."


def _schema(name, **params):
    return {"type": "function", "function": {"name": name, "description": name, "parameters": {
        "type": "object", "properties": {p: {"type": "string"} for p in params}, "required": list(params)}}}


class FakeEnv:
    name = "fake"

    def __init__(self, n_tasks=3, user_tools=False, pad=""):
        self.n, self.with_user_tools, self.pad = n_tasks, user_tools, pad
        self.sessions = []

    def tasks(self, split="train"):
        return [Task(id=f"t{i}", user_scenario=f"You want order o1 cancelled (scenario {i}).",
                     data={"db": {"orders": {"o1": {"status": "pending"}}}, "pad": self.pad}, meta={"turns": 2 + i})
                for i in range(self.n)]

    def system_prompt(self, task):
        return "You are a shop agent. Cancel orders when asked."

    def tools(self, task):
        return [_schema("get_order", order_id=1), _schema("cancel_order", order_id=1),
                _schema("transfer_to_human_agents")]

    def user_tools(self, task):
        return [_schema("reset_router")] if self.with_user_tools else []

    def start(self, task):
        self.sessions.append(FakeSession(task))
        return self.sessions[-1]

    def scripted_user(self, task):
        return FakeUser(task)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """At these tiny shapes one thread is faster, and immune to other processes on a 2-core box (measured:
    0.6 s vs 5 s for the same rollout with two threads while another job ran)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


GREEDY = RolloutConfig(greedy=True, max_new_tokens=64, max_turns=8)


def _segments(ep):
    """Split an episode's tokens into runs of equal loss_mask: [(mask, ids, logprobs)]."""
    out = []
    for t, m, lp in zip(ep.input_ids, ep.loss_mask, ep.logprobs):
        if not out or out[-1][0] != m:
            out.append((m, [], []))
        out[-1][1].append(t)
        out[-1][2].append(lp)
    return out


@pytest.mark.versions
# ---------------------------------------------------------------------------------------------------------
# The loop and the token layout
# ---------------------------------------------------------------------------------------------------------
def test_greedy_cache_reuse_equals_reencoding(lm, tiny_tok):
    """Invariant 5: several episodes of different lengths, several turns each, identical token ids."""
    env = FakeEnv(n_tasks=4)
    a = rollout(lm, tiny_tok, env, env.tasks(), 2, make_user_sim("scripted"), GREEDY)
    b = rollout(lm, tiny_tok, env, env.tasks(), 2, make_user_sim("scripted"),
                RolloutConfig(**{**GREEDY.__dict__, "reuse_cache": False}))
    assert [e.input_ids for e in a] == [e.input_ids for e in b]
    assert [e.loss_mask for e in a] == [e.loss_mask for e in b]
    for x, y in zip(a, b):
        assert torch.allclose(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-4)
    assert all(e.turns >= 2 for e in a) and len({len(e.input_ids) for e in a}) > 1
    assert sum(e.turns for e in a) >= 20 and {e.termination for e in a} == {"user_stop"}
    lengths = {len(s[1]) for e in a for s in _segments(e) if s[0] == 1}
    assert len(lengths) > 5  # turns of different lengths: rows leave the batch at different steps
    c = rollout(lm, tiny_tok, env, env.tasks(), 2, make_user_sim("scripted"),
                RolloutConfig(**{**GREEDY.__dict__, "max_batch": 1}))
    assert [e.input_ids for e in a] == [e.input_ids for e in c]


@pytest.mark.versions
def test_the_cache_goes_by_the_name_the_decoder_takes(lm, tiny_tok):
    """transformers renamed the forward's `past_key_values` to `cache` (newer 5.x warn on every call with the old
    name and drop it in 5.40), while 5.17 knows only the old name and would pass `cache=` on into **kwargs unread,
    decoding each turn without its past. The engine asks the decoder's signature; decoding here warns of neither."""
    import warnings

    from fast.decode import with_cache

    class Old(torch.nn.Module):  # 5.17's signature
        def forward(self, input_ids=None, past_key_values=None, use_cache=None, **kwargs):
            pass

    class New(torch.nn.Module):
        def forward(self, input_ids=None, cache=None, use_cache=None, **kwargs):
            pass
    assert with_cache(Old(), "C") == {"past_key_values": "C", "use_cache": True}
    assert with_cache(New(), "C") == {"cache": "C", "use_cache": True}
    env = FakeEnv(n_tasks=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        eps = rollout(lm, tiny_tok, env, env.tasks(), 2, make_user_sim("scripted"), GREEDY)
    assert sum(e.turns for e in eps) >= 4 and not any(e.infra_failed for e in eps)
    assert not [w for w in caught if "past_key_values" in str(w.message)]


@pytest.mark.versions
def _runs_of_ones(mask):
    """(start, the run) of each maximal run of 1s in a 0/1 list."""
    out, i = [], 0
    while i < len(mask):
        if mask[i]:
            j = i
            while j < len(mask) and mask[j]:
                j += 1
            out.append((i, mask[i:j]))
            i = j
        else:
            i += 1
    return out


def test_engine_plays_the_reference_episodes(lm, tiny_tok):
    """The oracle: under greedy decoding the engine (cross-turn KV cache, continuous batching, padded batches) gives
    exactly the token ids, loss masks, messages, endings and rewards of reference_rollout (HF generate, one episode
    at a time, re-encoding each turn), and the same sampler logprobs up to float error. `lm`'s logits are far
    enough from ties that greedy choices do not flip between the two numerically different paths. The max_batch
    configuration parks waiting episodes' caches with park_device='cpu', as grpo.py does on a GPU; on this CPU that
    move is a no-op, so what it checks here is the plumbing, not the host-device copies. The last two configurations
    prefill in chunks of 37 and of 2 columns (prefill_tokens 150 and 8 over 4 rows): every opening takes several
    forwards, and so do the later turns' deltas, whose rows hold caches of different lengths."""
    env, endings = FakeEnv(n_tasks=4), set()
    for cfg in (GREEDY, RolloutConfig(greedy=True, max_new_tokens=30, max_turns=3, max_context=720, max_batch=3,
                                      park_device="cpu"),
                RolloutConfig(greedy=True, max_new_tokens=64, max_turns=8, max_context=700),
                RolloutConfig(greedy=True, max_new_tokens=64, max_turns=8, prefill_tokens=150),  # 37-column chunks
                RolloutConfig(greedy=True, max_new_tokens=64, max_turns=8, prefill_tokens=8)):  # 2-column chunks
        fast = rollout(lm, tiny_tok, env, env.tasks(), 1, make_user_sim("scripted"), cfg)
        slow = [reference_rollout(lm, tiny_tok, env, t, make_user_sim("scripted"), cfg) for t in env.tasks()]
        for a, b in zip(fast, slow):
            assert a.input_ids == b.input_ids and a.loss_mask == b.loss_mask and a.messages == b.messages
            assert (a.termination, a.turns, a.reward, a.tool_calls) == (b.termination, b.turns, b.reward, b.tool_calls)
            assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4)
            assert a.turn_spans == b.turn_spans and len(a.turn_spans) == a.turns
            # each agent turn is one run of loss mask 1, recorded as it was appended (never read off the mask)
            runs = [(i, i + len(r)) for i, r in _runs_of_ones(a.loss_mask)]
            assert a.turn_spans == runs
        endings |= {e.termination for e in fast}
    assert endings == {"user_stop", "max_turns", "response_truncated", "context_limit"}


def _plays_the_reference_twice_a_task(lm, tok, env, fast, cfg):
    """Greedy episodes (two a task) equal to reference_rollout's, token for token, logprobs within 1e-4."""
    slow = [reference_rollout(lm, tok, env, t, make_user_sim("scripted"), cfg) for t in env.tasks()]
    for i, a in enumerate(fast):
        b = slow[i // 2]
        assert a.input_ids == b.input_ids and a.loss_mask == b.loss_mask and a.messages == b.messages
        assert (a.termination, a.turns, a.reward) == (b.termination, b.turns, b.reward)
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4)


def _samples_as_its_twin(lm, tok, env, cfg, **twin):
    """Sampled episodes (two a task, 4 turns at 0.8) equal to those of cfg with `twin`'s settings, per episode seed."""
    sampled = {**cfg.__dict__, "greedy": False, "temperature": 0.8, "max_turns": 4}
    gen = lambda: torch.Generator().manual_seed(3)  # noqa: E731
    a = rollout(lm, tok, env, env.tasks(), 2, make_user_sim("scripted"), RolloutConfig(**sampled), gen())
    b = rollout(lm, tok, env, env.tasks(), 2, make_user_sim("scripted"), RolloutConfig(**{**sampled, **twin}), gen())
    assert [e.input_ids for e in a] == [e.input_ids for e in b]
    assert torch.allclose(torch.tensor(sum((e.logprobs for e in a), [])), torch.tensor(sum((e.logprobs for e in b),
                                                                                         [])), atol=1e-4)


@pytest.mark.parametrize("extra", [{}, {"max_batch": 3, "park_device": "cpu"}, {"prefill_tokens": 8},
                                   {"reuse_cache": False}, {"refill_below": 1.0, "max_batch": 5}, {"fused": False}])
def test_the_opening_held_once_plays_the_same_episodes(lm, tiny_tok, extra, monkeypatch):
    """decode_share_opening: each group's opening in a pool of its own, the rows' slots holding what follows it, read by
    opening.opening_attention. Greedy: the reference's episodes (two a task, so each opening has several readers),
    with rows spilling to host memory and back (and openings: 3 slots for 4 groups), chunked prefill, re-encoding each
    turn, rows parked mid-turn, the two attention parts written out (decode.attend_lse's path where no fused kernel
    holds); sampled: the per-row engine's tokens, episode by episode; and the cache holds each opening once (the rows'
    slots are shorter by the shortest opening), every spilled one given back."""
    from transformers import AttentionInterface

    from fast import batched_rollout as R, decode, opening
    from fast.pool import _Spilled

    monkeypatch.setattr(decode, "FUSED_LSE", extra.pop("fused", True))
    env, pools, groups_read, rescued = FakeEnv(n_tasks=4), [], [], _Spilled.rescued
    cfg = RolloutConfig(**{**GREEDY.__dict__, **extra, "decode_share_opening": True})
    real = R.rollout_pool
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(R, "rollout_pool", lambda *a, **k: pools.append(real(*a, **k)) or pools[-1])
        mp.setitem(AttentionInterface._global_mapping, decode.OPENING, lambda *a, **k: groups_read.append(
            len(decode._OPENINGS[-1][2].lengths)) or opening.opening_decode_attention(*a, **k))
        fast = rollout(lm, tiny_tok, env, env.tasks(), 2, make_user_sim("scripted"), cfg)
    assert groups_read and max(groups_read) >= 2  # every forward after the openings read them, several at once
    _plays_the_reference_twice_a_task(lm, tiny_tok, env, fast, cfg)
    opens = pools[0].opens
    assert opens is not None and len(opens.owner) == min(len(pools[0].owner), len(env.tasks()))
    assert pools[0].capacity == cfg.max_context - min(len(e.input_ids[:e.turn_spans[0][0]]) - 1 for e in fast)
    assert all(o is None for o in opens.owner)  # every group's opening let go once its episodes ended
    assert _Spilled.rescued == rescued  # and every spilled cache given back by its rows, none by the collector
    _samples_as_its_twin(lm, tiny_tok, env, cfg, decode_share_opening=False)


@pytest.mark.parametrize("extra", [{}, {"max_batch": 3, "park_device": "cpu"}, {"prefill_tokens": 8},
                                   {"reuse_cache": False}, {"refill_below": 1.0},
                                   {"decode_share_opening": True, "decode_slots": "4x128,2x256,2x1024"}])
def test_slots_sized_by_need_play_the_same_episodes(lm, tiny_tok, extra):
    """decode_slots: three sizes of slot (pool.Tiers), an episode in the smallest that holds its turn and moved up
    when it outgrows it, rows that fit no free slot waiting for a later batch. The openings are ~560 tokens and the
    episodes end at 645-767: every episode starts in the 640-position slots, and most move up once or twice. Greedy:
    the reference's episodes, with spilling (and host memory), chunked prefill, re-encoding each turn, rows joining
    whenever one ends, the opening held once (its rows' slots then hold only what follows it); sampled: the one-size
    pool's tokens, episode by episode. Every row left its slot at the end, no spilled cache was left to the
    collector."""
    from fast import engine, pool as pools

    from fast.pool import _Spilled

    env, made, moves, waits, rescued = FakeEnv(n_tasks=4), [], [], [], _Spilled.rescued
    cfg = RolloutConfig(**{**GREEDY.__dict__, "max_context": 1024, "decode_slots": "4x640,2x720,2x1024", **extra})
    real_take, real_admit, real_tiers = pools.SlotPool.take, pools.Tiers.admit, pools.Tiers.__init__

    def take(self, row, slot):  # a move up: from a slot of another tier
        moves.append(row.slot >= 0 and row.pool is not self)
        real_take(self, row, slot)

    def admit(self, rows, limit=0):
        batch, rest = real_admit(self, rows, limit)
        waits.append(len(rest))
        return batch, rest

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pools.SlotPool, "take", take)
        mp.setattr(pools.Tiers, "admit", admit)
        mp.setattr(pools.Tiers, "__init__", lambda self, *a: made.append(self) or real_tiers(self, *a))
        fast = rollout(lm, tiny_tok, env, env.tasks(), 2, make_user_sim("scripted"), cfg)
    assert any(moves) != (not cfg.reuse_cache) and any(waits)  # rows moved up a size (with their cache, when they
    # keep it), and some waited for a slot that fits
    _plays_the_reference_twice_a_task(lm, tiny_tok, env, fast, cfg)
    (tiers,) = made
    assert [(len(p.owner), p.capacity) for p in tiers.pools] == pools.parse_slots(cfg.decode_slots, 1024)
    assert all(o is None for o in tiers.owner) and _Spilled.rescued == rescued
    assert isinstance(engine.admit(tiers, [], 0), tuple)
    _samples_as_its_twin(lm, tiny_tok, env, cfg, decode_slots="")


def test_tiers_admit_by_need_and_by_openings(tiny_lm):
    """Tiers.admit: each row to the smallest size that holds its turn, staying where it fits, waiting when no size
    that fits has room, and (openings held apart) when its group would be one more than max_openings."""
    from types import SimpleNamespace

    from fast.pool import SlotPool, Tiers

    tiers = Tiers([SlotPool(tiny_lm, 2, 32), SlotPool(tiny_lm, 1, 64)], max_new_tokens=8, max_context=64)
    a, b = SimpleNamespace(), SimpleNamespace()
    row = lambda n, opening=None: SimpleNamespace(ep=SimpleNamespace(input_ids=range(n)), base=0, pool=None,  # noqa
                                                  slot=-1, spilled=None, kv_len=0, held=0, opening=opening)
    short, long1, long2, short2, short3 = row(10), row(40), row(50), row(20), row(12)
    assert [tiers.need(r) for r in (short, long1)] == [18, 48]
    last = row(60)  # a turn that can reach max_context fits the largest size, which is max_context
    assert tiers.need(last) == 64 and tiers.admit([last]) == ([last], [])
    batch, rest = tiers.admit([short, long1, long2, short2, short3])
    assert batch == [short, long1, short2] and rest == [long2, short3]  # one 64-slot; two 32-slots
    assert tiers.admit([short, long1], limit=1) == ([short], [long1])
    parts = tiers.arrange(batch)
    assert [(p.capacity, [r.slot for r in rs]) for p, rs in parts] == [(32, [0, 1]), (64, [0])]
    tiers.max_openings = 1
    grouped = [row(10, a), row(10, b), row(10, a)]
    assert tiers.admit(grouped) == ([grouped[0], grouped[2]], [grouped[1]])


def test_bad_slot_sizes_are_refused_by_name():
    from fast.pool import parse_slots
    from plumbing import options

    opts = options.SamplingOptions(decode_slots="8x1024,2x4096", max_context=4096)
    assert RolloutConfig.from_options(opts, on_gpu=False).decode_slots == "8x1024,2x4096"
    for bad, what in ((dict(max_context=8192), "must hold an episode at --max-context"),
                      (dict(decode_attention="model"), "--decode-attention grouped only")):
        with pytest.raises(SystemExit, match=f"--decode-slots.*{what}"):
            RolloutConfig.from_options(options.SamplingOptions(**{"decode_slots": "8x1024,2x4096", "max_context":
                                                                   4096, **bad}), on_gpu=False)

    assert parse_slots("2x64, 4x16", 64) == [(4, 16), (2, 64)]
    for spec, what in (("4x16", "must hold an episode at --max-context"), ("4x", "'4x' is not SLOTSxPOSITIONS"),
                       ("0x64", "'0x64'"), ("ax64", "'ax64'")):
        with pytest.raises(ValueError, match=what):
            parse_slots(spec, 64)


def test_a_second_stop_token_from_the_generation_config_ends_the_turn(lm, tiny_tok):
    """Qwen3's generation config lists two eos ids (<|im_end|>, <|endoftext|>). A model with two stop tokens whose
    output rows nearly tie, so greedy turns end on either: a turn ends on the first one drawn, the token is kept and
    trained (mask 1, out of the message text), the next delta closes the turn with the template's <|im_end|> (mask
    0), the episode goes on, and the engine still plays the reference's episodes token for token."""
    eot, other = muarl.end_of_turn_id(tiny_tok), tiny_tok.convert_tokens_to_ids("<|endoftext|>")
    model = copy.deepcopy(lm)
    with torch.no_grad():
        w = model.get_output_embeddings().weight
        w[other] = w[eot] + 0.05 * torch.randn(w.shape[1], generator=torch.Generator().manual_seed(0))
    model.generation_config.eos_token_id = [eot, other]
    env = FakeEnv(n_tasks=4)
    fast = rollout(model, tiny_tok, env, env.tasks(), 1, make_user_sim("scripted"), GREEDY)
    slow = [reference_rollout(model, tiny_tok, env, t, make_user_sim("scripted"), GREEDY) for t in env.tasks()]
    ends = []
    for a, b in zip(fast, slow):
        assert a.input_ids == b.input_ids and a.loss_mask == b.loss_mask and a.messages == b.messages
        assert (a.termination, a.turns) == (b.termination, b.turns)
        segs = _segments(a)
        agent = [i for i, s in enumerate(segs) if s[0] == 1]
        said = [i for i, m in enumerate(a.messages) if m["role"] == "assistant"]
        for k, (i, mi) in enumerate(zip(agent[:-1], said[:-1])):  # a turn followed by more conversation
            stop = segs[i][1][-1]
            ends.append(stop)
            assert stop in (eot, other) and segs[i][2][-1] <= 0  # sampled, with its logprob, trained
            new = a.messages[mi + 1:said[k + 1]]
            delta = muarl.delta_ids(tiny_tok, new, ended_with=stop)
            assert segs[i + 1][:2] == (0, delta)
            assert delta == ([eot] if stop == other else []) + muarl.delta_ids(tiny_tok, new)
        assert not any("<|endoftext|>" in (m.get("content") or "") for m in a.messages)
    assert ends.count(other) >= 2 and ends.count(eot) >= 2
    assert sum(e.turns for e in fast) >= 10 and {e.termination for e in fast} <= {"user_stop", "max_turns"}
    b = rollout(model, tiny_tok, env, env.tasks(), 1, make_user_sim("scripted"),
                RolloutConfig(**{**GREEDY.__dict__, "reuse_cache": False}))
    assert [e.input_ids for e in fast] == [e.input_ids for e in b]
    sim = make_user_sim("hf", model=model, tokenizer=tiny_tok)
    assert sim.end_of_turn == [eot, other]


@pytest.mark.parametrize("max_batch", [0, 3])
def test_mid_turn_parking_changes_nothing(lm, tiny_tok, monkeypatch, max_batch):
    """Continuous batching: with refill_below=1 a batch returns whenever a row ends its turn, parking the others
    mid-turn, and is re-stacked with the rows that start their next turn (max_batch 3: also with rows waiting).
    Greedy tokens equal synchronous turns and re-encoding; sampled logprobs still equal a plain forward pass."""
    from fast import batched_rollout as R

    mid_turn, calls = [], []

    def counting(model, pool, rows, *args, **kwargs):
        calls.append(len(rows))
        R_generate(model, pool, rows, *args, **kwargs)
        mid_turn.append(sum(r.turn_end is None for r in rows))

    R_generate = R.generate_turn
    monkeypatch.setattr(R, "generate_turn", counting)
    env = FakeEnv(n_tasks=4)
    cfg = {**GREEDY.__dict__, "refill_below": 1.0, "max_batch": max_batch}
    a = rollout(lm, tiny_tok, env, env.tasks(), 2, make_user_sim("scripted"), RolloutConfig(**cfg))
    assert sum(mid_turn) > 10 and max(calls) == (max_batch or 8)  # rows were parked mid-turn, many times
    for other in ({"refill_below": 0.0}, {"reuse_cache": False, "refill_below": 0.0}):
        b = rollout(lm, tiny_tok, env, env.tasks(), 2, make_user_sim("scripted"), RolloutConfig(**{**cfg, **other}))
        assert [e.input_ids for e in a] == [e.input_ids for e in b]
        assert [e.loss_mask for e in a] == [e.loss_mask for e in b] and [e.turns for e in a] == [e.turns for e in b]
    cfg = RolloutConfig(temperature=0.7, max_new_tokens=24, max_turns=4, refill_below=1.0, max_batch=max_batch)
    for ep in rollout(lm, tiny_tok, env, env.tasks()[:2], 2, make_user_sim("scripted"), cfg,
                      generator=torch.Generator().manual_seed(1)):
        ids = torch.tensor([ep.input_ids])
        with torch.no_grad():
            ref = torch.log_softmax(lm(ids).logits[0, :-1].float() / 0.7, -1).gather(-1, ids[0, 1:, None])[:, 0]
        mask = torch.tensor(ep.loss_mask[1:]).bool()
        assert torch.allclose(torch.tensor(ep.logprobs[1:])[mask], ref[mask], atol=1e-4)


class LaggingUser:
    """The scripted user, answering its k-th reply of task `tid` after delay(tid, k) seconds (asyncio.sleep), or
    failing it where fail(tid, k); `log` records (tid, asked, answered) for every reply."""

    def __init__(self, delay, fail=lambda tid, k: False):
        self.sim, self.delay, self.fail, self.log = make_user_sim("scripted"), delay, fail, []

    async def opening(self, env, task):
        return await self.sim.opening(env, task)

    def start(self, env, task, session, opening):
        return [task.id, 0, self.sim.start(env, task, session, opening)]

    async def replies(self, states, conversations):
        import asyncio
        import time

        async def one(state, messages):
            tid, k, inner = state
            state[1] += 1
            asked = time.perf_counter()
            await asyncio.sleep(self.delay(tid, k))
            self.log.append((tid, asked, time.perf_counter()))
            if self.fail(tid, k):
                return UserSimError(f"endpoint down (task {tid}, reply {k})")
            return (await self.sim.replies([inner], [messages]))[0]

        return list(await asyncio.gather(*(one(s, m) for s, m in zip(states, conversations))))


def _decode_times(model):
    """Timestamps of the decoder's one-column forwards (decoding steps), and the hook's handle."""
    import time

    times = []
    handle = model.get_decoder().register_forward_pre_hook(
        lambda m, a, kw: times.append(time.perf_counter()) if kw["input_ids"].shape[1] == 1 else None,
        with_kwargs=True)
    return times, handle


def test_a_slow_user_reply_does_not_stop_the_others(lm, tiny_tok):
    """Task t0's user takes 0.4 s a reply, the others answer at once: the other episodes keep decoding while t0's
    replies are on their way (decoding steps fall inside every slow reply), t0's replies arrive after the others have
    finished turns and rejoin then, and the greedy episodes are exactly the instant user's."""
    env = FakeEnv(n_tasks=4)
    want = rollout(lm, tiny_tok, env, env.tasks(), 2, make_user_sim("scripted"), GREEDY)
    user = LaggingUser(lambda tid, k: 0.4 if tid == "t0" else 0.0)
    times, handle = _decode_times(lm)
    try:
        got = rollout(lm, tiny_tok, env, env.tasks(), 2, user, GREEDY)
    finally:
        handle.remove()
    assert [e.input_ids for e in got] == [e.input_ids for e in want]
    assert [e.loss_mask for e in got] == [e.loss_mask for e in want] and [e.reward for e in got] == [
        e.reward for e in want]
    slow = [(a, b) for tid, a, b in user.log if tid == "t0"]
    assert len(slow) >= 4
    overlapped = [sum(a < t < b for t in times) for a, b in slow]
    assert sum(n > 0 for n in overlapped) >= len(slow) // 2, overlapped
    assert all(w >= 0.4 for e in got if e.task_id == "t0" for w in e.user_seconds)
    others_done = max(b for tid, a, b in user.log if tid != "t0")
    assert max(b for a, b in slow) > others_done  # the last slow reply came after the others were all done


def test_a_user_failing_mid_way_ends_only_its_episodes(lm, tiny_tok):
    """Task t1's user fails its second reply after 0.2 s while the other tasks' users take 0.05 s: t1's episodes end
    as infra_error with the error, the others are exactly the instant user's episodes, and nothing waits forever."""
    env = FakeEnv(n_tasks=4)
    want = rollout(lm, tiny_tok, env, env.tasks(), 2, make_user_sim("scripted"), GREEDY)
    user = LaggingUser(lambda tid, k: 0.2 if tid == "t1" else 0.05, fail=lambda tid, k: tid == "t1" and k == 1)
    got = rollout(lm, tiny_tok, env, env.tasks(), 2, user, GREEDY)
    for a, b in zip(got, want):
        if a.task_id == "t1":
            assert a.termination == "infra_error" and a.infra_failed and "reply 1" in a.reward_info["error"]
            assert len(a.user_seconds) == 2
        else:
            assert (a.input_ids, a.termination, a.reward) == (b.input_ids, b.termination, b.reward)


def test_slow_tools_run_while_the_others_decode(lm, tiny_tok, monkeypatch):
    """An environment whose tools are slow (slow_tools = True; here task t0's tool step takes 0.3 s a turn, whether
    or not the turn called a tool) has them run from the user thread: the other episodes decode meanwhile, and the
    greedy episodes are exactly the plain environment's."""
    import time

    from fast import batched_rollout as R

    env = FakeEnv(n_tasks=3)
    want = rollout(lm, tiny_tok, env, env.tasks(), 2, make_user_sim("scripted"), GREEDY)
    spans, real = [], R.run_tool_calls

    def slow(ep, session, text):
        t0 = time.perf_counter()
        if ep.task_id == "t0":
            time.sleep(0.3)
        out = real(ep, session, text)
        spans.append((ep.task_id, t0, time.perf_counter()))
        return out

    monkeypatch.setattr(R, "run_tool_calls", slow)
    env.slow_tools = True
    times, handle = _decode_times(lm)
    try:
        got = rollout(lm, tiny_tok, env, env.tasks(), 2, make_user_sim("scripted"), GREEDY)
    finally:
        handle.remove()
    assert [e.input_ids for e in got] == [e.input_ids for e in want]
    assert [(e.termination, e.reward, e.turns) for e in got] == [(e.termination, e.reward, e.turns) for e in want]
    slow_spans = [(a, b) for tid, a, b in spans if tid == "t0"]
    assert len(slow_spans) >= 4
    assert sum(any(a < t < b for t in times) for a, b in slow_spans) >= len(slow_spans) // 2


def test_sampled_episodes_do_not_depend_on_batching(lm, tiny_tok):
    """Each episode samples from its own generator (batched_rollout.episode_seed): the same seed gives the same sampled
    episodes whether all decode together, one at a time or four at a time, and with a user whose latency varies by
    episode (so rows rejoin in another order and share batches with other rows); another seed differs."""
    env = FakeEnv(n_tasks=3)
    cfg = RolloutConfig(temperature=1.0, max_new_tokens=24, max_turns=4, top_p=0.95)

    def run(seed, user=None, **kw):
        eps = rollout(lm, tiny_tok, env, env.tasks(), 3, user or make_user_sim("scripted"),
                      RolloutConfig(**{**cfg.__dict__, **kw}), seed=seed)
        return [e.input_ids for e in eps]

    base = run(7)
    assert len({tuple(x) for x in base}) > 3  # the samples of a group differ
    assert run(7, max_batch=1) == base
    assert run(7, max_batch=4) == base
    assert run(7, user=LaggingUser(lambda tid, k: 0.01 * ((int(tid[1:]) * 7 + k * 3) % 5))) == base
    assert run(8) != base


def test_the_sampler_draws_from_the_truncated_distribution():
    """decode._sample (the cumulative distribution inverted at a uniform, the tokens outside top_p dropped): the
    drawn frequencies are the
    top_p-truncated, renormalized distribution, no token outside it is ever drawn, the recorded logprob is the full
    tempered one; each row's own seed and counter give it its own draws."""
    from fast.decode import _sample

    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0]).repeat(40000, 1)
    cfg = RolloutConfig(temperature=0.8, top_p=0.8)
    torch.manual_seed(0)
    tok, lp = _sample(logits, cfg)
    p = torch.softmax(logits[0] / 0.8, -1)
    keep = (torch.cumsum(p, 0) - p) <= 0.8  # the smallest prefix (by probability) that reaches top_p
    want = torch.where(keep, p, 0) / p[keep].sum()
    got = torch.bincount(tok, minlength=5).double() / len(tok)
    assert torch.allclose(got, want.double(), atol=0.01) and (got[~keep] == 0).all()
    assert torch.allclose(lp, torch.log(p)[tok], atol=1e-6)
    tok2, _ = _sample(logits, cfg, torch.arange(len(logits)), torch.zeros(len(logits), dtype=torch.long))
    got = torch.bincount(tok2, minlength=5).double() / len(tok2)  # the same with each row's counter-based noise
    assert torch.allclose(got, want.double(), atol=0.01) and (got[~keep] == 0).all()
    a, _ = _sample(logits[:3], RolloutConfig(), torch.tensor([1, 2, 1]), torch.tensor([5, 5, 5]))
    b, _ = _sample(logits[:1], RolloutConfig(), torch.tensor([1]), torch.tensor([5]))
    assert a[0] == a[2] == b[0]  # a row's draw depends on its seed and counter alone


def test_a_failing_user_thread_leaves_nothing_behind(lm, tiny_tok):
    """A user simulator that raises something other than UserSimError (a bug) fails the rollout with that error;
    the user thread is stopped and the model is back in training mode."""
    import threading

    class Broken(LaggingUser):
        async def replies(self, states, conversations):
            raise ValueError("a bug in the user simulator")

    env = FakeEnv(n_tasks=2)
    lm.train()
    with pytest.raises(ValueError, match="a bug in the user simulator"):
        rollout(lm, tiny_tok, env, env.tasks(), 2, Broken(lambda tid, k: 0.0), GREEDY)
    assert lm.training
    lm.eval()
    assert not [t for t in threading.enumerate() if t.name == "muarl-users"]


def test_ctrl_c_while_replies_are_on_their_way(lm, tiny_tok):
    """Ctrl-C (KeyboardInterrupt) in the decoding thread while a slow user's replies are on their way: the rollout
    stops at once, cancels the requests, leaves no user thread behind and puts the model back in training mode."""
    import os
    import signal
    import threading
    import time

    env = FakeEnv(n_tasks=3)
    lm.train()
    timer = threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGINT))
    t0 = time.perf_counter()
    old = signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal, even under `nohup ... &`
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            rollout(lm, tiny_tok, env, env.tasks(), 2, LaggingUser(lambda tid, k: 30.0), GREEDY)
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, old)
    assert time.perf_counter() - t0 < 20  # not the 30 s a reply would take
    assert lm.training
    lm.eval()
    assert not [t for t in threading.enumerate() if t.name == "muarl-users"]


def test_a_groups_opening_is_prefilled_once(lm, tiny_tok, monkeypatch):
    """The G episodes of a task share their opening's cache: the opening prefill has one row per task, not per
    episode, and its tokens are each task's opening once; the greedy episodes are still the reference's."""
    from fast import engine

    calls = []
    real = engine._prefill
    monkeypatch.setattr(engine, "_prefill", lambda model, pool, rows, pending, *a, **k: (
        calls.append([len(p) for p in pending]), real(model, pool, rows, pending, *a, **k))[1])
    env = FakeEnv(n_tasks=3)
    eps = rollout(lm, tiny_tok, env, env.tasks(), 4, make_user_sim("scripted"), GREEDY)
    openings = [len(muarl.prompt_ids(tiny_tok, [{"role": "system", "content": env.system_prompt(t)},
                                                {"role": "user", "content": env.scripted_user(t).opening()}],
                                     env.tools(t))) for t in env.tasks()]
    assert calls[0] == [n - 1 for n in openings]  # 3 rows, not 12
    assert all(len(c) <= 12 and max(c) < min(openings) for c in calls[1:])  # later prefills: deltas only
    ref = [reference_rollout(lm, tiny_tok, env, t, make_user_sim("scripted"), GREEDY) for t in env.tasks()]
    for i, e in enumerate(eps):
        assert e.input_ids == ref[i // 4].input_ids and e.loss_mask == ref[i // 4].loss_mask


def test_episode_layout_and_groups(lm, tiny_tok):
    env = FakeEnv(n_tasks=2)
    tasks = env.tasks()
    eps = rollout(lm, tiny_tok, env, tasks, 3, make_user_sim("scripted"), GREEDY)
    assert [(e.task_id, e.sample) for e in eps] == [(t.id, g) for t in tasks for g in range(3)]
    assert len(env.sessions) == 6  # one fresh session per episode
    eot = muarl.end_of_turn_id(tiny_tok)
    for ep in eps:
        assert len(ep.input_ids) == len(ep.loss_mask) == len(ep.logprobs)
        assert ep.messages[1]["content"] == f"Hi, please cancel order o1 ({ep.task_id})."  # shared opening
        segs = _segments(ep)
        assert segs[0] == (0, muarl.prompt_ids(tiny_tok, ep.messages[:2], ep.tools), [0.0] * len(segs[0][1]))
        agent_msgs = [i for i, m in enumerate(ep.messages) if m["role"] == "assistant"]
        agent_segs = [s for s in segs if s[0] == 1]
        assert len(agent_segs) == len(agent_msgs) == ep.turns
        assert ep.gen_tokens == sum(len(s[1]) for s in agent_segs)
        for k, (mi, seg) in enumerate(zip(agent_msgs, agent_segs)):
            assert all(lp <= 0 for lp in seg[2])
            if k < len(agent_msgs) - 1 or ep.termination not in ("response_truncated", "context_limit"):
                assert seg[1][-1] == eot  # the end-of-turn token is sampled and trained on
            if k < len(agent_msgs) - 1:  # what follows an agent turn is the template delta of the next messages
                nxt = agent_msgs[k + 1]
                delta = segs[segs.index(seg) + 1]
                assert delta[0] == 0 and delta[1] == muarl.delta_ids(tiny_tok, ep.messages[mi + 1:nxt])
        assert segs[-1][0] == 1  # nothing is appended after the last agent turn
        assert ep.termination in ("user_stop", "max_turns", "response_truncated", "transfer")
        assert ep.reward_info and ep.reward == 0.0


def test_logprobs_are_the_samplers(lm, tiny_tok):
    """Recorded logprob of each sampled token == log_softmax(logits / T) of a plain full forward pass."""
    env = FakeEnv(n_tasks=2)
    cfg = RolloutConfig(temperature=0.7, max_new_tokens=24, max_turns=4)
    eps = rollout(lm, tiny_tok, env, env.tasks(), 2, make_user_sim("scripted"), cfg,
                  generator=torch.Generator().manual_seed(1))
    for ep in eps:
        ids = torch.tensor([ep.input_ids])
        with torch.no_grad():
            logp = torch.log_softmax(lm(ids).logits[0, :-1].float() / 0.7, -1)
        ref = logp.gather(-1, ids[0, 1:, None])[:, 0]
        mask = torch.tensor(ep.loss_mask[1:]).bool()
        assert torch.allclose(torch.tensor(ep.logprobs[1:])[mask], ref[mask], atol=1e-4)


def test_seeded_sampling_reproducible(lm, tiny_tok):
    env = FakeEnv(n_tasks=2)
    cfg = RolloutConfig(max_new_tokens=16, max_turns=3, top_p=0.9)

    def run(seed):
        eps = rollout(lm, tiny_tok, env, env.tasks(), 2, make_user_sim("scripted"), cfg,
                      generator=torch.Generator().manual_seed(seed))
        return [e.input_ids for e in eps]

    assert run(3) == run(3)
    assert run(3) != run(4)


def test_limits(tiny_lm, tiny_tok, lm):
    env = FakeEnv(n_tasks=1)
    task = env.tasks()
    # a random model almost never ends its turn: 3 tokens without end-of-turn -> response_truncated
    eps = rollout(tiny_lm, tiny_tok, env, task, 2, make_user_sim("scripted"),
                  RolloutConfig(greedy=True, max_new_tokens=3))
    assert all(e.termination == "response_truncated" and e.gen_tokens == 3 and e.turns == 1 for e in eps)
    assert eps[0].messages[-1]["role"] == "assistant" and "tool_calls" not in eps[0].messages[-1]
    n_prompt = len(muarl.prompt_ids(tiny_tok, eps[0].messages[:2], eps[0].tools))
    eps = rollout(tiny_lm, tiny_tok, env, task, 1, make_user_sim("scripted"),
                  RolloutConfig(greedy=True, max_context=n_prompt + 5))
    assert eps[0].termination == "context_limit" and len(eps[0].input_ids) == n_prompt + 5
    env = FakeEnv(n_tasks=3)  # the third task's user talks for 4 turns
    eps = rollout(lm, tiny_tok, env, env.tasks()[2:], 1, make_user_sim("scripted"),
                  RolloutConfig(greedy=True, max_new_tokens=64, max_turns=2))
    assert eps[0].termination == "max_turns" and eps[0].turns == 2


def test_tool_calls_and_errors():
    env = FakeEnv()
    task = env.tasks()[0]
    ep, session = muarl.Episode(task_id="t0"), env.start(task)
    ep.turns = 1
    text = ('Let me look.\n<tool_call>\n{"name": "get_order", "arguments": {"order_id": "o1"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_order", "arguments": {"order_id": }\n</tool_call>\n'  # bad JSON
            '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>\n'  # unknown tool
            '<tool_call>\n{"name": "cancel_order", "arguments": {"oid": "o1"}}\n</tool_call>\n'  # bad arguments
            '<tool_call>\n{"name": "explode", "arguments": {}}\n</tool_call>\n'  # the tool raises
            '<tool_call>\n{"name": "cancel_order", "arguments": {"order_id": "o1"')  # unclosed
    msg, results, stop = run_tool_calls(ep, session, text)
    assert not stop
    assert msg["content"] == "Let me look." and len(msg["tool_calls"]) == len(results) == 6
    assert [r["tool_call_id"] for r in results] == [c["id"] for c in msg["tool_calls"]]
    assert len({c["id"] for c in msg["tool_calls"]}) == 6
    assert json.loads(results[0]["content"]) == {"status": "pending"}
    assert all(r["content"].startswith("Error") for r in results[1:])
    assert ep.tool_errors == 5 and ep.tool_calls == {"get_order": 1, "nope": 1, "cancel_order": 1, "explode": 1}
    assert session.db["orders"]["o1"]["status"] == "pending"
    ep.turns = 2
    msg, results, stop = run_tool_calls(
        ep, session, '<tool_call>\n{"name": "transfer_to_human_agents", "arguments": {}}\n</tool_call>')
    assert stop and results[0]["content"] == "Transfer successful" and msg["tool_calls"][0]["id"] == "call_2_0"
    assert not run_tool_calls(ep, session, '<tool_call>\n{"name": "transfer_to_human_agents", "arguments": {}\n')[2]


# ---------------------------------------------------------------------------------------------------------
# User simulators
# ---------------------------------------------------------------------------------------------------------
def _user_replies(body, n):
    said = sum(m["role"] == "assistant" for m in body["messages"])
    return 200, {"content": "Thanks, bye. ###STOP###" if said >= 3 else f"user message {said}"}


def test_openai_user_sim_flips_roles_and_retries(lm, tiny_tok):
    failed = []

    def script(body, n):  # the first request for a reply (not an opening) fails once with a 500
        if body["messages"][-1]["content"] != GREETING and not failed:
            failed.append(body)
            return 500, {}
        return _user_replies(body, n)

    server = ChatServer(script)
    try:
        env = FakeEnv(n_tasks=2)
        sim = make_user_sim("openai", base_url=server.url, api_key="k", model="sim", backoff=0.01)
        eps = rollout(lm, tiny_tok, env, env.tasks(), 2, sim, GREEDY)
    finally:
        server.close()
    assert not any(e.infra_failed for e in eps)
    assert all(e.messages[1]["content"] == "user message 0" for e in eps)
    openings = [b for _, b in server.requests if b["messages"][-1]["content"] == GREETING]
    assert len(openings) == 2  # once per task, shared by the group
    for path, body in server.requests:
        assert path == "/v1/chat/completions" and body["model"] == "sim" and body["temperature"] == 0
        msgs = body["messages"]
        assert msgs[0]["role"] == "system" and "<scenario>" in msgs[0]["content"]
        assert [m["role"] for m in msgs[1:]] == ["user", "assistant"] * (len(msgs) // 2 - 1) + ["user"]
        assert all("tool_calls" not in m for m in msgs) and "tools" not in body
    agent_texts = {m["content"] for e in eps for m in e.messages if m["role"] == "assistant" and "tool_calls" not in m}
    seen = {m["content"] for _, b in server.requests for m in b["messages"][2:] if m["role"] == "user"}
    assert seen and seen <= agent_texts  # the simulator saw the agent's words as `user`
    done = [e for e in eps if e.termination == "user_stop"]
    assert done and all(e.messages[-1]["content"] == "Thanks, bye. ###STOP###" for e in done)
    retried = [b for _, b in server.requests if b == failed[0]]
    # the group's two greedy episodes are identical, so they sent this request twice; one was retried once
    assert len(retried) == 3
    assert sum(e.user_retries for e in eps) == 1  # that retry is counted in its episode (and the step's metrics)
    assert any(e.messages[2:].count({"role": "user", "content": _user_replies(failed[0], 0)[1]["content"]})
               for e in eps)


def test_openai_user_sim_permanent_failure(lm, tiny_tok):
    server = ChatServer(lambda body, n: (503, {}) if n > 2 else _user_replies(body, n))  # openings succeed
    try:
        env = FakeEnv(n_tasks=2)
        sim = make_user_sim("openai", base_url=server.url, api_key="k", max_retries=2, backoff=0.01)
        eps = rollout(lm, tiny_tok, env, env.tasks(), 2, sim, GREEDY)
        failed_open = rollout(lm, tiny_tok, env, env.tasks()[:1], 2, sim, GREEDY)
    finally:
        server.close()
    talked = [e for e in eps if e.termination not in ("response_truncated", "transfer")]
    assert talked and all(e.termination == "infra_error" and e.infra_failed for e in talked)
    assert all(e.user_retries == 2 for e in talked)  # --user-retries 2, both spent
    assert all("error" in e.reward_info for e in talked)
    assert all(e.termination == "infra_error" and e.infra_failed and not e.input_ids for e in failed_open)
    assert [e.user_retries for e in failed_open] == [2, 0]  # the opening's retries, counted once for the group


def test_openai_user_tools(lm, tiny_tok):
    """Dual control: the simulator's tool calls run on the episode's session as the user, then it talks."""
    def script(body, n):
        if body["messages"][-1]["content"] == GREETING:
            return 200, {"content": "My internet is down."}
        assert body["tools"][0]["function"]["name"] == "reset_router"
        if body["messages"][-1]["role"] == "tool":
            return 200, {"content": "I reset it. ###STOP###"}
        return 200, {"content": None, "tool_calls": [{"id": "u1", "type": "function", "function": {
            "name": "reset_router", "arguments": "{}"}}]}

    server = ChatServer(script)
    try:
        env = FakeEnv(n_tasks=1, user_tools=True)
        eps = rollout(lm, tiny_tok, env, env.tasks(), 1, make_user_sim("openai", base_url=server.url), GREEDY)
    finally:
        server.close()
    ep = eps[0]
    assert ep.termination == "user_stop" and ep.messages[-1]["content"] == "I reset it. ###STOP###"
    assert ("reset_router", {}, "user") in env.sessions[0].calls
    assert not any(m["role"] == "tool" and m["name"] == "reset_router" for m in ep.messages)
    assert any(m["role"] == "tool" for _, b in server.requests for m in b["messages"])


def test_hf_user_sim(lm, tiny_lm, tiny_tok, monkeypatch):
    """A local model as the user: asked in the decoding thread (never from the user thread: it computes on the
    agent's device, here with the agent's own model and tokenizer), all waiting replies in one batch."""
    from fast import batched_rollout as R

    env = FakeEnv(n_tasks=2)
    sim = make_user_sim("hf", model=lm, tokenizer=tiny_tok, max_new_tokens=6)  # a user that says something
    assert sim.local and make_user_sim("scripted").local and not make_user_sim("openai", base_url="http://x").local
    monkeypatch.setattr(R, "UserLoop", None)  # a user thread would fail here
    eps = rollout(lm, tiny_tok, env, env.tasks(), 2, sim, RolloutConfig(greedy=True, max_new_tokens=64, max_turns=3))
    assert not any(ep.infra_failed for ep in eps)
    for ep in eps:
        users = [m["content"] for m in ep.messages if m["role"] == "user"]
        assert all(isinstance(u, str) for u in users) and users[0] == eps[0 if ep.task_id == "t0" else 2].messages[1]["content"]
        assert ep.termination in ("max_turns", "response_truncated", "transfer", "user_stop")
    assert sum(m["role"] == "user" for e in eps for m in e.messages) > len(eps)  # replies, not only openings
    convs = [[{"role": "system", "content": "Be a user."}, {"role": "user", "content": "Hi! " * k}] for k in (1, 9)]
    assert sim._generate(convs) == [sim._generate([c])[0] for c in convs]  # left padding is right


def test_make_user_sim_rejects_unknown():
    with pytest.raises(ValueError):
        make_user_sim("nope")
    assert issubclass(UserSimError, RuntimeError)


def test_openai_user_sim_as_text_level_user_for_play():
    """sync_user: the same simulator drives envs.play (cold-start synthesis and API agents in eval.py)."""
    from envs import play

    class Agent:  # says something, never calls tools
        def act(self, messages):
            return {"role": "assistant", "content": f"agent turn {sum(m['role'] == 'assistant' for m in messages)}"}

    server = ChatServer(_user_replies)
    try:
        env = FakeEnv(n_tasks=1)
        task = env.tasks()[0]
        sim = make_user_sim("openai", base_url=server.url, api_key="k", model="sim", backoff=0.01)
        session = env.start(task)
        messages, reward, info, termination = play(env, task, Agent(), sim.sync_user(env, task, session),
                                                   session=session)
    finally:
        server.close()
    assert termination == "user_stop" and messages[-1]["content"] == "Thanks, bye. ###STOP###"
    assert [m["role"] for m in messages] == ["system", "user"] + ["assistant", "user"] * 3
    assert messages[1]["content"] == "user message 0"


def test_the_slot_pool_moves_caches_intact(tiny_lm):
    """SlotPool.place puts a batch in slots 0..B-1 (rows already there stay; rows in the way trade places, move to a
    free slot or spill to the host), swap trades two slots: every row's cache is still its own afterwards."""
    from fast import engine
    from fast.pool import SlotPool

    pool = SlotPool(tiny_lm, 4, 16)
    rows = [engine._Row(None, None, None) for _ in range(6)]
    want = {}
    for i, r in enumerate(rows[:4]):
        pool.take(r, i)
        r.kv_len = 3 + i
        for buf in pool.k + pool.v:
            buf[i, :, :r.kv_len] = torch.randn(buf.shape[1], r.kv_len, buf.shape[3])
        want[i] = [buf[i, :, :r.kv_len].clone() for buf in pool.k + pool.v]

    def check():
        for i, r in enumerate(rows[:4]):
            if r.slot >= 0:
                got = [buf[r.slot, :, :r.kv_len] for buf in pool.k + pool.v]
            else:  # spilled: per layer (keys, values); the pool's order is every layer's keys, then their values
                got = [k for k, _ in r.spilled.kv] + [v for _, v in r.spilled.kv]
                assert all(t.is_contiguous() for t in got)  # (a GPU copies only a contiguous host view asynchronously)
            assert all(torch.equal(g, w) for g, w in zip(got, want[i]))
        assert all(pool.owner[r.slot] is r for r in rows if r.slot >= 0)

    assert pool.place([rows[2], rows[0]]) == [rows[0], rows[2]] and rows[1].slot >= 2  # 1 traded places with 2
    check()
    pool.swap(0, 3)
    check()
    placed = pool.place([rows[4], rows[5], rows[3], rows[1]])  # two new rows: two of the others spill
    assert {r.slot for r in placed} == {0, 1, 2, 3} and rows[0].slot == rows[2].slot == -1
    check()
    assert pool.place(rows[:2]) == sorted(rows[:2], key=lambda r: r.slot) and {rows[0].slot, rows[1].slot} == {0, 1}
    assert rows[2].slot == -1  # still on the host; row 0 came back from it
    check()
    rows[0].free_cache()
    assert rows[0].slot == -1 and None in pool.owner


def test_the_cache_is_never_held_twice(lm, tiny_tok, monkeypatch):
    """Byte accounting over whole rollouts (rows joining and leaving mid-turn, refills, a group's shared opening): the
    engine allocates its pool once (the memory estimate's kv_cache term), and besides it at most one row's cache of
    one layer at a time (a swap's temporary), never a batch's. With fewer slots than episodes, a row without a slot
    keeps its cache in a host block of one size, one episode at max_context (the estimate's host_kv_cache per waiting
    episode), no more blocks than rows that wait, taken back and reused: a second rollout allocates none.
    Counted at the allocation calls the engine makes (torch.zeros, torch.empty, torch.empty_like, torch.frombuffer)."""
    import sys

    from fast import pool
    from plumbing import memory

    made, blocks = [], []
    for name in ("zeros", "empty", "empty_like", "frombuffer"):
        real = getattr(torch, name)

        def counting(*a, real=real, **k):
            t = real(*a, **k)
            caller = sys._getframe(1)
            if caller.f_globals.get("__name__") in ("fast.engine", "fast.pool"):
                (blocks if caller.f_code.co_name == "_host_block" else made).append(t.numel() * t.element_size())
            return t

        monkeypatch.setattr(torch, name, counting)
    monkeypatch.setattr(pool, "_HOST_BLOCKS", {})  # no block left over from another test
    rescued = pool._Spilled.rescued
    cfg = lm.config
    row_layer = cfg.num_key_value_heads * 800 * cfg.head_dim * 4  # one row of one layer, at max_context 800
    episode = memory.kv_bytes_per_token(cfg, bf16=False) * 800  # one episode's cache at max_context
    env = FakeEnv(n_tasks=3)
    spilled = []  # host blocks each rollout allocated
    for max_batch in (0, 2, 2):
        made.clear()
        blocks.clear()
        c = RolloutConfig(greedy=True, max_new_tokens=24, max_turns=4, max_context=800, max_batch=max_batch)
        eps = rollout(lm, tiny_tok, env, env.tasks(), 3, make_user_sim("scripted"), c)
        slots = max_batch or 9
        big = [b for b in made if b > row_layer]
        assert sum(big) == episode * slots and len(big) == 2 * cfg.num_hidden_layers  # the pool, once
        assert len(made) > len(big) and sum(e.turns for e in eps) >= 9  # swaps happened, each small
        assert len(blocks) <= 9 - slots  # the page-aligned block: whole pages
        assert all(b == -(-episode // 4096) * 4096 for b in blocks)
        spilled.append(len(blocks))
    # no spill with a slot each; spills with 2 slots, in blocks the next rollout took back; every block free at the end
    assert spilled[0] == 0 and spilled[1] > 0 and spilled[2] == 0
    assert [len(free) for free in pool._HOST_BLOCKS.values()] == [spilled[1]]
    # each block's storage starts where the block does, on a page: Tensor.is_pinned asks at the storage's start, so
    # a block page-locked in place (on a GPU) reads as pinned only then
    assert all(b.untyped_storage().data_ptr() == b.data_ptr() and b.data_ptr() % 4096 == 0
               for free in pool._HOST_BLOCKS.values() for b in free)
    assert pool._Spilled.rescued == rescued  # each given back by the rows that read it, none by the collector
