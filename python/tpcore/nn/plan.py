"""The plan: per-rank shard sizes from measured speeds and memory, as a pure function.

`plan_from_measurements` turns each rank's speed (and memory limit) into the sizes of every
tensor-parallel dimension (query heads, MLP columns, vocabulary rows), split in proportion
to speed by largest remainders and capped by memory (water filling); `Plan` holds them, and
is what the layers and models take as ``plan=``.  Measuring the ranks and sharing the result
is `tpcore.parallel.planner.plan_partition`'s job (its module doc gives the rules in full).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from tpcore import _C
from tpcore.distributed.comm import Comm
from tpcore.utils.args import bool_arg, int_arg, is_int, shown
from tpcore.utils.dtypes import WEIGHT_FORMATS, block_size, bytes_per_element

OBJECTIVES = ("both", "prefill", "decode")
HEAD_UNITS = ("auto", "group", "head")
_FORMAT = "tpcore-plan"
_VERSION = 1



@dataclasses.dataclass(frozen=True)
class Dims:
    """The sizes a plan splits and the shapes its byte estimate needs.  heads == 0: a plain
    MLP (hidden -> ffn -> hidden: tpcore.ParallelMLP or a Column/RowParallelLinear pair)."""
    hidden: int
    ffn: int
    heads: int = 0
    kv_heads: int = 0
    head_dim: int = 0
    vocab: int = 0
    layers: int = 1
    gated: bool = False          # SwiGLU: fc1 holds [gate; up], 2 rows per column
    bias: bool = True
    tie: bool = True             # the LM head reads the embedding's rows
    layernorm: bool = True       # norms with a bias (LayerNorm) or without (RMSNorm)
    replicated_rows: int = 0     # position / token-type embedding rows (replicated, float32)

    @property
    def is_mlp(self) -> bool:
        return self.heads == 0

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads if self.heads else 1

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def _is_config(spec) -> bool:
    """A tpcore.Config (recognised by its fields: the layers import this module, so it does not
    import theirs)."""
    return type(spec).__name__ == "Config" and all(
        hasattr(spec, k) for k in ("validate", "hidden", "ffn_hidden", "heads", "kv_heads", "head_dim", "vocab_size"))


def dims_of(spec, who: str = "plan_partition") -> Dims:
    """Dims from a tpcore.Config, a (hidden, ffn_hidden) pair or a dict of Dims' fields."""
    if isinstance(spec, Dims):
        return spec
    if _is_config(spec):
        c = spec.validate()
        rows = (c.max_positions if c.positions == "learned" else 0) + c.type_vocab_size
        return Dims(hidden=c.hidden, ffn=c.ffn_hidden, heads=c.heads, kv_heads=c.kv_heads, head_dim=c.head_dim,
                    vocab=c.vocab_size, layers=c.layers, gated=c.activation in ("swiglu", "geglu"), bias=c.bias,
                    tie=c.tie_embeddings, layernorm=c.norm == "layernorm", replicated_rows=rows)
    if isinstance(spec, dict):
        return _dims_from_dict(spec, who)
    if isinstance(spec, (tuple, list)) and len(spec) == 2 and all(is_int(v) for v in spec):
        hidden = int_arg(spec[0], who, "hidden", lo=1)
        ffn = int_arg(spec[1], who, "ffn_hidden", lo=1)
        return Dims(hidden=hidden, ffn=ffn)
    raise TypeError(f"{who}: config_or_layer_dims must be a tpcore.Config, a (hidden, ffn_hidden) pair of integers "
                    f"or a dict of the planner's dims, got {shown(spec)}")


