"""The rank side of tpcore.Cluster: the loop each rank process runs (init its communicator,
then run the functions the parent sends until "stop"), the globals a rank keeps between
runs, the source lines of a notebook cell sent with its function, and the relay of writes to
file descriptors 1 and 2 to the parent.

Messages, parent to rank on the command pipe: ("run", cloudpickled (fn, args, kwargs), state
mode, source), ("abort", why), ("rebuild", job id), ("stop",).  Rank to parent on the result
pipe: ("ready", rank, backend), ("ok", rank, cloudpickled result, communicator failure or
None), ("out", rank, stream, text), and for a failure spawn's ("err", rank, ...) message with the
communicator's failure appended.
"""
from __future__ import annotations

import codecs
import fcntl
import functools
import linecache
import os
import secrets
import signal
import sys
import threading
import types

from tpcore.launch.spawn import _error_message, _flush_relay, _rank_setup


# -- the rank side ---------------------------------------------------------------------
def _function_of(fn):
    """The plain function under a functools.partial or a bound method (what has the globals
    and the code), else fn."""
    for _ in range(100):
        if isinstance(fn, functools.partial):
            fn = fn.func
        elif isinstance(fn, types.MethodType):
            fn = fn.__func__
        else:
            break
    return fn


class _Globals:
    """The module-level globals of the functions a rank ran, kept between runs.

    A function sent by value (defined in a notebook or a script's __main__) arrives with a
    fresh globals dict holding the parent's values of the names it uses.  Names the rank's
    functions set there (``global model; model = ...``, ``globals()["x"] = ...``) are the
    rank's own: they are put into every later function's globals, over the parent's value
    of the same name.  Functions of importable modules keep their module's globals."""

    def __init__(self):
        self.own: dict = {}

    def enter(self, fn):
        fn = _function_of(fn)
        g = getattr(fn, "__globals__", None)
        mod = sys.modules.get(getattr(fn, "__module__", None) or "")
        if not isinstance(g, dict) or g is getattr(mod, "__dict__", None):
            return None
        shipped = dict(g)
        g.update(self.own)
        return g, shipped

    def leave(self, entered):
        if entered is None:
            return
        g, shipped = entered
        for k, v in g.items():
            if k.startswith("__") and k.endswith("__"):
                continue
            if k in self.own or k not in shipped or v is not shipped[k]:
                self.own[k] = v
        for k in [k for k in self.own if k not in g]:  # `del` of a global
            del self.own[k]


def _source_of(fn):
    """fn's file name and its lines as this process's linecache has them (a notebook cell's too):
    cloudpickle sends code as "<dynamic-code>", and the rank's traceback should name and show
    the cell's lines."""
    code = getattr(_function_of(fn), "__code__", None)
    if code is None:
        return None
    if os.path.exists(code.co_filename):  # a file: the rank reads it itself
        return code.co_filename, []
    try:
        return code.co_filename, linecache.getlines(code.co_filename)
    except Exception:  # noqa: BLE001 - no source lines: the file name alone
        return code.co_filename, []


def _named(code, filename):
    consts = tuple(_named(c, filename) if isinstance(c, types.CodeType) else c for c in code.co_consts)
    return code.replace(co_filename=filename, co_consts=consts)


def _restore_source(fn, source):
    fn = _function_of(fn)
    code = getattr(fn, "__code__", None)
    if source is None or code is None or code.co_filename != "<dynamic-code>":
        return
    filename, lines = source
    try:
        fn.__code__ = _named(code, filename)
    except (TypeError, ValueError):
        return
    if lines and filename not in linecache.cache:
        linecache.cache[filename] = (sum(map(len, lines)), None, lines, filename)


_PIPE_SIZE = 1 << 20  # Linux's default pipe-max-size


