"""plumbing/disk.py: every file the programs write, written whole (a crash or a full disk never leaves half of one),
and a write the disk refuses (full, over quota, read-only, failing) stopping a run in one line that says what failed,
what was undone and how to go on, on every process at the same collective, never as a traceback nor with the others
left waiting at their next collective.

    json_line, write_json_atomic, write_jsonl_atomic  JSON and JSONL written whole (`replaced`), always valid UTF-8
    check_writable  a place a program will write into, refused at its start when it cannot be written

    out_of_room  whether an error raised while writing is the disk's refusal (an OSError's errno, or the words torch's
           zip writer, safetensors and torch.distributed.checkpoint use for one)
    agreed  a write on each process, then one collective: a refusal on any stops every process there
    refused  the line a run stops with (Refused, a SystemExit)
    check_room  before a write of a known size: refused at once (NoRoom) when the disk has less room than it needs
"""
import contextlib
import errno
import json
import os
import shutil
from pathlib import Path


def json_line(obj) -> str:
    """One line of a JSONL file (episodes, evaluations, cold-start data), non-ASCII text kept as it is. Always valid
    UTF-8: an unpaired surrogate, which json.loads makes of an escape like "\\ud800" wherever JSON is read (a tool
    call, an endpoint's reply, a data file), is written back as that escape, so the line reads back to the same
    string. Every JSONL writer goes through here, whatever the text came from; a surrogate is checked for again only
    where text meets a tokenizer (toolcall.parse_assistant, envs.users.reply_problem,
    conversations.load_conversations)."""
    return json.dumps(obj, ensure_ascii=False, default=str).encode("utf-8", "backslashreplace").decode("utf-8") + "\n"


def check_writable(path, program: str, option: str) -> None:
    """Refuse at start a place a program will write into but cannot (a read-only disk, a path below a file), rather
    than after the work: the nearest part of `path` that exists must be a directory this process can add a file to."""
    import tempfile

    p = Path(path).absolute()
    while not p.exists():
        p = p.parent
    if not p.is_dir():
        raise SystemExit(f"{program}: {option}: cannot write below {p}: it is a file, not a directory")
    try:
        with tempfile.NamedTemporaryFile(dir=p, prefix=".muarl-probe-"):
            pass
    except OSError as e:
        raise SystemExit(f"{program}: {option}: cannot write into {p}: {e.strerror or e}") from None


# The errors of a disk that refuses the bytes: full, read-only, over quota, a file past its size limit, failing
DISK_REFUSED = (errno.ENOSPC, errno.EROFS, errno.EDQUOT, errno.EFBIG, errno.EIO)


def unusable(path: Path, e: OSError) -> str:
    """Why `path` could not be made or written, naming the culprit: the file it would sit below, or the OS's reason."""
    for parent in path.parents:
        if parent.exists():
            return f"{parent} is a file, not a directory" if not parent.is_dir() else (e.strerror or str(e))
    return e.strerror or str(e)


@contextlib.contextmanager
def replaced(path):
    """A temporary path beside `path`, renamed over it when the block ends well and removed when it does not: a
    crash or a full disk never leaves half a file, nor a half-written copy beside it."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)


def write_jsonl_atomic(path, objs, option: str) -> None:
    """A JSONL file written whole (`replaced`) for the command-line option naming it; a write that fails (a full or
    read-only disk, a path below a file) stops in one line naming the option."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with replaced(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
            f.writelines(json_line(o) for o in objs)
    except OSError as e:
        why = unusable(path, e) + (" (is the disk full or read-only?)" if e.errno in DISK_REFUSED else "")
        raise SystemExit(f"{option}: cannot write {path}: {why}; nothing was written there") from None


def write_json_atomic(path, obj) -> None:
    """Write JSON so that a crash mid-write never leaves a truncated file (`replaced`)."""
    with replaced(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, default=str))


class Refused(SystemExit):
    """A write the disk refused (`out_of_room`): the one line a program stops with (no traceback), raised on every
    process alike where they write together. `why`: the writer's words."""

    def __init__(self, line: str, why: str):
        self.why = why
        super().__init__(line)


# How a failed write reads when it is not an OSError: torch's zip writer (torch.save, Accelerate's save_state) raises
# RuntimeError "[enforce fail at inline_container.cc] . unexpected pos N vs M" or "... failed writing file ..." on a
# short write; safetensors raises its own SafetensorError with the OS's words ("No space left on device (os error 28)").
WRITE_FAILURES = ("No space left", "write failed", "failed writing file", "unexpected pos", "Disk quota exceeded",
                  "File too large", "Read-only file system")


