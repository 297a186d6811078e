"""A model's checkpoint state: its full tensors in tpcore's names and the folders it saves.

`state_dict_full` gathers every tensor whole ("wte.weight", "blocks.0.attn.q.weight", ...),
`load_state_dict_full` loads full tensors (arrays, memory-mapped arrays or lazy views:
each rank reads only its slices, through one staging buffer), `save_pretrained` writes the
folders `tpcore.models.from_pretrained` loads: tpcore's own (full tensors, or one file per
rank) or Hugging Face's.  `TransformerLM` has them from `_CheckpointMixin`, which reads the
model's parts (embeddings, blocks, norms, head) and writes through tpcore.io.
"""
from __future__ import annotations

import os
import sys
import time
from typing import Any, Dict

import numpy as np

from tpcore.io import formats
from tpcore.io import stream as _stream
from tpcore.models import hf as _hf
from tpcore.nn.weights import load_weight
from tpcore.utils.arrays import DeviceArray, asarray


class _CheckpointMixin:
    """`TransformerLM`'s checkpoint methods: its full tensors, loading them, saving folders."""

    def state_dict_full(self) -> Dict[str, np.ndarray]:
        """The full tensors in tpcore's names ("wte.weight", "blocks.0.attn.q.weight", ...).

        Returns
        -------
        dict of str to numpy.ndarray
            A pipeline stage gives what it holds, its blocks under their numbers in the
            whole model.

        Notes
        -----
        Collective: all-gathers of every sharded tensor.
        """
        sd = {"wte.weight": self.wte.gather_full()} if self._first else {}
        if self.wpe is not None:
            sd["wpe.weight"] = _hostcopy(self.wpe)
        if self.tte is not None:
            sd["tte.weight"] = _hostcopy(self.tte)
        if self.emb_norm is not None:
            sd["emb_norm.weight"] = _hostcopy(self.emb_norm.weight)
            if self.emb_norm.bias is not None:
                sd["emb_norm.bias"] = _hostcopy(self.emb_norm.bias)
        lo = self.layer_range[0]
        for i, blk in enumerate(self.blocks):
            for k, v in blk.gather_full().items():
                sd[f"blocks.{lo + i}.{k}"] = v
        if self.final_norm is not None:
            sd["final_norm.weight"] = _hostcopy(self.final_norm.weight)
            if self.final_norm.bias is not None:
                sd["final_norm.bias"] = _hostcopy(self.final_norm.bias)
        if self.lm_head is not None:
            sd["lm_head.weight"] = self.lm_head.gather_full()[0]
        return sd

    def load_state_dict_full(self, sd: Dict[str, Any], progress: bool = False) -> None:
        """Load full tensors (tpcore's names); each rank keeps its slices.

        Parameters
        ----------
        sd : dict of str to array_like
            As `state_dict_full` gives; arrays or memory-mapped views (only the rank's
            slices are read).
        progress : bool, default False
            Show a progress line.

        Raises
        ------
        KeyError
            A tensor is missing.
        ValueError
            A tensor of the wrong shape.

        Notes
        -----
        No collective (each rank reads its slices).
        """
        def take(name):
            if name not in sd:
                raise KeyError(f"checkpoint: missing tensor {name!r}")
            t = sd[name]  # an array, a memory-mapped array or a lazy view: only the rank's slices are read
            if not isinstance(t, np.ndarray) and hasattr(t, "__dlpack__"):  # another library's tensor
                t = asarray(t, name, "TransformerLM.load_state_dict_full")  # device checked, no copy
            return t

        with _stream.loading_default("TransformerLM.load_state_dict_full"):   # one staging buffer
            self._load_full(take, progress)

    def _load_full(self, take, progress):
        if self.wte is not None:  # (a last pipeline stage's tied copy too)
            _load_embedding(self.wte, take("wte.weight"))
        if self.wpe is not None:
            _assign(self.wpe, take("wpe.weight"), "wpe.weight")
        if self.tte is not None:
            _assign(self.tte, take("tte.weight"), "tte.weight")
        for nm, norm in (("emb_norm", self.emb_norm), ("final_norm", self.final_norm)):
            if norm is not None:
                _assign(norm.weight, take(f"{nm}.weight"), f"{nm}.weight")
                if norm.bias is not None:
                    _assign(norm.bias, take(f"{nm}.bias"), f"{nm}.bias")
        bar = _Progress(len(self.blocks), progress and self.comm.rank == 0)
        lo = self.layer_range[0]
        for i, blk in enumerate(self.blocks):
            blk.load_full({k: take(f"blocks.{lo + i}.{k}") for k in blk.full_shapes()})
            bar.step()
        bar.done()
        if self.lm_head is not None:
            W = take("lm_head.weight")
            lo, n = self.vocab_partition[self.comm.rank]
            if tuple(W.shape) != (self.config.vocab_size, self.config.hidden):
                raise ValueError(f"checkpoint: lm_head.weight has shape {tuple(W.shape)}")
            load_weight(self.lm_head.weight, self.lm_head.dtype, W, slice(lo, lo + n), None, "lm_head.weight")

    def save_pretrained(self, path: str, sharded: bool = False, hf: bool = False) -> None:
        """Save the model to a directory that `from_pretrained` loads.

        Parameters
        ----------
        path : str
            The directory (made when missing).
        sharded : bool, default False
            False: tpcore_config.json + model.safetensors, full tensors (rank 0 writes;
            loadable at any world size).  True: one file per rank
            (model.rank<r>-of-<n>.safetensors; loads only into the same layout).
        hf : bool, default False
            Full tensors under Hugging Face's names with its config.json, for transformers'
            from_pretrained (GPT-2, Llama, BERT); not with sharded.

        Raises
        ------
        ValueError
            hf with sharded; sharded with quantized weights.
        OSError
            The files cannot be written.

        Notes
        -----
        Collective: `state_dict_full`'s all-gathers (unless sharded), then a barrier.
        """
        comm = self.comm
        if sharded and self._frozen():  # the shard files hold parameters() only: no room for raw rows
            raise ValueError(f"save_pretrained: sharded=True cannot save quantized weights ({self.dtype}); use "
                             f"sharded=False (full float32 tensors: from_pretrained(..., dtype=...) quantizes again)")
        if hf:
            if sharded:
                raise ValueError("save_pretrained: hf=True writes one consolidated file (sharded=False)")
            tensors, conf = _hf.to_hf(self.config, self.state_dict_full())
            if comm.rank == 0:
                os.makedirs(path, exist_ok=True)
                formats.write_safetensors(os.path.join(path, formats.MODEL_FILE), tensors, {"format": "pt"})
                formats.write_json(os.path.join(path, formats.HF_CONFIG), conf)
            comm.barrier()
            return
        if comm.rank == 0:
            os.makedirs(path, exist_ok=True)
            formats.write_own_config(path, self.config)
        comm.barrier()
        if sharded:
            formats.write_own_shard(path, comm.rank, comm.size, [p.to_numpy() if isinstance(p, DeviceArray) else p
                                                                 for p in self.weights()])
        else:
            sd = self.state_dict_full()
            if comm.rank == 0:
                formats.write_safetensors(os.path.join(path, formats.MODEL_FILE), sd, {"format": "tpcore"})
        comm.barrier()


