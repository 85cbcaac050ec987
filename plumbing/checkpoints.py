"""plumbing/checkpoints.py: checkpoints and run directories, written so that a run can be resumed exactly and nothing a
user had is lost. sft.py and grpo.py use it.

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
import json
import os
import shutil
from dataclasses import asdict
from pathlib import Path

import torch

from plumbing import cli, disk, lora, memory, shard
from plumbing.disk import (NoRoom, Refused, RefusedElsewhere, agreed, check_room, out_of_room, refused, save_errors,
                           tree_bytes)


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


def holds_model(path) -> bool:
    """Whether directory `path` holds a model (a config.json of Hugging Face's, with its model_type, or an adapter's
    config), not a run of grpo.py, whose config.json holds its settings: the two must never be taken for each other."""
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return (Path(path) / "adapter_config.json").is_file()
    return isinstance(config, dict) and ("model_type" in config or "architectures" in config)


def holds_run(path) -> bool:
    """Whether directory `path` holds grpo.py's settings (its config.json), not a model's."""
    return (Path(path) / "config.json").is_file() and not holds_model(path)


def check_out(out: str, overwrite: bool | None, program: str = "sft.py", option: str = "--out") -> None:
    """Refuse, at start, an output directory whose contents the run would destroy: anything that is there unless
    --overwrite (None: the program has no such option), and even with it anything that is not a checkpoint's file."""
    p = Path(out)
    if p.exists() and not p.is_dir():
        raise SystemExit(f"{program}: {option}: {p} is a file, not a directory")
    disk.check_writable(p.parent, program, option)  # (the checkpoint is written beside it, then renamed)
    if not p.exists() or not any(p.iterdir()):
        return
    other = not_checkpoint_files(p) or (["config.json (a grpo.py run's settings)"] if holds_run(p) else [])
    if other:
        raise SystemExit(f"{program}: {option}: {p} holds files that are not a checkpoint's ({', '.join(other[:8])}"
                         f"{', ...' if len(other) > 8 else ''}); writing the checkpoint there would delete them: "
                         f"choose another {option}")
    if not overwrite:
        raise SystemExit(f"{program}: {option}: {p} already holds a checkpoint; "
                         + ("replace it with --overwrite, or choose " if overwrite is not None else "choose ")
                         + f"another {option}")


def save_pretrained(acc, model, tok, out: Path, run_config: dict, then: str = "run the same command again",
                    program: str = "grpo.py") -> None:
    """A Hugging Face checkpoint (safetensors + tokenizer + the run config), written beside `out` and renamed into
    place: a crash never leaves half a checkpoint. An existing `out` is replaced only when it holds nothing but a
    checkpoint's files; otherwise the new checkpoint is left beside it, and the error says where. A full disk
    removes the partial copy and stops every process: the main one in one line (Refused) ending with `then`, the
    others saying they stopped with it (RefusedElsewhere: inside a checkpoint's save, not taken for their own)."""
    import shutil

    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    from accelerate.utils import broadcast_object_list

    state = shard.full_state_dict(acc, model)  # fp32 master weights under DeepSpeed too
    error = [None]
    try:
        if acc.is_main_process:
            error[0] = _write_pretrained(acc, model, tok, out, tmp, state, run_config)
    except Exception as e:  # a full or read-only disk: the partial copy goes, and every process stops alike
        if not out_of_room(e):
            raise
        shutil.rmtree(tmp, ignore_errors=True)
        error[0] = ("refused", str(e).splitlines()[0][:200])
    if acc.num_processes > 1:
        broadcast_object_list(error)  # every process stops with the main one
    if isinstance(error[0], tuple) and not acc.is_main_process:
        raise RefusedElsewhere(program)
    if isinstance(error[0], tuple):
        raise Refused(f"writing {out} failed: {error[0][1]} (is the disk full or read-only?). The partial copy was "
                      f"removed; make room, then {then}", error[0][1])
    if error[0]:
        raise SystemExit(error[0] if acc.is_main_process else f"{program}: stopped with the main process, which did "
                         f"not replace {out} (its line says why)")


