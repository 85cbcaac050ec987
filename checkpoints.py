"""checkpoints.py: checkpoints and run directories, written so that a run can be resumed exactly and nothing a user
had is lost. sft.py and grpo.py use it.

    save_pretrained  a Hugging Face model directory (weights, tokenizer, the run's config; LoRA adapters in PEFT's
           format), written beside its target and renamed; never over files that are not a checkpoint's (check_out
           refuses them at start)
    claim  the run directory, checked at start: a new one, or an existing run only with --resume or --overwrite
    open_run  once the run has loaded: --overwrite removes only the files a run writes; --resume cuts the logs back
           to the resumed step and records what it changed; config.json
    save   run_dir/checkpoints/step-N (model, tokenizer, run config; optimizer, scheduler and RNG states unless
           --save-weights-only), written atomically, `latest` updated, older ones pruned (--keep-checkpoints)
    find   the checkpoint --resume names (a checkpoint or a run directory; the newest complete step when `latest`
           is unreadable); resume_settings: its saved settings and the few a resume may change
    load   its optimizer, scheduler and RNG states into the prepared Accelerator; the step to continue from
"""
import errno
import json
import os
import shutil
import time
from dataclasses import asdict
from pathlib import Path

import torch

import cli
import lora
import shard


# The files a checkpoint directory holds (save_pretrained: the model's, the tokenizer's, muarl's): the only ones ever
# deleted when a checkpoint is replaced.
CHECKPOINT_FILES = ("*.safetensors", "*.safetensors.index.json", "*.bin", "*.bin.index.json", "config.json",
                    "generation_config.json", "tokenizer*", "special_tokens_map.json", "added_tokens.json",
                    "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt", "muarl_config.json",
                    "adapter_config.json")


def not_checkpoint_files(out: Path) -> list[str]:
    """What in directory `out` is not a checkpoint's file (and would be lost if the directory were replaced)."""
    import fnmatch

    return sorted(p.name for p in Path(out).iterdir()
                  if p.is_dir() or not any(fnmatch.fnmatch(p.name, pat) for pat in CHECKPOINT_FILES))


def check_out(out: str, overwrite: bool | None, program: str = "sft.py", option: str = "--out") -> None:
    """Refuse, at start, an output directory whose contents the run would destroy: anything that is there unless
    --overwrite (None: the program has no such option), and even with it anything that is not a checkpoint's file."""
    p = Path(out)
    if p.exists() and not p.is_dir():
        raise SystemExit(f"{program}: {option}: {p} is a file, not a directory")
    if not p.exists() or not any(p.iterdir()):
        return
    other = not_checkpoint_files(p)
    if other:
        raise SystemExit(f"{program}: {option}: {p} holds files that are not a checkpoint's ({', '.join(other[:8])}"
                         f"{', ...' if len(other) > 8 else ''}); writing the checkpoint there would delete them: "
                         f"choose another {option}")
    if not overwrite:
        raise SystemExit(f"{program}: {option}: {p} already holds a checkpoint; "
                         + ("replace it with --overwrite, or choose " if overwrite is not None else "choose ")
                         + f"another {option}")


def save_pretrained(acc, model, tok, out: Path, run_config: dict) -> None:
    """A Hugging Face checkpoint (safetensors + tokenizer + the run config), written beside `out` and renamed into
    place: a crash never leaves half a checkpoint. An existing `out` is replaced only when it holds nothing but a
    checkpoint's files; otherwise the new checkpoint is left beside it, and the error says where."""
    import shutil

    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    from accelerate.utils import broadcast_object_list

    state = shard.full_state_dict(acc, model)  # fp32 master weights under DeepSpeed too
    error = [None]
    if acc.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        unwrapped = acc.unwrap_model(model)
        if lora.is_adapted(unwrapped):  # the adapters only, in PEFT's format (PeftModel.from_pretrained loads them)
            unwrapped.save_pretrained(tmp, state_dict=state, safe_serialization=True, save_embedding_layers=False)
            (tmp / "README.md").unlink(missing_ok=True)  # peft's generated model card: not a file a checkpoint keeps
        else:
            unwrapped.save_pretrained(tmp, state_dict=state, safe_serialization=True)
        tok.save_pretrained(tmp)
        cli.write_json_atomic(tmp / "muarl_config.json", run_config)
        other = not_checkpoint_files(out) if out.is_dir() else []
        if other:
            error[0] = (f"{out} holds files that are not a checkpoint's ({', '.join(other[:8])}); it was not "
                        f"replaced. The new checkpoint is in {tmp}")
        else:
            shutil.rmtree(out, ignore_errors=True)
            os.replace(tmp, out)
    if acc.num_processes > 1:
        broadcast_object_list(error)  # every process stops with the main one
    if error[0]:
        raise SystemExit(error[0])


