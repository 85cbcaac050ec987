"""What the entry points (sft.py, eval.py, grpo.py) share to run: one config dataclass as the command line (each
field's docstring is its --help, CleanRL style), the Accelerator, atomic JSON writes, printing on the main process.

Its own module because it is the entry points' plumbing, not the method: muarl.py keeps the tokens, rollout.py the
episodes. It imports nothing of the project.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

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


def parse_config(cls, argv=None, recipes: dict | None = None, description: str = "", given: set | None = None):
    """Parse --field value options into `cls` (a dataclass). `--recipe NAME` applies a preset first; options
    given on the command line win. Unknown options and bad values fail at start, naming the option. `given`, a set,
    receives the names of the fields set on the command line (grpo.py --resume: which settings the user changes)."""
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
            group.add_argument(flag, dest=f.name, type=base, default=None, metavar=base.__name__.upper(),
                           help=f"{docs.get(f.name, '')} (default: {f.default!r})".replace("%", "%%"))
    args = vars(p.parse_args(argv))
    recipe = args.pop("recipe", None)
    values = dict(recipes[recipe]) if recipe else {}
    unknown = set(values) - {f.name for f in dataclasses.fields(cls)}
    if unknown:
        raise ValueError(f"recipe sets unknown options {sorted(unknown)}")
    values.update({k: tuple(v) if isinstance(v, list) else v for k, v in args.items() if v is not None})
    if given is not None:
        given.update([k for k, v in args.items() if v is not None] + (["recipe"] if recipe else []))
    return cls(**values)


def groups(parser, cls, name: str):
    """The --help group of field `name`: the first class in `cls`'s bases (options.py's groups, an entry point's own)
    that declares it, titled by the first line of that class's docstring."""
    owner = next(k for k in reversed(cls.__mro__) if name in getattr(k, "__annotations__", {}))
    title = (owner.__doc__ or owner.__name__).strip().splitlines()[0]
    made = parser.__dict__.setdefault("_muarl_groups", {})
    if title not in made:
        made[title] = parser.add_argument_group(title)
    return made[title]


def json_line(obj) -> str:
    """One line of a JSONL file (episodes, evaluations, cold-start data), non-ASCII text kept as it is. Always valid
    UTF-8: an unpaired surrogate, which json.loads makes of an escape like "\\ud800" wherever JSON is read (a tool
    call, an endpoint's reply, a data file), is written back as that escape, so the line reads back to the same
    string. Every JSONL writer goes through here, whatever the text came from; a surrogate is checked for again only
    where text meets a tokenizer (toolcall.parse_assistant, envs.users.reply_problem, coldstart.load_conversations)."""
    return json.dumps(obj, ensure_ascii=False, default=str).encode("utf-8", "backslashreplace").decode("utf-8") + "\n"


def write_json_atomic(path, obj) -> None:
    """Write JSON so that a crash mid-write never leaves a truncated file (write a temp file, then rename)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=str))
    os.replace(tmp, path)


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
    acc = Accelerator(cpu=not torch.cuda.is_available(), **kwargs)
    if acc.device.type == "cpu":
        # `accelerate launch` sets OMP_NUM_THREADS=1 when it has no config, which halves a 2-core machine:
        # share the cores among this machine's processes instead (MUARL_THREADS overrides).
        local = int(os.environ.get("LOCAL_WORLD_SIZE", acc.num_processes))
        torch.set_num_threads(int(os.environ.get("MUARL_THREADS", 0)) or max(1, (os.cpu_count() or 1) // local))
    return acc


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


def main_print(*args) -> None:
    """print on the main process only (before an Accelerator exists, from torchrun's RANK)."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(*args, flush=True)


class StopOnInterrupt:
    """Ctrl-C as a request to stop at the next safe point. The first SIGINT sets a flag that the loop reads once a
    step (`agreed`, the same answer on every process) to save and stop cleanly; a second one, two seconds or more
    later, raises KeyboardInterrupt as usual. (A launcher that forwards the terminal's SIGINT to its workers sends
    them a second one at once: that one is not taken as the user's second Ctrl-C.)"""

    debounce_s = 2.0  # a second SIGINT sooner than this is the launcher's copy of the first

    def __init__(self, program: str):
        self.program, self.asked, self.at, self._old = program, False, 0.0, None

    def __enter__(self):
        import signal
        import threading

        if threading.current_thread() is threading.main_thread():  # signal handlers live on the main thread only
            self._old = signal.signal(signal.SIGINT, self._handler)
        return self

    def _handler(self, signum, frame):
        import time

        if not self.asked:
            self.asked, self.at = True, time.monotonic()
            main_print(f"\n[{self.program}] Ctrl-C: finishing this step, then saving a checkpoint and stopping "
                       "(Ctrl-C again to stop at once)")
        elif time.monotonic() - self.at >= self.debounce_s:
            raise KeyboardInterrupt

    def __exit__(self, *exc):
        import signal

        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)
        return False

    def agreed(self, acc) -> bool:
        """Whether any process was asked to stop (a collective when there are several: call it on every one)."""
        if acc.num_processes == 1:
            return self.asked
        return acc.reduce(torch.tensor(float(self.asked), device=acc.device), reduction="max").item() > 0


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
