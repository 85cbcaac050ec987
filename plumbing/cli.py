"""What the entry points (sft.py, eval.py, grpo.py) share to run: one config dataclass as the command line (each
field's docstring is its --help, CleanRL style), the Accelerator, printing on the main process. (The files they
write go through disk.py.)

Its own module because it is the entry points' plumbing, not the method: muarl.py keeps the tokens, rollout.py the
episodes. It imports nothing of the project.
"""
from __future__ import annotations

import os

import torch


def field_docs(cls) -> dict[str, str]:
    """The docstring written under each field of a dataclass (CleanRL style), read from its source."""
    import ast
    import inspect
    import textwrap

    docs = {}
    for klass in reversed(cls.__mro__):
        try:
            body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body
        except (OSError, TypeError, IndexError, AttributeError):
            continue
        for node, nxt in zip(body, body[1:]):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and \
                    isinstance(nxt, ast.Expr) and isinstance(getattr(nxt, "value", None), ast.Constant):
                docs[node.target.id] = " ".join(str(nxt.value.value).split())
    return docs


class Range:
    """The values a numeric option accepts, in interval notation: "[0, 1]", "(0, 1]", "[1, inf)". It is declared in
    the option's annotation, `lr: Annotated[float, Range("(0, inf)")] = 2e-4`, so that an option and what it accepts
    are written once, together; --help shows it and `check_ranges` refuses any value outside it at start. A value
    must also be finite: NaN and inf are in no range ("(0, inf)" means every positive number)."""

    def __init__(self, text: str):
        low, high = (part.strip() for part in text[1:-1].split(","))
        self.text, self.low_open, self.high_open = text, text[0] == "(", text[-1] == ")"
        self.low, self.high = float(low), float(high)
        if text[0] not in "([" or text[-1] not in ")]" or not self.low <= self.high:
            raise ValueError(f"Range({text!r}) is not an interval like '[0, 1]' or '(0, inf)'")

    def __contains__(self, x) -> bool:
        import math

        return (math.isfinite(x) and (self.low < x if self.low_open else self.low <= x)
                and (x < self.high if self.high_open else x <= self.high))

    def __str__(self) -> str:
        return self.text


SEEDS = Range(f"[0, {2**32 - 1}]")  # numpy's seeds (models.seed_everything); torch's and random's take more
# Seconds: ~3 years, far past any wait, and within the int64 nanosecond clocks that sockets and process groups keep.
TIMEOUTS = Range("(0, 1e8]")


def range_of(cls, name: str) -> Range | None:
    """The Range declared for field `name` of dataclass `cls`: the annotation of the first class in its bases that
    declares one (a subclass that only gives the field another default keeps its base's range)."""
    import typing

    for klass in cls.__mro__:
        if name in vars(klass).get("__annotations__", {}):
            hint = typing.get_type_hints(klass, include_extras=True)[name]
            found = [m for m in getattr(hint, "__metadata__", ()) if isinstance(m, Range)]
            if found:
                return found[0]
    return None


def numeric_fields(cls) -> list[str]:
    """The fields of dataclass `cls` that hold a number (int or float; bool is a flag, not a number)."""
    import dataclasses
    import typing

    hints = typing.get_type_hints(cls)
    return [f.name for f in dataclasses.fields(cls) if hints[f.name] in (int, float)]


def check_ranges(cfg, program: str) -> None:
    """Every numeric option of `cfg` finite and inside its declared Range, else SystemExit in one line naming the
    option, its value and the range."""
    for name in numeric_fields(type(cfg)):
        value, allowed = getattr(cfg, name), range_of(type(cfg), name)
        if allowed is None:
            raise TypeError(f"{type(cfg).__name__}.{name} is a number with no declared Range (Annotated[..., Range])")
        if value not in allowed:
            finite = "" if value == value and abs(value) != float("inf") else "a finite number "
            raise SystemExit(f"{program}: --{name.replace('_', '-')} {value}: must be {finite}in {allowed}")


KINDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def check_saved(cls, saved: dict) -> None:
    """Settings read back from a file (a resumed run's) as dataclass `cls` takes them: a name `cls` has no field for,
    a value of another type (an int is a float; a bool is no number) or a number outside its Range raises ValueError
    naming the setting, never a TypeError from `cls(**saved)` or a refusal that blames an option nobody gave."""
    import dataclasses
    import typing

    hints = typing.get_type_hints(cls)
    unknown = sorted(set(saved) - {f.name for f in dataclasses.fields(cls)})
    if unknown:
        raise ValueError(f"it holds {', '.join(map(repr, unknown))}, which {cls.__name__} has no setting for")
    for name, value in saved.items():
        kind = hints[name]
        if kind not in KINDS:
            continue
        if isinstance(value, bool) != (kind is bool) or not isinstance(value, (int, float) if kind is float else kind):
            raise ValueError(f"its {name} is {value!r}, not {KINDS[kind]}")
        allowed = range_of(cls, name) if kind in (int, float) else None
        if allowed is not None and value not in allowed:
            raise ValueError(f"its {name} is {value!r}, outside {allowed}")


def parse_config(cls, argv=None, recipes: dict | None = None, description: str = "", given: set | None = None,
                 program: str = ""):
    """Parse --field value options into `cls` (a dataclass). `--recipe NAME` applies a preset first; options
    given on the command line win. Unknown options and bad values fail at start, naming the option, and so does a
    number outside its declared Range (`check_ranges`, messages prefixed by `program`). `given`, a set, receives the
    names of the fields set on the command line, and "recipe" with "recipe:<field>" for each field a --recipe sets
    (grpo.py --resume: which settings the user changes)."""
    import argparse
    import dataclasses
    import typing

    docs, hints = field_docs(cls), typing.get_type_hints(cls)
    p = argparse.ArgumentParser(description=description)
    if recipes:
        p.add_argument("--recipe", choices=sorted(recipes), help="a preset of settings, applied before the options")
    for f in dataclasses.fields(cls):
        kind, flag = hints[f.name], "--" + f.name.replace("_", "-")
        group = groups(p, cls, f.name)
        if kind is bool:
            group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None,
                           help=f"{docs.get(f.name, '')} (default: {f.default})".replace("%", "%%"))
        elif typing.get_origin(kind) is tuple:  # tuple[str, ...]: one or more values after the flag
            group.add_argument(flag, dest=f.name, type=typing.get_args(kind)[0], nargs="+", default=None,
                               help=f"{docs.get(f.name, '')}".replace("%", "%%"))
        else:
            base = (typing.get_args(kind)[0]
                    if typing.get_origin(kind) in (typing.Union, getattr(__import__('types'), 'UnionType', None))
                    else kind)
            allowed = range_of(cls, f.name) if base in (int, float) else None
            group.add_argument(flag, dest=f.name, type=base, default=None, metavar=base.__name__.upper(),
                               help=f"{docs.get(f.name, '')} (default: {f.default!r}"
                                    f"{f'; range: {allowed}' if allowed else ''})".replace("%", "%%"))
    args = vars(p.parse_args(argv))
    recipe = args.pop("recipe", None)
    values = dict(recipes[recipe]) if recipe else {}
    unknown = set(values) - {f.name for f in dataclasses.fields(cls)}
    if unknown:
        raise ValueError(f"recipe sets unknown options {sorted(unknown)}")
    values.update({k: tuple(v) if isinstance(v, list) else v for k, v in args.items() if v is not None})
    if given is not None:
        given.update([k for k, v in args.items() if v is not None] +
                     (["recipe", *(f"recipe:{k}" for k in recipes[recipe])] if recipe else []))
    cfg = cls(**values)
    check_ranges(cfg, program or p.prog)
    return cfg


def groups(parser, cls, name: str):
    """The --help group of field `name`: the first class in `cls`'s bases (options.py's groups, an entry point's own)
    that declares it, titled by the first line of that class's docstring, or its first sentence where that line goes
    on past one."""
    owner = next(k for k in reversed(cls.__mro__) if name in getattr(k, "__annotations__", {}))
    title = (owner.__doc__ or owner.__name__).strip().splitlines()[0].split(". ")[0]
    made = parser.__dict__.setdefault("_muarl_groups", {})
    if title not in made:
        made[title] = parser.add_argument_group(title)
    return made[title]


