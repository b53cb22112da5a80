"""``verl.metrics``: a run's per-step metrics as Python values, and their CSV / JSON export.

    import verl.metrics
    history = RLTrainer(pipeline=pipeline).run()        # a verl.metrics.History (also verl.metrics.latest())
    history.last()                                      # the last step's metrics: {"step": 2, "actor/pg_loss": ...}
    history.last(3)                                     # the last 3 steps, oldest first
    history["critic/score/mean"]                        # one metric over the steps: [0.25, 0.5, ...]
    history.to_csv("m.csv"); history.to_json("m.json")  # written by the driving rank (rank 0) only
    verl.metrics.load("outputs/run")                    # any run's metrics.jsonl (`verl train`'s too)

The records are the trainer's ``metrics.jsonl`` lines (verl's metric names, one flat dict per step with ``step``),
read with :func:`verl.utils.tracking.read_metrics`, so they are the numbers `verl train` logs.
"""

from __future__ import annotations

import csv
import json
import math
import os
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from verl.errors import InputError

_LATEST: History | None = None


def _is_driver() -> bool:
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch is a dependency
        return True
    return not dist.is_initialized() or dist.get_rank() == 0


class History(Sequence):
    """The steps' metrics in step order (a sequence of dicts, each with ``step``)."""

    def __init__(self, records: Iterable[dict[str, Any]], output_dir: str | None = None):
        self.records = sorted((dict(r) for r in records), key=lambda r: r["step"])
        self.output_dir = output_dir

    def __len__(self) -> int:
        return len(self.records)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self.records)

    def __getitem__(self, key: Any) -> Any:
        """``history[i]``: step record i; ``history[a:b]``: a History; ``history["name"]``: that metric per step
        (None where a step did not log it)."""
        if isinstance(key, str):
            if not any(key in r for r in self.records):
                raise InputError(f"metrics: expected a logged metric name, found {key!r} (logged: "
                                 f"{sorted({k for r in self.records for k in r})[:20]} ...)")
            return [r.get(key) for r in self.records]
        if isinstance(key, slice):
            return History(self.records[key], self.output_dir)
        return self.records[key]

    def __repr__(self) -> str:
        steps = [r["step"] for r in self.records]
        return f"History({len(steps)} steps{f', {steps[0]}..{steps[-1]}' if steps else ''})"

    @property
    def names(self) -> list[str]:
        """Every metric name logged, sorted (``step`` first)."""
        return ["step", *sorted({k for r in self.records for k in r} - {"step"})]

    def last(self, n: int | None = None) -> Any:
        """The last step's record (``n`` None), or a History of the last ``n`` steps."""
        if n is None:
            if not self.records:
                raise InputError("metrics.last(): expected at least one logged step, found none")
            return self.records[-1]
        if not isinstance(n, int) or n < 1:
            raise InputError(f"metrics.last(n): expected a positive int, found {n!r}")
        return History(self.records[-n:], self.output_dir)

    def to_json(self, path: str, *, all_ranks: bool = False) -> str | None:
        """The records as one JSON list (non-finite numbers as null); written by rank 0 only unless ``all_ranks``
        (returns the path, or None on a rank that did not write)."""
        if not (all_ranks or _is_driver()):
            return None
        _write_atomic(path, json.dumps([{k: _finite(v) for k, v in r.items()} for r in self.records], indent=1))
        return path

    def to_csv(self, path: str, *, all_ranks: bool = False) -> str | None:
        """One row per step, one column per metric (``step`` first, the others sorted; empty where a step did not
        log it); written by rank 0 only unless ``all_ranks``."""
        if not (all_ranks or _is_driver()):
            return None
        import io

        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=self.names, restval="", lineterminator="\n")
        writer.writeheader()
        for record in self.records:
            writer.writerow({k: json.dumps(v) if isinstance(v, (list, dict)) else v for k, v in record.items()})
        _write_atomic(path, buf.getvalue())
        return path


def _finite(value: Any) -> Any:
    return None if isinstance(value, float) and not math.isfinite(value) else value


def _write_atomic(path: str, text: str) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
    os.replace(tmp, path)


def load(output_dir: str, *, from_step: int = 1) -> History:
    """A run's metrics (``output_dir``: its ``trainer.output_dir`` or the ``metrics.jsonl`` itself), steps from
    ``from_step`` on (step 0 is the validation before training)."""
    from verl.utils.tracking import METRICS_FILE, read_metrics

    path = os.fspath(output_dir)
    if not (os.path.isfile(path) or os.path.isfile(os.path.join(path, METRICS_FILE))):
        raise InputError(f"metrics: expected {os.path.join(path, METRICS_FILE)}, found no such file")
    return History([r for r in read_metrics(path) if r["step"] >= from_step], path)


def latest() -> History:
    """The metrics of the last run this process trained through the Python API."""
    if _LATEST is None:
        raise InputError("verl.metrics.latest(): expected a finished run in this process, found none")
    return _LATEST


def _record(history: History) -> History:
    global _LATEST
    _LATEST = history
    return history
