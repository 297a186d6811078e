"""tpcore.init's reading of the environment: launcher/spawn, torchrun, Open
MPI, Slurm, and a single process."""
import os

import pytest

from tpcore.distributed import env as _env


def test_single_process():
    info = _env.detect({})
    assert (info.rank, info.world_size, info.source) == (0, 1, "single")


def test_tpcore_launcher():
    info = _env.detect({"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "4",
                        "TPCORE_JOB_ID": "ln0123"})
    assert (info.rank, info.world_size, info.local_rank, info.job_id, info.source) == (2, 4, 2, "ln0123", "tpcore")


def test_torchrun():
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "abc"}
    a, b = _env.detect(env), _env.detect(dict(env, RANK="0", LOCAL_RANK="0"))
    assert a.source == "torchrun" and a.job_id == b.job_id  # every rank derives the same job
    assert a.job_id != _env.detect(dict(env, MASTER_PORT="29501")).job_id


def test_torchrun_without_master_is_an_error():
    with pytest.raises(ValueError, match="MASTER_ADDR"):
        _env.detect({"RANK": "0", "WORLD_SIZE": "2"})


def test_openmpi():
    info = _env.detect({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4",
                        "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
                        "PMIX_NAMESPACE": "prterun-host-1234@1"})
    assert (info.rank, info.world_size, info.local_rank, info.local_world_size) == (3, 4, 1, 2)
    assert info.source == "openmpi"
    assert all(ch.isalnum() or ch in "_-" for ch in info.job_id)


def test_slurm():
    info = _env.detect({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
                        "SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_JOB_ID": "991", "SLURM_STEP_ID": "0"})
    assert (info.rank, info.world_size, info.local_rank, info.local_world_size) == (5, 8, 1, 4)
    assert info.job_id == "slurm_991_0"


@pytest.mark.parametrize("env,msg", [
    ({"RANK": "4", "WORLD_SIZE": "4", "TPCORE_JOB_ID": "j"}, "outside"),
    ({"RANK": "x", "WORLD_SIZE": "4", "TPCORE_JOB_ID": "j"}, "RANK"),
    ({"RANK": "0", "WORLD_SIZE": "0", "TPCORE_JOB_ID": "j"}, "world size"),
])
def test_bad_values(env, msg):
    with pytest.raises(ValueError, match=msg):
        _env.detect(env)


def test_init_refuses_ranks_on_several_hosts(monkeypatch):
    import tpcore
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("TPCORE_JOB_ID", "multihost")
    with pytest.raises(tpcore.CommError, match="one host"):
        tpcore.init()


def test_single_process_init_works():
    import numpy as np
    import tpcore
    with tpcore.init() as comm:
        x = np.arange(4.0)
        comm.all_reduce(x)
        assert comm.size == 1 and list(x) == [0, 1, 2, 3] and comm.backend == "shm"


def test_blas_is_linked_and_threads_follow_local_ranks(monkeypatch):
    import tpcore
    assert "OpenBLAS" in tpcore.build_info()["blas"] or "CBLAS" in tpcore.build_info()["blas"]
    cores = len(os.sched_getaffinity(0))
    got = tpcore.spawn(lambda c: tpcore.get_num_threads(), 2, deadline=60)
    if "OpenBLAS" in tpcore.build_info()["blas"]:
        assert got == [max(1, cores // 2)] * 2
        monkeypatch.setenv("TPCORE_NUM_THREADS", "1")
        assert tpcore.spawn(lambda c: tpcore.get_num_threads(), 1, deadline=60) == [1]
    with pytest.raises(ValueError, match="n must be"):
        tpcore.set_num_threads(0)


def _job_id(comm):
    return os.environ["TPCORE_JOB_ID"]


def test_job_prefix_starts_every_job_id_tpcore_makes_up(monkeypatch, tmp_path):
    # TPCORE_JOB_PREFIX: how a harness (this test session: conftest) tells its jobs' /dev/shm names apart
    import subprocess
    import sys

    import tpcore
    monkeypatch.setenv("TPCORE_JOB_PREFIX", "px-1_")
    assert _env.detect({}).job_id.startswith("px-1_solo_")
    assert _env.detect({"TPCORE_JOB_ID": "mine"}).job_id == "mine"  # an id set by hand stays as it is
    ids = tpcore.spawn(_job_id, 2)
    assert ids[0] == ids[1] and ids[0].startswith("px-1_sp") and len(ids[0]) == 5 + 2 + 16
    with tpcore.Cluster(1) as cluster:
        got = cluster.run(_job_id)[0]
        assert got.startswith("px-1_cl") and got.endswith("_g0") and len(got) <= 40
    script = tmp_path / "job.py"
    script.write_text("import os, tpcore\nc = tpcore.init()\nc.barrier()\nprint('ID', os.environ['TPCORE_JOB_ID'])\n")
    r = subprocess.run([sys.executable, "-m", "tpcore.launch", "-n", "2", str(script)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert [ln.split()[-1][:7] for ln in r.stdout.splitlines() if " ID " in ln] == ["px-1_ln"] * 2, r.stdout
    for bad in ("a b", "x" * 17, "ü"):
        monkeypatch.setenv("TPCORE_JOB_PREFIX", bad)
        with pytest.raises(ValueError, match=r"TPCORE_JOB_PREFIX must be at most 16 characters of \[A-Za-z0-9_-\]"):
            tpcore.spawn(_job_id, 1)
        with pytest.raises(ValueError, match="TPCORE_JOB_PREFIX must be"):
            _env.detect({})
