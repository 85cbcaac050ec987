"""plumbing/coldstart.py: the cold start's conversations synthesized by a teacher (the small domain's scripted expert,
or an OpenAI-compatible model) playing tasks against the environment and a user simulator (those read from a file:
plumbing/conversations.py), the tiny cold start's teacher's users (`cold_start_users`); the drills the `tiny` base is
pretrained on (`windows`, `copy_loss`); and the conversations as token ids and loss masks (`encode`, the same layout as
the rollout's). sft.py trains on them."""
from __future__ import annotations

import random
import time
from dataclasses import replace

import torch

from plumbing import cli
from plumbing.users import make_user_sim, user_sim_options
from envs.api_agent import DEAD_AFTER, OpenAIAgent
from fast.logprobs import token_logprobs
from muarl import collate, encode_conversation


def make_cold_start(cfg) -> list[dict]:
    """Play tasks with the teacher and keep the conversations whose reward is 1; with `teacher_skips_confirm`, also
    those that broke only the confirmation rule (the database is right): filtered on the database alone."""
    import inspect

    from envs import load_tasks, message_history, play

    skips = {"skip_confirm": cfg.teacher_skips_confirm, "skip_ask": cfg.teacher_skips_ask,
             "skip_status": cfg.teacher_skips_status}
    for name, p in skips.items():
        if not 0 <= p <= 1:
            raise SystemExit(f"sft.py: --teacher-{name[:4]}s-{name[5:]} {p}: must be in [0, 1]")
    env, tasks = load_tasks(cfg.env, cfg.split, "sft.py")
    if cfg.teacher == "expert" and not callable(getattr(env, "expert", None)):
        raise SystemExit(f"sft.py: --teacher expert: {cfg.env} has no scripted expert (shop and bfcl: have one); give "
                         "--teacher MODEL (an OpenAI-compatible endpoint: --teacher-base-url) or --data FILE")
    for name, p in skips.items():
        if p and (cfg.teacher != "expert" or name not in
                  inspect.signature(getattr(env, "expert", lambda task: None)).parameters):
            raise SystemExit(f"sft.py: --teacher-{name[:4]}s-{name[5:]} {p}: only the scripted expert of the 'shop' "
                             f"domain can be imperfect so (teacher {cfg.teacher!r}, env {cfg.env!r})")
    imperfect = {k: p for k, p in skips.items() if p}
    random.Random(cfg.seed).shuffle(tasks)
    kept, t0 = [], time.time()
    sim = None
    if cfg.user_sim != "scripted":
        sim = make_user_sim(cfg.user_sim, **user_sim_options(cfg))
    failed, played, first_error = 0, 0, None
    for task in tasks[:cfg.num_tasks]:
        tools = env.tools(task)
        if cfg.teacher != "expert":
            agent = OpenAIAgent(cfg.teacher, tools, cfg.teacher_base_url, timeout=cfg.teacher_timeout)
        elif imperfect:
            agent = env.expert(task, **imperfect)
        else:
            agent = env.expert(task)
        session = env.start(task)
        user = sim.sync_user(env, task, session) if sim else None
        try:
            messages, reward, info, termination = play(env, task, agent, user, session=session)
        except Exception as e:  # an endpoint that keeps failing costs this episode only, and is reported
            failed += 1
            first_error = first_error or f"task {task.id}: {e}"
            cli.main_print(f"[sft] task {task.id}: episode failed ({e}); skipped")
            if failed >= DEAD_AFTER and not played:  # nothing ever worked: a dead endpoint
                raise SystemExit(f"sft.py: the teacher's first {failed} episodes all failed; stopping rather than "
                                 f"playing the other {min(len(tasks), cfg.num_tasks) - failed} tasks. The first "
                                 f"failure: {first_error}") from None
            continue
        played += 1
        if reward == 1.0 or (cfg.teacher_skips_confirm and info.get("db_match") and "ended_early" not in info):
            # prompt: the system message + the task's earlier conversation + the user's opening
            n_prompt = 1 + len(message_history(env, task))
            n_prompt += n_prompt < len(messages) and messages[n_prompt]["role"] == "user"  # the user's opening
            kept.append({"messages": messages, "tools": tools, "task_id": task.id, "prompt_messages": n_prompt})
    what = "with the right database (it skipped the confirmation in some)" if cfg.teacher_skips_confirm else "solved"
    played = min(len(tasks), cfg.num_tasks)
    cli.main_print(f"[sft] teacher {cfg.teacher!r}: {len(kept)}/{played} {cfg.env} tasks {what} "
                   f"in {time.time() - t0:.1f}s ({failed} failed episodes); keeping those")
    if not kept and failed:
        raise SystemExit(f"sft.py: the teacher's episodes: {failed} of {played} failed and none was kept, so there is "
                         f"nothing to train on; the first failure: {first_error}")
    return kept


