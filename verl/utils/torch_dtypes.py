"""The one table from the dtype names used in configs and on the command line to torch dtypes."""

from __future__ import annotations

import torch

from verl.errors import InputError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ELEMENT_SIZES = {name: dtype.itemsize for name, dtype in DTYPES.items()}


def torch_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``; one clear error for a name outside the table."""
    try:
        return DTYPES[name]
    except KeyError:
        raise InputError(f"dtype: expected one of {sorted(DTYPES)}, found {name!r}") from None
