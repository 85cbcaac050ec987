"""A run's directory: claimed at start (one run at a time: run.lock), opened once the run has loaded (--overwrite
removes only a run's own files; --resume cuts the logs back to its checkpoint), the settings a --resume continues
with (a run stopped before its first checkpoint starts again, a finished one is left as it is), and how a run ends
outside its steps (a stop signal while it loads or evaluates, a collective that timed out). The stop signals
themselves are plumbing/stopping.py's."""
from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import time
from pathlib import Path

from plumbing import checkpoints, cli, disk, stopping

# What --resume lets a user change: how the run reaches its user simulator and how it reports and saves; none of it
# changes the algorithm. A dead endpoint can be replaced on resume, under another model name if the new server
# serves the user so (a --user-model that names another model changes the user itself: your call, recorded in
# resumes.jsonl). Anything else continues with the run's saved settings; giving another value is refused.
RESUMABLE = ("steps", "user_base_url", "user_model", "user_concurrency", "user_timeout", "user_retries", "tool_timeout",
             "report_to", "log_episodes", "save_every", "keep_checkpoints", "memory_check", "dist_timeout",
             "eval_every", "lora_decode")
# Options added after runs were saved, as those runs ran: a run resumes as it started unless told otherwise.
BEFORE_THEY_EXISTED = {"lora_decode": "unmerged", "eval_env": ""}


def options(Config, argv, recipes: dict) -> tuple:
    """The run's settings: the command line, or with --resume the run's saved settings and the few that may change
    (RESUMABLE). Returns (config, the checkpoint to resume from, what the resume changes: name -> [old, new])."""
    given = set()
    cfg = cli.parse_config(Config, argv, recipes=recipes, description=Config.__doc__.split("\n\n")[0], given=given,
                           program="grpo.py")
    if "model" in given and cfg.init_from and not cfg.resume:  # typed beside --init-from, it was not read, yet was
        # recorded as the model trained (a --recipe's --model is not "given": --recipe paper --init-from X works)
        raise SystemExit(f"grpo.py: --model {cfg.model}: with --init-from {cfg.init_from} the run trains that "
                         "checkpoint and --model is not read: give one of them")
    if not cfg.resume:
        return cfg, None, {}
    if checkpoints.holds_model(cfg.resume):
        raise SystemExit(f"grpo.py: --resume: {cfg.resume} is a model, not a run of grpo.py or one of its checkpoints: "
                         f"to train from it, --init-from {cfg.resume}")
    unsaved = unsaved_run(cfg.resume)  # stopped before its first checkpoint: starts again at step 0
    resume_from = None if unsaved else checkpoints.find(cfg.resume)
    saved, changes = resume_settings(unsaved or resume_from, cfg, given, RESUMABLE)
    if unsaved and not in_use(unsaved):  # (a run still going is refused by claim: announce no restart of it)
        cli.main_print(f"[grpo] --resume: {unsaved} stopped before its first checkpoint; starting it again from step "
                       "0 with its settings")
    out_dir = str(unsaved) if unsaved else saved["out_dir"]
    return Config(**{**saved, "resume": cfg.resume, "overwrite": False, "out_dir": out_dir}), resume_from, changes


def finished(cfg, resume_from: Path | None) -> bool:
    """A resumed run that already did all its steps and wrote its summary: nothing is left to do, or to rewrite
    (a run stopped after its last checkpoint but before the summary goes on to its "after" evaluation)."""
    if resume_from is None or checkpoints.step_of(resume_from) < cfg.steps:
        return False
    if checkpoints.step_of(resume_from) > cfg.steps:
        raise SystemExit(f"grpo.py: --resume --steps {cfg.steps}: {resume_from} is already at step "
                         f"{checkpoints.step_of(resume_from)}; --steps can only grow")
    summary = resume_from.parents[1] / "summary.json"
    try:
        done = json.loads(summary.read_text()).get("steps") == cfg.steps
    except (OSError, ValueError, AttributeError):
        done = False
    if done:
        cli.main_print(f"[grpo] {resume_from.parents[1]} finished all {cfg.steps} steps ({summary}); nothing to do. "
                       f"To train it further: --resume {cfg.resume} --steps N (N > {cfg.steps})")
    return done


