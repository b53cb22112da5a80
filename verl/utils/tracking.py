"""Tracking: one ``log(data, step)`` fanned out to the configured backends (rank 0 only).

Always ``<output_dir>/metrics.jsonl`` (one flat JSON object per step, with ``step``: what ``verl plot``
and the quickstart read). ``trainer.logger`` adds, by verl's names:

- ``console``: a compact line per step;
- ``file``: verl's JSONL file logger, one line ``{"step": N, "data": {...}}`` per step, at
  ``$VERL_FILE_LOGGER_PATH``, else ``<$VERL_FILE_LOGGER_ROOT or .>/<project_name>/<experiment_name>.jsonl``
  (verl's rule). Unlike verl's, which truncates the file, it appends, so a resumed run continues it
  (a step logged again after a restart appears twice: take the last); a cut last line is dropped first;
- ``tensorboard``: ``$TENSORBOARD_DIR`` or ``<output_dir>/tensorboard``;
- ``wandb``: imported only when asked; offline (``WANDB_MODE=offline``) unless ``WANDB_MODE`` or
  ``WANDB_API_KEY`` is set; files under ``$WANDB_DIR`` or ``<output_dir>``; finished on close;
- ``csv``: ``metrics.csv``, rewritten when new columns appear (ours).

A full disk while a record is written to ``metrics.jsonl`` ends in one ``DiskFullError`` line naming the file and
the step; the part of the record that was written is cut, so the file holds whole records only.
"""

from __future__ import annotations

import csv
import errno
import json
import math
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from verl.errors import InputError
from verl.utils.logging_utils import get_logger

logger = get_logger(__name__)
METRICS_FILE = "metrics.jsonl"
# The names trainer.logger accepts (verl's names, plus our csv).
SUPPORTED_BACKENDS = ("console", "file", "tensorboard", "wandb", "csv")
FILE_LOGGER_PATH_ENV = "VERL_FILE_LOGGER_PATH"
FILE_LOGGER_ROOT_ENV = "VERL_FILE_LOGGER_ROOT"

# The compact console line shows these, in this order, when present.
CONSOLE_KEYS = (
    ("critic/score/mean", "score"),
    ("critic/rewards/mean", "reward"),
    ("val/accuracy", "val_acc"),
    ("actor/pg_loss", "pg_loss"),
    ("actor/entropy", "entropy"),
    ("actor/ppo_kl", "kl"),
    ("critic/vf_loss", "vf_loss"),
    ("response_length/mean", "resp_len"),
    ("timing_s/step", "step_s"),
    ("perf/throughput", "tok/s/rank"),
)


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def _number_or_null(value: Any) -> Any:
    """verl's file logger (orjson) writes NaN and infinities as null."""
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def import_wandb() -> Any:
    """The wandb module, or one ValueError saying it is missing."""
    try:
        import wandb
    except ImportError:
        raise InputError("trainer.logger: wandb requested, expected the wandb package (pip install wandb), "
                         "found none") from None
    return wandb


def check_backends(backends: Sequence[str]) -> None:
    """Raise one ValueError for a backend name we do not know or whose package is missing
    (what :class:`Tracking` would raise, checkable before any rank starts)."""
    for name in backends:
        if name not in SUPPORTED_BACKENDS:
            raise InputError(f"trainer.logger: expected entries among {list(SUPPORTED_BACKENDS)}, found {name!r}")
    if "wandb" in backends:
        import_wandb()


def file_logger_path(project_name: str, experiment_name: str, environ: Mapping[str, str] | None = None) -> str:
    """verl's FileLogger path: ``$VERL_FILE_LOGGER_PATH``, else
    ``<$VERL_FILE_LOGGER_ROOT or .>/<project_name>/<experiment_name>.jsonl``."""
    environ = os.environ if environ is None else environ
    path = environ.get(FILE_LOGGER_PATH_ENV)
    if path:
        return path
    root = os.path.expanduser(environ.get(FILE_LOGGER_ROOT_ENV) or ".")
    return os.path.join(root, project_name, f"{experiment_name}.jsonl")


class FileLogger:
    """verl's ``file`` backend: ``{"step": N, "data": {...}}`` per line, appended (see the module doc)."""

    def __init__(self, path: str):
        self.path = path
        directory = os.path.dirname(os.path.abspath(path))
        os.makedirs(directory, exist_ok=True)
        drop_partial_last_line(path)
        self._fh = open(path, "ab")
        logger.info("file logger: appending to %s", path)

    def log(self, data: Mapping[str, Any], step: int) -> None:
        record = {"step": step, "data": {k: _number_or_null(v) for k, v in data.items()}}
        self._fh.write((json.dumps(record, allow_nan=False) + "\n").encode("utf-8"))  # one write per line
        self._fh.flush()

    def close(self) -> None:
        self._fh.close()