def make_accelerator(dist_timeout: float | None = None, **kwargs):
    """An Accelerator that also joins CPU-only processes started by torchrun (over gloo): Accelerate only
    treats a CPU run as distributed when told `cpu=True`, otherwise each process trains alone. `dist_timeout`:
    seconds a process waits for the others at a collective (the process group's timeout; NCCL's default is 10
    minutes, too short for a step whose rollout waits on a slow user endpoint)."""
    from datetime import timedelta

    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    plugin = fsdp2_plugin(kwargs.get("mixed_precision", "no"))
    if plugin is not None and "fsdp_plugin" not in kwargs:
        kwargs["fsdp_plugin"] = plugin
    if dist_timeout:
        kwargs["kwargs_handlers"] = [*kwargs.get("kwargs_handlers", []),
                                     InitProcessGroupKwargs(timeout=timedelta(seconds=dist_timeout))]
    try:
        acc = Accelerator(cpu=not torch.cuda.is_available(), **kwargs)
    except (RuntimeError, ValueError) as e:  # e.g. an FSDP or XLA configuration where no such device is
        raise SystemExit(f"Accelerate cannot start with this launch's configuration here ({str(e)[:300]}): see "
                         "`accelerate env`, or give another with `accelerate launch --config_file`") from None
    sharded_checkpoints(getattr(acc.state, "fsdp_plugin", None))
    if acc.device.type == "cpu":
        # `accelerate launch` sets OMP_NUM_THREADS=1 when it has no config, which halves a 2-core machine:
        # share the cores among this machine's processes instead (MUARL_THREADS overrides).
        local = int(os.environ.get("LOCAL_WORLD_SIZE", acc.num_processes))
        threads = os.environ.get("MUARL_THREADS", "").strip() or "0"
        if not threads.isdigit():
            raise SystemExit(f"MUARL_THREADS={os.environ['MUARL_THREADS']!r}: must be a whole number of threads (0 or "
                             "unset: this machine's cores shared among its processes)")
        torch.set_num_threads(int(threads) or max(1, (os.cpu_count() or 1) // local))
    return acc


def sharded_checkpoints(fsdp_plugin, sharded: bool = True) -> None:
    """Under FSDP2, save_state (a checkpoint's accelerate/) writes each process's shards of the weights and AdamW
    moments, all processes in parallel (torch.distributed.checkpoint), whatever the accelerate config chose: with
    its other answer, FULL_STATE_DICT, model and optimizer are gathered to one process (~100 GB of host memory at
    8B) and saved by it alone. The model directory is one full gather (shard.full_state_dict). `sharded` False:
    the full state dict, to read a checkpoint saved that way (checkpoints.load)."""
    if fsdp_plugin is not None and fsdp_plugin.fsdp_version == 2:
        # the other kind's configs (rank0_only: broadcast from rank 0) would stay, and torch refuses them sharded
        fsdp_plugin.state_dict_config = fsdp_plugin.optim_state_dict_config = None
        fsdp_plugin.set_state_dict_type("SHARDED_STATE_DICT" if sharded else "FULL_STATE_DICT")


def check_report_to(report_to: str, program: str) -> None:
    """--report-to names a tracker Accelerate knows whose package is installed ('all': at least one is), else
    SystemExit in one line naming the known ones. Accelerate itself only warns about a missing package, and the run
    then logs to no tracker at all."""
    if not report_to:
        return
    from accelerate.tracking import LOGGER_TYPE_TO_CLASS, LoggerType, get_available_trackers

    known = sorted(LOGGER_TYPE_TO_CLASS)
    installed = [str(t) for t in get_available_trackers()] + [k for k in known if k not in LoggerType.list()]
    if report_to not in known + ["all"]:
        raise SystemExit(f"{program}: --report-to {report_to}: not a tracker Accelerate knows ({', '.join(known)}, "
                         "or all)")
    if report_to == "all" and not installed:
        raise SystemExit(f"{program}: --report-to all: none of the trackers' packages is installed "
                         f"({', '.join(known)})")
    if report_to != "all" and report_to not in installed:
        raise SystemExit(f"{program}: --report-to {report_to}: its package is not installed (pip install {report_to}); "
                         f"installed: {', '.join(installed) or 'none'}")


def fsdp2_plugin(mixed_precision: str):
    """Under `accelerate launch` with FSDP2 and bf16, the mixed-precision policy to use instead of Accelerate's:
    its default also casts every output of the sharded forward to bf16 (output_dtype), which would round the
    float32 log-probs the loss is computed from (steps of ~0.03 at logp -5), and reduces gradients in bf16. Here the
    weights are gathered in bf16, gradients reduced in fp32, outputs left as computed. None when not FSDP2 + bf16."""
    if (os.environ.get("ACCELERATE_USE_FSDP", "false").lower() != "true" or os.environ.get("FSDP_VERSION") != "2"
            or mixed_precision != "bf16"):
        return None
    from accelerate import FullyShardedDataParallelPlugin
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return FullyShardedDataParallelPlugin(fsdp_version=2, mixed_precision_policy=MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32))


ALLOC_CONF = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")  # torch >= 2.9 reads the first, older ones the second


def cuda_allocator_defaults() -> str | None:
    """At an entry point's start, before CUDA is initialized: CUDA's caching allocator with expandable segments, so
    that the KV caches of varying size that come and go every turn (and the parked ones coming back) do not fragment
    GPU memory into blocks too small to reuse. A setting of the user's (either name, or ROCm's
    PYTORCH_HIP_ALLOC_CONF) is left exactly as it is. Returns what was set (None: nothing)."""
    if torch.version.cuda is None or torch.cuda.is_initialized():  # no CUDA build, or too late to take effect
        return None
    if any(name in os.environ for name in (*ALLOC_CONF, "PYTORCH_HIP_ALLOC_CONF")):
        return None
    for name in ALLOC_CONF:
        os.environ[name] = "expandable_segments:True"
    return "expandable_segments:True"


def main_print(*args) -> None:
    """print on the main process only (before an Accelerator exists, from torchrun's RANK)."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(*args, flush=True)


class option_errors:
    """`with option_errors("grpo.py: --init-from"):` prefixes a SystemExit message raised inside (a loading error
    that names the path) with the program and the option that gave the path."""

    def __init__(self, prefix: str):
        self.prefix = prefix

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        if kind is SystemExit and isinstance(exc.code, str):
            raise SystemExit(f"{self.prefix}: {exc.code}") from None
        return False


def is_collective_timeout(e: BaseException) -> bool:
    """Whether an error is a collective that waited past the process group's timeout. gloo raises it in the process;
    NCCL's watchdog aborts the process instead (its own message names the timeout), so this sees gloo's."""
    text = str(e).lower()
    return isinstance(e, RuntimeError) and ("timed out" in text or "timeout" in text) and (
        type(e).__name__ == "DistBackendError" or "gloo" in text or "nccl" in text or "processgroup" in text)


class outside_zero3_init:
    """Build or load a model as a plain one even where Accelerate has installed a DeepSpeed ZeRO-3 config, under which
    transformers builds every model inside `deepspeed.zero.Init` (partitioned at once, its parameters reporting 0
    elements): for the shapes-only model of the memory estimate, and for models that are only evaluated (eval.py,
    an `hf` user simulator), which no engine ever gathers."""

    def __enter__(self):
        try:
            from transformers.integrations import deepspeed as hf_ds
        except ImportError:
            self.hf_ds = None
            return self
        # transformers keeps the active config in a module-level weak reference; it has no public getter
        self.hf_ds, self.saved = hf_ds, hf_ds._hf_deepspeed_config_weak_ref
        hf_ds._hf_deepspeed_config_weak_ref = None
        return self

    def __exit__(self, *exc):
        if self.hf_ds is not None:
            self.hf_ds._hf_deepspeed_config_weak_ref = self.saved
        return False
