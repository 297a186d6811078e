"""Checkpoint loaders, one per format behind one interface (`ModelLoader`), as vLLM's
model_loader keeps them.

- `base`: `ModelLoader`, the interface: load a path into a `TransformerLM`.
- `hf_folder`: `HFLoader`, Hugging Face folders (config.json + *.safetensors).
- `tpcore_folder`: `TpcoreFolderLoader`, the folders `TransformerLM.save_pretrained` writes.
- `gguf_file`: `GGUFLoader`, GGUF files (llama.cpp's format).
- `load`: the entry points `from_pretrained` (the loader a path needs) and `from_gguf`.

Loaders know formats (tpcore.io, models.hf, models.gguf); the model (models.lm) knows the
architecture and imports no loader.
"""
from tpcore.models.loader.base import ModelLoader
from tpcore.models.loader.gguf_file import GGUFLoader
from tpcore.models.loader.hf_folder import HFLoader
from tpcore.models.loader.load import from_gguf, from_pretrained
from tpcore.models.loader.tpcore_folder import TpcoreFolderLoader

__all__ = ["ModelLoader", "HFLoader", "TpcoreFolderLoader", "GGUFLoader", "from_pretrained", "from_gguf"]
