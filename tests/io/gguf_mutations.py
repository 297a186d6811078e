"""Mutations of a real GGUF file, as an attacker or a bad disk makes them, and the rank function
that loads each one (tests/io/test_corrupt_gguf.py).

The positions come from this module's own walk of the header (`layout`, written from the
format's description, not tpcore's reader).  Each mutation is a list of edits applied to a
working copy of the file and undone after: ("w", offset, bytes) writes over, ("cut", size)
truncates, ("add", bytes) appends.
"""
import os
import resource
import struct
import time

# metadata value types: id -> element size (None: string; 9: array)
_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def layout(path):
    """{'kv': {key: {...positions}}, 'tensors': [{...}], 'data': data section offset,
    'kv_end': where the tensor infos start}: byte positions in the file."""
    with open(path, "rb") as f:
        raw = f.read(4 << 20)      # the header of the file used here is 1.8 MB
    pos = 4 + 4 + 8 + 8
    n_t, n_kv = struct.unpack_from("<QQ", raw, 8)
    kv = {}

    def string(p):
        (n,) = struct.unpack_from("<Q", raw, p)
        return raw[p + 8:p + 8 + n].decode(), p + 8 + n
    for _ in range(n_kv):
        start = pos
        key, pos = string(pos)
        (vt,) = struct.unpack_from("<I", raw, pos)
        info = {"start": start, "type": pos, "value": pos + 4}
        pos += 4
        if vt == 8:
            _, pos = string(pos)
        elif vt == 9:
            et, cnt = struct.unpack_from("<IQ", raw, pos)
            info.update(elem_type=pos, count=pos + 4, n=cnt)
            pos += 12
            if et == 8:
                for _ in range(cnt):
                    _, pos = string(pos)
            else:
                pos += cnt * _SIZES[et]
        else:
            pos += _SIZES[vt]
        kv[key] = info
    kv_end = pos
    tensors = []
    for _ in range(n_t):
        start = pos
        name, pos = string(pos)
        (nd,) = struct.unpack_from("<I", raw, pos)
        dims = struct.unpack_from(f"<{nd}Q", raw, pos + 4)
        t = {"name": name, "start": start, "ndims": pos, "dims": pos + 4, "nd": nd, "shape": dims}
        pos += 4 + 8 * nd
        t["type"] = pos
        (t["ggml_type"],) = struct.unpack_from("<I", raw, pos)
        t["offset"] = pos + 4
        (t["rel"],) = struct.unpack_from("<Q", raw, pos + 4)
        pos += 12
        tensors.append(t)
    assert pos <= len(raw), "a header over 4 MiB: read more"
    return {"kv": kv, "tensors": tensors, "kv_end": kv_end, "infos_end": pos, "data": -(-pos // 32) * 32,
            "n_kv": n_kv, "n_t": n_t}


def u32(v):
    return struct.pack("<I", v)


def u64(v):
    return struct.pack("<Q", v)


def mutations(path):
    """[(name, edits, words the error must hold)] over header, metadata counts, tensor infos,
    offsets, alignment, types and truncation."""
    L = layout(path)
    kv, ts, size = L["kv"], L["tensors"], os.path.getsize(path)
    by = {t["name"]: t for t in ts}
    mid = ts[len(ts) // 2]                        # a quantized matrix in the middle of the file
    while mid["nd"] != 2 or mid["ggml_type"] != 3:
        mid = ts[ts.index(mid) + 1]
    after_mid = ts[ts.index(mid) + 1]
    norm = by["blk.3.attn_norm.weight"]
    last = ts[-1]
    out = [
        # the header
        ("magic", [("w", 0, b"GGUX")], ["magic"]),
        ("version 1", [("w", 4, u32(1))], ["version", "1"]),
        ("version big-endian", [("w", 4, struct.pack(">I", 3))], ["version", "big-endian"]),
        ("version 4", [("w", 4, u32(4))], ["version", "4"]),
        ("tensor_count 2**63", [("w", 8, u64(2 ** 63))], ["tensor_count", "forged"]),
        ("tensor_count 2**31-1", [("w", 8, u64(2 ** 31 - 1))], ["tensor_count"]),
        ("tensor_count +1", [("w", 8, u64(L["n_t"] + 1))], ["tensor"]),
        ("tensor_count -1", [("w", 8, u64(L["n_t"] - 1))], []),
        ("tensor_count 0", [("w", 8, u64(0))], ["block_count"]),
        ("kv_count 2**64-1", [("w", 16, u64(2 ** 64 - 1))], ["kv_count", "forged"]),
        ("kv_count +1", [("w", 16, u64(L["n_kv"] + 1))], ["tensor info #0"]),
        ("kv_count -1", [("w", 16, u64(L["n_kv"] - 1))], ["tensor"]),
        # metadata values and counts
        ("block_count 2**31-1", [("w", kv["llama.block_count"]["value"], u32(2 ** 31 - 1))],
         ["llama.block_count", "at most the number of tensors"]),
        ("block_count +1", [("w", kv["llama.block_count"]["value"], u32(31))], ["blk.30", "no such tensor"]),
        ("block_count 0", [("w", kv["llama.block_count"]["value"], u32(0))], ["llama.block_count"]),
        ("embedding_length 2**31-1", [("w", kv["llama.embedding_length"]["value"], u32(2 ** 31 - 1))],
         ["embedding_length"]),
        ("head_count_kv 7", [("w", kv["llama.attention.head_count_kv"]["value"], u32(7))], ["head_count_kv"]),
        ("vocab_size 2**31-1", [("w", kv["llama.vocab_size"]["value"], u32(2 ** 31 - 1))], ["vocab_size"]),
        ("context_length 2**32-1", [("w", kv["llama.context_length"]["value"], u32(2 ** 32 - 1))],
         ["llama.context_length"]),
        ("token_type count 2**33", [("w", kv["tokenizer.ggml.token_type"]["count"], u64(2 ** 33))],
         ["tokenizer.ggml.token_type", "forged"]),
        ("token_type count 10**7", [("w", kv["tokenizer.ggml.token_type"]["count"], u64(10 ** 7))], []),
        ("token_type count -1", [("w", kv["tokenizer.ggml.token_type"]["count"],
                                      u64(kv["tokenizer.ggml.token_type"]["n"] - 1))], []),
        ("tokens count 2**33", [("w", kv["tokenizer.ggml.tokens"]["count"], u64(2 ** 33))],
         ["tokenizer.ggml.tokens"]),
        ("tokens count 10**7", [("w", kv["tokenizer.ggml.tokens"]["count"], u64(10 ** 7))], []),
        ("tokens count 0", [("w", kv["tokenizer.ggml.tokens"]["count"], u64(0))], []),
        ("merges count 2**40", [("w", kv["tokenizer.ggml.merges"]["count"], u64(2 ** 40))],
         ["tokenizer.ggml.merges"]),
        ("key length 2**63", [("w", kv["general.name"]["start"], u64(2 ** 63))], ["metadata key #"]),
        ("string length 2**40", [("w", kv["general.name"]["value"], u64(2 ** 40))], ["general.name"]),
        ("value type 13", [("w", kv["general.name"]["type"], u32(13))], ["general.name", "value type"]),
        ("nested array", [("w", kv["tokenizer.ggml.token_type"]["elem_type"], u32(9))],
         ["tokenizer.ggml.token_type", "arrays"]),
        ("token_type as strings", [("w", kv["tokenizer.ggml.token_type"]["elem_type"], u32(8))],
         ["tokenizer.ggml.token_type"]),
        ("architecture", [("w", kv["general.architecture"]["value"] + 8, b"llamb")], ["general.architecture"]),
        # general.alignment (llama.block_count's key renamed: same length, a UINT32)
        ("alignment 30", [("w", kv["llama.block_count"]["start"] + 8, b"general.alignment")],
         ["general.alignment", "power of two"]),
        ("alignment 4096", [("w", kv["llama.block_count"]["start"] + 8, b"general.alignment"),
                            ("w", kv["llama.block_count"]["value"], u32(4096))], ["offset", "padded to 4096"]),
        # tensor infos
        ("name length 0", [("w", mid["start"], u64(0))], ["tensor name"]),
        ("name length 2**63", [("w", mid["start"], u64(2 ** 63))], ["tensor name"]),
        ("duplicate name", [("w", by["blk.0.attn_k.weight"]["start"] + 8, b"blk.0.attn_q.weight")],
         ["blk.0.attn_q.weight", "two tensors"]),
        ("unknown tensor", [("w", by["blk.0.attn_k.weight"]["start"] + 8, b"blk.0.attn_z.weight")],
         ["blk.0.attn_z.weight"]),
        ("n_dims 0", [("w", mid["ndims"], u32(0))], ["n_dims"]),
        ("n_dims 5", [("w", mid["ndims"], u32(5))], ["n_dims"]),
        ("dim 2**63", [("w", mid["dims"] + 8, u64(2 ** 63))], ["shape"]),
        ("dim 0", [("w", mid["dims"] + 8, u64(0))], ["shape"]),
        ("dim not whole blocks", [("w", mid["dims"], u64(mid["shape"][0] + 1))], ["shape", "blocks"]),
        ("dims swapped", [("w", mid["dims"], u64(mid["shape"][1]) + u64(mid["shape"][0]))], [mid["name"], "shape"]),
        ("type 99", [("w", mid["type"], u32(99))], [mid["name"], "99"]),
        ("type Q4_1 -> Q4_0", [("w", mid["type"], u32(2))], [after_mid["name"], "offset"]),
        ("type Q4_1 -> Q8_0", [("w", mid["type"], u32(8))], [after_mid["name"], "offset"]),
        ("type Q4_1 -> F32", [("w", mid["type"], u32(0))], []),
        ("type F32 -> F16 (a norm)", [("w", norm["type"], u32(1))], ["offset"]),
        ("type F32 -> F16 (the last tensor)", [("w", last["type"], u32(1))], ["after"]),
        ("type Q4_1 -> Q4_K", [("w", mid["type"], u32(12))], []),
        # offsets
        ("all offsets 0", [("w", t["offset"], u64(0)) for t in ts], ["offset"]),
        ("offset +1", [("w", mid["offset"], u64(mid["rel"] + 1))], [mid["name"], "misaligned"]),
        ("offset +32", [("w", mid["offset"], u64(mid["rel"] + 32))], [mid["name"], "hole"]),
        ("offset -32 (overlap)", [("w", mid["offset"], u64(mid["rel"] - 32))], [mid["name"], "overlapping"]),
        ("offset past the end", [("w", last["offset"], u64(size))], [last["name"]]),
        ("offset 2**64-1", [("w", mid["offset"], u64(2 ** 64 - 1))], [mid["name"]]),
        ("two offsets swapped", [("w", mid["offset"], u64(after_mid["rel"])),
                                 ("w", after_mid["offset"], u64(mid["rel"]))], [mid["name"], "offset"]),
        # truncation and additions
        ("cut in the magic", [("cut", 3)], ["magic"]),
        ("cut in the header", [("cut", 20)], ["truncated"]),
        ("cut in the metadata", [("cut", kv["tokenizer.ggml.tokens"]["value"] + 5000)], ["truncated"]),
        ("cut in the tensor infos", [("cut", (L["kv_end"] + L["infos_end"]) // 2)], ["truncated"]),
        ("cut at the data", [("cut", L["data"])], ["truncated"]),
        ("cut in the data", [("cut", L["data"] + (size - L["data"]) // 2)], ["truncated"]),
        ("last byte cut", [("cut", size - 1)], ["truncated"]),
        ("bytes appended", [("add", b"\0" * 4096)], ["after"]),
    ]
    return out


def apply(work, edits, src):
    """Apply edits to the working copy; returns what undoes them."""
    undo = []
    with open(work, "r+b") as f:
        for e in edits:
            if e[0] == "w":
                f.seek(e[1])
                undo.append(("w", e[1], f.read(len(e[2]))))
                f.seek(e[1])
                f.write(e[2])
            elif e[0] == "cut":
                undo.append(("restore",))
                f.truncate(e[1])
            else:
                undo.append(("cut", os.path.getsize(work)))
                f.seek(0, 2)
                f.write(e[1])
    return undo[::-1]


def undo_edits(work, undo, src):
    with open(work, "r+b") as f:
        for e in undo:
            if e[0] == "w":
                f.seek(e[1])
                f.write(e[2])
            elif e[0] == "cut":
                f.truncate(e[1])
            else:
                n = f.seek(0, 2)
                with open(src, "rb") as s:
                    s.seek(n)
                    while True:
                        chunk = s.read(8 << 20)
                        if not chunk:
                            break
                        f.write(chunk)


def load_each(comm, src, work, only=None):
    """Every mutation of src loaded into work by tpcore.models.from_gguf on comm: for each,
    (name, error class, message, seconds, how many times this rank parsed the header), then
    this rank's peak resident memory (bytes).  Rank 0 edits the working copy between loads."""
    import tpcore
    import tpcore.io.gguf as reader
    parsed = [0]
    real_init = reader.GGUFFile.__init__

    def counting(self, path):
        parsed[0] += 1
        real_init(self, path)
    reader.GGUFFile.__init__ = counting
    out = []
    for name, edits, _ in mutations(src):
        if only is not None and name not in only:
            continue
        undo = apply(work, edits, src) if comm.rank == 0 else None
        comm.barrier()
        parsed[0] = 0
        t0 = time.perf_counter()
        try:
            tpcore.models.from_gguf(work, comm, progress=False)
            res = ("loaded", "")
        except Exception as e:  # noqa: BLE001 - the class and text are what the test checks
            res = (type(e).__name__, str(e))
        dt = time.perf_counter() - t0
        comm.barrier()
        if comm.rank == 0:
            undo_edits(work, undo, src)
        out.append([name, res[0], res[1], dt, parsed[0]])
    return {"results": out, "maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
