"""toolcall.py: the agent's tool calls as text, in the Hermes/Qwen format (`<tool_call>\n{"name": ..., "arguments":
{...}}\n</tool_call>`): formatted as the template renders them, parsed from what the agent sampled (never raising on
model output), and the tool-aware ChatML template for models whose own template cannot render tools.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
MAX_JSON_DEPTH = 64
"""The deepest nesting of arrays and objects read from a tool call or a cold-start line (a call's own object is one
level; real calls use a handful). Checked before parsing: Python's JSON parser and the tools that walk arguments
recurse per level (json.loads fails near 1,000 levels, BFCL's call path near 450)."""
MAX_INT_DIGITS = 100
"""The longest integer a tool call may hold, in digits (no tool takes more). Python refuses to read one past 4,300."""


def format_tool_call(name: str, arguments) -> str:
    """One tool call as the tool template renders it (json.dumps spacing, non-ASCII kept)."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return (f'{TOOL_CALL_OPEN}\n{{"name": {json.dumps(name, ensure_ascii=False)}, '
            f'"arguments": {args}}}\n{TOOL_CALL_CLOSE}')


def format_assistant(message: dict) -> str:
    """The text of an assistant message body exactly as TOOL_CHAT_TEMPLATE renders it (without the
    `<|im_start|>assistant\\n` header and the `<|im_end|>`). Used to build cold-start ids and by tests."""
    text = message.get("content") or ""
    for i, call in enumerate(message.get("tool_calls") or []):
        if i > 0 or text:
            text += "\n"
        text += format_tool_call(call["function"]["name"], call["function"]["arguments"])
    return text


@dataclass
class ParsedMessage:
    """What the agent said: text content, tool calls in OpenAI format, and parse errors.

    A malformed call still appears in `tool_calls` (name as best understood, arguments = the raw text) so that
    every tool message in the conversation answers a call; `errors` maps its index in `tool_calls` to the
    error text the agent will see instead of a tool result.
    """

    content: str
    tool_calls: list[dict]
    errors: dict[int, str]


def _calls(text: str):
    """(start, end, inside) of each complete <tool_call>...</tool_call>, left to right, each ending at the first close
    tag after its open tag: what re.finditer of OPEN(.*?)CLOSE finds, in one pass. The regex rescans the rest of the
    text from every open tag when no close tag follows, which took 59 s for 20,000 open tags."""
    pos = 0
    while (start := text.find(TOOL_CALL_OPEN, pos)) >= 0:
        close = text.find(TOOL_CALL_CLOSE, start + len(TOOL_CALL_OPEN))
        if close < 0:
            return
        pos = close + len(TOOL_CALL_CLOSE)
        yield start, pos, text[start + len(TOOL_CALL_OPEN):close]


def parse_assistant(text: str, call_id_prefix: str = "call") -> ParsedMessage:
    """Parse the agent's decoded text into content and tool calls. Never raises on model output."""
    calls, errors, spans = [], {}, []

    def add(name, arguments, error=None):
        idx = len(calls)
        calls.append({"id": f"{call_id_prefix}_{idx}", "type": "function",
                      "function": {"name": name, "arguments": arguments}})
        if error:
            errors[idx] = error

    for start, end, inside in _calls(text):
        spans.append((start, end))
        raw = inside.strip()
        try:
            obj = loads_limited(raw)
        except json.JSONDecodeError as e:
            add(_guess_name(raw), raw, f"Error: tool call is not valid JSON ({e.msg} at char {e.pos}): {raw[:200]}")
            continue
        except ValueError as e:
            add(_guess_name(raw), raw, f"Error: tool call {e}: {raw[:200]}")
            continue
        if not isinstance(obj, dict):
            add("", raw, 'Error: a tool call must be a JSON object {"name": ..., "arguments": {...}}')
            continue
        name, args = obj.get("name"), obj.get("arguments", {})
        if isinstance(args, str):  # some models double-encode the arguments
            try:
                args = loads_limited(args)
            except ValueError:
                pass
        unknown = sorted(set(obj) - {"name", "arguments"})
        canonical = json.dumps(args, ensure_ascii=False)
        if not isinstance(name, str) or not name:
            add("", raw, 'Error: tool call has no "name" string')
        elif not isinstance(args, dict):
            add(name, raw, f'Error: "arguments" of {name} must be a JSON object')
        elif unknown:
            add(name, raw, f"Error: tool call has unknown keys {unknown}; use only name and arguments")
        elif _SURROGATE.search(name + canonical):
            # an escape like "\ud800" read alone: not a character, so no tool, tokenizer or UTF-8 file can take it
            add(_guess_name(raw), raw, "Error: tool call holds an unpaired surrogate escape (\\ud800-\\udfff), "
                                       "which is not a character")
        else:
            add(name, canonical)
    # An opening tag with no closing tag after the last complete call: the agent stopped mid-call.
    tail_start = spans[-1][1] if spans else 0
    tail = text[tail_start:]
    if TOOL_CALL_OPEN in tail:
        cut = tail.index(TOOL_CALL_OPEN)
        raw = tail[cut + len(TOOL_CALL_OPEN):].strip()
        add(_guess_name(raw), raw, f"Error: unclosed {TOOL_CALL_OPEN} (missing {TOOL_CALL_CLOSE})")
        spans.append((tail_start + cut, len(text)))
    content, pos = [], 0
    for a, b in spans:
        content.append(text[pos:a])
        pos = b
    content.append(text[pos:])
    return ParsedMessage("".join(content).strip(), calls, errors)


_SURROGATE = re.compile("[\ud800-\udfff]")
_JSON_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]')


