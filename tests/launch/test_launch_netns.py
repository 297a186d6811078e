"""Hosts simulated with Linux network namespaces (tests/netns.py; skipped with the reason where
they cannot be made): the rendezvous store bound to one namespace's veth address serving
clients in another (and not reachable on their loopback), two launchers in two namespaces
forming one job (and a failing rank on one stopping the other), and the rsh agent that runs
commands in a simulated host (for mpirun)."""
import os
import secrets
import subprocess
import sys
import textwrap

import pytest

import netns
from test_launch_multinode import FAIL, JOB, check_job, finish, script, start

pytestmark = pytest.mark.multihost


STORE_SERVER = """
import sys, time, tpcore
addr, secret = sys.argv[1], sys.argv[2]
with tpcore.Store(addr, 29400, is_server=True, secret=secret, timeout=20) as s:
    print("READY", flush=True)
    s.barrier("all", 3)
    print("VALUES", s.get("from/1").decode(), s.get("from/2").decode(), flush=True)
    s.wait(["bye/1", "bye/2"])  # the clients are done with the store
"""

STORE_CLIENT = """
import sys, tpcore
addr, secret, me = sys.argv[1], sys.argv[2], sys.argv[3]
with tpcore.Store(addr, 29400, secret=secret, timeout=20) as s:
    s.set(f"from/{me}", f"hello from {me}")
    s.barrier("all", 3)
    print("ADD", s.add("n", 1))
    s.set(f"bye/{me}", b"")
"""


def test_store_across_namespaces(tmp_path):
    with netns.hosts_or_skip(2) as net:
        secret = secrets.token_hex(16)
        srv = script(tmp_path, STORE_SERVER, "srv.py")
        cli = script(tmp_path, STORE_CLIENT, "cli.py")
        procs = []
        try:
            server = subprocess.Popen(net.cmd(0, [sys.executable, srv, net.addr[0], secret]),
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            procs.append(server)
            assert server.stdout.readline().strip() == "READY"
            for me in (1, 2):
                procs.append(subprocess.Popen(net.cmd(1, [sys.executable, cli, net.addr[0], secret, str(me)]),
                                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
            # loopback of host 1 has no store: the store is reachable at host 0's address only
            r = subprocess.run(net.cmd(1, [sys.executable, "-c",
                                           f"import tpcore; tpcore.Store('127.0.0.1', 29400, secret='{secret}', "
                                           f"timeout=0.5)"]), capture_output=True, text=True, timeout=60)
            assert r.returncode != 0 and "cannot connect within 0.5 s" in r.stderr
            runs = finish(procs)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.communicate()
        assert runs[0][0] == 0 and "VALUES hello from 1 hello from 2" in runs[0][1], runs[0]
        assert all(rc == 0 for rc, _, _ in runs[1:]), runs
        assert sorted(int(out.split()[-1]) for _, out, _ in runs[1:]) == [1, 2]


def test_launchers_across_namespaces(tmp_path):
    path = script(tmp_path, JOB)
    with netns.hosts_or_skip(2) as net:
        env = dict(os.environ, TPCORE_STORE_SECRET=secrets.token_hex(32))
        procs = [start(k, 2, 29500, ["-n", "2", path, "x", "--flag"], prefix=net.cmd(k, []), env=env,
                       addr=net.addr[0]) for k in range(2)]
        check_job(finish(procs), 2, 2)
        # a failing rank on host 1 stops host 0's ranks
        fail = script(tmp_path, FAIL, "fail.py")
        env["FAIL_RANK"] = "2"
        procs = [start(k, 2, 29501, ["-n", "2", "--grace", "1", fail], prefix=net.cmd(k, []), env=env,
                       addr=net.addr[0]) for k in range(2)]
        runs = finish(procs)
        assert [rc for rc, _, _ in runs] == [7, 7], runs
        assert "node 1: rank 2 exited with code 7" in runs[0][2]


def test_rsh_agent_runs_commands_in_the_simulated_host(tmp_path):
    with netns.hosts_or_skip(3) as net:
        agent = net.rsh_agent(str(tmp_path / "agent.sh"))
        for i in range(3):
            r = subprocess.run([agent, "-x", net.hostnames[i], "ip", "-o", "-4", "addr", "show"], capture_output=True,
                               text=True, timeout=30)
            assert r.returncode == 0 and f"inet {net.addr[i]}/24" in r.stdout, r
            assert all(f"inet {a}/" not in r.stdout for a in net.addr if a != net.addr[i])
        # three hosts on one bridge: a store on host 2 serves host 0
        r = subprocess.run([agent, "nohost", "true"], capture_output=True, text=True, timeout=30)
        assert r.returncode == 255 and "no simulated host nohost" in r.stderr
        secret = secrets.token_hex(16)
        srv = subprocess.Popen(net.cmd(2, [sys.executable, "-c", textwrap.dedent(f"""
            import tpcore
            with tpcore.Store("{net.addr[2]}", 29600, is_server=True, secret="{secret}", timeout=20) as s:
                print("READY", flush=True)
                s.wait(["bye"])
            """)]), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert srv.stdout.readline().strip() == "READY"
            r = subprocess.run(net.cmd(0, [sys.executable, "-c", f"import tpcore; s = tpcore.Store('{net.addr[2]}', "
                                          f"29600, secret='{secret}', timeout=10); s.set('bye', b'1'); s.close()"]),
                               capture_output=True, text=True, timeout=60)
            assert r.returncode == 0, r.stderr
            assert srv.wait(timeout=30) == 0
        finally:
            if srv.poll() is None:
                srv.kill()
            srv.communicate()