@contextlib.contextmanager
def stops(cfg, stop):
    """How a run ends outside its steps (pipeline.train handles those): a stop signal while it loads or evaluates,
    and a collective that timed out, each in one line. The run directory's lock goes when the run does."""
    try:
        yield
    except stopping.Abandoned as e:
        run_dir = Path(cfg.out_dir) if cfg.out_dir else None
        then = (f"continue with: accelerate launch grpo.py --resume {run_dir}" if run_dir and not cfg.overwrite and
                (run_dir / "config.json").exists() else "run the same command again")
        cli.main_print(f"\n[grpo] stopped by {stopping.SIGNALS[e.signame]} while loading or evaluating; {then}")
        raise SystemExit(stop.exit_code()) from None
    except RuntimeError as e:
        if not cli.is_collective_timeout(e):
            raise
        raise SystemExit(f"grpo.py: this process waited more than --dist-timeout {cfg.dist_timeout:g} s for another "
                         f"at a collective (a rollout that waited on the user, a process that died, a slow disk): "
                         f"{str(e)[:300]}") from e
    finally:
        unlock()


# What a run writes into its directory (grpo.main); --overwrite removes these and nothing else.
RUN_FILES = ("config.json", "metrics.jsonl", "episodes.jsonl", "eval-before.jsonl", "eval-before.json",
             "eval-after.jsonl", "summary.json", "curves.png", "checkpoints", "resumes.jsonl", "metrics.jsonl.cut",
             "episodes.jsonl.cut")


def run_files(run_dir: Path) -> list[str]:
    """The files of RUN_FILES in `run_dir`, and its evaluations along the way (eval-stepN.jsonl, --eval-every)."""
    return ([n for n in RUN_FILES if (run_dir / n).exists()] +
            sorted(p.name for p in run_dir.glob("eval-step*.jsonl")) if run_dir.is_dir() else [])


_held: list = []  # the open lock files of the run directories this process writes (kept for its lifetime)


LOGS = ("metrics.jsonl", "episodes.jsonl")  # one JSON object a line, each with its "step"


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


def in_use(run_dir: Path) -> bool:
    """Whether another process holds run_dir's run.lock now (asked on the main process only: lock() decides)."""
    import fcntl

    if int(os.environ.get("RANK", "0")) != 0 or not (run_dir / "run.lock").is_file():
        return False
    with open(run_dir / "run.lock", "a+") as f:  # this process holds no lock on it yet: closing releases nothing
        try:
            fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            return e.errno in (errno.EAGAIN, errno.EACCES)
        fcntl.lockf(f, fcntl.LOCK_UN)
    return False


def unlock() -> None:
    """Release the run directories this process locked (the run ended; a crash releases them anyway). A directory
    that holds nothing but its lock (a run refused or stopped before it opened) goes with it."""
    while _held:
        f = _held.pop()
        f.close()
        run_dir = Path(f.name).parent
        if [p.name for p in run_dir.iterdir()] == ["run.lock"]:
            os.remove(f.name)
            with contextlib.suppress(OSError):
                run_dir.rmdir()


