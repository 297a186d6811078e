"""The launcher's part in a job that spans hosts (python -m tpcore.launch --nnodes N ...).

Node 0's launcher hosts the job's rendezvous store (tpcore.Store) on
MASTER_ADDR:MASTER_PORT; every launcher (node 0's too) connects to it and:

  join     claims its node rank (a rank claimed twice stops the job on both
           launchers that claimed it), posts what it runs (nnodes, ranks per node,
           the script and its arguments, its host), and waits for node 0's verdict:
           node 0 compares every node's post with its own and either publishes the
           job (its id and world size) or the reason the nodes disagree, which
           every launcher then prints and exits with;
  poll     while the ranks run, every ~0.1 s: another node's failure ("launch/failed",
           which stops this node's ranks), a lost store (node 0's launcher gone),
           and a heartbeat (node 0 declares a node whose launcher stopped beating
           for --heartbeat-timeout seconds failed);
  finish   once its ranks are done: node 0 keeps the store up until every node is
           done (or one failed); the others report and leave.

The secret that authenticates the launchers and ranks with the store
(TPCORE_STORE_SECRET, given to the ranks): the one in the environment when set (the
secure way across hosts: the same random value on every node, e.g. from the job
scheduler), else node 0 generates one and writes it to a file only this user can read
(secret_path()), which launchers of the other nodes read when they run on the same
host or share that directory; otherwise they stop with an error that says to set it.
"""
from __future__ import annotations

import json
import os
import secrets
import socket
import tempfile
import time
from typing import Optional

from tpcore.distributed.store import SECRET_VAR, Store
from tpcore.utils import cleanup as _cleanup

PREFIX = "launch/"


class MultinodeError(RuntimeError):
    """The launchers could not form the job (the message says why)."""


def secret_path(addr: str, port: int) -> str:
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    safe = "".join(ch if ch.isalnum() or ch in ".-" else "_" for ch in addr)
    return os.path.join(base, f"tpcore-{os.geteuid()}", f"store-{safe}-{port}.secret")


def _private_dir(path: str) -> None:
    d = os.path.dirname(path)
    os.makedirs(d, mode=0o700, exist_ok=True)
    st = os.lstat(d)
    if st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise MultinodeError(f"{d} must be a directory of this user that only it can read (mode 0700)")


def _write_secret(path: str, secret: str) -> None:
    tmp = f"{path}.{os.getpid()}"
    for attempt in range(3):  # another launcher's close may remove the empty directory meanwhile
        _private_dir(path)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            break
        except FileNotFoundError:
            if attempt == 2:
                raise
    with os.fdopen(fd, "w") as f:
        f.write(secret)
    os.replace(tmp, path)


def _read_secret(path: str) -> Optional[str]:
    try:
        st = os.lstat(path)
        if st.st_uid != os.geteuid() or st.st_mode & 0o077:
            return None
        with open(path) as f:
            return f.read().strip() or None
    except OSError:
        return None


