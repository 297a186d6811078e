"""tpcore.Store: the rendezvous store of a job (a TCP key-value server, like torchrun's TCPStore).

    store = tpcore.Store("10.0.0.1", 29500, is_server=(node == 0), secret=..., timeout=60)
    store.set("id", b"...");  store.get("id");  store.add("n", 1);  store.wait(["a", "b"])
    store.barrier("ready", 4);  store.delete("id");  store.close()   # or `with tpcore.Store(...)`
    tpcore.Store.from_env()      # in a rank of python -m tpcore.launch --nnodes: the job's store

The process that opens it with is_server=True runs the server (a thread) on host:port:
host is the address it listens on and the clients connect to (loopback, 127.0.0.1, by
default: give the host's own network address to reach it from other hosts).  Every
connection proves that it knows the job's secret (HMAC-SHA256 challenge-response; the
secret never travels), so a store reachable from a network serves only its job.  The
secret: `secret=` (bytes or str, at least 16 bytes), else TPCORE_STORE_SECRET, which
python -m tpcore.launch sets for its ranks.

Limits: a key is a str of 1..512 UTF-8 bytes; a value at most max_value_bytes (1 MiB by
default, 64 MiB at most).  Every call is bounded by `timeout` seconds (CommTimeout names
the key); the server drops a client that sends a malformed or oversized message, fails to
authenticate, or stalls inside a message for io_timeout seconds (default: timeout), and
logs why on stderr, naming the client's address (at most one line a second of each kind,
the rest summed up every 10 s).  A flood of connections that never authenticate does not
lock clients out: the server keeps slots for authenticated clients and drops the oldest
unauthenticated connections, and a client dropped before it authenticated tries again
(backing off) until its timeout (docs/backends.md).
"""
from __future__ import annotations

import os
from typing import Any, Iterable, Optional, Union

from tpcore import _C
from tpcore.utils.args import real_arg

SECRET_VAR = "TPCORE_STORE_SECRET"


def _secret_bytes(secret) -> bytes:
    if secret is None:
        secret = os.environ.get(SECRET_VAR)
        if not secret:
            raise ValueError(f"Store: no secret: pass secret= or set {SECRET_VAR} (the same random value, at "
                             f"least 16 bytes, on every process of the job; python -m tpcore.launch sets it)")
    if isinstance(secret, str):
        secret = secret.encode()
    if not isinstance(secret, (bytes, bytearray, memoryview)):
        raise TypeError(f"Store: secret must be bytes or str, got {type(secret).__name__}")
    return bytes(secret)


