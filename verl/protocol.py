"""DataProto: the batch that flows between the controller and the workers.

A ``DataProto`` holds
- ``batch``: tensors that share dim 0 (the batch dim), in a :class:`TensorBatch`;
- ``non_tensor_batch``: numpy arrays (usually dtype=object) of the same length (e.g. ``uid``,
  ``data_source``, ``reward_model``);
- ``meta_info``: a plain dict shared by the whole batch (e.g. ``temperature``, ``eos_token_id``).

Field names follow verl (``responses``, ``response_mask``, ``old_log_probs``, ``ref_log_prob``,
``values``, ``token_level_scores``, ``token_level_rewards``, ``advantages``, ``returns``...).

Strict checks (``VERL_STRICT_DATA_CHECK=1``) validate the batch size, the prompt/response length
families and dtypes at every ``union`` and at every worker return, and raise one
:class:`DataProtoError` naming the field, the expected and found shapes and the worker method that
produced the field.
"""

from __future__ import annotations

import copy
import io
import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

STRICT_DATA_CHECK_ENV = "VERL_STRICT_DATA_CHECK"

# Floating-point fields, all [B, R] with R = response length.
FLOAT_FIELDS = (
    "token_level_scores",
    "token_level_rewards",
    "values",
    "old_log_probs",
    "ref_log_prob",
    "advantages",
    "returns",
    "rollout_log_probs",
    "rm_scores",
)
# Fields that are [B, R] with R = response length.
RESPONSE_LENGTH_FIELDS = ("responses", "response_mask", *FLOAT_FIELDS)
# Fields that are [B, L] with L = prompt length + response length (position_ids: L in its last dim).
SEQUENCE_LENGTH_FIELDS = ("input_ids", "attention_mask")
MASK_FIELDS = ("response_mask", "attention_mask")
TOKEN_ID_FIELDS = ("input_ids", "responses", "prompts", "position_ids")

_WIRE_FORMAT = "verl-hpc.DataProto/1"


class DataProtoError(ValueError):
    """A DataProto whose fields disagree (batch size, lengths, dtypes, conflicting union)."""


def strict_data_check_enabled() -> bool:
    """True when ``VERL_STRICT_DATA_CHECK`` is set to 1/true/yes."""
    return os.environ.get(STRICT_DATA_CHECK_ENV, "0").strip().lower() in ("1", "true", "yes")


def _shape(t: torch.Tensor | np.ndarray) -> str:
    return "[" + ", ".join(str(d) for d in t.shape) + "]"


class TensorBatch(dict):
    """A dict of tensors whose dim 0 is always ``batch_size`` (enforced on every insertion)."""

    def __init__(self, tensors: dict[str, torch.Tensor] | None = None, batch_size: int | None = None):
        super().__init__()
        tensors = dict(tensors or {})
        if batch_size is None:
            if not tensors:
                raise DataProtoError("TensorBatch: expected tensors or an explicit batch_size, found neither")
            first_key = next(iter(tensors))
            first = tensors[first_key]
            if not isinstance(first, torch.Tensor) or first.dim() == 0:
                raise DataProtoError(
                    f"TensorBatch: field '{first_key}' expected a tensor with a batch dim, found {type(first).__name__}"
                    f"{' of dim 0' if isinstance(first, torch.Tensor) else ''}"
                )
            batch_size = first.shape[0]
        self._batch_size = int(batch_size)
        for key, value in tensors.items():
            self[key] = value

    @property
    def batch_size(self) -> torch.Size:
        return torch.Size([self._batch_size])

    def __setitem__(self, key: str, value: torch.Tensor) -> None:
        if not isinstance(value, torch.Tensor):
            raise DataProtoError(f"batch field '{key}': expected a torch.Tensor, found {type(value).__name__}")
        if value.dim() == 0 or value.shape[0] != self._batch_size:
            raise DataProtoError(
                f"batch field '{key}': expected batch size {self._batch_size} in dim 0, found shape {_shape(value)}"
            )
        super().__setitem__(key, value)

    def update(self, other=(), **kwargs) -> None:  # route through __setitem__ so sizes are checked
        for key, value in dict(other, **kwargs).items():
            self[key] = value

    def setdefault(self, key, default=None):
        if key not in self:
            self[key] = default
        return self[key]