def _dims_from_dict(d: dict, who: str) -> Dims:
    fields = {f.name: f for f in dataclasses.fields(Dims)}
    extra = sorted(set(d) - set(fields))
    if extra:
        raise ValueError(f"{who}: unknown dims field(s) {extra} (expected some of {sorted(fields)})")
    for need in ("hidden", "ffn"):
        if need not in d:
            raise ValueError(f"{who}: dims need {need!r}")
    kw = {}
    for name, v in d.items():
        if name in ("gated", "bias", "tie", "layernorm"):
            kw[name] = bool_arg(v, who, f"dims {name}")
        else:
            kw[name] = int_arg(v, who, f"dims {name}", lo=1 if name in ("hidden", "ffn", "layers") else 0)
    dims = Dims(**kw)
    if dims.heads:
        if dims.kv_heads < 1 or dims.heads % dims.kv_heads:
            raise ValueError(f"{who}: dims heads ({dims.heads}) must be a multiple of kv_heads ({dims.kv_heads})")
        if dims.head_dim < 1 or dims.vocab < 1:
            raise ValueError(f"{who}: a transformer's dims need head_dim >= 1 and vocab >= 1, got "
                             f"{dims.head_dim} and {dims.vocab}")
    elif dims.kv_heads or dims.head_dim or dims.vocab:
        raise ValueError(f"{who}: dims without heads are a plain MLP: kv_heads, head_dim and vocab must be 0")
    return dims


# ------------------------------------------------------------------ the plan's arithmetic

def _kv_held(q0: int, nq: int, group: int) -> int:
    """KV heads a rank holding query heads [q0, q0 + nq) keeps: the groups they touch."""
    return 0 if nq == 0 else (q0 + nq - 1) // group - q0 // group + 1


def _offsets(sizes: Sequence[int]) -> List[int]:
    out, o = [], 0
    for s in sizes:
        out.append(o)
        o += s
    return out


def rank_bytes(d: Dims, heads: Sequence[int], ffn: Sequence[int], vocab: Sequence[int], wb: int,
                cache: Optional[Tuple[int, int]]) -> List[int]:
    """Each rank's parameter bytes (weights wb each; biases, norms, position rows float32),
    plus its KV cache for cache=(batch, max_len)."""
    C, g, f4 = d.hidden, 2 if d.gated else 1, 4
    norm = C * f4 * (2 if d.layernorm else 1)
    out = []
    q0s = _offsets(heads)
    for r in range(len(ffn)):
        layer = g * ffn[r] * C * wb + C * ffn[r] * wb + (g * ffn[r] * f4 + C * f4 if d.bias else 0)
        if d.is_mlp:
            out.append(layer)
            continue
        nq, D = heads[r], d.head_dim
        nk = _kv_held(q0s[r], nq, d.group)
        layer += (nq + 2 * nk) * D * C * wb + C * nq * D * wb + ((nq + 2 * nk) * D * f4 + C * f4 if d.bias else 0)
        layer += 2 * norm
        if cache is not None:
            layer += 2 * cache[0] * cache[1] * nk * D * f4
        model = d.layers * layer + vocab[r] * C * wb * (1 if d.tie else 2) + d.replicated_rows * C * f4 + norm
        out.append(model)
    return out


def _rank_work(d: Dims, heads: Sequence[int], ffn: Sequence[int], vocab: Sequence[int]) -> List[float]:
    """Each rank's weight elements read per token (GEMM flops and GEMV bytes are both in
    proportion to them): the compute of a step on that rank, up to a constant."""
    C, g = d.hidden, 2 if d.gated else 1
    q0s = _offsets(heads)
    out = []
    for r in range(len(ffn)):
        w = (g + 1) * ffn[r] * C
        if not d.is_mlp:
            nk = _kv_held(q0s[r], heads[r], d.group)
            w += (2 * heads[r] + 2 * nk) * d.head_dim * C
            w = w * d.layers + vocab[r] * C
        out.append(float(w))
    return out


