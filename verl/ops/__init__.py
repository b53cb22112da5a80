"""Thin Python wrappers over the compiled extension ``verl._C``."""

from verl.ops.copy_program import (  # noqa: F401
    SEGMENT_FIELDS,
    CopyProgramError,
    make_program,
    run_copy_program,
    validate_program,
)

__all__ = ["SEGMENT_FIELDS", "CopyProgramError", "make_program", "run_copy_program", "validate_program"]
