"""Tool calls under a deadline: a tool call that runs too long becomes an error the agent reads, never a stalled step.

A tool runs inside this process, against the episode's own database. Some calls never end in Python's terms: tau2
retail's `calculate("9**9**9")` is one C-level big-integer power that holds the interpreter for minutes, and no
thread, timer or signal handler can interrupt it. So each call is first tried on a copy of the episode's session in
another process (the probe), which is killed at the deadline. Only a call that finished there runs here, for real: the
same call on the same state, so its writes land once, in this process. A call that overran, or that killed the probe
(a crash, out of memory), is answered with an error and never runs here.

The probe is not a fork of this process, which holds the model, its caches and, on a GPU, a CUDA context: while a
forked copy lives, every page this process writes is first copied (a rollout took 2.4x as long beside one, and a GPU
process would be forked with tens of GB of host memory). Instead each environment gets one small process, its keeper,
forked once while this process is still small (`prepare`, which grpo.py and eval.py call right after they build the
environment, before the model loads; else at the environment's first call), and probes are forked from the keeper.
A probe holds a copy of each episode's session made as this process made it, `env.start(task)`, followed by the
calls this process has run on it, in order: a probe that takes over after a kill replays them. A call travels to the
keeper, which times it, and on to the probe over pipes (~0.1 ms). The copies are exact where `start` is a function of
the task and each tool a function of the session's state (the environment contract, docs/invariants.md, 4); where
they are not (a tool that draws random ids), the copies may drift, which can weaken the deadline's protection but
never change a result: the call that counts is always this process's own.

An environment whose tools are remote (`slow_tools = True`) is not probed, since its calls are not safe to make twice:
its calls wait at most the deadline in a thread and are then abandoned (the remote side may still act on them). Where
this process cannot fork (not POSIX), calls run without a deadline, with one warning.
"""
from __future__ import annotations

import logging
import os
import pickle
import signal
import itertools
import threading
import weakref
from multiprocessing.connection import Pipe

from envs import ToolResult

log = logging.getLogger("muarl")


def prepare(env) -> None:
    """Fork `env`'s keeper now, while this process is small (before the model loads): the probes are forked from it,
    never from the process that holds the model. Without it, the keeper is forked at the environment's first call."""
    if KEEPERS.usable and not getattr(env, "slow_tools", False):
        KEEPERS.get(env).start()


def guard(env, task, timeout: float, remote: bool = False):
    """A fresh session of `task` (env.start) whose call_tool runs under a deadline of `timeout` seconds (0: none)."""
    session = env.start(task)
    if not timeout or timeout <= 0:
        return session
    guarded = DeadlineSession(session, env, task, timeout, remote)
    if not remote:
        KEEPERS.register(guarded)  # the probe makes its copy now, while the episode decodes
    return guarded


class DeadlineSession:
    """An episode's session (envs.EnvSession) whose tool calls have a deadline; everything else passes through (its
    own fields are named so as not to hide a session's)."""

    def __init__(self, session, env, task, timeout: float, remote: bool):
        self.session, self.timeout, self.remote = session, timeout, remote
        self.busy = threading.Lock()  # remote: an abandoned call may still run; the next waits for it
        self._deadline_env, self._deadline_task = env, task
        self._deadline_calls: list[tuple] = []  # the calls run here, in order: what a new probe replays
        self._deadline_key: int | None = None  # its number at the keeper

    def __getattr__(self, name):
        return getattr(self.session, name)

    def call_tool(self, name: str, arguments, requestor: str = "assistant", n_messages: int | None = None):
        kwargs = {"requestor": requestor} if requestor != "assistant" else {}  # as the session was called
        kwargs.update({"n_messages": n_messages} if n_messages is not None else {})
        if self.remote:
            return _in_thread(self, name, arguments, kwargs)
        return KEEPERS.call(self, name, arguments, kwargs)


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


class _Keepers:
    """The keeper of each environment (weakly held: it ends with its environment)."""

    def __init__(self):
        self.lock = threading.RLock()  # a finalizer (_drop) can run on this thread while it is held
        self.by_env: dict[int, _Keeper] = {}
        self.usable = hasattr(os, "fork")
        self.warned = False

    def get(self, env) -> _Keeper:
        with self.lock:
            keeper = self.by_env.get(id(env))
            if keeper is None or keeper.env() is not env:  # none yet, or one of an environment at a reused address
                if keeper is not None:
                    keeper.close()
                keeper = self.by_env[id(env)] = _Keeper(env)
                weakref.finalize(env, self._drop, id(env), keeper)
            return keeper

    def _drop(self, ident: int, keeper: _Keeper) -> None:  # its environment is gone
        keeper.close()
        with self.lock:
            if self.by_env.get(ident) is keeper:
                del self.by_env[ident]

    def register(self, guarded: DeadlineSession) -> None:
        if self.usable:
            self.get(guarded._deadline_env).register(guarded)

    def call(self, guarded: DeadlineSession, name, arguments, kwargs) -> ToolResult:
        if not self.usable:
            if not self.warned:
                log.warning("tool calls run without a deadline: this platform cannot fork (--tool-timeout)")
                self.warned = True
            return guarded.session.call_tool(name, arguments, **kwargs)
        return self.get(guarded._deadline_env).call(guarded, name, arguments, kwargs)

    def close(self) -> None:
        """End every keeper and its probe (tests; a process ends them with itself)."""
        with self.lock:
            keepers, self.by_env = list(self.by_env.values()), {}
        for k in keepers:
            k.close()