def _write_pretrained(acc, model, tok, out: Path, tmp: Path, state: dict, run_config: dict) -> str | None:
    """save_pretrained's writing, on the main process: None, or the error every process stops with."""
    import shutil

    shutil.rmtree(tmp, ignore_errors=True)
    unwrapped = acc.unwrap_model(model)
    if lora.is_adapted(unwrapped):  # the adapters only, in PEFT's format (PeftModel.from_pretrained loads them)
        unwrapped.save_pretrained(tmp, state_dict=state, safe_serialization=True, save_embedding_layers=False)
        (tmp / "README.md").unlink(missing_ok=True)  # peft's generated model card: not a file a checkpoint keeps
    else:
        # files of at most 5 GB: safetensors serializes a whole file in host memory before writing it
        unwrapped.save_pretrained(tmp, state_dict=state, safe_serialization=True,
                                  max_shard_size=memory.MODEL_FILE_BYTES)
    tok.save_pretrained(tmp)
    if lora.is_adapted(unwrapped):  # the base's weights as they are under these adapters (lora.check_base)
        run_config = {**run_config, "lora_base": lora.base_record(unwrapped)}
    disk.write_json_atomic(tmp / "muarl_config.json", run_config)
    other = not_checkpoint_files(out) if out.is_dir() else []
    if other:
        return (f"{out} holds files that are not a checkpoint's ({', '.join(other[:8])}); it was not replaced. The "
                f"new checkpoint is in {tmp}")
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return None


def save(acc, run, step: int) -> Path:
    """run_dir/checkpoints/step-N: Hugging Face model + tokenizer + run config, and accelerate/ (optimizer and RNG
    states of every process; the scheduler's as JSON). Written to a temporary directory and renamed, then `latest`
    is updated: a crash mid-save never corrupts the last good checkpoint. A disk with less room than the checkpoint
    needs (`room_needed`), even once the older checkpoints --keep-checkpoints prunes after it are gone (never the
    newest), refuses it before its first byte; a full or read-only disk mid-save removes the partial copy
    (so that a --resume has room); either stops the run in one line."""
    final = run.dir / "checkpoints" / f"step-{step:06d}"
    tmp = final.with_name(final.name + ".tmp")
    try:
        return _save(acc, run, step, final, tmp)
    except save_errors() as e:  # OSError, torch's RuntimeError, safetensors' own error: out_of_room reads them
        if not out_of_room(e):
            raise
        here = not isinstance(e, RefusedElsewhere)  # this process's disk refused (else another's)
        if here and acc.is_main_process and final.is_dir() and not tmp.exists() and not isinstance(e, NoRoom):
            # renamed whole, `latest` behind
            raise refused(run.dir, f"writing {run.dir / 'checkpoints' / 'latest.json'} after {final.name}", e,
                          f"{final.name} was saved whole, but latest.json names the checkpoint before it",
                          f"accelerate launch grpo.py --resume {final}") from None
        if acc.is_main_process:  # the partial copy is the main process's to remove, whichever disk refused
            shutil.rmtree(tmp, ignore_errors=True)
        if not here:
            raise
        raise refused(run.dir, f"writing the checkpoint of step {step} into {final.parent}", e,
                      "Nothing was written" if isinstance(e, NoRoom) else "The partial copy was removed") from None


