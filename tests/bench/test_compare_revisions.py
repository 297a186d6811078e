"""benchmarks/compare_revisions.py's pairing of two revisions' benchmark JSON: which numbers it
compares (times and rates, not counts or settings) and how list rows are named (by their
identifying fields, so that the same row pairs up whatever its position)."""
import importlib.util

import paths

_spec = importlib.util.spec_from_file_location("compare_revisions", paths.ROOT / "benchmarks" / "compare_revisions.py")
cr = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cr)


def test_kind_tells_times_from_rates_and_skips_the_rest():
    assert [cr.kind(k) for k in ("time_us", "ttft_ms", "decode_s", "busbw", "decode_tok_s", "gflops", "iters",
                                 "size", "threads", "params", "items")] == ["time", "time", "time", "rate", "rate",
                                                                            "rate", None, None, None, None, None]


def test_flatten_names_rows_by_their_fields_and_skips_the_environment():
    doc = {"env": {"time_us": 1.0}, "options": {"busbw": 2.0},
           "rows": [{"op": "all_reduce", "size": 4096, "mode": "private", "time_us": 10.5, "busbw": 0.4,
                     "iters": 100},
                    {"op": "all_gather", "size": 4096, "mode": "private", "time_us": 7.0, "ok": True}],
           "decode": {"gpt2": {"tpcore": {"decode_tok_s": 150.0, "threads": 2}}}}
    got = cr.flatten(doc)
    assert got == {"/rows[op=all_reduce,mode=private,size=4096]/time_us": 10.5,
                   "/rows[op=all_reduce,mode=private,size=4096]/busbw": 0.4,
                   "/rows[op=all_gather,mode=private,size=4096]/time_us": 7.0,
                   "/decode/gpt2/tpcore/decode_tok_s": 150.0}
    # the same rows in another order pair up with the same names
    doc["rows"].reverse()
    assert cr.flatten(doc) == got
