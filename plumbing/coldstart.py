"""plumbing/coldstart.py: the cold start's conversations: read from a JSONL file and checked conversation by
conversation, or synthesized by a teacher (the small domain's scripted expert, or an OpenAI-compatible model) playing
tasks against the environment and a user simulator; the drills the `tiny` base is pretrained on (`windows`,
`copy_loss`); and the conversations as token ids and loss masks (`encode`, the same layout as the rollout's). sft.py
trains on them."""
from __future__ import annotations

import json
import os
import random
import re
import time
from dataclasses import replace

import torch

from plumbing import cli
from plumbing.users import make_user_sim, user_sim_options
from envs import OpenAIAgent
from fast.logprobs import token_logprobs
from muarl import collate, encode_conversation
from toolcall import loads_limited

ROLES = ("system", "user", "assistant", "tool")
MAX_LINE_BYTES = 2 << 20
"""The longest cold-start line read, in bytes: about 15 times the text of a conversation that fills the paper's context
(32k tokens). A longer line is refused before it is decoded (a 50 MB line took 9.6 GB and 78 s to tokenize, only to be
skipped as too long)."""
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


SCHEMA = '{"type": "function", "function": {"name": ..., "parameters": ...}}'  # a tool, as OpenAI's API takes it


def check_conversation(rec) -> dict:
    """One cold-start record, checked and normalized: {"messages", "tools", "prompt_messages"}. Raises ValueError
    naming the first problem. Content may be a string or OpenAI content parts (their texts are joined); every tool
    message must answer a call of the assistant message before it; tool-call arguments must be JSON objects; a call
    names one of the conversation's tools (when it lists any); a system message opens the conversation or is not
    there. A conversation that breaks these would put an invalid call, or a result of nothing, under the loss
    mask."""
    if not isinstance(rec, dict):
        raise ValueError(f"a record must be a JSON object, not {type(rec).__name__}")
    msgs = rec.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise ValueError("'messages' must be a non-empty list")
    out, calls = [], None  # calls: the ids the last assistant message's tool calls left to answer
    for i, m in enumerate(msgs):
        where = f"message {i}"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise ValueError(f"{where}: role must be one of {', '.join(ROLES)} (got {str(m)[:80]})")
        m = dict(m)
        content = m.get("content")
        if isinstance(content, list):  # OpenAI content parts
            if not all(isinstance(c, dict) and c.get("type") == "text" and isinstance(c.get("text"), str)
                       for c in content):
                raise ValueError(f"{where}: content parts other than text ({str(content)[:80]})")
            content = "".join(c["text"] for c in content)
        if content is None and m["role"] == "assistant" and m.get("tool_calls"):
            content = ""
        if not isinstance(content, str):
            raise ValueError(f"{where} ({m['role']}): content must be a string or text parts, not {content!r:.60}")
        m["content"] = content
        if m["role"] == "system" and i > 0:
            raise ValueError(f"{where}: a system message after the conversation began (only the first may be one)")
        if m["role"] == "assistant":
            tool_calls = m.get("tool_calls") or []
            if not isinstance(tool_calls, list):
                raise ValueError(f"{where}: 'tool_calls' must be a list")
            calls = []
            for j, c in enumerate(tool_calls):
                fn = c.get("function") if isinstance(c, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
                    raise ValueError(f"{where}, tool call {j}: needs a 'function' with a 'name'")
                args = fn.get("arguments", "{}")
                try:
                    parsed = json.loads(args) if isinstance(args, str) else args
                except json.JSONDecodeError as e:
                    raise ValueError(f"{where}, tool call {j} ({fn['name']}): arguments are not JSON ({e})") from None
                if not isinstance(parsed, dict):
                    raise ValueError(f"{where}, tool call {j} ({fn['name']}): arguments must be a JSON object")
                calls.append(c.get("id"))
            if tool_calls:
                m["tool_calls"] = tool_calls
            else:
                m.pop("tool_calls", None)
        elif m["role"] == "tool":
            if not calls:
                raise ValueError(f"{where}: a tool message that answers no call of the assistant message before it")
            call_id = m.get("tool_call_id")
            if call_id is not None and any(c is not None for c in calls) and call_id not in calls:
                raise ValueError(f"{where}: tool_call_id {call_id!r} is not a call of the assistant message before it")
            calls.remove(call_id if call_id in calls else calls[0])
        else:
            calls = None
        out.append(m)
    tools = rec.get("tools") or []
    if not isinstance(tools, list):
        raise ValueError("'tools' must be a list")
    tools = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}}
             if isinstance(t, dict) and "function" not in t and "name" in t else t
             for t in tools]  # a flat schema ({"name", "parameters"}, as some exports and the Responses API): wrapped
    for k, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(f"tool {k}: not a function schema ({SCHEMA}): {json.dumps(t)[:80]}")
    named = {t["function"]["name"] for t in tools}
    for i, m in enumerate(out):  # a call of a tool the conversation does not offer would be taught as a call to make
        for c in m.get("tool_calls") or [] if tools else []:
            if c["function"]["name"] not in named:
                raise ValueError(f"message {i}: calls {c['function']['name']!r}, which is not among the conversation's "
                                 f"tools ({', '.join(sorted(str(n) for n in named))})")
    n_prompt = rec.get("prompt_messages") or 0
    if type(n_prompt) is not int or not 0 <= n_prompt < len(out):
        raise ValueError("'prompt_messages' must be an int smaller than the number of messages")
    if not any(m["role"] == "assistant" for m in out[n_prompt:]):
        raise ValueError("no assistant message to train on"
                         + (" after the prompt ('prompt_messages')" if n_prompt else ""))
    return {"messages": out, "tools": tools, "prompt_messages": n_prompt}