class Store:
    """A connection to the job's rendezvous store (is_server=True: also its server).

    A TCP key-value store like torchrun's TCPStore (see the module doc: authentication,
    limits).  Not a collective: any process may call any method at any time.

    Parameters
    ----------
    host : str, default "127.0.0.1"
        The address the server listens on and the clients connect to (give the host's
        network address to reach it from other hosts).
    port : int, default 0
        The TCP port (0 with is_server: any free port, see `port`).
    is_server : bool, default False
        Also run the server (a thread of this process).
    secret : bytes or str, optional
        The job's secret, at least 16 bytes.  Default None: TPCORE_STORE_SECRET.
    timeout : float, default 300.0
        Seconds any call (and connecting) may take, > 0.
    io_timeout : float, optional
        Seconds the server lets a client stall inside a message (default None: timeout).
    max_value_bytes : int, default 0
        The largest value (0: 1 MiB; at most 64 MiB).
    max_clients : int, default 0
        The server's open connections at once (0: 1024); at most half of them (and at most
        512) may be connections that have not authenticated yet.
    quiet : bool, default False
        The server does not log dropped clients on stderr (the log is rate-limited either
        way: one line a second of each kind, summed up every 10 s).

    Raises
    ------
    TypeError
        port not an int, secret not bytes or str.
    ValueError
        host empty, no secret, a secret too short, a timeout not > 0.
    CommError
        The server cannot listen, or the client cannot connect or authenticate.
    CommTimeout
        Connecting took longer than timeout.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, is_server: bool = False,
                 secret: Union[bytes, str, None] = None, timeout: float = 300.0,
                 io_timeout: Optional[float] = None, max_value_bytes: int = 0, max_clients: int = 0,
                 quiet: bool = False) -> None:
        if not isinstance(host, str) or not host:
            raise ValueError(f"Store: host must be a non-empty str, got {host!r}")
        if isinstance(port, bool) or not isinstance(port, int):
            raise TypeError(f"Store: port must be an int, got {type(port).__name__}")
        timeout = real_arg(timeout, "Store", "timeout", lo=0, lo_open=True)
        io = 0.0 if io_timeout is None else real_arg(io_timeout, "Store", "io_timeout", lo=0, lo_open=True)
        self._s = _C.Store(host, port, bool(is_server), _secret_bytes(secret), timeout, io, int(max_value_bytes),
                           int(max_clients), bool(quiet))
        self.host, self.timeout, self.is_server = host, timeout, bool(is_server)

    @classmethod
    def from_env(cls, timeout: float = 300.0, **kw: Any) -> "Store":
        """A client of this job's store, from the environment.

        Reads MASTER_ADDR, MASTER_PORT and TPCORE_STORE_SECRET, as ``python -m
        tpcore.launch --nnodes`` gives its ranks.

        Parameters
        ----------
        timeout : float, default 300.0
            As the constructor's.
        **kw
            Further constructor arguments (io_timeout, max_value_bytes, quiet).

        Returns
        -------
        Store

        Raises
        ------
        ValueError
            MASTER_ADDR / MASTER_PORT unset, or MASTER_PORT not an integer.
        CommError, CommTimeout
            As the constructor.
        """
        addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if not addr or not port:
            raise ValueError("Store.from_env: MASTER_ADDR and MASTER_PORT must be set (python -m tpcore.launch "
                             "--nnodes sets them, with TPCORE_STORE_SECRET)")
        try:
            p = int(port)
        except ValueError:
            raise ValueError(f"Store.from_env: MASTER_PORT must be an integer, got {port!r}") from None
        return cls(addr, p, is_server=False, timeout=timeout, **kw)

    @property
    def port(self) -> int:
        """The server's TCP port (the one chosen when port=0 was asked for)."""
        return self._s.port

    def set(self, key: str, value: Union[bytes, str]) -> None:
        """Set key to value (replacing it).

        Parameters
        ----------
        key : str
            1..512 UTF-8 bytes.
        value : bytes or str
            At most max_value_bytes (a str is stored UTF-8 encoded).

        Raises
        ------
        TypeError, ValueError
            A bad key or value.
        CommError, CommTimeout
            The server is gone, or did not answer within timeout.
        """
        self._s.set(key, value.encode() if isinstance(value, str) else value)

    def get(self, key: str) -> bytes:
        """key's value, waiting until it is set.

        Parameters
        ----------
        key : str
            1..512 UTF-8 bytes.

        Returns
        -------
        bytes

        Raises
        ------
        CommTimeout
            key was not set within timeout (naming it).
        CommError
            The server is gone.
        """
        return self._s.get(key)

    def try_get(self, key: str) -> Optional[bytes]:
        """key's value, or None when it is not set (no waiting).

        Parameters
        ----------
        key : str
            1..512 UTF-8 bytes.

        Returns
        -------
        bytes or None
        """
        return self._s.try_get(key)

    def add(self, key: str, delta: int) -> int:
        """Add delta to the integer counter at key (0 when unset) atomically.

        Parameters
        ----------
        key : str
            1..512 UTF-8 bytes; its value, when set, is a counter.
        delta : int
            A 64-bit integer.

        Returns
        -------
        int
            The counter after the addition.
        """
        return self._s.add(key, delta)

    def wait(self, keys: Union[str, Iterable[str]]) -> None:
        """Wait until every key is set.

        Parameters
        ----------
        keys : str or iterable of str
            One key or several.

        Raises
        ------
        CommTimeout
            Not all were set within timeout (naming the missing ones).
        """
        self._s.wait([keys] if isinstance(keys, str) else list(keys))

    def delete(self, key: str) -> bool:
        """Remove key.

        Parameters
        ----------
        key : str
            1..512 UTF-8 bytes.

        Returns
        -------
        bool
            Whether it was set.
        """
        return self._s.delete(key)

    def barrier(self, name: str, n: int) -> None:
        """Wait until n processes have called barrier(name, n).

        Parameters
        ----------
        name : str
            The barrier's key (one barrier per name).
        n : int
            The number of processes, >= 1.

        Raises
        ------
        CommTimeout
            Not all arrived within timeout.
        """
        self._s.barrier(name, n)

    def close(self) -> None:
        """Close the connection (and stop the server, when this process runs it)."""
        self._s.close()

    @property
    def closed(self) -> bool:
        """Whether `close` was called."""
        return self._s.closed

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"port {self.port}"
        return f"tpcore.Store({self.host!r}, {state}{', server' if self.is_server else ''})"