class _Keeper:
    """This process's side of one environment's keeper. Calls are serialized (the decoding thread and the user thread
    both call tools), so the probe sees them in the order they run here."""

    def __init__(self, env):
        self.env = weakref.ref(env)
        self.lock = threading.Lock()
        self.pid, self.conn = None, None
        self.known: set[int] = set()  # the sessions the live keeper has
        self.gone: list[int] = []  # sessions that ended since the last call: the keeper drops its copies

    def start(self) -> None:
        with self.lock:
            if self.pid is None:
                self._fork()

    def _forget(self, key: int) -> None:
        self.gone.append(key)  # (a finalizer: no lock; the list is read under the lock, appended atomically)

    def _ready(self, guarded: DeadlineSession, what: str) -> bool:
        """Under the lock: the session's key, and a keeper to send to (False: none could be forked)."""
        if guarded._deadline_key is None:
            guarded._deadline_key = next(_KEYS)
            weakref.finalize(guarded, self._forget, guarded._deadline_key)
        if self.pid is None:
            try:
                self._fork()
            except OSError as e:  # no memory or processes left for a keeper
                log.warning("%s runs without its deadline: the keeper of its probes could not be forked (%s)", what, e)
                return False
        return True

    def register(self, guarded: DeadlineSession) -> None:
        """A new session: the probe makes its copy at once, not at the session's first call (tau2 retail's start
        takes ~0.2 s), answering nothing."""
        with self.lock:
            if not self._ready(guarded, "a new session"):
                return
            try:
                message = pickle.dumps((self.gone, guarded._deadline_key, (guarded._deadline_task, []), None))
            except Exception:  # a task that cannot be copied: its first call says so (and runs without the probe)
                return
            try:
                self.conn.send_bytes(message)
                self.gone = []
                self.known.add(guarded._deadline_key)
            except OSError:  # the keeper is gone: its first call forks another and sends the session again
                self._kill()
            except BaseException:  # interrupted mid-send (a stop signal): a cut-short message would desync the keeper
                self._kill()
                raise

    def call(self, guarded: DeadlineSession, name, arguments, kwargs) -> ToolResult:
        session, timeout = guarded.session, guarded.timeout
        with self.lock:
            if not self._ready(guarded, f"tool {name}"):
                guarded._deadline_calls.append((name, arguments, kwargs))  # what a later probe's copy replays
                return session.call_tool(name, arguments, **kwargs)
            key = guarded._deadline_key
            new = None if key in self.known else (guarded._deadline_task, guarded._deadline_calls)
            try:
                message = pickle.dumps((self.gone, key, new, (name, arguments, kwargs, timeout)))
            except Exception as e:  # a task or arguments that cannot be copied to the probe: run without it
                log.warning("tool %s runs without its deadline: its session's task or arguments cannot be sent to "
                            "the probe (%s: %s)", name, type(e).__name__, e)
                guarded._deadline_calls.append((name, arguments, kwargs))
                return session.call_tool(name, arguments, **kwargs)
            try:
                self.conn.send_bytes(message)
                self.gone = []
                self.known.add(key)
                # the keeper times the call itself; this wait only covers a keeper that stopped answering
                wait = timeout * (2 + len(guarded._deadline_calls)) + 120  # past the keeper's own waits
                answer = self.conn.recv_bytes() if self.conn.poll(wait) else b"error: the keeper did not answer"
            except (OSError, EOFError) as e:
                answer = f"error: the keeper failed ({type(e).__name__})".encode()
            except BaseException:  # interrupted mid-call (a stop signal): the keeper's answer would be the next's
                self._kill()
                raise
            if answer in (b"ok", b"raised"):  # it finished there: run it here, for real (raising as it always did)
                guarded._deadline_calls.append((name, arguments, kwargs))
                return session.call_tool(name, arguments, **kwargs)
            if answer.startswith(b"error: the keeper"):
                self._kill()
            if answer == b"overran":
                return overran(name, timeout)
            why = answer.decode(errors="replace")[len("error:"):]
            return ToolResult(f"Error: tool {name} failed in a way that stopped it ({why.strip()[:300]}); "
                              "it changed nothing", error=True)

    def _fork(self) -> None:
        self._kill()
        env = self.env()
        parent, child = Pipe()
        pid = os.fork()
        if pid == 0:  # the keeper: forks probes and times their calls until the pipe closes; never returns
            try:
                parent.close()
                _quiet_child(die_with_parent=False)  # it ends when this process's end of the pipe closes
                _keep(child, env)
            finally:
                os._exit(0)
        child.close()
        self.pid, self.conn, self.known, self.owner = pid, parent, set(), os.getpid()

    def close(self) -> None:
        with self.lock:
            self._kill()

    def _kill(self) -> None:
        if self.pid is None or self.owner != os.getpid():  # (in a forked child: not its keeper to end)
            return
        _end(self.pid, self.conn)
        self.pid = self.conn = None