def json_depth(text: str) -> int:
    """How deep arrays and objects nest in JSON text, counted without parsing it (brackets inside strings skipped)."""
    depth = deepest = 0
    for t in _JSON_TOKEN.findall(text):
        if t in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif t in "]}":
            depth -= 1
    return deepest


def _bounded_int(digits: str) -> int:
    if len(digits.lstrip("-")) > MAX_INT_DIGITS:
        raise ValueError(f"holds an integer of {len(digits.lstrip('-'))} digits (at most {MAX_INT_DIGITS})")
    return int(digits)


def loads_limited(text: str):
    """json.loads within MAX_JSON_DEPTH and MAX_INT_DIGITS. Raises ValueError naming the limit (JSONDecodeError, a
    ValueError too, for text that is not JSON), never RecursionError."""
    depth = json_depth(text)
    if depth > MAX_JSON_DEPTH:
        raise ValueError(f"is nested {depth} levels deep (at most {MAX_JSON_DEPTH})")
    return json.loads(text, parse_int=_bounded_int)


def _guess_name(raw: str) -> str:
    m = re.search(r'"name"\s*:\s*"([^"]*)"', raw)
    return m.group(1) if m else ""


# ---------------------------------------------------------------------------------------------------------
# The tool-aware default chat template: ChatML + Hermes tool calls
# ---------------------------------------------------------------------------------------------------------
# For models whose own template cannot render tools (SmolLM2's is plain ChatML). Tools are listed in the system
# turn; tool results come back as a user turn wrapped in <tool_response>, one turn per result, so that the
# rendering of a message never depends on its neighbours (every render is a prefix of the next).
TOOL_CHAT_TEMPLATE = (
    "{%- set sys = messages[0].content if messages and messages[0].role == 'system' else none %}"
    "{%- if sys is not none or tools %}"
    "{{- '<|im_start|>system\\n' }}{%- if sys is not none %}{{- sys }}{%- endif %}"
    "{%- if tools %}"
    "{{- '\\n\\n# Tools\\n\\nYou may call one or more tools. Their signatures are in <tools></tools>:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nTo call a tool, reply with <tool_call>\\n"
    "{\"name\": <tool-name>, \"arguments\": <args-json-object>}\\n</tool_call>' }}"
    "{%- endif %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}{%- set text = message.content or '' %}{{- text }}"
    "{%- for call in message.tool_calls or [] %}"
    "{%- if not loop.first or text %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": ' + (call.function.name | tojson) + ', \"arguments\": ' }}"
    "{%- if call.function.arguments is string %}{{- call.function.arguments }}"
    "{%- else %}{{- call.function.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_PROBE_TOOLS = [{"type": "function", "function": {"name": "probe_tool_xyz", "description": "d",
                                                    "parameters": {"type": "object", "properties": {}}}}]