# What a run writes into its directory (grpo.main); --overwrite removes these and nothing else.
RUN_FILES = ("config.json", "metrics.jsonl", "episodes.jsonl", "eval-before.jsonl", "eval-before.json",
             "eval-after.jsonl", "summary.json", "curves.png", "checkpoints", "resumes.jsonl", "metrics.jsonl.cut",
             "episodes.jsonl.cut")
_held: list = []  # the open lock files of the run directories this process writes (kept for its lifetime)


def lock(run_dir: Path, program: str = "grpo.py") -> str | None:
    """Take run_dir/run.lock for this process's lifetime (a POSIX lock: the kernel drops it when the process ends,
    however it ends, and a forked child does not inherit it). Returns why not when another run holds it."""
    import fcntl

    run_dir.mkdir(parents=True, exist_ok=True)
    f = open(run_dir / "run.lock", "a+")
    try:
        fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno not in (errno.EAGAIN, errno.EACCES):  # a file system without locks (some NFS, Lustre mounts)
            cli.main_print(f"[{program.removesuffix('.py')}] {run_dir} cannot be locked ({e}): nothing stops another "
                           "run from writing into it")
            f.close()
            return None
        f.seek(0)
        holder = f.read().strip() or "unknown"
        f.close()
        return (f"{program}: {run_dir} is in use by a run that is still going ({holder}); wait for it to end or stop "
                f"it (Ctrl-C, SIGTERM) first: two runs in one directory would mix their steps and checkpoints")
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()} on {os.uname().nodename}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    f.flush()
    _held.append(f)
    return None


def unlock() -> None:
    """Release the run directories this process locked (the run ended; a crash releases them anyway)."""
    while _held:
        _held.pop().close()
LOGS = ("metrics.jsonl", "episodes.jsonl")  # one JSON object a line, each with its "step"


def claim(acc, run_dir: Path, resuming: bool, overwrite: bool) -> Path:
    """Check, at start, that this run may write into `run_dir`; returns it as the main process named it (a default
    name holds the time, which could tick between processes). A directory that already holds a run is refused
    unless the run is resumed or --overwrite is given. Nothing is removed here: that waits until the run has
    loaded (`open_run`), so a run that fails to start loses nothing. The main process decides; every process
    stops with it."""
    from accelerate.utils import broadcast_object_list

    decision = [None, str(run_dir)]
    if acc.is_main_process:
        present = [n for n in RUN_FILES if (run_dir / n).exists()]
        if run_dir.exists() and not run_dir.is_dir():
            decision[0] = f"grpo.py: --out-dir: {run_dir} is a file"
        elif present and not resuming and not overwrite:
            decision[0] = (f"grpo.py: --out-dir: {run_dir} already holds a run ({', '.join(present)}); continue it "
                           f"with --resume {run_dir}, replace it with --overwrite, or choose another --out-dir")
        elif present and overwrite and "config.json" not in present:
            decision[0] = (f"grpo.py: --overwrite: {run_dir} holds {', '.join(present)} but no config.json, so no "
                           "run of grpo.py wrote them; nothing was deleted. Move them away or choose another --out-dir")
        else:
            decision[0] = lock(run_dir)
    if acc.num_processes > 1:
        broadcast_object_list(decision)
    if decision[0]:
        raise SystemExit(decision[0])
    return Path(decision[1])


def open_run(acc, run_dir: Path, config: dict, resume_step: int | None, changes: dict, overwrite: bool) -> None:
    """Once everything has loaded (main process): --overwrite removes the earlier run's own files; --resume moves the
    log lines of steps after the checkpoint to `<log>.cut` (so every step appears once in the logs) and records
    what it changed in resumes.jsonl; then config.json is written."""
    if not acc.is_main_process:
        return
    present = [n for n in RUN_FILES if (run_dir / n).exists()]
    if resume_step is not None:
        for name in LOGS:
            dropped = cut_log(run_dir / name, resume_step)
            if dropped:
                print(f"[grpo] --resume at step {resume_step}: {dropped} line(s) of {name} after it moved to "
                      f"{name}.cut", flush=True)
        with open(run_dir / "resumes.jsonl", "a") as f:
            f.write(json.dumps({"step": resume_step, "time": time.strftime("%Y-%m-%d %H:%M:%S"),
                                "changed": changes}) + "\n")
    elif present and overwrite:
        print(f"[grpo] --overwrite: removing the earlier run's {', '.join(present)} from {run_dir}", flush=True)
        for name in sorted(present, key=lambda n: n == "config.json"):  # config.json last: cut short, it is still ours
            p = run_dir / name
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    run_dir.mkdir(parents=True, exist_ok=True)
    cli.write_json_atomic(run_dir / "config.json", config)


