"""NumPy .npz archives, checked before they are read: .npy members only, no pickles,
headers that match the members' sizes; stored members can be opened lazily (FileTensor)."""
from __future__ import annotations

import math
import os
import sys
import zipfile
from typing import Dict

import numpy as np

from tpcore.io.checks import CheckpointError, bad, regular_file
from tpcore.io.lazy import FileTensor
from tpcore.io.safetensors import _ST_NAMES


def read_npz(path: str, lazy: bool = False) -> Dict[str, np.ndarray]:
    """Every array of a .npz archive, checked before it is read: a zip of .npy members
    only, no pickled objects, each member's .npy header consistent with the member's
    size (a header that lies about its shape allocates nothing).  Else CheckpointError.
    lazy: a stored (uncompressed, np.savez's) C-order member of a numeric little-endian
    dtype is a tpcore.io.formats.FileTensor at its bytes in the archive (read with pread on
    indexing: the loaders stream it; its CRC is checked first, reading it in 1 MiB pieces);
    the others are read."""
    if os.path.exists(path):
        regular_file(path)
    try:
        zf = zipfile.ZipFile(path)
    except FileNotFoundError:
        raise
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as e:
        raise bad(path, "file", "a NumPy .npz archive (zip)", f"{type(e).__name__}: {e}") from e
    out = {}
    with zf:
        for info in zf.infolist():
            member = info.filename
            if not member.endswith(".npy") or info.is_dir():
                raise bad(path, f"member {member!r}", "only .npy arrays in the archive", "another kind of member")
            key = member[:-4]
            if key in out:
                raise bad(path, f"array {key!r}", "each array once", "it twice")
            try:
                with zf.open(info) as f:
                    version = np.lib.format.read_magic(f)
                    if version == (1, 0):
                        shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
                    elif version == (2, 0):
                        shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
                    else:
                        raise bad(path, f"array {key!r}", ".npy format version 1.0 or 2.0", f"version {version}")
                    if dtype.hasobject:
                        raise bad(path, f"array {key!r} dtype", "a numeric dtype (pickled objects are refused)",
                                  str(dtype))
                    hdr = f.tell()
                    need = hdr + math.prod(shape) * dtype.itemsize
                if need != info.file_size:
                    raise bad(path, f"array {key!r}", f"{need} bytes for shape {shape} of {dtype}",
                              f"{info.file_size} bytes in the archive")
                st = _ST_NAMES.get(dtype.newbyteorder("=")) if dtype.byteorder in "<|" or \
                    (dtype.byteorder == "=" and sys.byteorder == "little") else None
                if lazy and st is not None and not fortran and info.compress_type == zipfile.ZIP_STORED:
                    with zf.open(info) as f:   # its CRC checked first, 1 MiB at a time (zipfile raises)
                        while f.read(1 << 20):
                            pass
                    out[key] = FileTensor(path, key, st, shape, _zip_data_offset(path, info) + hdr)
                    continue
                with zf.open(info) as f:
                    out[key] = np.lib.format.read_array(f, allow_pickle=False)
            except CheckpointError:
                raise
            except Exception as e:
                raise bad(path, f"array {key!r}", "a readable .npy array", f"{type(e).__name__}: {e}") from e
    return out


def _zip_data_offset(path: str, info) -> int:
    """Where a zip member's bytes start in the archive: after its local header (30 bytes,
    the name and an extra field whose lengths it gives)."""
    with open(path, "rb") as f:
        f.seek(info.header_offset)
        head = f.read(30)
    if len(head) != 30 or head[:4] != b"PK\x03\x04":
        raise bad(path, f"member {info.filename!r}", "a zip local file header", "something else")
    return info.header_offset + 30 + int.from_bytes(head[26:28], "little") + int.from_bytes(head[28:30], "little")
