"""A port's dtype by name without importing torch: `pipecc run`'s launcher checks every
``ports.json`` (`pipecc.runtime.folder_check.check_folder`) before any process starts, and torch's
import is most of its time.

``TORCH_DTYPES`` is torch's own table (each ``torch.<name>`` that is a ``torch.dtype`` -> its
``str`` without ``torch.``) for the pinned torch; ``tests/test_launch_imports.py`` checks it
against the torch installed. A name it lacks is asked of torch itself (`dtype_name`), so a torch
with other dtypes answers as before.

Imports nothing of pipecc."""

from __future__ import annotations

import importlib

__all__ = ["TORCH_DTYPES", "dtype_name", "torch_dtype"]

TORCH_DTYPES = {
    "bcomplex32": "bcomplex32", "bfloat16": "bfloat16", "bit": "uint1", "bits16": "bits16",
    "bits1x8": "bits1x8", "bits2x4": "bits2x4", "bits4x2": "bits4x2", "bits8": "bits8", "bool": "bool",
    "cdouble": "complex128", "cfloat": "complex64", "chalf": "complex32", "complex128": "complex128",
    "complex32": "complex32", "complex64": "complex64", "double": "float64", "float": "float32",
    "float16": "float16", "float32": "float32", "float4_e2m1fn_x2": "float4_e2m1fn_x2", "float64": "float64",
    "float8_e4m3fn": "float8_e4m3fn", "float8_e4m3fnuz": "float8_e4m3fnuz", "float8_e5m2": "float8_e5m2",
    "float8_e5m2fnuz": "float8_e5m2fnuz", "float8_e8m0fnu": "float8_e8m0fnu", "half": "float16",
    "int": "int32", "int1": "int1", "int16": "int16", "int2": "int2", "int3": "int3", "int32": "int32",
    "int4": "int4", "int5": "int5", "int6": "int6", "int64": "int64", "int7": "int7", "int8": "int8",
    "long": "int64", "qint32": "qint32", "qint8": "qint8", "quint2x4": "quint2x4", "quint4x2": "quint4x2",
    "quint8": "quint8", "short": "int16", "uint1": "uint1", "uint16": "uint16", "uint2": "uint2",
    "uint3": "uint3", "uint32": "uint32", "uint4": "uint4", "uint5": "uint5", "uint6": "uint6",
    "uint64": "uint64", "uint7": "uint7", "uint8": "uint8",
}


def torch_dtype(name: str) -> object | None:
    """``torch.<name>`` when it is a ``torch.dtype``, else None (imports torch)."""
    torch = importlib.import_module("torch")
    dtype = getattr(torch, name, None)
    return dtype if isinstance(dtype, torch.dtype) else None


def dtype_name(name: str) -> str | None:
    """The dtype ``torch.<name>`` is, by its name (``"float"`` -> ``"float32"``), or None when
    ``torch.<name>`` is no dtype; torch is imported only for a name the table lacks."""
    if name in TORCH_DTYPES:
        return TORCH_DTYPES[name]
    dtype = torch_dtype(name)
    return None if dtype is None else str(dtype).removeprefix("torch.")