def cut_log(path: Path, last_step: int) -> int:
    """Keep the lines of a JSONL log up to `last_step`; move later steps, and a line cut short by a crash, to
    `<path>.cut`. Returns how many lines moved. Streams: episodes.jsonl can be large."""
    if not path.exists():
        return 0
    tmp, dropped = path.with_name(path.name + ".tmp"), 0
    with open(path, encoding="utf-8", errors="replace") as src, open(tmp, "w", encoding="utf-8") as keep, \
            open(path.with_name(path.name + ".cut"), "a", encoding="utf-8") as cut:
        for line in src:
            try:
                ok = json.loads(line)["step"] <= last_step
            except (ValueError, KeyError, TypeError):
                ok = False
            if ok:
                keep.write(line)
            elif line.strip():
                cut.write(line if line.endswith("\n") else line + "\n")
                dropped += 1
    os.replace(tmp, path)
    return dropped


def save(acc, run, step: int) -> Path:
    """run_dir/checkpoints/step-N: Hugging Face model + tokenizer + run config, and accelerate/ (optimizer and RNG
    states of every process; the scheduler's as JSON). Written to a temporary directory and renamed, then `latest`
    is updated: a crash mid-save never corrupts the last good checkpoint. A full or read-only disk removes the
    partial copy (so that a --resume has room) and stops the run in one line."""
    final = run.dir / "checkpoints" / f"step-{step:06d}"
    tmp = final.with_name(final.name + ".tmp")
    try:
        return _save(acc, run, step, final, tmp)
    except (OSError, RuntimeError) as e:
        full = isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EROFS, errno.EDQUOT, errno.EIO)
        if not (full or "write failed" in str(e) or "No space left" in str(e)):
            raise
        if acc.is_main_process:  # the partial copy is the main process's to remove (the others stop at a collective)
            shutil.rmtree(tmp, ignore_errors=True)
        newest = sorted(p.name for p in final.parent.glob("step-*") if not p.name.endswith(".tmp"))
        kept = f"the newest checkpoint, {newest[-1]}, is untouched" if newest else "no checkpoint was saved before it"
        raise SystemExit(f"grpo.py: writing the checkpoint of step {step} into {final.parent} failed: "
                         f"{str(e).splitlines()[0][:200]} (is the disk full or read-only?). The partial copy was "
                         f"removed; {kept}. Make room, then: accelerate launch grpo.py --resume {run.dir}") from None


def _save(acc, run, step: int, final: Path, tmp: Path) -> Path:
    model, tok, cfg, run_dir = run.model, run.tok, run.cfg, run.dir
    if acc.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    acc.wait_for_everyone()
    if not cfg.save_weights_only:
        acc.save_state(str(tmp / "accelerate"))
        if acc.is_main_process:
            cli.write_json_atomic(tmp / "accelerate" / "scheduler.json", run.sched.state_dict())
    save_pretrained(acc, model, tok, tmp / "model", {"grpo": asdict(cfg)})
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
    if not p.exists():
        raise SystemExit(f"grpo.py: --resume: {path} does not exist")
    if not (p / "trainer_state.json").exists() and (p / "checkpoints").is_dir():
        p = newest(p / "checkpoints")
    if (p / "trainer_state.json").exists():
        if not (p / "accelerate").is_dir():
            raise SystemExit(f"grpo.py: --resume: {p} was saved with --save-weights-only (no optimizer, scheduler or "
                             "RNG state), so it cannot continue the run exactly; start a new run with "
                             f"--init-from {p / 'model'}")
        return p
    raise SystemExit(f"grpo.py: --resume: no checkpoint in {path} "
                     "(expected trainer_state.json or checkpoints/latest.json)")


def unsaved_run(path: str) -> Path | None:
    """The run directory --resume names when it holds a run that stopped before its first checkpoint (config.json,
    no complete step): such a run starts again from step 0 with its own settings."""
    p = Path(path)
    if not (p / "config.json").is_file() or (p / "trainer_state.json").exists():
        return None
    ckpts = p / "checkpoints"
    if ckpts.is_dir() and any((s / "trainer_state.json").exists() for s in ckpts.glob("step-*")
                              if not s.name.endswith(".tmp")):
        return None
    return p


def saved_settings(path: Path) -> dict:
    """The settings a run was started with: a checkpoint's (model/muarl_config.json) or a run directory's
    (config.json, for a run that saved no checkpoint)."""
    if (path / "config.json").is_file() and not (path / "trainer_state.json").exists():
        return json.loads((path / "config.json").read_text())
    return json.loads((path / "model" / "muarl_config.json").read_text())["grpo"]