def user_shares(spec: str, option: str = "--teacher-users", users=None) -> list[tuple[str, int]]:
    """--teacher-users as (user, share): "dynamic:3,told:1" gives the dynamic user 3 of every 4 tasks."""
    from envs.shop import USERS

    shares = []
    for part in spec.split(","):
        user, _, n = part.partition(":")
        if user not in (users or USERS) or not (n or "1").isdigit() or int(n or "1") < 1:
            raise SystemExit(f"{option}: {part!r} is not USER[:SHARE] with USER among {', '.join(users or USERS)} "
                             "and SHARE a whole number of at least 1")
        shares.append((user, int(n or "1")))
    return shares


def cold_start_users(env: str) -> tuple[str, str]:
    """The tiny cold start's store and procedure (--env without its user and without ':default': every arm of
    bench/ablation.py starts from one cold start), and its teacher's users: the dynamic user on 3 of every 4 tasks, on
    the fourth the user who says its wish unasked (told; static for a static run), so that the cold start can talk to
    either (bench/README.md, try 11)."""
    from envs.shop import USERS

    parts = env.split(":")
    other = "static" if "static" in parts else "told"
    return ":".join(p for p in parts if p not in USERS and p != "default"), f"dynamic:3,{other}:1"


def teacher_data(cfg) -> list[dict]:
    """The teacher's conversations (make_cold_start), each task played with one of --teacher-users (by its number in
    the split, each user on its share of every sum-of-shares tasks; the same tasks as with one user), then
    --copy-drills x as many copy drills of them (`drills`, the seed's draw), shuffled in among them."""
    if cfg.copy_drills and cfg.env.split(":")[0] != "shop":
        raise SystemExit(f"--copy-drills {cfg.copy_drills}: the drills rename shop's goods; --env is {cfg.env!r}")
    if not cfg.teacher_users:
        convs = make_cold_start(cfg)
    else:
        shares = user_shares(cfg.teacher_users)
        if cfg.env.split(":")[0] != "shop" or any(p in dict(shares) for p in cfg.env.split(":")[1:]):
            raise SystemExit(f"--teacher-users {cfg.teacher_users}: give a shop environment without a user of its own "
                             f"as --env (not {cfg.env!r}): each user is added to it")
        turn = [user for user, k in shares for _ in range(k)]  # task number modulo len(turn) -> its user
        convs = [c for user in dict(shares) for c in make_cold_start(replace(
            cfg, env=cfg.env if user == "dynamic" else f"{cfg.env}:{user}"))
            if turn[int(c["task_id"].rsplit("-", 1)[1]) % len(turn)] == user]
    return with_drills(convs, cfg.seed, cfg.copy_drills)


def with_drills(convs: list[dict], seed: int, share: float) -> list[dict]:
    """The conversations and `share` x as many copy drills of them (`drills`), shuffled together (the seed's order).
    Without them the tiny cold start's copy of the user's answer into the write came out seed by seed: at seed 1 the
    write after "(refund: original) ... Yes." carried the voucher (bench/README.md, try 12)."""
    if not share:
        return convs
    data = convs + drills(convs, int(share * len(convs)), random.Random(seed))
    random.Random(seed).shuffle(data)
    return data


def windows(conversations: list[dict], sizes=(1, 2, 4)) -> list[dict]:
    """The pretraining drills of 'tiny' (`pretrain_tiny`): each agent message that carries arguments (a tool
    call, or text with a digit: "I will cancel order o42") with the last 1, 2 and 4 messages before it, cut to
    begin at a user message, without the system prompt and tools. Only that agent message is trained.

    Why a model trained from scratch needs it: the agent must copy ids, names and items from the dialogue into
    its calls. At initialization attention is spread evenly over the context, so in a ~900-token shop episode
    (two thirds of it the policy and tool schemas) a copy source gets ~1/900 of it, and whole-conversation SFT
    alone did not learn to copy within a CPU budget; in ~60-token windows copying appears after a few hundred
    steps and carries over to whole conversations. LLM pretraining also grows the context length over training;
    a pretrained model (Qwen3) already copies and skips this stage."""
    out = []
    for conv in conversations:
        msgs = conv["messages"]
        for i in range(max(1, conv.get("prompt_messages", 0)), len(msgs)):
            m = msgs[i]
            if m["role"] != "assistant" or not (
                    m.get("tool_calls") or any(c.isdigit() for c in str(m.get("content") or ""))):
                continue
            starts = set()
            for w in sizes:
                start = max(1, i - w)
                while start < i and msgs[start]["role"] != "user":
                    start += 1
                if start < i and start not in starts:
                    starts.add(start)
                    out.append({"messages": msgs[start:i + 1], "tools": [], "prompt_messages": i - start})
    return out

