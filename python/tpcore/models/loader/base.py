"""The interface of the checkpoint loaders: one `ModelLoader` per format.

A loader knows its format's files (through tpcore.io, models.hf and models.gguf) and the
model only through its public face: the constructor (a Config and the split), the
`load_state_dict_full` of full tensors in tpcore's names, `weights()` for a sharded folder.
`from_pretrained` (models/loader/load.py) picks the loader a path needs.
"""
from __future__ import annotations

from typing import Any, Optional

from tpcore.distributed.comm import Comm
from tpcore.models.lm import TransformerLM
from tpcore.nn.config import Config

__all__ = ["ModelLoader"]


class ModelLoader:
    """A checkpoint format `tpcore.models.from_pretrained` loads.

    Subclasses (one per format: `HFLoader`, `TpcoreFolderLoader`, `GGUFLoader`) implement
    `load`; `build` makes the model the checkpoint's tensors are then loaded into.
    """

    #: the format's name, for messages
    name = ""

    def load(self, path: str, comm: Comm, partition: Any = None, progress: bool = True,
             device: Optional[str] = None, dtype: Any = None, staging: Optional[int] = None) -> TransformerLM:
        """A TransformerLM loaded from path, split over comm (see `from_pretrained`).

        Parameters
        ----------
        path : str
            The checkpoint (a directory, or a file for GGUF).
        comm : Comm
            The ranks that share the model.
        partition : list of int or list of (int, int), optional
            Query heads per rank (default None: even).
        progress : bool, default True
            Show a progress line on rank 0.
        device : str, optional
            "cpu" (default) or "cuda[:N]".
        dtype : str or dict, optional
            The weights' storage (default None: the format's default).
        staging : int, optional
            The staging buffer's bytes (default None: the environment's default).

        Returns
        -------
        TransformerLM
        """
        raise NotImplementedError(f"{type(self).__name__}.load")

    @staticmethod
    def build(cfg: Config, comm: Comm, partition: Any, device: Optional[str], dtype: Any) -> TransformerLM:
        """The model a checkpoint of cfg loads into: allocated, its values left for the load."""
        return TransformerLM(cfg, comm, partition=partition, device=device, dtype=dtype, _loading=True)