class _FdRelay:
    """Writes to file descriptor 1 or 2 of a rank that bypass sys.stdout / sys.stderr (C code:
    the communicator's history on a failure; subprocesses; os.write) go to the parent as "out"
    messages too, so they get the rank prefix in the cell: a pipe in place of the descriptor,
    read by a thread.  sync() returns once everything written before it was sent.  The thread
    needs the GIL: C code that holds it while writing more than the pipe holds (1 MiB) blocks
    for good."""

    def __init__(self, fd, name, rank, send):
        self.fd, self.name, self.rank, self.send = fd, name, rank, send
        self.marker = b"\0tpcore-sync-" + secrets.token_hex(6).encode() + b"\0"
        r, w = os.pipe()
        try:  # C code that writes while holding the GIL blocks the pump: it must not fill the pipe
            fcntl.fcntl(w, getattr(fcntl, "F_SETPIPE_SZ", 1031), _PIPE_SIZE)
        except OSError:  # above /proc/sys/fs/pipe-max-size (or not Linux): the default, 64 KiB
            pass
        os.dup2(w, fd)
        os.close(w)
        self.r = r
        self.cv = threading.Condition()
        self.asked = self.seen = 0  # markers written / markers the pump got to, in order
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")
        threading.Thread(target=self._pump, name=f"tpcore-fd{fd}", daemon=True).start()

    def _pump(self):
        buf = b""
        m = self.marker
        while True:
            try:
                data = os.read(self.r, 65536)
            except InterruptedError:
                continue
            except OSError:
                return
            if not data:
                return
            buf += data
            while (i := buf.find(m)) >= 0:
                self._out(buf[:i])
                buf = buf[i + len(m):]
                with self.cv:
                    self.seen += 1
                    self.cv.notify_all()
            keep = next((j for j in range(min(len(m) - 1, len(buf)), 0, -1) if m.startswith(buf[-j:])), 0)
            self._out(buf[:len(buf) - keep])  # all but a marker's start cut between two reads
            buf = buf[len(buf) - keep:]

    def _out(self, data):
        text = self.decoder.decode(data) if data else ""
        if text:
            try:
                self.send(("out", self.rank, self.name, text))
            except OSError:
                pass

    def sync(self, timeout=2.0):
        # counted, not a semaphore: the marker of a sync that timed out, seen later, must not
        # let the next sync return before its own output was sent
        try:
            os.write(self.fd, self.marker)
        except OSError:
            return
        self.asked += 1
        want = self.asked
        with self.cv:
            self.cv.wait_for(lambda: self.seen >= want, timeout)


def _rank_main(rank, world, job, backend, timeout, cmd, res, parent_pid, life):
    """A Cluster's rank: init the communicator, then run what the parent sends until "stop".
    life: the janitor's pipe, held open (never written) while the rank lives."""
    lock = threading.Lock()

    def send(msg):
        with lock:
            res.send(msg)

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's: it stops the ranks
    _rank_setup(rank, world, job, parent_pid, True, send)
    fds = []
    for fd, name in ((1, "stdout"), (2, "stderr")):
        try:
            fds.append(_FdRelay(fd, name, rank, send))
            getattr(sys, name).fd = fd  # sys.stdout.fileno() works (faulthandler.enable(), subprocesses)
        except OSError:
            pass

    def flush():  # everything this rank wrote, sent before its answer
        _flush_relay(True)
        for f in fds:
            f.sync()

    import cloudpickle

    from tpcore.distributed.init import init

    def failed():  # why the communicator is unusable (a mismatch, a timeout, an abort, closed), or None
        try:
            return "closed" if comm.closed else comm._c.error
        except Exception:  # noqa: BLE001 - the state is only reported
            return "unknown"

    def fail(e):
        flush()
        send(_error_message(e, rank, cloudpickle.dumps) + (failed(),))

    comm = None
    try:
        comm = init(backend=backend, timeout=timeout)
        flush()
        send(("ready", rank, comm.backend))
    except BaseException as e:  # noqa: BLE001 - every failure goes to the parent
        fail(e)
        os._exit(1)
    state = types.SimpleNamespace()
    glob = _Globals()
    while True:
        try:
            msg = cmd.recv()
        except (EOFError, OSError):
            break
        if msg[0] == "stop":
            break
        if msg[0] == "abort":
            try:
                if not comm.closed:
                    comm.abort(msg[1])
            except Exception:  # noqa: BLE001 - failed already: the peers fail anyway
                pass
            continue
        if msg[0] == "rebuild":  # the same Comm object, a new communicator under it
            try:
                comm.close()
                os.environ["TPCORE_JOB_ID"] = msg[1]
                comm._c = init(backend=backend, timeout=timeout)._c
                flush()
                send(("ready", rank, comm.backend))
            except BaseException as e:  # noqa: BLE001 - every failure goes to the parent
                fail(e)
            continue
        entered = fn = args = kwargs = result = None
        try:  # "run"
            fn, args, kwargs = cloudpickle.loads(msg[1])
            _restore_source(fn, msg[3])
            if msg[2] == 1:
                args = (state,) + tuple(args)
            elif msg[2] == 2:
                kwargs = dict(kwargs, state=state)
            entered = glob.enter(fn)
            result = fn(comm, *args, **kwargs)
            flush()
            try:
                payload = cloudpickle.dumps(result)
            except Exception as e:
                raise TypeError(f"the return value of rank {rank} cannot be pickled: {e}") from e
            send(("ok", rank, payload, failed()))
        except BaseException as e:  # noqa: BLE001 - every failure goes to the parent
            fail(e)
        finally:
            glob.leave(entered)
            entered = fn = args = kwargs = result = msg = None  # nothing of this run is kept alive
    try:
        comm.close()
    finally:
        os._exit(0)