def check_data_out(data_out: str, data: str, overwrite: bool) -> None:
    """sft.py --data-out, at start: a file it may write (not a directory, not the --data file it reads, replaced only
    with --overwrite), in a directory it can write to."""
    from pathlib import Path

    if Path(data_out).is_dir():
        raise SystemExit(f"sft.py: --data-out: {data_out} is a directory; give the JSONL file to write")
    cli.check_writable(Path(data_out).parent, "sft.py", "--data-out")
    if Path(data_out).exists() and not overwrite:
        raise SystemExit(f"sft.py: --data-out: {data_out} exists; replace it with --overwrite, or choose another")
    if data and Path(data_out).resolve() == Path(data).resolve():
        raise SystemExit(f"sft.py: --data-out {data_out} is the --data file it reads")


def load_conversations(path: str, strict: bool = False) -> list[dict]:
    """Read JSONL conversations, each checked (`check_conversation`). A bad line (longer than MAX_LINE_BYTES, not UTF-8,
    not JSON, nested deeper than toolcall.MAX_JSON_DEPTH, not text, a broken conversation) is reported with its file
    and line and skipped, and the skipped are counted; with `strict`
    (--strict-data) the first one stops the run. Each conversation keeps its "source" (file:line) for later errors."""
    out, bad = [], []
    if os.path.isdir(path):
        raise ValueError(f"{path} is a directory: give a JSONL file")
    if os.path.exists(path) and not os.path.isfile(path):  # a pipe (`<(zcat data.gz)`) is read; say why it may wait
        print(f"[sft] {path} is not a regular file (a pipe or a device): reading it waits until its writer writes and "
              "closes it", flush=True)
    with open(path, "rb") as f:
        raw_lines = f.read().split(b"\n")
    for lineno, raw in enumerate(raw_lines, 1):
        if not raw.strip():
            continue
        try:
            if len(raw) > MAX_LINE_BYTES:
                raise ValueError(f"{len(raw):,} bytes long, more than a conversation (at most {MAX_LINE_BYTES:,}: "
                                 "coldstart.MAX_LINE_BYTES)")
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"not UTF-8: byte {raw[e.start]:#04x} at column {e.start + 1}") from None
            try:
                rec = loads_limited(line)  # nested deeper than MAX_JSON_DEPTH: refused before parsing
            except json.JSONDecodeError as e:
                raise ValueError(f"not JSON: {e}") from None
            except ValueError as e:
                raise ValueError(f"a record that {e}") from None
            if _SURROGATE_ESCAPE.search(line) and not _is_text(rec):
                raise ValueError("not text: an escape of an unpaired surrogate (\\ud800-\\udfff), which no tokenizer "
                                 "takes")
            conv = check_conversation(rec)
        except ValueError as e:
            if strict:
                raise ValueError(f"{path}:{lineno}: malformed conversation: {e} (--strict-data)") from None
            bad.append(f"{path}:{lineno}: {e}")
            continue
        out.append({**conv, "source": f"{path}:{lineno}"})
    if not out and not bad:
        raise ValueError(f"{path}: the file is empty: no conversation to train on")
    for b in bad[:20]:
        cli.main_print(f"[sft] skipped {b}")
    if bad:
        cli.main_print(f"[sft] {path}: {len(bad)} malformed conversation(s) skipped"
                       f"{' (first 20 shown)' if len(bad) > 20 else ''}, {len(out)} kept (--strict-data refuses the "
                       "file instead)")
    if not out:
        raise ValueError(f"{path}: none of its {len(bad)} conversations is usable (the first: {bad[0]})")
    return out


def _is_text(rec) -> bool:
    try:
        json.dumps(rec, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


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
    failed, first_error = 0, None
    for task in tasks[:cfg.num_tasks]:
        tools = env.tools(task)
        if cfg.teacher != "expert":
            agent = OpenAIAgent(cfg.teacher, tools, cfg.teacher_base_url)
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
            first_error = first_error or f"task {task.id}: {e!r}"
            cli.main_print(f"[sft] task {task.id}: episode failed ({e!r}); skipped")
            continue
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
