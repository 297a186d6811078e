"""The layers benchmark's peer: the same MLP in torch.distributed with gloo (Megatron style,
custom autograd Functions around the all-reduces), on processes of its own, and its rows
combined over the ranks."""
from __future__ import annotations

import gc
import math
import time

import numpy as np

from tpcore.bench._layers_tpcore import _inputs, _timed
from tpcore.bench._sweep import Progress


# -------------------------------------------------------------- torch peer

def _torch_worker(rank: int, n: int, port: int, plan: dict, iters: list, threads: int, conn) -> None:
    """One gloo rank (a multiprocessing "spawn" child): all shapes."""
    from tpcore.bench._peers import gloo_rank

    with gloo_rank(rank, n, port, conn, threads, timeout_s=600) as (torch, dist):
        import torch.nn.functional as F

        progress = Progress(plan["progress"] and rank == 0)
        comm_t = [0.0]

        def all_reduce(t):
            t0 = time.perf_counter_ns()
            dist.all_reduce(t)
            comm_t[0] += (time.perf_counter_ns() - t0) * 1e-9
            return t

        class CopyToParallel(torch.autograd.Function):
            """fc1's input: identity forward, all-reduce of the gradient backward."""
            @staticmethod
            def forward(ctx, t):
                return t

            @staticmethod
            def backward(ctx, g):
                return all_reduce(g.contiguous())

        class ReduceFromParallel(torch.autograd.Function):
            """fc2's output: all-reduce forward, identity backward."""
            @staticmethod
            def forward(ctx, t):
                return all_reduce(t)

            @staticmethod
            def backward(ctx, g):
                return g

        def barrier():
            dist.barrier()

        rows = []
        for shape, it in zip(plan["shapes"], iters):
            h, f, t = shape["hidden"], shape["ffn"], shape["tokens"]
            tag = f"[layers] torch n={n} h={h} T={t}"
            progress.status(f"{tag}: setup", important=True)
            fl = f // n + (1 if rank < f % n else 0)
            g = torch.Generator().manual_seed(1234 + rank)
            W1 = torch.nn.Parameter(torch.randn(fl, h, generator=g) / math.sqrt(h))
            b1 = torch.nn.Parameter(torch.randn(fl, generator=g) * 0.1)
            W2 = torch.nn.Parameter(torch.randn(h, fl, generator=g) / math.sqrt(f))
            b2 = torch.nn.Parameter(torch.randn(h, generator=torch.Generator().manual_seed(99)) * 0.1)
            xn, dyn = _inputs(h, t)
            x = torch.from_numpy(xn).requires_grad_(True)
            dyt = torch.from_numpy(dyn)

            def forward(xin):
                hh = F.linear(CopyToParallel.apply(xin), W1, b1)
                return ReduceFromParallel.apply(F.linear(F.gelu(hh), W2)) + b2

            def step():
                x.grad = None
                forward(x).backward(dyt)

            def fwd():
                with torch.no_grad():
                    forward(x)

            row = {"hidden": h, "ffn": f, "tokens": t, "n": n, "rank": rank, "threads": torch.get_num_threads(),
                   "iters": it}
            y = forward(x)
            y.backward(dyt)
            if plan["check"]:  # float64, per-rank partial sums all-reduced (the TP math), on the first rows
                k = min(t, plan["check_rows"])
                with torch.no_grad():
                    x64, dy64 = x.detach()[:k].double(), dyt[:k].double()
                    W1d, b1d, W2d = W1.detach().double(), b1.detach().double(), W2.detach().double()
                    z = x64 @ W1d.T + b1d
                    yp = F.gelu(z) @ W2d.T
                    cdf = 0.5 * (1 + torch.erf(z / math.sqrt(2.0)))
                    dxp = ((dy64 @ W2d) * (cdf + z * torch.exp(-0.5 * z * z) / math.sqrt(2 * math.pi))) @ W1d
                    dist.all_reduce(yp)
                    dist.all_reduce(dxp)
                    yref = yp + b2.detach().double()
                    if rank == 0:
                        row["err_y"] = float((y.detach()[:k].double() - yref).abs().max())
                        row["err_dx"] = float((x.grad[:k].double() - dxp).abs().max())
                        row["ref_max"] = float(max(yref.abs().max(), dxp.abs().max()))
                        row["check_rows"] = k
            for _ in range(max(0, plan["warmup"] - 1)):
                barrier()
                step()
            progress.status(f"{tag}: {it} steps", important=True)
            comm_t[0] = 0.0
            row["step_s"] = _timed(step, it, barrier)
            row["comm_total_s"] = comm_t[0]
            row["fwd_s"] = _timed(fwd, max(1, it), barrier)
            rows.append(row)
            W1 = b1 = W2 = b2 = x = dyt = y = None  # released (the closures above hold these names: no del)
            gc.collect()
        progress.done()
        info = {"torch": torch.__version__, "threads": torch.get_num_threads(),
                "interop_threads": torch.get_num_interop_threads(),
                "mkl": bool(torch.backends.mkl.is_available()), "mkldnn": bool(torch.backends.mkldnn.is_available())}
        try:
            import re
            m = re.search(r"BLAS_INFO=([\w.-]+)", torch.__config__.show())
            info["blas"] = f"BLAS_INFO={m.group(1)}" if m else None
        except Exception:  # noqa: BLE001 - the BLAS name is informational
            pass
        conn.send(("ok", rows, info))


def _run_torch(n: int, plan: dict, iters: list, threads: int, timeout: float):
    """(per-rank rows, info) or (None, note)."""
    from tpcore.bench._peers import run_ranks

    per_rank, info, note = run_ranks(n, _torch_worker, (plan, iters, threads), timeout, "torch")
    return (per_rank, info) if per_rank is not None else (None, note)

def _combine_torch(per_rank: list, n: int) -> list:
    out = []
    for k in range(len(per_rank[0])):
        rr = [per_rank[r][k] for r in range(n)]
        r0 = rr[0]
        out.append({"hidden": r0["hidden"], "ffn": r0["ffn"], "tokens": r0["tokens"], "n": n,
                    "threads": r0["threads"], "iters": r0["iters"],
                    "step_ms": max(np.mean(r["step_s"]) for r in rr) * 1e3,
                    "step_min_ms": max(np.min(r["step_s"]) for r in rr) * 1e3,
                    "fwd_ms": max(np.mean(r["fwd_s"]) for r in rr) * 1e3,
                    "comm_share": max(r["comm_total_s"] / float(np.sum(r["step_s"])) for r in rr),
                    "err_y": r0.get("err_y"), "err_dx": r0.get("err_dx"), "ref_max": r0.get("ref_max")})
    return out
