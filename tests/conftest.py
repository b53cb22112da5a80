"""Test tiers are chosen by directory: tests/<tier>/... gets the marker <tier>.

Run one tier with `pytest -m kernels` (or `pytest tests/kernels`). Strict DataProto checks are on
for every test, as the project promises.

On CI (``CI=true``, which ``.ci/run`` sets) a skipped test is a failure, except in the GPU tier: a tier that
cannot run there (SGLang not installable, Slurm without root, no nvcc) must not pass by skipping.
"""

import os

import pytest

TIERS = ("unit", "distributed", "kernels", "sglang", "vllm", "slurm")
MAY_SKIP_ON_CI = ("gpu",)

os.environ.setdefault("VERL_STRICT_DATA_CHECK", "1")
# Multi-rank tests talk over loopback only.
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


def _tier(path) -> str:
    return os.path.relpath(str(path), os.path.dirname(__file__)).split(os.sep, 1)[0]


def _on_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def pytest_collection_modifyitems(config, items):
    for item in items:
        tier = _tier(item.fspath)
        if tier in TIERS:
            item.add_marker(getattr(pytest.mark, tier))


def _fail_skip_on_ci(report, path) -> None:
    if report.skipped and not hasattr(report, "wasxfail") and _on_ci() and _tier(path) not in MAY_SKIP_ON_CI:
        reason = report.longrepr[-1] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped on CI (CI=true), where only the GPU tier may skip: {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _fail_skip_on_ci(outcome.get_result(), item.fspath)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield  # a module-level importorskip skips the whole module at collection
    if getattr(collector, "path", None) is not None and collector.path.suffix == ".py":
        _fail_skip_on_ci(outcome.get_result(), collector.path)