def claim(acc, run_dir: Path, resuming: bool, overwrite: bool) -> Path:
    """Check, at start, that this run may write into `run_dir`; returns it as the main process named it (a default
    name holds the time, which could tick between processes). A directory that already holds a run is refused
    unless the run is resumed or --overwrite is given. Nothing is removed here: that waits until the run has
    loaded (`open_run`), so a run that fails to start loses nothing. The main process decides; every process
    stops with it."""
    from accelerate.utils import broadcast_object_list

    decision = [None, str(run_dir)]
    if acc.is_main_process:
        present = run_files(run_dir)
        if run_dir.exists() and not run_dir.is_dir():
            decision[0] = f"grpo.py: --out-dir: {run_dir} is a file"
        elif not resuming and run_dir.is_dir() and checkpoints.holds_model(run_dir):
            decision[0] = (f"grpo.py: --out-dir: {run_dir} holds a model, not a run (its config.json is the model's, "
                           f"which a run's would replace): choose another --out-dir; to train from it, --init-from "
                           f"{run_dir}")
        elif present and not resuming and "config.json" not in present:  # an evaluation's, or another program's
            decision[0] = (f"grpo.py: {'--overwrite' if overwrite else '--out-dir'}: {run_dir} holds "
                           f"{', '.join(present)} but no config.json, so no run of grpo.py wrote them; nothing was "
                           "deleted. Move them away or choose another --out-dir")
        elif present and not resuming and not overwrite:
            decision[0] = (f"grpo.py: --out-dir: {run_dir} already holds a run ({', '.join(present)}); continue it "
                           f"with --resume {run_dir}, replace it with --overwrite, or choose another --out-dir")
        else:
            try:
                decision[0] = lock(run_dir)
            except OSError as e:  # below a file, an unwritable or read-only place
                decision[0] = (f"grpo.py: {'--resume' if resuming else '--out-dir'}: cannot "
                               f"{'write into' if run_dir.is_dir() else 'make'} {run_dir}: "
                               f"{disk.unusable(run_dir, e)}")
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
    present = run_files(run_dir)
    if resume_step is not None:
        for stale in sorted((run_dir / "checkpoints").glob("step-*.tmp")):  # a save cut short: its room comes first
            print(f"[grpo] --resume: removing {stale.name}, a checkpoint whose save never finished", flush=True)
            shutil.rmtree(stale, ignore_errors=True)
        try:
            for name in LOGS:
                dropped = cut_log(run_dir / name, resume_step)
                if dropped:
                    print(f"[grpo] --resume at step {resume_step}: {dropped} line(s) of {name} after it (or cut short, "
                          f"or unreadable) moved to {name}.cut", flush=True)
            kept = logged_steps(run_dir / "metrics.jsonl")
            if len(kept & set(range(1, resume_step + 1))) < resume_step:
                print(f"[grpo] --resume at step {resume_step}: metrics.jsonl holds {len(kept)} of the steps before it "
                      "(emptied or cut by hand?): the curves and their means go without the missing ones", flush=True)
            with open(run_dir / "resumes.jsonl", "a") as f:
                f.write(json.dumps({"step": resume_step, "time": time.strftime("%Y-%m-%d %H:%M:%S"),
                                    "changed": changes}) + "\n")
        except OSError as e:
            if not disk.out_of_room(e):
                raise
            raise SystemExit(f"grpo.py: --resume: cannot rewrite the logs of {run_dir}: {e.strerror or e} (is the "
                             f"disk full or read-only?). The logs and checkpoints are as they were. Make room, then "
                             f"run the same command again.") from None
    elif present and overwrite:
        print(f"[grpo] --overwrite: removing the earlier run's {', '.join(present)} from {run_dir}", flush=True)
        for name in sorted(present, key=lambda n: n == "config.json"):  # config.json last: cut short, it is still ours
            p = run_dir / name
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    run_dir.mkdir(parents=True, exist_ok=True)
    new = resume_step is None
    with refusals(run_dir, f"writing config.json to {run_dir}",
                  "The run has not started" if new else "config.json is as it was",
                  "run the same command again" if new else ""):
        disk.write_json_atomic(run_dir / "config.json", config)


