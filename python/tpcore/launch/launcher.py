"""python -m tpcore.launch -n N [options] script.py args...   (or -m module args...)
   python -m tpcore.launch --gpus N script.py ...            (one rank per GPU)

Starts N ranks of one job on this host, one process each, with the variables
tpcore.init() reads (and torchrun's: RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT).  Every output line is prefixed
with its rank as tpcore.spawn does ("[rank3] "; --no-prefix: none).  When a
rank exits non-zero or is killed, the others are stopped (SIGTERM, then
SIGKILL after --grace seconds) and the launcher exits with that rank's code
(128 + signal for a signal).  Ctrl-C stops all ranks.
Ranks die with the launcher (PR_SET_PDEATHSIG), so none is ever orphaned.

Several hosts, like torchrun: on each host run
    python -m tpcore.launch --nnodes N --node-rank K --master-addr A --master-port P -n LOCAL script.py
Node 0's launcher hosts the job's store (tpcore.Store) on A:P; the launchers check
that they agree (N, LOCAL, the script and its arguments, each node rank once) and
start ranks RANK = K*LOCAL + local rank of WORLD_SIZE = N*LOCAL, with TPCORE_NNODES,
TPCORE_NODE_RANK, MASTER_ADDR/PORT and TPCORE_STORE_SECRET.  Set TPCORE_STORE_SECRET
to the same random value on every host (else node 0 makes one that only launchers on
its own host can read).  A rank that fails on one host stops the ranks of every host;
a host whose launcher stops answering (--heartbeat-timeout) fails the job.

--gpus N starts N ranks, one GPU each: rank r gets CUDA_VISIBLE_DEVICES=<the r-th
visible GPU> and LOCAL_RANK=r, so device="cuda" in the rank is its own GPU.
Without -n, --gpus or TPCORE_NPROC, a machine where CUDA is usable starts one rank
per visible GPU.  Asking for more GPUs than are visible is an error.

torchrun's spellings work too: --nproc-per-node (--nproc_per_node) is -n, and also
takes "gpu" (one rank per visible GPU, as --gpus), "cpu" (one per CPU) or "auto"
(gpu where CUDA is usable, else cpu); --standalone is a job of this host alone on a
free port (what the launcher does without --nnodes, so it contradicts --nnodes > 1,
--master-addr and --master-port); --nnodes also takes MIN:MAX with MIN == MAX (no
elastic jobs); --node_rank, --master_addr and --master_port are --node-rank,
--master-addr and --master-port.  On one host, --master-addr and --master-port set
the ranks' MASTER_ADDR/MASTER_PORT (default 127.0.0.1 and a free port, not
torchrun's 29500, so that two jobs never share one).  Two spellings of one thing
that disagree (-n 2 --nproc-per-node 3) are an error.

--backend mpi hands the job to Open MPI: the launcher execs
`mpirun -n N --oversubscribe [--tag-output] python -u script.py ...` with
TPCORE_BACKEND=mpi (and TPCORE_TIMEOUT, PYTHONPATH passed on with -x), so
tpcore.init() reads mpirun's OMPI_COMM_WORLD_* and uses the mpi backend; mpirun
then stops the job when a rank fails.  Other --backend values set TPCORE_BACKEND
for tpcore.init(backend="auto").
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import List, Optional

from tpcore.utils import cleanup as _cleanup
from tpcore.launch.relay import Console, pump


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _parse(argv):
    p = argparse.ArgumentParser(
        prog="python -m tpcore.launch",
        description="Run a script or module on N local ranks of one tpcore job.")
    p.add_argument("-n", "--nproc", type=int, default=None,
                   help="number of ranks (default: TPCORE_NPROC, else 2)")
    p.add_argument("--nproc-per-node", "--nproc_per_node", dest="nproc_per_node", default=None,
                   metavar="{N,gpu,cpu,auto}",
                   help="torchrun's spelling of -n; also gpu (one rank per visible GPU, as --gpus), cpu (one "
                        "per CPU) or auto (gpu where CUDA is usable, else cpu)")
    p.add_argument("--standalone", action="store_true",
                   help="torchrun's single-host job: this host alone, on a free port (the default without "
                        "--nnodes)")
    p.add_argument("--gpus", type=int, default=None,
                   help="one GPU per rank: start this many ranks, each with CUDA_VISIBLE_DEVICES naming its own "
                        "GPU and LOCAL_RANK set (like torchrun); refused when fewer GPUs are visible")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds any one communicator wait may take (sets TPCORE_TIMEOUT)")
    p.add_argument("--grace", type=float, default=5.0,
                   help="seconds between SIGTERM and SIGKILL when stopping ranks (default 5)")
    p.add_argument("--no-prefix", action="store_true", help="do not prefix output lines with the rank")
    p.add_argument("--backend", choices=("auto", "shm", "nccl", "mpi"), default=None,
                   help="the backend tpcore.init() picks (sets TPCORE_BACKEND); mpi starts the ranks with mpirun")
    p.add_argument("-m", dest="module", default=None, help="run a module as a script, like python -m")
    _add_multinode_args(p)
    p.add_argument("args", nargs=argparse.REMAINDER, help="script and its arguments")
    # Everything after the module name (or the script) belongs to it, options included
    # (`-m tpcore.demo --iters 2`): argparse alone would take `--iters` as the launcher's.
    argv = list(sys.argv[1:] if argv is None else argv)
    takes_value = {"-n", "--nproc", "--nproc-per-node", "--nproc_per_node", "--gpus", "--timeout", "--grace",
                   "--backend"} | set(_MULTINODE_OPTS)
    i, tail = 0, []
    while i < len(argv):
        a = argv[i]
        if a == "-m":
            tail, argv = argv[i + 2:], argv[:i + 2]
            break
        if a in takes_value:
            i += 2
            continue
        if a == "--" or not a.startswith("-"):
            tail, argv = argv[i + (a == "--"):], argv[:i]
            break
        i += 1
    ns = p.parse_args(argv)
    ns.args = list(ns.args) + tail
    ns.gpu_ids = None
    _torchrun_nproc(p, ns)
    if ns.gpus is not None:
        if ns.gpus < 1:
            p.error(f"--gpus must be >= 1, got {ns.gpus}")
        if ns.nproc is not None and ns.nproc != ns.gpus:
            p.error(f"-n {ns.nproc} and --gpus {ns.gpus} disagree: --gpus starts one rank per GPU (give one of them)")
        visible, why = visible_gpus()
        if ns.gpus > len(visible):
            p.error(f"--gpus {ns.gpus}: asked for {ns.gpus} GPU{'s' if ns.gpus != 1 else ''} but {why}")
        ns.nproc, ns.gpu_ids = ns.gpus, visible[:ns.gpus]
    elif ns.nproc is None and "TPCORE_NPROC" not in os.environ:
        visible, _ = visible_gpus()
        if visible:  # CUDA is usable: one rank per visible GPU
            ns.nproc, ns.gpu_ids = len(visible), visible
    if ns.nproc is None:
        ns.nproc = int(os.environ.get("TPCORE_NPROC", "2"))
    if ns.nproc < 1:
        p.error(f"-n must be >= 1, got {ns.nproc}")
    if ns.module is None and not ns.args:
        p.error("give a script (or -m module) to run")
    if ns.timeout is not None and ns.timeout <= 0:
        p.error(f"--timeout must be > 0, got {ns.timeout}")
    _check_multinode_args(p, ns)
    return ns


def _torchrun_nproc(p, ns):
    """--nproc-per-node (torchrun's -n): a number sets ns.nproc, gpu sets ns.gpus, cpu and auto
    one of them; refused when -n or --gpus says otherwise."""
    text = ns.nproc_per_node
    if text is None:
        return
    v = text.strip().lower()
    if v == "auto":
        v = "gpu" if visible_gpus()[0] else "cpu"
    if v == "gpu":
        visible, why = visible_gpus()
        if not visible:
            p.error(f"--nproc-per-node {text}: one rank per GPU, but {why}")
        if ns.gpus is not None and ns.gpus != len(visible):
            p.error(f"--gpus {ns.gpus} and --nproc-per-node {text} ({len(visible)} visible GPUs) disagree "
                    "(give one of them)")
        if ns.nproc is not None and ns.nproc != len(visible):
            p.error(f"-n {ns.nproc} and --nproc-per-node {text} ({len(visible)} visible GPUs) disagree "
                    "(give one of them)")
        ns.gpus = len(visible)
        return
    if v == "cpu":
        n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    else:
        try:
            n = int(v)
        except ValueError:
            p.error(f"--nproc-per-node must be a number of ranks, gpu, cpu or auto, got {text!r}")
        if n < 1:
            p.error(f"--nproc-per-node must be >= 1, got {n}")
    if ns.nproc is not None and ns.nproc != n:
        p.error(f"-n {ns.nproc} and --nproc-per-node {text} disagree (--nproc-per-node is torchrun's spelling "
                "of -n: give one of them)")
    if ns.gpus is not None and ns.gpus != n:
        p.error(f"--gpus {ns.gpus} and --nproc-per-node {text} disagree (give one of them)")
    ns.nproc = n


def visible_gpus():
    """([the CUDA_VISIBLE_DEVICES entry of each GPU this launcher may hand out], a phrase
    saying how many there are and why).  With CUDA_VISIBLE_DEVICES set, its entries
    (indices or UUIDs), as many as CUDA itself counts; else 0..count-1.  No CUDA: []."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    try:
        from tpcore import _C
        from tpcore.utils.runtime import cuda_available
        ok = cuda_available()
        count = _C.device_count("cuda") if ok else 0
        status = _C.cuda_status()
    except Exception as e:  # noqa: BLE001 - an unusable extension: no GPUs to hand out
        count, status = 0, f"tpcore's CUDA support could not be loaded ({type(e).__name__}: {e})"
    if count == 0:
        return [], f"CUDA is not available here: {status}"
    ids = [str(i) for i in range(count)]
    if env is not None:
        ids = [e.strip() for e in env.split(",") if e.strip()][:count]
        return ids, f"only {len(ids)} GPU{'s are' if len(ids) != 1 else ' is'} visible (CUDA_VISIBLE_DEVICES={env!r})"
    return ids, f"only {count} GPU{'s are' if count != 1 else ' is'} visible ({status})"


def gpu_env(rank: int, gpu_ids) -> dict:
    """The variables that bind rank `rank` to its GPU (one each, as torchrun's users do):
    CUDA_VISIBLE_DEVICES names that GPU alone, so device 'cuda' is it in the rank."""
    return {"CUDA_VISIBLE_DEVICES": str(gpu_ids[rank]), "LOCAL_RANK": str(rank)}


def _pump(stream, relay):
    """A rank's pipe into its relay (prefixed lines) until the rank closes it."""
    try:
        pump(stream.fileno(), relay)
    finally:
        stream.close()


def _stop_all(procs, grace):
    for p in procs:
        if p.poll() is None:
            try:
                p.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
    end = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(timeout=max(0.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def _exec_mpirun(ns) -> int:
    """--backend mpi: replaces this process with mpirun running the job (returns only on error)."""
    import shutil
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        print("tpcore.launch: --backend mpi needs mpirun on PATH (apt-get install openmpi-bin libopenmpi-dev)",
              file=sys.stderr)
        return 2
    if ns.gpu_ids is not None:
        print("tpcore.launch: --gpus is not supported with --backend mpi (the mpi backend takes host arrays)",
              file=sys.stderr)
        return 2
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TPCORE_JOB_ID")}
    env.update(TPCORE_BACKEND="mpi", PYTHONUNBUFFERED="1")
    if ns.timeout is not None:
        env["TPCORE_TIMEOUT"] = str(ns.timeout)
    if hasattr(os, "geteuid") and os.geteuid() == 0:  # Open MPI refuses root unless told twice
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    cmd = [mpirun, "-n", str(ns.nproc), "--oversubscribe"] + ([] if ns.no_prefix else ["--tag-output"])
    for var in ("TPCORE_BACKEND", "TPCORE_TIMEOUT", "PYTHONPATH", "PYTHONUNBUFFERED"):
        if var in env:
            cmd += ["-x", var]
    cmd += [sys.executable, "-u"] + (["-m", ns.module] if ns.module is not None else []) + ns.args
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(mpirun, cmd, env)
    return 2  # not reached


def run(argv: Optional[List[str]] = None) -> int:
    """The launcher (``python -m tpcore.launch``, ``tpcore-launch``) as a function.

    Parameters
    ----------
    argv : list of str, optional
        The command line after the program name (default None: sys.argv[1:]); see the
        module doc and ``--help``.

    Returns
    -------
    int
        The exit status: 0 when every rank succeeded, else the code of the rank that failed
        first (128 + signal for a signal).
    """
    ns = _parse(sys.argv[1:] if argv is None else argv)
    if ns.backend == "mpi":
        return _exec_mpirun(ns)
    n = ns.nproc
    job = _cleanup.new_job_id("ln")
    if ns.module is not None:
        cmd = [sys.executable, "-u", "-m", ns.module] + ns.args
    else:
        cmd = [sys.executable, "-u"] + ns.args
    base = dict(os.environ)
    base.update({"WORLD_SIZE": str(n), "LOCAL_WORLD_SIZE": str(n), "TPCORE_JOB_ID": job, "TPCORE_JOB_RANDOM": "1",
                 "MASTER_ADDR": ns.master_addr or "127.0.0.1", "PYTHONUNBUFFERED": "1",
                 "MASTER_PORT": str(ns.master_port if ns.master_port is not None else _free_port())})
    mn, rank0 = None, 0  # --nnodes > 1: this launcher's part in a job over several hosts
    if ns.nnodes > 1:
        mn = _multinode_join(ns)
        if mn is None:
            return 1
        base.update(mn.env)
        job, rank0 = mn.job_id, mn.rank0
    if ns.timeout is not None:
        base["TPCORE_TIMEOUT"] = str(ns.timeout)
    if ns.backend is not None:
        base["TPCORE_BACKEND"] = ns.backend
    procs = []
    stopping = {"signal": None}
    # Removes the job's shared-memory names once the launcher and every rank are
    # gone, however they go (SIGKILL of the whole process group included).
    life_w, janitor = _cleanup.start_janitor(job)
    life = (life_w,) if life_w is not None else ()
    err_r, err_w = os.pipe()  # ranks report uncaught exceptions here (see _excepthook)
    os.set_blocking(err_r, False)

    def on_signal(signum, frame):
        stopping["signal"] = signum

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        # All processes first, then the reader threads (preexec_fn and threads do not mix).
        for r in range(n):
            env = dict(base, RANK=str(rank0 + r), LOCAL_RANK=str(r), TPCORE_ERROR_FD=str(err_w))
            if ns.gpu_ids is not None:
                env.update(gpu_env(r, ns.gpu_ids))
            if life_w is not None:
                env[_cleanup.LIFE_FD_VAR] = str(life_w)
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          stdin=subprocess.DEVNULL, pass_fds=(err_w,) + life,
                                          preexec_fn=_cleanup.die_with_parent))
        os.close(err_w)
        err_w = -1
        console = Console()  # the ranks' lines, one prefix each (_relay.py: "\r" progress lines too)
        threads = []
        for r, p in enumerate(procs):
            prefix = "" if ns.no_prefix else f"[rank{rank0 + r}] "
            for stream, out in ((p.stdout, sys.stdout), (p.stderr, sys.stderr)):
                relay = console.relay(lambda out=out: out, prefix)
                t = threading.Thread(target=_pump, args=(stream, relay), daemon=True)
                t.start()
                threads.append(t)
        failed = None  # (rank, returncode)
        seen = {}  # rank -> order in which its exit was noticed
        while True:
            if stopping["signal"] is not None:
                console.write(sys.stderr, f"tpcore.launch: got {signal.Signals(stopping['signal']).name}; "
                                          f"stopping all ranks\n")
                if mn is not None:  # the other nodes stop too
                    mn.report(f"its launcher got {signal.Signals(stopping['signal']).name}", 128 + stopping["signal"])
                _stop_all(procs, ns.grace)
                for t in threads:
                    t.join(2)
                return 128 + stopping["signal"]
            news = mn.poll() if mn is not None else None
            if news is not None:  # another node's rank failed (or node 0's store is gone)
                return _multinode_stop(mn, news, procs, threads, console, ns.grace)
            codes = [p.poll() for p in procs]
            for r, c in enumerate(codes):
                if c is not None and r not in seen:
                    seen[r] = len(seen)
            if failed is None and any(c not in (None, 0) for c in codes):
                failed = _blame(procs, seen, err_r)
            if failed is not None:
                r, c = failed
                how = f"was killed by signal {signal.Signals(-c).name}" if c < 0 else f"exited with code {c}"
                r += rank0
                if mn is not None:
                    mn.report(f"rank {r} {how}", 128 - c if c < 0 else c)
                running = [rank0 + i for i, p in enumerate(procs) if p.poll() is None]
                if running:
                    console.write(sys.stderr, f"tpcore.launch: rank {r} {how}; stopping ranks {running}\n")
                else:
                    console.write(sys.stderr, f"tpcore.launch: rank {r} {how}\n")
                _stop_all(procs, ns.grace)
                for t in threads:
                    t.join(2)
                if mn is not None:
                    mn.linger(ns.grace)
                return 128 - c if c < 0 else c
            if all(c == 0 for c in codes):
                for t in threads:
                    t.join(5)
                if mn is not None:
                    return _multinode_finish(mn, console, ns.grace)
                return 0
            time.sleep(0.005)
    finally:
        _stop_all(procs, 0.5)
        if mn is not None:
            mn.close()
        for s, h in old.items():
            signal.signal(s, h)
        _cleanup.remove_shm(job)
        if life_w is not None:
            os.close(life_w)
            try:
                janitor.wait(5)
            except subprocess.TimeoutExpired:
                pass
        os.close(err_r)
        if err_w >= 0:
            os.close(err_w)


def _read_records(fd) -> dict:
    """rank -> the error record it wrote down the pipe (see _excepthook)."""
    data = b""
    while True:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            break
        if not chunk:
            break
        data += chunk
    recs = {}
    for line in data.splitlines():
        try:
            rec = json.loads(line)
            recs.setdefault(int(rec["rank"]), rec)
        except (ValueError, KeyError, TypeError):
            continue
    return recs


def _blame(procs, seen, err_fd, window=1.0):
    """(rank, code) of the rank whose failure came first.  Ranks that failed
    because a peer failed say so in their error record; a rank that was
    killed, or exited non-zero for its own reasons, is a root cause.  Waits up
    to `window` seconds for the other ranks to end and report."""
    end = time.monotonic() + window
    while time.monotonic() < end and any(p.poll() is None for p in procs):
        for r, p in enumerate(procs):
            if p.poll() is not None and r not in seen:
                seen[r] = len(seen)
        time.sleep(0.01)
    for r, p in enumerate(procs):
        if p.poll() is not None and r not in seen:
            seen[r] = len(seen)
    records = _read_records(err_fd)
    cands = []
    for r, p in enumerate(procs):
        c = p.poll()
        if c in (None, 0):
            continue
        rec = records.get(r)
        secondary = bool(rec and rec.get("peer_failure"))
        when = rec["time"] if rec else float("inf")
        cands.append((secondary, when, seen.get(r, 1 << 30), r, c))
    cands.sort()
    _, _, _, r, c = cands[0]
    return r, c


# ------------------------------------------------------------ several hosts (--nnodes > 1)

_MULTINODE_OPTS = ("--nnodes", "--node-rank", "--node_rank", "--master-addr", "--master_addr", "--master-port",
                   "--master_port", "--join-timeout", "--heartbeat-timeout")


def _nnodes(text):
    """--nnodes: a number of hosts, or torchrun's MIN:MAX when MIN == MAX (tpcore jobs have a fixed size)."""
    parts = text.split(":")
    try:
        nums = [int(x) for x in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of hosts, got {text!r}") from None
    if len(nums) > 2 or (len(nums) == 2 and nums[0] != nums[1]):
        raise argparse.ArgumentTypeError(f"{text!r}: elastic jobs (torchrun's MIN:MAX hosts) are not supported; "
                                         "give one number of hosts")
    return nums[0]


def _add_multinode_args(p):
    g = p.add_argument_group("several hosts (like torchrun; see tpcore/_multinode.py)")
    g.add_argument("--nnodes", type=_nnodes, default=1,
                   help="hosts of the job (default 1; torchrun's N:N too); each runs this launcher with its own "
                        "--node-rank")
    g.add_argument("--node-rank", "--node_rank", dest="node_rank", type=int, default=None,
                   help="this host's index in 0..nnodes-1")
    g.add_argument("--master-addr", "--master_addr", dest="master_addr", default=None,
                   help="address of node 0, where its launcher hosts the job's store (default 127.0.0.1; "
                        "MASTER_ADDR); on one host, the ranks' MASTER_ADDR")
    g.add_argument("--master-port", "--master_port", dest="master_port", type=int, default=None,
                   help="the store's port on node 0 (MASTER_PORT); on one host, the ranks' MASTER_PORT (default "
                        "a free port)")
    g.add_argument("--join-timeout", type=float, default=300.0,
                   help="seconds to wait for every node to join (default 300)")
    g.add_argument("--heartbeat-timeout", type=float, default=30.0,
                   help="seconds without a node's heartbeat before node 0 declares it failed (default 30)")


def _check_multinode_args(p, ns):
    if ns.nnodes < 1:
        p.error(f"--nnodes must be >= 1, got {ns.nnodes}")
    if ns.standalone:
        given = [f"{o} {v}" for o, v in (("--nnodes", ns.nnodes if ns.nnodes != 1 else None),
                                          ("--node-rank", ns.node_rank if ns.node_rank else None),
                                          ("--master-addr", ns.master_addr), ("--master-port", ns.master_port))
                 if v is not None]
        if given:
            p.error(f"--standalone runs the job on this host alone, on a free port: {', '.join(given)} "
                    "contradicts it (give one of them)")
    if ns.master_port is not None and not 1 <= ns.master_port <= 65535:
        p.error(f"--master-port must be in 1..65535, got {ns.master_port}")
    if ns.nnodes == 1:
        if ns.node_rank not in (None, 0):
            p.error(f"--node-rank {ns.node_rank} needs --nnodes > {ns.node_rank}")
        return
    if ns.node_rank is None:
        p.error(f"--nnodes {ns.nnodes} needs --node-rank (this host's index in 0..{ns.nnodes - 1})")
    if not 0 <= ns.node_rank < ns.nnodes:
        p.error(f"--node-rank must be in 0..{ns.nnodes - 1}, got {ns.node_rank}")
    ns.master_addr = ns.master_addr or os.environ.get("MASTER_ADDR") or "127.0.0.1"
    if ns.master_port is None and os.environ.get("MASTER_PORT"):
        ns.master_port = int(os.environ["MASTER_PORT"])
    if ns.master_port is None or not 1 <= ns.master_port <= 65535:
        p.error(f"--nnodes {ns.nnodes} needs --master-port in 1..65535 (the same on every node), got "
                f"{ns.master_port}")
    if not ns.join_timeout > 0 or not ns.heartbeat_timeout > 0:
        p.error("--join-timeout and --heartbeat-timeout must be > 0")


def _multinode_join(ns):
    """The job formed with the other nodes' launchers, or None after printing why not."""
    from tpcore.launch.multinode import Multinode, MultinodeError
    from tpcore.distributed.comm import CommError
    job_args = (["-m", ns.module] if ns.module is not None else []) + list(ns.args)
    mn = Multinode(ns.nnodes, ns.node_rank, ns.nproc, ns.master_addr, ns.master_port, job_args,
                   ns.join_timeout, ns.heartbeat_timeout, None)
    try:
        mn.join()
        return mn
    except (MultinodeError, CommError, ValueError, OSError) as e:
        hint = ""
        if ns.node_rank == 0 and "already in use" in str(e):
            hint = " (is another launcher already node 0 of this job, or another job on this port?)"
        sys.stderr.write(f"tpcore.launch: node {ns.node_rank}: {e}{hint}\n")
        mn.close()
        return None


def _multinode_stop(mn, news, procs, threads, console, grace):
    msg, code = news
    running = [mn.rank0 + i for i, p in enumerate(procs) if p.poll() is None]
    console.write(sys.stderr, f"tpcore.launch: {msg}; stopping ranks {running}\n")
    _stop_all(procs, grace)
    for t in threads:
        t.join(2)
    mn.linger(grace)
    return code if code else 1


def _multinode_finish(mn, console, grace):
    news = mn.finish(grace)
    if news is None:
        return 0
    msg, code = news
    console.write(sys.stderr, f"tpcore.launch: {msg}\n")
    return code if code else 1


def main() -> None:
    """The console script ``tpcore-launch``: `run` on sys.argv, exiting with its status."""
    sys.exit(run())


if __name__ == "__main__":
    main()
