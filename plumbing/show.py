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
    """Line `index` (0-based) of a JSONL file of episodes, checked to hold its tokens."""
    p = Path(path)
    if not p.is_file():
        raise SystemExit(f"eval.py: --show: {path}: no such file (a run's episodes.jsonl or eval-*.jsonl)")
    lines = [line for line in p.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not 0 <= index < len(lines):
        raise SystemExit(f"eval.py: --show-index {index}: {path} holds {len(lines)} episodes (0 to {len(lines) - 1})")
    try:
        rec = json.loads(lines[index])
    except ValueError as e:
        raise SystemExit(f"eval.py: --show: {path}, episode {index}: not JSON ({e})") from None
    missing = [k for k in ("input_ids", "loss_mask") if not isinstance(rec.get(k), list)]
    if missing:
        raise SystemExit(f"eval.py: --show: {path}, episode {index} has no {' or '.join(missing)}: it was logged "
                         "without its tokens (by an older muarl); the viewer shows recorded tokens only")
    return rec


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
    for start, end, turn in runs(rec):
        text = tokenizer.decode(ids[start:end], skip_special_tokens=False)
        if turn < 0:
            out.append(f"{PROMPT}{text}{RESET}" if color else text)
        else:
            assert all(mask[start:end]), f"agent turn {turn + 1} at {start}-{end} holds untrained tokens"
            out.append(f"\n--- agent turn {turn + 1}: tokens {start}-{end - 1}, {end - start} trained ---\n")
            out.append(f"{TRAINED}{text}{RESET}" if color else f"{OPEN}{text}{CLOSE}")
    return "".join(out) + "\n"


def show(path: str, index: int = 0, agent: str = "", color: bool | None = None) -> str:
    rec = record(path, index)
    if color is None:
        color = sys.stdout.isatty() and not os.environ.get("NO_COLOR")
    return render(tokenizer_for(path, agent), rec, color)