@contextlib.contextmanager
def refusals(run_dir: Path, what: str, undone: str, then: str = ""):
    """A write the disk refuses inside (full, over quota, read-only: `disk.out_of_room`) stops the run in one
    line naming what was written, what was undone, the newest checkpoint and what to run then."""
    try:
        yield
    except Exception as e:  # OSError, or a writer's own words for it
        if not disk.out_of_room(e):
            raise
        raise disk.refused(run_dir, what, e, undone, then) from None


@contextlib.contextmanager
def together(acc):
    """Around writes only the main process makes, reached by every process: a write the disk refused there (a
    `disk.Refused`) stops every process here in one line each, not the others at their next collective (the
    agreement of disk.agreed)."""
    try:
        yield
    except disk.Refused:
        disk.any_failed(acc, True)
        raise
    if disk.any_failed(acc, False):
        raise disk.RefusedElsewhere()


@contextlib.contextmanager
def writing(run_dir: Path, name: str, what: str, mode: str = "a"):
    """One of the run's logs, open to append to (or, mode "w", to write whole). A failed write cuts the log back to
    where it was, so that no line is left half written; a disk that refused it stops the run in one line."""
    path = run_dir / name
    size = path.stat().st_size if mode == "a" and path.exists() else 0
    with refusals(run_dir, f"writing {what} to {path}",
                  "The log was cut back to where it was" if size else "The file was removed"):
        try:
            with open(path, mode, encoding="utf-8") as f:
                yield f
        except BaseException:  # the write, the flush as the file closes, or a stop signal between lines
            with contextlib.suppress(OSError):
                os.truncate(path, size) if size else path.unlink()
            raise


def cut_log(path: Path, last_step: int) -> int:
    """Keep the lines of a JSONL log up to `last_step`; move later steps, and a line cut short by a crash, to
    `<path>.cut`. Returns how many lines moved. Streams: episodes.jsonl can be large."""
    if not path.exists():
        return 0
    tmp, dropped = path.with_name(path.name + ".tmp"), 0
    cut_path = path.with_name(path.name + ".cut")
    cut_tmp = cut_path.with_name(cut_path.name + ".tmp")  # the old .cut and the new lines, replaced whole
    try:
        with open(path, encoding="utf-8", errors="replace") as src, open(tmp, "w", encoding="utf-8") as keep, \
                open(cut_tmp, "w", encoding="utf-8") as cut:
            if cut_path.exists():
                with open(cut_path, encoding="utf-8", errors="replace") as old:
                    shutil.copyfileobj(old, cut)
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
    except OSError:  # a full disk: nothing replaced, nothing left behind; a second try cuts the same lines once
        tmp.unlink(missing_ok=True)
        cut_tmp.unlink(missing_ok=True)
        raise
    if dropped:
        os.replace(cut_tmp, cut_path)
    else:
        cut_tmp.unlink()
    os.replace(tmp, path)
    return dropped


def logged_steps(path: Path) -> set[int]:
    """The steps a JSONL log holds a readable line of."""
    steps = set()
    for line in open(path, encoding="utf-8", errors="replace") if path.exists() else ():
        with contextlib.suppress(ValueError, KeyError, TypeError):
            steps.add(int(json.loads(line)["step"]))
    return steps


def unsaved_run(path: str) -> Path | None:
    """The run directory --resume names when it holds a run that stopped before its first checkpoint (config.json,
    no complete step): such a run starts again from step 0 with its own settings."""
    p = Path(path)
    if not checkpoints.holds_run(p) or (p / "trainer_state.json").exists():
        return None
    ckpts = p / "checkpoints"  # a checkpoint saved once (latest.json, a step-N), even if damaged since: not unsaved
    if ckpts.is_dir() and ((ckpts / "latest.json").exists() or any(
            not s.name.endswith(".tmp") for s in ckpts.glob("step-*"))):
        return None
    return p


