"""Run a function on N local ranks: tpcore.spawn(fn, world_size, ...).

Works from scripts, pytest and Jupyter.  Each rank is a process that gets a
communicator and calls fn(comm, *args, **kwargs).  Return values come back in
rank order.  If a rank raises, the others are stopped and the exception is
raised here, with the rank and its traceback in the message; if a rank dies
(killed, os._exit), RankExitedError says which and how.  Output the ranks
print from Python is relayed here line by line, prefixed with the rank, so it
shows in a notebook too (_relay.py: a carriage-return progress line is one line
per update, or one line drawn in place on a terminal, with one prefix).  Nothing
is left behind: no process, no /dev/shm name.
"""
from __future__ import annotations

import copy
import io
import multiprocessing as mp
import os
import pickle
import pickletools
import signal
import sys
import threading
import time
import traceback
from multiprocessing.connection import wait
from typing import Any, Callable, Dict, List, Optional, Sequence, TypeVar

from tpcore.utils import cleanup as _cleanup
from tpcore.launch.relay import Console
from tpcore.distributed.comm import CommError, CommTimeout


_T = TypeVar("_T")


class RankExitedError(RuntimeError):
    """A rank process ended without reporting a result (killed, os._exit, crash).

    Attributes
    ----------
    rank : int or None
        The rank that ended.
    exitcode : int or None
        Its exit code (negative: killed by that signal).
    """

    def __init__(self, message: str, rank: Optional[int] = None, exitcode: Optional[int] = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.exitcode = exitcode


class _RelayStream(io.TextIOBase):
    """sys.stdout / sys.stderr of a rank: text up to its last line end ("\n" or "\r")
    goes to the parent, the rest on flush; the parent cuts it into lines (_relay)."""

    def __init__(self, send, rank, name):
        self._send, self._rank, self._name, self._buf = send, rank, name, ""

    fd = None  # what fileno() gives (faulthandler, subprocess): set where the descriptor is relayed too

    def writable(self):
        return True

    def fileno(self):
        if self.fd is None:
            raise io.UnsupportedOperation("fileno")
        return self.fd

    def write(self, s):
        self._buf += s
        cut = max(self._buf.rfind("\n"), self._buf.rfind("\r")) + 1
        if cut:
            head, self._buf = self._buf[:cut], self._buf[cut:]
            self._send(("out", self._rank, self._name, head))
        return len(s)

    def flush(self):
        if self._buf:
            self._send(("out", self._rank, self._name, self._buf))
            self._buf = ""


def _rank_setup(rank, world, job, parent_pid, relay, send):
    """What a rank process does first (tpcore.spawn's ranks and tpcore.Cluster's): die with
    the parent, relay sys.stdout / sys.stderr to it (send), and the job's environment."""
    _cleanup.die_with_parent()
    _cleanup.die_with(parent_pid)  # start method "forkserver": the fork server is the parent
    try:  # the parent may have died before PR_SET_PDEATHSIG took effect
        os.kill(parent_pid, 0)
    except ProcessLookupError:
        os._exit(1)
    if relay:
        sys.stdout = _RelayStream(send, rank, "stdout")
        sys.stderr = _RelayStream(send, rank, "stderr")
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world), "TPCORE_JOB_ID": job,
                       "TPCORE_JOB_RANDOM": "1"})


def _flush_relay(relay):
    if relay:
        sys.stdout.flush()
        sys.stderr.flush()


def _error_message(e, rank, dumps=pickle.dumps):
    """The ("err", ...) message of exception e (being handled) for the parent's _rebuild:
    the exception pickled when it round-trips, its type name, text and this rank's traceback."""
    tb = traceback.format_exc()
    try:
        blob = dumps(e)
        pickle.loads(blob)
    except Exception:  # noqa: BLE001 - an exception that does not pickle round-trip: sent as text
        blob = None
    try:
        text = str(e)
    except Exception:  # noqa: BLE001 - its own __str__ failed: say so rather than lose the rank
        text = f"<str() of the {type(e).__name__} failed>"
    return ("err", rank, blob, type(e).__name__, text, tb)


