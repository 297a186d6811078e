"""File formats and bounded streaming reads; knows no model.

- `formats`: tpcore.save's files and the model folders (Hugging Face's, save_pretrained's); every
  format's reader and writer is importable from it.
- `safetensors`: the safetensors header check, writer and memory-mapped reader.
- `lazy`: `FileTensor` (a tensor read on indexing), `open_safetensors`, the row-index helpers.
- `npz`: NumPy .npz archives, checked before they are read.
- `checks`: `CheckpointError`, `bad`, strict JSON, `ConfigFields` (what every reader checks with).
- `stream`: reading slices of a file straight into their final place through one staging buffer.

Every length, count and offset read from a file is checked against the bytes that remain
before anything is allocated.  Imports: tpcore.utils.
"""
