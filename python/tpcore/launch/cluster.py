"""Ranks that stay alive across notebook cells: tpcore.Cluster(n).

tpcore.spawn starts its ranks for one function and ends them with it; a notebook
wants ranks that keep their models between cells.  A Cluster starts n rank
processes once (each with its communicator, as spawn's ranks: the same environment,
output relay, exception rebuilding and parent-death handling, from spawn.py), then
runs function after function on them.  Functions travel by value (cloudpickle), so
ones defined in a cell after the cluster started work.  Each rank keeps a
namespace between runs (see Cluster).

This module is the parent's side (Cluster, its processes and pipes, closing them at exit);
cluster_rank holds what runs in each rank.
"""
from __future__ import annotations

import atexit
import contextlib
import importlib
import inspect
import multiprocessing as mp
import multiprocessing.connection
import multiprocessing.util
import os
import pickle
import signal
import subprocess
import threading
import time
import warnings
import weakref
from multiprocessing.connection import wait
from typing import Any, Callable, List, Optional

from tpcore.utils import cleanup as _cleanup
from tpcore.distributed.comm import CommTimeout
from tpcore.launch.cluster_rank import _rank_main, _source_of
from tpcore.launch.spawn import RankExitedError, _Outputs, _default_method, _exit_error, _pick_error, _rebuild, _stop

_BACKENDS = ("auto", "shm", "nccl")


# -- the parent side ---------------------------------------------------------------------
@contextlib.contextmanager
def _interrupts_held():
    """A Ctrl-C (SIGINT) that arrives in the block is raised at its end: between starting a
    process and recording it, or while stopping them, a KeyboardInterrupt would leave ranks
    (and the janitor waiting for them) running.  Only the main thread gets signals."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is None:
        yield  # None: a handler not set from Python, which could not be put back
        return
    got: list = []
    try:
        old = signal.signal(signal.SIGINT, lambda signum, frame: got.append(frame))
    except (ValueError, OSError):  # not the main interpreter
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)
        if got:
            if callable(old):
                old(signal.SIGINT, got[0])
            elif old == signal.SIG_DFL:
                raise KeyboardInterrupt


class _Ranks:
    """A cluster's processes and pipes, apart from the Cluster object, so that closing them
    at garbage collection or at exit needs no reference to it."""

    def __init__(self):
        self.procs: list = []
        self.cmds: list = []     # the parent's ends of the command pipes
        self.results: list = []  # the parent's ends of the result pipes
        self.jobs: list = []     # every communicator's job id (one more after each rebuild)
        self.janitor = None      # removes the names if this process dies without closing
        self.closed = False
        self.owner = os.getpid()  # a forked child that exits normally must not stop them

    def close(self, polite=True, grace=2.0):
        """Stop the ranks (asked to, then SIGTERM, SIGKILL) and remove the job's segments."""
        if self.closed or os.getpid() != self.owner:
            return
        self.closed = True
        _live.discard(self)
        with _interrupts_held():  # a second Ctrl-C must not leave ranks behind
            self._close(polite, grace)

    def _close(self, polite, grace):
        try:
            if polite:
                for c in self.cmds:
                    try:
                        c.send(("stop",))
                    except (OSError, ValueError):
                        pass
                t_end = time.monotonic() + grace
                for p in self.procs:
                    p.join(max(0.0, t_end - time.monotonic()))
            _stop(self.procs, grace)
        finally:
            for c in self.cmds + self.results:
                try:
                    c.close()
                except OSError:
                    pass
            for job in self.jobs:
                _cleanup.remove_shm(job)
            if self.janitor is not None:  # it ends once the ranks are gone
                try:
                    self.janitor.wait(5)
                except subprocess.TimeoutExpired:
                    pass


_live: set = set()  # the _Ranks not closed yet, closed at exit


@atexit.register
def _close_all():
    # registered after multiprocessing's exit handler (imported above), so it runs first: that one
    # would wait for our (non-daemon) ranks, which wait for a command
    for ranks in list(_live):
        ranks.close(polite=False, grace=1.0)


def _state_mode(fn, kwargs) -> int:
    """How fn gets the rank's namespace: 0 not at all (no parameter named state, or the caller
    passes state=), 1 as the second positional argument (fn(comm, state, ...)), 2 as state=."""
    if "state" in kwargs:
        return 0
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return 0
    for i, p in enumerate(params):
        if p.name == "state":
            return 1 if i == 1 and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) else 2
    return 0


