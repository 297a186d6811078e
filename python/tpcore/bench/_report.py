"""Printing and plotting for the collectives benchmark: the environment header,
nccl-tests style tables, the comparison summary and the busbw plot."""
from __future__ import annotations

import importlib.metadata
import math
import sys
from typing import Dict, List, Optional

from tpcore.bench._sweep import human_bytes

# (impl, mode, label) in the order tables, summaries and plots show them.
SERIES = (("tpcore", "private", "tpcore private"), ("tpcore", "registered", "tpcore registered"),
          ("tpcore-mpi", "private", "tpcore mpi"), ("gloo", "private", "gloo"), ("mpi", "private", "mpi"))


def _version(dist: str) -> Optional[str]:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def print_header(env: dict, args, plan, peer_names: List[str], mpirun: str) -> None:
    from tpcore.bench._peers import availability

    out = sys.stdout
    w = out.write
    w("# tpcore collectives benchmark\n#\n")
    aff = env.get("affinity")
    w(f"#  host {env['hostname']}: {env['nproc']} CPUs"
      f"{f' ({aff} usable)' if aff and aff != env['nproc'] else ''}, {env.get('cpu') or 'unknown CPU'}\n")
    build = env.get("tpcore_build") or {}
    w(f"#  python {env['python']}, numpy {env['numpy']}, tpcore {env['tpcore']}"
      f"{'  build ' + _short_build(build) if build else ''}\n")
    w("#  " + "  ".join(f"{k}={env.get(k) if env.get(k) is not None else '(unset)'}"
                        for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")) + "\n")
    others = {k: v for k, v in env.get("env", {}).items() if k not in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")}
    if others:
        w("#  " + "  ".join(f"{k}={v}" for k, v in others.items()) + "\n")
    iters = (f"{plan.iters} per size" if plan.iters else
             f"auto (~{plan.target_s:g} s per size, {plan.min_iters}..{plan.max_iters})")
    w(f"#  ranks {args.nranks}, dtype {plan.dtype}, sum / root 0, in place; ops {', '.join(plan.ops)}; "
      f"modes {', '.join(plan.modes)}\n")
    w(f"#  sizes {human_bytes(plan.sizes[0])} .. {human_bytes(plan.sizes[-1])} ({len(plan.sizes)} sizes, "
      f"x{args.factor}); iterations {iters}; {plan.warmup} warm-up\n")
    load = env.get("loadavg")
    if load:
        w(f"#  load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at start (other work on the machine "
          f"disturbs the numbers)\n")
    w("#  time: per call, input rewritten + barrier before each call (untimed); per rank the mean, "
      "reported the max over ranks\n")
    if peer_names:
        parts = []
        for name in peer_names:
            why = availability(name, mpirun)
            if why:
                parts.append(f"{name}: skipped, {why}")
            elif name == "gloo":
                parts.append(f"gloo: torch {_version('torch')}, 1 thread per rank")
            elif name == "tpcore-mpi":
                parts.append(f"tpcore-mpi: tpcore's mpi backend via {mpirun}")
            else:
                parts.append(f"mpi: mpi4py {_version('mpi4py')} via {mpirun}"
                             f"{' ' + args.mpi_args if args.mpi_args else ''}")
        w("#  peers  " + "; ".join(parts) + "\n")
    else:
        w("#  peers  none\n")
    out.flush()


def _short_build(build: dict) -> str:
    keys = ("backends", "sanitizers", "debug", "compiler", "cflags")
    items = [f"{k}={build[k]}" for k in keys if k in build]
    return ", ".join(items) if items else ", ".join(f"{k}={v}" for k, v in list(build.items())[:4])


def _index(rows: List[dict]) -> Dict[tuple, dict]:
    return {(r["impl"], r["mode"], r["op"], r["nominal"]): r for r in rows if "unsupported" not in r}


def _unsupported(rows: List[dict]) -> Dict[tuple, str]:
    return {(r["impl"], r["mode"], r["op"]): r["unsupported"] for r in rows if "unsupported" in r}


_HEAD = (f"#{'size':>11} {'count':>11} {'type':>9} {'time(us)':>10} {'algbw(GB/s)':>12} {'busbw(GB/s)':>12} "
         f"{'#wrong':>7} {'iters':>6} {'memcpy(GB/s)':>13}")

_WHAT = {"all_reduce": "size = buffer", "broadcast": "size = buffer, root 0",
         "all_gather": "size = output; each rank sends size/n",
         "reduce_scatter": "size = input; each rank receives size/n",
         "all_to_all": "size = each rank's input and output; size/n to each rank"}


def print_tables(rows: List[dict], memcpy: List[dict], plan, n: int, peers) -> None:
    idx, unsup = _index(rows), _unsupported(rows)
    mc = {r["nominal"]: r for r in memcpy}
    impls_present = {r["impl"] for r in rows}
    w = sys.stdout.write
    for op in plan.ops:
        for impl, mode, label in SERIES:
            if impl not in impls_present or (impl == "tpcore" and mode not in plan.modes):
                continue
            w(f"#\n# {op} -- {label}{' arrays' if impl == 'tpcore' else ''} ({_WHAT[op]}, n={n})\n")
            if (impl, mode, op) in unsup:
                w(f"#   not measured: {unsup[(impl, mode, op)]}\n")
                continue
            w(_HEAD + "\n")
            missed = []
            for s in plan.sizes:
                r = idx.get((impl, mode, op, s))
                if r is None:
                    continue
                m = mc.get(s)
                wrong = "-" if r["wrong"] is None else str(r["wrong"])
                w(f"{r['bytes']:>12} {r['count']:>11} {r['dtype']:>9} {r['time_us']:>10.2f} {r['algbw']:>12.3f} "
                  f"{r['busbw']:>12.3f} {wrong:>7} {r['iters']:>6} {m['algbw'] if m else float('nan'):>13.3f}\n")
                if mode == "registered" and r.get("zero_copy", 1.0) < 1.0:
                    missed.append(r)
            if missed:
                w(f"#   zero-copy path not taken on every call at: "
                  f"{', '.join(human_bytes(r['bytes']) for r in missed)}\n")
    for p in peers:
        if p.rows is None:
            w(f"#\n# {p.name}: {p.note}\n")
    sys.stdout.flush()


def _fmt(v: Optional[float], spec: str, width: int) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return f"{'-':>{width}}"
    return f"{v:>{width}{spec}}"


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    if a is None or b is None or not b:
        return None
    return a / b


def print_summary(rows: List[dict], memcpy: List[dict], plan, n: int, peers, ref_sizes) -> dict:
    """The all_reduce comparison at the reference sizes, busbw / memcpy for
    registered arrays, and every point where tpcore is slower than a peer."""
    idx = _index(rows)
    mc = {r["nominal"]: r for r in memcpy}
    impls = {r["impl"] for r in rows if "unsupported" not in r}
    series = [(i, m, lab) for i, m, lab in SERIES if i in impls and (i != "tpcore" or m in plan.modes)]
    w = sys.stdout.write
    summary: dict = {"all_reduce": [], "slower_than_peer": {}, "wrong": {}}
    sizes = [s for s in ref_sizes if s in plan.sizes]
    w("#\n# " + "=" * 100 + "\n")
    w(f"# Summary: all_reduce, {plan.dtype}, {n} ranks (time = mean us per call; busbw GB/s)\n")
    if "all_reduce" in plan.ops and sizes:
        w(f"#{'size':>9} " + "".join(f"{label:>22}" for _, _, label in series) + f"{'memcpy':>9}\n")
        w(f"#{'':>9} " + "".join(f"{'time':>12}{'busbw':>10}" for _ in series) + f"{'GB/s':>9}\n")
        for s in sizes:
            line = f" {human_bytes(s):>9} "
            entry = {"size": s, "memcpy_gbs": mc[s]["algbw"] if s in mc else None}
            for impl, mode, label in series:
                r = idx.get((impl, mode, "all_reduce", s))
                line += _fmt(r and r["time_us"], ".1f", 12) + _fmt(r and r["busbw"], ".2f", 10)
                entry[label] = {"time_us": r["time_us"], "busbw": r["busbw"]} if r else None
            line += _fmt(entry["memcpy_gbs"], ".2f", 9)
            w(line + "\n")
            summary["all_reduce"].append(entry)
        # Speed-ups: peer time / tpcore time (> 1: tpcore is faster).
        peers_here = [(i, lab) for i, _m, lab in series if i != "tpcore"]
        mine = [(m, lab) for i, m, lab in series if i == "tpcore"]
        cols = [(tm, tl, pi, pl) for tm, tl in mine for pi, pl in peers_here]
        w("#\n# speed-up of tpcore = peer time / tpcore time (> 1: tpcore faster); "
          "registered busbw / memcpy\n")
        w(f"#{'size':>9} " + "".join(f"{f'{tm}/{pl}':>18}" for tm, _, _, pl in cols)
          + (f"{'registered/memcpy':>19}" if "registered" in plan.modes else "") + "\n")
        for entry in summary["all_reduce"]:
            s = entry["size"]
            line = f" {human_bytes(s):>9} "
            for _tm, tl, _pi, pl in cols:
                mine_r, peer_r = entry.get(tl), entry.get(pl)
                sp = _ratio(peer_r and peer_r["time_us"], mine_r and mine_r["time_us"])
                entry[f"speedup {tl} vs {pl}"] = sp
                line += _fmt(sp, ".2f", 17) + ("x" if sp is not None else " ")
            if "registered" in plan.modes:
                reg = entry.get("tpcore registered")
                rm = _ratio(reg and reg["busbw"], entry["memcpy_gbs"])
                entry["registered busbw / memcpy"] = rm
                line += _fmt(rm, ".2f", 18) + ("x" if rm is not None else " ")
            w(line + "\n")
        if "registered" in plan.modes:
            parts = [f"{human_bytes(e['size'])} {e['registered busbw / memcpy']:.2f}x"
                     for e in summary["all_reduce"] if e["size"] >= (16 << 20)
                     and e.get("registered busbw / memcpy") is not None]
            if parts:
                w(f"#  registered all_reduce busbw / memcpy bandwidth at the same size: {', '.join(parts)}\n")
                # memcpy need not be monotone in size (glibc switches to non-temporal
                # stores above a threshold derived from the cache size): also show the
                # ratio against the best large-size memcpy of this run.
                big = [r for r in memcpy if r["nominal"] >= (16 << 20)]
                if big:
                    best = max(big, key=lambda r: r["algbw"])
                    alt = []
                    for e in summary["all_reduce"]:
                        reg = e.get("tpcore registered")
                        if e["size"] >= (16 << 20) and reg:
                            alt.append(f"{human_bytes(e['size'])} {reg['busbw'] / best['algbw']:.2f}x")
                            e["registered busbw / best large memcpy"] = reg["busbw"] / best["algbw"]
                    summary["best_large_memcpy"] = {"size": best["nominal"], "gbs": best["algbw"]}
                    w(f"#  ... and against the best memcpy at >= 16 MiB ({best['algbw']:.2f} GB/s at "
                      f"{human_bytes(best['nominal'])}): {', '.join(alt)}\n")
    elif "all_reduce" not in plan.ops:
        w("#  (all_reduce was not measured)\n")
    else:
        w("#  (none of the reference sizes 4 KiB, 1 MiB, 16 MiB, 64 MiB is in the range)\n")

    # Every point where tpcore is slower than a peer (same op and size).
    for pi, _, pl in series:
        if pi == "tpcore":
            continue
        for mode in [m for m in plan.modes]:
            slower, total = [], 0
            for op in plan.ops:
                for s in plan.sizes:
                    mine_r, peer_r = idx.get(("tpcore", mode, op, s)), idx.get((pi, "private", op, s))
                    if not mine_r or not peer_r:
                        continue
                    total += 1
                    if mine_r["time_us"] > peer_r["time_us"]:
                        slower.append({"op": op, "size": mine_r["bytes"], "tpcore_us": mine_r["time_us"],
                                       "peer_us": peer_r["time_us"],
                                       "speedup": peer_r["time_us"] / mine_r["time_us"]})
            if not total:
                continue
            summary["slower_than_peer"][f"tpcore {mode} vs {pl}"] = slower
            if slower:
                w(f"#  tpcore {mode} slower than {pl} at {len(slower)} of {total} points:\n")
                for e in slower:
                    w(f"#    {e['op']:<15}{human_bytes(e['size']):>10}: {e['tpcore_us']:10.1f} us vs "
                      f"{e['peer_us']:10.1f} us ({e['speedup']:.2f}x)\n")
            else:
                w(f"#  tpcore {mode} faster than {pl} at all {total} points\n")

    for p in peers:
        if p.rows is None:
            w(f"#  {p.name}: {p.note}\n")
    wrong: dict = {}
    for r in rows:
        if "unsupported" in r:
            continue
        wrong.setdefault(r["impl"], 0)
        wrong[r["impl"]] += r["wrong"] or 0
    summary["wrong"] = wrong
    checked = plan.check
    w("#  wrong elements: " + ", ".join(f"{k} {v}" for k, v in wrong.items())
      + ("" if checked else " (check disabled)")
      + ("  -> OK" if checked and not any(wrong.values()) else ("  -> ERRORS" if checked else "")) + "\n")
    sys.stdout.flush()
    return summary


def plot(path: str, rows: List[dict], memcpy: List[dict], plan, n: int, env: dict, factor: int) -> bool:
    """One column per op: time per call (us) and busbw (GB/s) against size, both on
    log-log axes so that the small sizes (latency-bound) are as readable as the large
    ones (bandwidth-bound), the single-thread memcpy in each; below, a latency panel:
    the time of the smallest size per op and implementation."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker as mticker
    except ImportError:
        print("# --plot: matplotlib is not installed, so no plot was written (pip install 'tpcore[bench]' "
              "or pip install matplotlib); the tables and --json output are unaffected", file=sys.stderr)
        return False
    idx = _index(rows)
    ops = plan.ops
    geometric = {plan.sizes[0] * factor ** k for k in range(64)}
    ticks = [s for s in plan.sizes if s in geometric or s == plan.sizes[-1]]
    if len(ticks) > 9:  # at most ~9 labels a panel: every k-th, the largest kept
        k = -(-len(ticks) // 9)
        ticks = ticks[::k] + ([ticks[-1]] if (len(ticks) - 1) % k else [])
    ncols = len(ops)
    fig = plt.figure(figsize=(max(7.0, 4.3 * ncols), 11.5))
    grid = fig.add_gridspec(3, ncols, height_ratios=(1, 1, 0.85))
    styles = {"tpcore private": dict(color="C0", marker="o"), "tpcore registered": dict(color="C3", marker="s"),
              "tpcore mpi": dict(color="C4", marker="D", linestyle="--"),
              "gloo": dict(color="C2", marker="^", linestyle="--"), "mpi": dict(color="C1", marker="v",
                                                                            linestyle="-.")}
    sizes_fmt = mticker.FixedFormatter([human_bytes(s).replace(" ", "") for s in ticks])
    legend: Dict[str, object] = {}
    for k, op in enumerate(ops):
        for row, (key, ylabel) in enumerate((("time_us", "time per call (us)"), ("busbw", "busbw (GB/s)"))):
            ax = fig.add_subplot(grid[row, k])
            for impl, mode, label in SERIES:
                pts = [(r["bytes"], r[key]) for s in plan.sizes if (r := idx.get((impl, mode, op, s)))
                       and r[key] > 0]
                if pts:
                    ax.plot(*zip(*pts), label=label, markersize=3.5, **styles[label])
            ref = [(r["bytes"], r["time_us"] if key == "time_us" else r["algbw"]) for r in memcpy]
            ax.plot(*zip(*ref), color="k", linestyle=":", label="memcpy (1 thread)")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.xaxis.set_major_locator(mticker.FixedLocator(ticks))
            ax.xaxis.set_major_formatter(sizes_fmt)
            ax.xaxis.set_minor_locator(mticker.NullLocator())
            ax.yaxis.set_major_formatter(mticker.FuncFormatter(lambda v, _: f"{v:g}"))
            ax.tick_params(axis="x", labelrotation=45, labelsize=7)
            ax.tick_params(axis="y", labelsize=8)
            ax.grid(True, alpha=0.3, which="major")
            ax.grid(True, alpha=0.12, which="minor", axis="y")
            if row == 0:
                ax.set_title(f"{op} (n={n}, {plan.dtype})", fontsize=10)
            if k == 0:
                ax.set_ylabel(ylabel if key == "time_us" or n > 1 or op == "broadcast"
                              else ylabel + " (0 for n=1: not shown)")
            ax.set_xlabel("size", fontsize=8)
            for hd, lb in zip(*ax.get_legend_handles_labels()):
                legend.setdefault(lb, hd)
    # latency: the time of the smallest size, per op (groups) and implementation (bars)
    ax = fig.add_subplot(grid[2, :])
    small = plan.sizes[0]
    labels = [lb for impl, mode, lb in SERIES if any(idx.get((impl, mode, op, small)) for op in ops)]
    width = 0.8 / max(1, len(labels) + 1)
    for j, label in enumerate(labels + ["memcpy (1 thread)"]):
        vals = []
        for op in ops:
            if label.startswith("memcpy"):
                r = next((m for m in memcpy if m["bytes"] == small), None)
            else:
                impl, mode = next((i, m) for i, m, lb in SERIES if lb == label)
                r = idx.get((impl, mode, op, small))
            vals.append(r["time_us"] if r else float("nan"))
        xs = [i + (j - len(labels) / 2) * width for i in range(len(ops))]
        color = styles[label]["color"] if label in styles else "0.35"
        bars = ax.bar(xs, vals, width, color=color, label=label, alpha=0.85)
        for b, v in zip(bars, vals):
            if v == v:
                ax.annotate(f"{v:.1f}", (b.get_x() + b.get_width() / 2, v), ha="center", va="bottom", fontsize=7)
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(mticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.set_xticks(range(len(ops)))
    ax.set_xticklabels(ops)
    ax.set_ylabel("time per call (us)")
    ax.set_title(f"latency: the smallest size ({human_bytes(small)}), lower is better", fontsize=10)
    ax.grid(True, alpha=0.3, axis="y")
    ax.set_ylim(top=ax.get_ylim()[1] * 2.5)  # room for the value labels
    fig.suptitle(f"tpcore collectives on {env['hostname']} ({env['nproc']} CPUs; log-log: time lower, "
                 f"busbw higher is better)", fontsize=11)
    fig.legend(list(legend.values()), list(legend.keys()), loc="lower center", ncol=len(legend), fontsize=9)
    fig.tight_layout(rect=(0, 0.035, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"# wrote {path}")
    return True
