"""Simulated hosts for tests: Linux network namespaces joined by a veth pair.

    from netns import hosts_or_skip
    with hosts_or_skip(2) as net:              # pytest.skip(reason) where it cannot be done
        net.addr[0], net.addr[1]               # "10.231.0.1", "10.231.0.2"
        subprocess.run(net.cmd(1, [sys.executable, "-c", "..."]))   # runs "inside host 1"

Each host is a namespace of its own with a loopback and one veth end; the ends are joined
through a bridge in an extra namespace when there are more than two hosts.  Addresses
are 10.231.0.<i+1>/24 and exist only inside the namespaces this module creates (nothing
is added to the caller's namespace: the veth pairs are created inside them).  Names are
unique per call (pid + random), and every namespace is deleted on the way out, also when
the body raises; processes started in a namespace must be ended by the test before that
(a namespace with a live process lingers until it exits).

Needs root and iproute2 (`ip netns`); `available()` says why not.  An rsh agent for
mpirun across them: `net.rsh_agent(path)` writes a script that runs
`ip netns exec <namespace of host> <command>` for the host names net.hostnames.
"""
from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import subprocess
from typing import List

SUBNET = "10.231.0"


def _ip(*args, check=True):
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed ({r.returncode}): {r.stderr.strip()}")
    return r


def available() -> tuple:
    """(True, "") when namespaces can be made here, else (False, the reason)."""
    if os.geteuid() != 0:
        return False, "network namespaces need root (not running as root)"
    if shutil.which("ip") is None:
        return False, "iproute2's `ip` is not installed"
    probe = f"tpprobe{os.getpid()}{secrets.token_hex(3)}"
    r = _ip("netns", "add", probe, check=False)
    if r.returncode != 0:
        return False, f"`ip netns add` fails here: {r.stderr.strip() or r.returncode}"
    try:
        r = _ip("-n", probe, "link", "add", "tpa0", "type", "veth", "peer", "name", "tpb0", check=False)
        if r.returncode != 0:
            return False, f"cannot create a veth pair in a namespace: {r.stderr.strip() or r.returncode}"
    finally:
        _ip("netns", "del", probe, check=False)
    return True, ""


class Hosts:
    def __init__(self, n: int):
        tag = f"{os.getpid() % 100000}{secrets.token_hex(2)}"
        self.n = n
        self.names: List[str] = [f"tph{tag}n{i}" for i in range(n)]
        self.bridge_ns = f"tph{tag}br" if n > 2 else None
        self.addr: List[str] = [f"{SUBNET}.{i + 1}" for i in range(n)]
        self.hostnames: List[str] = [f"host{i}" for i in range(n)]
        self._made: List[str] = []

    def cmd(self, i: int, argv: list) -> list:
        """argv run inside host i's namespace."""
        return ["ip", "netns", "exec", self.names[i], *argv]

    def _add_ns(self, name):
        _ip("netns", "add", name)
        self._made.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def setup(self):
        for name in self.names:
            self._add_ns(name)
        if self.bridge_ns is None:
            a, b = self.names
            _ip("-n", a, "link", "add", "v0", "type", "veth", "peer", "name", "v1", "netns", b)
            ends = [(a, "v0"), (b, "v1")]
        else:
            self._add_ns(self.bridge_ns)
            br = self.bridge_ns
            _ip("-n", br, "link", "add", "br0", "type", "bridge")
            _ip("-n", br, "link", "set", "br0", "up")
            ends = []
            for i, name in enumerate(self.names):
                _ip("-n", br, "link", "add", f"p{i}", "type", "veth", "peer", "name", f"v{i}", "netns", name)
                _ip("-n", br, "link", "set", f"p{i}", "master", "br0")
                _ip("-n", br, "link", "set", f"p{i}", "up")
                ends.append((name, f"v{i}"))
        for (name, dev), addr in zip(ends, self.addr):
            _ip("-n", name, "addr", "add", f"{addr}/24", "dev", dev)
            _ip("-n", name, "link", "set", dev, "up")

    def teardown(self):
        errors = []
        for name in reversed(self._made):
            r = _ip("netns", "del", name, check=False)
            if r.returncode != 0:
                errors.append(f"{name}: {r.stderr.strip()}")
        self._made = []
        if errors:
            raise RuntimeError("could not delete network namespaces: " + "; ".join(errors))

    def rsh_agent(self, path: str) -> str:
        """An executable rsh agent (for mpirun's plm_rsh_agent): `agent HOST cmd...` runs
        cmd in HOST's namespace through a shell, as ssh would."""
        cases = "\n".join(f"  {h}) ns={n} ;;" for h, n in zip(self.hostnames, self.names))
        with open(path, "w") as f:
            f.write("#!/bin/sh\n# rsh agent: runs a command in a simulated host's network namespace\n"
                    "while [ \"${1#-}\" != \"$1\" ]; do shift; done\n"  # ssh-style options: ignored
                    "host=$1; shift\n"
                    f"case $host in\n{cases}\n  *) echo \"no simulated host $host\" >&2; exit 255 ;;\nesac\n"
                    "exec ip netns exec \"$ns\" sh -c \"$*\"\n")
        os.chmod(path, 0o755)
        return path


@contextlib.contextmanager
def hosts(n: int = 2):
    """n simulated hosts (namespaces) on one subnet; deleted on exit."""
    if not 2 <= n <= 200:
        raise ValueError(f"hosts: n must be in 2..200, got {n}")
    h = Hosts(n)
    try:
        h.setup()
        yield h
    finally:
        h.teardown()


@contextlib.contextmanager
def hosts_or_skip(n: int = 2):
    import pytest
    ok, why = available()
    if not ok:
        pytest.skip(f"cannot simulate hosts with network namespaces: {why}")
    with hosts(n) as h:
        yield h
