"""The sparse mixture-of-experts MLP (Mixtral): `MoE`, its expert parallelism, and the
router's load-balancing loss as transformers computes it (`load_balancing_loss`).

A float32 router (a replicated Linear hidden -> experts, no bias) scores each token; the
softmax over the experts, the top-k of it and (norm_topk_prob) those k weights divided by
their sum choose and weigh the experts; each expert is a SwiGLU MLP (fc1 = [gate; up] of
shape (2F, C), fc2 of shape (C, F)), and a token's output is the weighted sum of its k
experts' outputs.  Every GEMM and activation is a tpcore C kernel (_C.linear_forward /
linear_backward, act_forward / act_backward); the routing (softmax, top-k, the sort by
expert) is NumPy on the host.

Two ways to split the experts over a communicator's ranks (``mode``):

* ``"ep"`` (expert parallelism): each rank holds whole experts (expert_partition, default
  as even as can be: 8 experts on 3 ranks are 3, 3, 2); a rank's token-expert pairs,
  sorted by expert, travel to the ranks that hold their experts in one all_to_all (per
  rank counts: one small all-gather of the (ranks, experts) count matrix first), every
  expert runs one GEMM pair over the rows it received (an expert with no rows runs none
  and reads no weight), and a second all_to_all brings the outputs home, where the
  weighted sum is made.  Backward mirrors it (two all_to_alls).  ``replicated=True``: the
  ranks hold the same tokens (a tensor-parallel group): each dispatches only its share
  of the rows and the outputs are all-gathered (no token is computed twice).
* ``"tp"`` (tensor parallelism inside every expert, for few experts): each rank holds
  every expert's slice of F (fc1's gate and up rows, fc2's columns), the tokens are the
  same on every rank, and one all-reduce sums the partial outputs (one more in backward).

The temporary all_to_all: `_all_to_all` below (an all-gather of the sizes and the data)
stands in for ``Comm.all_to_all(x, send_sizes, recv_sizes=None, axis=0)`` until that lands;
it is the only function to swap.

Full-tensor names (`load_full` / `gather_full`): ``router.weight`` (experts, hidden),
``experts.{e}.fc1.weight`` (2F, hidden) [gate; up], ``experts.{e}.fc2.weight`` (hidden, F);
a MoE decoder layer prefixes them with ``moe.``.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from tpcore import _C
from tpcore.distributed.comm import Comm
from tpcore.io.formats import to_float32
from tpcore.nn.common import as_float32, check_grad, kept_output
from tpcore.utils.args import bool_arg, int_arg, seed_arg, shown
from tpcore.utils.arrays import asarray

__all__ = ["MoE", "load_balancing_loss"]

MODES = ("ep", "tp")


def _all_to_all(comm: Comm, x: np.ndarray, send_sizes: Sequence[int],
                recv_sizes: Optional[Sequence[int]] = None, axis: int = 0) -> np.ndarray:
    """x's rows split into blocks of send_sizes rows, block r sent to rank r; the rows received,
    concatenated in rank order (`Comm.all_to_all`; recv_sizes None: exchanged first)."""
    return comm.all_to_all(x, send_sizes, recv_sizes, axis)


def _even(n: int, parts: int) -> List[int]:
    return [n // parts + (1 if r < n % parts else 0) for r in range(parts)]


def _normal(seed: int, tag: int, shape, std: float = 0.02) -> np.ndarray:
    """The same float32 N(0, std) tensor for a (seed, tag) at every world size and mode."""
    return (np.random.default_rng([seed, tag]).standard_normal(shape) * std).astype(np.float32)


def _softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


class MoE:
    """A Mixtral sparse MoE MLP over a communicator's ranks (module doc).

    Parameters
    ----------
    hidden : int
        The model width C, >= 1.
    ffn_hidden : int
        Each expert's inner width F, >= 1.
    experts : int
        The number of experts E, >= 1.
    top_k : int
        Experts per token, 1 <= top_k <= experts.
    comm : Comm
        The expert-parallel group ("ep") or the tensor-parallel group ("tp").
    mode : {"ep", "tp"}, default "ep"
        Whole experts per rank, or every expert split by columns.
    norm_topk_prob : bool, default True
        Divide the top-k weights by their sum (Mixtral).
    replicated : bool, default False
        ("ep") the ranks pass the same tokens (the tokens of a tensor-parallel group): each
        dispatches a share of the rows; the output is the same on every rank.  "tp" always
        takes the same tokens on every rank.
    expert_partition : list of int, optional
        ("ep") experts per rank (>= 0 each, adding up to experts).  Default: even.
    seed : int, default 0
        The weights' random stream (the same logical weights at every world size and mode).

    Attributes
    ----------
    experts_local : list of int
        The experts this rank holds (all of them in "tp").
    ffn_offset, ffn_local : int
        ("tp") this rank's columns [ffn_offset, ffn_offset + ffn_local) of each expert.
    router_logits : numpy.ndarray or None
        The last forward's router logits (N, experts), float32 (for `load_balancing_loss`).
    bytes_read : dict
        The last forward's weight bytes read by this rank: "experts" (the fc1 and fc2 of the
        experts that had rows), "router", "active_experts" (how many ran).

    Raises
    ------
    TypeError, ValueError
        An argument of the wrong type or out of range (named).
    """

    def __init__(self, hidden: int, ffn_hidden: int, experts: int, top_k: int, comm: Comm, mode: str = "ep",
                 norm_topk_prob: bool = True, replicated: bool = False,
                 expert_partition: Optional[Sequence[int]] = None, seed: int = 0) -> None:
        who = "MoE"
        if not isinstance(comm, Comm):
            raise TypeError(f"{who}: comm must be a tpcore.Comm, got {shown(comm)}")
        if not isinstance(mode, str) or mode not in MODES:
            raise (ValueError if isinstance(mode, str) else TypeError)(
                f"{who}: mode must be one of {', '.join(map(repr, MODES))}, got {shown(mode)}")
        C = self.hidden = int_arg(hidden, who, "hidden", lo=1)
        F = self.ffn_hidden = int_arg(ffn_hidden, who, "ffn_hidden", lo=1)
        E = self.experts = int_arg(experts, who, "experts", lo=1)
        self.top_k = int_arg(top_k, who, "top_k", lo=1, hi=E)
        self.norm_topk_prob = bool_arg(norm_topk_prob, who, "norm_topk_prob")
        self.replicated = bool_arg(replicated, who, "replicated") or mode == "tp"
        seed = seed_arg(seed, who)
        self.comm, self.mode = comm, mode
        P, me = comm.size, comm.rank
        if mode == "ep":
            counts = _even(E, P) if expert_partition is None else self._partition(expert_partition, E, P)
        else:
            if expert_partition is not None:
                raise ValueError(f"{who}: expert_partition is for mode 'ep' (in 'tp' every rank holds every expert)")
            counts = [E] * P
        self.expert_counts = counts
        first = 0 if mode == "tp" else sum(counts[:me])
        self.experts_local = list(range(first, first + counts[me]))
        self.owner = np.zeros(E, np.int64)  # the rank that holds each expert ("ep")
        if mode == "ep":
            self.owner = np.repeat(np.arange(P), counts)
        split = _even(F, P) if mode == "tp" else [F] * P
        self.ffn_local = split[me]
        self.ffn_offset = sum(split[:me]) if mode == "tp" else 0
        self.ffn_split = split
        self.router = _normal(seed, 0, (E, C))
        lo, n = self.ffn_offset, self.ffn_local
        self.fc1: Dict[int, np.ndarray] = {}
        self.fc2: Dict[int, np.ndarray] = {}
        for e in self.experts_local:  # (a rank makes only its own experts' slices)
            w1 = _normal(seed, 1 + 2 * e, (2 * F, C))
            self.fc1[e] = np.ascontiguousarray(np.concatenate([w1[lo:lo + n], w1[F + lo:F + lo + n]]))
            self.fc2[e] = np.ascontiguousarray(_normal(seed, 2 + 2 * e, (C, F))[:, lo:lo + n])
        self.grad_router: Optional[np.ndarray] = None
        self.grad_fc1: Dict[int, np.ndarray] = {}
        self.grad_fc2: Dict[int, np.ndarray] = {}
        self.router_logits: Optional[np.ndarray] = None
        self.bytes_read = {"experts": 0, "router": 0, "active_experts": 0}
        self._ctx: Optional[dict] = None
        self._aux_dprobs: Optional[np.ndarray] = None  # load_balancing_loss's gradient of the probabilities

    @staticmethod
    def _partition(parts, E: int, P: int) -> List[int]:
        if not isinstance(parts, (list, tuple)) or len(parts) != P:
            raise ValueError(f"MoE: expert_partition must be a list of {P} expert counts (one per rank), "
                             f"got {shown(parts)}")
        counts = [int_arg(c, "MoE", "expert_partition[]", lo=0) for c in parts]
        if sum(counts) != E:
            raise ValueError(f"MoE: expert_partition {counts} adds up to {sum(counts)}, expected experts = {E}")
        return counts

    # ------------------------------------------------------------- parameters
    def _alloc_grads(self) -> None:
        if self.grad_router is None:
            self.grad_router = np.zeros_like(self.router)
            self.grad_fc1 = {e: np.zeros_like(w) for e, w in self.fc1.items()}
            self.grad_fc2 = {e: np.zeros_like(w) for e, w in self.fc2.items()}

    def named_parameters(self) -> Dict[str, Tuple[np.ndarray, np.ndarray]]:
        """This rank's tensors by local name ("router.weight", "experts.{e}.fc1.weight", ...)
        -> (parameter, gradient); allocates the gradients (zeroed) if no backward has yet."""
        self._alloc_grads()
        assert self.grad_router is not None
        out = {"router.weight": (self.router, self.grad_router)}
        for e in self.experts_local:
            out[f"experts.{e}.fc1.weight"] = (self.fc1[e], self.grad_fc1[e])
            out[f"experts.{e}.fc2.weight"] = (self.fc2[e], self.grad_fc2[e])
        return out

    def parameters(self) -> List[Tuple[np.ndarray, np.ndarray]]:
        """This rank's (parameter, gradient) pairs: the router's, then its experts'."""
        return list(self.named_parameters().values())

    def expert_parameters(self) -> List[Tuple[np.ndarray, np.ndarray]]:
        """The pairs of this rank's experts (not the router): what `ProcessGrid.average_gradients`
        averages over the expert data-parallel group only ("ep")."""
        return [pg for k, pg in self.named_parameters().items() if k.startswith("experts.")]

    def zero_grad(self) -> None:
        """Set every gradient to zero (allocating them if no backward has yet)."""
        for _, g in self.parameters():
            g[...] = 0

    def param_bytes(self) -> int:
        """Bytes of this rank's parameters."""
        return int(self.router.nbytes + sum(w.nbytes for w in self.fc1.values()) +
                   sum(w.nbytes for w in self.fc2.values()))

    def full_shapes(self) -> Dict[str, Tuple[int, ...]]:
        """Every full tensor's shape by its full name (module doc)."""
        C, F = self.hidden, self.ffn_hidden
        out: Dict[str, Tuple[int, ...]] = {"router.weight": (self.experts, C)}
        for e in range(self.experts):
            out[f"experts.{e}.fc1.weight"] = (2 * F, C)
            out[f"experts.{e}.fc2.weight"] = (C, F)
        return out

    def load_full(self, tensors: Dict[str, Any], strict: bool = True) -> None:
        """Keep this rank's part of the full tensors: the router, its experts' fc1 / fc2 ("ep";
        the other experts' tensors are not read), or every expert's column slice ("tp").

        Parameters
        ----------
        tensors : dict of str to array_like
            Full tensors by name (`full_shapes`); arrays, memory maps or lazy views.
        strict : bool, default True
            Every tensor must be given and no other.

        Raises
        ------
        KeyError
            strict and a tensor missing or unexpected.
        ValueError
            A tensor of the wrong shape.
        """
        shapes = self.full_shapes()
        if strict:
            missing, extra = sorted(set(shapes) - set(tensors)), sorted(set(tensors) - set(shapes))
            if missing or extra:
                raise KeyError(f"MoE.load_full: missing {missing}, unexpected {extra}")
        F, lo, n = self.ffn_hidden, self.ffn_offset, self.ffn_local
        for name, t in tensors.items():
            if name not in shapes:
                continue
            if not hasattr(t, "shape") or (not isinstance(t, np.ndarray) and hasattr(t, "__dlpack__")):
                t = asarray(t, name, "MoE.load_full")
            if tuple(t.shape) != shapes[name]:
                raise ValueError(f"MoE.load_full: {name} has shape {tuple(t.shape)}, expected {shapes[name]}")
            if name == "router.weight":
                self.router[...] = to_float32(np.asarray(t[:]))
                continue
            e = int(name.split(".")[1])
            if e not in self.fc1:
                continue  # another rank's expert: not read
            if name.endswith("fc1.weight"):
                self.fc1[e][:n] = to_float32(np.asarray(t[lo:lo + n]))
                self.fc1[e][n:] = to_float32(np.asarray(t[F + lo:F + lo + n]))
            else:
                self.fc2[e][...] = to_float32(np.asarray(t[:, lo:lo + n]))

    def gather_full(self, grads: bool = False) -> Dict[str, np.ndarray]:
        """The full tensors (or their gradients) rebuilt from every rank (collective:
        all-gathers over comm)."""
        p = self.named_parameters() if grads else None
        w1 = self.grad_fc1 if grads else self.fc1
        w2 = self.grad_fc2 if grads else self.fc2
        router = p["router.weight"][1] if p is not None else self.router
        out = {"router.weight": router.copy()}
        comm, F, C = self.comm, self.ffn_hidden, self.hidden
        if self.mode == "ep":
            mine = np.concatenate([np.concatenate([w1[e].reshape(-1), w2[e].reshape(-1)])
                                   for e in self.experts_local] or [np.zeros(0, np.float32)])
            per = 3 * F * C
            every = comm.all_gather(mine, sizes=[c * per for c in self.expert_counts]) if comm.size > 1 else mine
            for e in range(self.experts):
                flat = every[e * per:(e + 1) * per]
                out[f"experts.{e}.fc1.weight"] = flat[:2 * F * C].reshape(2 * F, C).copy()
                out[f"experts.{e}.fc2.weight"] = flat[2 * F * C:].reshape(C, F).copy()
            return out
        for e in range(self.experts):
            n = self.ffn_local
            rows = comm.all_gather(np.ascontiguousarray(w1[e]), sizes=[2 * s for s in self.ffn_split])
            gates, ups, o = [], [], 0
            for s in self.ffn_split:
                gates.append(rows[o:o + s])
                ups.append(rows[o + s:o + 2 * s])
                o += 2 * s
            out[f"experts.{e}.fc1.weight"] = np.concatenate(gates + ups)
            out[f"experts.{e}.fc2.weight"] = comm.all_gather(np.ascontiguousarray(w2[e]).reshape(C, n), axis=1,
                                                             sizes=self.ffn_split)
        return out

    # ---------------------------------------------------------------- compute
    def _route(self, x2: np.ndarray):
        """Router logits, softmax probabilities, each token's top-k experts and weights."""
        logits = _C.linear_forward(x2, self.router)
        probs = _softmax(logits)
        top = np.argsort(-probs, axis=1, kind="stable")[:, :self.top_k]
        ptop = np.take_along_axis(probs, top, 1)
        w = ptop / ptop.sum(axis=1, keepdims=True) if self.norm_topk_prob else ptop
        return logits, probs, top, ptop, w.astype(np.float32)

    def _experts_forward(self, xs: np.ndarray, counts: np.ndarray, keep: bool) -> np.ndarray:
        """Each local expert over its rows of xs (grouped by expert, counts rows each): the
        outputs, in xs's order.  Only experts with rows run (and read their weights)."""
        ys = np.zeros((xs.shape[0], self.hidden), np.float32)
        saved, o, read, active = [], 0, 0, 0
        for e, c in zip(self.experts_local, counts.tolist()):
            if c and self.ffn_local:
                xe = xs[o:o + c]
                h = _C.linear_forward(xe, self.fc1[e])
                a = _C.act_forward("swiglu", h)
                ys[o:o + c] = _C.linear_forward(a, self.fc2[e])
                read += self.fc1[e].nbytes + self.fc2[e].nbytes
                active += 1
                if keep:
                    saved.append((e, o, c, xe, h, a))
            o += c
        self.bytes_read = {"experts": read, "router": self.router.nbytes, "active_experts": active}
        if keep:
            self._saved = saved
        return ys

    def _experts_backward(self, dys: np.ndarray) -> np.ndarray:
        self._alloc_grads()
        dxs = np.zeros((dys.shape[0], self.hidden), np.float32)
        for e, o, c, xe, h, a in self._saved:
            da = _C.linear_backward(np.ascontiguousarray(dys[o:o + c]), a, self.fc2[e], self.grad_fc2[e])
            dh = _C.act_backward("swiglu", h, da)
            dxs[o:o + c] = _C.linear_backward(dh, xe, self.fc1[e], self.grad_fc1[e])
        return dxs

    def _plan(self, experts_flat: np.ndarray):
        """The dispatch of the token-expert pairs (expert ids, in pair order): their order
        sorted by expert, the (ranks, experts) count matrix of every rank, the rows sent to
        and received from each rank, and the permutation that groups the received rows by
        local expert (source-major -> expert-major)."""
        comm, E, P, me = self.comm, self.experts, self.comm.size, self.comm.rank
        order = np.argsort(experts_flat, kind="stable")
        counts = np.bincount(experts_flat, minlength=E).astype(np.int64)
        table = comm.all_gather(counts.reshape(1, E)).reshape(P, E) if P > 1 else counts.reshape(1, E)
        bounds = np.concatenate([[0], np.cumsum(self.expert_counts)])
        send = [int(counts[bounds[r]:bounds[r + 1]].sum()) for r in range(P)]
        mine = table[:, bounds[me]:bounds[me + 1]]  # (sources, local experts)
        recv = [int(v) for v in mine.sum(1)]
        starts = np.concatenate([[0], np.cumsum(recv)[:-1]]).astype(np.int64)
        within = np.concatenate([np.zeros((P, 1), np.int64), np.cumsum(mine, 1)[:, :-1]], 1)
        runs = [np.arange(starts[s] + within[s, j], starts[s] + within[s, j] + mine[s, j])
                for j in range(mine.shape[1]) for s in range(P)]
        perm = np.concatenate(runs).astype(np.int64) if runs else np.zeros(0, np.int64)
        return order, send, recv, perm, mine.sum(0)

    def forward(self, x: Any, need_backward: bool = True) -> np.ndarray:
        """The MoE output for x (also ``moe(x)``).

        Parameters
        ----------
        x : array_like, shape (..., hidden)
            This rank's tokens (the same on every rank when replicated or mode "tp"); float32
            (16-bit floats converted).
        need_backward : bool, default True
            False keeps nothing for backward (inference).

        Returns
        -------
        numpy.ndarray, shape (..., hidden), float32

        Notes
        -----
        Collectives: "ep": an all-gather of the counts and two all_to_alls (plus an
        all-gather of the outputs when replicated); "tp": one all-reduce.
        """
        x = as_float32(x, "x", "MoE.forward")
        if x.ndim < 1 or x.shape[-1] != self.hidden:
            raise ValueError(f"MoE.forward: x must have shape (..., {self.hidden}), got {tuple(x.shape)}")
        bool_arg(need_backward, "MoE.forward", "need_backward")
        lead, C, k = x.shape[:-1], self.hidden, self.top_k
        x2 = np.ascontiguousarray(x.reshape(-1, C))
        N = x2.shape[0]
        kept_output(self, None)
        logits, probs, top, ptop, w = self._route(x2)
        self.router_logits = logits
        lo, hi = self._rows(N)
        ctx = dict(x2=x2, probs=probs, top=top, ptop=ptop, w=w, lo=lo, hi=hi)
        if self.mode == "tp":
            flat = top.reshape(-1)
            order = np.argsort(flat, kind="stable")
            xs = np.ascontiguousarray(x2[order // k])
            ys = self._experts_forward(xs, np.bincount(flat, minlength=self.experts), need_backward)
            out = np.empty_like(ys)
            out[order] = ys
            y = (out.reshape(N, k, C) * w[:, :, None]).sum(1)
            if self.comm.size > 1:
                self.comm.all_reduce(y)
            ctx.update(order=order, out=out)
        else:
            flat = top[lo:hi].reshape(-1)
            order, send, recv, perm, local_counts = self._plan(flat)
            xs = _all_to_all(self.comm, np.ascontiguousarray(x2[lo:hi][order // k]), send, recv)
            ys_e = self._experts_forward(np.ascontiguousarray(xs[perm]), local_counts, need_backward)
            ys = np.empty_like(ys_e)
            ys[perm] = ys_e
            back = _all_to_all(self.comm, ys, recv, send)
            out = np.empty_like(back)
            out[order] = back
            y = (out.reshape(hi - lo, k, C) * w[lo:hi, :, None]).sum(1)
            if self.replicated and self.comm.size > 1:
                y = self.comm.all_gather(np.ascontiguousarray(y, np.float32), sizes=self._shares(N))
            ctx.update(order=order, out=out, send=send, recv=recv, perm=perm)
        self._ctx = ctx if need_backward else None
        self._aux_dprobs = None
        y = np.ascontiguousarray(y, np.float32).reshape(lead + (C,))
        kept_output(self, y.shape if need_backward else None)
        return y

    __call__ = forward

    def _shares(self, N: int) -> List[int]:
        return _even(N, self.comm.size) if self.replicated and self.mode == "ep" else [N]

    def _rows(self, N: int) -> Tuple[int, int]:
        """The rows [lo, hi) of the N tokens this rank dispatches (all but when replicated "ep")."""
        if not (self.replicated and self.mode == "ep"):
            return 0, N
        shares = self._shares(N)
        lo = sum(shares[:self.comm.rank])
        return lo, lo + shares[self.comm.rank]

    def backward(self, dy: Any) -> np.ndarray:
        """The input gradient for the last forward; accumulates the router's and this rank's
        experts' gradients (and the load-balancing loss's, when `load_balancing_loss` was
        called with this layer since its forward).

        Parameters
        ----------
        dy : array_like, shape of forward's output
            (The same on every rank when replicated or "tp".)

        Returns
        -------
        numpy.ndarray, x's shape, float32

        Raises
        ------
        RuntimeError
            No forward with need_backward before.
        ValueError
            dy not of the last output's shape.

        Notes
        -----
        Collectives: "ep": two all_to_alls (plus an all-reduce of the router's gradient and an
        all-gather of the input gradient when replicated); "tp": one all-reduce.
        """
        ctx = self._ctx
        if ctx is None:
            raise RuntimeError("MoE.backward: no forward with need_backward=True to differentiate")
        d = as_float32(dy, "dy", "MoE.backward")
        check_grad(self, d.shape)
        C, k = self.hidden, self.top_k
        dy2 = np.ascontiguousarray(d.reshape(-1, C))
        N, lo, hi = dy2.shape[0], ctx["lo"], ctx["hi"]
        self._alloc_grads()
        assert self.grad_router is not None
        w, out, order = ctx["w"], ctx["out"], ctx["order"]
        dmine = dy2[lo:hi]
        n = hi - lo
        dout = (dmine[:, None, :] * w[lo:hi, :, None]).reshape(n * k, C)
        dw = np.einsum("nkc,nc->nk", out.reshape(n, k, C), dmine)
        if self.mode == "tp":
            dxs = self._experts_backward(np.ascontiguousarray(dout[order]))
            dpair = np.empty_like(dxs)
            dpair[order] = dxs
            dx = dpair.reshape(N, k, C).sum(1)
            if self.comm.size > 1:  # the partial input gradient and the partial weight gradients in one sum
                both = np.concatenate([dx.reshape(-1), dw.reshape(-1).astype(np.float32)])
                self.comm.all_reduce(both)
                dx, dw = both[:N * C].reshape(N, C), both[N * C:].reshape(N, k)
        else:
            send, recv, perm = ctx["send"], ctx["recv"], ctx["perm"]
            dys = _all_to_all(self.comm, np.ascontiguousarray(dout[order]), send, recv)
            dxs_e = self._experts_backward(np.ascontiguousarray(dys[perm]))
            dxs = np.empty_like(dxs_e)
            dxs[perm] = dxs_e
            back = _all_to_all(self.comm, dxs, recv, send)
            dpair = np.empty_like(back)
            dpair[order] = back
            dx = dpair.reshape(n, k, C).sum(1)
        dlogits = self._router_grad(ctx, dw, lo, hi)
        x_rows = np.ascontiguousarray(ctx["x2"][lo:hi])
        if self.replicated and self.mode == "ep" and self.comm.size > 1:
            gr = np.zeros_like(self.grad_router)
            dx = dx + _C.linear_backward(dlogits, x_rows, self.router, gr)
            self.comm.all_reduce(gr)
            self.grad_router += gr
            dx = self.comm.all_gather(np.ascontiguousarray(dx, np.float32), sizes=self._shares(N))
        else:
            dx = dx + _C.linear_backward(dlogits, x_rows, self.router, self.grad_router)
        self._ctx = None
        return np.ascontiguousarray(dx, np.float32).reshape(d.shape)

    def _router_grad(self, ctx, dw: np.ndarray, lo: int, hi: int) -> np.ndarray:
        """The gradient of the router logits of rows [lo, hi): through the top-k weights (and
        their renormalization) and the softmax, plus the load-balancing loss's."""
        probs, top, ptop = ctx["probs"][lo:hi], ctx["top"][lo:hi], ctx["ptop"][lo:hi]
        if self.norm_topk_prob:
            s = ptop.sum(axis=1, keepdims=True)
            wn = ptop / s
            dptop = (dw - (dw * wn).sum(axis=1, keepdims=True)) / s
        else:
            dptop = dw
        dp = np.zeros_like(probs)
        np.put_along_axis(dp, top, dptop.astype(np.float32), 1)
        if self._aux_dprobs is not None:
            dp += self._aux_dprobs[lo:hi]
        return np.ascontiguousarray(probs * (dp - (dp * probs).sum(axis=1, keepdims=True)), np.float32)

    def __repr__(self) -> str:
        return (f"MoE(hidden={self.hidden}, ffn_hidden={self.ffn_hidden}, experts={self.experts}, top_k={self.top_k}, "
                f"mode={self.mode!r}; experts {self.experts_local} on rank {self.comm.rank})")


def _moe_layers(layers: Any) -> List[MoE]:
    """The MoE layers of a model (its blocks' .moe), a list of MoE / MoE blocks, or one MoE."""
    if isinstance(layers, MoE):
        return [layers]
    if hasattr(layers, "blocks"):
        layers = layers.blocks
    out = []
    for m in layers:
        m = getattr(m, "moe", m)
        if isinstance(m, MoE):
            out.append(m)
        elif not hasattr(m, "moe"):
            raise TypeError(f"load_balancing_loss: expected MoE layers or blocks, got {shown(m)}")
    return out


def load_balancing_loss(layers: Any, attention_mask: Any = None, coef: float = 1.0) -> float:
    """transformers' load_balancing_loss_func (Mixtral) over the MoE layers' last router
    logits, and its gradient (times coef) registered for their next backward.

    Over all L layers' N tokens (padding excluded with attention_mask): f_e = the top-k
    choices of expert e over L x N (the unmasked) rows, P_e = the summed softmax
    probabilities of e over those rows, loss = experts * sum_e f_e P_e.  Only P carries a
    gradient (into each router, and through it into each layer's input).

    Parameters
    ----------
    layers : TransformerLM, list of MoE or MoE blocks, or MoE
        Whose last forward (with need_backward for training) gives the router logits.
    attention_mask : array_like, shape (B, T), optional
        1 for tokens, 0 for padding (the forward's B x T tokens, in order).
    coef : float, default 1.0
        The loss's weight in the total loss (router_aux_loss_coef): the gradient registered
        is coef x d loss.

    Returns
    -------
    float
        The loss (without coef), as transformers returns it.

    Notes
    -----
    Each rank's own rows: with "ep" layers over different tokens, each rank's loss is its
    tokens' (as each data-parallel replica computes it in transformers).
    """
    moes = _moe_layers(layers)
    logits = [m.router_logits for m in moes]
    if not moes or any(lg is None for lg in logits):
        raise RuntimeError("load_balancing_loss: run a forward of the MoE layers first")
    E, k = moes[0].experts, moes[0].top_k
    N = logits[0].shape[0]  # type: ignore[union-attr]
    for m, lg in zip(moes, logits):
        if (m.experts, m.top_k, lg.shape[0]) != (E, k, N):  # type: ignore[union-attr]
            raise ValueError("load_balancing_loss: the layers differ in experts, top_k or tokens")
    if attention_mask is None:
        mask = np.ones(N, np.float64)
    else:
        mask = np.asarray(asarray(attention_mask, "attention_mask", "load_balancing_loss"), np.float64).reshape(-1)
        if mask.size != N:
            raise ValueError(f"load_balancing_loss: attention_mask has {mask.size} entries, the layers routed "
                             f"{N} tokens")
    counts = np.zeros(E)
    psum = np.zeros(E)
    probs = []
    for lg in logits:
        p = _softmax(np.asarray(lg, np.float64))
        top = np.argsort(-p, axis=1, kind="stable")[:, :k]
        counts += np.bincount(top.reshape(-1), weights=np.repeat(mask, k), minlength=E)
        psum += (p * mask[:, None]).sum(0)
        probs.append(p)
    rows = float(mask.sum()) * len(moes)
    f, P = counts / rows, psum / rows
    loss = float(E * (f * P).sum())
    coef = float(coef)
    for m in moes:  # d loss / d p[n, e] = E f_e mask[n] / rows
        m._aux_dprobs = (coef * E * f[None, :] * mask[:, None] / rows).astype(np.float32)
    return loss