def _worker(fn, rank, world, job, backend, timeout, args, kwargs, conn, parent_pid, relay):
    lock = threading.Lock()

    def send(msg):
        with lock:
            conn.send(msg)

    _rank_setup(rank, world, job, parent_pid, relay, send)
    from tpcore.distributed.init import init  # late: the child may be a fresh interpreter

    comm = None
    code = 0
    try:
        comm = init(backend=backend, timeout=timeout)
        result = fn(comm, *args, **(kwargs or {}))
        _flush_relay(relay)
        try:
            payload = pickle.dumps(result)
        except Exception as e:
            raise TypeError(f"the return value of rank {rank} cannot be pickled: {e}") from e
        send(("ok", rank, payload))
    except BaseException as e:  # noqa: BLE001 - every failure goes to the parent
        code = 1
        try:
            _flush_relay(relay)
            send(_error_message(e, rank))
        except Exception:  # noqa: BLE001 - parent gone: nothing else to do
            pass
        if comm is not None and not comm.closed:
            comm.abort(f"{type(e).__name__}: {e}")
    finally:
        try:
            if comm is not None:
                comm.close()
        except Exception:  # noqa: BLE001 - best-effort cleanup before os._exit
            pass
        try:
            conn.close()
        except Exception:  # noqa: BLE001 - best-effort cleanup before os._exit
            pass
    os._exit(code)


def _rebuild(rank, blob, tname, text, tb):
    """The rank's exception, with its rank and traceback in the message."""
    msg = f"rank {rank} raised {tname}: {text}\n\n--- traceback on rank {rank} ---\n{tb.rstrip()}"
    exc = None
    if blob is not None:
        try:
            exc = pickle.loads(blob)
        except Exception:  # noqa: BLE001 - an exception that does not unpickle: rebuilt from its text
            exc = None
    if isinstance(exc, BaseException):
        try:
            new = copy.copy(exc)
            new.args = (msg,)
            new.__traceback__ = None
            new.rank = rank
            text_now = str(new)
            if text_now == msg:
                return new
            if f"rank {rank} raised" in text_now:
                # str() quotes the message (KeyError's is the repr of its key): the same type with a
                # plain str, so the message and the rank's traceback read as lines
                return _plain_str(new, msg)
        except Exception:  # noqa: BLE001 - the rebuild is best effort: the fallback below
            pass
        # An exception whose message does not come from args (its own __str__): keep
        # it as it is and attach the rank and its traceback as a note (shown with it).
        exc.rank = rank
        exc.add_note(msg)
        return exc
    return RankExitedError(msg, rank=rank)


def _plain_str(exc: BaseException, msg: str) -> BaseException:
    """exc as an instance of a subclass of its type, named like it, whose str() is msg as is."""
    cls = type(exc)
    plain = type(cls.__name__, (cls,), {"__str__": lambda self: str(self.args[0]) if self.args else "",
                                        "__module__": cls.__module__, "__qualname__": cls.__qualname__})
    out = plain.__new__(plain, msg)
    out.args = (msg,)
    out.__dict__.update(getattr(exc, "__dict__", {}))
    return out


class _Outputs:
    """The parent's side of the ranks' relayed output ("out" messages): a LineRelay with the
    rank prefix per (rank, stream), to this process's sys.stdout / sys.stderr of the moment."""

    def __init__(self):
        self.console = Console()
        self.relays: dict = {}  # (rank, "stdout" | "stderr") -> LineRelay

    def feed(self, msg):
        r = msg[1]
        key = (r, "stdout" if msg[2] == "stdout" else "stderr")
        if key not in self.relays:
            self.relays[key] = self.console.relay(
                (lambda: sys.stdout) if key[1] == "stdout" else (lambda: sys.stderr), f"[rank{r}] ")
        try:
            self.relays[key].feed(msg[3])
        except Exception:  # noqa: BLE001 - a broken sys.stdout must not hide the results
            pass

    def close(self):
        """Write the ranks' unfinished last lines."""
        for relay in self.relays.values():
            try:
                relay.close()
            except Exception:  # noqa: BLE001 - a closed stream must not hide the result
                pass
        self.relays.clear()


def _exit_error(r, p) -> RankExitedError:
    """RankExitedError for rank r, whose process p ended without a word."""
    p.join(1)
    code = p.exitcode
    if code is not None and code < 0:
        how = f"was killed by signal {signal.Signals(-code).name}"
    else:
        how = f"exited with code {code}"
    return RankExitedError(f"rank {r} (pid {p.pid}) {how} without returning or raising", rank=r, exitcode=code)


