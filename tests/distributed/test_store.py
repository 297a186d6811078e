"""tpcore.Store, the TCP rendezvous store: set/get/add/wait/delete/barrier across processes,
timeouts that name the key, the secret, and hostile clients (garbage, oversized and
zero/negative lengths, half messages, floods of silent connections) that are disconnected
while the store keeps serving the well-behaved ones; no fds or threads left by close."""
import hashlib
import hmac
import os
import re
import secrets
import socket
import struct
import subprocess
import sys
import threading
import time

import pytest

import tpcore

SECRET = secrets.token_hex(16)


def server(**kw):
    kw.setdefault("timeout", 5.0)
    kw.setdefault("quiet", True)
    return tpcore.Store("127.0.0.1", 0, is_server=True, secret=SECRET, **kw)


def client(port, **kw):
    kw.setdefault("timeout", 5.0)
    return tpcore.Store("127.0.0.1", port, secret=kw.pop("secret", SECRET), **kw)


def responsive(port, tag):
    """A well-behaved client's round trip works and is quick."""
    t0 = time.monotonic()
    with client(port) as c:
        c.set(f"probe/{tag}", b"v" + tag.encode())
        assert c.get(f"probe/{tag}") == b"v" + tag.encode()
    return time.monotonic() - t0


# ------------------------------------------------------------------ basic operations

def test_operations_and_values():
    with server() as s:
        rng = os.urandom(70000)
        s.set("blob", rng)
        s.set("empty", b"")
        s.set("text", "héllo")
        assert s.get("blob") == rng and s.get("empty") == b"" and s.get("text") == "héllo".encode()
        assert s.try_get("nothing") is None
        assert s.add("n", 7) == 7 and s.add("n", -10) == -3 and s.get("n") == b"-3"
        assert s.add("n", 0) == -3
        s.set("n", b"41")
        assert s.add("n", 1) == 42
        assert s.delete("blob") is True and s.delete("blob") is False and s.try_get("blob") is None
        s.wait(["text", "n"])
        with pytest.raises(tpcore.CommError, match="not a decimal integer"):
            s.add("text", 1)
        with pytest.raises(tpcore.CommError, match="overflows int64"):
            s.add("n", 2**63 - 1)
        assert s.get("n") == b"42"  # the connection survives refused requests


def test_from_env(monkeypatch):
    with server() as s:
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(s.port))
        monkeypatch.setenv("TPCORE_STORE_SECRET", SECRET)
        with tpcore.Store.from_env(timeout=5) as c:
            c.set("k", b"v")
        assert s.get("k") == b"v"
        monkeypatch.setenv("MASTER_PORT", "x")
        with pytest.raises(ValueError, match="MASTER_PORT must be an integer"):
            tpcore.Store.from_env()
        monkeypatch.delenv("MASTER_ADDR")
        with pytest.raises(ValueError, match="MASTER_ADDR and MASTER_PORT must be set"):
            tpcore.Store.from_env()