def _end(pid: int, conn) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass
    conn.close()


def _quiet_child(die_with_parent: bool = True) -> None:
    """A keeper's or probe's set-up: stop signals are the parent's to handle; a probe ends with its keeper, however
    the keeper ends (Linux: the death signal follows the thread that forked it, and a keeper is single-threaded; a
    keeper, which any thread of the trainer may fork, ends instead when the trainer's end of its pipe closes); it logs
    nothing (the parent logs what it runs)."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    for keeper in list(KEEPERS.by_env.values()):  # the other keepers' pipes are not this child's to hold open
        if keeper.conn is not None:
            keeper.conn.close()
    if not die_with_parent:
        logging.disable(logging.CRITICAL)
        return
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    logging.disable(logging.CRITICAL)


def _keep(conn, env) -> None:
    """The keeper: for each call, the session's task and the calls run on it (sent when it is new here), a probe
    (forked when there is none), the call timed there; the calls that finished are added to the session's record, so
    that a probe forked after a kill can rebuild every session."""
    sessions: dict[int, list] = {}  # key -> [task, calls]
    probe = None  # (pid, conn, the keys it has)
    while True:
        try:
            gone, key, new, call = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return
        for k in gone:
            sessions.pop(k, None)
        if new is not None:
            sessions[key] = [new[0], list(new[1])]
        if probe is None:
            parent, child = Pipe()
            pid = os.fork()
            if pid == 0:
                try:
                    parent.close()
                    conn.close()  # the trainer's pipe is the keeper's alone: its end must close with the keeper
                    _quiet_child()
                    _probe(child, env, {k: (t, list(c)) for k, (t, c) in sessions.items()})
                finally:
                    os._exit(0)
            child.close()
            probe = (pid, parent, set(sessions))
        pid, pconn, has = probe
        task, calls = sessions[key]
        try:
            pconn.send_bytes(pickle.dumps((gone, key, None if key in has else (task, calls),
                                           call and call[:3])))
            has.add(key)
            has.difference_update(gone)
            if call is None:  # a new session: the probe makes its copy; nothing to answer
                continue
            timeout = call[3]
            ready = pconn.poll(timeout * (1 + len(calls)) + 60) and pconn.recv_bytes() == b"ready"  # its copy made
            answer = pconn.recv_bytes() if ready and pconn.poll(timeout) else b"overran"
        except (OSError, EOFError):
            if call is None:
                _end(pid, pconn)
                probe = None
                continue
            answer = b"error: the probe died"
        if answer in (b"ok", b"raised"):
            calls.append(call[:3])
        else:
            _end(pid, pconn)
            probe = None
        conn.send_bytes(answer)


def _probe(conn, env, sessions: dict) -> None:
    """A probe: each session's copy made on its first call (env.start, then the calls run on it so far), then each
    call run on it, answering how it ended."""
    copies = {}
    while True:
        try:
            gone, key, new, call = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return
        for k in gone:
            copies.pop(k, None)
            sessions.pop(k, None)
        if new is not None:
            sessions[key] = new
        if key not in copies:
            task, calls = sessions[key]
            copy = env.start(task)
            for n, a, kw in calls:  # each of them finished before, here and there
                try:
                    copy.call_tool(n, a, **kw)
                except Exception:
                    pass
            copies[key] = copy
        if call is None:  # made ahead of its first call
            continue
        name, arguments, kwargs = call
        conn.send_bytes(b"ready")
        try:
            copies[key].call_tool(name, arguments, **kwargs)
            conn.send_bytes(b"ok")
        except (MemoryError, RecursionError) as e:  # would take the parent down too: the call is not run there
            conn.send_bytes(f"error: {type(e).__name__}: {e}".encode(errors="replace"))
            return
        except Exception:  # the parent makes the same call and raises the same way: the two stay equal
            conn.send_bytes(b"raised")
        except BaseException as e:  # SystemExit and the like: a tool that would end the process
            conn.send_bytes(f"error: {type(e).__name__}: {e}".encode(errors="replace"))
            return


KEEPERS = _Keepers()
_KEYS = itertools.count()  # sessions' numbers at their keepers: one counter for the process, never reused