def _hostcopy(a) -> np.ndarray:
    """A host copy of a parameter (a DeviceArray's comes back from its device)."""
    return a.to_numpy() if isinstance(a, DeviceArray) else a.copy()


def _assign(dst, src, name):
    if tuple(src.shape) != dst.shape:
        raise ValueError(f"checkpoint: {name} has shape {tuple(src.shape)}, expected {dst.shape}")
    load_weight(dst, "float32", src, slice(None), None, f"checkpoint: {name}")


def _load_embedding(emb, table):
    if tuple(table.shape) != (emb.num_embeddings, emb.embedding_dim):
        raise ValueError(f"checkpoint: the token embedding has shape {tuple(table.shape)}, expected "
                         f"{(emb.num_embeddings, emb.embedding_dim)}")
    load_weight(emb.weight, emb.dtype, table, slice(emb.offset, emb.offset + emb.local), None, "wte.weight")


class _Progress:
    def __init__(self, n, on):
        self.n, self.i, self.on, self.t0 = n, 0, on and n > 0, time.monotonic()

    def step(self):
        self.i += 1
        if self.on:
            w = 30
            k = w * self.i // self.n
            sys.stderr.write(f"\rloading [{'#' * k}{'.' * (w - k)}] {self.i}/{self.n} blocks "
                             f"{time.monotonic() - self.t0:.1f}s")
            sys.stderr.flush()

    def done(self):
        if self.on:
            sys.stderr.write("\n")
