"""The 1-vs-N report (python -m tpcore.bench report): the memory-read probe it rests on, the advice it
computes from measurements (never canned: other numbers give other advice), and a quick run end to
end whose numbers are checked against what the model's shapes imply."""
import copy
import json
import subprocess
import sys

import numpy as np
import pytest

from tpcore import _C
from tpcore.bench import report


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 4099, 1 << 16])
def test_read_bytes_is_the_sum_of_the_words(n):
    rng = np.random.default_rng(n)
    a = rng.integers(0, 256, n, dtype=np.uint8).view(np.uint8)
    a32 = np.frombuffer(np.concatenate([a, np.zeros((-n) % 4, np.uint8)]).tobytes(), np.float32).copy()
    raw = a32.view(np.uint8)
    words = raw[:raw.size // 8 * 8].view(np.uint64)
    expect = (int(words.astype(object).sum()) + int(raw[raw.size // 8 * 8:].astype(np.int64).sum())) % 2 ** 64
    assert _C.read_bytes(a32) == expect


def test_read_bytes_refuses_what_is_not_an_array():
    with pytest.raises(TypeError):
        _C.read_bytes([1.0, 2.0])
    with pytest.raises((TypeError, ValueError)):
        _C.read_bytes(np.ones((4, 4), np.float32)[:, ::2])  # not contiguous


def _data(decode_tok_s_2, comm_s_2, read_gbs=20.0):
    """A synthetic report: world 1 and 2 of a model whose weights are 400 MB."""
    cfg = dict(hidden=1024, layers=4, heads=8, kv_heads=8, head_dim=128, ffn_hidden=4096, vocab_size=32000,
               activation="gelu", model_type="gpt2")

    def row(n, tok_s, comm_s, params):
        step = 1.0 / tok_s
        return {"n": n, "threads": 1, "prefill_s": 0.5 / n, "ttft_s": 0.6 / n, "decode_s": 31 * step,
                "p50_s": step, "p99_s": step * 1.2, "steps_s": [step] * 31, "param_bytes": [params] * n,
                "kv_bytes": [1 << 20] * n, "rss_peak_bytes": [params + (60 << 20)] * n,
                "rss_load_bytes": [params + (40 << 20)] * n, "rss_load_peak_bytes": [2 * params] * n,
                "prefill_tok_s": 128 * n,
                "decode_tok_s": tok_s, "same_tokens": True,
                "comm_decode": {"attention": {"calls": 124, "bytes": 124 * 4096, "seconds_max": comm_s * 31 / 2,
                                              "seconds_min": comm_s * 31 / 4},
                                "mlp": {"calls": 124, "bytes": 124 * 4096, "seconds_max": comm_s * 31 / 2,
                                        "seconds_min": comm_s * 31 / 4},
                                "total": {"calls": 248, "bytes": 248 * 4096, "seconds_max": comm_s * 31,
                                          "seconds_min": comm_s * 31 / 2}} if n > 1 else {"total": {
                                    "calls": 0, "bytes": 0, "seconds_max": 0.0, "seconds_min": 0.0}},
                "comm_prefill": {}, "bytes_per_token": 0.0,
                "bench": [{"op": "all_reduce", "bytes": 4096, "time_us": 3.0, "algbw": 1.4, "busbw": 1.4}]}

    return {"config": cfg, "batch": 1, "prompt": 64, "new": 32, "concurrency": [1],
            "limits": {"cores": 2, "read_gbs": {1: read_gbs, 2: read_gbs * 1.1}, "gemm_gflops": {1: 80.0, 2: 150.0},
                       "numpy_gemm_gflops": 140.0},
            "worlds": [row(1, 40.0, 0.0, 400_000_000), row(2, decode_tok_s_2, comm_s_2, 200_000_000)]}


def test_advice_follows_the_measurements():
    slow = report.advice(_data(decode_tok_s_2=30.0, comm_s_2=0.012))
    fast = report.advice(_data(decode_tok_s_2=70.0, comm_s_2=0.001))
    assert slow != fast
    s, f = "\n".join(slow), "\n".join(fast)
    # TP=2 slower than TP=1: say so, and that TP=2 is only for memory
    assert "TP=1 decodes faster here (40.0 vs 30.0 tok/s); TP=2 only for memory (50%" in s
    assert "collectives take 36% of a decode step" in s  # 12 ms of a 33.3 ms step
    assert "TP=2 decodes 1.75x as fast as TP=1" in f and "only for memory" not in f
    # 400 MB per token at 40 tok/s = 16 GB/s = 80% of a 20 GB/s host: memory bound
    assert "at 16.0 GB/s = 80% of this host's measured read bandwidth" in s and "bound by memory" in s
    relaxed = "\n".join(report.advice(_data(70.0, 0.001, read_gbs=100.0)))
    assert "= 16% of this host's" in relaxed and "not bound by memory" in relaxed
    # the link line compares the model's all-reduce with the benchmark's at the same size: 6 ms per call
    # against 3 us is waiting, not the link (and saving all of the link's 248 calls x 3 us / 31 steps)
    assert "against 3.0 us in the collectives benchmark" in s and "ranks waiting for each other" in s
    assert "a faster link would save at most 0.02 ms per step" in s
    # the load's peak (twice the parameters) against the steady state
    assert "building or loading the model peaked at 800 MB per rank, 1.81x the 442 MB resident" in s
    # every number in the advice comes from the data: change the data, the text changes
    d = _data(30.0, 0.012)
    d2 = copy.deepcopy(d)
    d2["worlds"][1]["param_bytes"] = [150_000_000] * 2
    assert report.advice(d) != report.advice(d2)


def test_report_quick_end_to_end(tmp_path):
    out = tmp_path / "rep"
    r = subprocess.run([sys.executable, "-m", "tpcore.bench", "report", "--quick", "--hetero", "--no-progress",
                        "--out", str(out), "--json"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    md = (out / "report.md").read_text()
    for section in ("## The host's own limits", "## Speed at each world size", "## Same results at every world size",
                    "## Memory per rank",
                    "## Time in collectives, per layer kind", "## Advice from these measurements"):
        assert section in md
    data = json.loads((out / "report.json").read_text())
    one, two = data["worlds"]
    assert (one["n"], two["n"]) == (1, 2)
    assert one["same_tokens"] and two["same_tokens"]
    # parity (tpcore.bench parity's numbers): world 2's next-token distributions are world 1's
    assert data["parity"]["tokens"] == 64 and one["parity"]["kl_max"] == 0.0
    assert 0.0 <= two["parity"]["kl_mean"] <= two["parity"]["kl_max"] < 1e-6 and two["parity"]["agree"] == 1.0
    assert two["parity"]["ppl"] == pytest.approx(one["parity"]["ppl"], rel=1e-5) and two["parity"]["ppl"] > 1
    assert two["parity"]["diverges_at"] is None
    for row in (one, two):
        assert row["prefill_tok_s"] > 0 and row["decode_tok_s"] > 0 and 0 < row["p50_s"] <= row["p99_s"]
        assert len(row["steps_s"]) == data["new"] - 1
    assert all(v > 0 for v in data["limits"]["read_gbs"].values())
    cfg = data["config"]
    # parameters per rank: world 2 holds half of every split weight; the norms are replicated
    C, L = cfg["hidden"], cfg["layers"]
    norms = (2 * L + 1) * C * 4
    assert two["param_bytes"][0] - norms / 2 == pytest.approx((one["param_bytes"][0] - norms) / 2, rel=0.02)
    # KV cache per rank: kv_heads split over 2 ranks, batch x (prompt + new) positions, K and V
    kv_total = 2 * L * data["batch"] * (data["prompt"] + data["new"]) * cfg["kv_heads"] * cfg["head_dim"] * 4
    assert one["kv_bytes"] == [kv_total] and two["kv_bytes"] == [kv_total // 2] * 2
    assert data["advice"] and all(any(ch.isdigit() for ch in line) for line in data["advice"])
    # collectives per layer kind in the decode steps: one all-reduce of B x hidden float32 after the
    # attention and one after the MLP of every block, per step; the regions add up to the total
    steps, B = data["new"] - 1, data["batch"]
    dec = two["comm_decode"]
    for kind in ("attention", "mlp"):
        assert dec[kind]["calls"] == L * steps and dec[kind]["bytes"] == L * steps * B * C * 4
    assert dec["embedding"]["calls"] == steps and dec["head"]["calls"] == steps
    assert sum(v["calls"] for k, v in dec.items() if k != "total") == dec["total"]["calls"]
    assert sum(v["seconds_min"] for k, v in dec.items() if k != "total") <= dec["total"]["seconds_max"] * 1.0001
    # the link table compares the same message size in the collectives benchmark
    assert any(b["op"] == "all_reduce" and b["bytes"] == B * C * 4 and b["wrong"] == 0 for b in two["bench"])
    # serving: every concurrency level at every world size, the tokens checked against generate
    for row in (one, two):
        assert sorted(int(c) for c in row["serve"]) == data["concurrency"] == [1, 4]
        for c, s in row["serve"].items():
            assert s["same_as_generate"] and s["throughput_tok_s"] > 0 and s["generated_tokens"] > 0
            assert s["requests"] == max(4, 2 * int(c)) and s["peak_running"] <= int(c)
            assert 0 < s["latency_p50_s"] <= s["latency_p99_s"] and 0 < s["ttft_p50_s"] <= s["ttft_p99_s"]
    # the mismatched-devices section: equal vs planned shards at worlds 2 and 3
    het = data["hetero"]
    assert {(x["case"], x["world"]) for x in het["rows"]} == {(c, w) for c in ("mlp", "prefill", "decode")
                                                               for w in (2, 3)}
    assert "## Mismatched devices" in md and "## Concurrent requests" in md
    try:
        import matplotlib  # noqa: F401 (only whether it is installed)
    except ImportError:
        return
    assert {p.name for p in out.glob("*.png")} >= {"speed.png", "memory.png", "decode_breakdown.png",
                                                   "serving.png", "hetero.png"}


def test_report_from_a_checkpoint(tmp_path):
    """--checkpoint: the model's shapes come from the directory, and every world size loads it."""
    import tpcore
    ckpt = tmp_path / "ckpt"

    def save(comm):
        cfg = tpcore.Config(vocab_size=300, hidden=48, layers=2, heads=3, ffn_hidden=80, max_positions=64)
        tpcore.models.TransformerLM(cfg, comm, seed=5).save_pretrained(str(ckpt), hf=True)

    tpcore.spawn(save, 1)
    out = tmp_path / "rep"
    r = subprocess.run([sys.executable, "-m", "tpcore.bench", "report", "--quick", "--checkpoint", str(ckpt),
                        "--worlds", "1,3", "--no-serve", "--no-plots", "--no-progress", "--out", str(out), "--json"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    data = json.loads((out / "report.json").read_text())
    assert data["config"]["vocab_size"] == 300 and data["config"]["heads"] == 3
    assert [w["n"] for w in data["worlds"]] == [1, 3] and all(w["same_tokens"] for w in data["worlds"])
    assert "serve" not in data["worlds"][0] and not list(out.glob("*.png"))


def test_report_refuses_bad_arguments(tmp_path):
    def run(*extra):
        return subprocess.run([sys.executable, "-m", "tpcore.bench", "report", "--quick", "--no-progress",
                               "--out", str(tmp_path), *extra], capture_output=True, text=True, timeout=120)
    for extra, msg in ((["--worlds", "0,2"], "integers >= 1"), (["--new", "1"], "--new >= 2"),
                       (["--model", "tiny", "--checkpoint", str(tmp_path)], "not both"),
                       (["--device", "tpu"], "--device must be cpu or cuda")):
        r = run(*extra)
        assert r.returncode != 0 and msg in r.stderr, (extra, r.stderr[-2000:])
