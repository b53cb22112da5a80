"""The one table of dtype names used in configs and on the command line, and their torch dtypes.

verl writes the long names (torch's) in its Megatron and rollout sections and the short ones (fp32, bf16) in
its FSDP sections; both name the same dtypes here.
"""

from __future__ import annotations

import torch

from verl.errors import InputError

SHORT_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # verl's FSDP spelling -> the long name
DTYPES = {name: getattr(torch, name) for name in SHORT_NAMES.values()}
ELEMENT_SIZES = {name: dtype.itemsize for name, dtype in DTYPES.items()}
NAME_OF_DTYPE = {dtype: name for name, dtype in DTYPES.items()}  # torch dtype -> its name (e.g. SGLang's dtype)
# The dtypes a role's config may name for training and rollout (megatron.dtype, rollout.dtype); the FSDP
# sections name the same ones in either spelling.
TRAINING_DTYPES = ("float32", "bfloat16")
FSDP_DTYPE_NAMES = tuple(short for short, name in SHORT_NAMES.items() if name in TRAINING_DTYPES) + TRAINING_DTYPES


def torch_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` (or verl's short ``"bf16"``) -> ``torch.bfloat16``; one clear error for a name outside the
    table."""
    try:
        return DTYPES[SHORT_NAMES.get(name, name)]
    except KeyError:
        raise InputError(f"dtype: expected one of {sorted(DTYPES)}, found {name!r}") from None
