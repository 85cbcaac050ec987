"""checkpoints.py: a GRPO run's checkpoints, written so that a run can be resumed exactly. grpo.py uses it.

    save   run_dir/checkpoints/step-N (model, tokenizer, run config; optimizer, scheduler and RNG states unless
           --save-weights-only), written atomically, `latest` updated, older ones pruned (--keep-checkpoints)
    find   the checkpoint --resume names (a checkpoint or a run directory)
    load   its optimizer, scheduler and RNG states into the prepared Accelerator; the step to continue from
"""
import json
import os
import shutil
from dataclasses import asdict
from pathlib import Path

import cli


def save(acc, model, tok, cfg, run_dir: Path, step: int) -> Path:
    """run_dir/checkpoints/step-N: Hugging Face model + tokenizer + run config, and accelerate/ (optimizer,
    scheduler, RNG states of every process). Written to a temporary directory and renamed, then `latest`
    is updated: a crash mid-save never corrupts the last good checkpoint."""
    import sft  # here, as grpo.py imports it: importing grpo for the loss math loads no training stack

    final = run_dir / "checkpoints" / f"step-{step:06d}"
    tmp = final.with_name(final.name + ".tmp")
    if acc.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    acc.wait_for_everyone()
    if not cfg.save_weights_only:
        acc.save_state(str(tmp / "accelerate"))
    sft.save_pretrained(acc, model, tok, tmp / "model", {"grpo": asdict(cfg)})
    if acc.is_main_process:
        cli.write_json_atomic(tmp / "trainer_state.json", {"step": step, "data_position": step * cfg.tasks_per_step})
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        cli.write_json_atomic(run_dir / "checkpoints" / "latest.json", {"checkpoint": final.name})
        if cfg.keep_checkpoints:
            older = sorted(p for p in final.parent.glob("step-*") if p.is_dir() and not p.name.endswith(".tmp"))
            for p in older[:-cfg.keep_checkpoints]:
                if p != final:
                    shutil.rmtree(p, ignore_errors=True)
    acc.wait_for_everyone()
    return final


def find(path: str) -> Path:
    """The checkpoint --resume names: a checkpoint directory, or a run directory (its `latest`)."""
    p = Path(path)
    latest = p / "checkpoints" / "latest.json"
    if not (p / "trainer_state.json").exists() and latest.exists():
        p = p / "checkpoints" / json.loads(latest.read_text())["checkpoint"]
    if (p / "trainer_state.json").exists():
        if not (p / "accelerate").is_dir():
            raise SystemExit(f"grpo.py: --resume: {p} was saved with --save-weights-only (no optimizer, scheduler or "
                             f"RNG state), so it cannot continue the run exactly; start a new run with --init-from {p / 'model'}")
        return p
    raise SystemExit(f"grpo.py: --resume: no checkpoint in {path} (expected trainer_state.json or checkpoints/latest.json)")


def load(acc, path: Path, tasks_per_step: int) -> int:
    """Restore the saved states (weights, optimizer, scheduler, RNG of every process); returns the step reached,
    after checking that the data position matches it."""
    acc.load_state(str(path / "accelerate"))
    state = json.loads((path / "trainer_state.json").read_text())
    step = state["step"]
    if state["data_position"] != step * tasks_per_step:
        raise SystemExit(f"grpo.py: --resume: {path} is at data position {state['data_position']}, "
                         f"not {step} x {tasks_per_step} tasks")
    return step