def _save(acc, run, step: int, final: Path, tmp: Path) -> Path:
    model, tok, cfg, run_dir = run.model, run.tok, run.cfg, run.dir
    main = acc.is_main_process

    def start():
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)

    def states():  # every process writes its RNG state, the main one the model's, the optimizer's and the scheduler's
        acc.save_state(str(tmp / "accelerate"))
        if main:
            disk.write_json_atomic(tmp / "accelerate" / "scheduler.json", run.sched.state_dict())

    def room():  # a checkpoint that cannot fit is refused before its first byte, after the older ones that
        # --keep-checkpoints prunes once it is written have made what room they can (never the newest)
        need = room_needed(run, final)
        try:
            check_room(final.parent, *need)
        except NoRoom:
            kept = max(cfg.keep_checkpoints - 1, 1)  # finish keeps K - 1 older ones; the newest is never removed here
            doomed = complete(final.parent, below=final)[:-kept] if cfg.keep_checkpoints else []
            if not doomed:
                raise
            for p in doomed:
                shutil.rmtree(p, ignore_errors=True)
            from tqdm.auto import tqdm  # (a line of its own under the run's progress bar)

            names = ", ".join(p.name for p in doomed)
            tqdm.write(f"[grpo] too little room for the checkpoint of step {step}: removed {names} first, which "
                       f"--keep-checkpoints {cfg.keep_checkpoints} removes once it is written")
            check_room(final.parent, *need)

    # Each part ends in an agreement (every process at the same collective): a disk that refuses one process's write
    # stops them all there in one line, never the others at a later collective. First, one that cannot fit at all.
    agreed(acc, lambda: main and room())
    agreed(acc, start)
    if not cfg.save_weights_only and str(getattr(acc.distributed_type, "value", acc.distributed_type)) == "DEEPSPEED":
        states()  # DeepSpeed's save has collectives after its writes: a process leaving it early would meet the others
        # at another collective than theirs, so no agreement here; they stop where they wait (gloo's or NCCL's error)
    elif not cfg.save_weights_only:  # DDP (no collective after a write) and FSDP2 (failures raised on every process)
        agreed(acc, states)
    save_pretrained(acc, model, tok, tmp / "model", {"grpo": asdict(cfg)})  # (which agrees by itself)
    agreed(acc, lambda: main and finish(cfg, run_dir, step, final, tmp))
    return final


def complete(checkpoints: Path, below: Path | None = None) -> list[Path]:
    """The run's complete checkpoints (step-N with its trainer_state.json), oldest first; with `below`, only those of
    earlier steps (a resumed run may hold later ones it abandoned)."""
    return sorted(p for p in checkpoints.glob("step-*") if p.is_dir() and not p.name.endswith(".tmp")
                  and (below is None or p.name < below.name) and (p / "trainer_state.json").exists())


def room_needed(run, final: Path) -> tuple[int, str]:
    """At least the bytes checkpoint `final` will take, and whence the figure: the newest complete checkpoint of the
    run (the same shapes, the same files), else the weights it trains, at 4 bytes each, twice more for AdamW's
    moments unless --save-weights-only (a lower bound: the frozen weights, the RNG states and the tokenizer aside)."""
    older = complete(final.parent, below=final)
    if older:
        return tree_bytes(older[-1]), f"what {older[-1].name} took"
    return weights_needed(run)


def trained_weights(model) -> int:
    """How many weights `model` trains, whole however they are sharded (FSDP2's DTensors count whole; ZeRO-3's
    partitioned parameters carry their whole size as ds_numel)."""
    return sum(getattr(p, "ds_numel", None) or p.numel() for p in model.parameters() if p.requires_grad)


def weights_needed(run) -> tuple[int, str]:
    """At least the bytes of a checkpoint of `run`, from its weights: those it trains at 4 bytes each, twice more for
    AdamW's moments unless --save-weights-only."""
    trained = trained_weights(run.model)
    moments = 2 if run.cfg.optimizer != "sgd" and not run.cfg.save_weights_only else 0
    return trained * 4 * (1 + moments), f"{trained:,} trained weights{' and their optimizer state' if moments else ''}"


def check_room_to_start(acc, path: Path, need: tuple[int, str], refusal: str, program: str = "grpo.py") -> None:
    """Work whose result cannot fit on its disk is refused before it starts (not after the hours it took), on every
    process at once: `need` is (bytes, whence), `refusal` the start of the line (program and option) and its advice
    follows the room and the need."""
    try:
        agreed(acc, lambda: acc.is_main_process and check_room(path, *need), program)
    except NoRoom as e:
        raise SystemExit(refusal.format(room=e.strerror)) from None


