"""Every name users have keeps working: the face tpcore.*, tpcore.models.*, tpcore.quant,
tpcore.optim, tpcore.torch, tpcore.bench, tpcore.serve, and the programs (python -m
tpcore.launch / tpcore.cleanup / tpcore.demo / tpcore.chat / tpcore.bench, the tpcore-launch script).

The lists are written out here, not read from the package, so that a name dropped or moved
without an alias fails this test."""
import importlib
import os
import subprocess
import sys

import pytest

import tpcore
import paths

FACE = ["CheckpointError", "Cluster", "ColumnParallelLinear", "Comm", "CommError", "CommTimeout", "Config",
        "DeviceArray", "Engine", "ParallelAttention", "ParallelMLP", "PipelineLM", "Plan", "PlanError", "ProcessGrid",
        "QuantTensor", "RankExitedError", "RowParallelLinear", "Store", "TransformerBlock",
        "VocabParallelCrossEntropy", "VocabParallelEmbedding", "__version__", "asarray", "average_gradients",
        "build_info", "convert", "cuda_available", "from_dlpack", "get_num_threads", "get_throttle", "init", "load",
        "models", "optim", "partition", "plan_from_measurements", "plan_partition", "quant", "save",
        "set_num_threads", "set_throttle", "spawn", "stage_partition", "vocab_parallel_cross_entropy"]

MODULES = {
    "tpcore.models": ["Config", "TransformerLM", "from_pretrained", "from_gguf", "head_partition", "quantize",
                      "estimate_memory", "Tokenizer", "load_tokenizer", "IncrementalDetokenizer", "StopMatcher",
                      "render_chat"],
    "tpcore.quant": ["QUANT_FORMATS", "QuantTensor", "block_size", "row_bytes", "quantize", "dequantize"],
    "tpcore.optim": ["AdamW", "SGD", "ShardedAdamW"],
    "tpcore.serve": ["Engine", "Request"],
    "tpcore.bench": ["SUBCOMMANDS"],
    "tpcore.models.gguf": ["read_gguf", "GGUFModel", "tokenizer", "is_gguf"],
}

TORCH = ["ColumnParallelLinear", "RowParallelLinear", "ParallelMLP", "VocabParallelEmbedding",
         "VocabParallelCrossEntropy", "vocab_parallel_cross_entropy", "TransformerBlock", "ParallelAttention",
         "sharded_state_dict", "load_sharded_state_dict"]


@pytest.mark.parametrize("name", FACE)
def test_face_names(name):
    assert name in tpcore.__all__, f"tpcore.{name} left __all__"
    assert getattr(tpcore, name) is not None


@pytest.mark.parametrize("mod", sorted(MODULES))
def test_module_names(mod):
    m = importlib.import_module(mod)
    missing = [n for n in MODULES[mod] if not hasattr(m, n)]
    assert not missing, f"{mod} lacks {missing}"


def test_old_module_paths_are_the_new_modules():
    # `from tpcore.quant import X` and `tpcore.quant.X` reach the one module, not a copy
    import tpcore.nn.optim
    import tpcore.nn.quant
    import tpcore.optim
    import tpcore.quant
    assert tpcore.quant is tpcore.nn.quant and sys.modules["tpcore.quant"] is tpcore.nn.quant
    assert tpcore.optim is tpcore.nn.optim and sys.modules["tpcore.optim"] is tpcore.nn.optim
    from tpcore.quant import QuantTensor
    assert QuantTensor is tpcore.QuantTensor


def test_torch_names():
    pytest.importorskip("torch")
    import tpcore.torch
    missing = [n for n in TORCH if not hasattr(tpcore.torch, n)]
    assert not missing, f"tpcore.torch lacks {missing}"


@pytest.mark.parametrize("argv, says", [
    (["-m", "tpcore.launch", "--help"], "usage"),
    (["-m", "tpcore.cleanup", "--help"], "usage"),
    (["-m", "tpcore.demo", "--help"], "usage"),
    (["-m", "tpcore.chat", "--help"], "--chat-template"),
    (["-m", "tpcore.bench", "--help"], "collectives"),
])
def test_programs(argv, says):
    r = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert says in r.stdout.lower(), r.stdout[-2000:]


def test_console_script_entry_point():
    # pyproject's [project.scripts] names tpcore.launch:main; that function must exist and be the launcher's
    import tomllib
    root = str(paths.ROOT)
    with open(os.path.join(root, "pyproject.toml"), "rb") as f:
        scripts = tomllib.load(f)["project"]["scripts"]
    mod, fn = scripts["tpcore-launch"].split(":")
    main = getattr(importlib.import_module(mod), fn)
    from tpcore.launch.launcher import main as launcher_main
    assert main is launcher_main
