"""mx arrays <-> wire tensors: the raw buffer goes out without a copy; it comes back as one.

The wire layer never imports mlx; this edge does the conversion. bfloat16 travels as its
16-bit storage and is viewed back as bfloat16 on arrival.
"""

from __future__ import annotations

from typing import Any, cast

import mlx.core as mx
import numpy as np

from mlxppd.wire.codec import Tensor, as_tensor
from mlxppd.wire.dtypes import dtype_by_name


def to_wire(array: mx.array) -> Tensor:
    """A wire Tensor over an evaluated, contiguous mx array (no copy of its memory)."""
    array = mx.contiguous(array)
    mx.eval(array)
    if array.dtype == mx.bfloat16:
        storage = cast(Any, array.view(mx.uint16))
        return as_tensor(memoryview(storage), dtype_by_name("bfloat16"))
    return as_tensor(memoryview(cast(Any, array)))


def from_wire(tensor: Tensor) -> mx.array:
    """An mx array holding the tensor's bytes, shaped and typed as sent."""
    host = np.frombuffer(tensor.data, dtype=tensor.dtype.storage_name).reshape(tensor.shape)
    array = mx.array(host)
    if tensor.dtype.name == "bfloat16":
        array = array.view(mx.bfloat16)
    return array
