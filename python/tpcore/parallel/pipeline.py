"""Pipeline (model) parallelism: a TransformerLM's blocks cut into stages over the PP group of a
process grid, each stage itself tensor-parallel over its TP group.

    grid = tpcore.ProcessGrid(comm, tp=2, pp=2)                  # 4 ranks: 2 stages x 2-way TP
    model = tpcore.PipelineLM(cfg, grid, seed=0)                 # stage s holds its share of the blocks
    opt = tpcore.optim.AdamW(model, lr=1e-3)
    loss = model.train_step(tokens, targets, micro_batches=4, schedule="1f1b")
    grid.average_gradients(model); opt.step(); model.zero_grad()  # (DP: the mean over the replicas)
    out = model.generate(prompts, max_new_tokens=16)             # prefill and decode across the stages

Stage s holds the consecutive blocks [lo, hi) (even cuts by default, the first L % P stages
one block more; `stages=[n0, n1, ...]` for uneven ones), the first stage also the embeddings,
the last the final norm and the LM head.  With tied embeddings the last stage keeps its own
copy of the token embedding (made from the same seed, loaded from the same tensor) and the two
copies' gradients are summed after every step, as Megatron does, so they stay equal.

A training step splits the batch into micro-batches; activations go forward (stage s to s+1)
and their gradients backward with send/recv.  Schedules:
  "gpipe"  all forwards, then all backwards (GPipe);
  "1f1b"   P - s - 1 warm-up forwards, then one forward and one backward in turn, then the
           remaining backwards (PipeDream-flush / Megatron's default): at most P - s micro-batches
           in flight on stage s, against GPipe's M.
Both idle a stage for (P - 1) of the M + P - 1 slots (the bubble): more micro-batches, a smaller
share.  Deadlock-free by construction: every stage posts its sends and receives in the order
of the schedule, and where a stage sends to a neighbour that is sending to it (1F1B's steady
state) the two go as one sendrecv, whose halves progress independently; the communicator's
timeout is the backstop (a stage that dies or never arrives is named).

The C blocks keep one forward's context at a time, so a stage keeps each in-flight micro-batch's
input (not its activations) and re-runs that forward just before its backward when another
micro-batch ran in between (the re-materialisation of GPipe; Megatron's full recompute); the
last stage under 1F1B never needs to.  `last_stats` holds each step's measurements: time
computing, time waiting in send/recv (the bubble and the transfers), bytes sent, forwards re-run
and the most stage inputs held at once.
"""
from __future__ import annotations

import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from tpcore.distributed.agree import agree
from tpcore.utils.args import int_arg, shown
from tpcore.utils.arrays import int_array
from tpcore.distributed.grid import ProcessGrid
from tpcore.models.generate import agree_generate, batch_samplers, generate_args, generate_result, logits_error
from tpcore.models.sampling import sample_batch
from tpcore.models.lm import TransformerLM
from tpcore.nn.quant import is_quantized
from tpcore.nn.config import Config

__all__ = ["PipelineLM", "stage_partition", "SCHEDULES"]

SCHEDULES = ("1f1b", "gpipe")


