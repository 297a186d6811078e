"""`python -m tpcore.bench families`: the table, the JSON and its refusals (not a timing test)."""
import json
import subprocess
import sys

import pytest


def _bench(*args):
    return subprocess.run([sys.executable, "-m", "tpcore.bench", "families", *args], capture_output=True, text=True,
                          timeout=300)


def test_families_quick_table_and_json(tmp_path):
    out = tmp_path / "f.json"
    r = _bench("--quick", "--worlds", "1", "--rounds", "1", "--families", "gemma2,qwen3,mistral", "--json", str(out))
    assert r.returncode == 0, r.stderr
    data = json.loads(out.read_text())
    rows = {(x["family"], x["world"]): x for x in data["rows"]}
    assert set(rows) == {("llama", 1), ("gemma2", 1), ("qwen3", 1), ("mistral", 1)}   # llama: the reference row
    assert rows[("llama", 1)]["vs_llama"] == 1.0
    for x in rows.values():
        assert x["decode_tok_s"] > 0 and x["p50_ms"] > 0 and x["kv_mb"] > 0
    # quick: prompt 8 + 4 new = 12 > 2 windows of 4: the sliding layers' caches are rings (smaller)
    assert rows[("mistral", 1)]["kv_mb"] < rows[("llama", 1)]["kv_mb"]
    assert "vs llama" in r.stdout and "gemma2" in r.stdout


@pytest.mark.parametrize("args,words", [(["--families", "gpt5"], "unknown families"),
                                        (["--worlds", "0"], "--worlds"), (["--worlds", "a"], "--worlds"),
                                        (["--new", "1"], "--new")])
def test_families_bad_arguments(args, words):
    r = _bench("--quick", *args)
    assert r.returncode == 2 and words in r.stderr and "Traceback" not in r.stderr
