"""plumbing/show.py: one logged episode as the trainer saw it (`eval.py --show FILE.jsonl`): its token ids decoded run
by run, the tokens it trains on (loss mask 1) marked, each agent turn's span, its reward and why it ended. What it
shows are the ids, loss mask and turn spans the episode recorded (episodes.jsonl and eval-*.jsonl keep them), never
a re-encoding of its messages with a mask inferred from their roles.

    ./run python eval.py --show runs/grpo-shop-.../episodes.jsonl --show-index 3
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

TRAINED, PROMPT, RESET = "\x1b[1;32m", "\x1b[2m", "\x1b[0m"  # bold green; dim
OPEN, CLOSE = "\u27e6", "\u27e7"  # around the trained tokens without colour


def record(path: str, index: int) -> dict:
    """Line `index` (0-based) of a JSONL file of episodes, checked to hold its tokens (check_tokens)."""
    p = Path(path)
    if p.is_dir():
        raise SystemExit(f"eval.py: --show: {path} is a directory: give one of its JSONL files of episodes "
                         "(episodes.jsonl, eval-*.jsonl)")
    if not p.is_file():
        raise SystemExit(f"eval.py: --show: {path}: no such file (a run's episodes.jsonl or eval-*.jsonl)")
    try:
        lines = [line for line in p.read_text(encoding="utf-8").splitlines() if line.strip()]
    except UnicodeDecodeError as e:
        raise SystemExit(f"eval.py: --show: {path} is not text (UTF-8, byte {e.start}): give a JSONL file of "
                         "episodes") from None
    if not lines:
        raise SystemExit(f"eval.py: --show: {path} is empty: no episode to show")
    if not 0 <= index < len(lines):
        raise SystemExit(f"eval.py: --show-index {index}: {path} holds {len(lines)} episodes (0 to {len(lines) - 1})")
    try:
        rec = json.loads(lines[index])
    except ValueError as e:
        whole = ""
        if index == 0 and len(lines) > 1:  # one JSON document over several lines (summary.json), not JSONL
            try:
                json.loads("\n".join(lines))
                whole = ": the file is one JSON document, not JSONL (one episode a line)"
            except ValueError:
                pass
        raise SystemExit(f"eval.py: --show: {path}, episode {index}: not JSON ({e}){whole}") from None
    problem = check_tokens(rec)
    if problem:
        raise SystemExit(f"eval.py: --show: {path}, line {index + 1}: {problem}")
    return rec


def check_tokens(rec) -> str:
    """What keeps a record from being shown ('' when nothing does): it must be an episode with its token ids, a loss
    mask of 0s and 1s as long, and turn spans (if any) in order inside them over trained tokens only."""
    if not isinstance(rec, dict):
        return f"a JSON {type(rec).__name__}, not an episode (an object)"
    if "step" in rec and "task_id" not in rec:
        return "a step's metrics, not an episode: give episodes.jsonl or an eval-*.jsonl"
    missing = [k for k in ("input_ids", "loss_mask") if k not in rec]
    if missing:
        return (f"an episode without its {' or '.join(missing)} (an API agent's, or logged by an older muarl): the "
                "viewer shows recorded tokens only")
    ids, mask, spans = rec["input_ids"], rec["loss_mask"], rec.get("turn_spans")
    if not (isinstance(ids, list) and all(type(t) is int and 0 <= t < 1 << 31 for t in ids)):
        return "input_ids is not a list of token ids (whole numbers, 0 or more): the record is damaged"
    if not (isinstance(mask, list) and len(mask) == len(ids) and all(m in (0, 1) and type(m) is not float
                                                                     for m in mask)):
        return f"loss_mask is not a list of {len(ids)} 0s and 1s, one a token: the record is damaged"
    if spans is None:
        return ""
    if not (isinstance(spans, list) and all(isinstance(s, list) and len(s) == 2 and all(type(x) is int for x in s)
                                            for s in spans)):
        return "turn_spans is not a list of [start, end] pairs: the record is damaged"
    ends = [x for s in spans for x in s]
    if ends != sorted(ends) or any(a >= b for a, b in spans) or (ends and not 0 <= ends[0] <= ends[-1] <= len(ids)):
        return f"turn_spans are not in order inside the episode's {len(ids)} tokens: the record is damaged"
    untrained = [k + 1 for k, (a, b) in enumerate(spans) if not all(mask[a:b])]
    return f"agent turn {untrained[0]}'s span holds untrained tokens: the record is damaged" if untrained else ""


def tokenizer_for(path: str, agent: str = ""):
    """The tokenizer that wrote the file's ids: --agent's, or the one of the run whose directory holds the file (its
    newest checkpoint's model, else the start its config.json names)."""
    from plumbing import checkpoints, models

    run = Path(path).resolve().parent
    names = [agent] if agent else []
    if not names and (run / "checkpoints").is_dir():
        try:
            names.append(str(checkpoints.newest(run / "checkpoints") / "model"))
        except SystemExit:  # no complete checkpoint: the start its config.json names
            pass
    if not names and (run / "config.json").is_file():
        cfg = json.loads((run / "config.json").read_text())
        names.append(cfg.get("init_from") or cfg.get("agent") or cfg.get("model") or "")
    if not names or not names[0] or names[0] == "tiny":
        raise SystemExit(f"eval.py: --show: no tokenizer named beside {path}: give the model that wrote it, --agent")
    return models.load_tokenizer(names[0])


def runs(rec: dict) -> list[tuple[int, int, int]]:
    """(start, end, agent turn or -1) of the stretches of the episode: each agent turn (its recorded span, or the
    mask's runs for a record without spans), and what lies between them (prompt, user, tool results, scaffolding)."""
    n, spans = len(rec["input_ids"]), rec.get("turn_spans")
    if spans is None:  # the mask's runs of 1s
        mask, spans, i = rec["loss_mask"], [], 0
        while i < n:
            j = i
            while j < n and mask[j] == mask[i]:
                j += 1
            if mask[i]:
                spans.append((i, j))
            i = j
    out, at = [], 0
    for k, (start, end) in enumerate(spans):
        if start > at:
            out.append((at, start, -1))
        out.append((start, end, k))
        at = end
    return out + ([(at, n, -1)] if at < n else [])


PAST = "\u27e8id {id}\u27e9"  # a token id the tokenizer has no entry for, which decode() would drop without a word


def decode(tokenizer, ids: list[int]) -> str:
    """The ids as text, an id past the tokenizer shown as PAST rather than dropped."""
    out, run = [], []
    for t in ids + [None]:
        if t is not None and t < len(tokenizer):
            run.append(t)
            continue
        if run:
            out.append(tokenizer.decode(run, skip_special_tokens=False))
        run = []
        if t is not None:
            out.append(PAST.format(id=t))
    return "".join(out)


def render(tokenizer, rec: dict, color: bool) -> str:
    """The episode as text: a header, then each stretch decoded whole, each agent turn under a line that names its
    token span and marked (bold green, or between the brackets OPEN and CLOSE without colour)."""
    ids, mask = rec["input_ids"], rec["loss_mask"]
    trained = sum(mask)
    head = (f"task {rec.get('task_id')} · sample {rec.get('sample', 0)}"
            + (f" · step {rec['step']}" if "step" in rec else "")
            + f" · reward {rec.get('reward')} · {rec.get('termination')} · {rec.get('turns')} agent turns · "
            f"{len(ids)} tokens, {trained} trained (loss mask 1)")
    out = [f"{head}\n{'=' * min(len(head), 100)}\n"]
    past = sum(t >= len(tokenizer) for t in ids)
    if past:  # the model's output rows past the tokenizer (Qwen3: 151,936 rows, 151,669 tokens) can be sampled
        out.append(f"{past} token id(s) past the tokenizer's {len(tokenizer)}, shown as {PAST.format(id='N')}\n")
    for start, end, turn in runs(rec):
        text = decode(tokenizer, ids[start:end])
        if turn < 0:
            out.append(f"{PROMPT}{text}{RESET}" if color else text)
        else:
            out.append(f"\n--- agent turn {turn + 1}: tokens {start}-{end - 1}, {end - start} trained ---\n")
            out.append(f"{TRAINED}{text}{RESET}" if color else f"{OPEN}{text}{CLOSE}")
    return "".join(out) + "\n"


def show(path: str, index: int = 0, agent: str = "", color: bool | None = None) -> str:
    rec = record(path, index)
    if color is None:
        color = sys.stdout.isatty() and not os.environ.get("NO_COLOR")
    return render(tokenizer_for(path, agent), rec, color)
