"""tpcore's own checkpoint folders, as `TransformerLM.save_pretrained` writes them.

tpcore_config.json with model.safetensors (full tensors in tpcore's names: loadable at
any world size and split), or one file of this rank's parameters per rank
(model.rank<r>-of-<n>.safetensors: the same world size and split only).
"""
from __future__ import annotations

import dataclasses
import math
import os

from tpcore.io import formats
from tpcore.io import stream as _stream
from tpcore.models import hf as _hf
from tpcore.models.loader.base import ModelLoader
from tpcore.models.memory import MODEL_PARTS
from tpcore.models.text import has_tokenizer, load_tokenizer
from tpcore.nn.config import ACTIVATIONS, NORMS, POSITIONS, Config
from tpcore.nn.weights import load_weight
from tpcore.utils.dtypes import is_quantized, weight_formats

__all__ = ["TpcoreFolderLoader"]


class TpcoreFolderLoader(ModelLoader):
    """A folder of `TransformerLM.save_pretrained` (tpcore_config.json)."""

    name = "tpcore"

    def load(self, path, comm, partition=None, progress=True, device=None, dtype=None, staging=None):
        with _stream.loading(staging):
            model = _load_own(self, path, os.path.join(path, formats.OWN_CONFIG), comm, partition, progress, device,
                              dtype)
        model.tokenizer = load_tokenizer(path, lazy=True) if has_tokenizer(path) else None
        return model


def _load_own(loader: ModelLoader, path: str, own: str, comm, partition, progress: bool, device=None,
              dtype=None):
    """A folder of save_pretrained: tpcore_config.json with model.safetensors (full tensors in
    tpcore's names, any world size) or the shard files of the same world size."""
    cfg = formats.read_own_config(own, Config, {"norm": NORMS, "activation": ACTIVATIONS, "positions": POSITIONS})
    full = os.path.join(path, formats.MODEL_FILE)
    if os.path.exists(full):
        header, _, _ = formats.read_safetensors_header(full)
        _hf.check_against_config(path, cfg, "tpcore", formats.OWN_CONFIG, {k: (full, v) for k, v in header.items()})
        model = loader.build(cfg, comm, partition, device, dtype or "float32")
        t, _ = formats.open_safetensors(full)
        model.load_state_dict_full(t, progress=progress)
        return model
    shards = formats.own_shard_files(path)
    if not shards:
        raise FileNotFoundError(f"{path}: no model.safetensors")
    mine = formats.own_shard_file(path, comm.rank, comm.size)
    if not os.path.exists(mine):
        raise ValueError(f"{path}: a sharded checkpoint of another world size ({os.path.basename(shards[0])}); "
                         f"save it with sharded=False to reshard")
    _check_own_shards(path, cfg, own, comm.size)
    if dtype is not None and any(is_quantized(v)
                                 for v in weight_formats(dtype, "from_pretrained", MODEL_PARTS).values()):
        raise ValueError(f"from_pretrained: {path} is a sharded checkpoint (this rank's parameters as they are); it "
                         f"cannot load into quantized weights (dtype={dtype!r}): load it in float32 and "
                         f"tpcore.models.quantize the model, or save it with sharded=False")
    model = loader.build(cfg, comm, partition, device, dtype or "float32")
    t, _ = formats.open_safetensors(mine)
    params = model.weights()  # weights only: a loaded model holds no gradients until it trains
    formats.check_tensors(mine, t, {f"param.{i}": p.shape for i, p in enumerate(params)},
                      "this rank's shard of the model (another partition?)")
    for i, p in enumerate(params):
        load_weight(p, "float32", t[f"param.{i}"], slice(None), None, f"{mine}: param.{i}")
    return model


def _check_own_shards(path: str, cfg: Config, source: str, world: int) -> None:
    """The shard files of a sharded save_pretrained checkpoint, before allocating: each file
    checked (formats.count_own_shards), and together at least as many values as cfg's full
    tensors hold (every value of the model is on some rank), so a config that claims more
    than the files hold is refused."""
    req, _ = _hf.expected_shapes(dataclasses.replace(cfg, layers=1), "tpcore")   # a layer's tensors, not L layers'
    sizes = {k: math.prod(v for v, _ in dims) for k, dims in req.items()}
    per_layer = sum(n for k, n in sizes.items() if k.startswith("blocks.0."))
    need = sum(sizes.values()) + (cfg.layers - 1) * per_layer
    total = formats.count_own_shards(path, world)
    if total < need:
        raise formats.bad(source, "sizes", f"a model the {world} shard files can hold ({total} values)",
                      f"sizes that need {need} values (vocab_size={cfg.vocab_size}, hidden={cfg.hidden}, "
                      f"layers={cfg.layers}, max_positions={cfg.max_positions}, ...)")

