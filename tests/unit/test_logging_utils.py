"""verl's library logging: VERL_LOGGING_LEVEL (default WARN), rank 0 only, one stderr line per record."""

import logging
import os
import subprocess
import sys

import pytest

from verl.utils import logging_utils
from verl.utils.logging_utils import configure, current_rank, get_logger

LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID",
                 logging_utils.LEVEL_ENV, logging_utils.ALL_RANKS_ENV)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for key in LAUNCHER_VARS:
        monkeypatch.delenv(key, raising=False)
    yield
    configure()  # back to this process's own setting for the tests that follow


def test_level_from_verl_logging_level_default_warn(caplog):
    assert configure({}) == logging.WARNING
    assert configure({"VERL_LOGGING_LEVEL": "debug"}) == logging.DEBUG
    assert configure({"VERL_LOGGING_LEVEL": "INFO"}) == logging.INFO
    with caplog.at_level(logging.WARNING, logger="verl"):
        assert configure({"VERL_LOGGING_LEVEL": "loud"}) == logging.WARNING
    assert "VERL_LOGGING_LEVEL: expected one of DEBUG, INFO, WARN" in caplog.text and "found 'loud'" in caplog.text


def test_only_rank_zero_logs_unless_all_ranks_asked(monkeypatch, caplog):
    logger = get_logger("verl.test_logging")
    with caplog.at_level(logging.WARNING, logger="verl"):
        logger.warning("from rank zero")
        monkeypatch.setenv("RANK", "1")
        logger.warning("from rank one")
        monkeypatch.setenv(logging_utils.ALL_RANKS_ENV, "1")
        logger.warning("from rank one, asked for")
    assert [r.getMessage() for r in caplog.records] == ["from rank zero", "from rank one, asked for"]
    assert get_logger("verl.test_logging").filters == logger.filters  # one filter however often it is asked for


def test_rank_from_the_launchers_variables():
    assert current_rank({}) == 0
    assert current_rank({"RANK": "3"}) == 3
    assert current_rank({"OMPI_COMM_WORLD_RANK": "2"}) == 2
    assert current_rank({"SLURM_PROCID": "5", "PMI_RANK": "4"}) == 4  # the launcher's own rank wins over Slurm's
    assert current_rank({"RANK": ""}) == 0


SNIPPET = ("import logging, sys\n"
           "from verl.utils.logging_utils import get_logger\n"
           "if len(sys.argv) > 1: logging.basicConfig(format='app: %(message)s')\n"
           "log = get_logger('verl.snippet')\n"
           "log.info('detail'); log.warning('attention')\n")


@pytest.mark.parametrize("env, argv, expected", [
    ({}, [], ["WARNING verl.snippet: attention"]),
    ({"VERL_LOGGING_LEVEL": "INFO"}, [], ["INFO verl.snippet: detail", "WARNING verl.snippet: attention"]),
    ({"RANK": "1"}, [], []),
    ({}, ["app"], ["app: attention"]),  # the application's handler, and only it
])
def test_console_output_in_a_fresh_process(env, argv, expected):
    base = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    out = subprocess.run([sys.executable, "-c", SNIPPET, *argv], capture_output=True, text=True, timeout=60,
                         env={**base, **env})
    assert out.returncode == 0 and out.stdout == "" and out.stderr.splitlines() == expected, out
