"""The one vocabulary of dtypes and weight storage formats, read from the C core's table.

Names, element sizes and block layouts are the C core's (csrc/core/dtype.c: tp_dtype_name,
tp_dtype_size, tp_weight_format, tp_weight_is_quantized), read once through
``tpcore._C.dtype_table()``; nothing here types them again.

- `TENSOR_DTYPES`: the element types of tensors (DeviceArray, the collectives) -> bytes.
- `FLOAT_FORMATS`: the float weight storage formats (trainable; float32 arithmetic),
  `HALF_FORMATS` the 16-bit ones among them.
- `QUANT_FORMATS`: the quantized ones (int8 rows with a float32 scale per row, llama.cpp's
  GGUF block formats; frozen weights).
- `WEIGHT_FORMATS`: both: every name a layer's or a model's ``dtype`` takes.
- `block_size`, `block_bytes`, `row_header`, `row_bytes`, `bytes_per_element`,
  `is_quantized`: a format's layout.
- `weight_format`: a weight-dtype argument (a name, a NumPy / ml_dtypes / torch dtype) as
  its format name, or an error naming the call, what came and what is accepted;
  `weight_formats`: one such argument, or a dict of them by part (a model's or a block's
  projections), as a format per part.

Imports the extension and tpcore.utils.args.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Sequence, Tuple, Union

import numpy as np

from tpcore import _C
from tpcore.utils.args import int_arg, shown

# name -> (bytes per tensor element (0: a weight-only format), (block, block_bytes, row_header,
# quantized) or None: not a weight storage format), in the C core's enum order
_TABLE: Dict[str, Tuple[int, Optional[Tuple[int, int, int, bool]]]] = {
    name: (size, weight) for name, size, weight in _C.dtype_table()}

TENSOR_DTYPES: Dict[str, int] = {n: s for n, (s, _) in _TABLE.items() if s}
"""The tensor element types (the C core's tp_dtype_t below TP_NUM_DTYPES) -> bytes per element."""
_WEIGHT = {n: w for n, (_, w) in _TABLE.items() if w is not None}
FLOAT_FORMATS: Tuple[str, ...] = tuple(n for n, w in _WEIGHT.items() if not w[3])
"""The float weight storage formats: trainable, computed in float32."""
HALF_FORMATS: Tuple[str, ...] = tuple(n for n in FLOAT_FORMATS if TENSOR_DTYPES.get(n) == 2)
"""The 16-bit float formats (activations of these dtypes are computed in float32)."""
QUANT_FORMATS: Tuple[str, ...] = tuple(n for n, w in _WEIGHT.items() if w[3])
"""The quantized weight formats (int8 rows, GGUF block formats): frozen weights."""
WEIGHT_FORMATS: Tuple[str, ...] = FLOAT_FORMATS + QUANT_FORMATS
"""Every weight storage format: a layer's or a model's ``dtype``."""


def _layout(fmt: Any, who: str) -> Tuple[int, int, int, bool]:
    if not isinstance(fmt, str):
        raise TypeError(f"{who}: fmt must be a str (one of {', '.join(WEIGHT_FORMATS)}), got {type(fmt).__name__}")
    w = _WEIGHT.get(fmt.lower())
    if w is None:
        raise ValueError(f"{who}: unknown weight format {fmt!r}; expected one of {', '.join(WEIGHT_FORMATS)}")
    return w


def quant_format(fmt: Any, who: str) -> str:
    """fmt as a quantized format's name (any case); a TypeError / ValueError naming who
    otherwise."""
    if not isinstance(fmt, str):
        raise TypeError(f"{who}: fmt must be a str (one of {', '.join(QUANT_FORMATS)}), got {type(fmt).__name__}")
    name = fmt.lower()
    if name not in QUANT_FORMATS:
        raise ValueError(f"{who}: unknown quantized format {fmt!r}; expected one of {', '.join(QUANT_FORMATS)}")
    return name


def is_quantized(dtype: Optional[str]) -> bool:
    """Whether a layer dtype name is a quantized format (a frozen weight).

    Parameters
    ----------
    dtype : str or None
        A weight format's name ("q4_k", "int8", "float32", ...).
    """
    return dtype in QUANT_FORMATS


def block_size(fmt: str) -> int:
    """Elements per block of a format (1 for int8 rows and for float formats).

    Parameters
    ----------
    fmt : str
        A weight format: "q8_0", "q4_0", "q4_1", "q4_k", "q5_k", "q6_k", "int8", or a float
        format ("float32", "float16", "bfloat16").

    Raises
    ------
    TypeError, ValueError
        fmt not a known name.
    """
    return _layout(fmt, "block_size")[0]


def block_bytes(fmt: str) -> int:
    """Bytes of one block of a format (a float format's element size).

    Parameters
    ----------
    fmt : str
        A weight format.

    Raises
    ------
    TypeError, ValueError
        fmt not a known name.
    """
    return _layout(fmt, "block_bytes")[1]


def row_header(fmt: str) -> int:
    """Bytes that start every row of a format (int8: its float32 scale; 0 otherwise).

    Parameters
    ----------
    fmt : str
        A weight format.

    Raises
    ------
    TypeError, ValueError
        fmt not a known name.
    """
    return _layout(fmt, "row_header")[2]


def bytes_per_element(fmt: str) -> Union[int, float]:
    """A format's bytes per weight element: its block's bytes over its elements (int8's
    scale per row left out); an int where that is whole (the float formats, int8).

    Parameters
    ----------
    fmt : str
        A weight format.

    Raises
    ------
    TypeError, ValueError
        fmt not a known name.
    """
    blk, nb, _, _ = _layout(fmt, "bytes_per_element")
    return nb // blk if nb % blk == 0 else nb / blk


def row_bytes(fmt: str, cols: int) -> int:
    """Bytes of one row of `cols` elements in format fmt.

    Parameters
    ----------
    fmt : str
        A weight format (quantized or float).
    cols : int
        Elements of the row, a multiple of `block_size(fmt)`.

    Raises
    ------
    ValueError
        cols negative or not whole blocks; an unknown format.
    """
    blk, nb, hdr, _ = _layout(fmt, "row_bytes")
    cols = int_arg(cols, "row_bytes", "cols")
    if cols < 0 or cols % blk:
        raise ValueError(f"row_bytes: {cols} elements are not whole blocks of {blk} ({fmt})")
    return hdr + cols // blk * nb


def weight_format(dtype: Any, who: str, quantized: bool = True) -> str:
    """The weight storage format a layer or model was given, by name.

    Parameters
    ----------
    dtype : str, dtype or None
        None: "float32".  A float format ("float32", "bfloat16", "float16") as a string, a
        NumPy / ml_dtypes dtype or a torch dtype; or (quantized) a quantized format's name
        ("int8", "q8_0", "q4_0", "q4_1", "q4_k", "q5_k", "q6_k"; any case).
    who : str
        The call, for the messages.
    quantized : bool, default True
        Whether quantized formats are accepted (False: a trainable weight).

    Returns
    -------
    str
        The format's name.

    Raises
    ------
    TypeError
        dtype is no dtype at all.
    ValueError
        A dtype that is no weight format (float64, int32, ...), or a quantized one where
        quantized is False.
    """
    if dtype is None:
        return "float32"
    allowed = WEIGHT_FORMATS if quantized else FLOAT_FORMATS
    if isinstance(dtype, str) and dtype.lower() in QUANT_FORMATS:
        if not quantized:
            raise ValueError(f"{who}: dtype {dtype} (a quantized format) is not supported here; expected one of "
                             f"{', '.join(FLOAT_FORMATS)}")
        return dtype.lower()
    name = dtype if isinstance(dtype, str) else getattr(dtype, "name", None)
    if name is None:
        text = str(dtype)  # torch.bfloat16 -> "torch.bfloat16"
        name = text.rsplit(".", 1)[-1] if text.startswith("torch.") else None
    if name is None:
        try:
            name = np.dtype(dtype).name
        except TypeError:
            raise TypeError(f"{who}: dtype must be one of {', '.join(allowed)}, got {shown(dtype)}") from None
    if name not in FLOAT_FORMATS:
        raise ValueError(f"{who}: dtype {name} is not supported for parameters; expected one of "
                         f"{', '.join(allowed)} (weights in that dtype, float32 arithmetic)")
    return name


def weight_formats(dtype: Any, who: str, parts: Sequence[str]) -> Dict[str, str]:
    """A weight format per part: one dtype for all of them, or a dict by part (missing parts
    float32), e.g. a GGUF file's mix of formats.

    Parameters
    ----------
    dtype : str, dtype, None or dict
        As `weight_format`, or a dict of them with keys among parts.
    who : str
        The call, for the messages.
    parts : sequence of str
        The parts (a model's "embedding", "head", "qkv", ...; a block's projections).

    Returns
    -------
    dict of str to str
        part -> format name, in the order of parts.

    Raises
    ------
    TypeError, ValueError
        As `weight_format`; a dict key that is no part (ValueError).
    """
    if isinstance(dtype, dict):
        extra = sorted(set(dtype) - set(parts))
        if extra:
            raise ValueError(f"{who}: dtype keys must be among {list(parts)}, got {extra}")
        return {k: weight_format(dtype.get(k, "float32"), who) for k in parts}
    d = weight_format(dtype, who)
    return {k: d for k in parts}
