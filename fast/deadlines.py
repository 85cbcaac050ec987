"""Tool calls under a deadline: a tool call that runs too long becomes an error the agent reads, never a stalled step.

A tool runs inside this process, against the episode's own database. Some calls never end in Python's terms: tau2
retail's `calculate("9**9**9")` is one C-level big-integer power that holds the interpreter for minutes, and no
thread, timer or signal handler can interrupt it. So each call is first tried in a forked copy of this process (the
probe), which is killed at the deadline. Only a call that finished there runs here, for real: the same call on the
same state, so its writes land once, in this process, and the two copies stay equal. A call that overran, or that
killed the probe (a crash, out of memory), is answered with an error and never runs here.

The probe is forked at a rollout's first tool call and ended with the rollout: it answers calls over a pipe (about
0.05 ms each) and is forked again, carrying every session's current state, when a call names a session it does not
have or after it was killed. Its cost is copy-on-write: while it lives, each page of private memory this process
writes is copied first (the engine's host blocks for waiting caches are shared mappings, and are not). On the tiny
model on 2 CPU cores a GRPO step's rollout took 6.1 s against 4.3 s with --tool-timeout 0; a probe started by its
own interpreter, holding only the environment, would avoid that (not done yet). An environment
whose tools are remote (`slow_tools = True`) is not probed, since its calls are not safe to make twice: its calls wait
at most the deadline in a thread and are then abandoned (the remote side may still act on them). Where this process
cannot fork (not POSIX), calls run without a deadline, with one warning.
"""
from __future__ import annotations

import logging
import os
import pickle
import signal
import threading
import weakref
from multiprocessing.connection import Pipe

from envs import ToolResult

log = logging.getLogger("muarl")


def guard(session, timeout: float, remote: bool = False):
    """`session` whose call_tool runs under a deadline of `timeout` seconds (0: none)."""
    if not timeout or timeout <= 0:
        return session
    return DeadlineSession(session, timeout, remote)


class DeadlineSession:
    """An episode's session (envs.EnvSession) whose tool calls have a deadline; everything else passes through."""

    def __init__(self, session, timeout: float, remote: bool):
        self.session, self.timeout, self.remote = session, timeout, remote
        self.busy = threading.Lock()  # remote: an abandoned call may still run; the next waits for it

    def __getattr__(self, name):
        return getattr(self.session, name)

    def call_tool(self, name: str, arguments, requestor: str = "assistant", n_messages: int | None = None):
        kwargs = {"requestor": requestor} if requestor != "assistant" else {}  # as the session was called
        kwargs.update({"n_messages": n_messages} if n_messages is not None else {})
        if self.remote:
            return _in_thread(self, name, arguments, kwargs)
        return PROBE.call(self.session, self.timeout, name, arguments, kwargs)


def overran(name: str, timeout: float, what: str = "did not finish") -> ToolResult:
    return ToolResult(f"Error: tool {name} {what} within its deadline of {timeout:g} s (--tool-timeout); "
                      "it was stopped and changed nothing", error=True)


def _in_thread(guarded: DeadlineSession, name, arguments, kwargs) -> ToolResult:
    """A remote tool's call in a daemon thread (an abandoned one never holds the process at exit); the session takes
    one call at a time, so a call that overran still holds it until it returns."""
    timeout, out = guarded.timeout, []
    if not guarded.busy.acquire(timeout=timeout):
        return ToolResult(f"Error: tool {name} was not run: this episode's previous tool call is still running past "
                          f"its deadline of {timeout:g} s (--tool-timeout)", error=True)

    def call():
        try:
            out.append(guarded.session.call_tool(name, arguments, **kwargs))
        except Exception as e:  # the session's contract is to never raise; one that does is the agent's error
            out.append(ToolResult(f"Error: tool {name} raised {type(e).__name__}: {e}", error=True))
        finally:
            guarded.busy.release()

    thread = threading.Thread(target=call, daemon=True, name="muarl-tool")
    thread.start()
    thread.join(timeout)
    if out:
        return out[0]
    return ToolResult(f"Error: tool {name} did not answer within its deadline of {timeout:g} s (--tool-timeout); "
                      "the call was abandoned (the remote side may still carry it out)", error=True)