def stage_partition(layers: int, stages: int, counts: Optional[Sequence[int]] = None) -> List[Tuple[int, int]]:
    """The blocks [lo, hi) of each pipeline stage.

    Parameters
    ----------
    layers : int
        Blocks of the model, >= 1.
    stages : int
        Pipeline stages, >= 1 (at most layers without counts).
    counts : sequence of int, optional
        Blocks per stage (>= 0 each, adding up to layers).  Default None: even cuts, the
        first layers % stages stages one block more.

    Returns
    -------
    list of (int, int)
        (lo, hi) per stage, consecutive.

    Raises
    ------
    TypeError
        A non-integer argument, counts not a sequence.
    ValueError
        More stages than blocks without counts, counts of the wrong length or sum.
    """
    layers = int_arg(layers, "stage_partition", "layers", lo=1)
    stages = int_arg(stages, "stage_partition", "stages", lo=1)
    if counts is None:
        if stages > layers:
            raise ValueError(f"PipelineLM: {stages} pipeline stages for {layers} blocks: every stage needs a block "
                             f"(pass stages=[...] to give some stage none, or use fewer stages)")
        counts = [layers // stages + (1 if s < layers % stages else 0) for s in range(stages)]
    else:
        if isinstance(counts, (str, bytes, dict)) or not hasattr(counts, "__iter__"):
            raise TypeError(f"PipelineLM: stages must be a list of block counts, one per stage, got {shown(counts)}")
        counts = [int_arg(c, "PipelineLM", "stages[i]", lo=0) for c in counts]
        if len(counts) != stages:
            raise ValueError(f"PipelineLM: stages has {len(counts)} entries, but the pipeline has {stages} stages")
        if sum(counts) != layers:
            raise ValueError(f"PipelineLM: stages {counts} sum to {sum(counts)}, but the model has {layers} blocks")
    out, lo = [], 0
    for c in counts:
        out.append((lo, lo + c))
        lo += c
    return out


class PipelineLM:
    """A TransformerLM cut into pipeline stages over grid.pp, each stage tensor-parallel.

    See the module's text for the schedules and the tied embeddings.  CPU (NumPy) models
    in this version.

    Parameters
    ----------
    config : Config
        The whole model's shape.
    grid : ProcessGrid
        Stages over grid.pp, each stage tensor-parallel over grid.tp.
    stages : sequence of int, optional
        Blocks per stage (`stage_partition`'s counts).  Default None: even cuts.
    seed : int, default 0
        As `tpcore.models.TransformerLM` (the same logical weights as an unsplit model).
    partition, ffn_partition, vocab_partition : optional
        Each stage's head, MLP-column and vocabulary splits over its TP group (as
        TransformerLM's).
    dtype : str, default "float32"
        The large weights' storage (as TransformerLM's).

    Attributes
    ----------
    stage : TransformerLM
        This rank's stage (its blocks, plus the embeddings on the first stage and the head
        on the last).
    stage_index, num_stages : int
    stage_bounds : list of (int, int)
    last_stats : dict
        The last train_step's measurements (compute and wait time, bytes sent, forwards
        re-run, most inputs held).

    Raises
    ------
    TypeError
        grid not a ProcessGrid, config not a Config.
    ValueError
        Bad stages, or ranks that passed different config, seed, stages or dtype.

    Notes
    -----
    Collective over the grid: every rank makes it with the same arguments (checked).
    """

    def __init__(self, config: Config, grid: ProcessGrid, stages: Optional[Sequence[int]] = None, seed: int = 0,
                 partition: Any = None, ffn_partition: Any = None, vocab_partition: Any = None,
                 dtype: Any = "float32") -> None:
        if not isinstance(grid, ProcessGrid):
            raise TypeError(f"PipelineLM: grid must be a tpcore.ProcessGrid, got {shown(grid)}")
        if not isinstance(config, Config):
            raise TypeError(f"PipelineLM: config must be a tpcore.Config, got {shown(config)}")
        cfg = self.config = config.validate()
        P, s = grid.sizes["pp"], grid.pp_rank
        err, bounds = None, None
        try:
            bounds = stage_partition(cfg.layers, P, stages)
        except (TypeError, ValueError) as e:
            err = e
        text = np.frombuffer(repr(cfg).encode(), np.uint8)
        agree(grid.comm, "PipelineLM", [] if err else [
            ("the model configs differ", (text,), None),
            ("the stages differ", (np.array(bounds, np.int64),), None),
            ("seed differs", (int(seed) % 2 ** 63 if isinstance(seed, int) else -1,), None),
            ("dtype differs", (np.frombuffer(str(dtype).encode(), np.uint8),), None)], err)
        self.grid, self.tp, self.pp = grid, grid.tp, grid.pp
        self.num_stages, self.stage_index = P, s
        self.stage_bounds = bounds
        lo, hi = bounds[s]
        self.first, self.last = s == 0, s == P - 1
        self.stage = TransformerLM(cfg, grid.tp, seed=seed, partition=partition, ffn_partition=ffn_partition,
                                   vocab_partition=vocab_partition, dtype=dtype,
                                   stage=(lo, hi, self.first, self.last))
        self.blocks = self.stage.blocks
        # the model-parallel group (this replica's TP x PP ranks): generate's arguments agree over it
        self.mp = grid.comm.split(grid.dp_rank)
        # tied embeddings: the first and last stages' copies of the token embedding
        self._tied = None
        if cfg.tie_embeddings and P > 1:
            self._tied = self.pp.split(0 if s in (0, P - 1) else None)
        self.last_stats: dict = {}

    # ------------------------------------------------------------- parameters
    def parameters(self) -> List[Tuple[Any, Any]]:
        """This stage's (parameter, gradient) pairs, for `tpcore.optim`."""
        return self.stage.parameters()

    def zero_grad(self) -> None:
        """Set this stage's gradients to zero."""
        self.stage.zero_grad()

    def param_bytes(self) -> int:
        """Bytes of this rank's parameters."""
        return self.stage.param_bytes()

    def memory(self, optimizer: Any = None) -> Dict[str, Any]:
        """The bytes this rank holds for its stage now (`TransformerLM.memory` of the stage:
        its blocks, and the embeddings / head it holds), with optimizer's state when given.

        Parameters
        ----------
        optimizer : optional
            An optimizer over this stage's parameters (counted under "optimizer").

        Returns
        -------
        dict
            The keys of `TransformerLM.memory`, "by_device" included.
        """
        return self.stage.memory(optimizer)

    def state_dict_full(self) -> Dict[str, np.ndarray]:
        """This stage's full tensors, in the whole model's names (blocks.i: the model's i).

        Notes
        -----
        Collective over the stage's TP group.
        """
        return self.stage.state_dict_full()

    def load_state_dict_full(self, sd: Dict[str, Any], progress: bool = False) -> None:
        """Load this stage's part of a whole model's full tensors.

        Parameters
        ----------
        sd : dict of str to array_like
            The whole model's tensors in tpcore's names (`state_dict_full`); the other
            stages' are ignored.
        progress : bool, default False
            Show a progress line.

        Raises
        ------
        KeyError, ValueError
            A tensor of this stage missing or of the wrong shape.
        """
        self.stage.load_state_dict_full(sd, progress)

    def close(self) -> None:
        """Release the communicators this model made (the grid's stay open)."""
        for c in (self.mp, self._tied):
            if c is not None:
                c.close()
        self.mp = self._tied = None

    # ------------------------------------------------------------- point to point
    def _recv(self, peer, shape, st):
        buf = np.empty(shape, np.float32)
        t = time.perf_counter()
        self.pp.recv(buf, peer)
        st["wait_s"] += time.perf_counter() - t
        return buf

    def _send(self, x, peer, st):
        t = time.perf_counter()
        x = np.ascontiguousarray(x, np.float32)
        self.pp.send(x, peer)
        st["wait_s"] += time.perf_counter() - t
        st["sent_bytes"] += x.nbytes

    def _sendrecv(self, x, peer, shape, st):
        """Send x to peer and receive an array of shape from it, as one operation."""
        buf = np.empty(shape, np.float32)
        x = np.ascontiguousarray(x, np.float32)
        t = time.perf_counter()
        self.pp.sendrecv(x, peer, buf, peer)
        st["wait_s"] += time.perf_counter() - t
        st["sent_bytes"] += x.nbytes
        return buf

    # ------------------------------------------------------------- the stage's steps
    def _stage_forward(self, x, p0, pos, mask, use_cache, need_backward):
        """The forward of this rank's stage: x the tokens (B, T) on the first stage, the
        previous stage's hidden states (B, T, hidden) on the others; pos (B, T) the positions,
        p0 (B,) or None the first ones (the KV cache).  Returns its hidden states (after the
        final norm on the last stage)."""
        h = self.stage.embed(x, pos) if self.first else x
        return self.stage.run_blocks(h, p0, mask, use_cache, need_backward)

    def _stage_backward(self, dloss, dy, pos):
        """The backward of this rank's stage after its need_backward forward: from the loss
        (dloss, the last stage) or from dy (B, T, hidden), the next stage's gradient of its
        output.  Returns the gradient of its input on a stage after the first, else None."""
        st = self.stage
        dh = st.blocks_backward(st.head_backward(dloss) if self.last else dy)
        if not self.first:
            return dh
        st.embed_backward(dh, pos)
        return None

    # ------------------------------------------------------------- training
    def train_step(self, tokens: Any, targets: Any, micro_batches: int = 1, schedule: str = "1f1b",
                   attention_mask: Any = None, ignore_index: int = -100) -> float:
        """Forward and backward of one batch through the pipeline.

        Gradients accumulate into every stage's parameters (as loss() + backward() do on a
        TransformerLM).  Each micro-batch's loss is weighted by its share of the counted
        targets, so the result and the gradients equal the whole batch's.

        Parameters
        ----------
        tokens : array_like of int, shape (B, T)
            Given on every rank of the pipeline (the first stage reads them; the ranks check
            they agree).
        targets : array_like of int, shape (B, T)
            Next-token targets (the last stage reads them).
        micro_batches : int, default 1
            Consecutive slices of the batch, in [1, B] (uneven when B is not a multiple).
        schedule : {"1f1b", "gpipe"}, default "1f1b"
        attention_mask : array_like, shape (B, T), optional
            Nonzero for real tokens (default None: all).
        ignore_index : int, default -100
            Targets with no loss.

        Returns
        -------
        float
            The mean cross-entropy over the counted targets, on every rank.

        Raises
        ------
        TypeError, ValueError
            A bad argument, or ranks that disagree (on every rank).
        CommError, CommTimeout
            A stage failed or never arrived.

        Notes
        -----
        Communication: send / recv (or sendrecv) of activations and their gradients between
        neighbouring stages, the stages' TP all-reduces, the tied embeddings' gradient
        all-reduce, and a broadcast of the loss.
        """
        who = "PipelineLM.train_step"
        st = self.stage
        err = None
        try:
            tokens, pos, mask = st.check_inputs(tokens, attention_mask, who)
            targets = int_array(targets, who, "targets")
            if targets.shape != tokens.shape:
                raise ValueError(f"{who}: targets must have shape {tokens.shape} (the tokens'), got {targets.shape}")
            B = tokens.shape[0]
            M = int_arg(micro_batches, who, "micro_batches", lo=1, hi=max(B, 1),
                        expected=f"an integer in [1, batch={B}]")
            if B == 0:
                raise ValueError(f"{who}: the batch is empty")
            if schedule not in SCHEDULES:
                raise ValueError(f"{who}: schedule must be one of {', '.join(map(repr, SCHEDULES))}, got "
                                 f"{shown(schedule)}")
            ignore = int_arg(ignore_index, who, "ignore_index", lo=-2 ** 63, hi=2 ** 63 - 1)
        except (TypeError, ValueError) as e:
            err = e
        ok = err is None
        agree(self.mp, who, [] if not ok else [
            ("the batch shape (B, T) differs", (np.array(tokens.shape, np.int64),), None),
            ("micro_batches differs", M, str),
            ("schedule differs", SCHEDULES.index(schedule), lambda v: repr(SCHEDULES[v])),
            ("the tokens differ", (tokens,), None), ("the targets differ", (targets,), None),
            ("attention_mask differs", (mask,), None), ("ignore_index differs", ignore, str)], err)
        T, C = tokens.shape[1], self.config.hidden
        cuts = np.linspace(0, B, M + 1).round().astype(np.int64) if M > 1 else np.array([0, B])
        cuts = [(int(a), int(b)) for a, b in zip(cuts[:-1], cuts[1:])]
        counted = [(targets[a:b] != ignore).sum() for a, b in cuts]
        total = int(sum(counted))
        weights = [float(c) / total if total else 0.0 for c in counted]
        stats = dict(schedule=schedule, micro_batches=M, stages=self.num_stages, stage=self.stage_index,
                     wait_s=0.0, sent_bytes=0, recomputes=0, peak_inputs=0, peak_input_bytes=0)
        state = dict(saved={}, live=None, loss=0.0)
        g0 = self._tied_begin()

        def fwd(m, x):
            a, b = cuts[m]
            if self.last and not counted[m]:  # no target counts: no loss, a zero gradient (below)
                return 0.0
            state["saved"][m] = x
            held = state["saved"].values()
            stats["peak_inputs"] = max(stats["peak_inputs"], len(held))
            stats["peak_input_bytes"] = max(stats["peak_input_bytes"], sum(v.nbytes for v in held))
            h = self._stage_forward(x, None, pos[a:b], None if mask is None else mask[a:b], False, True)
            state["live"] = m
            if self.last:
                return st.head_loss(h, targets[a:b], ignore)
            return h

        def bwd(m, dy):
            if self.last and not counted[m]:
                a, b = cuts[m]
                return None if self.first else np.zeros((b - a, T, C), np.float32)
            if state["live"] != m:  # another micro-batch ran since: re-run this one's forward
                stats["recomputes"] += 1
                fwd(m, state["saved"][m])  # (its loss was counted at its first forward)
            a, b = cuts[m]
            dx = self._stage_backward(weights[m] if self.last else None, dy, pos[a:b])
            state["live"] = None
            del state["saved"][m]
            return dx

        def first_in(m):
            a, b = cuts[m]
            return tokens[a:b] if self.first else self._recv(self.stage_index - 1, (b - a, T, C), stats)

        def out_fwd(m, y):
            if self.last:
                state["loss"] += weights[m] * y
            else:
                self._send(y, self.stage_index + 1, stats)

        def shape(m):
            a, b = cuts[m]
            return (b - a, T, C)

        t0 = time.perf_counter()
        try:
            if schedule == "gpipe":
                for m in range(M):
                    out_fwd(m, fwd(m, first_in(m)))
                for m in reversed(range(M)):  # the last forward's context is still there: no re-run for it
                    dy = None if self.last else self._recv(self.stage_index + 1, shape(m), stats)
                    dx = bwd(m, dy)
                    if not self.first:
                        self._send(dx, self.stage_index - 1, stats)
            else:
                self._one_f_one_b(M, fwd, bwd, first_in, out_fwd, shape, state, stats)
        except BaseException:
            st.drop_backward()
            raise
        stats["step_s"] = time.perf_counter() - t0
        stats["compute_s"] = stats["step_s"] - stats["wait_s"]
        self._tied_end(g0)
        loss = np.array([state["loss"] if total else np.nan], np.float64)  # (no counted target: NaN, as torch)
        if self.num_stages > 1:
            self.pp.broadcast(loss, root=self.num_stages - 1)
        self.last_stats = stats
        return float(loss[0])

    def _one_f_one_b(self, M, fwd, bwd, first_in, out_fwd, shape, state, stats):
        P, s = self.num_stages, self.stage_index
        warm = min(P - s - 1, M)
        rest = M - warm
        for m in range(warm):
            out_fwd(m, fwd(m, first_in(m)))
        x = first_in(warm) if rest > 0 else None
        for i in range(rest):
            mf, mb = warm + i, i
            y = fwd(mf, x)
            if self.last:  # the loss of mf, then its backward at once
                out_fwd(mf, y)
                dy = None
            else:          # send mf's activation, receive mb's gradient: one exchange with s + 1
                dy = self._sendrecv(y, s + 1, shape(mb), stats)
            dx = bwd(mb, dy)
            if i == rest - 1:
                if not self.first:
                    self._send(dx, s - 1, stats)
            elif self.first:
                x = first_in(mf + 1)
            else:          # send mb's gradient, receive mf + 1's activation: one exchange with s - 1
                x = self._sendrecv(dx, s - 1, shape(mf + 1), stats)
        for m in range(rest, M):
            dy = None if self.last else self._recv(s + 1, shape(m), stats)
            dx = bwd(m, dy)
            if not self.first:
                self._send(dx, s - 1, stats)

    def _tied_begin(self):
        if self._tied is None or is_quantized(self.stage.wte.dtype):  # a quantized table: frozen, no gradient
            return None
        return self.stage.wte.grad_weight.copy()  # (a training step: allocates it, zeroed, before the first)

    def _tied_end(self, g0):
        """The first and last stages' embedding copies: this step's gradient of each summed (the
        embedding's and the head's share), so that both take the same update."""
        if self._tied is None or g0 is None:
            return
        g = self.stage.wte.grad_weight
        delta = np.subtract(g, g0, dtype=np.float32)
        self._tied.all_reduce(delta)
        np.add(g0, delta, out=g)

    # ------------------------------------------------------------- inference
    def logits(self, tokens: Any, attention_mask: Any = None) -> np.ndarray:
        """The full-vocabulary logits on every rank of the pipeline.

        Parameters
        ----------
        tokens : array_like of int, shape (B, T)
            The same on every rank.
        attention_mask : array_like, shape (B, T), optional
            Nonzero for real tokens.

        Returns
        -------
        numpy.ndarray, shape (B, T, vocab_size), float32

        Notes
        -----
        Collective over the grid: sends through the stages, then a broadcast from the last.
        """
        who = "PipelineLM.logits"
        st = self.stage
        err = None
        try:
            tokens, pos, mask = st.check_inputs(tokens, attention_mask, who)
        except (TypeError, ValueError) as e:
            err = e
        ok = err is None
        agree(self.mp, who, [] if not ok else [
            ("the batch shape (B, T) differs", (np.array(tokens.shape, np.int64),), None),
            ("the tokens differ", (tokens,), None), ("attention_mask differs", (mask,), None)], err)
        B, T = tokens.shape
        C, V = self.config.hidden, self.config.vocab_size
        s, stats = self.stage_index, dict(wait_s=0.0, sent_bytes=0)
        x = tokens if self.first else self._recv(s - 1, (B, T, C), stats)
        h = self._stage_forward(x, None, pos, mask, False, False)
        out = np.empty((B, T, V), np.float32)
        if self.last:
            out = st.gather_logits(st.logits_shard(np.ascontiguousarray(h.reshape(B * T, C)))).reshape(B, T, V)
        else:
            self._send(h, s + 1, stats)
        if self.num_stages > 1:
            self.pp.broadcast(out, root=self.num_stages - 1)
        return out

    def cache(self, batch: int, max_len: int) -> None:
        """(Re)allocate this stage's blocks' KV caches.

        Parameters
        ----------
        batch : int
            Sequences, >= 1.
        max_len : int
            Tokens per sequence, >= 1.
        """
        self.stage.cache(batch, max_len)

    def generate(self, prompts: Any, max_new_tokens: int = 16, temperature: float = 0.0, top_k: Optional[int] = None,
                 seed: int = 0, eos_token_id: Any = None, pad_token_id: Optional[int] = None) -> Any:
        """`TransformerLM.generate` across the stages.

        The prompt's prefill and each decode step go through the stages in turn (each stage
        its blocks' KV cache); the last stage picks the next tokens and every stage receives
        them.  Greedy decoding gives the tokens of one process.

        Parameters
        ----------
        prompts, max_new_tokens, temperature, top_k, seed, eos_token_id, pad_token_id
            As `TransformerLM.generate`.

        Returns
        -------
        numpy.ndarray or list
            As `TransformerLM.generate`.

        Raises
        ------
        TypeError, ValueError
            As `TransformerLM.generate`: logits no token can be drawn from are a ValueError
            naming the sequence and the step on every stage (the last stage broadcasts what
            it found instead of tokens).

        Notes
        -----
        Collective over the grid (sends between stages, broadcasts of the next tokens).
        """
        st = self.stage
        err, args = None, None
        try:
            args = generate_args(st, prompts, max_new_tokens, dict(temperature=temperature, top_k=top_k, seed=seed),
                                 eos_token_id, pad_token_id)
        except (TypeError, ValueError) as e:
            err = e
        agree_generate(self.mp, args, err)
        return self._generate(*args)

    def _generate(self, seqs, max_new_tokens, params, eos_ids, pad_token_id):
        st, s, P = self.stage, self.stage_index, self.num_stages
        C = self.config.hidden
        B, lens = len(seqs), np.array([q.size for q in seqs], np.int64)
        Tp = int(lens.max())
        st.cache(B, Tp + max_new_tokens)
        out = [list(q) for q in seqs]
        if max_new_tokens == 0:
            return generate_result(out)
        padded = np.zeros((B, Tp), np.int64)
        for b, q in enumerate(seqs):
            padded[b, :q.size] = q
        samplers = batch_samplers(params, self.config.vocab_size, seqs) if self.last else None
        stats = dict(wait_s=0.0, sent_bytes=0)
        zeros = np.zeros(B, np.int64)

        def step(x, p0, T):
            if not self.first:
                x = self._recv(s - 1, (B, T, C), stats)
            h = self._stage_forward(x, p0, p0[:, None] + np.arange(T)[None, :], None, True, False)
            if not self.last:
                self._send(h, s + 1, stats)
            return h

        h = step(padded, zeros, Tp)  # right padding: causal attention never reads the pads
        rows = np.arange(B), lens - 1
        cur, done = lens.copy(), np.zeros(B, bool)
        for i in range(max_new_tokens):
            nxt = np.zeros(B, np.int64)
            if self.last:
                last = np.ascontiguousarray(h[rows])
                logits = st.gather_logits(st.logits_shard(last))
                nxt, _ = sample_batch(logits, samplers)  # (< 0: no token; broadcast, so every stage says why)
            if P > 1:
                self.pp.broadcast(nxt, root=P - 1)
            if nxt.min() < 0:
                b = int(np.argmax(nxt < 0))
                raise logits_error("PipelineLM.generate", f"sequence {b}", i, int(nxt[b]))
            if eos_ids:
                nxt = np.where(done, pad_token_id, nxt)
            for b in range(B):
                out[b].append(int(nxt[b]))
                if samplers is not None and not done[b]:
                    samplers[b].accept(int(nxt[b]))  # (the penalties count it)
            if eos_ids:
                done |= np.isin(nxt, eos_ids)
            if i == max_new_tokens - 1 or (eos_ids and done.all()):
                break
            h = step(nxt.reshape(B, 1), cur, 1)
            rows = np.arange(B), np.zeros(B, np.int64)
            cur = cur + 1
        return generate_result(out)

    def __repr__(self):
        lo, hi = self.stage_bounds[self.stage_index]
        return (f"PipelineLM(stage {self.stage_index} of {self.num_stages}: blocks [{lo}, {hi}), "
                f"tp={self.tp.size}{', embedding' if self.first else ''}{', head' if self.last else ''})")
