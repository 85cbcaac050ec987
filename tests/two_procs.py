"""torchrun with two CPU processes, for the tests that start them (test_train, test_lora, test_sharding).

A launch that outlives its timeout is shown, not only timed out: every process torchrun started is sent SIGABRT,
which under PYTHONFAULTHANDLER=1 prints each thread's Python stack to stderr, and the test fails with those
stacks. A hang then says where it was (a collective one process never joined, a teardown that never ended).
"""
import os
import signal
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def descendants(pid: int) -> list[int]:
    """The processes below `pid` (Linux /proc; empty elsewhere)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def torchrun(args: list[str], port: int, timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m torch.distributed.run --nproc_per_node 2 --master_port PORT ARGS...` through run()."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port), *args]
    return run(cmd, timeout, env)


def run(cmd: list[str], timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run `cmd` (a torchrun command line) in the repository root with one thread per process; on timeout, fail with
    the Python stacks of the processes it started."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1", **(env or {})}
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        out, err = p.communicate(timeout=timeout)
        return subprocess.CompletedProcess(cmd, p.returncode, out, err)
    except subprocess.TimeoutExpired:
        ended = p.poll()
        for pid in descendants(p.pid):
            try:
                os.kill(pid, signal.SIGABRT)
            except ProcessLookupError:
                pass
        try:
            out, err = p.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
    state = (f"the launcher had exited ({ended}) but a process it started held its output open" if ended is not None
             else "the launcher was still running")
    pytest.fail(f"{' '.join(cmd[:6])} ... did not end within {timeout:g} s ({state}). The last output, with each "
                f"process's Python stacks (SIGABRT under PYTHONFAULTHANDLER):\n{out[-1500:]}\n{err[-8000:]}",
                pytrace=False)
