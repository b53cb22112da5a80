"""Tracking: one ``log(data, step)`` fanned out to the configured backends (rank 0 only).

Always ``<output_dir>/metrics.jsonl`` (one JSON object per step, with ``step``); ``trainer.logger``
adds ``console`` (a compact line per step), ``csv`` (``metrics.csv``; rewritten when new columns
appear) and ``tensorboard`` (``<output_dir>/tensorboard``).
"""

from __future__ import annotations

import csv
import json
import logging
import math
import os
import sys
from collections.abc import Sequence
from typing import Any

logger = logging.getLogger(__name__)
METRICS_FILE = "metrics.jsonl"

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


class Tracking:
    def __init__(self, output_dir: str, backends: Sequence[str] = ("console",), project_name: str = "",
                 experiment_name: str = "", stream=None):
        self.output_dir = output_dir
        self.backends = list(backends)
        self.stream = stream or sys.stdout
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
        self.project_name, self.experiment_name = project_name, experiment_name

    def _read_csv(self) -> list[dict[str, Any]]:
        if not os.path.isfile(self._csv_path):
            return []
        with open(self._csv_path, newline="", encoding="utf-8") as fh:
            return list(csv.DictReader(fh))

    def log(self, data: dict[str, Any], step: int, total_steps: int | None = None) -> None:
        record = {"step": step, **{k: _plain(v) for k, v in sorted(data.items())}}
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        if "csv" in self.backends:
            self._log_csv(record)
        if self._tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._tb.add_scalar(key, value, step)
            self._tb.flush()
        if "console" in self.backends:
            self.stream.write(self.console_line(record, total_steps) + "\n")
            self.stream.flush()

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
        self._jsonl.close()
        if self._tb is not None:
            self._tb.close()


class MetricsError(ValueError):
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
    return record


def read_metrics(output_dir: str, live: bool = False) -> list[dict[str, Any]]:
    """Every record of ``metrics.jsonl`` (``output_dir`` is its directory or the file itself), by step;
    a step logged twice (a resumed run) keeps its last record.

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
                    config.trainer.experiment_name)
