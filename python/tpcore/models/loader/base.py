"""The interface of the checkpoint loaders: one `ModelLoader` per format.

A loader knows its format's files (through tpcore.io, models.hf and models.gguf) and the
model only through its public face: the constructor (a Config and the split), the
`load_state_dict_full` of full tensors in tpcore's names, `weights()` for a sharded folder.
`from_pretrained` (models/loader/load.py) picks the loader a path needs.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, TypeVar

import numpy as np

from tpcore.distributed.comm import Comm
from tpcore.io.checks import CheckpointError
from tpcore.models.lm import TransformerLM
from tpcore.nn.config import Config

__all__ = ["ModelLoader", "first_rank_reads"]

_T = TypeVar("_T")


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


# what rank 0's refusal of a file is raised as on every rank (anything else: RuntimeError)
_SHARED_ERRORS = {"CheckpointError": CheckpointError, "FileNotFoundError": FileNotFoundError,
                  "PermissionError": PermissionError, "IsADirectoryError": IsADirectoryError}


def first_rank_reads(comm: Comm, read: Callable[[], _T]) -> _T:
    """read() on rank 0 first, then on the other ranks only if rank 0 accepted the file: a
    file that rank 0 refuses is refused on every rank with rank 0's error (its class and
    message; the error's ``every_rank`` is True, so `collective` leaves the communicator
    usable), and no rank spends time or memory on a file already refused.  Collective (two
    broadcasts) when comm has more than one rank."""
    if not isinstance(comm, Comm) or comm.size == 1:
        return read()
    err: Optional[BaseException] = None
    out: Any = None
    msg = b""
    if comm.rank == 0:
        try:
            out = read()
        except Exception as e:  # noqa: BLE001 - whatever rank 0 met is what every rank raises
            err = e
            msg = f"{type(e).__name__}\0{e}".encode("utf-8", "replace")
    n = comm.broadcast(np.array([len(msg)], np.int64))
    if n[0]:
        buf = np.frombuffer(msg, np.uint8).copy() if comm.rank == 0 else np.empty(int(n[0]), np.uint8)
        comm.broadcast(buf)
        if err is None:
            kind, _, text = buf.tobytes().decode("utf-8", "replace").partition("\0")
            cls = _SHARED_ERRORS.get(kind)
            err = cls(text) if cls is not None else RuntimeError(f"rank 0 refused the checkpoint: {kind}: {text}")
        err.every_rank = True   # type: ignore[attr-defined]
        raise err
    return out if comm.rank == 0 else read()
