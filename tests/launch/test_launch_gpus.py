"""python -m tpcore.launch --gpus N: argument checks, the clear error when CUDA or
enough GPUs are missing, and the per-rank binding (CUDA_VISIBLE_DEVICES / LOCAL_RANK)
that one rank per GPU needs.  On a GPU machine, a real run binds one GPU per rank."""
import os
import subprocess
import sys
import textwrap

import pytest

import tpcore
from tpcore.launch import launcher as L

LAUNCH = [sys.executable, "-m", "tpcore.launch"]
CUDA = getattr(tpcore, "cuda_available", lambda: False)()


def run(args, tmp_path, body="print('ran')", env=None, timeout=60):
    p = tmp_path / "job.py"
    p.write_text(textwrap.dedent(body))
    e = dict(os.environ, **(env or {}))
    return subprocess.run(LAUNCH + args + [str(p)], capture_output=True, text=True, timeout=timeout, env=e)


@pytest.mark.parametrize("n", ["0", "-3"])
def test_gpus_must_be_positive(tmp_path, n):
    r = run(["--gpus", n], tmp_path)
    assert r.returncode == 2 and f"--gpus must be >= 1, got {n}" in r.stderr
    assert "ran" not in r.stdout


def test_gpus_and_n_disagree(tmp_path):
    r = run(["-n", "3", "--gpus", "2"], tmp_path)
    assert r.returncode == 2 and "-n 3 and --gpus 2 disagree" in r.stderr


@pytest.mark.skipif(CUDA, reason="CUDA is available here")
def test_gpus_without_cuda_is_a_clear_error(tmp_path):
    r = run(["--gpus", "1"], tmp_path)
    assert r.returncode == 2
    assert "--gpus 1: asked for 1 GPU but CUDA is not available here" in r.stderr
    assert "ran" not in r.stdout


@pytest.mark.skipif(CUDA, reason="CUDA is available here")
def test_default_n_without_cuda_unchanged(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TPCORE_NPROC"}
    p = tmp_path / "job.py"
    p.write_text("import os; print('ws', os.environ['WORLD_SIZE'], 'cvd', os.environ.get('CUDA_VISIBLE_DEVICES'))")
    r = subprocess.run(LAUNCH + [str(p)], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("ws 2") == 2


def test_visible_gpus_without_cuda():
    if CUDA:
        ids, why = L.visible_gpus()
        assert len(ids) >= 1 and "visible" in why
    else:
        assert L.visible_gpus()[0] == []
        assert "CUDA is not available" in L.visible_gpus()[1]


def test_gpu_env_binds_one_gpu_per_rank():
    ids = ["3", "5", "GPU-1234abcd"]
    envs = [L.gpu_env(r, ids) for r in range(3)]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ids
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1", "2"]
    assert all(set(e) == {"CUDA_VISIBLE_DEVICES", "LOCAL_RANK"} for e in envs)


def test_parse_keeps_script_options(monkeypatch):
    monkeypatch.setattr(L, "visible_gpus", lambda: (["0", "1"], "2 GPUs"))
    ns = L._parse(["--gpus", "2", "train.py", "--gpus", "7"])
    assert ns.nproc == 2 and ns.gpu_ids == ["0", "1"] and ns.args == ["train.py", "--gpus", "7"]
    ns = L._parse(["train.py"])  # no -n: one rank per visible GPU
    assert ns.nproc == 2 and ns.gpu_ids == ["0", "1"]
    ns = L._parse(["-n", "3", "train.py"])  # -n alone: CPU ranks as before
    assert ns.nproc == 3 and ns.gpu_ids is None
    with pytest.raises(SystemExit):
        L._parse(["--gpus", "3", "train.py"])


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (tpcore.cuda_available() is False)")
def test_gpus_real_run(tmp_path):
    body = """
    import os
    print('bind', os.environ['LOCAL_RANK'], os.environ['CUDA_VISIBLE_DEVICES'], os.environ['WORLD_SIZE'])
    """
    r = run(["--gpus", "1"], tmp_path, body=body)
    assert r.returncode == 0, r.stderr
    assert "bind 0" in r.stdout and "1" in r.stdout.split()[-1]


def test_spawn_defaults_to_fresh_interpreters_once_cuda_is_up(monkeypatch):
    """A forked child cannot use the parent's CUDA context: once this process initialised CUDA,
    tpcore.spawn's default start method is "spawn"; before, "fork" (notebook functions work)."""
    import multiprocessing as mp

    from tpcore.launch import spawn as sp
    if "fork" not in mp.get_all_start_methods():
        pytest.skip("no fork on this platform")
    monkeypatch.setattr(sp, "_cuda_initialised", lambda: False)
    assert sp._default_method() == "fork"
    monkeypatch.setattr(sp, "_cuda_initialised", lambda: True)
    assert sp._default_method() == "spawn"
    monkeypatch.undo()
    # here: the plugin is loaded only where a GPU answered; without one the default stays fork
    assert sp._default_method() == ("spawn" if tpcore.cuda_available() else "fork")