def newest(ckpt_dir: Path) -> Path:
    """The checkpoint `latest.json` names; when it is missing, unreadable (cut short) or names a step that is gone,
    the newest complete step (a step directory exists only once it was fully written: save renames it into place)."""
    latest = ckpt_dir / "latest.json"
    try:
        p = ckpt_dir / json.loads(latest.read_text())["checkpoint"]
        if (p / "trainer_state.json").exists():
            return p
        why = f"names {p.name}, which is not a complete checkpoint"
    except (OSError, ValueError, KeyError, TypeError) as e:
        why = "is missing" if not latest.exists() else f"is unreadable ({e.__class__.__name__}: {e})"
    steps = sorted(p for p in ckpt_dir.glob("step-*") if not p.name.endswith(".tmp")
                   and (p / "trainer_state.json").exists())
    if not steps:
        raise SystemExit(f"grpo.py: --resume: {latest} {why}, and {ckpt_dir} holds no complete checkpoint")
    cli.main_print(f"[grpo] --resume: {latest} {why}; using the newest complete checkpoint, {steps[-1].name}")
    return steps[-1]


def resume_settings(path: Path, cfg, given: set, resumable: tuple) -> tuple[dict, dict]:
    """The settings a resumed run continues with: the checkpoint's (or the unsaved run's, `path` its directory),
    with the options given on the command line that may change (`resumable`; an option equal to the saved value is
    no change). Returns (settings, changes: name -> [saved, new]); any other change is refused, naming it."""
    saved = saved_settings(path)
    changes = {k: [saved.get(k), getattr(cfg, k)] for k in sorted(given - {"resume"})
               if k == "recipe" or saved.get(k) != getattr(cfg, k)}
    fixed = [k for k in changes if k not in resumable]
    if fixed:
        raise SystemExit(f"grpo.py: --resume continues the run with its saved settings; "
                         f"{', '.join('--' + k.replace('_', '-') for k in fixed)} cannot change in it (only "
                         f"{', '.join('--' + k.replace('_', '-') for k in resumable)} can); start a new run with "
                         f"--init-from {path / 'model'} to change them")
    return {**saved, **{k: new for k, (_, new) in changes.items()}}, changes


def step_of(path: Path) -> int:
    """The step a checkpoint was saved at."""
    return json.loads((path / "trainer_state.json").read_text())["step"]


def load(acc, path: Path, tasks_per_step: int, sched) -> int:
    """Restore the saved states (weights, optimizer, scheduler, RNG of every process); returns the step reached,
    after checking that the data position matches it. Nothing is unpickled that could run code: Accelerate loads
    with weights_only=True, the scheduler is JSON (an older checkpoint's custom_checkpoint_0.pkl is read with
    weights_only=True too)."""
    import pickle
    import tempfile

    from accelerate.utils import load as accelerate_load

    state_dir = path / "accelerate"
    try:
        rng = state_dir / f"random_states_{acc.process_index}.pkl"
        if not rng.exists():  # Accelerate would go on without it: the resume would not be exact
            raise SystemExit(f"grpo.py: --resume: {rng} is missing: the checkpoint is incomplete")
        accelerate_load(rng)  # an unreadable one Accelerate would skip without a word
        with tempfile.TemporaryDirectory() as view:
            if any(state_dir.glob("custom_checkpoint_*.pkl")):  # not for Accelerate to unpickle: a view without them
                for p in state_dir.iterdir():
                    if not p.name.startswith("custom_checkpoint_"):
                        os.symlink(p.resolve(), Path(view) / p.name)
            acc.load_state(view if any(Path(view).iterdir()) else str(state_dir))
    except pickle.UnpicklingError as e:  # a payload planted in the run directory: refused, never run
        raise SystemExit(f"grpo.py: --resume: {state_dir} holds a file that is not plain saved state, so it was not "
                         f"loaded (it could run code): {str(e).splitlines()[0][:200]}") from None
    state_file, old = state_dir / "scheduler.json", state_dir / "custom_checkpoint_0.pkl"
    if state_file.exists():
        sched.load_state_dict(json.loads(state_file.read_text()))
    elif old.exists():
        try:
            sched.load_state_dict(torch.load(old, map_location="cpu", weights_only=True))
        except Exception as e:  # a planted payload is refused here, never run
            raise SystemExit(f"grpo.py: --resume: {old} is not a plain scheduler state, so it was not loaded (it "
                             f"could run code): {str(e).splitlines()[0][:200]}") from None
    state = json.loads((path / "trainer_state.json").read_text())
    step = state["step"]
    if state["data_position"] != step * tasks_per_step:
        raise SystemExit(f"grpo.py: --resume: {path} is at data position {state['data_position']}, "
                         f"not {step} x {tasks_per_step} tasks")
    return step