class Cluster:
    """n local rank processes that stay alive between calls (notebook cells), each with
    its communicator; ``run(fn, ...)`` runs fn on all of them.

    Parameters
    ----------
    n : int
        Number of ranks (>= 1).
    backend : {"auto", "shm", "nccl"}
        The communicator's backend, as for tpcore.init (default "auto").
    timeout : float, optional
        Seconds any one wait of the communicator may take (default: TPCORE_TIMEOUT or 300).
    start_method : str, optional
        "fork" (the default on Linux, unless this process initialised CUDA) or "spawn" /
        "forkserver" (fresh interpreters; a script that starts a cluster this way needs
        the ``if __name__ == "__main__":`` guard, as multiprocessing asks).  Functions are
        sent by value whatever the method.
    grace : float
        After a rank raised, seconds the other ranks get to finish before the
        communicator is aborted (default 1.0); see Notes.
    deadline : float, optional
        Seconds one run() (and the start) may take; past it the cluster is closed and CommTimeout names
        the ranks still running.  None (default): no limit (interrupt the kernel instead).

    Raises
    ------
    ValueError, TypeError
        A bad argument (n < 1, an unknown backend or start method, a negative timeout).
    Exception
        The first rank's exception if a rank's communicator cannot be set up
        (RankExitedError if a rank died).

    Notes
    -----
    **Running functions.** ``cluster.run(fn, *args, **kwargs)`` calls ``fn(comm, *args,
    **kwargs)`` on every rank and returns the list of results in rank order.  fn, its
    arguments and its results travel by value (cloudpickle): a function or class defined
    in a notebook cell after the cluster started works.  Each rank's prints stream into
    the running cell while fn runs, one ``[rankN] `` prefix a line (a ``\\r`` progress
    bar: one line per update in a notebook or a file, one line redrawn in place on a
    terminal), and so does what C code and subprocesses write to file descriptors 1 and 2
    (the communicator's call history after a failure, for one).

    **State between runs.**  Each rank keeps two namespaces for the cluster's life:

    * ``state``: when fn has a parameter named ``state`` (and the caller passes none), it
      receives the rank's ``types.SimpleNamespace`` -- ``state.model = ...`` in one cell,
      ``state.model(x)`` in the next: right after comm when it is fn's second parameter
      (``def f(comm, state, x)`` gets ``f(comm, state, *args)``), else as ``state=``.
    * module-level globals of functions defined in the notebook (or a script's
      ``__main__``): a name a rank function sets (``global model; model = ...`` or
      ``globals()["model"] = ...``) stays on that rank, and later functions see it --
      the rank's value wins over a notebook variable of the same name (a functools.partial
      or a bound method of such a function too).  Functions of
      importable modules use their module's globals as usual.

    **Errors.**  An exception on a rank raises here with the same type where it can be
    rebuilt (else RankExitedError), the rank and its traceback in the message; when
    several ranks fail, the first that did not fail because of a peer.  The cluster stays
    usable.  If other ranks are still running ``grace`` seconds after a rank failed
    (usually waiting in a collective for it), the communicator is aborted, so that they
    fail at once instead of after the timeout, and then rebuilt on every rank: the
    ``comm`` object the functions receive stays the same (and the namespaces stay), but
    layers and sub-communicators built on the aborted communicator are bound to it and
    fail with CommError: build them again (the raised exception carries a note that says
    so).  A communicator that failed by itself (a collective mismatch, a timeout) is
    rebuilt the same way, with the same note (a RuntimeWarning when fn caught the error).
    An error that every rank raises before the next collective (a wrong shape) keeps the
    communicator and the layers.

    A rank process that dies (os._exit, a signal) raises RankExitedError naming it; the
    cluster is then closed (the other ranks' state cannot be kept consistent) and must
    be recreated.  A KeyboardInterrupt (kernel interrupt) during run() stops every rank
    and closes the cluster.

    **Closing.**  ``close()`` (also on leaving a ``with`` block, on garbage collection and
    at exit) stops every rank and removes the job's shared-memory segments; run()
    afterwards raises RuntimeError.  If this process is killed (a kernel restarted by
    force), the ranks die with it and a small janitor process (the launcher's) removes
    the segments.

    Examples
    --------
    >>> cluster = tpcore.Cluster(2)
    >>> cluster.run(lambda comm, state: setattr(state, "x", comm.rank))
    [None, None]
    >>> cluster.run(lambda comm, state: state.x * 10)
    [0, 10]
    >>> cluster.close()
    """

    def __init__(self, n: int, backend: str = "auto", timeout: Optional[float] = None,
                 start_method: Optional[str] = None, grace: float = 1.0, deadline: Optional[float] = None):
        from tpcore.utils.args import real_arg
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"Cluster: n must be an int >= 1, got {n!r}")
        try:  # a dependency of tpcore: said clearly if it is missing
            importlib.import_module("cloudpickle")
        except ImportError:
            raise ImportError("Cluster: sending functions to the ranks needs cloudpickle: "
                              "pip install cloudpickle") from None
        if backend not in _BACKENDS:
            raise ValueError(f"Cluster: backend must be one of {', '.join(map(repr, _BACKENDS))}, got {backend!r}")
        if timeout is not None:
            timeout = real_arg(timeout, "Cluster", "timeout", lo=0, lo_open=True, finite=False)
        if deadline is not None:
            deadline = real_arg(deadline, "Cluster", "deadline", lo=0, lo_open=True, finite=False)
        self._grace = real_arg(grace, "Cluster", "grace", lo=0)
        methods = mp.get_all_start_methods()
        if start_method is not None and start_method not in methods:
            raise ValueError(f"Cluster: start_method must be one of {', '.join(map(repr, methods))}, "
                             f"got {start_method!r}")
        self._n, self._deadline = n, deadline
        self._why_closed = ""
        self._busy = threading.Lock()
        self._backend = None
        self._base = _cleanup.new_job_id("cl")
        h = self._h = _Ranks()
        self._finalizer = weakref.finalize(self, h.close, False, 1.0)
        self._finalizer.atexit = False  # _close_all does it, before multiprocessing's handler
        _live.add(h)
        ctx = mp.get_context(start_method or _default_method())
        h.jobs.append(self._base + "_g0")  # job ids "<base>_g<N>": the janitor removes "<base>_*"
        life = None
        try:
            with _interrupts_held():  # a process started is recorded before a Ctrl-C can lose it
                life_w, h.janitor = _cleanup.start_janitor(self._base)
                life = None if life_w is None else mp.connection.Connection(life_w, readable=False)
                for r in range(n):
                    crd, cwr = ctx.Pipe(duplex=False)
                    rrd, rwr = ctx.Pipe(duplex=False)
                    p = ctx.Process(target=_rank_main, name=f"tpcore-cluster-rank{r}",
                                    args=(r, n, h.jobs[-1], backend, timeout, crd, rwr, os.getpid(), life))
                    p.start()
                    crd.close()
                    rwr.close()
                    h.procs.append(p)
                    h.cmds.append(cwr)
                    h.results.append(rrd)
                if life is not None:  # the ranks hold it now; processes forked later must not
                    life.close()
                    life = None
            self._await_ready("Cluster")
        except BaseException:
            if life is not None:
                life.close()
            self._shut("it failed to start", polite=False)
            raise

    # -- properties -------------------------------------------------------------------
    @property
    def size(self) -> int:
        """The number of ranks."""
        return self._n

    @property
    def backend(self) -> Optional[str]:
        """The backend the ranks' communicator uses ("shm" or "nccl")."""
        return self._backend

    @property
    def closed(self) -> bool:
        """True once the cluster was closed (close(), an interrupt, a dead rank, the
        deadline); run() then raises RuntimeError saying why."""
        return self._h.closed

    @property
    def pids(self) -> List[int]:
        """The ranks' process ids, in rank order."""
        return [p.pid for p in self._h.procs]

    def __repr__(self) -> str:
        if self.closed:
            return f"<tpcore.Cluster of {self._n} ranks, closed>"
        return f"<tpcore.Cluster of {self._n} ranks, backend {self._backend!r}>"

    def __reduce__(self) -> Any:
        # a function that uses the notebook's `cluster` would otherwise fail with "cannot pickle
        # '_thread.lock' object"
        raise TypeError("a tpcore.Cluster cannot be pickled, so it cannot be sent to its ranks: fn or "
                        "its arguments use it (a notebook global?); on the ranks use comm.size / comm.rank")

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, et: Any, ev: Any, tb: Any) -> None:
        self.close()

    # -- running ----------------------------------------------------------------------
    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> List[Any]:
        """``fn(comm, *args, **kwargs)`` on every rank; the list of their results in rank order.

        Parameters
        ----------
        fn : callable
            Called as ``fn(comm, *args, **kwargs)`` on every rank; sent by value
            (cloudpickle).  With a parameter named ``state`` it also gets the rank's
            persistent namespace (see the class Notes).
        *args, **kwargs
            Sent to every rank by value.

        Returns
        -------
        list
            The ranks' return values, in rank order.

        Raises
        ------
        Exception
            A rank's exception (its type where it can be rebuilt, with the rank and its
            traceback); the cluster stays usable.
        RankExitedError
            A rank process died; the cluster is closed.
        CommTimeout
            The cluster's deadline passed; the cluster is closed.
        KeyboardInterrupt
            Interrupted; every rank was stopped and the cluster closed.
        RuntimeError
            The cluster is closed, or another run() is in progress.
        TypeError
            fn is not callable, or fn, its arguments or a result cannot be pickled.
        """
        self._check_open("run")
        if not callable(fn):
            raise TypeError(f"Cluster.run: fn must be callable, got {type(fn).__name__}")
        import cloudpickle
        try:
            blob = cloudpickle.dumps((fn, args, kwargs))
        except Exception as e:
            raise TypeError(f"Cluster.run: fn and its arguments must be picklable (cloudpickle), "
                            f"but: {type(e).__name__}: {e}") from e
        pass_state = _state_mode(fn, kwargs)
        source = _source_of(fn)
        h = self._h
        if not self._busy.acquire(blocking=False):
            raise RuntimeError("Cluster.run: another run() of this cluster is in progress (one at a time)")
        try:
            for c in h.cmds:
                try:
                    c.send(("run", blob, pass_state, source))
                except OSError:  # a dead rank: the wait below names it
                    pass
            return self._collect()
        except KeyboardInterrupt:
            self._shut("run() was interrupted", polite=False)
            raise KeyboardInterrupt("Cluster.run: interrupted; every rank was stopped and the cluster "
                                    "closed: create a new tpcore.Cluster") from None
        finally:
            self._busy.release()

    def close(self) -> None:
        """Stop every rank and remove the job's shared-memory segments (idempotent)."""
        self._shut("close() was called", polite=True)

    # -- internals ----------------------------------------------------------------------
    def _check_open(self, who):
        if self.closed:
            raise RuntimeError(f"Cluster.{who}: this cluster is closed ({self._why_closed}); create a new "
                               f"tpcore.Cluster")

    def _shut(self, why, polite):
        if not self._h.closed:
            self._why_closed = why
        self._finalizer.detach()
        self._h.close(polite=polite)

    def _wait(self, want, who):
        """Messages from the ranks until each rank in `want` answered (ok, err, ready) or died:
        (answers {rank: message}, errors [(time, rank, exception)], dead ranks).  After a rank
        failed, ranks still running `grace` seconds later get the communicator aborted; after a
        rank died, the others are waited for `grace` seconds at most."""
        h = self._h
        outputs = _Outputs()
        pending = set(want)
        answers: dict = {}
        errors: list = []
        dead: list = []
        conns = {c: r for r, c in enumerate(h.results)}
        sentinels = {p.sentinel: r for r, p in enumerate(h.procs)}
        exited: dict = {}
        broken: dict = {}  # rank -> why its communicator is unusable after the run (None: it is fine)
        first_error_at = None
        first_dead_at = None
        aborted = False
        t0 = time.monotonic()
        try:
            while pending:
                if h.closed:  # close() from another thread
                    raise RuntimeError(f"{who}: the cluster was closed while this call ran ({self._why_closed})")
                now = time.monotonic()
                if self._deadline is not None and now - t0 > self._deadline:
                    self._shut(f"a {who} passed the deadline", polite=False)
                    raise CommTimeout(f"{who}: deadline of {self._deadline} s passed; ranks {sorted(pending)} "
                                      f"were still running; the cluster was closed: create a new tpcore.Cluster")
                if first_dead_at is not None and now - first_dead_at > self._grace:
                    break  # the cluster closes: the others need not finish (they may wait for the dead one)
                if first_error_at is not None and not aborted and now - first_error_at > self._grace:
                    aborted = True
                    r0, e0 = errors[0][1], errors[0][2]
                    reason = f"{type(e0).__name__} on rank {r0} (tpcore.Cluster: ranks {sorted(pending)} still ran)"
                    try:
                        h.cmds[r0].send(("abort", reason))
                    except OSError:
                        pass
                waitables = list(conns) + [s for s, r in sentinels.items() if r not in exited]
                try:
                    ready = wait(waitables, timeout=0.1)
                except (OSError, ValueError):  # a pipe closed by close() from another thread
                    if h.closed:
                        continue
                    raise
                for obj in ready:
                    if obj in sentinels:
                        exited[sentinels[obj]] = time.monotonic()
                        continue
                    r = conns[obj]
                    try:
                        msg = obj.recv()
                    except (EOFError, OSError):
                        del conns[obj]
                        continue
                    if msg[0] == "out":
                        outputs.feed(msg)
                    elif msg[0] == "err":
                        errors.append((time.monotonic(), r, _rebuild(r, *msg[2:6])))
                        broken[r] = msg[6]
                        first_error_at = first_error_at or time.monotonic()
                        pending.discard(r)
                    else:  # "ok", "ready"
                        answers[r] = msg
                        if msg[0] == "ok":
                            broken[r] = msg[3]
                        pending.discard(r)
                for r, t_exit in exited.items():
                    # not dead: answered already (a rank whose init failed exits after saying so), or
                    # its pipe may still hold the answer
                    if r in dead or r not in pending or (h.results[r] in conns and time.monotonic() - t_exit < 1.0):
                        continue
                    dead.append(r)
                    pending.discard(r)
                    first_dead_at = first_dead_at or time.monotonic()
        except Exception:
            # the ranks' answers not read yet would be taken for the next call's: out of step for good
            if not h.closed:
                self._shut(f"a {who} failed reading the ranks' answers", polite=False)
            raise
        finally:
            outputs.close()
        return answers, errors, dead, aborted, [w for w in broken.values() if w]

    def _raise_dead(self, dead, who):
        if self._h.closed:  # stopped by close() from another thread, not dead by themselves
            raise RuntimeError(f"{who}: the cluster was closed while this call ran ({self._why_closed})")
        err = _exit_error(dead[0], self._h.procs[dead[0]])
        self._shut(f"rank {dead[0]} died", polite=False)
        others = f" (so did ranks {dead[1:]})" if len(dead) > 1 else ""
        raise RankExitedError(f"{who}: {err}{others}; the cluster was closed, its ranks' state is lost: "
                              f"create a new tpcore.Cluster", rank=err.rank, exitcode=err.exitcode)

    def _await_ready(self, who):
        answers, errors, dead, _, _ = self._wait(range(self._n), who)
        if dead:
            self._raise_dead(dead, who)
        if errors:
            self._shut("its communicator could not be set up", polite=False)
            raise _pick_error(errors)
        self._backend = answers[0][2]

    def _collect(self):
        answers, errors, dead, aborted, broken = self._wait(range(self._n), "Cluster.run")
        if dead:
            self._raise_dead(dead, "Cluster.run")
        exc = _pick_error(errors) if errors else None
        if aborted or broken:
            # the communicator is unusable (aborted because ranks waited for a failed one, or failed by
            # itself: a mismatch, a timeout): a new one on every rank, under the same Comm objects
            h = self._h
            old = h.jobs[-1]
            h.jobs.append(f"{self._base}_g{len(h.jobs)}")
            for c in h.cmds:
                try:
                    c.send(("rebuild", h.jobs[-1]))
                except OSError:  # a rank that raised, then died: the wait below names it
                    pass
            try:
                self._await_ready("Cluster.run (rebuilding the communicator)")
            except BaseException as e:
                raise e from exc
            _cleanup.remove_shm(old)
            why = (f"ranks still waited for the failed rank after {self._grace} s, so the communicator was "
                   f"aborted" if aborted else f"the communicator failed ({broken[0]})")
            note = (f"tpcore.Cluster: {why} and a new one was built; the ranks' `comm` and namespaces are kept, "
                    f"but layers and sub-communicators built before are bound to the old communicator: build "
                    f"them again")
            if exc is None:  # fn caught the communicator's error itself
                warnings.warn(note, RuntimeWarning, stacklevel=3)
            else:
                exc.add_note(note)
        if exc is not None:
            raise exc
        results = []
        for r in range(self._n):
            try:
                results.append(pickle.loads(answers[r][2]))
            except Exception as e:
                raise TypeError(f"Cluster.run: the return value of rank {r} cannot be unpickled here: "
                                f"{type(e).__name__}: {e}") from e
        return results
