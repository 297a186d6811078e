"""File formats and bounded streaming reads; knows no model.

- `formats`: safetensors and .npz readers and writers, `FileTensor` (a tensor read on indexing).
- `stream`: reading slices of a file straight into their final place through one staging buffer.

Every length, count and offset read from a file is checked against the bytes that remain
before anything is allocated.  Imports: tpcore.utils.
"""
