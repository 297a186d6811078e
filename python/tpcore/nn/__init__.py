"""The tensor-parallel layers over the C core.

- `partition`: `partition` (a dimension's split over the ranks), a layer's partition
  argument as sizes, the check that the ranks agree on it.
- `common`: what the layers' Python faces share: inputs as float32 rows (host, DLPack, GPU),
  outputs back in the input's dtype, `layer_memory` and `MEMORY_KEYS`.
- `weights`: full weights written into a rank's shard (`put_weight`, `load_weight` streaming
  from checkpoint tensors), shards read back for gathering.
- `linear`: `ColumnParallelLinear`, `RowParallelLinear`.
- `mlp`: `ParallelMLP`.
- `vocab`: `VocabParallelEmbedding`, `VocabParallelCrossEntropy`.
- `config`: `Config` (from a Hugging Face config.json too), `NORMS`, `POSITIONS`,
  `ACTIVATIONS`, `head_partition`.
- `rope`: `rope_frequencies` (Hugging Face's rope scalings as the rope kernel's frequency table
  and factor), `depends_on_length`, `rope_type`, `ROPE_TYPES`.
- `transformer`: `TransformerBlock`, `ParallelAttention`.
- `moe`: `MoE` (Mixtral's sparse MoE MLP: expert parallelism with all_to_all dispatch, or
  tensor parallelism inside the experts) and `load_balancing_loss` (transformers').
- `plan`: `Plan`, per-rank shard sizes from measured speeds and memory (`plan_from_measurements`).
- `quant`: quantized weight formats (`QuantTensor`, `quantize`, `dequantize`).
- `optim`: `AdamW`, `SGD`, `ShardedAdamW` over the layers' parameters.
- `checkpoint`: `tpcore.save` / `tpcore.load` of layers' state.

The weight formats and their sizes are `tpcore.utils.dtypes`'.

Imports: tpcore.utils, tpcore.distributed, tpcore.io.
"""