class WandbLogger:
    """verl's ``wandb`` backend: ``wandb.init(project, name, entity=$WANDB_ENTITY, config)``, ``log(step=)``."""

    def __init__(self, project_name: str, experiment_name: str, output_dir: str, config: Any = None):
        wandb = import_wandb()
        kwargs: dict[str, Any] = {"project": project_name, "name": experiment_name,
                                  "entity": os.environ.get("WANDB_ENTITY"), "config": config,
                                  "dir": os.environ.get("WANDB_DIR") or output_dir}
        if not os.environ.get("WANDB_MODE") and not os.environ.get("WANDB_API_KEY"):
            kwargs["mode"] = "offline"  # no credentials: keep the run on disk (`wandb sync` uploads it later)
            logger.info("wandb: no WANDB_MODE or WANDB_API_KEY set, logging offline under %s", kwargs["dir"])
        self._run = wandb.init(**kwargs)

    def log(self, data: Mapping[str, Any], step: int) -> None:
        self._run.log({k: v.item() if hasattr(v, "item") else v for k, v in data.items()}, step=step)

    def close(self) -> None:
        self._run.finish()


def _config_dict(config: Any) -> Any:
    """A run config as plain containers for wandb (an OmegaConf config, a dict, or None)."""
    if config is None or isinstance(config, dict):
        return config
    try:
        from omegaconf import OmegaConf

        return OmegaConf.to_container(config, resolve=True)
    except (ImportError, ValueError):  # not an OmegaConf object: wandb gets no config rather than a failed run
        return None


class Tracking:
    def __init__(self, output_dir: str, backends: Sequence[str] = ("console",), project_name: str = "",
                 experiment_name: str = "", stream=None, config: Any = None):
        check_backends(backends)  # before anything is written
        self.output_dir = output_dir
        self.backends = list(backends)
        self.stream = stream or sys.stdout
        self.project_name, self.experiment_name = project_name, experiment_name
        os.makedirs(output_dir, exist_ok=True)
        jsonl_path = os.path.join(output_dir, METRICS_FILE)
        drop_partial_last_line(jsonl_path)
        self._jsonl = open(jsonl_path, "a", encoding="utf-8")
        self._csv_path = os.path.join(output_dir, "metrics.csv")
        self._csv_rows: list[dict[str, Any]] = self._read_csv() if "csv" in self.backends else []
        self._csv_columns: list[str] = list(dict.fromkeys(k for row in self._csv_rows for k in row))
        self._tb = None
        if "tensorboard" in self.backends:
            from torch.utils.tensorboard import SummaryWriter

            # verl's TENSORBOARD_DIR (what `verl train --tensorboard_dir` sets) wins over the run's own dir.
            self._tb = SummaryWriter(os.environ.get("TENSORBOARD_DIR") or os.path.join(output_dir, "tensorboard"))
        self._file = FileLogger(file_logger_path(project_name, experiment_name)) if "file" in self.backends else None
        self._wandb = WandbLogger(project_name, experiment_name, output_dir, _config_dict(config)) \
            if "wandb" in self.backends else None
        self._closed = False

    def _read_csv(self) -> list[dict[str, Any]]:
        if not os.path.isfile(self._csv_path):
            return []
        with open(self._csv_path, newline="", encoding="utf-8") as fh:
            return list(csv.DictReader(fh))

    def log(self, data: dict[str, Any], step: int, total_steps: int | None = None) -> None:
        record = {"step": step, **{k: _plain(v) for k, v in sorted(data.items())}}
        self._write_jsonl(record)
        if "csv" in self.backends:
            self._log_csv(record)
        if self._tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._tb.add_scalar(key, value, step)
            self._tb.flush()
        if self._file is not None:
            self._file.log(data, step)
        if self._wandb is not None:
            self._wandb.log(data, step)
        if "console" in self.backends:
            self.stream.write(self.console_line(record, total_steps) + "\n")
            self.stream.flush()

    def _write_jsonl(self, record: dict[str, Any]) -> None:
        size = os.fstat(self._jsonl.fileno()).st_size  # flushed after every record: where this one starts
        try:
            self._jsonl.write(json.dumps(record) + "\n")
            self._jsonl.flush()
        except OSError as err:
            if err.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            # Drop what the buffer still holds (closing may write part of it), then cut the torn record.
            path = self._jsonl.name
            try:
                self._jsonl.close()
            except OSError:
                pass
            os.truncate(path, size)
            self._jsonl = open(path, "a", encoding="utf-8")
            from verl.utils.checkpoint import DiskFullError  # here: importing it pulls in torch

            raise DiskFullError(f"{path}: {os.strerror(err.errno)} logging step {record['step']}; nothing of its "
                                "record was kept") from None

    @staticmethod
    def console_line(record: dict[str, Any], total_steps: int | None = None) -> str:
        parts = [f"step {record['step']}" + (f"/{total_steps}" if total_steps else "")]
        for key, short in CONSOLE_KEYS:
            value = record.get(key)
            if isinstance(value, (int, float)):
                parts.append(f"{short} {value:.4g}")
        return " | ".join(parts)

    def _log_csv(self, record: dict[str, Any]) -> None:
        new_columns = [k for k in record if k not in self._csv_columns]
        self._csv_columns += new_columns
        self._csv_rows.append(record)
        if new_columns or not os.path.isfile(self._csv_path):
            tmp = self._csv_path + ".tmp"
            with open(tmp, "w", newline="", encoding="utf-8") as fh:
                writer = csv.DictWriter(fh, fieldnames=self._csv_columns)
                writer.writeheader()
                writer.writerows(self._csv_rows)
            os.replace(tmp, self._csv_path)
        else:
            with open(self._csv_path, "a", newline="", encoding="utf-8") as fh:
                csv.DictWriter(fh, fieldnames=self._csv_columns).writerow(record)

    def close(self) -> None:
        """Close every backend (wandb: finish the run); a second call does nothing."""
        if self._closed:
            return
        self._closed = True
        self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if self._file is not None:
            self._file.close()
        if self._wandb is not None:
            self._wandb.close()


