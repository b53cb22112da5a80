"""The one error type for bad dataset input (CLI maps it to exit code 2)."""


class DatasetError(ValueError):
    """Dataset input that cannot be used: missing file, bad row, bad option."""
