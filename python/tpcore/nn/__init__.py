"""The tensor-parallel layers over the C core.

- `layers`: `ColumnParallelLinear`, `RowParallelLinear`, `ParallelMLP`, `partition`.
- `vocab`: `VocabParallelEmbedding`, `VocabParallelCrossEntropy`.
- `transformer`: `Config`, `ParallelAttention`, `TransformerBlock`.
- `plan`: `Plan`, per-rank shard sizes from measured speeds and memory (`plan_from_measurements`).
- `quant`: quantized weight formats (`QuantTensor`, `quantize`, `dequantize`).
- `optim`: `AdamW`, `SGD`, `ShardedAdamW` over the layers' parameters.
- `checkpoint`: `tpcore.save` / `tpcore.load` of layers' state.

Imports: tpcore.utils, tpcore.distributed, tpcore.io.
"""