def _auto_align(n: int, world: int) -> int:
    a = 32
    while a > 1 and (n % a or n // a < 8 * world):
        a //= 2
    return a


def _waterfill(speeds: Sequence[float], caps: Sequence[float]) -> List[float]:
    """Shares f (summing to 1) with f[r] = min(caps[r], lam * speeds[r]); caps sum >= 1."""
    world = len(speeds)
    f = [0.0] * world
    free = list(range(world))
    left = 1.0
    while free:
        total = sum(speeds[r] for r in free)
        lam = left / total
        over = [r for r in free if lam * speeds[r] > caps[r]]
        if not over:
            for r in free:
                f[r] = lam * speeds[r]
            break
        for r in over:
            f[r] = caps[r]
            left -= caps[r]
        free = [r for r in free if r not in over]
    return f


def _split(units: int, shares: Sequence[float]) -> List[int]:
    """Largest remainders of units * shares (tpcore.partition), then every rank with a
    positive share and no unit gets one from the rank furthest above its exact share."""
    world = len(shares)
    counts = list(_C.partition(units, world, [float(s) for s in shares], 1))  # tpcore.partition's split
    total = sum(shares)
    exact = [units * s / total for s in shares]
    if units >= world:
        for r in range(world):
            if counts[r] == 0 and shares[r] > 0:
                donors = [q for q in range(world) if counts[q] > 1]
                if not donors:
                    break
                q = max(donors, key=lambda q: (counts[q] - exact[q], -q))
                counts[q] -= 1
                counts[r] += 1
    return counts


class PlanError(ValueError):
    """A plan that cannot be made (the model does not fit) or a plan file that is corrupt."""


@dataclasses.dataclass
class Plan:
    """Per-rank shard sizes from measured speeds (see the module doc).

    Made by `plan_partition` / `plan_from_measurements` or `Plan.load`; pass it as
    ``plan=`` to the layers and models (or ``**plan.model_kwargs()``).  A dataclass.

    Parameters
    ----------
    dims : Dims
        The sizes split and the shapes of the byte estimate.
    heads, ffn, vocab : list of int
        Each rank's query heads, MLP columns and vocabulary rows (heads and vocab are
        empty lists for a plain MLP).
    speeds : list of float
        Relative to the fastest (1.0).
    memory : list of int or None
        The byte limits (None: none).
    bytes_per_rank : list of int
        Estimated parameter (+ KV cache) bytes.
    predicted : float
        The step time of this plan over that of equal shards (< 1: faster), from the work
        per rank / speed.
    predicted_ideal : float
        Total work / total speed over equal shards' step (the bound).
    shares : list of float
        Each rank's fraction of every dimension before rounding (speed, capped by memory).
    align : dict
        The units of "ffn" and "vocab".
    head_unit : {"group", "head"}
        Heads split in whole GQA groups or whole heads.
    dtype : str, default "float32"
        The weights' dtype of the byte estimate.
    cache : (int, int), optional
        (batch, max_len) of the KV cache counted.
    measurements : dict, optional
        What the ranks measured.
    """
    dims: Dims
    heads: List[int]
    ffn: List[int]
    vocab: List[int]
    speeds: List[float]
    memory: Optional[List[int]]
    bytes_per_rank: List[int]
    predicted: float
    predicted_ideal: float
    shares: List[float]
    align: Dict[str, int]
    head_unit: str
    dtype: str = "float32"
    cache: Optional[Tuple[int, int]] = None
    measurements: Optional[dict] = None

    @property
    def world(self) -> int:
        """The number of ranks the plan is for."""
        return len(self.speeds)

    def model_kwargs(self) -> Dict[str, List[int]]:
        """The partition arguments of TransformerLM or ParallelMLP.

        Returns
        -------
        dict
            partition, ffn_partition, vocab_partition for a TransformerLM; partition for a
            plain MLP's plan (tpcore.ParallelMLP).
        """
        if self.dims.is_mlp:
            return {"partition": list(self.ffn)}
        return {"partition": list(self.heads), "ffn_partition": list(self.ffn), "vocab_partition": list(self.vocab)}

    def sizes_for(self, n: int, who: str, prefer: str = "ffn") -> List[int]:
        """The split of a dimension of length n.

        Parameters
        ----------
        n : int
            The length: the MLP columns (ffn), the vocabulary rows or the query heads'
            features (heads * head_dim), whichever has length n.
        who : str
            The caller, for the message.
        prefer : {"ffn", "vocab"}, default "ffn"
            "vocab": the vocabulary first (for an embedding).

        Returns
        -------
        list of int
            Per rank.

        Raises
        ------
        ValueError
            The plan splits no dimension of length n.
        """
        if prefer == "vocab" and self.vocab and n == self.dims.vocab:
            return list(self.vocab)
        if n == self.dims.ffn:
            return list(self.ffn)
        if self.vocab and n == self.dims.vocab:
            return list(self.vocab)
        if self.heads and n == self.dims.heads * self.dims.head_dim:
            return [h * self.dims.head_dim for h in self.heads]
        have = [f"ffn={self.dims.ffn}"] + ([f"vocab={self.dims.vocab}", f"heads*head_dim="
                                            f"{self.dims.heads * self.dims.head_dim}"] if self.heads else [])
        raise ValueError(f"{who}: the plan splits no dimension of length {n} ({', '.join(have)})")

    def check_world(self, comm: Comm, who: str) -> None:
        """Check the plan is for comm's size.

        Parameters
        ----------
        comm : Comm
        who : str
            The caller, for the message.

        Raises
        ------
        ValueError
            The plan is for another number of ranks.
        """
        if self.world != comm.size:
            raise ValueError(f"{who}: the plan is for {self.world} ranks but the communicator has {comm.size}")

    def check_config(self, cfg: Any, who: str) -> None:
        """Check the plan was made for this model's sizes.

        Parameters
        ----------
        cfg : Config or (int, int) or dict
            As `plan_partition`'s config_or_layer_dims.
        who : str
            The caller, for the message.

        Raises
        ------
        ValueError
            A size differs (named).
        """
        d = dims_of(cfg, who)
        for name in ("hidden", "ffn", "heads", "kv_heads", "head_dim", "vocab"):
            if getattr(d, name) != getattr(self.dims, name):
                raise ValueError(f"{who}: the plan was made for {name}={getattr(self.dims, name)} but the model has "
                                 f"{name}={getattr(d, name)}")

    def __str__(self) -> str:
        mlp = self.dims.is_mlp
        head = f"{'rank':>4} {'speed':>6} {'share':>6} " + ("" if mlp else f"{'heads':>5} ") + f"{'ffn cols':>8} "
        head += ("" if mlp else f"{'vocab rows':>10} ") + f"{'MB':>9}"
        lines = [head + ("" if self.memory is None else f" {'limit MB':>9}")]
        for r in range(self.world):
            row = f"{r:>4} {self.speeds[r]:>6.3f} {self.shares[r]:>6.1%} " + ("" if mlp else f"{self.heads[r]:>5} ")
            row += f"{self.ffn[r]:>8} " + ("" if mlp else f"{self.vocab[r]:>10} ")
            row += f"{self.bytes_per_rank[r] / 1e6:>9.2f}"
            if self.memory is not None:
                row += f" {self.memory[r] / 1e6:>9.1f}"
            lines.append(row)
        units = f"heads in whole {'GQA groups' if self.head_unit == 'group' else 'heads'}, " if not mlp else ""
        units += f"ffn align {self.align['ffn']}" + ("" if mlp else f", vocab align {self.align['vocab']}")
        lines.append(f"{units}; predicted step {self.predicted:.2f}x of equal shards "
                     f"(ideal {self.predicted_ideal:.2f}x)")
        return "\n".join(lines)

    # ----------------------------------------------------------- save / load
    def to_json(self) -> Dict[str, Any]:
        """The plan as a JSON-able dict (what `save` writes)."""
        return {"format": _FORMAT, "version": _VERSION, "dims": self.dims.to_json(), "heads": self.heads,
                "ffn": self.ffn, "vocab": self.vocab, "speeds": self.speeds, "memory": self.memory,
                "bytes_per_rank": self.bytes_per_rank, "predicted": self.predicted,
                "predicted_ideal": self.predicted_ideal, "shares": self.shares, "align": self.align,
                "head_unit": self.head_unit,
                "dtype": self.dtype, "cache": None if self.cache is None else list(self.cache),
                "measurements": self.measurements}

    def save(self, path: str) -> None:
        """Write the plan as JSON (the measurements it came from, its sizes and estimates).

        Parameters
        ----------
        path : str
            The file (written to a temporary name, then renamed).

        Raises
        ------
        OSError
            It cannot be written.
        """
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(self.to_json(), f, indent=1)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str) -> "Plan":
        """A plan saved by `save`.

        Every field is checked, and the sizes and estimates are computed again from its
        speeds, memory and alignment.

        Parameters
        ----------
        path : str

        Returns
        -------
        Plan

        Raises
        ------
        PlanError
            The file cannot be read, is not JSON, or is corrupt or edited (a ValueError
            naming the file and the field).
        """
        try:
            with open(path, "rb") as f:
                raw = f.read()
        except OSError as e:
            raise PlanError(f"Plan.load: cannot read {path}: {e.strerror or e}") from None
        try:
            doc = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as e:
            raise PlanError(f"Plan.load: {path} is not a JSON plan ({e})") from None
        return cls.from_json(doc, source=path)

    @classmethod
    def from_json(cls, doc: Any, source: str = "plan") -> "Plan":
        """A plan from `to_json`'s dict (checked as `load` does).

        Parameters
        ----------
        doc : dict
        source : str, default "plan"
            Where it came from, for the messages.

        Returns
        -------
        Plan

        Raises
        ------
        PlanError
            A bad field.
        """
        def fail(field, want, got):
            return PlanError(f"Plan.load: {source}: field {field!r} must be {want}, got {shown(got)}")
        if not isinstance(doc, dict):
            raise fail("(top level)", "a JSON object", doc)
        if doc.get("format") != _FORMAT or doc.get("version") != _VERSION:
            raise fail("format/version", f"{_FORMAT!r} version {_VERSION}", (doc.get("format"), doc.get("version")))
        missing = [k for k in ("dims", "heads", "ffn", "vocab", "speeds", "memory", "bytes_per_rank", "predicted",
                               "align", "head_unit", "dtype") if k not in doc]
        if missing:
            raise PlanError(f"Plan.load: {source}: missing field(s) {missing}")
        try:
            dims = _dims_from_dict(doc["dims"], "Plan.load") if isinstance(doc["dims"], dict) else None
        except (TypeError, ValueError) as e:
            raise PlanError(f"Plan.load: {source}: {e}") from None
        if dims is None:
            raise fail("dims", "an object", doc["dims"])
        speeds = doc["speeds"]
        if not isinstance(speeds, list) or not speeds or not all(
                isinstance(s, (int, float)) and not isinstance(s, bool) and math.isfinite(s) and s > 0 for s in speeds):
            raise fail("speeds", "a non-empty list of finite positive numbers", speeds)
        world = len(speeds)
        memory = doc["memory"]
        if memory is not None and (not isinstance(memory, list) or len(memory) != world or
                                   not all(is_int(m) and m > 0 for m in memory)):
            raise fail("memory", f"null or a list of {world} positive integers (bytes)", memory)
        align = doc["align"]
        if not isinstance(align, dict) or set(align) != {"ffn", "vocab"} or \
                not all(is_int(v) and v >= 1 for v in align.values()):
            raise fail("align", "an object {\"ffn\": int >= 1, \"vocab\": int >= 1}", align)
        if doc["head_unit"] not in ("group", "head"):
            raise fail("head_unit", "\"group\" or \"head\"", doc["head_unit"])
        if doc["dtype"] not in WEIGHT_FORMATS:
            raise fail("dtype", f"one of {sorted(WEIGHT_FORMATS)}", doc["dtype"])
        cache = doc.get("cache")
        if cache is not None and (not isinstance(cache, list) or len(cache) != 2 or
                                  not all(is_int(v) and v >= 1 for v in cache)):
            raise fail("cache", "null or [batch, max_len]", cache)
        for name in ("heads", "ffn", "vocab", "bytes_per_rank"):
            v = doc[name]
            n = 0 if dims.is_mlp and name in ("heads", "vocab") else world
            if not isinstance(v, list) or len(v) != n or not all(is_int(x) and x >= 0 for x in v):
                raise fail(name, f"a list of {n} non-negative integers", v)
        meas = doc.get("measurements")
        if meas is not None and not isinstance(meas, dict):
            raise fail("measurements", "null or an object", meas)
        try:
            again = plan_from_measurements(dims, speeds, memory, align, head_unit=doc["head_unit"],
                                           dtype=doc["dtype"], cache=None if cache is None else tuple(cache))
        except ValueError as e:
            raise PlanError(f"Plan.load: {source}: its speeds, memory and alignment give no plan: {e}") from None
        for name in ("heads", "ffn", "vocab", "bytes_per_rank"):
            if list(getattr(again, name)) != doc[name]:
                raise PlanError(f"Plan.load: {source}: field {name!r} is {doc[name]} but the plan's speeds, memory "
                                f"and alignment give {list(getattr(again, name))} (an edited or corrupt file: "
                                f"edit speeds or memory, not the sizes)")
        for name in ("predicted", "predicted_ideal"):
            v = doc.get(name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not abs(v - getattr(again, name)) <= 1e-9:
                raise PlanError(f"Plan.load: {source}: field {name!r} is {shown(v)} but the plan gives "
                                f"{getattr(again, name)!r}")
        again.measurements = meas
        return again


def check_speeds(speeds, world: Optional[int], who: str) -> List[float]:
    if isinstance(speeds, (str, bytes)) or not hasattr(speeds, "__iter__"):
        raise TypeError(f"{who}: speeds must be a list of positive numbers (one per rank), got {shown(speeds)}")
    out = []
    for s in speeds:
        if isinstance(s, (bool, np.bool_)) or not isinstance(s, (int, float, np.integer, np.floating)):
            raise TypeError(f"{who}: speeds must be positive numbers, got {shown(s)} in {shown(speeds)}")
        s = float(s)
        if not math.isfinite(s) or s <= 0:
            raise ValueError(f"{who}: speeds must be finite and > 0, got {list(speeds)}")
        out.append(s)
    if not out or (world is not None and len(out) != world):
        raise ValueError(f"{who}: speeds has {len(out)} entries, expected one per rank ({world})")
    return out


def check_memory(memory, world: int, who: str) -> Optional[List[int]]:
    if memory is None:
        return None
    if isinstance(memory, dict):
        bad = [k for k in memory if not is_int(k) or not 0 <= k < world]
        if bad:
            raise ValueError(f"{who}: memory_limits keys must be ranks in [0, {world}), got {bad}")
        if len(memory) != world:
            raise ValueError(f"{who}: memory_limits must give every rank's bytes, missing ranks "
                             f"{sorted(set(range(world)) - set(memory))}")
        memory = [memory[r] for r in range(world)]
    if isinstance(memory, (str, bytes)) or not hasattr(memory, "__iter__"):
        raise TypeError(f"{who}: memory_limits must be a list or dict of bytes per rank, got {shown(memory)}")
    out = []
    for m in memory:
        if isinstance(m, float) and m.is_integer() and math.isfinite(m):
            m = int(m)
        out.append(int_arg(m, who, "memory_limits entry", lo=1))
    if len(out) != world:
        raise ValueError(f"{who}: memory_limits has {len(out)} entries, expected one per rank ({world})")
    return out


def check_align(align, dims: Dims, world: int, who: str, dtype: str = "float32") -> Dict[str, int]:
    """The units of the MLP and vocabulary splits; a quantized dtype's MLP unit is a multiple
    of its block (the row-parallel fc2 is split along its rows' blocks)."""
    blk = block_size(dtype) if dtype in WEIGHT_FORMATS else 1
    if align is None:
        align = {}
    elif is_int(align):
        align = {"ffn": int(align)}
    elif not isinstance(align, dict) or set(align) - {"ffn", "vocab"}:
        raise TypeError(f"{who}: align must be an integer (the MLP columns' unit) or a dict with keys 'ffn' / "
                        f"'vocab', got {shown(align)}")
    out = {}
    for key, n in (("ffn", dims.ffn), ("vocab", dims.vocab)):
        if key in align:
            a = int_arg(align[key], who, f"align[{key!r}]", lo=1)
            if n and n % a:
                raise ValueError(f"{who}: align[{key!r}]={a} does not divide {key}={n}")
            if key == "ffn" and a % blk:
                raise ValueError(f"{who}: align['ffn']={a} is not a multiple of {dtype}'s block of {blk} elements "
                                 f"(the MLP's row-parallel weight splits on block boundaries)")
            out[key] = a
        else:
            a = _auto_align(n, world) if n else 1
            if key == "ffn" and blk > 1:
                if n % blk:
                    raise ValueError(f"{who}: ffn_hidden={n} is not a multiple of {dtype}'s block of {blk} elements")
                a = blk * _auto_align(n // blk, world)
            out[key] = a
    return out


def plan_from_measurements(dims: Any, speeds: Sequence[float], memory: Any = None, align: Any = None,
                           head_unit: str = "auto", dtype: str = "float32",
                           cache: Optional[Tuple[int, int]] = None) -> Plan:
    """The plan for given speeds and memory limits: a pure function, the same on every rank.

    Parameters
    ----------
    dims : Config, (int, int), dict or Dims
        The model: a tpcore.Config, a (hidden, ffn_hidden) pair for a plain MLP, or a dict
        of Dims' fields.
    speeds : sequence of float
        One per rank, > 0; only their ratios matter.
    memory : sequence of int or dict, optional
        Bytes per rank (a list, or a dict rank -> bytes).  Default None: no limit.
    align : dict, optional
        {"ffn": units, "vocab": units}.  Default None: chosen (see the module doc).
    head_unit : {"auto", "group", "head"}, default "auto"
    dtype : str, default "float32"
        The weights' dtype of the byte estimate.
    cache : (int, int), optional
        (batch, max_len): count the KV cache too.

    Returns
    -------
    Plan

    Raises
    ------
    TypeError, ValueError
        A bad argument.
    PlanError
        The model does not fit the memory limits.

    Notes
    -----
    No collective.
    """
    who = "plan_from_measurements"
    d = dims_of(dims, who)
    sp = check_speeds(speeds, None, who)
    world = len(sp)
    top = max(sp)
    sp = [s / top for s in sp]
    mem = check_memory(memory, world, who)
    al = check_align(align, d, world, who, dtype if dtype in WEIGHT_FORMATS else "float32")
    if head_unit not in HEAD_UNITS:
        raise ValueError(f"{who}: head_unit must be one of {HEAD_UNITS}, got {head_unit!r}")
    if dtype not in WEIGHT_FORMATS:
        raise ValueError(f"{who}: dtype must be one of {sorted(WEIGHT_FORMATS)}, got {shown(dtype)}")
    if cache is not None:
        if not isinstance(cache, (tuple, list)) or len(cache) != 2:
            raise TypeError(f"{who}: cache must be (batch, max_len), got {shown(cache)}")
        cache = (int_arg(cache[0], who, "cache batch", lo=1), int_arg(cache[1], who, "cache max_len", lo=1))
    wb = bytes_per_element(dtype)
    unit = head_unit
    if not d.is_mlp and unit == "auto":
        unit = "head"
        if d.kv_heads < d.heads and d.kv_heads >= world:
            g = [c * d.group for c in _split(d.kv_heads, sp)]
            h = _split(d.heads, sp)
            if max(x / s for x, s in zip(g, sp)) <= 1.10 * max(x / s for x, s in zip(h, sp)):
                unit = "group"
    elif d.is_mlp:
        unit = "head"
    if unit == "group" and not d.is_mlp and d.kv_heads < world:
        raise ValueError(f"{who}: head_unit='group' needs at least one KV group per rank ({d.kv_heads} KV heads, "
                         f"{world} ranks); use head_unit='head'")

    # a quantized format's row-parallel output projection splits its heads x head_dim columns in
    # whole blocks: heads in units of hu (KV groups in units of gu) when the model allows it
    hu = gu = 1
    if not d.is_mlp and d.head_dim:
        blk = block_size(dtype)
        hu = blk // math.gcd(blk, d.head_dim)
        gu = hu // math.gcd(hu, d.group)
        if d.heads % hu or (unit == "group" and d.kv_heads % gu):
            hu = gu = 1  # no whole-block split exists: the layer names the problem

    def sizes_for(shares):
        heads = [] if d.is_mlp else (
            [c * d.group * gu for c in _split(d.kv_heads // gu, shares)] if unit == "group"
            else [c * hu for c in _split(d.heads // hu, shares)])
        ffn = [c * al["ffn"] for c in _split(d.ffn // al["ffn"], shares)]
        vocab = [] if d.is_mlp else [c * al["vocab"] for c in _split(d.vocab // al["vocab"], shares)]
        return heads, ffn, vocab

    def bytes_of(heads, ffn, vocab):
        return rank_bytes(d, heads or [0] * world, ffn, vocab or [0] * world, wb, cache)

    caps = [math.inf] * world
    whole = rank_bytes(d, [d.heads], [d.ffn], [d.vocab], wb, cache)[0]
    none = rank_bytes(d, [0], [0], [0], wb, cache)[0]
    sharded = max(1, whole - none)
    if mem is not None:
        # the linear model of bytes: replicated + share * sharded (KV heads mid-group and rounding are
        # checked exactly below, and a rank over its limit gets a smaller cap)
        for r in range(world):
            if mem[r] <= none:
                raise PlanError(f"{who}: rank {r}'s memory limit ({mem[r]} bytes) does not hold even the replicated "
                                f"parameters ({none} bytes: norms, biases, position embeddings)")
            caps[r] = (mem[r] - none) / sharded
    for _ in range(8 * world + 8):
        if sum(caps) < 1.0:
            raise PlanError(f"{who}: the model does not fit in the memory limits {mem} (bytes per rank, "
                            f"{sum(mem)} in all): it holds {whole} bytes of parameters"
                            + (" and KV cache" if cache else "") + f", {none} of them replicated on every rank")
        shares = _waterfill(sp, caps)
        heads, ffn, vocab = sizes_for(shares)
        nbytes = bytes_of(heads, ffn, vocab)
        over = [r for r in range(world) if mem is not None and nbytes[r] > mem[r]]
        if not over:
            break
        for r in over:
            # shrink the cap by the overshoot (at least a little, so that this terminates)
            caps[r] = max(0.0, min(caps[r], shares[r]) - max((nbytes[r] - mem[r]) / sharded, 1e-3 * shares[r]))
    else:
        raise PlanError(f"{who}: found no split within the memory limits {mem} (bytes per rank)")
    # equal shards: what the layers make without a partition (even whole heads, columns, rows)
    eq_heads = [0] * world if d.is_mlp else list(_C.partition(d.heads, world, None, 1))
    eq_ffn = list(_C.partition(d.ffn, world, None, 1))
    eq_vocab = [0] * world if d.is_mlp else list(_C.partition(d.vocab, world, None, 1))
    work = _rank_work(d, heads or [0] * world, ffn, vocab or [0] * world)
    eq_work = _rank_work(d, eq_heads or [0] * world, eq_ffn, eq_vocab or [0] * world)
    step = max(w / s for w, s in zip(work, sp))
    eq_step = max(w / s for w, s in zip(eq_work, sp))
    ideal = _rank_work(d, [d.heads], [d.ffn], [d.vocab])[0] / sum(sp)  # the whole model's work, spread by speed
    return Plan(dims=d, heads=heads, ffn=ffn, vocab=vocab, speeds=sp, memory=mem, bytes_per_rank=nbytes,
                predicted=step / eq_step, predicted_ideal=ideal / eq_step, shares=shares, align=al,
                head_unit="head" if d.is_mlp else unit, dtype=dtype, cache=cache)



def plan_arg(plan, comm: Comm, who: str, **given) -> Optional[Plan]:
    """A layer's plan= argument: None, or a Plan for comm's size, with no partition given beside it."""
    if plan is None:
        return None
    if not isinstance(plan, Plan):
        raise TypeError(f"{who}: plan must be a tpcore.Plan (tpcore.plan_partition / Plan.load), got {shown(plan)}")
    both = [k for k, v in given.items() if v is not None]
    if both:
        raise ValueError(f"{who}: give either plan or {', '.join(both)}, not both")
    plan.check_world(comm, who)
    return plan