def _stop(procs, grace):
    for p in procs:
        if p.is_alive():
            try:
                p.terminate()
            except Exception:  # noqa: BLE001 - best-effort stop: the process may be gone
                pass
    t_end = time.monotonic() + grace
    for p in procs:
        p.join(max(0.0, t_end - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)


def _cuda_initialised() -> bool:
    """Whether this process has brought up CUDA (the plugin loaded and a GPU seen): a forked
    child cannot use the parent's CUDA context (every CUDA call in it fails), so ranks must
    then start fresh interpreters, as PyTorch's multiprocessing asks."""
    from tpcore import _C
    from tpcore.utils import cuda as _cuda
    return bool(getattr(_cuda, "_loaded", False)) and "cuda" in (_C.build_info().get("devices") or ())


def _default_method():
    methods = mp.get_all_start_methods()
    if "fork" in methods and not _cuda_initialised():
        return "fork"
    return "spawn"


def _check_importable(fn, method, args=(), kwargs=None):
    """A process started with "spawn" / "forkserver" is a fresh interpreter that gets fn (and
    its arguments) by reference (module and name) and imports it: say so here, once, when it
    cannot (a function of a notebook or an interactive session, a lambda, a nested function),
    rather than let every rank fail to unpickle it and exit without a result."""
    name = getattr(fn, "__qualname__", None) or type(fn).__name__
    main = sys.modules.get("__main__")
    interactive = not getattr(main, "__file__", None)  # a notebook, the REPL, python -c
    why = None
    for what, obj in (("fn", fn), ("an argument", (tuple(args), kwargs))):
        try:
            blob = pickle.dumps(obj, protocol=2)  # protocol 2: each reference is one GLOBAL "module name"
            pickle.loads(blob)
        except Exception as e:  # noqa: BLE001 - any pickling failure is explained below
            if what == "fn" and ("<locals>" in name or "<lambda>" in name):
                why = f"fn {name} is a lambda or a function nested in another function"
            elif what == "fn":
                why = f"fn {name} cannot be pickled by reference ({type(e).__name__}: {e})"
            else:
                why = f"an argument of fn {name} cannot be pickled ({type(e).__name__}: {e})"
            break
        mains = sorted({arg.split(" ", 1)[1] for op, arg, _ in pickletools.genops(blob)
                        if op.name == "GLOBAL" and arg.split(" ", 1)[0] == "__main__"})
        if mains and interactive:
            where = "defined in a notebook or an interactive session (__main__ without a file)"
            if what == "fn" and mains == [name]:
                why = f"fn {name} is {where}"
            else:
                owner = f"fn {name}" if what == "fn" else f"an argument of fn {name}"
                why = f"{owner} uses {', '.join(mains)}, {where}"
            break
    if why:
        raise TypeError(f"spawn: {why}, so a process started with start_method={method!r} cannot import "
                        f"it; define fn at the top level of a module (a .py file the notebook imports), "
                        f"use the default start method (fork), or use tpcore.Cluster, which sends "
                        f"functions by value")


def _start_ranks(ctx, procs, conns, job_args):
    """Start the rank processes, appending each (and the read end of its pipe) to procs and
    conns as it starts, in rank order once all have.  Rank 0 last: the shm backend's rank 0
    creates the job's /dev/shm name, which lives only until every rank has mapped it;
    started last, it finds the others waiting."""
    fn, world_size, job, backend, timeout, args, kwargs, relay_output = job_args
    for r in reversed(range(world_size)):
        rd, wr = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_worker, name=f"tpcore-rank{r}",
                        args=(fn, r, world_size, job, backend, timeout, args, kwargs, wr, os.getpid(), relay_output))
        p.start()
        wr.close()
        procs.append(p)
        conns.append(rd)
    procs.reverse()
    conns.reverse()


