"""The layers benchmark's output: the environment header, the tables (tpcore, memory, the
torch peer), the summary against the targets, and the plot (matplotlib, optional)."""
from __future__ import annotations

import importlib.metadata
import math
import os
import sys
from typing import List, Optional

import numpy as np

TARGETS = {"numpy_ratio": 0.9, "comm_share": 0.10, "param_ratio": 0.01}
CHECK_TOL = 1e-3  # relative to max(1, max |reference|)

# ---------------------------------------------------------------- printing

def _version(dist: str) -> Optional[str]:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _numpy_blas_info() -> str:
    try:
        from threadpoolctl import threadpool_info
        here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        libs = [d for d in threadpool_info() if d.get("user_api") == "blas"
                and not os.path.abspath(d["filepath"]).startswith(here + os.sep)]
        if libs:
            d = libs[0]
            return (f"{d.get('internal_api')} {d.get('version')} ({os.path.basename(d['filepath'])}, "
                    f"{d.get('architecture')}, {d.get('threading_layer')}, {d.get('num_threads')} threads by default)")
    except ImportError:
        pass
    try:
        cfg = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
        return f"{cfg.get('name')} {cfg.get('version')}"
    except Exception:  # noqa: BLE001 - the BLAS name is informational
        return "unknown"


def print_header(env: dict, plan: dict, peers: List[str], worlds_threads: dict) -> None:
    import tpcore

    w = sys.stdout.write
    w("# tpcore layers benchmark: ParallelMLP (column fc1 -> GELU -> row fc2), forward + backward\n#\n")
    aff = env.get("affinity")
    w(f"#  host {env['hostname']}: nproc {env['nproc']}{f' ({aff} usable)' if aff and aff != env['nproc'] else ''}"
      f", {env.get('cpu') or 'unknown CPU'}\n")
    w(f"#  python {env['python']}, numpy {env['numpy']}, tpcore {env['tpcore']}, torch {_version('torch') or '-'}"
      f", threadpoolctl {_version('threadpoolctl') or '- (not installed)'}, scipy {_version('scipy') or '-'}\n")
    build = env.get("tpcore_build") or {}
    w(f"#  tpcore build: {build.get('build', '?')}, backends {build.get('backends')}, "
      f"sanitize {build.get('sanitize') or 'none'}\n")
    w(f"#  tpcore BLAS: {tpcore.build_info().get('blas')}\n")
    w(f"#  NumPy BLAS:  {_numpy_blas_info()}\n")
    w("#  " + "  ".join(f"{k}={env.get(k) if env.get(k) is not None else '(unset)'}"
                        for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")) + "\n")
    others = {k: v for k, v in env.get("env", {}).items() if k not in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")}
    if others:
        w("#  " + "  ".join(f"{k}={v}" for k, v in others.items()) + "\n")
    w("#  BLAS threads per rank (tpcore default: cores / local ranks; NumPy and torch set to the same): "
      + ", ".join(f"n={n}: {t}" for n, t in worlds_threads.items()) + "\n")
    cores = env.get("affinity") or env.get("nproc") or 1
    over = [n for n in plan["worlds"] if n > cores]
    if over:
        w(f"#  worlds {','.join(map(str, over))} exceed the {cores} usable cores: those ranks share cores "
          f"(oversubscribed), so their per-rank GF/s are a share of a core\n")
    shapes = ", ".join(f"h={s['hidden']} f={s['ffn']} T={s['tokens']}" for s in plan["shapes"])
    w(f"#  shapes {shapes}; worlds {','.join(map(str, plan['worlds']))}; float32\n")
    it = (f"{plan['iters']} per configuration" if plan["iters"] else
          f"auto (~{plan['target_s']:g} s of steps per configuration, {plan['min_iters']}..{plan['max_iters']})")
    w(f"#  iterations {it}; {plan['warmup']} warm-up step(s) (the first also checks against float64)\n")
    load = env.get("loadavg")
    if load:
        w(f"#  load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at start (other work on the machine "
          f"disturbs the numbers)\n")
    if peers:
        from tpcore.bench._peers import availability
        why = availability("gloo")
        what = f"skipped, {why}" if why else f"torch {_version('torch')}"
        w(f"#  peer  torch.distributed gloo: {what}\n")
    else:
        w("#  peer  none\n")
    sys.stdout.flush()


def _f(v, spec, width):
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return f"{'-':>{width}}"
    return f"{v:>{width}{spec}}"

def _err_flag(row) -> str:
    e = row.get("err_y")
    if e is None:
        return ""
    tol = CHECK_TOL * max(1.0, row.get("ref_max") or 0.0)
    return "" if max(row["err_y"], row["err_dx"]) <= tol else " BAD"


def print_tables(rows: list, torch_rows: list, torch_note: Optional[str]) -> None:
    w = sys.stdout.write
    w("#\n# tpcore ParallelMLP (times: per rank mean/min over iterations, max over ranks; GF/s: slowest rank)\n")
    w(f"#{'h':>5} {'f':>6} {'T':>4} {'n':>2} {'thr':>3} {'iters':>5} {'step ms':>9} {'min ms':>9} {'fwd ms':>9} "
      f"{'GF/s':>7} {'GF/s-c':>7} {'NumPy':>7} {'/NP':>5} {'/NP-c':>5} {'comm%':>6} {'param':>7} "
      f"{'err y':>8} {'err dx':>8}\n")
    for r in rows:
        w(f" {r['hidden']:>5} {r['ffn']:>6} {r['tokens']:>4} {r['n']:>2} {r['threads']:>3} {r['iters']:>5} "
          f"{r['step_ms']:>9.3f} {r['step_min_ms']:>9.3f} {r['fwd_ms']:>9.3f} {r['gflops']:>7.1f} "
          f"{r['gflops_nocomm']:>7.1f} {r['numpy_gflops']:>7.1f} {r['ratio_numpy']:>5.2f} "
          f"{r['ratio_numpy_nocomm']:>5.2f} {100 * r['comm_share']:>5.1f}% {r['param_ratio']:>7.4f} "
          f"{_f(r['err_y'], '.1e', 8)} {_f(r['err_dx'], '.1e', 8)}{_err_flag(r)}\n")
    w("#\n# where a rank's bytes are (ParallelMLP.memory() after the timed steps, the largest rank; MB) and the "
      "process's peak RSS\n")
    w(f"#{'h':>5} {'f':>6} {'T':>4} {'n':>2} {'params':>8} {'grads':>8} {'work':>8} {'comm':>7} {'total':>8} "
      f"{'peak RSS':>9}\n")
    for r in rows:
        m = r["memory"]
        w(f" {r['hidden']:>5} {r['ffn']:>6} {r['tokens']:>4} {r['n']:>2} {m['params'] / 1e6:>8.2f} "
          f"{m['grads'] / 1e6:>8.2f} {m['workspace'] / 1e6:>8.2f} {m['comm'] / 1e6:>7.2f} {m['total'] / 1e6:>8.2f} "
          f"{r['rss_peak_bytes'] / 1e6:>9.0f}\n")
    if torch_rows or torch_note:
        w("#\n# vs torch.distributed gloo (same shapes, threads and iterations; speed-up = torch / tpcore)\n")
    if torch_rows:
        idx = {(r["hidden"], r["tokens"], r["n"]): r for r in torch_rows}
        w(f"#{'h':>5} {'f':>6} {'T':>4} {'n':>2} {'thr':>3} {'tpcore ms':>10} {'torch ms':>10} {'speed-up':>9} "
          f"{'tp fwd':>9} {'torch fwd':>10} {'fwd s-up':>9} {'torch comm%':>12} {'torch err':>10}\n")
        for r in rows:
            q = idx.get((r["hidden"], r["tokens"], r["n"]))
            if q is None:
                continue
            err = None if q.get("err_y") is None else max(q["err_y"], q["err_dx"])
            w(f" {r['hidden']:>5} {r['ffn']:>6} {r['tokens']:>4} {r['n']:>2} {q['threads']:>3} "
              f"{r['step_ms']:>10.3f} {q['step_ms']:>10.3f} {q['step_ms'] / r['step_ms']:>8.2f}x "
              f"{r['fwd_ms']:>9.3f} {q['fwd_ms']:>10.3f} {q['fwd_ms'] / r['fwd_ms']:>8.2f}x "
              f"{100 * q['comm_share']:>11.1f}% {_f(err, '.1e', 10)}{_err_flag(q)}\n")
    if torch_note:
        w(f"#  torch: {torch_note}\n")
    sys.stdout.flush()


def summarize(rows: list, torch_rows: list) -> dict:
    w = sys.stdout.write
    s: dict = {"targets": TARGETS}
    w("#\n# " + "=" * 100 + "\n# Summary\n")
    lo = min(rows, key=lambda r: r["ratio_numpy"])
    lo_c = min(rows, key=lambda r: r["ratio_numpy_nocomm"])
    below = [r for r in rows if r["ratio_numpy_nocomm"] < TARGETS["numpy_ratio"]]
    s["numpy_ratio_min"] = lo["ratio_numpy"]
    s["numpy_ratio_nocomm_min"] = lo_c["ratio_numpy_nocomm"]
    s["numpy_below_target"] = [_key(r) for r in below]
    w(f"#  tpcore / NumPy GF/s: min {lo['ratio_numpy']:.2f} (step, at {_key(lo)}), min {lo_c['ratio_numpy_nocomm']:.2f}"
      f" without communication (at {_key(lo_c)}); target >= {TARGETS['numpy_ratio']}\n")
    if below:
        w("#    below target without communication at: "
          + ", ".join(f"{_key(r)} {r['ratio_numpy_nocomm']:.2f}" for r in below) + "\n")
    cs = [r for r in rows if r["hidden"] == 1024 and r["tokens"] == 8 and r["n"] == 2]
    if cs:
        r = cs[0]
        s["comm_share_h1024_T8_n2"] = r["comm_share"]
        ok = r["comm_share"] < TARGETS["comm_share"]
        w(f"#  comm share at h=1024 T=8 n=2: {100 * r['comm_share']:.1f}% (max over ranks; mean "
          f"{100 * r['comm_share_mean']:.1f}%), target < {100 * TARGETS['comm_share']:.0f}% -> "
          f"{'OK' if ok else 'MISSED'}\n")
    pr = max(rows, key=lambda r: r["param_ratio"])
    s["param_ratio_max"] = pr["param_ratio"]
    ok = abs(pr["param_ratio"] - 1) <= TARGETS["param_ratio"]
    w(f"#  per-rank parameter bytes / (full / n): max {pr['param_ratio']:.4f} (at {_key(pr)}), target within "
      f"{100 * TARGETS['param_ratio']:.0f}% -> {'OK' if ok else 'MISSED'}\n")
    bad = [r for r in rows if _err_flag(r)]
    s["check_failed"] = [_key(r) for r in bad]
    checked = [r for r in rows if r.get("err_y") is not None]
    if checked:
        w(f"#  float64 check: max err y {max(r['err_y'] for r in checked):.1e}, dx "
          f"{max(r['err_dx'] for r in checked):.1e}" + (f"; FAILED at {', '.join(_key(r) for r in bad)}" if bad
                                                         else " -> OK") + "\n")
    if torch_rows:
        idx = {(r["hidden"], r["tokens"], r["n"]): r for r in torch_rows}
        sp = []
        for r in rows:
            q = idx.get((r["hidden"], r["tokens"], r["n"]))
            if q:
                sp.append((r, q["step_ms"] / r["step_ms"], q["fwd_ms"] / r["fwd_ms"]))
        s["speedup_vs_torch"] = [{"config": _key(r), "step": a, "fwd": b} for r, a, b in sp]
        slower = [(r, a, b) for r, a, b in sp if a < 1 or b < 1]
        if sp:
            w(f"#  speed-up vs torch/gloo (step): min {min(a for _, a, _ in sp):.2f}x, max "
              f"{max(a for _, a, _ in sp):.2f}x; forward only: min {min(b for _, _, b in sp):.2f}x, max "
              f"{max(b for _, _, b in sp):.2f}x\n")
            if slower:
                w("#  tpcore slower than torch at: " + ", ".join(f"{_key(r)} (step {a:.2f}x, fwd {b:.2f}x)"
                                                               for r, a, b in slower) + "\n")
            else:
                w(f"#  tpcore faster than torch at all {len(sp)} configurations (step and forward only)\n")
        tbad = [q for q in torch_rows if _err_flag(q)]
        if tbad:
            w(f"#  torch float64 check FAILED at {', '.join(_key(q) for q in tbad)} (its timings are suspect)\n")
    sys.stdout.flush()
    return s


def _key(r) -> str:
    return f"h={r['hidden']} T={r['tokens']} n={r['n']}"


def plot(path: str, rows: list, torch_rows: list, env: dict) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        print("# --plot: matplotlib is not installed, so no plot was written (pip install matplotlib)",
              file=sys.stderr)
        return False
    shapes = sorted({(r["hidden"], r["tokens"]) for r in rows})
    ncols = 2 if len(shapes) > 1 else 1
    nrows = (len(shapes) + ncols - 1) // ncols
    fig, axes = plt.subplots(nrows, ncols, figsize=(6 * ncols, 4 * nrows + 0.6), squeeze=False)
    legend: dict = {}
    for k, (h, t) in enumerate(shapes):
        ax = axes[k // ncols][k % ncols]
        for series, label, style in ((rows, "tpcore", dict(color="C0", marker="o")),
                                     (torch_rows, "torch gloo", dict(color="C2", marker="^"))):
            pts = sorted((r["n"], r["step_ms"], r["fwd_ms"]) for r in series if (r["hidden"], r["tokens"]) == (h, t))
            if not pts:
                continue
            ns, st, fw = zip(*pts)
            ax.plot(ns, st, label=f"{label} fwd+bwd", **style)
            ax.plot(ns, fw, label=f"{label} fwd", linestyle="--", alpha=0.7, **style)
        ax.set_xticks(sorted({r["n"] for r in rows}))
        ax.set_yscale("log")
        # labels at 1, 2, 5 x 10^k only (labelling every minor tick made 0.9 and 1 overlap)
        fmt = matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}")
        ax.yaxis.set_major_formatter(fmt)
        ax.yaxis.set_minor_locator(matplotlib.ticker.LogLocator(base=10, subs=(2.0, 5.0)))
        ax.yaxis.set_minor_formatter(fmt)
        ax.tick_params(axis="y", which="minor", labelsize=7)
        ax.set_title(f"h={h}, f={4 * h if not rows else next(r['ffn'] for r in rows if r['hidden'] == h)}, T={t}")
        ax.set_xlabel("ranks")
        ax.set_ylabel("ms per step")
        ax.grid(True, alpha=0.3, which="both")
        for hd, lb in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(lb, hd)
    for k in range(len(shapes), nrows * ncols):
        axes[k // ncols][k % ncols].set_visible(False)
    fig.suptitle(f"ParallelMLP step time on {env['hostname']} ({env['nproc']} CPUs; lower is better)", fontsize=11)
    cols = 4 if ncols > 1 else 2  # one panel wide: two legend rows, so that nothing is cut off
    fig.legend(list(legend.values()), list(legend.keys()), loc="lower center", ncol=cols, fontsize=9)
    rows_of_legend = -(-len(legend) // cols)
    fig.tight_layout(rect=(0, 0.35 * rows_of_legend / (4 * nrows + 0.6), 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"# wrote {path}")
    return True
