"""Tensor element types on the wire: one byte code per type, names as mlx spells them.

The wire layer never imports mlx. A tensor is sent from any object that exposes the buffer
protocol (numpy arrays, and mlx arrays through ``memoryview(array)``); the element type is read
from the buffer's format string. A receiver turns the bytes back into an array with
``np.frombuffer(data, dtype=dt.storage_name)`` (then ``.view`` for bfloat16, which numpy lacks).

Tensor bytes travel in little-endian order, the native order of every platform mlx supports.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

__all__ = ["DTYPES", "DType", "dtype_by_code", "dtype_by_name", "dtype_for_buffer_format"]

if sys.byteorder != "little":  # pragma: no cover - no big-endian platform runs mlx
    raise ImportError("mlxpp's wire format assumes a little-endian host")


@dataclass(frozen=True)
class DType:
    """One element type: its wire code, mlx name, size, and numpy-compatible storage name."""

    code: int
    name: str
    itemsize: int
    #: numpy dtype name with the same bytes (bfloat16 is carried as uint16 storage)
    storage_name: str


# Codes are part of the wire format (docs/protocol.md): never renumber, only append.
# Code 0 means "this message carries no tensor".
DTYPES: tuple[DType, ...] = (
    DType(1, "bool", 1, "bool"),
    DType(2, "uint8", 1, "uint8"),
    DType(3, "uint16", 2, "uint16"),
    DType(4, "uint32", 4, "uint32"),
    DType(5, "uint64", 8, "uint64"),
    DType(6, "int8", 1, "int8"),
    DType(7, "int16", 2, "int16"),
    DType(8, "int32", 4, "int32"),
    DType(9, "int64", 8, "int64"),
    DType(10, "float16", 2, "float16"),
    DType(11, "float32", 4, "float32"),
    DType(12, "float64", 8, "float64"),
    DType(13, "bfloat16", 2, "uint16"),
    DType(14, "complex64", 8, "complex64"),
)

_BY_CODE = {d.code: d for d in DTYPES}
_BY_NAME = {d.name: d for d in DTYPES}
# numpy spells bool "bool_" as an attribute; accept both so callers can pass either.
_BY_NAME["bool_"] = _BY_NAME["bool"]

# struct-module format characters; integer width depends on the platform's C types, so integers
# are resolved by signedness and the buffer's itemsize rather than by the character alone.
_SIGNED = frozenset("bhilqn")
_UNSIGNED = frozenset("BHILQN")
_FIXED_FORMATS = {
    "?": "bool",
    "e": "float16",
    "f": "float32",
    "d": "float64",
    "Zf": "complex64",
    "bfloat16": "bfloat16",  # how mlx names its bfloat16 buffers
}


def dtype_by_code(code: int) -> DType | None:
    """The element type with wire code ``code``, or None for an unknown code."""
    return _BY_CODE.get(code)


def dtype_by_name(name: str) -> DType:
    """The element type called ``name`` (mlx spelling; ``mlx.core.`` prefix allowed)."""
    key = name.removeprefix("mlx.core.")
    try:
        return _BY_NAME[key]
    except KeyError:
        known = ", ".join(d.name for d in DTYPES)
        raise ValueError(f"unknown tensor dtype '{name}'; use one of {known}") from None


def dtype_for_buffer_format(fmt: str, itemsize: int) -> DType:
    """The element type of a buffer with struct format ``fmt`` and element size ``itemsize``."""
    # Explicit little-endian and native markers mean the same on a little-endian host;
    # big-endian data ('>', '!') would be misread on the other end, so it matches nothing.
    native = "" if fmt[:1] in (">", "!") else fmt.lstrip("@=<")
    if native in _SIGNED or native in _UNSIGNED:
        name = ("int" if native in _SIGNED else "uint") + str(itemsize * 8)
        if name in _BY_NAME:
            return _BY_NAME[name]
    elif native in _FIXED_FORMATS:
        dtype = _BY_NAME[_FIXED_FORMATS[native]]
        if dtype.itemsize == itemsize:
            return dtype
    raise ValueError(
        f"tensor buffers with format '{fmt}' (itemsize {itemsize}) cannot be sent; "
        "pass dtype= explicitly or convert the array to one of " + ", ".join(d.name for d in DTYPES)
    )