def spawn(fn: Callable[..., _T], world_size: int, args: Sequence[Any] = (), kwargs: Optional[Dict[str, Any]] = None,
          backend: str = "shm", timeout: Optional[float] = None, deadline: Optional[float] = None,
          start_method: Optional[str] = None, relay_output: bool = True, grace: float = 3.0) -> List[_T]:
    """Run ``fn(comm, *args, **kwargs)`` on world_size local ranks; return their results.

    Each rank is a process with its own communicator (`tpcore.init` inside it); works
    from scripts, pytest and Jupyter.  What a rank prints is relayed line by line with a
    "[rankN] " prefix (the launcher's style), progress lines drawn with "\\r" included.

    Parameters
    ----------
    fn : callable
        ``fn(comm, *args, **kwargs)``; its return value must pickle.
    world_size : int
        Ranks, >= 1.
    args : sequence, default ()
        Positional arguments after comm (they must pickle with start_method "spawn").
    kwargs : dict, optional
        Keyword arguments.
    backend : str, default "shm"
        The ranks' `init` backend.
    timeout : float, optional
        Seconds any one wait of the communicator may take (> 0).  Default None: the
        TPCORE_TIMEOUT variable, else 300.
    deadline : float, optional
        Seconds the whole run may take; past it the ranks are stopped and `CommTimeout`
        names the ones still running.  Default None: no limit.
    start_method : {"fork", "forkserver", "spawn"}, optional
        Default "fork" on Linux (works with functions defined in a notebook or a test);
        "forkserver" / "spawn" need fn importable.  Once this process has initialised
        CUDA (a GPU layer, `cuda_available` True) the default is "spawn": a forked child
        cannot use the parent's CUDA context.
    relay_output : bool, default True
        Relay the ranks' stdout / stderr through this process with the rank prefix
        (False: the ranks write to the inherited streams, unprefixed).
    grace : float, default 3.0
        Seconds to wait, after a rank failed, for the others to report (their errors say
        how they reacted) before they are stopped: SIGTERM, then SIGKILL after as long
        again.

    Returns
    -------
    list
        fn's return values in rank order.

    Raises
    ------
    TypeError
        fn not callable, args / kwargs of the wrong type, timeout or deadline not a
        number.
    ValueError
        world_size not an int >= 1, timeout or deadline not > 0.
    Exception
        The first rank's exception (the same type), with the rank and its traceback in
        the message; the other ranks are stopped.
    RankExitedError
        A rank died without a result (rank, exit code or signal).
    CommTimeout
        The deadline passed.
    """
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"spawn: world_size must be an int >= 1, got {world_size!r}")
    if not callable(fn):
        raise TypeError(f"spawn: fn must be callable, got {type(fn).__name__}")
    from tpcore.utils.args import real_arg, shown
    if deadline is not None:
        real_arg(deadline, "spawn", "deadline", lo=0, lo_open=True, finite=False)
    if timeout is not None:  # each rank's init() checks it too: refuse it here, once, before any rank starts
        real_arg(timeout, "spawn", "timeout", lo=0, lo_open=True, finite=False)
    if isinstance(args, (str, bytes)) or not hasattr(args, "__iter__") or \
            not (kwargs is None or isinstance(kwargs, dict)):
        raise TypeError(f"spawn: args must be a tuple (or list) and kwargs a dict or None, got {shown(args)} and "
                        f"{shown(kwargs)}")
    method = start_method or _default_method()
    ctx = mp.get_context(method)
    if method != "fork":
        _check_importable(fn, method, args, kwargs)
    job = _cleanup.new_job_id("sp")
    procs, conns = [], []
    results: dict = {}
    errors: list = []  # (time, rank, exception)
    outputs = _Outputs()
    t0 = time.monotonic()
    try:
        _start_ranks(ctx, procs, conns, (fn, world_size, job, backend, timeout, tuple(args), kwargs, relay_output))
        open_conns = {c: r for r, c in enumerate(conns)}
        sentinels = {p.sentinel: r for r, p in enumerate(procs)}
        exited: dict = {}  # rank -> monotonic time its process ended
        first_error_at = None

        def decided(r):
            return r in results or any(e[1] == r for e in errors)

        while not all(decided(r) for r in range(world_size)):
            now = time.monotonic()
            if first_error_at is not None and now - first_error_at > grace:
                break
            if deadline is not None and now - t0 > deadline:
                running = [r for r in range(world_size) if procs[r].is_alive()]
                raise CommTimeout(f"spawn: deadline of {deadline} s passed; ranks {running} were still "
                                  f"running and were stopped")
            waitables = list(open_conns) + [s for s, r in sentinels.items() if r not in exited]
            for obj in wait(waitables, timeout=0.1):
                if obj in sentinels:
                    exited[sentinels[obj]] = time.monotonic()
                    continue
                r = open_conns[obj]
                try:
                    msg = obj.recv()
                except (EOFError, OSError):
                    del open_conns[obj]
                    continue
                if msg[0] == "out":
                    outputs.feed(msg)
                elif msg[0] == "ok":
                    results[r] = pickle.loads(msg[2])
                elif msg[0] == "err":
                    errors.append((time.monotonic(), r, _rebuild(r, *msg[2:])))
                    first_error_at = first_error_at or time.monotonic()
            # A rank whose process ended and whose pipe is drained, with no word: it died.
            for r, t_exit in exited.items():
                if decided(r) or (conns[r] in open_conns and time.monotonic() - t_exit < 1.0):
                    continue
                errors.append((time.monotonic(), r, _exit_error(r, procs[r])))
                first_error_at = first_error_at or time.monotonic()
        if errors:
            raise _pick_error(errors)
        missing = [r for r in range(world_size) if r not in results]
        if missing:
            raise RankExitedError(f"ranks {missing} ended without a result")
        return [results[r] for r in range(world_size)]
    finally:
        outputs.close()
        _stop(procs, grace)
        for c in conns:
            try:
                c.close()
            except Exception:  # noqa: BLE001 - best-effort cleanup
                pass
        _cleanup.remove_shm(job)


def _pick_error(errors):
    """The root cause: the first error that is not a rank's reaction to a
    peer's failure."""
    def secondary(e):
        return (isinstance(e, CommError) and getattr(e, "peer_failure", False)) or (
            isinstance(e, CommError) and "aborted the communicator" in str(e))
    errors.sort(key=lambda t: t[0])
    for _, _, e in errors:
        if not secondary(e):
            return e
    return errors[0][2]