class _Probe:
    """The forked copy of this process that tries each call first. One per process; calls are serialized (the
    decoding thread and the user thread both call tools), so both copies see the calls in the same order."""

    def __init__(self):
        self.lock = threading.Lock()
        self.pid, self.conn = None, None
        self.sessions: dict[int, weakref.ref] = {}  # key -> session, as the next fork will see them
        self.keys: dict[int, int] = {}  # id(session) -> key
        self.forked_keys: set[int] = set()  # the sessions the live probe has
        self.next_key = 0
        self.usable = hasattr(os, "fork")
        self.warned = False

    def key(self, session) -> int:
        k = self.keys.get(id(session))
        if k is not None and self.sessions[k]() is session:
            return k
        k, self.next_key = self.next_key, self.next_key + 1  # a new session (or a new one at a reused address)
        self.keys[id(session)] = k
        self.sessions[k] = weakref.ref(session, lambda _, k=k, i=id(session): self._forget(k, i))
        return k

    def _forget(self, key: int, ident: int) -> None:
        self.sessions.pop(key, None)
        if self.keys.get(ident) == key:
            del self.keys[ident]

    def call(self, session, timeout, name, arguments, kwargs) -> ToolResult:
        if not self.usable:
            if not self.warned:
                log.warning("tool calls run without a deadline: this platform cannot fork (--tool-timeout)")
                self.warned = True
            return session.call_tool(name, arguments, **kwargs)
        with self.lock:
            key = self.key(session)
            if self.pid is None or key not in self.forked_keys:
                try:
                    self._fork()
                except OSError as e:  # no memory or processes left for a copy: this call runs without one
                    log.warning("tool %s runs without its deadline: the copy that would try it could not be forked "
                                "(%s)", name, e)
                    return session.call_tool(name, arguments, **kwargs)
            try:
                self.conn.send_bytes(pickle.dumps((key, name, arguments, kwargs)))
                answer = self.conn.recv_bytes() if self.conn.poll(timeout) else None
            except (OSError, EOFError, pickle.PicklingError):
                answer = b"crashed"
            except BaseException:  # interrupted mid-call (a stop signal): the probe's answer would be the next's
                self._kill()
                raise
            if answer == b"raised":  # an ordinary exception: here it raises as it always did
                return session.call_tool(name, arguments, **kwargs)
            if answer is None or answer == b"crashed" or answer.startswith(b"error:"):
                self._kill()
                if answer is None:
                    return overran(name, timeout)
                why = answer.decode(errors="replace")[len("error:"):] if answer != b"crashed" else "the probe died"
                return ToolResult(f"Error: tool {name} failed in a way that stopped it ({why.strip()[:300]}); "
                                  "it changed nothing", error=True)
            return session.call_tool(name, arguments, **kwargs)  # it finished there: run it here, for real

    def _fork(self) -> None:
        self._kill()
        parent, child = Pipe()
        pid = os.fork()
        if pid == 0:  # the probe: answers calls until the pipe closes; never returns
            try:
                parent.close()
                _serve(child, {k: r() for k, r in list(self.sessions.items())})
            finally:
                os._exit(0)
        child.close()
        self.pid, self.conn, self.forked_keys = pid, parent, set(self.sessions)

    def close(self) -> None:
        """End the probe (the rollout is over): while it lives, every page this process writes is first copied,
        since the two share them (copy-on-write): a training step of the tiny model took 1.0 s instead of 0.57 s
        beside a forked child."""
        with self.lock:
            self._kill()

    def _kill(self) -> None:
        if self.pid is None:
            return
        try:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        self.conn.close()
        self.pid = self.conn = None


def _serve(conn, sessions: dict) -> None:
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # stop signals are the parent's to handle
        signal.signal(sig, signal.SIG_IGN)
    try:  # and the probe ends with its parent, however the parent ends (Linux)
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    logging.disable(logging.CRITICAL)  # the parent logs what it runs; a copy must not log twice
    while True:
        try:
            key, name, arguments, kwargs = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return
        try:
            sessions[key].call_tool(name, arguments, **kwargs)
            conn.send_bytes(b"ok")
        except (MemoryError, RecursionError) as e:  # would take the parent down too: the call is not run there
            conn.send_bytes(f"error: {type(e).__name__}: {e}".encode(errors="replace"))
            return
        except Exception:  # the parent makes the same call and raises the same way: the two stay equal
            conn.send_bytes(b"raised")
        except BaseException as e:  # SystemExit and the like: a tool that would end the process
            conn.send_bytes(f"error: {type(e).__name__}: {e}".encode(errors="replace"))
            return


PROBE = _Probe()