class Multinode:
    def __init__(self, nnodes: int, node_rank: int, nproc: int, addr: str, port: int, job_args: list,
                 timeout: float, heartbeat_timeout: float, log):
        self.nnodes, self.node, self.nproc = nnodes, node_rank, nproc
        self.addr, self.port, self.job_args = addr, port, list(job_args)
        self.timeout, self.heartbeat_timeout, self.log = timeout, heartbeat_timeout, log
        self.store: Optional[Store] = None    # joins and finishes (the join timeout)
        self.monitor: Optional[Store] = None  # polls while the ranks run (short timeout)
        self.secret = None
        self.secret_file = None
        self.job_id = None
        self.env: dict = {}
        self._next_poll = 0.0
        self._beats: dict = {}  # node 0: node -> (last beat count, when it changed)
        self._beat = 0
        self._last_beat = 0.0

    # ------------------------------------------------------------------ join

    def _connect(self) -> None:
        given = os.environ.get(SECRET_VAR)
        deadline = time.monotonic() + self.timeout
        if self.node == 0:
            self.secret = given or secrets.token_hex(32)
            self.store = Store(self.addr, self.port, is_server=True, secret=self.secret, timeout=self.timeout)
            if not given:
                self.secret_file = secret_path(self.addr, self.port)
                _write_secret(self.secret_file, self.secret)
            return
        path = secret_path(self.addr, self.port)
        last = None
        while True:
            secret = given or _read_secret(path)
            left = deadline - time.monotonic()
            if secret and secret != last:
                last = secret
                try:
                    self.store = Store(self.addr, self.port, secret=secret, timeout=max(left, 0.5))
                    self.secret = secret
                    return
                except Exception as e:  # noqa: BLE001 - a stale secret file: node 0 rewrites it
                    if given or "secret" not in str(e) or left <= 0:
                        raise MultinodeError(f"node {self.node}: cannot join the store at {self.addr}:{self.port}: "
                                             f"{e}") from None
            if left <= 0:
                raise MultinodeError(
                    f"node {self.node}: no store secret: set {SECRET_VAR} to the same random value on every "
                    f"node (node 0's launcher writes a generated one to {path}, readable only on its host, and "
                    f"none appeared there within {self.timeout:g} s)")
            time.sleep(0.1)

    def _abort(self, msg: str) -> None:
        try:
            self.store.set(PREFIX + "abort", msg)
        except Exception:  # noqa: BLE001 - the message is raised here anyway
            pass
        raise MultinodeError(msg)

    def _post(self) -> dict:
        return {"nnodes": self.nnodes, "nproc": self.nproc, "args": self.job_args, "host": socket.gethostname(),
                "pid": os.getpid()}

    def _verdict(self, posts: dict) -> dict:
        mine = posts[0]
        for k in range(1, self.nnodes):
            p = posts[k]
            where = f"node {k} (host {p['host']}, pid {p['pid']})"
            if p["nnodes"] != mine["nnodes"]:
                return {"error": f"{where} has --nnodes {p['nnodes']} but node 0 has {mine['nnodes']}"}
            if p["nproc"] != mine["nproc"]:
                return {"error": f"{where} starts -n {p['nproc']} ranks but node 0 starts {mine['nproc']} "
                                 f"(every node must start the same number)"}
            if p["args"] != mine["args"]:
                return {"error": f"{where} runs {' '.join(p['args'])!r} but node 0 runs "
                                 f"{' '.join(mine['args'])!r} (a different job on the same MASTER_ADDR:MASTER_PORT?)"}
        return {"job": _cleanup.new_job_id("ln"), "world": self.nnodes * self.nproc, "nnodes": self.nnodes,
                "nproc": self.nproc, "args": self.job_args}

    def join(self) -> dict:
        """Forms the job with the other launchers; the variables of this node's ranks."""
        self._connect()
        try:
            return self._join()
        except MultinodeError:
            if self.node == 0:
                self._linger_abort()
            raise

    def _linger_abort(self, limit: float = 5.0) -> None:
        """Node 0 after the job was refused: keeps the store up until every other node that
        joined has read why (at most `limit` s)."""
        end = time.monotonic() + limit
        while time.monotonic() < end:
            try:
                # every launcher that claimed a node rank (two for a rank claimed twice) acknowledges
                joined = sum(int(self.store.try_get(f"{PREFIX}claim/{k}") or 0) for k in range(1, self.nnodes))
                seen = int(self.store.try_get(PREFIX + "abort_seen") or 0)
            except Exception:  # noqa: BLE001 - the store is gone: nothing left to wait for
                return
            if seen >= joined:
                return
            time.sleep(0.05)

    def _join(self) -> dict:
        s = self.store
        me = f"node {self.node} (host {socket.gethostname()}, pid {os.getpid()})"
        n = s.add(f"{PREFIX}claim/{self.node}", 1)
        if n > 1:
            first = s.try_get(f"{PREFIX}node/{self.node}")
            other = json.loads(first) if first else None
            who = f"host {other['host']}, pid {other['pid']}" if other else "another launcher"
            if self.node != 0:
                s.add(PREFIX + "abort_seen", 1)  # this one knows why
            self._abort(f"node rank {self.node} was given to two launchers ({who}, and {me}): each node needs "
                        f"its own --node-rank in 0..{self.nnodes - 1}")
        s.set(f"{PREFIX}node/{self.node}", json.dumps(self._post()))
        deadline = time.monotonic() + self.timeout
        while True:
            bad = s.try_get(PREFIX + "abort")
            if bad is not None:
                if self.node != 0:
                    s.add(PREFIX + "abort_seen", 1)
                raise MultinodeError(bad.decode())
            if self.node == 0:
                posts = {k: s.try_get(f"{PREFIX}node/{k}") for k in range(self.nnodes)}
                missing = [k for k, v in posts.items() if v is None]
                if not missing:
                    v = self._verdict({k: json.loads(p) for k, p in posts.items()})
                    if "error" in v:
                        self._abort(v["error"])
                    s.set(PREFIX + "verdict", json.dumps(v))
                    break
            else:
                if s.try_get(PREFIX + "verdict") is not None:
                    break
                missing = [0]
            if time.monotonic() > deadline:
                raise MultinodeError(f"{me}: timed out after {self.timeout:g} s waiting for node"
                                     f"{'s' if len(missing) > 1 else ''} {missing} to join at "
                                     f"{self.addr}:{self.port}")
            time.sleep(0.05)
        v = json.loads(s.get(PREFIX + "verdict"))
        if (v["nnodes"], v["nproc"], v["args"]) != (self.nnodes, self.nproc, self.job_args):
            # a launcher that arrives after the job was formed (another job on this port)
            raise MultinodeError(f"{me}: the job at {self.addr}:{self.port} was formed without this node: it runs "
                                 f"{v['nnodes']} nodes x {v['nproc']} ranks of {' '.join(v['args'])!r}, this "
                                 f"launcher {self.nnodes} x {self.nproc} of {' '.join(self.job_args)!r}")
        self.job_id = v["job"]
        self.monitor = Store(self.addr, self.port, secret=self.secret, timeout=min(self.timeout, 10.0))
        self.env = {"MASTER_ADDR": self.addr, "MASTER_PORT": str(self.port), "TPCORE_JOB_ID": self.job_id,
                    "TPCORE_NNODES": str(self.nnodes), "TPCORE_NODE_RANK": str(self.node),
                    "WORLD_SIZE": str(v["world"]), "LOCAL_WORLD_SIZE": str(self.nproc), SECRET_VAR: self.secret}
        now = time.monotonic()
        self._beats = {k: (-1, now) for k in range(1, self.nnodes)}
        return self.env

    @property
    def rank0(self) -> int:
        return self.node * self.nproc

    # ------------------------------------------------------------------ while the ranks run

    def _failure_news(self) -> Optional[tuple]:
        raw = self.monitor.try_get(PREFIX + "failed")
        if raw is None:
            return None
        f = json.loads(raw)
        if self.node != 0:
            self.monitor.add(PREFIX + "seen_failed", 1)
        return f["msg"], int(f["code"])

    def poll(self, force: bool = False) -> Optional[tuple]:
        """(message, exit code) when the job failed elsewhere (or the store is gone), else None."""
        now = time.monotonic()
        if not force and now < self._next_poll:
            return None
        self._next_poll = now + 0.1
        try:
            news = self._failure_news()
            if news:
                return news
            if now - self._last_beat >= 1.0:
                self._last_beat = now
                self._beat = self.monitor.add(f"{PREFIX}beat/{self.node}", 1)
            if self.node == 0:
                return self._check_beats(now)
        except Exception as e:  # noqa: BLE001 - the store is unreachable: node 0's launcher is gone
            return (f"lost the job's store at {self.addr}:{self.port} ({e}); node 0's launcher has exited or its "
                    f"host is unreachable", 1)
        return None

    def _check_beats(self, now) -> Optional[tuple]:
        for k, (last, since) in list(self._beats.items()):
            if self.monitor.try_get(f"{PREFIX}done/{k}") is not None:
                continue
            raw = self.monitor.try_get(f"{PREFIX}beat/{k}")
            count = int(raw) if raw else 0
            if count != last:
                self._beats[k] = (count, now)
            elif now - since > self.heartbeat_timeout:
                msg = (f"node {k}'s launcher stopped answering (no heartbeat for {self.heartbeat_timeout:g} s: "
                       f"its host or launcher died)")
                self.report(msg, 1)
                return msg, 1
        return None

    def report(self, msg: str, code: int) -> None:
        """Tells the other launchers that this node's job failed (the first report wins)."""
        try:
            if self.monitor.add(PREFIX + "failed_count", 1) == 1:
                self.monitor.set(PREFIX + "failed", json.dumps({"msg": f"node {self.node}: {msg}", "code": code}))
            if self.node != 0:
                self.monitor.add(PREFIX + "seen_failed", 1)
        except Exception:  # noqa: BLE001 - the store is gone: the others see that themselves
            pass

    def finish(self, grace: float) -> Optional[tuple]:
        """This node's ranks are done (all exited 0, or failed and reported).  Node 0 keeps
        the store up until every node is done or has seen a failure; (message, code) when
        another node failed meanwhile."""
        try:
            self.monitor.set(f"{PREFIX}done/{self.node}", b"1")
        except Exception as e:  # noqa: BLE001 - any store failure is the lost store, reported
            return (f"lost the job's store at {self.addr}:{self.port} ({e})", 1)
        if self.node != 0:
            return None
        while True:
            news = self.poll(force=True)
            if news:
                return news
            done = sum(self.monitor.try_get(f"{PREFIX}done/{k}") is not None for k in range(self.nnodes))
            if done == self.nnodes:
                return None
            time.sleep(0.1)

    def linger(self, grace: float) -> None:
        """Node 0 after a failure: keeps the store up until every other node has seen it (at
        most grace + 5 s), so that they stop with the failure's message."""
        if self.node != 0 or self.monitor is None:
            return
        end = time.monotonic() + grace + 5.0
        while time.monotonic() < end:
            try:
                seen = int(self.monitor.try_get(PREFIX + "seen_failed") or 0)
                done = sum(self.monitor.try_get(f"{PREFIX}done/{k}") is not None for k in range(1, self.nnodes))
            except Exception:  # noqa: BLE001 - the store is gone: nothing left to wait for
                return
            if seen + done >= self.nnodes - 1:
                return
            time.sleep(0.05)

    def close(self) -> None:
        for s in (self.monitor, self.store):
            if s is not None:
                try:
                    s.close()
                except Exception:  # noqa: BLE001 - best-effort cleanup
                    pass
        if self.secret_file:
            for remove, what in ((os.unlink, self.secret_file), (os.rmdir, os.path.dirname(self.secret_file))):
                try:
                    remove(what)  # the directory only when no other job's secret is in it
                except OSError:
                    pass
