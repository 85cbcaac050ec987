"""plumbing/conversations.py: cold-start conversations read from a JSONL file (sft.py --data), each line checked and
normalized (`check_conversation`): a bad line is reported with its file and line and skipped, or with --strict-data
stops the run; the file --data-out writes checked before anything is made (`check_data_out`)."""
from __future__ import annotations

import json
import os
import re

from plumbing import cli, disk
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
    disk.check_writable(Path(data_out).parent, "sft.py", "--data-out")
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
        data = f.read()
    if data.startswith(b"\x1f\x8b"):
        raise ValueError(f"{path} is gzip-compressed: decompress it first (zcat {path} > conversations.jsonl)")
    raw_lines = data.removeprefix(b"\xef\xbb\xbf").split(b"\n")  # a UTF-8 byte-order mark is not line 1's text
    for lineno, raw in enumerate(raw_lines, 1):
        if not raw.strip():
            continue
        try:
            if len(raw) > MAX_LINE_BYTES:
                raise ValueError(f"{len(raw):,} bytes long, more than a conversation (at most {MAX_LINE_BYTES:,}: "
                                 "conversations.MAX_LINE_BYTES)")
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
    if not out and len(raw_lines) > 2:  # one JSON document over several lines (pretty-printed), not JSONL
        try:
            doc = loads_limited(data.removeprefix(b"\xef\xbb\xbf").decode("utf-8"))
        except ValueError:  # (JSONDecodeError and UnicodeDecodeError are ValueErrors)
            doc = None
        if isinstance(doc, (list, dict)):
            raise ValueError(f"{path}: one JSON {'array' if isinstance(doc, list) else 'object'} over "
                             f"{len(raw_lines)} lines, not JSONL: give each conversation a line of its own (one JSON "
                             "object a line)")
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


# What makes the teacher's conversations (sft.py without --data): none of it is read when --data names a file
SYNTHESIS = ("teacher", "teacher_skips_confirm", "teacher_skips_ask", "teacher_skips_status", "teacher_users",
             "copy_drills", "teacher_base_url", "teacher_timeout", "env", "split", "num_tasks", "user_sim",
             "user_base_url", "user_model")


def check_data_options(cfg) -> None:
    """With --data, an option of the teacher's synthesis set away from its default is refused (it was ignored, and
    recorded in the checkpoint's muarl_config.json as if the data had been made so)."""
    import dataclasses

    if not cfg.data:
        return
    default = {f.name: f.default for f in dataclasses.fields(cfg)}
    given = [n for n in SYNTHESIS if getattr(cfg, n) != default[n]]
    if given:
        raise SystemExit(f"sft.py: {', '.join('--' + n.replace('_', '-') for n in given)}: the teacher's options have "
                         f"no effect with --data {cfg.data}, whose conversations are made already")