def check_first_room(acc, run) -> None:
    """A run without a checkpoint yet whose first checkpoint cannot fit on the disk of its directory is refused at
    start (before the evaluation and the --save-every steps that come before it), its need from its weights; what
    open_run removes before the first step counts as room: the old run's checkpoints (--overwrite), the partial copy
    a first save cut short left (--resume of a run that saved nothing)."""
    if run.resume_from:  # a resumed run's saves check for themselves, with the room its older checkpoints can make
        return
    need, whence = weights_needed(run)
    held = run.dir / "checkpoints"
    need -= tree_bytes(held) if run.cfg.overwrite else sum(tree_bytes(p) for p in held.glob("step-*.tmp"))
    then = "then run the same command again" if run.cfg.resume else "or choose another --out-dir"
    check_room_to_start(acc, run.dir, (need, f"its first checkpoint: {whence}"),
                        f"grpo.py: --out-dir {run.dir}: {{room}}. Nothing was done: make room, {then}")


def finish(cfg, run_dir: Path, step: int, final: Path, tmp: Path) -> None:
    """A checkpoint's last files and its rename into place, then `latest` and the pruning of older ones (main)."""
    disk.write_json_atomic(tmp / "trainer_state.json", {"step": step, "data_position": step * cfg.tasks_per_step})
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    disk.write_json_atomic(run_dir / "checkpoints" / "latest.json", {"checkpoint": final.name})
    if cfg.keep_checkpoints:
        older = sorted(p for p in final.parent.glob("step-*") if p.is_dir() and not p.name.endswith(".tmp"))
        for p in older[:-cfg.keep_checkpoints]:
            if p != final:
                shutil.rmtree(p, ignore_errors=True)


def find(path: str) -> Path:
    """The checkpoint --resume names: a checkpoint directory, or a run directory (its `latest`)."""
    p = Path(path)
    if not p.exists():
        raise SystemExit(f"grpo.py: --resume: {path} does not exist")
    if not (p / "trainer_state.json").exists() and (p / "checkpoints").is_dir():
        p = newest(p / "checkpoints")
    if (p / "trainer_state.json").exists():
        if not (p / "accelerate").is_dir():
            raise SystemExit(f"grpo.py: --resume: {p} has no accelerate/ (no optimizer, scheduler or RNG state: saved "
                             "with --save-weights-only, or since removed), so it cannot continue the run exactly; "
                             f"start a new run with --init-from {p / 'model'}")
        return p
    raise SystemExit(f"grpo.py: --resume: no checkpoint in {path} "
                     "(expected trainer_state.json or checkpoints/latest.json)")


def newest(ckpt_dir: Path) -> Path:
    """The checkpoint `latest.json` names; when it is missing, unreadable (cut short) or names a step that is gone,
    the newest complete step (a step directory exists only once it was fully written: save renames it into place)."""
    latest = ckpt_dir / "latest.json"
    try:
        name = json.loads(latest.read_text())["checkpoint"]
        p = ckpt_dir / name
        if not (isinstance(name, str) and name.startswith("step-") and Path(name).name == name):
            why = f"names {name!r}, which is not a checkpoint of this run (a step-N directory beside it)"
        elif (p / "trainer_state.json").exists():
            return p
        else:
            why = f"names {p.name}, which is not a complete checkpoint"
    except (OSError, ValueError, KeyError, TypeError) as e:
        why = "is missing" if not latest.exists() else f"is unreadable ({e.__class__.__name__}: {e})"
    steps = sorted(p for p in ckpt_dir.glob("step-*") if not p.name.endswith(".tmp")
                   and (p / "trainer_state.json").exists())
    if not steps:
        raise SystemExit(f"grpo.py: --resume: {latest} {why}, and {ckpt_dir} holds no complete checkpoint (each has "
                         "its trainer_state.json): to train the run again from step 0, give its command with "
                         "--overwrite")
    cli.main_print(f"[grpo] --resume: {latest} {why}; using the newest complete checkpoint, {steps[-1].name}")
    return steps[-1]


