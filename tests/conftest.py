"""Test tiers are chosen by directory: tests/<tier>/... gets the marker <tier>.

Run one tier with `pytest -m kernels` (or `pytest tests/kernels`). Strict DataProto checks are on
for every test, as the project promises.
"""

import os

import pytest

TIERS = ("unit", "distributed", "kernels", "sglang", "slurm")

os.environ.setdefault("VERL_STRICT_DATA_CHECK", "1")
# Multi-rank tests talk over loopback only.
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


def pytest_collection_modifyitems(config, items):
    root = os.path.dirname(__file__)
    for item in items:
        rel = os.path.relpath(str(item.fspath), root)
        tier = rel.split(os.sep, 1)[0]
        if tier in TIERS:
            item.add_marker(getattr(pytest.mark, tier))