def test_bad_arguments():
    with pytest.raises(ValueError, match="secret must have 16"):
        tpcore.Store("127.0.0.1", 0, is_server=True, secret="short")
    with pytest.raises(ValueError, match="port must be in 1..65535"):
        tpcore.Store("127.0.0.1", 0, secret=SECRET)
    with pytest.raises(ValueError, match="port must be in"):
        tpcore.Store("127.0.0.1", 70000, is_server=True, secret=SECRET)
    with pytest.raises(ValueError, match="cannot resolve host 'no-such-host.invalid'"):
        tpcore.Store("no-such-host.invalid", 1234, secret=SECRET, timeout=1)
    with pytest.raises(ValueError, match="max_value_bytes .* above the cap"):
        tpcore.Store("127.0.0.1", 0, is_server=True, secret=SECRET, max_value_bytes=1 << 30)
    env = dict(os.environ)
    env.pop("TPCORE_STORE_SECRET", None)
    r = subprocess.run([sys.executable, "-c", "import tpcore; tpcore.Store('127.0.0.1', 0, is_server=True)"],
                       env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "TPCORE_STORE_SECRET" in r.stderr
    with server(max_value_bytes=1000) as s:
        with pytest.raises(ValueError, match="1..512 bytes"):
            s.set("k" * 513, b"x")
        with pytest.raises(ValueError, match="1..512 bytes"):
            s.get("")
        with pytest.raises(ValueError, match="NUL"):
            s.set("a\0b", b"x")
        with pytest.raises(TypeError, match="key must be a str"):
            s.get(b"k")
        with pytest.raises(ValueError, match="1001 bytes is above max_value_bytes"):
            s.set("k", b"x" * 1001)
        with pytest.raises(ValueError, match="n must be >= 1"):
            s.barrier("b", 0)
        with pytest.raises(ValueError, match="1..4096 keys"):
            s.wait([])
        s.set("k", b"x" * 1000)
        assert len(s.get("k")) == 1000
    with pytest.raises(ValueError, match="closed"):
        s.get("k")


# ------------------------------------------------------------------ across processes

WORKER = """
import sys, tpcore
port, rank, n, secret = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
with tpcore.Store("127.0.0.1", port, secret=secret, timeout=20) as s:
    order = s.add("arrivals", 1)
    s.set(f"val/{rank}", f"payload-{rank}-{'x' * rank}")
    s.wait([f"val/{r}" for r in range(n)])
    vals = [s.get(f"val/{r}").decode() for r in range(n)]
    for round in range(3):
        s.add(f"count/{round}", rank + 1)
        s.barrier("step", n)
        # after the barrier every rank's add of this round is in
        total = int(s.get(f"count/{round}"))
        assert total == n * (n + 1) // 2, (round, total)
    print("ok", rank, order, ",".join(vals))
"""


def test_four_processes(tmp_path):
    n = 4
    script = tmp_path / "w.py"
    script.write_text(WORKER)
    with server(timeout=20) as s:
        procs = [subprocess.Popen([sys.executable, str(script), str(s.port), str(r), str(n), SECRET],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(n)]
        try:
            outs = [p.communicate(timeout=60) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        orders = []
        for r, (p, (out, err)) in enumerate(zip(procs, outs)):
            assert p.returncode == 0, err
            ok, rank, order, vals = out.split()
            assert int(rank) == r
            orders.append(int(order))
            assert vals.split(",") == [f"payload-{k}-{'x' * k}" for k in range(n)]
        assert sorted(orders) == [1, 2, 3, 4]  # add is atomic: every rank got its own ticket
        assert s.get("arrivals") == b"4"


def test_get_timeout_names_key_and_timeout():
    with server(timeout=0.6) as s:
        t0 = time.monotonic()
        with pytest.raises(tpcore.CommTimeout) as ei:
            s.get("never/set")
        took = time.monotonic() - t0
        assert 0.5 < took < 3.0
        msg = str(ei.value)
        assert "never/set" in msg and "0.6 s" in msg and f"127.0.0.1:{s.port}" in msg
        with pytest.raises(tpcore.CommTimeout, match=r"wait for 2 keys \('a'"):
            s.wait(["a", "b"])
        s.set("a", b"1")  # reconnects after the abandoned wait
        assert s.get("a") == b"1"


def test_barrier_timeout_says_how_many_arrived():
    with server(timeout=0.5) as s, client(s.port, timeout=0.5) as c:
        c.add("tpcore/barrier/trio/count", 1)  # one other caller arrived
        with pytest.raises(tpcore.CommTimeout, match=r"barrier\('trio'\): timed out after 0.5 s with 2 of 3 arrived"):
            s.barrier("trio", 3)


def test_wrong_secret_refused_and_others_served(capfd):
    with tpcore.Store("127.0.0.1", 0, is_server=True, secret=SECRET, timeout=5) as s:
        with pytest.raises(tpcore.CommError, match="authentication failed") as ei:
            client(s.port, secret="another-secret-of-some-length")
        assert f"127.0.0.1:{s.port}" in str(ei.value)
        s.set("still", b"here")
        with client(s.port) as c:
            assert c.get("still") == b"here"
    err = capfd.readouterr().err
    assert "authentication failed" in err and "client 127.0.0.1:" in err


def test_server_gone_fails_waiting_client_promptly():
    s = server(timeout=30)
    c = client(s.port, timeout=30)
    got = {}

    def waiter():
        try:
            c.get("never")
        except Exception as e:  # noqa: BLE001 - the exception is handed back for the test to check
            got["e"] = e

    t = threading.Thread(target=waiter)
    t.start()
    time.sleep(0.3)
    t0 = time.monotonic()
    s.close()
    t.join(10)
    assert not t.is_alive() and time.monotonic() - t0 < 5
    assert isinstance(got["e"], tpcore.CommError) and "closed the connection" in str(got["e"])
    c.close()


def test_close_from_another_thread_ends_a_blocked_get():
    with server(timeout=30) as s:
        c = client(s.port, timeout=30)
        got = {}

        def waiter():
            try:
                c.get("never")
            except Exception as e:  # noqa: BLE001 - the exception is handed back for the test to check
                got["e"] = e

        t = threading.Thread(target=waiter)
        t.start()
        time.sleep(0.3)
        t0 = time.monotonic()
        c.close()
        t.join(10)
        assert not t.is_alive() and time.monotonic() - t0 < 2
        assert isinstance(got["e"], tpcore.CommError) and "closed" in str(got["e"])
        assert c.closed
        with pytest.raises(ValueError, match="closed"):
            c.get("x")
        assert responsive(s.port, "after") < 1


def test_second_store_on_the_same_port():
    with server() as s:
        with pytest.raises(tpcore.CommError, match=f"port {s.port} on 127.0.0.1 is already in use"):
            tpcore.Store("127.0.0.1", s.port, is_server=True, secret=SECRET, timeout=2)
        assert responsive(s.port, "after") < 2


def test_client_retries_until_the_server_starts():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("c", client(port, timeout=10)))
    t.start()
    time.sleep(0.5)
    with tpcore.Store("127.0.0.1", port, is_server=True, secret=SECRET, timeout=10) as s:
        t.join(10)
        c = box["c"]
        c.set("k", b"v")
        assert s.get("k") == b"v"
        c.close()
    with pytest.raises(tpcore.CommTimeout, match=f"cannot connect within 0.3 s.*127.0.0.1:{port}|127.0.0.1:{port}.*"
                                                 f"cannot connect within 0.3 s"):
        client(port, timeout=0.3)


# ------------------------------------------------------------------ hostile clients

def raw(port):
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    greeting = b""
    while len(greeting) < 40:
        chunk = s.recv(40 - len(greeting))
        assert chunk
        greeting += chunk
    assert greeting[:4] == b"TPCS"
    return s, greeting[8:40]


def authenticate(sock, nonce_s, secret=SECRET):
    nonce_c = os.urandom(32)
    mac = hmac.new(secret.encode(), b"tpcore-store-v1 client" + nonce_s + nonce_c, hashlib.sha256).digest()
    sock.sendall(struct.pack("<QB", 65, 1) + nonce_c + mac)
    hdr = sock.recv(8, socket.MSG_WAITALL)
    (n,) = struct.unpack("<Q", hdr)
    body = sock.recv(n, socket.MSG_WAITALL)
    want = hmac.new(secret.encode(), b"tpcore-store-v1 server" + nonce_c + nonce_s, hashlib.sha256).digest()
    assert body == b"\0" + want  # the server proved it knows the secret too (same HMAC as Python's)


def until_closed(sock, limit):
    """Everything the server sends until it closes, and how long that took."""
    t0 = time.monotonic()
    data = b""
    sock.settimeout(0.2)
    while time.monotonic() - t0 < limit:
        try:
            chunk = sock.recv(65536)
        except socket.timeout:
            continue
        except ConnectionResetError:
            break
        if not chunk:
            break
        data += chunk
    else:
        raise AssertionError(f"the server did not close the connection within {limit} s")
    return data, time.monotonic() - t0


@pytest.mark.parametrize("case", ["garbage", "len2^31", "len2^63", "len-1", "len0", "unknown-op", "hello-bad-size"])
@pytest.mark.parametrize("authed", [False, True])
def test_malformed_messages_disconnect(case, authed):
    payload = {
        "garbage": b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
        "len2^31": struct.pack("<Q", 1 << 31) + b"x" * 100,
        "len2^63": struct.pack("<Q", 1 << 63) + b"x" * 100,
        "len-1": struct.pack("<q", -1) + b"x" * 100,
        "len0": struct.pack("<Q", 0),
        "unknown-op": struct.pack("<QB", 5, 99) + b"abcd",
        "hello-bad-size": struct.pack("<QB", 3, 1) + b"ab",
    }[case]
    with server(io_timeout=2.0) as s:
        sock, nonce = raw(s.port)
        with sock:
            if authed:
                authenticate(sock, nonce)
            sock.sendall(payload)
            data, took = until_closed(sock, 4.0)
        assert took < 3.0
        if case.startswith("len") and case != "len0" or case == "garbage":
            assert b"message length" in data
        assert b"disconnected" in data or case == "garbage" and authed is False
        assert responsive(s.port, case) < 1.0


@pytest.mark.parametrize("size,says", [(4200, b"sent a value of 4200 bytes (the most is 4096)"),
                                       (5000, b"message length of 5004 bytes")])
def test_oversized_value_after_auth(size, says):
    with server(max_value_bytes=4096) as s:
        sock, nonce = raw(s.port)
        with sock:
            authenticate(sock, nonce)
            key = b"k"
            body = struct.pack("<BH", 2, len(key)) + key + b"v" * size
            sock.sendall(struct.pack("<Q", len(body)) + body)
            data, took = until_closed(sock, 4.0)
        assert says in data and took < 3
        assert s.try_get("k") is None


def test_slowloris_is_dropped_and_others_served():
    with server(io_timeout=1.0) as s:
        slow, nonce = raw(s.port)
        half, _ = raw(s.port)
        authed, n2 = raw(s.port)
        with slow, half, authed:
            slow.sendall(struct.pack("<Q", 65) + b"\1" + b"z" * 10)  # half a HELLO, then nothing
            half.sendall(b"\x41\x00\x00")  # part of a length
            authenticate(authed, n2)
            silent = [raw(s.port)[0] for _ in range(80)]  # more than may authenticate at once
            authed.sendall(struct.pack("<QBH", 100, 2, 1) + b"k" + b"x" * 20)  # half a SET
            t0 = time.monotonic()
            # meanwhile well-behaved clients are served at once
            for i in range(5):
                assert responsive(s.port, f"during{i}") < 0.5
            for sock in (slow, half, authed):
                data, took = until_closed(sock, 3.0)
                assert b"disconnected" not in data or b"did not" in data
            assert time.monotonic() - t0 < 3.0
        for sock in silent:
            until_closed(sock, 3.0)
            sock.close()
        assert responsive(s.port, "after") < 0.5


def test_client_that_never_reads_its_reply():
    with server(io_timeout=1.0) as s:
        sock, nonce = raw(s.port)
        with sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            authenticate(sock, nonce)
            s.set("big", os.urandom(1 << 20))
            sock.sendall(struct.pack("<QBBH", 5 + 3, 3, 1, 3) + b"big")  # GET big, never read
            time.sleep(2.5)
            assert responsive(s.port, "reader") < 0.5
            data, _ = until_closed(sock, 3.0)
            assert len(data) < (1 << 20) + 9


# ------------------------------------------------------------------ floods of unauthenticated connections

FLOOD = r"""
import collections, socket, sys, threading, time
port, seconds, hold = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
opened = [0, 0]
started = threading.Event()

def flood(i):  # connect as fast as it can, never authenticate; keep the last `hold` open
    held = collections.deque()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            held.append(socket.create_connection(("127.0.0.1", port), timeout=2))
        except OSError:
            continue
        opened[i] += 1
        if opened[i] == 200:
            started.set()
        if len(held) > hold:
            held.popleft().close()
    for c in held:
        c.close()

threads = [threading.Thread(target=flood, args=(i,)) for i in range(2)]
for t in threads:
    t.start()
started.wait(seconds)
print("flooding", flush=True)
for t in threads:
    t.join()
print(sum(opened), flush=True)
"""


def test_flood_of_unauthenticated_connections(capfd):
    """Two threads (another process) open connections as fast as they can and never
    authenticate, more than the server has slots for, while real clients come and go: every
    client gets through (the server drops the oldest unauthenticated connection only after a
    grace or when the slots are full, and the client tries again when it was dropped), and
    the server's log stays a few lines a second."""
    with server(timeout=60, quiet=False) as s:
        fl = subprocess.Popen([sys.executable, "-c", FLOOD, str(s.port), "6", "1500"], stdout=subprocess.PIPE,
                              text=True)
        try:
            assert fl.stdout.readline().strip() == "flooding"
            t0 = time.monotonic()
            done, failures = [], []

            def clients(i):
                while fl.poll() is None:
                    key, value = f"c/{i}/{len(done)}/{secrets.token_hex(4)}", os.urandom(64)
                    try:
                        with client(s.port, timeout=60) as c:
                            c.set(key, value)
                            assert c.get(key) == value
                        done.append(key)
                    except Exception as e:  # noqa: BLE001 - every failure is reported below
                        failures.append(repr(e))

            threads = [threading.Thread(target=clients, args=(i,)) for i in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            opened = int(fl.communicate(timeout=60)[0].split()[-1])
            took = time.monotonic() - t0
        finally:
            if fl.poll() is None:
                fl.kill()
                fl.wait()
        assert not failures, f"{len(failures)} of {len(failures) + len(done)} clients failed: {failures[:3]}"
        assert len(done) >= 20 and opened > 600, (len(done), opened)  # clients ran, and it was a flood
        assert responsive(s.port, "after") < 5
    lines = capfd.readouterr().err.splitlines()
    dropped = [ln for ln in lines if "dropped before it authenticated" in ln]
    assert dropped, "the flood did not fill the slots: the test tested nothing"
    assert any("unauthenticated connections in the last" in ln and "not logged one by one" in ln for ln in lines)
    assert len(lines) <= 2 * took + 20, f"{len(lines)} log lines in {took:.1f} s: {lines[:5]}"


def test_log_is_rate_limited_and_summarised(capfd):
    """Clients refused in a quick row: a line a second, the others counted in a summary
    (every 10 s, and when the store closes)."""
    n = 40 + secrets.randbelow(20)
    t0 = time.monotonic()
    with server(quiet=False) as s:
        port = s.port
        for _ in range(n):
            sock, _ = raw(s.port)
            with sock:
                sock.sendall(struct.pack("<Q", 1 << 40))
                until_closed(sock, 4.0)
        assert responsive(s.port, "after") < 1
    took = time.monotonic() - t0
    lines = [ln for ln in capfd.readouterr().err.splitlines() if f"127.0.0.1:{port}:" in ln]
    one_by_one = [ln for ln in lines if "sent a message length of 1099511627776" in ln]
    summaries = [re.search(r"disconnected (\d+) clients that sent malformed or oversized messages in the last "
                           r"[\d.]+ s; (\d+) of them not logged one by one", ln) for ln in lines]
    counted = [(int(m[1]), int(m[2])) for m in summaries if m]
    assert 1 <= len(one_by_one) <= took + 2 and len(one_by_one) < n, lines  # at most a line a second
    assert counted and all(total >= quiet for total, quiet in counted), lines
    assert len(one_by_one) + sum(quiet for _, quiet in counted) == n, lines  # each one logged or counted


@pytest.mark.parametrize("server_does", ["close", "greet-then-close", "close-then-exit"])
def test_client_says_the_store_kept_closing(server_does):
    """A store that keeps closing connections before authentication: the client tries again
    until its timeout and then says so (how many tries), not that the process exited; one
    that then goes away (connections refused) is said to have gone."""
    accepted = []
    with socket.socket() as lst:
        lst.bind(("127.0.0.1", 0))
        lst.listen(64)
        lst.settimeout(0.05)
        stop = threading.Event()
        end = time.monotonic() + (0.5 if server_does == "close-then-exit" else 60)

        def serve():
            while not stop.is_set() and time.monotonic() < end:
                try:
                    conn, _ = lst.accept()
                except socket.timeout:
                    continue
                accepted.append(1)
                if server_does == "greet-then-close":
                    conn.sendall(b"TPCS\1\0\0\0" + os.urandom(32))
                    conn.recv(100)
                conn.close()
            lst.close()

        t = threading.Thread(target=serve)
        t.start()
        try:
            t0 = time.monotonic()
            with pytest.raises(tpcore.CommTimeout) as ei:
                client(lst.getsockname()[1], timeout=1.5)
            took = time.monotonic() - t0
        finally:
            stop.set()
            t.join(10)
    msg = str(ei.value)
    m = re.search(r"kept closing the connection before authentication \((\d+) of (\d+) tries in", msg)
    assert m and "flooded" in msg and "(its host process exited" not in msg and 1.4 < took < 6, (msg, took)
    closed, tries = int(m[1]), int(m[2])
    assert closed >= 3 and abs(closed - len(accepted)) <= 1, (msg, len(accepted))  # each reached the server
    if server_does == "close-then-exit":
        assert tries > closed and "then it refused connections: its process has exited?" in msg, msg
        assert "Connection refused" in msg, msg
    else:  # every try but perhaps the last (cut by the deadline) was closed
        assert tries <= closed + 1 and "then it refused" not in msg, msg


def test_unauthenticated_connections_leave_slots_for_clients():
    """max_clients silent connections do not lock the clients out: at most half the slots
    are for connections that have not authenticated."""
    with server(max_clients=8, io_timeout=30) as s:
        silent = [socket.create_connection(("127.0.0.1", s.port), timeout=5) for _ in range(8 + secrets.randbelow(8))]
        try:
            assert responsive(s.port, "through") < 3
            with client(s.port) as a, client(s.port) as b:
                a.set("a", b"1")
                assert b.get("a") == b"1"
        finally:
            for sock in silent:
                sock.close()


# ------------------------------------------------------------------ no leaks

def fds():
    return len(os.listdir("/proc/self/fd"))


def tasks():
    return len(os.listdir("/proc/self/task"))


def test_close_leaks_no_fds_or_threads():
    with server() as warm:  # anything loaded once (resolver, etc.) is loaded now
        client(warm.port).close()
    f0, t0 = fds(), tasks()
    for _ in range(3):
        s = server()
        cs = [client(s.port) for _ in range(3)]
        for i, c in enumerate(cs):
            c.set(f"k{i}", b"v")
        s.barrier("all", 1)
        sock, _ = raw(s.port)  # a hostile one open at close time
        for c in cs:
            c.close()
        assert tasks() == t0 + 1  # the server thread
        s.close()
        sock.close()
    assert fds() == f0 and tasks() == t0


# ------------------------------------------------------------------ the C API, under sanitizers

@pytest.mark.parametrize("sanitize", [False, pytest.param(True, marks=[pytest.mark.slow, pytest.mark.sanitized])])
def test_c_store_program(tmp_path, sanitize):
    """csrc/tests/test_store.c against csrc/comm/store/*.c alone (no Python), plain and under
    ASan + UBSan (leaks included): compiled directly, so it takes seconds."""
    import shutil
    from c_binaries import ROOT, run
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    exe = tmp_path / "test_store"
    flags = ["-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=address,undefined",
             "-fno-sanitize-recover=undefined"] if sanitize else ["-O2"]
    srcs = [ROOT / "csrc/tests/test_store.c", *sorted((ROOT / "csrc/comm/store").glob("*.c")),
            ROOT / "csrc/core/status.c"]
    r = subprocess.run([cc, "-std=c11", "-Wall", "-Wextra", "-Werror", "-Wno-unused-parameter", "-D_GNU_SOURCE",
                        f"-I{ROOT / 'csrc/include'}", *flags, *map(str, srcs), "-o", str(exe), "-lpthread"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    r = run(exe, timeout=120)
    assert r.returncode == 0 and "8 passed, 0 failed" in r.stdout, r.stdout + r.stderr