def _object_array(values: Iterable[Any]) -> np.ndarray:
    """1-D object array of ``values`` (np.array would turn equal-length lists into a 2-D array)."""
    values = list(values)
    out = np.empty(len(values), dtype=object)
    for i, v in enumerate(values):
        out[i] = v
    return out


def _as_numpy(key: str, value: Any) -> np.ndarray:
    if isinstance(value, np.ndarray):
        return value
    if isinstance(value, (list, tuple)):
        return _object_array(value)
    raise DataProtoError(
        f"non_tensor_batch field '{key}': expected a numpy array or list, found {type(value).__name__}"
    )


def _arrays_equal(a: np.ndarray, b: np.ndarray) -> bool:
    if a.shape != b.shape:
        return False
    if a.dtype != object and b.dtype != object:
        return bool(np.array_equal(a, b))
    return all(x is y or x == y for x, y in zip(a.ravel().tolist(), b.ravel().tolist(), strict=False))


@dataclass
class DataProtoItem:
    """One sample of a DataProto: tensors without the batch dim, one element per non-tensor field."""

    batch: dict[str, torch.Tensor]
    non_tensor_batch: dict[str, Any]
    meta_info: dict = field(default_factory=dict)


class DataProto:
    """Batch of tensors + numpy fields + meta info, the unit of data exchanged between workers."""

    def __init__(
        self,
        batch: TensorBatch | dict[str, torch.Tensor] | None = None,
        non_tensor_batch: dict[str, Any] | None = None,
        meta_info: dict | None = None,
        field_producers: dict[str, str] | None = None,
    ):
        non_tensor_batch = {k: _as_numpy(k, v) for k, v in (non_tensor_batch or {}).items()}
        if isinstance(batch, TensorBatch):
            self.batch = batch
        elif batch:
            self.batch = TensorBatch(batch)
        else:
            size = len(next(iter(non_tensor_batch.values()))) if non_tensor_batch else 0
            self.batch = TensorBatch({}, batch_size=size)
        self.non_tensor_batch = non_tensor_batch
        self.meta_info = dict(meta_info or {})
        # Which worker method produced each field, so strict-check errors can name it.
        self.field_producers = dict(field_producers or {})
        for key, value in self.non_tensor_batch.items():
            if value.ndim == 0 or value.shape[0] != len(self):
                raise DataProtoError(
                    f"non_tensor_batch field '{key}': expected batch size {len(self)} in dim 0, "
                    f"found shape {_shape(value)}"
                )

    # ----------------------------------------------------------------- construction
    @classmethod
    def from_dict(
        cls,
        tensors: dict[str, torch.Tensor] | None = None,
        non_tensors: dict[str, Any] | None = None,
        meta_info: dict | None = None,
    ) -> DataProto:
        return cls(batch=tensors, non_tensor_batch=non_tensors, meta_info=meta_info)

    @classmethod
    def from_single_dict(cls, data: dict[str, Any], meta_info: dict | None = None) -> DataProto:
        """Split one dict into tensors (torch.Tensor values) and non-tensors (everything else)."""
        tensors = {k: v for k, v in data.items() if isinstance(v, torch.Tensor)}
        non_tensors = {k: v for k, v in data.items() if not isinstance(v, torch.Tensor)}
        return cls.from_dict(tensors, non_tensors, meta_info)

    def _derive(self, batch: TensorBatch, non_tensor_batch: dict, meta_info: dict | None = None) -> DataProto:
        keys = set(batch) | set(non_tensor_batch)
        producers = {k: v for k, v in self.field_producers.items() if k in keys}
        return DataProto(batch, non_tensor_batch, self.meta_info if meta_info is None else meta_info, producers)

    # ----------------------------------------------------------------- size / indexing
    def __len__(self) -> int:
        return self.batch.batch_size[0]

    def __getitem__(self, item):
        if isinstance(item, (int, np.integer)):
            index = int(item)
            if not -len(self) <= index < len(self):
                raise IndexError(f"DataProto index {index} out of range for batch size {len(self)}")
            return DataProtoItem(
                batch={k: v[index] for k, v in self.batch.items()},
                non_tensor_batch={k: v[index] for k, v in self.non_tensor_batch.items()},
                meta_info=self.meta_info,
            )
        if isinstance(item, slice):
            return self.slice(item.start, item.stop, item.step)
        if isinstance(item, (list, np.ndarray, torch.Tensor)):
            return self.select_idxs(item)
        raise TypeError(
            f"DataProto indices must be int, slice, list, numpy array or tensor, found {type(item).__name__}"
        )

    def slice(self, start: int | None = None, end: int | None = None, step: int | None = None) -> DataProto:
        """Rows start:end:step (tensors are views)."""
        s = slice(start, end, step)
        size = len(range(*s.indices(len(self))))
        batch = TensorBatch({k: v[s] for k, v in self.batch.items()}, batch_size=size)
        return self._derive(batch, {k: v[s] for k, v in self.non_tensor_batch.items()})

    def select_idxs(self, idxs: Sequence[int] | np.ndarray | torch.Tensor) -> DataProto:
        """Rows at integer indices, or where a boolean mask of length B is true."""
        index = torch.as_tensor(np.asarray(idxs) if isinstance(idxs, list) else idxs)
        if index.dtype == torch.bool:
            if index.shape != (len(self),):
                raise DataProtoError(
                    f"select_idxs: expected a boolean mask of shape [{len(self)}], found {_shape(index)}"
                )
            index = index.nonzero(as_tuple=True)[0]
        if index.numel() == 0:
            index = index.to(torch.long)
        index = index.long().reshape(-1)
        np_index = index.cpu().numpy()
        batch = TensorBatch({k: v[index.to(v.device)] for k, v in self.batch.items()}, batch_size=index.numel())
        return self._derive(batch, {k: v[np_index] for k, v in self.non_tensor_batch.items()})

    # ----------------------------------------------------------------- key selection
    def select(
        self,
        batch_keys: Sequence[str] | None = None,
        non_tensor_batch_keys: Sequence[str] | None = None,
        meta_info_keys: Sequence[str] | None = None,
        deepcopy: bool = False,
    ) -> DataProto:
        """A DataProto with only the named keys (None keeps all keys of that kind)."""

        def pick(source: dict, keys, kind: str) -> dict:
            if keys is None:
                return dict(source)
            missing = [k for k in keys if k not in source]
            if missing:
                raise DataProtoError(f"select: {kind} keys {missing} not found; available: {sorted(source)}")
            return {k: source[k] for k in keys}

        batch = pick(self.batch, batch_keys, "batch")
        non_tensor = pick(self.non_tensor_batch, non_tensor_batch_keys, "non_tensor_batch")
        meta = pick(self.meta_info, meta_info_keys, "meta_info")
        if deepcopy:
            batch = {k: v.clone() for k, v in batch.items()}
            non_tensor = copy.deepcopy(non_tensor)
            meta = copy.deepcopy(meta)
        return self._derive(TensorBatch(batch, batch_size=len(self)), non_tensor, meta)

    def pop(
        self,
        batch_keys: Sequence[str] | None = None,
        non_tensor_batch_keys: Sequence[str] | None = None,
        meta_info_keys: Sequence[str] | None = None,
    ) -> DataProto:
        """Remove the named keys from self and return them as a new DataProto."""
        popped = self.select(batch_keys or [], non_tensor_batch_keys or [], meta_info_keys or [])
        for key in batch_keys or []:
            dict.pop(self.batch, key)
        for key in non_tensor_batch_keys or []:
            self.non_tensor_batch.pop(key)
        for key in meta_info_keys or []:
            self.meta_info.pop(key)
        for key in list(popped.batch) + list(popped.non_tensor_batch):
            self.field_producers.pop(key, None)
        return popped

    # ----------------------------------------------------------------- combination
    def union(self, other: DataProto) -> DataProto:
        """Add ``other``'s fields to self (in place, returns self); shared keys must be equal."""
        if len(self) != len(other) and (self.batch or self.non_tensor_batch):
            raise DataProtoError(f"union: expected batch size {len(self)}, found {len(other)} in the other DataProto")
        if not self.batch and not self.non_tensor_batch:
            self.batch = TensorBatch({}, batch_size=len(other))
        for key, value in other.batch.items():
            if key in self.batch and not (
                self.batch[key].shape == value.shape and torch.equal(self.batch[key], value.to(self.batch[key].device))
            ):
                raise DataProtoError(
                    f"union: batch field '{key}' differs between the two DataProtos "
                    f"(shapes {_shape(self.batch[key])} vs {_shape(value)}); pop it from one side first"
                )
            self.batch[key] = value
        for key, value in other.non_tensor_batch.items():
            if key in self.non_tensor_batch and not _arrays_equal(self.non_tensor_batch[key], value):
                raise DataProtoError(f"union: non_tensor_batch field '{key}' differs between the two DataProtos")
            self.non_tensor_batch[key] = value
        for key, value in other.meta_info.items():
            if key in self.meta_info and self.meta_info[key] != value:
                raise DataProtoError(f"union: meta_info '{key}' differs: {self.meta_info[key]!r} vs {value!r}")
            self.meta_info[key] = value
        for key, producer in other.field_producers.items():
            self.field_producers.setdefault(key, producer)
        if strict_data_check_enabled():
            self.check_consistency(producer="DataProto.union")
        return self

    @staticmethod
    def concat(data: Sequence[DataProto]) -> DataProto:
        """Concatenate along the batch dim; all parts need the same keys. meta_info is the first's."""
        if not data:
            raise DataProtoError("concat: expected at least one DataProto, found an empty list")
        first = data[0]
        for i, part in enumerate(data[1:], start=1):
            if set(part.batch) != set(first.batch) or set(part.non_tensor_batch) != set(first.non_tensor_batch):
                raise DataProtoError(
                    f"concat: part {i} has keys {sorted(part.batch) + sorted(part.non_tensor_batch)}, "
                    f"expected {sorted(first.batch) + sorted(first.non_tensor_batch)}"
                )
        size = sum(len(p) for p in data)
        batch = TensorBatch({k: torch.cat([p.batch[k] for p in data], dim=0) for k in first.batch}, batch_size=size)
        non_tensor = {k: np.concatenate([p.non_tensor_batch[k] for p in data], axis=0) for k in first.non_tensor_batch}
        producers: dict[str, str] = {}
        for part in data:
            for key, producer in part.field_producers.items():
                producers.setdefault(key, producer)
        return DataProto(batch, non_tensor, first.meta_info, producers)

    def split(self, split_size: int) -> list[DataProto]:
        """Consecutive pieces of ``split_size`` rows (the last may be smaller)."""
        if split_size <= 0:
            raise DataProtoError(f"split: expected a positive split_size, found {split_size}")
        return [self.slice(start, start + split_size) for start in range(0, len(self), split_size)]

    def chunk(self, chunks: int) -> list[DataProto]:
        """``chunks`` equal consecutive pieces; the batch size must be divisible by ``chunks``."""
        if chunks <= 0 or len(self) % chunks != 0:
            raise DataProtoError(
                f"chunk: expected batch size {len(self)} to be divisible by chunks={chunks}; "
                f"use pad_dataproto_to_divisor first"
            )
        if len(self) == 0:
            return [self.slice(0, 0) for _ in range(chunks)]
        return self.split(len(self) // chunks)

    def repeat(self, repeat_times: int = 2, interleave: bool = True) -> DataProto:
        """Repeat every row; interleave gives [a, a, b, b], otherwise [a, b, a, b]."""
        if repeat_times < 1:
            raise DataProtoError(f"repeat: expected repeat_times >= 1, found {repeat_times}")
        if interleave:
            tensors = {k: v.repeat_interleave(repeat_times, dim=0) for k, v in self.batch.items()}
            non_tensor = {k: np.repeat(v, repeat_times, axis=0) for k, v in self.non_tensor_batch.items()}
        else:
            tensors = {k: v.repeat(repeat_times, *([1] * (v.dim() - 1))) for k, v in self.batch.items()}
            non_tensor = {
                k: np.tile(v, (repeat_times,) + (1,) * (v.ndim - 1)) for k, v in self.non_tensor_batch.items()
            }
        return self._derive(TensorBatch(tensors, batch_size=len(self) * repeat_times), non_tensor)

    def reorder(self, indices: torch.Tensor) -> None:
        """Permute rows in place: row i becomes old row indices[i]."""
        reordered = self.select_idxs(indices)
        if len(reordered) != len(self):
            raise DataProtoError(f"reorder: expected {len(self)} indices, found {len(reordered)}")
        self.batch = reordered.batch
        self.non_tensor_batch = reordered.non_tensor_batch

    def to(self, device: str | torch.device) -> DataProto:
        """Move every tensor to ``device`` (in place, returns self)."""
        self.batch = TensorBatch({k: v.to(device) for k, v in self.batch.items()}, batch_size=len(self))
        return self

    # ----------------------------------------------------------------- strict checks
    def check_consistency(self, producer: str = "") -> None:
        """Validate batch size, length families and dtypes; raise one DataProtoError on the first mismatch.

        ``producer`` names the worker method that returned this batch (e.g. ``critic.compute_values``);
        it is recorded for fields whose producer is not known yet and named in errors.
        """
        size = len(self)

        def fail(key: str, message: str) -> None:
            who = self.field_producers.get(key, producer) or "unknown producer"
            raise DataProtoError(f"[{who}] field '{key}': {message}")

        for key, value in self.batch.items():
            if value.dim() == 0 or value.shape[0] != size:
                fail(key, f"expected batch size {size} in dim 0, found shape {_shape(value)}")
        for key, value in self.non_tensor_batch.items():
            if not isinstance(value, np.ndarray):
                fail(key, f"expected a numpy array, found {type(value).__name__}")
            if value.ndim == 0 or value.shape[0] != size:
                fail(key, f"expected batch size {size} in dim 0, found shape {_shape(value)}")

        self._check_length_family(RESPONSE_LENGTH_FIELDS, "response length", fail)
        self._check_length_family(SEQUENCE_LENGTH_FIELDS, "sequence length", fail)
        if "position_ids" in self.batch and "input_ids" in self.batch:
            # position_ids may carry an extra rope-section dim ([B, 3, L]); the last dim must match.
            pos, ids = self.batch["position_ids"], self.batch["input_ids"]
            if pos.shape[-1] != ids.shape[-1]:
                fail("position_ids", f"expected last dim {ids.shape[-1]} (from 'input_ids'), found shape {_shape(pos)}")
        if all(k in self.batch for k in ("input_ids", "prompts", "responses")):
            expected = self.batch["prompts"].shape[-1] + self.batch["responses"].shape[-1]
            found = self.batch["input_ids"].shape[-1]
            if found != expected:
                fail(
                    "input_ids",
                    f"expected shape [{size}, {expected}] (prompts + responses), "
                    f"found {_shape(self.batch['input_ids'])}",
                )

        for key in MASK_FIELDS:
            value = self.batch.get(key)
            if value is not None and value.is_floating_point():
                fail(key, f"expected an integer or bool mask dtype, found {value.dtype}")
        for key in TOKEN_ID_FIELDS:
            value = self.batch.get(key)
            if value is not None and (value.is_floating_point() or value.dtype == torch.bool):
                fail(key, f"expected an integer dtype, found {value.dtype}")
        for key in FLOAT_FIELDS:
            value = self.batch.get(key)
            if value is not None and not value.is_floating_point():
                fail(key, f"expected a floating-point dtype, found {value.dtype}")

        if producer:
            for key in list(self.batch) + list(self.non_tensor_batch):
                self.field_producers.setdefault(key, producer)

    def _check_length_family(self, keys: Sequence[str], what: str, fail) -> None:
        present = [k for k in keys if k in self.batch]
        if not present:
            return
        reference = present[0]
        ref_shape = self.batch[reference].shape
        if len(ref_shape) != 2:
            fail(reference, f"expected shape [B, {what}], found {_shape(self.batch[reference])}")
        for key in present[1:]:
            found = self.batch[key]
            if found.shape != ref_shape:
                fail(
                    key,
                    f"expected shape {_shape(self.batch[reference])} ({what} from '{reference}'), "
                    f"found {_shape(found)}",
                )

    # ----------------------------------------------------------------- transport
    def to_bytes(self) -> bytes:
        """Serialise for transport; ``from_bytes`` reads it back without unpickling arbitrary objects.

        Non-tensor arrays travel as JSON (str, int, float, bool, None, list, dict elements; numpy
        scalars become Python scalars, tuples become lists, dict keys become strings).
        """
        non_tensor = {}
        for key, value in self.non_tensor_batch.items():
            try:
                encoded = json.dumps(value.ravel().tolist(), default=_json_default)
            except (TypeError, ValueError) as err:
                raise DataProtoError(
                    f"to_bytes: non_tensor_batch field '{key}' holds a value JSON cannot carry ({err})"
                ) from None
            non_tensor[key] = {"dtype": value.dtype.str, "shape": list(value.shape), "json": encoded}
        _check_plain(self.meta_info, "meta_info")
        payload = {
            "format": _WIRE_FORMAT,
            "batch_size": len(self),
            "batch": {k: _compact(v) for k, v in self.batch.items()},
            "non_tensor_batch": non_tensor,
            "meta_info": self.meta_info,
            "field_producers": self.field_producers,
        }
        buffer = io.BytesIO()
        torch.save(payload, buffer)
        return buffer.getvalue()

    @classmethod
    def from_bytes(cls, data: bytes) -> DataProto:
        payload = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        if not isinstance(payload, dict) or payload.get("format") != _WIRE_FORMAT:
            found = payload.get("format") if isinstance(payload, dict) else type(payload).__name__
            raise DataProtoError(f"from_bytes: expected format {_WIRE_FORMAT!r}, found {found!r}")
        non_tensor = {}
        for key, enc in payload["non_tensor_batch"].items():
            items = json.loads(enc["json"])
            dtype = np.dtype(enc["dtype"])
            flat = _object_array(items) if dtype.kind == "O" else np.array(items, dtype=dtype).reshape(-1)
            non_tensor[key] = flat.reshape(enc["shape"])
        batch = TensorBatch(payload["batch"], batch_size=payload["batch_size"])
        return cls(batch, non_tensor, payload["meta_info"], payload["field_producers"])

    def __repr__(self) -> str:
        tensors = ", ".join(f"{k}: {_shape(v)} {str(v.dtype).replace('torch.', '')}" for k, v in self.batch.items())
        return (
            f"DataProto(batch_size={len(self)}, batch={{{tensors}}}, "
            f"non_tensor_batch={sorted(self.non_tensor_batch)}, meta_info={sorted(self.meta_info)})"
        )


def _compact(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU tensor owning exactly its elements: torch.save writes a view's whole storage."""
    tensor = tensor.detach().cpu()
    if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size() or not tensor.is_contiguous():
        tensor = tensor.clone(memory_format=torch.contiguous_format)
    return tensor


def _json_default(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, tuple):
        return list(value)
    raise TypeError(f"type {type(value).__name__} is not JSON serialisable")


def _check_plain(value: Any, where: str) -> None:
    """meta_info travels through torch.load(weights_only=True): plain containers, scalars, tensors only."""
    if value is None or isinstance(value, (str, int, float, bool, torch.Tensor)):
        return
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_plain(v, f"{where}[{i}]")
        return
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, (str, int)):
                raise DataProtoError(f"to_bytes: {where} key {k!r}: expected str or int, found {type(k).__name__}")
            _check_plain(v, f"{where}[{k!r}]")
        return
    raise DataProtoError(
        f"to_bytes: {where}: expected str/int/float/bool/None/tensor/list/dict, found {type(value).__name__}"
    )


def pad_dataproto_to_divisor(data: DataProto, size_divisor: int) -> tuple[DataProto, int]:
    """Pad ``data`` with copies of its first rows so len is divisible by ``size_divisor``.

    Returns (padded data, pad_size); undo with :func:`unpad_dataproto`.
    """
    if size_divisor <= 0:
        raise DataProtoError(f"pad_dataproto_to_divisor: expected a positive size_divisor, found {size_divisor}")
    if len(data) % size_divisor == 0:
        return data, 0
    if len(data) == 0:
        raise DataProtoError("pad_dataproto_to_divisor: expected a non-empty DataProto, found batch size 0")
    pad_size = size_divisor - len(data) % size_divisor
    pieces, remaining = [data], pad_size
    while remaining > 0:
        take = min(remaining, len(data))
        pieces.append(data[:take])
        remaining -= take
    return DataProto.concat(pieces), pad_size


def unpad_dataproto(data: DataProto, pad_size: int) -> DataProto:
    """Drop the last ``pad_size`` rows added by :func:`pad_dataproto_to_divisor`."""
    return data[:-pad_size] if pad_size else data