_PROBE = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
          {"role": "assistant", "content": "", "tool_calls": [
              {"id": "c0", "type": "function", "function": {"name": "probe_call_xyz", "arguments": "{}"}}]},
          {"role": "tool", "tool_call_id": "c0", "name": "probe_call_xyz", "content": "probe_result_xyz"}]


def template_renders_tools(tokenizer) -> bool:
    """Whether the tokenizer's own chat template shows tool schemas, tool calls and tool results."""
    if not tokenizer.chat_template:
        return False
    try:
        text = tokenizer.apply_chat_template(_PROBE, tools=_PROBE_TOOLS, tokenize=False)
    except Exception:
        return False
    return all(s in text for s in ("probe_tool_xyz", "probe_call_xyz", "probe_result_xyz"))


# ---------------------------------------------------------------------------------------------------------
# Rendering a conversation with the chat template, what a message says kept as text (muarl.py's deltas use it)
# ---------------------------------------------------------------------------------------------------------
def template_kwargs(tokenizer) -> dict:
    """Extra template variables: Qwen3 in non-thinking mode (the paper's setting)."""
    return {"enable_thinking": False} if "enable_thinking" in (tokenizer.chat_template or "") else {}


def render(tokenizer, messages, tools=None, add_generation_prompt=False) -> str:
    return tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                         add_generation_prompt=add_generation_prompt, **template_kwargs(tokenizer))


# A user, a tool or a data file may write "<|im_end|>\n<|im_start|>assistant\n" in its text. Tokenized with the rest of
# the rendered conversation, that text would become the control tokens themselves: a turn boundary forged inside an
# episode the agent is trained on. So the strings of the messages and tools are rendered with each control string (a
# special token of the tokenizer) replaced by a marker (`as_text`), and encode_text encodes what a marker stands for as
# ordinary characters; the template's own control strings stay control tokens. The agent's sampled ids never come
# through here (token in, token out).
_MARK, _MARK_END = "\ue000", "\ue001"  # private-use characters; a _MARK in the text itself is marked too
_MARKED = re.compile(f"{_MARK}(\\d+){_MARK_END}")


# Tool-call tags the tokenizer may hold as tokens that are not "special" (Qwen3's): kept as text like the special ones
TOOL_TAGS = (TOOL_CALL_OPEN, TOOL_CALL_CLOSE, "<tool_response>", "</tool_response>")


def _controls(tokenizer) -> tuple[list[str], re.Pattern]:
    """The strings to keep as text (the special tokens, the tool tags, and _MARK) and a pattern finding them;
    cached."""
    cached = getattr(tokenizer, "_muarl_controls", None)
    if cached is None:
        strings = sorted({t.content for t in tokenizer.added_tokens_decoder.values()
                          if t.special or t.content in TOOL_TAGS} | {_MARK}, key=len, reverse=True)
        cached = strings, re.compile("|".join(map(re.escape, strings)))
        tokenizer._muarl_controls = cached
    return cached


def as_text(tokenizer, obj):
    """Messages, tools or a string, with each control string in their strings replaced by a marker that encode_text
    encodes as the string's own characters: what a user, a tool or the data wrote stays text."""
    strings, pattern = _controls(tokenizer)
    if isinstance(obj, str):
        return pattern.sub(lambda m: f"{_MARK}{strings.index(m.group())}{_MARK_END}", obj)
    if isinstance(obj, dict):
        return {as_text(tokenizer, k): as_text(tokenizer, v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [as_text(tokenizer, v) for v in obj]
    return obj


def encode_text(tokenizer, text: str) -> list[int]:
    """Ids of rendered text. Control strings the template wrote become control tokens; a marker (as_text) becomes the
    characters of the string it stands for, never its control token."""
    if _MARK not in text:
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    strings, ids = _controls(tokenizer)[0], []
    for k, piece in enumerate(_MARKED.split(text)):  # text, marker index, text, ...
        if k % 2:
            ids += tokenizer(strings[int(piece)], add_special_tokens=False, split_special_tokens=True)["input_ids"]
        elif piece:
            ids += tokenizer(piece, add_special_tokens=False)["input_ids"]
    return ids
