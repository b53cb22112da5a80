"""The GPU tier (marker ``gpu``): skipped where torch sees no CUDA device, run by ``bash tests/run_gpu.sh``
on a GPU machine. Every test here runs a function the CPU tiers also run, on CUDA tensors."""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="no CUDA device")
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(skip)