def trainer_state(path: Path) -> dict:
    """A checkpoint's trainer_state.json, checked: its step and data position whole numbers, else one line."""
    f = path / "trainer_state.json"
    try:
        state = json.loads(f.read_text())
        ok = all(type(state[k]) is int and state[k] >= 0 for k in ("step", "data_position"))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"grpo.py: --resume: {f} is unreadable ({e.__class__.__name__}: {e})") from None
    if not ok:
        raise SystemExit(f"grpo.py: --resume: {f} holds step {state['step']!r} and data position "
                         f"{state['data_position']!r}, not whole numbers: the checkpoint is damaged")
    named = path.name.removeprefix("step-")
    if path.name.startswith("step-") and named.isdigit() and int(named) != state["step"]:  # the name is save's own
        raise SystemExit(f"grpo.py: --resume: {f} says step {state['step']}, its directory {path.name}: the "
                         "checkpoint is damaged (resumed so, steps would be skipped or trained twice)")
    return state


def step_of(path: Path) -> int:
    """The step a checkpoint was saved at."""
    return trainer_state(path)["step"]


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
        full = (state_dir / "pytorch_model_fsdp.bin").exists()  # an FSDP2 checkpoint saved whole, as before
        cli.sharded_checkpoints(getattr(acc.state, "fsdp_plugin", None), sharded=not full)
        with tempfile.TemporaryDirectory() as view:
            if any(state_dir.glob("custom_checkpoint_*.pkl")):  # not for Accelerate to unpickle: a view without them
                for p in state_dir.iterdir():
                    if not p.name.startswith("custom_checkpoint_"):
                        os.symlink(p.resolve(), Path(view) / p.name)
            try:
                acc.load_state(view if any(Path(view).iterdir()) else str(state_dir))
            finally:
                cli.sharded_checkpoints(getattr(acc.state, "fsdp_plugin", None))  # this run saves sharded
    except pickle.UnpicklingError as e:  # a payload planted in the run directory: refused, never run
        raise SystemExit(f"grpo.py: --resume: {state_dir} holds a file that is not plain saved state, so it was not "
                         f"loaded (it could run code): {str(e).splitlines()[0][:200]}") from None
    except Exception as e:  # a file cut short or damaged (torch's, safetensors' and pickle's own errors)
        if isinstance(e, (torch.OutOfMemoryError, MemoryError, ImportError)) or cli.is_collective_timeout(e):
            raise
        raise SystemExit(f"grpo.py: --resume: {state_dir} could not be loaded ({e.__class__.__name__}: "
                         f"{str(e).splitlines()[0][:200]}): the checkpoint is damaged; move it away to resume from an "
                         "earlier one") from None
    state_file, old = state_dir / "scheduler.json", state_dir / "custom_checkpoint_0.pkl"
    if not state_file.exists() and not old.exists():  # the schedule would start again: the resume would not be exact
        raise SystemExit(f"grpo.py: --resume: {state_file} is missing: the checkpoint is incomplete")
    if state_file.exists():
        try:
            sched.load_state_dict(json.loads(state_file.read_text()))
        except (ValueError, KeyError, TypeError) as e:
            raise SystemExit(f"grpo.py: --resume: {state_file} is unreadable ({e.__class__.__name__}: {e}): the "
                             "checkpoint is damaged") from None
    elif old.exists():
        try:
            sched.load_state_dict(torch.load(old, map_location="cpu", weights_only=True))
        except Exception as e:  # a planted payload is refused here, never run
            raise SystemExit(f"grpo.py: --resume: {old} is not a plain scheduler state, so it was not loaded (it "
                             f"could run code): {str(e).splitlines()[0][:200]}") from None
    state = trainer_state(path)
    step = state["step"]
    if state["data_position"] != step * tasks_per_step:
        raise SystemExit(f"grpo.py: --resume: {path} is at data position {state['data_position']}, "
                         f"not {step} x {tasks_per_step} tasks")
    return step
