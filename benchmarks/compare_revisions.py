"""Two revisions of tpcore, benchmarked in one interleaved run: is a change within noise?

    python benchmarks/compare_revisions.py BEFORE AFTER [--rounds 3] [--out DIR]

Each revision is checked out with `git worktree` under --out and built in place
(`setup.py build_ext --inplace`, CPU-only); then, round after round, the collectives, layers and
decode benchmarks (`python -m tpcore.bench ...`, small fixed configurations) run once for each
revision, alternating which goes first, so that a machine shared with other work slows both
alike.  Every number of the benchmarks' JSON whose key names a time or a rate is paired across
the two revisions by its place in the document; the table gives each pair's median over the
rounds and the ratio after / before (for times, > 1 is slower; for rates, > 1 is faster), and
the JSON file (--out/compare.json) every round's value.  The revisions must share the
benchmarks' command lines and JSON layout (rows that exist in one only are listed, not compared).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCHES = {
    "collectives": ["collectives", "-n", "2", "--ops", "all_reduce,all_gather,reduce_scatter", "--min-bytes", "4K",
                    "--max-bytes", "16M", "--factor", "16", "--peers", "none", "--no-progress"],
    "layers": ["layers", "--hidden", "1024,4096", "--tokens", "8,512", "--worlds", "1,2", "--peers", "none"],
    "decode": ["decode", "--worlds", "1,2", "--peers", "none"],
}
TIME_KEYS = ("_us", "_ms", "_s")  # key endings of times (microseconds, milliseconds, seconds)
RATE_KEYS = ("busbw", "algbw", "tok_s", "gflops", "gbs", "_per_s")


def kind(key):
    k = key.lower()
    if any(k.endswith(r) or r in k for r in RATE_KEYS):
        return "rate"
    if any(k.endswith(t) for t in TIME_KEYS) or k in ("us", "ms", "s"):
        return "time"
    return None


def flatten(doc, path=""):
    """{path: value} of the numbers under keys that name a time or a rate; list items are named by
    their identifying fields (size, op, n, mode, hidden, tokens, dtype, world) when they have them."""
    out = {}
    if isinstance(doc, dict):
        for k, v in doc.items():
            if k in ("env", "argv", "options", "plan"):
                continue
            if isinstance(v, (int, float)) and not isinstance(v, bool) and kind(k):
                out[f"{path}/{k}"] = float(v)
            elif isinstance(v, (dict, list)):
                out.update(flatten(v, f"{path}/{k}"))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            tag = str(i)
            if isinstance(v, dict):
                ids = [f"{f}={v[f]}" for f in ("op", "impl", "mode", "bytes", "size", "n", "world", "hidden", "tokens",
                                               "dtype")
                       if f in v and not isinstance(v[f], (dict, list))]
                tag = ",".join(ids) or tag
            out.update(flatten(v, f"{path}[{tag}]"))
    return out


def build(rev, where):
    if not os.path.isdir(where):
        subprocess.run(["git", "worktree", "add", "-f", "--detach", where, rev], cwd=ROOT, check=True,
                       capture_output=True)
    env = dict(os.environ, TPCORE_CUDA="0")
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace", "-j", "2"], cwd=where, env=env,
                       capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"building {rev} in {where} failed:\n{r.stderr[-3000:]}")
    took = time.monotonic() - t0
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=where, capture_output=True,
                         text=True).stdout.strip()
    print(f"# built {rev} ({sha}) in {took:.0f} s (setup.py build_ext --inplace -j 2, CPU-only; from scratch "
          f"in a new worktree)", file=sys.stderr, flush=True)
    return sha


def run_bench(where, name, out_json, timeout, reuse=False):
    if reuse:  # --reuse: the JSON an earlier run of this script wrote
        with open(out_json) as f:
            return flatten(json.load(f))
    env = dict(os.environ, PYTHONPATH=os.path.join(where, "python"))
    cmd = [sys.executable, "-m", "tpcore.bench", *BENCHES[name], "--json", out_json]
    r = subprocess.run(cmd, cwd=where, env=env, capture_output=True, text=True, timeout=timeout)
    if r.returncode:
        sys.exit(f"{' '.join(cmd)} in {where} failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    with open(out_json) as f:
        return flatten(json.load(f))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("before")
    p.add_argument("after")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default="/tmp/tpcore-compare")
    p.add_argument("--benches", default=",".join(BENCHES), help="comma list of " + ", ".join(BENCHES))
    p.add_argument("--timeout", type=float, default=900, help="seconds one benchmark run may take")
    p.add_argument("--reuse", action="store_true", help="no build and no run: pair the JSON files an earlier run left "
                   "in --out again")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    revs = {"before": a.before, "after": a.after}
    trees = {k: os.path.join(a.out, k) for k in revs}
    if a.reuse:
        shas = {k: subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=trees[k], capture_output=True,
                                  text=True).stdout.strip() for k in revs}
    else:
        shas = {k: build(revs[k], trees[k]) for k in revs}
    names = [b for b in a.benches.split(",") if b]
    vals = {k: {} for k in revs}  # side -> path -> [value per round]
    for rnd in range(a.rounds):
        for name in names:
            order = ("before", "after") if rnd % 2 == 0 else ("after", "before")
            for side in order:
                got = run_bench(trees[side], name, os.path.join(a.out, f"{name}-{side}-{rnd}.json"), a.timeout,
                                a.reuse)
                for k, v in got.items():
                    vals[side].setdefault(f"{name}{k}", []).append(v)
            print(f"# round {rnd + 1}/{a.rounds}: {name} done", file=sys.stderr, flush=True)
    both = sorted(set(vals["before"]) & set(vals["after"]))
    only = sorted(set(vals["before"]) ^ set(vals["after"]))
    rows = []
    print(f"# before {revs['before']} ({shas['before']}), after {revs['after']} ({shas['after']}), "
          f"{a.rounds} interleaved rounds; medians")
    width = max([len(k) for k in both] + [6])
    print(f"{'metric':<{width}} {'before':>12} {'after':>12} {'after/before':>12}")
    for k in both:
        b, f = statistics.median(vals["before"][k]), statistics.median(vals["after"][k])
        ratio = f / b if b else float("nan")
        rows.append({"metric": k, "kind": kind(k.rsplit("/", 1)[-1]), "before": vals["before"][k],
                     "after": vals["after"][k], "ratio_of_medians": ratio})
        print(f"{k:<{width}} {b:>12.4g} {f:>12.4g} {ratio:>12.3f}")
    if only:
        print(f"# {len(only)} metrics in one revision only (not compared), e.g. {only[:3]}")
    with open(os.path.join(a.out, "compare.json"), "w") as fh:
        json.dump({"before": revs["before"], "after": revs["after"], "shas": shas, "rounds": a.rounds,
                   "rows": rows, "only_in_one": only}, fh, indent=1)


if __name__ == "__main__":
    main()