def drills(conversations: list[dict], n: int, rng: random.Random, wishes: float = 0.0) -> list[dict]:
    """`n` drills (`windows`) of the shop family's conversations, each from one drawn at random with its items renamed
    as it is drawn (envs.shop_tasks.relabel_goods): every draw copies other names, as pretraining shows every word.
    A drill that ends in a proposal gets a wish to copy (envs.shop_tasks.with_wish) with probability `wishes`."""
    from envs.shop_tasks import relabel_goods, with_wish

    out = []
    while len(out) < n:
        if options := windows([relabel_goods(rng.choice(conversations), rng)]):
            drill = rng.choice(options)
            out.append((rng.random() < wishes and with_wish(drill, rng)) or drill)
    return out


def repeated(ids: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
    """[b, T] booleans: the token stood earlier in its sequence (a copy, where it is a value the agent writes)."""
    return ((ids[:, :, None] == ids[:, None, :]) & attn.bool()[:, None, :]).tril(-1).any(-1)


def copy_loss(model, tok, data, copy_ids: set[int], micro_batch_size: int = 32) -> tuple[float, float]:
    """(copy loss, other loss) on (ids, loss_mask) pairs: mean NLL of the trained tokens that copy a value from
    earlier in the same sequence (a token of `copy_ids` that already appeared before it), and of the other trained
    tokens. A value that is not in the sequence yet (the next order to look up when the window does not show the
    order list) is not a copy and counts as "other": no model can get it right from the drill alone."""
    device = next(model.parameters()).device
    sums = torch.zeros(4, dtype=torch.float64)
    with torch.no_grad():
        for k in range(0, len(data), micro_batch_size):
            ids, attn, mask = collate(data[k:k + micro_batch_size], tok.pad_token_id, device)
            nll = -token_logprobs(model, ids, attn).double()
            is_copy = torch.isin(ids, torch.tensor(sorted(copy_ids), device=device)) & mask.bool() & repeated(ids, attn)
            other = mask.bool() & ~is_copy
            sums += torch.stack([(nll * is_copy).sum(), is_copy.sum(), (nll * other).sum(), other.sum()]).cpu()
    return (sums[0] / sums[1].clamp(min=1)).item(), (sums[2] / sums[3].clamp(min=1)).item()


class Untokenizable(ValueError):
    """A conversation the chat template cannot render (encode): sft.py stops in one line naming its file and line."""


def encode(tok, conversations: list[dict], max_len: int) -> tuple[list[tuple[list[int], list[int]]], list[int]]:
    """(ids, loss_mask) per conversation no longer than max_len, and the lengths of those skipped (never cut). A
    conversation the chat template cannot render stops with its source (file:line) named."""
    data, skipped = [], []
    for k, conv in enumerate(conversations):
        try:
            ids, mask = encode_conversation(tok, conv["messages"], conv["tools"], conv.get("prompt_messages", 0))
        except Exception as e:
            raise Untokenizable(f"{conv.get('source', f'conversation {k}')}: cannot be tokenized: {e!r}") from e
        if len(ids) > max_len:
            skipped.append(len(ids))
        else:
            data.append((ids, mask))
    return data, skipped


def length_limit(cfg, model) -> int:
    """--max-len, or with 0 the model's context: the longest conversation it can read."""
    return cfg.max_len or getattr(model.config.get_text_config(), "max_position_embeddings", None) or 1 << 31


class NothingFits(ValueError):
    """No conversation is short enough to train on (sft.main says so without a traceback)."""


def nothing_fits(cfg, model, skipped: list[int]) -> str:
    """Why no conversation is left, and which option to change by how much."""
    context, shortest = length_limit(replace(cfg, max_len=0), model), min(skipped, default=0)
    if not skipped:
        return "no conversation to train on"
    if shortest > context:
        return (f"all {len(skipped)} conversations are longer than the model's context ({context} tokens, "
                f"max_position_embeddings; the shortest has {shortest}): use a model with a longer context")
    return (f"no conversation fits --max-len {cfg.max_len}: all {len(skipped)} are longer (the shortest has {shortest} "
            f"tokens, the longest {max(skipped)}); raise --max-len by at least {shortest - cfg.max_len} to {shortest}, "
            f"or give --max-len 0 to keep all that fit the model's context ({context})")
