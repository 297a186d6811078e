"""Hugging Face checkpoint folders: config.json and *.safetensors (GPT-2, BERT, the decoder families).

Each rank reads only its slices of the tensors, mapped from Hugging Face's names to
tpcore's by models.hf, through one bounded staging buffer.
"""
from __future__ import annotations

from tpcore.io import formats
from tpcore.io import stream as _stream
from tpcore.models import hf as _hf
from tpcore.models.loader.base import ModelLoader
from tpcore.models.text import has_tokenizer, load_tokenizer
from tpcore.nn.config import Config
from tpcore.utils.arrays import resolve_device

__all__ = ["HFLoader"]


class HFLoader(ModelLoader):
    """A Hugging Face folder: config.json, *.safetensors, generation_config.json if any."""

    name = "Hugging Face safetensors"

    def load(self, path, comm, partition=None, progress=True, device=None, dtype=None, staging=None):
        cfg = Config.from_hf(path)
        headers = formats.read_headers(path)
        _hf.check_against_config(path, cfg, cfg.model_type, formats.HF_CONFIG, headers, warn=comm.rank == 0)
        gen = formats.read_generation_config(path)
        t = formats.open_tensors(path, headers)
        try:
            sd = _hf.from_hf(t, cfg)
        except KeyError as e:
            raise KeyError(f"{path}: the checkpoint has no tensor {e} (expected {cfg.model_type} names)") from None
        model = self.build(cfg, comm, partition, device, dtype or _checkpoint_dtype(headers, device, "from_pretrained"))
        with _stream.loading(staging):
            model.load_state_dict_full(sd, progress=progress)
        del t, sd
        model.generation_config = gen
        model.tokenizer = load_tokenizer(path, lazy=True) if has_tokenizer(path) else None
        return model


def _checkpoint_dtype(headers: dict, device, who: str) -> str:
    """The weight dtype a checkpoint loads into by default: on a GPU its own floating-point
    dtype when every float tensor has it and it is bfloat16 / float16; float32 otherwise (and
    always on the CPU)."""
    if resolve_device(device, who)[0] == "cpu":
        return "float32"
    names = {"BF16": "bfloat16", "F16": "float16"}
    kinds = {getattr(info, "dtype", None) for _, info in headers.values()} & {"F32", "F64", "BF16", "F16"}
    return names.get(kinds.pop(), "float32") if len(kinds) == 1 else "float32"

