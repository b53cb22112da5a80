"""verl's library logging: one ``verl`` logger tree, rank 0 only, level from ``VERL_LOGGING_LEVEL``.

    from verl.utils.logging_utils import get_logger
    logger = get_logger(__name__)
    logger.warning("RLHFDataset: filtered %d prompts ...", n)

- Level: ``VERL_LOGGING_LEVEL`` (verl's variable: DEBUG, INFO, WARN, ERROR, CRITICAL), default WARN
  as in verl, so a library says nothing unless something deserves attention.
- Ranks: every rank runs the same code (SPMD), so only rank 0's records pass -- the rank is
  torch.distributed's once it is initialised, else the launcher's (RANK, OMPI_COMM_WORLD_RANK,
  PMI_RANK, SLURM_PROCID). ``VERL_LOGGING_ALL_RANKS=1`` lets every rank log.
- Output: records propagate as usual; verl's own stderr handler writes them only while the
  application has configured no root handler (so ``logging.basicConfig`` or pytest's capture
  gets each record once).

What a command exists to show (metrics lines, progress, results, one-line usage errors) stays a
``print`` in its CLI; this is for what the library has to say on the way.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping

LEVEL_ENV = "VERL_LOGGING_LEVEL"
ALL_RANKS_ENV = "VERL_LOGGING_ALL_RANKS"
DEFAULT_LEVEL = "WARN"
ROOT = "verl"
LEVELS = {"DEBUG": logging.DEBUG, "INFO": logging.INFO, "WARN": logging.WARNING, "WARNING": logging.WARNING,
          "ERROR": logging.ERROR, "CRITICAL": logging.CRITICAL}
# Launchers' rank variables, in the order verl.launcher.env.discover trusts them.
RANK_ENVS = ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID")
FORMAT = "%(levelname)s %(name)s: %(message)s"

_configured = False


def current_rank(environ: Mapping[str, str] | None = None) -> int:
    """torch.distributed's rank when initialised, else the launcher's, else 0."""
    dist = sys.modules.get("torch.distributed")  # not imported -> not initialised: no torch import for a log line
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    env = os.environ if environ is None else environ
    for key in RANK_ENVS:
        value = env.get(key, "")
        if value.strip().isdigit():
            return int(value)
    return 0


class RankZeroFilter(logging.Filter):
    """Passes rank 0's records (every rank's with ``VERL_LOGGING_ALL_RANKS=1``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return os.environ.get(ALL_RANKS_ENV) == "1" or current_rank() == 0


class _ConsoleHandler(logging.Handler):
    """stderr (looked up per record, so redirections apply) unless the application set up logging."""

    def emit(self, record: logging.LogRecord) -> None:
        if logging.getLogger().handlers:
            return  # the root's handlers get the record by propagation
        try:
            sys.stderr.write(self.format(record) + "\n")
        except Exception:  # logging must never take the caller down
            self.handleError(record)


def configure(environ: Mapping[str, str] | None = None) -> int:
    """(Re)read ``VERL_LOGGING_LEVEL`` into the ``verl`` logger; returns the level set."""
    global _configured
    env = os.environ if environ is None else environ
    root = logging.getLogger(ROOT)
    if not any(isinstance(h, _ConsoleHandler) for h in root.handlers):
        handler = _ConsoleHandler()
        handler.setFormatter(logging.Formatter(FORMAT))
        root.addHandler(handler)
    name = env.get(LEVEL_ENV, DEFAULT_LEVEL).strip().upper() or DEFAULT_LEVEL
    level = LEVELS.get(name)
    root.setLevel(LEVELS[DEFAULT_LEVEL] if level is None else level)
    _configured = True
    if level is None:
        root.warning("%s: expected one of %s, found %r; using %s", LEVEL_ENV, ", ".join(LEVELS), env[LEVEL_ENV],
                     DEFAULT_LEVEL)
    return root.level


def get_logger(name: str) -> logging.Logger:
    """The logger for module ``name`` (under ``verl``), rank-0 filtered; configures ``verl`` once."""
    if not _configured:
        configure()
    logger = logging.getLogger(name)
    if not any(isinstance(f, RankZeroFilter) for f in logger.filters):
        logger.addFilter(RankZeroFilter())
    return logger