def settings_file(path: Path) -> Path:
    """Where a run's settings are saved: a checkpoint's model/muarl_config.json, or a run directory's config.json (a
    run that saved no checkpoint)."""
    run_dir = (path / "config.json").is_file() and not (path / "trainer_state.json").exists()
    return path / "config.json" if run_dir else path / "model" / "muarl_config.json"


def saved_settings(path: Path) -> dict:
    """The settings a run was started with (settings_file)."""
    file = settings_file(path)
    try:
        saved = json.loads(file.read_text())
        saved = saved if file.name == "config.json" else saved["grpo"]
        if not isinstance(saved, dict):
            raise TypeError(f"{type(saved).__name__}, not an object of settings")
        return saved
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"grpo.py: --resume: {file} is unreadable ({e.__class__.__name__}: {e}): the run's saved "
                         "settings are damaged") from None


SHIPPED_ENVS = ("shop:", "tau2:", "bfcl:", "acebench:")  # and "shop": the environments envs.make_env builds itself


def resume_settings(path: Path, cfg, given: set, resumable: tuple) -> tuple[dict, dict]:
    """The settings a resumed run continues with: the checkpoint's (or the unsaved run's, `path` its directory),
    with the options given on the command line that may change (`resumable`; an option equal to the saved value is
    no change). Returns (settings, changes: name -> [saved, new]); any other change is refused, naming it."""
    saved = {**BEFORE_THEY_EXISTED, **saved_settings(path)}
    for key in ("env", "eval_env"):
        env = saved.get(key, "shop" if key == "env" else "")  # (absent: the default)
        if not (isinstance(env, str) and (env in ("shop", "") or env.startswith(SHIPPED_ENVS))) and not (
                key in given and getattr(cfg, key) == env):  # a run directory never chooses code to import and run
            option, what = ("--env", "environment") if key == "env" else ("--eval-env", "evaluations' environment")
            raise SystemExit(f"grpo.py: --resume: the run's {what}, {env!r} in its saved settings, is not one muarl "
                             "ships (shop, tau2:, bfcl:, acebench:), and a run directory may not choose code to "
                             f"import: name it again on the command line, --resume {path} {option} {env}")
    # A --recipe's settings, where not typed too, are compared with the run's: the command that started a run, with
    # --resume added, changes nothing, and a setting a resume may change keeps the run's value (its --steps grown by
    # an earlier resume, a replaced --user-model) unless it is typed.
    typed = {k for k in given if ":" not in k} - {"resume", "recipe"}
    recipe = {k.split(":", 1)[1] for k in given if k.startswith("recipe:")} - typed - set(resumable)
    changes = {k: [saved.get(k), getattr(cfg, k)] for k in sorted(typed | recipe) if saved.get(k) != getattr(cfg, k)}
    fixed = [k for k in changes if k not in resumable]
    if fixed:
        by_recipe = [k for k in fixed if k in recipe]
        raise SystemExit(f"grpo.py: --resume continues the run with its saved settings; "
                         f"{', '.join('--' + k.replace('_', '-') for k in fixed)} cannot change in it (only "
                         f"{', '.join('--' + k.replace('_', '-') for k in resumable)} can)"
                         + (f"; --recipe sets {', '.join('--' + k.replace('_', '-') for k in by_recipe)}"
                            if by_recipe else "")
                         + f"; start a new run with --init-from {path / 'model'} to change them")
    settings = {**saved, **{k: new for k, (_, new) in changes.items()}}
    try:  # (after the changes: a resume may mend a setting it may change)
        cli.check_saved(type(cfg), settings)
    except ValueError as e:
        raise SystemExit(f"grpo.py: --resume: the settings saved in {settings_file(path)}: {e} (saved by another "
                         "version of muarl, or damaged)") from None
    return settings, changes


def results_so_far(run) -> dict:
    """The "before" evaluation of a resumed run (eval-before.json), for its summary."""
    path = run.dir / "eval-before.json"
    return json.loads(path.read_text()) if run.first_step and path.exists() else {}
