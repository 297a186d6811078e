"""What every checkpoint reader checks with: CheckpointError and bad() (the message
"<file>: <field>: expected <what>, found <what>"), strict JSON, regular files, small JSON
objects (config.json and the like), and ConfigFields (a config's fields, each checked)."""
from __future__ import annotations

import json
import math
import os
import stat

from tpcore.utils.args import is_int


class CheckpointError(ValueError):
    """A checkpoint file that is corrupt, or that disagrees with itself or with its config:
    a safetensors file (header length, JSON, dtypes, shapes, data_offsets), a config.json,
    tpcore_config.json, generation_config.json or ``*.safetensors.index.json``, or one of
    tpcore's own .npz / .safetensors checkpoints.  The message reads
    "<file>: <tensor or field>: expected <what>, found <what>"; the parts are also the
    attributes path, field, expected and found.  A lower-level error (JSON, UTF-8, zip)
    is chained as __cause__.  Raised before any memory is allocated for the model."""

    def __init__(self, message: str, *, path=None, field=None, expected=None, found=None):
        super().__init__(message)
        self.path, self.field, self.expected, self.found = path, field, expected, found


def _short(v, n: int = 80) -> str:
    r = v if isinstance(v, str) and not v.startswith("'") else repr(v)
    return r if len(r) <= n else r[:n - 3] + "..."


def bad(path, field, expected, found) -> CheckpointError:
    """CheckpointError "<path>: <field>: expected <expected>, found <found>" (found: a
    string as it is, another value as its repr cut at 80 characters)."""
    found_s = found if isinstance(found, str) else _short(found)
    return CheckpointError(f"{path}: {field}: expected {expected}, found {found_s}",
                           path=str(path), field=field, expected=expected, found=found)


def type_name(v) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null",
            int: "an integer", float: "a number"}.get(type(v), type(v).__name__) + f" ({_short(v, 40)})"


def parse_json(raw: bytes, path, field: str = "JSON"):
    """Strict JSON: UTF-8, no duplicate keys, no NaN/Infinity, bounded nesting."""
    def pairs(kv):
        d = {}
        for k, v in kv:
            if k in d:
                raise bad(path, f"key {k!r}", "each key once (duplicate keys are ambiguous)", "it twice")
            d[k] = v
        return d

    def const(name):
        raise bad(path, field, "standard JSON numbers", name)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad(path, field, "UTF-8 text", f"invalid byte {raw[e.start:e.start + 1]!r} at offset {e.start}") from e
    try:
        return json.loads(text, object_pairs_hook=pairs, parse_constant=const)
    except RecursionError as e:
        raise bad(path, field, "JSON nested to a sane depth", "nesting too deep to parse") from e
    except json.JSONDecodeError as e:
        raise bad(path, field, "valid JSON", f"{e.msg} at line {e.lineno} column {e.colno}") from e
    except CheckpointError:
        raise
    except ValueError as e:   # e.g. an integer of more than 4300 digits
        raise bad(path, field, "valid JSON", str(e)) from e


def regular_file(path: str) -> int:
    """The size of `path`, which must be a regular file (a symlink to one is fine): a
    directory, a FIFO (open would block) or a device (/dev/zero: endless) is refused."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise bad(path, "file", "a readable regular file", f"{type(e).__name__}: {e.strerror}") from e
    if not stat.S_ISREG(st.st_mode):
        kind = ("a directory" if stat.S_ISDIR(st.st_mode) else "a FIFO" if stat.S_ISFIFO(st.st_mode) else
                "a device" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode) else "not a regular file")
        raise bad(path, "file", "a regular file", kind)
    return st.st_size


def read_json_object(path: str, max_bytes: int = 64 << 20) -> dict:
    """A small JSON file (config.json and the like) that must hold one object."""
    size = regular_file(path)
    if size > max_bytes:
        raise bad(path, "file size", f"at most {max_bytes} bytes for a JSON file", f"{size} bytes")
    with open(path, "rb") as f:
        data = f.read(size + 1)  # bounded even if the file grows meanwhile (size <= max_bytes)
    if len(data) > max_bytes:
        raise bad(path, "file size", f"at most {max_bytes} bytes for a JSON file", "more")
    obj = parse_json(data, path)
    if not isinstance(obj, dict):
        raise bad(path, "top level", "a JSON object", type_name(obj))
    return obj


MISSING = object()
INT_MAX = 2 ** 31 - 1       # sizes the C core takes as C ints


class ConfigFields:
    """Typed reads of a config dict, each failure a CheckpointError naming the file and
    field: fields.int("n_head"), fields.num("layer_norm_epsilon", 1e-5), ..."""

    def __init__(self, d: dict, source: str):
        if not isinstance(d, dict):
            raise bad(source, "top level", "a JSON object", type_name(d))
        self.d, self.source = d, str(source)

    def get(self, key, default=MISSING):
        if key not in self.d:
            if default is MISSING:
                raise bad(self.source, key, "a value (a required field)", "no such field")
            return default
        return self.d[key]

    def int(self, key, default=MISSING, lo=1, hi=INT_MAX, null=False):
        v = self.get(key, default)
        if v is None and null:
            return None
        if not (is_int(v) and lo <= v <= hi):
            raise bad(self.source, key, f"an integer from {lo} to {hi}{' or null' if null else ''}", type_name(v))
        return v

    def num(self, key, default=MISSING, positive=True):
        v = self.get(key, default)
        if not (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                and (v > 0 or not positive)):
            raise bad(self.source, key, f"a finite number{' > 0' if positive else ''}", type_name(v))
        return float(v)

    def bool(self, key, default=MISSING):
        v = self.get(key, default)
        if v is None:
            v = default
        if not isinstance(v, bool):
            raise bad(self.source, key, "true or false", type_name(v))
        return v

    def str(self, key, default=MISSING, choices=None, note=""):
        v = self.get(key, default)
        if not isinstance(v, str) or (choices is not None and v not in choices):
            want = "a string" if choices is None else f"one of {', '.join(map(repr, choices))}{note}"
            raise bad(self.source, key, want, type_name(v))
        return v

    def obj(self, key):
        v = self.get(key, None)
        if v is not None and not isinstance(v, dict):
            raise bad(self.source, key, "an object or null", type_name(v))
        return v or {}

    def fail(self, key, expected, found):
        return bad(self.source, key, expected, found)
