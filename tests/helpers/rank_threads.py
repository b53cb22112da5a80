"""A pytest plugin (``-p helpers.rank_threads``): the test process holds ``VERL_TEST_RANK_THREADS`` (default 40) idle
threads from the start, as a training rank does (torch's intra-op pool, gloo, the data plane, the engine's event
loop), so per-user limits that count threads (RLIMIT_NPROC) are met as on a cluster. The summary reports the
effective uid and the thread count, which :mod:`tests.unit.test_nonroot_tier` checks."""

import os
import threading

_stop = threading.Event()


def pytest_configure(config):
    for i in range(int(os.environ.get("VERL_TEST_RANK_THREADS", "40"))):
        threading.Thread(target=_stop.wait, name=f"rank-thread-{i}", daemon=True).start()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    terminalreporter.write_line(f"rank_threads: uid {os.geteuid()}, {threading.active_count()} threads")


def pytest_unconfigure(config):
    _stop.set()
