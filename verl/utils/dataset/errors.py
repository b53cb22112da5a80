"""The one error type for bad dataset input (CLI maps it to exit code 2)."""

from verl.errors import InputError


class DatasetError(InputError):
    """Dataset input that cannot be used: missing file, bad row, bad option."""
