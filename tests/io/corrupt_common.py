"""Helpers of the corrupt-file tests (test_corrupt_files.py, test_corrupt_own_formats.py): copies
of the fixtures, config.json edits, a safetensors file's raw st_parts, and the error a corrupt file
must raise."""
import json
import os
import shutil
import struct

import numpy as np
import pytest

import tpcore
from tpcore import CheckpointError
from tpcore.io.formats import read_safetensors
import paths

FIX = str(paths.FIXTURES)
GPT2_ST = os.path.join(FIX, "gpt2", "model.safetensors")


def copy_fixture(tmp_path, name, sub="ckpt"):
    d = tmp_path / sub
    d.mkdir()
    for f in os.listdir(os.path.join(FIX, name)):
        if f != "expected.npz":
            shutil.copy(os.path.join(FIX, name, f), d / f)
    return d


def read_config(d):
    return json.loads((d / "config.json").read_text())


def set_config(d, **kw):
    c = read_config(d)
    c.update(kw)
    (d / "config.json").write_text(json.dumps(c))


def read_tensors(path):
    t, _ = read_safetensors(path)
    return {k: np.array(v) for k, v in t.items()}


def st_parts(path):
    """(header dict in file order, the data section) of a safetensors file."""
    raw = open(path, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def write_raw(path, header, data, n=None):
    h = header if isinstance(header, bytes) else json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h) if n is None else n) + h + data)


def must_raise(call, *words):
    """call() must raise CheckpointError whose message has every word; returns it."""
    with pytest.raises(CheckpointError) as e:
        call()
    msg = str(e.value)
    for w in words:
        assert str(w) in msg, f"{w!r} not in {msg!r}"
    assert "expected" in msg and "found" in msg, msg
    assert isinstance(e.value, ValueError)
    return e.value


def load_model(comm, d):
    return tpcore.models.from_pretrained(str(d), comm, progress=False)