def writers_error(e: BaseException) -> BaseException:
    """The error the writer raised: torch.distributed.checkpoint (FSDP2's sharded checkpoints) raises a
    CheckpointException on every process alike when any process's write failed, carrying each failed one's error."""
    failures = getattr(e, "failures", None)
    return next(iter(failures.values()))[0] if isinstance(failures, dict) and failures else e


def save_errors() -> tuple:
    """What a save may raise that out_of_room reads: CheckpointException is a BaseException, not an Exception."""
    try:
        from torch.distributed.checkpoint.api import CheckpointException
    except ImportError:  # a torch built without distributed
        return Exception, Refused
    return Exception, Refused, CheckpointException


def out_of_room(e: BaseException) -> bool:
    """Whether an error raised while writing means the disk refused the bytes (full, over quota, read-only, failing)."""
    e = writers_error(e)
    if isinstance(e, Refused):
        return True
    if isinstance(e, OSError) and e.errno in DISK_REFUSED:
        return True
    return any(s in str(e) for s in WRITE_FAILURES)


class RefusedElsewhere(Refused):
    """What the other processes stop with when one process's disk refused a write they made together."""

    def __init__(self, program: str = "grpo.py"):
        super().__init__(f"{program}: stopped with the process whose disk refused a write (its line says which, and "
                         "how to go on)", "")


def agreed(acc, work, program: str = "grpo.py") -> None:
    """`work()` on this process, then one collective: a write the disk refused on any process (`out_of_room`) stops
    every process here, the one that failed with its error and the others with RefusedElsewhere, so that none is left
    waiting at a collective the failed one never reaches. (Any other error is a bug: it is raised where it happens.)"""
    try:
        work()
    except save_errors() as e:
        if not out_of_room(e):
            raise
        any_failed(acc, True)
        raise  # never kept in a local: that would keep its frames, and the files they hold open, until the garbage
        # collector runs, and the partial copy's room with them (found on a real full disk)
    if any_failed(acc, False):
        raise RefusedElsewhere(program)


def any_failed(acc, failed: bool) -> bool:
    """Whether `failed` is true on any process (a collective every process must reach)."""
    if acc.num_processes == 1:
        return failed
    from accelerate.utils import gather_object

    return any(gather_object([failed]))


def refused(run_dir: Path, what: str, e: BaseException, undone: str, then: str = "") -> Refused:
    """The one line a run stops with when the disk refused a write (`out_of_room`): what failed and why, what was
    undone, the newest checkpoint, and how to go on (`then`; by default the --resume command)."""
    e = writers_error(e)
    why = e.why if isinstance(e, Refused) else str(e) if isinstance(e, NoRoom) else str(e).splitlines()[0][:200]
    newest = sorted(p.name for p in (run_dir / "checkpoints").glob("step-*") if not p.name.endswith(".tmp"))
    kept = f"the newest checkpoint, {newest[-1]}, is untouched" if newest else "no checkpoint was saved before it"
    if newest and not then and not (run_dir / "checkpoints" / newest[-1] / "accelerate").is_dir():  # weights only
        then = f"train on from its weights in a new run: --init-from {run_dir / 'checkpoints' / newest[-1] / 'model'}"
    return Refused(f"grpo.py: {what} failed: {why} (is the disk full or read-only?). {undone}; {kept}. Make room, "
                   f"then: {then or f'accelerate launch grpo.py --resume {run_dir}'}", why)


class NoRoom(OSError):
    """A write refused before it began: the disk has less room than the write needs (`check_room`)."""


def free_bytes(path: Path) -> int | None:
    """The bytes a write into `path` (or the nearest directory above it that exists) may still take; None when the
    filesystem does not say."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def check_room(path: Path, need: int, whence: str) -> None:
    """Raise NoRoom (ENOSPC: `out_of_room` reads it as the disk's refusal) when the disk of `path` has less than
    `need` bytes free: a write that cannot fit is refused before its first byte, instead of after minutes of writing
    (and, under DeepSpeed, whose save has collectives of its own after its writes, instead of leaving the other
    processes waiting there)."""
    free = free_bytes(path)
    if free is not None and free < need:
        raise NoRoom(errno.ENOSPC, f"{size(free)} free on the disk of {path}, and it needs at least {size(need)} "
                                   f"({whence})")


def size(n: int) -> str:
    """Bytes as a reader reads them: 1000 bytes, 4.0 KiB, 14.8 MiB, 3.1 GiB."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


def tree_bytes(path: Path) -> int:
    """The bytes of the files under `path` (0 when it is not there)."""
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)

