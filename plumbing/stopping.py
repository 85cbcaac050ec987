"""The stop signals (Ctrl-C, SIGTERM, SIGHUP, a dying launcher) as a request to stop at the next safe point:
`StopOnInterrupt`, read once a step by the training loop; `Abandoned`, raised where the work in progress is not worth
finishing (loading, an evaluation, one process's rollout under SIGTERM). plumbing/rundir.py says how a run ends
when one arrives outside its steps; plumbing/pipeline.py, inside them."""
import os

import torch

from plumbing import cli


class Abandoned(BaseException):
    """A stop signal arrived where the work in progress is not worth finishing (loading, an evaluation, or, on one
    process, a rollout under SIGTERM): raised from the signal handler to leave it at once. A BaseException, as
    KeyboardInterrupt is: code that turns a failing tool, evaluator or user into that episode's error (`except
    Exception`) must never take a stop signal for one."""

    def __init__(self, signame: str):
        super().__init__(signame)
        self.signame = signame


SIGNALS = {"SIGINT": "Ctrl-C", "SIGTERM": "SIGTERM", "SIGHUP": "SIGHUP"}


class StopOnInterrupt:
    """Ctrl-C, SIGTERM and SIGHUP (what Slurm and Kubernetes send before they preempt a job, and a closed terminal) as
    a request to stop at the next safe point. The first one sets a flag that the loop reads once a step (`agreed`,
    the same answer on every process) to save and stop cleanly; a second Ctrl-C, two seconds or more later, raises
    KeyboardInterrupt as usual. (A launcher that forwards the terminal's SIGINT to its workers sends them a second
    one at once: that one is not taken as the user's second Ctrl-C.) Inside `abandoning()` (loading, evaluations,
    and on one process the rollout under SIGTERM or SIGHUP, whose grace period before SIGKILL is often 30 s) the
    first signal raises Abandoned instead, so the caller saves what finished. A signal that the process inherited as
    ignored (`nohup`, a background job of a script) stays ignored; exit status 128 + the signal's number."""

    debounce_s = 2.0  # a second SIGINT sooner than this is the launcher's copy of the first

    def __init__(self, program: str):
        self.program, self.asked, self.at, self._old, self.again = program, None, 0.0, {}, False
        self.abandon: set[str] = set()  # the signals that abandon the work in progress now
        # several processes never abandon: one that left a rollout or an evaluation early would meet the others at
        # a different collective; they finish the step together and stop after it
        self.alone = int(os.environ.get("WORLD_SIZE", "1")) == 1

    def __enter__(self):
        import signal
        import threading

        if threading.current_thread() is threading.main_thread():  # signal handlers live on the main thread only
            follow_launcher()
            for name in SIGNALS:
                sig = getattr(signal, name, None)
                if sig is not None and signal.getsignal(sig) is not signal.SIG_IGN:
                    self._old[sig] = signal.signal(sig, self._handler)
        return self

    def _handler(self, signum, frame):
        import signal
        import time

        name = signal.Signals(signum).name
        if name == "SIGHUP":  # the terminal is gone: writing to it would raise EIO wherever the run is
            devnull = os.open(os.devnull, os.O_WRONLY)
            for fd in (1, 2):
                if os.isatty(fd):
                    os.dup2(devnull, fd)
            os.close(devnull)
        if self.again and name == self.asked and name in self.abandon:  # the signal sent again (below)
            self.again = False
            self._abandon(name, signum, frame)
        elif not self.asked:
            self.asked, self.at = name, time.monotonic()
            if name in self.abandon:
                self._abandon(name, signum, frame)
            try:
                cli.main_print(f"\n[{self.program}] {SIGNALS[name]}: finishing this step, then saving a checkpoint and "
                           "stopping" + (" (Ctrl-C again to stop at once)" if name == "SIGINT" else ""))
            except OSError:
                pass
        elif name == "SIGINT" and time.monotonic() - self.at >= self.debounce_s:
            raise KeyboardInterrupt

    def _abandon(self, name: str, signum: int, frame) -> None:
        """Raise Abandoned where the signal arrived, unless that is inside a finalizer (`__del__`, which the garbage
        collector may run anywhere), where Python prints an exception and drops it: the stop was lost there, and an
        evaluation ran on to its end. Then the signal is sent again a moment later, to land in the work itself."""
        import threading

        if frame is not None and frame.f_code.co_name == "__del__":
            self.again = True
            threading.Timer(0.05, os.kill, (os.getpid(), signum)).start()
            return
        raise Abandoned(name)

    def abandoning(self, *names: str):
        """`with ctrl_c.abandoning("SIGTERM", "SIGHUP"):` the first of these signals raises Abandoned in the block
        (all three when none is named); one that arrived before the block raises at its start. With several
        processes, nothing is abandoned (the signal only asks to stop after the step)."""
        import contextlib

        @contextlib.contextmanager
        def block():
            before, self.abandon = self.abandon, set(names or SIGNALS) if self.alone else set()
            try:
                if self.asked in self.abandon:
                    raise Abandoned(self.asked)
                yield
            finally:
                self.abandon = before
        return block()

    def exit_code(self) -> int:
        import signal

        return 128 + int(getattr(signal, self.asked or "SIGINT"))

    def __exit__(self, *exc):
        import signal

        for sig, old in self._old.items():
            signal.signal(sig, old)
        return False

    def agreed(self, acc) -> bool:
        """Whether any process was asked to stop (a collective when there are several: call it on every one)."""
        if acc.num_processes == 1:
            return bool(self.asked)
        return acc.reduce(torch.tensor(float(bool(self.asked)), device=acc.device), reduction="max").item() > 0


def follow_launcher() -> None:
    """Under `accelerate launch` with one process, the launcher runs this program as its child and dies of a SIGTERM
    without passing it on: ask Linux to send this process SIGTERM when its parent dies, so it saves and stops
    instead of training on, orphaned. Not when run from a shell (`nohup` must keep working)."""
    import ctypes
    import signal
    import sys

    if not sys.platform.startswith("linux"):
        return
    try:
        parent = open(f"/proc/{os.getppid()}/cmdline", "rb").read().split(b"\0")
    except OSError:
        return
    if not any(b"accelerate" in part for part in parent[:3]):
        return
    ppid = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
    if os.getppid() != ppid:  # it died before the request
        os.kill(os.getpid(), signal.SIGTERM)