class MetricsError(InputError):
    """A metrics.jsonl line (not the last, which may be mid-write) that is not a JSON record with a step."""


# Files whose partial last line was reported already (once per file and process).
_WARNED_PARTIAL: set[str] = set()


def _parse_record(path: str, lineno: int, raw: bytes) -> dict[str, Any]:
    try:
        record = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        snippet = raw[:60].decode("utf-8", errors="replace")
        raise MetricsError(f"{path}, line {lineno}: expected a JSON object with a 'step', found {snippet!r} "
                           f"({exc.__class__.__name__}: {getattr(exc, 'msg', exc)})") from None
    if not isinstance(record, dict) or not isinstance(record.get("step"), int):
        raise MetricsError(f"{path}, line {lineno}: expected a JSON object with an integer 'step', "
                           f"found {json.dumps(record)[:60]}")
    if set(record) == {"step", "data"} and isinstance(record["data"], dict):  # the `file` logger's line
        return {**record["data"], "step": record["step"]}
    return record


def read_metrics(output_dir: str, live: bool = False) -> list[dict[str, Any]]:
    """Every record of ``metrics.jsonl`` (``output_dir`` is its directory or the file itself; the
    ``file`` logger's ``{"step", "data"}`` lines are read flat too), by step; a step logged twice (a
    resumed run) keeps its last record.

    A last line without its newline is a record being written (or one a killed writer left half
    written): it is skipped, with a warning once per file unless ``live`` (the caller polls a file
    another process is appending to). A bad line anywhere else raises :class:`MetricsError` naming
    the file and line.
    """
    path = output_dir if os.path.isfile(output_dir) else os.path.join(output_dir, METRICS_FILE)
    with open(path, "rb") as fh:
        data = fh.read()
    lines = data.split(b"\n")
    partial = lines.pop()  # b"" when the file ends with a newline
    if partial.strip() and not live and path not in _WARNED_PARTIAL:
        _WARNED_PARTIAL.add(path)
        logger.warning("%s: skipped its last line %d (%d bytes without a newline): a record cut mid-write",
                       path, len(lines) + 1, len(partial))
    by_step: dict[int, dict[str, Any]] = {}
    for lineno, raw in enumerate(lines, start=1):
        if raw.strip():
            record = _parse_record(path, lineno, raw)
            by_step[record["step"]] = record
    return [by_step[s] for s in sorted(by_step)]


def drop_partial_last_line(path: str) -> None:
    """Before appending to ``path`` (a resumed run): cut a last line a killed writer left without its
    newline, so the next record starts a line of its own instead of corrupting that one."""
    if not os.path.isfile(path):
        return
    with open(path, "rb+") as fh:
        size = fh.seek(0, os.SEEK_END)
        if size == 0:
            return
        fh.seek(size - 1)
        if fh.read(1) == b"\n":
            return
        # Scan back for the last newline, a block at a time.
        end = size
        keep = 0
        while end > 0:
            start = max(0, end - 65536)
            fh.seek(start)
            block = fh.read(end - start)
            cut = block.rfind(b"\n")
            if cut >= 0:
                keep = start + cut + 1
                break
            end = start
        fh.truncate(keep)
    logger.warning("%s: dropped a partial last record (%d bytes without a newline) before appending",
                   path, size - keep)


def rank_zero_tracking(config: Any, rank: int) -> Tracking | None:
    if rank != 0:
        return None
    return Tracking(config.trainer.output_dir, list(config.trainer.logger), config.trainer.project_name,
                    config.trainer.experiment_name, config=config)
