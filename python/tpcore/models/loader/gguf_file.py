"""GGUF files (llama.cpp's format): the config from the metadata, quantized weights kept.

models.gguf reads the file (tpcore.io.gguf for the header and metadata, pread for the
tensor data); this loader makes the model and loads each rank's rows, the raw blocks copied where
the model keeps the file's formats.
"""
from __future__ import annotations

from tpcore.io import stream as _stream
from tpcore.models.gguf import GGUFModel
from tpcore.models.loader.base import ModelLoader, first_rank_reads
from tpcore.models.memory import MODEL_PARTS
from tpcore.models.text import load_tokenizer
from tpcore.utils.dtypes import is_quantized, weight_formats

__all__ = ["GGUFLoader"]


class GGUFLoader(ModelLoader):
    """A .gguf file (`tpcore.models.from_gguf`)."""

    name = "GGUF"

    def load(self, path, comm, partition=None, progress=True, device=None, dtype=None, staging=None):
        g = first_rank_reads(comm, lambda: GGUFModel(path, "from_gguf"))
        if dtype is None or (isinstance(dtype, str) and dtype == "gguf"):
            dtype = g.model_dtypes()
        elif dtype is not None:
            weight_formats(dtype, "from_gguf", MODEL_PARTS)  # refused here, naming from_gguf
        model = self.build(g.config, comm, partition, device, dtype)
        # the parts stored quantized get the file's raw rows (copied as they are when the formats
        # match, requantized otherwise); the others dequantized rows
        with _stream.loading(_stream.staging_arg(None, "from_gguf") if staging is None else staging):
            model.load_state_dict_full(g.state_dict([k for k, v in model.dtypes.items() if is_quantized(v)]),
                                       progress=progress)
        info = g.tokenizer_info
        model.generation_config = {k: info[f] for k, f in (("eos_token_id", "eos_token_id"),
                                                            ("pad_token_id", "padding_token_id"))
                                   if info[f] is not None}
        model.gguf_tokenizer_info = info
        model.tokenizer = load_tokenizer(path, lazy=True) if info.get("model") is not None else None
        del g
        return model

