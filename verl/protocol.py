"""DataProto: the batch that flows between the controller and the workers, with verl's API.

A ``DataProto`` holds
- ``batch``: a :class:`tensordict.TensorDict` of tensors sharing dim 0 (the batch dim), or None when
  there are no tensors (as in verl);
- ``non_tensor_batch``: numpy arrays (usually dtype=object) of the same length (e.g. ``uid``,
  ``data_source``, ``reward_model``);
- ``meta_info``: a plain dict shared by the whole batch (e.g. ``temperature``, ``eos_token_id``).

The public surface (methods, constructor arguments, module helpers) follows verl 0.9's
``verl/protocol.py``, so custom reward managers and recipes written against verl run unchanged.
What verl-hpc adds:

- strict checks (``VERL_STRICT_DATA_CHECK=1``) validate the batch size, the prompt/response length
  families and dtypes at every ``union`` and at every worker return, and raise one
  :class:`DataProtoError` naming the field, the expected and found shapes and the worker method that
  produced the field (``field_producers``);
- ``to_bytes``/``from_bytes``: the transport of the worker groups, which never unpickles objects.

Not provided: verl's ``DataProtoFuture`` and ``BatchData`` (Ray object references; there is no Ray here).
"""

from __future__ import annotations

import copy
import io
import json
import logging
import math
import os
import pickle
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict

from verl.errors import InputError

__all__ = ["DataProto", "union_tensor_dict"]

logger = logging.getLogger(__name__)

STRICT_DATA_CHECK_ENV = "VERL_STRICT_DATA_CHECK"
AUTO_PADDING_ENV = "VERL_AUTO_PADDING"
SERIALIZATION_METHOD_ENV = "VERL_DATAPROTO_SERIALIZATION_METHOD"

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


class DataProtoError(ValueError, AssertionError):
    """A DataProto whose fields disagree (batch size, lengths, dtypes, conflicting union).

    Also an AssertionError: verl signals these conditions with ``assert``, so user code written
    against verl that catches AssertionError keeps working.
    """


class DataProtoFileError(DataProtoError, InputError):
    """A file ``load_from_disk`` refuses: not a pickled DataProto, or one naming code to run."""


def strict_data_check_enabled() -> bool:
    """True when ``VERL_STRICT_DATA_CHECK`` is set to 1/true/yes."""
    return os.environ.get(STRICT_DATA_CHECK_ENV, "0").strip().lower() in ("1", "true", "yes")


class _DataProtoConfigMeta(type):
    """``DataProtoConfig.auto_padding``: a class-level switch, also turned on by ``VERL_AUTO_PADDING``."""

    _settings: dict[str, bool] = {}
    auto_padding_key = "_verl_auto_padding"

    @property
    def auto_padding(cls) -> bool:
        from_env = os.environ.get(AUTO_PADDING_ENV, "FALSE").strip().upper() in ("TRUE", "1")
        return from_env or cls._settings.get(cls.auto_padding_key, False)

    @auto_padding.setter
    def auto_padding(cls, enabled: bool) -> None:
        if not isinstance(enabled, bool):
            raise DataProtoError(f"DataProtoConfig.auto_padding: expected a bool, found {type(enabled).__name__}")
        cls._settings[cls.auto_padding_key] = enabled


class DataProtoConfig(metaclass=_DataProtoConfigMeta):
    """Process-wide DataProto settings (verl's): ``DataProtoConfig.auto_padding = True``."""


def _shape(t: Any) -> str:
    return "[" + ", ".join(str(d) for d in t.shape) + "]"


def _object_array(values: Iterable[Any]) -> np.ndarray:
    """1-D object array of ``values`` (np.array would turn equal-length lists into a 2-D array)."""
    values = list(values)
    out = np.empty(len(values), dtype=object)
    for i, v in enumerate(values):
        out[i] = v
    return out


def _as_numpy(key: str, value: Any) -> np.ndarray:
    """verl's conversion: a list becomes ``np.array(value, dtype=object)`` (equal-length lists: 2-D)."""
    if isinstance(value, np.ndarray):
        return value
    if isinstance(value, (list, tuple)):
        return np.array(value, dtype=object)
    raise DataProtoError(
        f"non_tensor_batch field '{key}': expected a numpy array or list, found {type(value).__name__}"
    )


def _as_tensordict(batch: Any) -> TensorDict | None:
    """None, a TensorDict as is, or a mapping of tensors -> a TensorDict with dim 0 as its batch dim."""
    if batch is None or isinstance(batch, TensorDict):
        return batch
    if not isinstance(batch, Mapping):
        raise DataProtoError(f"batch: expected a TensorDict or a dict of tensors, found {type(batch).__name__}")
    if not batch:
        return None
    size = None
    for key, value in batch.items():
        if not isinstance(value, torch.Tensor):
            raise DataProtoError(f"batch field '{key}': expected a torch.Tensor, found {type(value).__name__}")
        if value.dim() == 0:
            raise DataProtoError(f"batch field '{key}': expected a tensor with a batch dim, found a 0-dim tensor")
        if size is None:
            size = value.shape[0]
        elif value.shape[0] != size:
            raise DataProtoError(
                f"batch field '{key}': expected batch size {size} in dim 0, found shape {_shape(value)}"
            )
    return TensorDict(dict(batch), batch_size=[size])


# ----------------------------------------------------------------------------- equality helpers
def _deep_equal(a: Any, b: Any, seen: set[int] | None = None) -> bool:
    """Equality that treats NaN == NaN, compares arrays/tensors element-wise and survives cycles."""
    seen = set() if seen is None else seen
    if type(a) is not type(b):
        return False
    if id(a) in seen:  # a cycle with matching types so far: equal along this path
        return True
    seen.add(id(a))
    try:
        if isinstance(a, float):
            return a == b or (math.isnan(a) and math.isnan(b))
        if isinstance(a, torch.Tensor):
            return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b.to(a.device)))
        if isinstance(a, np.ndarray):
            if a.dtype != b.dtype or a.shape != b.shape:
                return False
            if a.dtype != object:
                return bool(np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"))
            return all(_deep_equal(x, y, seen) for x, y in zip(a.flat, b.flat, strict=True))
        if isinstance(a, (list, tuple)):
            return len(a) == len(b) and all(_deep_equal(x, y, seen) for x, y in zip(a, b, strict=True))
        if isinstance(a, dict):
            return a.keys() == b.keys() and all(_deep_equal(a[k], b[k], seen) for k in a)
        result = a == b
        return bool(result.all()) if hasattr(result, "all") else bool(result)
    finally:
        seen.discard(id(a))


def union_tensor_dict(tensor_dict1: TensorDict, tensor_dict2: TensorDict) -> TensorDict:
    """Add ``tensor_dict2``'s tensors to ``tensor_dict1`` (in place); shared keys must hold equal tensors."""
    if tensor_dict1.batch_size != tensor_dict2.batch_size:
        raise DataProtoError(
            f"union: expected batch size {list(tensor_dict1.batch_size)}, found {list(tensor_dict2.batch_size)} "
            f"in the other batch"
        )
    for key, value in tensor_dict2.items():
        if key in tensor_dict1.keys():
            mine = tensor_dict1[key]
            if mine.shape != value.shape or not torch.equal(mine, value.to(mine.device)):
                raise DataProtoError(
                    f"union: batch field '{key}' differs between the two DataProtos "
                    f"(shapes {_shape(mine)} vs {_shape(value)}); pop it from one side first"
                )
        tensor_dict1[key] = value
    return tensor_dict1


def union_numpy_dict(tensor_dict1: dict[str, np.ndarray], tensor_dict2: dict[str, np.ndarray]) -> dict:
    """Add ``tensor_dict2``'s arrays to ``tensor_dict1`` (in place); shared keys must be equal (NaN == NaN)."""
    for key, value in tensor_dict2.items():
        if key in tensor_dict1:
            if not isinstance(value, np.ndarray) or not isinstance(tensor_dict1[key], np.ndarray):
                raise DataProtoError(f"union: non_tensor_batch field '{key}': expected numpy arrays on both sides")
            if not _deep_equal(tensor_dict1[key], value):
                raise DataProtoError(f"union: non_tensor_batch field '{key}' differs between the two DataProtos")
        tensor_dict1[key] = value
    return tensor_dict1


def _union_meta(meta1: dict, meta2: dict) -> dict:
    for key, value in meta2.items():
        if key in meta1 and not _deep_equal(meta1[key], value):
            raise DataProtoError(f"union: meta_info '{key}' differs: {meta1[key]!r} vs {value!r}")
        meta1[key] = value
    return meta1


# ----------------------------------------------------------------------------- byte encoding (verl's numpy path)
def serialize_single_tensor(obj: torch.Tensor) -> tuple[str, torch.Size, np.ndarray]:
    """(dtype name, shape, raw bytes as a uint8 array) of a CPU tensor."""
    raw = obj.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    return str(obj.dtype).removeprefix("torch."), obj.shape, raw


def deserialize_single_tensor(encoded: tuple[str, Sequence[int], Any]) -> torch.Tensor:
    dtype_name, shape, raw = encoded
    dtype = getattr(torch, dtype_name, None)
    if not isinstance(dtype, torch.dtype):
        raise DataProtoError(f"deserialize_single_tensor: expected a torch dtype name, found {dtype_name!r}")
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).view(tuple(shape))


def serialize_tensordict(batch: TensorDict) -> tuple[tuple[int, ...], str | None, dict[str, tuple]]:
    """(batch_size, device, {key: encoded}); a nested (jagged) tensor is (layout, [encoded per row])."""
    items: dict[str, tuple] = {}
    for key, value in batch.items():
        if value.is_nested:
            layout = str(value.layout).removeprefix("torch.")
            items[key] = (layout, [serialize_single_tensor(t) for t in value.unbind()])
        else:
            items[key] = serialize_single_tensor(value)
    device = None if batch.device is None else str(batch.device)
    return tuple(batch.batch_size), device, items


def deserialize_tensordict(encoded: tuple) -> TensorDict:
    batch_size, device, items = encoded
    tensors: dict[str, torch.Tensor] = {}
    for key, value in items.items():
        if len(value) == 3:
            tensors[key] = deserialize_single_tensor(value)
        elif len(value) == 2:
            layout, rows = value
            tensors[key] = torch.nested.as_nested_tensor(
                [deserialize_single_tensor(r) for r in rows], layout=getattr(torch, layout)
            )
        else:
            raise DataProtoError(
                f"deserialize_tensordict: field '{key}': expected a 2- or 3-tuple encoding, found length {len(value)}"
            )
    return TensorDict(tensors, batch_size=batch_size, device=device)


def _compact(tensor: torch.Tensor, to_cpu: bool = True) -> torch.Tensor:
    """A (CPU) tensor owning exactly its elements: torch.save writes a view's whole storage."""
    tensor = tensor.detach().cpu() if to_cpu else tensor.detach()
    if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size() or not tensor.is_contiguous():
        tensor = tensor.clone(memory_format=torch.contiguous_format)
    return tensor


# ----------------------------------------------------------------------------- items and collation
@dataclass
class DataProtoItem:
    """One row of a DataProto: ``batch`` a TensorDict with batch_size [] (or None), one element per
    non-tensor field, and the parent's meta_info."""

    batch: TensorDict | None = None
    non_tensor_batch: dict = field(default_factory=dict)
    meta_info: dict = field(default_factory=dict)


def collate_fn(items: list[DataProtoItem]) -> DataProto:
    """Stack DataProtoItems (the rows ``make_iterator``'s DataLoader yields) back into a DataProto."""
    rows = [item.batch for item in items]
    batch = None if not rows or rows[0] is None else torch.stack(rows).contiguous()
    non_tensor: dict[str, list] = {}
    for item in items:
        for key, value in item.non_tensor_batch.items():
            non_tensor.setdefault(key, []).append(value)
    return DataProto(batch=batch, non_tensor_batch={k: np.array(v, dtype=object) for k, v in non_tensor.items()})


class DataProto:
    """Batch of tensors + numpy fields + meta info, the unit of data exchanged between workers."""

    def __init__(
        self,
        batch: TensorDict | Mapping[str, torch.Tensor] | None = None,
        non_tensor_batch: dict[str, Any] | None = None,
        meta_info: dict | None = None,
        field_producers: dict[str, str] | None = None,
    ):
        self.batch = _as_tensordict(batch)
        self.non_tensor_batch = {k: _as_numpy(k, v) for k, v in (non_tensor_batch or {}).items()}
        self.meta_info = dict(meta_info or {})
        # Which worker method produced each field, so strict-check errors can name it.
        self.field_producers = dict(field_producers or {})
        self._check_batch_sizes()

    def _check_batch_sizes(self) -> None:
        if self.batch is not None and len(self.batch.batch_size) != 1:
            raise DataProtoError(
                f"batch: expected exactly one batch dim, found batch_size {list(self.batch.batch_size)}"
            )
        size = len(self)
        for key, value in self.non_tensor_batch.items():
            if value.ndim == 0 or value.shape[0] != size:
                raise DataProtoError(
                    f"non_tensor_batch field '{key}': expected batch size {size} in dim 0, "
                    f"found shape {_shape(value)}"
                )

    # ----------------------------------------------------------------- construction
    @classmethod
    def from_dict(
        cls,
        tensors: dict[str, torch.Tensor] | None = None,
        non_tensors: dict[str, Any] | None = None,
        meta_info: dict | None = None,
        num_batch_dims: int = 1,
        auto_padding: bool = False,
    ) -> DataProto:
        """A DataProto from tensors sharing their first ``num_batch_dims`` dims, arrays/lists and meta info.

        ``auto_padding`` marks this DataProto so that ``chunk`` splits sizes that do not divide evenly.
        A DataProto has one batch dim, so ``num_batch_dims`` > 1 is refused after the shapes are checked
        (as verl does).
        """
        if num_batch_dims < 1:
            raise DataProtoError(f"from_dict: expected num_batch_dims >= 1, found {num_batch_dims}")
        if non_tensors and num_batch_dims != 1:
            raise DataProtoError(f"from_dict: expected num_batch_dims=1 with non_tensors, found {num_batch_dims}")
        tensors = dict(tensors or {})
        meta_info = dict(meta_info or {})
        if num_batch_dims > 1 and tensors:
            pivot, lead = next(iter(tensors.items()))[0], None
            for key, value in tensors.items():
                if lead is None:
                    lead = value.shape[:num_batch_dims]
                elif value.shape[:num_batch_dims] != lead:
                    raise DataProtoError(
                        f"batch field '{key}': expected batch size {list(lead)} in dims 0..{num_batch_dims - 1} "
                        f"(from '{pivot}'), found shape {_shape(value)}"
                    )
            raise DataProtoError(
                f"from_dict: a DataProto has one batch dim; expected num_batch_dims=1, found {num_batch_dims} "
                f"(fold rows with fold_batch_dim instead)"
            )
        batch = _as_tensordict(tensors)
        if auto_padding:
            meta_info[DataProtoConfig.auto_padding_key] = True
        return cls(batch=batch, non_tensor_batch=non_tensors, meta_info=meta_info)

    @classmethod
    def from_single_dict(cls, data: dict[str, Any], meta_info: dict | None = None, auto_padding: bool = False):
        """Split one dict into tensors (torch.Tensor values) and non-tensors (numpy arrays)."""
        wrong = [key for key, value in data.items() if not isinstance(value, torch.Tensor | np.ndarray)]
        if wrong:
            raise DataProtoError(f"from_single_dict: field '{wrong[0]}': expected a torch.Tensor or numpy array, "
                                 f"found {type(data[wrong[0]]).__name__}")
        tensors = {key: value for key, value in data.items() if isinstance(value, torch.Tensor)}
        non_tensors = {key: value for key, value in data.items() if isinstance(value, np.ndarray)}
        return cls.from_dict(tensors=tensors, non_tensors=non_tensors, meta_info=meta_info, auto_padding=auto_padding)

    @classmethod
    def from_tensordict(cls, tensor_dict: TensorDict, meta_info: dict | None = None, num_batch_dims: int = 1):
        """The inverse of :meth:`to_tensordict`: tensors -> batch, NonTensorStack -> non_tensor_batch,
        NonTensorData -> meta_info."""
        if num_batch_dims < 1:
            raise DataProtoError(f"from_tensordict: expected num_batch_dims >= 1, found {num_batch_dims}")
        meta = dict(meta_info or {})
        tensors: dict[str, torch.Tensor] = {}
        non_tensors: dict[str, np.ndarray] = {}
        for key, value in tensor_dict.items():
            if isinstance(value, NonTensorStack):
                non_tensors[key] = _object_array(value.tolist())
            elif isinstance(value, NonTensorData):
                meta[key] = value.data
            elif isinstance(value, torch.Tensor):
                tensors[key] = value
            else:
                raise DataProtoError(
                    f"from_tensordict: field '{key}': expected a tensor, NonTensorStack or NonTensorData, "
                    f"found {type(value).__name__}"
                )
        if non_tensors and num_batch_dims != 1:
            raise DataProtoError(
                f"from_tensordict: expected num_batch_dims=1 with non-tensor data, found {num_batch_dims}"
            )
        return cls.from_dict(tensors, non_tensors, meta, num_batch_dims=num_batch_dims)

    def to_tensordict(self) -> TensorDict:
        """One TensorDict: tensors, each non-tensor field as a NonTensorStack (one element per row, nested
        lists and dicts kept), each meta_info entry as NonTensorData."""
        tensors = {} if self.batch is None else dict(self.batch.items())
        row_keys = set(tensors) | set(self.non_tensor_batch)
        clash = (set(tensors) & set(self.non_tensor_batch)) | (row_keys & set(self.meta_info))
        if clash:
            raise DataProtoError(f"to_tensordict: keys {sorted(clash)} appear in more than one of batch, "
                                 f"non_tensor_batch and meta_info")
        source: dict[str, Any] = dict(tensors)
        for key, value in self.non_tensor_batch.items():
            source[key] = NonTensorStack.from_list([NonTensorData(item) for item in value])
        for key, value in self.meta_info.items():
            source[key] = NonTensorData(value)
        batch_size = [len(self)] if (tensors or self.non_tensor_batch) else []
        return TensorDict(source, batch_size=batch_size)

    def _derive(self, batch: TensorDict | None, non_tensor_batch: dict, meta_info: dict | None = None) -> DataProto:
        keys = set(non_tensor_batch) | (set(batch.keys()) if batch is not None else set())
        producers = {k: v for k, v in self.field_producers.items() if k in keys}
        meta = self.meta_info if meta_info is None else meta_info
        return type(self)(batch, non_tensor_batch, meta, producers)

    # ----------------------------------------------------------------- size / indexing
    def __len__(self) -> int:
        if self.batch is not None:
            return int(self.batch.batch_size[0])
        if self.non_tensor_batch:
            return int(next(iter(self.non_tensor_batch.values())).shape[0])
        return 0

    def __getitem__(self, item):
        """int -> DataProtoItem; slice -> DataProto (views); list / numpy / tensor indices or bool mask ->
        DataProto."""
        if isinstance(item, slice):
            return self.slice(item.start, item.stop, item.step)
        if isinstance(item, (list, np.ndarray, torch.Tensor)):
            return self.select_idxs(item)
        if isinstance(item, (int, np.integer)):
            index = int(item)
            if not -len(self) <= index < len(self):
                raise IndexError(f"DataProto index {index} out of range for batch size {len(self)}")
            return DataProtoItem(
                batch=None if self.batch is None else self.batch[index],
                non_tensor_batch={k: v[index] for k, v in self.non_tensor_batch.items()},
                meta_info=self.meta_info,
            )
        raise TypeError(
            f"DataProto indices must be int, slice, list, numpy array or tensor, found {type(item).__name__}"
        )

    def slice(self, start: int | None = None, end: int | None = None, step: int | None = None) -> DataProto:
        """Rows start:end:step (tensors are views)."""
        s = slice(start, end, step)
        batch = None if self.batch is None else self.batch[s]
        return self._derive(batch, {k: v[s] for k, v in self.non_tensor_batch.items()})

    def select_idxs(self, idxs: Sequence[int] | Sequence[bool] | np.ndarray | torch.Tensor) -> DataProto:
        """Rows at integer indices, or where a boolean mask of length B is true."""
        if isinstance(idxs, torch.Tensor):
            index = idxs.detach().cpu()
        else:
            index = torch.as_tensor(np.asarray(idxs))
        if index.dtype == torch.bool:
            if index.shape != (len(self),):
                raise DataProtoError(
                    f"select_idxs: expected a boolean mask of shape [{len(self)}], found {_shape(index)}"
                )
            index = index.nonzero(as_tuple=True)[0]
        elif index.is_floating_point() and index.numel() > 0:
            raise DataProtoError(f"select_idxs: expected integer or boolean indices, found {index.dtype}")
        index = index.long().reshape(-1)
        np_index = index.numpy()
        batch = None
        if self.batch is not None:
            batch = TensorDict(
                {k: v[index.to(v.device)] for k, v in self.batch.items()},
                batch_size=[index.numel()],
                device=self.batch.device,
            )
        return self._derive(batch, {k: v[np_index] for k, v in self.non_tensor_batch.items()})

    # ----------------------------------------------------------------- key selection
    def select(
        self,
        batch_keys: Sequence[str] | None = None,
        non_tensor_batch_keys: Sequence[str] | None = None,
        meta_info_keys: Sequence[str] | None = None,
        deepcopy: bool = False,
    ) -> DataProto:
        """A DataProto with only the named keys (None keeps all keys of that kind).

        As in verl: a missing batch key is an error, missing non-tensor and meta keys are skipped, and
        ``deepcopy`` copies the non-tensor arrays and meta_info (tensors stay shared).
        """
        if self.batch is None:
            if batch_keys:
                raise DataProtoError(f"select: batch keys {list(batch_keys)} not found; this DataProto has no tensors")
            batch = None
        elif batch_keys is None:
            batch = self.batch.copy()
        else:
            missing = [k for k in batch_keys if k not in self.batch.keys()]
            if missing:
                raise DataProtoError(
                    f"select: batch keys {missing} not found; available: {sorted(self.batch.keys())}"
                )
            batch = self.batch.select(*batch_keys)
        if non_tensor_batch_keys is None:
            non_tensor = dict(self.non_tensor_batch)
        else:
            non_tensor = {k: v for k, v in self.non_tensor_batch.items() if k in non_tensor_batch_keys}
        if meta_info_keys is None:
            meta = dict(self.meta_info)
        else:
            meta = {k: v for k, v in self.meta_info.items() if k in meta_info_keys}
        if deepcopy:
            non_tensor = copy.deepcopy(non_tensor)
            meta = copy.deepcopy(meta)
        if batch is None and not non_tensor and len(self):
            # Keep the batch size when every key was dropped (verl would lose it).
            batch = TensorDict({}, batch_size=[len(self)])
        return self._derive(batch, non_tensor, meta)

    def pop(
        self,
        batch_keys: Sequence[str] | None = None,
        non_tensor_batch_keys: Sequence[str] | None = None,
        meta_info_keys: Sequence[str] | None = None,
    ) -> DataProto:
        """Remove the named keys from self and return them as a new DataProto."""
        batch_keys, non_tensor_batch_keys, meta_info_keys = (
            list(batch_keys or []), list(non_tensor_batch_keys or []), list(meta_info_keys or []))
        available = [] if self.batch is None else list(self.batch.keys())
        for keys, source, kind in ((batch_keys, available, "batch"),
                                   (non_tensor_batch_keys, self.non_tensor_batch, "non_tensor_batch"),
                                   (meta_info_keys, self.meta_info, "meta_info")):
            missing = [k for k in keys if k not in source]
            if missing:
                raise DataProtoError(f"pop: {kind} keys {missing} not found; available: {sorted(source)}")
        tensors = {k: self.batch.pop(k) for k in batch_keys}
        non_tensors = {k: self.non_tensor_batch.pop(k) for k in non_tensor_batch_keys}
        meta = {k: self.meta_info.pop(k) for k in meta_info_keys}
        producers = {k: self.field_producers.pop(k) for k in [*tensors, *non_tensors] if k in self.field_producers}
        popped = type(self).from_dict(tensors=tensors, non_tensors=non_tensors, meta_info=meta)
        popped.field_producers = producers
        return popped

    def rename(self, old_keys: str | list[str] | None = None, new_keys: str | list[str] | None = None) -> DataProto:
        """Rename batch keys in place (one name or a list of names each side); returns self."""

        def as_list(keys, side: str) -> list[str]:
            if keys is None:
                return []
            if isinstance(keys, str):
                return [keys]
            if isinstance(keys, list):
                return keys
            raise TypeError(f"rename: {side} must be a str or a list of str, found {type(keys).__name__}")

        old, new = as_list(old_keys, "old_keys"), as_list(new_keys, "new_keys")
        if len(old) != len(new):
            raise DataProtoError(f"rename: expected as many new_keys as old_keys ({len(old)}), found {len(new)}")
        if old and self.batch is None:
            raise DataProtoError(f"rename: batch keys {old} not found; this DataProto has no tensors")
        missing = [k for k in old if k not in self.batch.keys()] if old else []
        if missing:
            raise DataProtoError(f"rename: batch keys {missing} not found; available: {sorted(self.batch.keys())}")
        for before, after in zip(old, new, strict=True):
            self.batch.rename_key_(before, after)
            if before in self.field_producers:
                self.field_producers[after] = self.field_producers.pop(before)
        return self

    # ----------------------------------------------------------------- combination
    def union(self, other: DataProto) -> DataProto:
        """Add ``other``'s fields to self (in place, returns self); shared keys must be equal."""
        mine_empty = self.batch is None and not self.non_tensor_batch
        theirs_empty = other.batch is None and not other.non_tensor_batch
        if not mine_empty and not theirs_empty and len(self) != len(other):
            raise DataProtoError(f"union: expected batch size {len(self)}, found {len(other)} in the other DataProto")
        if other.batch is not None:
            if self.batch is None:
                self.batch = TensorDict({}, batch_size=[len(other)])
            self.batch = union_tensor_dict(self.batch, other.batch)
        self.non_tensor_batch = union_numpy_dict(self.non_tensor_batch, other.non_tensor_batch)
        self.meta_info = _union_meta(self.meta_info, other.meta_info)
        for key, producer in other.field_producers.items():
            self.field_producers.setdefault(key, producer)
        if strict_data_check_enabled():
            self.check_consistency(producer="DataProto.union")
        return self

    @staticmethod
    def concat(data: Sequence[DataProto]) -> DataProto:
        """Concatenate along the batch dim; all parts need the same keys.

        meta_info is merged as verl merges the outputs of several workers: every part's
        ``meta_info["metrics"]`` (a dict, or a list of dicts) is collected into one dict of lists, in
        part order; any other key must have the same value in every part that has it.
        """
        if not data:
            raise DataProtoError("concat: expected at least one DataProto, found an empty list")
        first = data[0]

        def keys_of(part: DataProto) -> list[str]:
            return sorted(part.batch.keys()) + sorted(part.non_tensor_batch) if part.batch is not None \
                else sorted(part.non_tensor_batch)

        for i, part in enumerate(data[1:], start=1):
            if (part.batch is None) != (first.batch is None) or keys_of(part) != keys_of(first):
                raise DataProtoError(f"concat: part {i} has keys {keys_of(part)}, expected {keys_of(first)}")
        batch = None if first.batch is None else torch.cat([p.batch for p in data], dim=0)
        non_tensor = {k: np.concatenate([p.non_tensor_batch[k] for p in data], axis=0) for k in first.non_tensor_batch}

        meta: dict[str, Any] = {}
        metrics: dict[str, list] = {}
        for part in data:
            for key, value in part.meta_info.items():
                if key == "metrics":
                    for entry in value if isinstance(value, list) else ([] if value is None else [value]):
                        if not isinstance(entry, dict):
                            raise DataProtoError(f"concat: meta_info['metrics']: expected a dict or a list of "
                                                 f"dicts, found an entry of type {type(entry).__name__}")
                        for name, number in entry.items():
                            metrics.setdefault(name, []).append(number)
                elif key in meta and not _deep_equal(meta[key], value):
                    raise DataProtoError(
                        f"concat: Conflicting values for meta_info key '{key}': {meta[key]!r} vs {value!r}"
                    )
                else:
                    meta[key] = value
        if metrics:
            meta["metrics"] = metrics
        producers: dict[str, str] = {}
        for part in data:
            for key, producer in part.field_producers.items():
                producers.setdefault(key, producer)
        return type(first)(batch, non_tensor, meta, producers)

    def split(self, split_size: int) -> list[DataProto]:
        """Consecutive pieces of ``split_size`` rows (the last may be smaller)."""
        if split_size <= 0:
            raise DataProtoError(f"split: expected a positive split_size, found {split_size}")
        return [self.slice(start, start + split_size) for start in range(0, len(self), split_size)]

    def is_padding_enabled(self) -> bool:
        """True when this DataProto was built with ``auto_padding`` or ``DataProtoConfig.auto_padding`` is on."""
        return bool(self.meta_info.get(DataProtoConfig.auto_padding_key, False)) or DataProtoConfig.auto_padding

    def padding(self, padding_size: int, padding_candidate: str = "") -> None:
        """Append ``padding_size`` copies of the first row (``"first"``) or of the last row (anything else),
        in place."""
        if padding_size == 0:
            return
        if padding_size < 0 or len(self) == 0:
            raise DataProtoError(
                f"padding: expected padding_size >= 0 and a non-empty DataProto, found padding_size={padding_size} "
                f"and batch size {len(self)}"
            )
        row = self.select_idxs([0 if padding_candidate == "first" else len(self) - 1])
        padded = DataProto.concat([self, row.repeat(padding_size)])
        self.batch, self.non_tensor_batch = padded.batch, padded.non_tensor_batch

    def chunk(self, chunks: int) -> list[DataProto]:
        """``chunks`` consecutive pieces, each with this meta_info.

        The batch size must divide by ``chunks`` unless padding is enabled (``is_padding_enabled``);
        then the pieces are sized as torch.chunk sizes them (ceil(B / chunks) rows, the last smaller),
        or as np.array_split does when there are no tensors, which is verl's behaviour.
        """
        size = len(self)
        if chunks <= 0:
            raise DataProtoError(f"chunk: expected a positive number of chunks, found {chunks}")
        if size % chunks == 0:
            sizes = [size // chunks] * chunks
        elif not self.is_padding_enabled():
            raise DataProtoError(
                f"chunk: expected batch size {size} to be divisible by chunks={chunks}; "
                f"use pad_dataproto_to_divisor first (or enable auto_padding)"
            )
        elif self.batch is None:
            sizes = [len(part) for part in np.array_split(np.arange(size), chunks)]
        else:
            step = -(-size // chunks)
            sizes = [min(step, size - start) for start in range(0, size, step)]
            if len(sizes) != chunks:
                raise DataProtoError(
                    f"chunk: batch size {size} splits into only {len(sizes)} torch.chunk pieces of "
                    f"{step} rows, expected {chunks}; pad to a multiple of {chunks} first"
                )
        bounds = np.cumsum([0, *sizes]).tolist()
        return [self.slice(bounds[i], bounds[i + 1]) for i in range(chunks)]

    def repeat(self, repeat_times: int = 2, interleave: bool = True) -> DataProto:
        """Repeat every row; interleave gives [a, a, b, b], otherwise [a, b, a, b]."""
        if repeat_times < 1:
            raise DataProtoError(f"repeat: expected repeat_times >= 1, found {repeat_times}")
        batch = None
        if self.batch is not None:
            if interleave:
                tensors = {k: v.repeat_interleave(repeat_times, dim=0) for k, v in self.batch.items()}
            else:
                tensors = {k: v.repeat(repeat_times, *([1] * (v.dim() - 1))) for k, v in self.batch.items()}
            batch = TensorDict(tensors, batch_size=[len(self) * repeat_times], device=self.batch.device)
        if interleave:
            non_tensor = {k: np.repeat(v, repeat_times, axis=0) for k, v in self.non_tensor_batch.items()}
        else:
            non_tensor = {k: np.tile(v, (repeat_times,) + (1,) * (v.ndim - 1))
                          for k, v in self.non_tensor_batch.items()}
        return self._derive(batch, non_tensor)

    def sample_level_repeat(self, repeat_times: Sequence[int] | np.ndarray | torch.Tensor) -> DataProto:
        """Repeat row i ``repeat_times[i]`` times (interleaved): [a, a, a, b, c, c] for [3, 1, 2]."""
        if not isinstance(repeat_times, (list, tuple, np.ndarray, torch.Tensor)):
            raise DataProtoError(
                f"sample_level_repeat: expected a list, tuple, numpy array or tensor of counts, "
                f"found {type(repeat_times).__name__}"
            )
        counts = torch.as_tensor(np.asarray(repeat_times) if not isinstance(repeat_times, torch.Tensor)
                                 else repeat_times.detach().cpu()).long()
        if counts.shape != (len(self),) or bool((counts < 0).any()):
            raise DataProtoError(
                f"sample_level_repeat: expected {len(self)} non-negative counts (one per row), "
                f"found {counts.tolist()}"
            )
        total = int(counts.sum())
        batch = None
        if self.batch is not None:
            batch = TensorDict(
                {k: v.repeat_interleave(counts.to(v.device), dim=0) for k, v in self.batch.items()},
                batch_size=[total],
                device=self.batch.device,
            )
        np_counts = counts.numpy()
        return self._derive(batch, {k: np.repeat(v, np_counts, axis=0) for k, v in self.non_tensor_batch.items()})

    def unfold_column_chunks(self, n_split: int, split_keys: list[str] | None = None) -> DataProto:
        """Cut dim 1 of each key in ``split_keys`` into ``n_split`` pieces that become rows; every other key
        is repeated ``n_split`` times per row so the rows stay aligned (batch size B * n_split)."""
        split_keys = list(split_keys or [])
        if n_split < 1:
            raise DataProtoError(f"unfold_column_chunks: expected n_split >= 1, found {n_split}")

        def unfold(key: str, value):
            if key not in split_keys:
                return None
            if value.ndim < 2 or value.shape[1] % n_split != 0:
                raise DataProtoError(
                    f"unfold_column_chunks: field '{key}': expected dim 1 divisible by n_split={n_split}, "
                    f"found shape {_shape(value)}"
                )
            return value.reshape(value.shape[0] * n_split, value.shape[1] // n_split, *value.shape[2:])

        batch = None
        if self.batch is not None:
            tensors = {}
            for key, value in self.batch.items():
                out = unfold(key, value)
                tensors[key] = value.repeat_interleave(n_split, dim=0) if out is None else out
            batch = TensorDict(tensors, batch_size=[len(self) * n_split], device=self.batch.device)
        non_tensor = {}
        for key, value in self.non_tensor_batch.items():
            out = unfold(key, value)
            non_tensor[key] = np.repeat(value, n_split, axis=0) if out is None else out
        return self._derive(batch, non_tensor)

    def reorder(self, indices: torch.Tensor) -> None:
        """Permute rows in place: row i becomes old row indices[i]."""
        reordered = self.select_idxs(indices)
        if len(reordered) != len(self):
            raise DataProtoError(f"reorder: expected {len(self)} indices, found {len(reordered)}")
        self.batch = reordered.batch
        self.non_tensor_batch = reordered.non_tensor_batch

    def to(self, device: str | torch.device) -> DataProto:
        """Move every tensor to ``device`` (in place, returns self)."""
        if self.batch is not None:
            self.batch = self.batch.to(device)
        return self

    def make_iterator(self, mini_batch_size: int, epochs: int, seed: int | None = None,
                      dataloader_kwargs: dict | None = None) -> Iterator[DataProto]:
        """Mini-batches of ``mini_batch_size`` rows for ``epochs`` passes, from a torch DataLoader over the
        rows (``dataloader_kwargs``, e.g. ``{"shuffle": True}``, go to it; ``seed`` seeds its generator).
        Each mini-batch carries this meta_info."""
        if mini_batch_size <= 0 or len(self) % mini_batch_size != 0:
            raise DataProtoError(
                f"make_iterator: expected batch size {len(self)} to be divisible by mini_batch_size={mini_batch_size}"
            )
        if dataloader_kwargs is not None and not isinstance(dataloader_kwargs, dict):
            raise DataProtoError(
                f"make_iterator: expected dataloader_kwargs to be a dict, found {type(dataloader_kwargs).__name__}"
            )
        generator = None
        if seed is not None:
            generator = torch.Generator()
            generator.manual_seed(seed)
        loader = torch.utils.data.DataLoader(
            dataset=self, batch_size=mini_batch_size, collate_fn=collate_fn, generator=generator,
            **(dataloader_kwargs or {}),
        )

        def mini_batches():
            for _ in range(epochs):
                for mini_batch in loader:
                    mini_batch.meta_info = self.meta_info
                    yield mini_batch

        return iter(mini_batches())

    # ----------------------------------------------------------------- inspection
    def print_size(self, prefix: str = "") -> None:
        """Print the tensor and numpy bytes of this DataProto in GB."""
        tensor_bytes = 0 if self.batch is None else sum(t.element_size() * t.numel() for t in self.batch.values())
        numpy_bytes = sum(a.nbytes for a in self.non_tensor_batch.values())
        message = (f"Size of tensordict: {tensor_bytes / 1024**3} GB, "
                   f"size of non_tensor_batch: {numpy_bytes / 1024**3} GB")
        print(f"{prefix}, {message}" if prefix else message)

    def get_data_info(self) -> str:
        """Multi-line description: each tensor's shape, dtype and device, each array's shape and dtype, and
        the (nested) types of the meta_info values."""
        lines = ["batch"]
        for key, value in ([] if self.batch is None else self.batch.items()):
            if isinstance(value, torch.Tensor):
                lines.append(f"  {key}: {tuple(value.shape)} ({value.dtype}) {value.device}")
            else:
                lines.append(f"  {key}: {type(value).__name__}")
        lines.append("non_tensor_batch")
        for key, array in self.non_tensor_batch.items():
            lines.append(f"  {key}: ndarray{array.shape} ({array.dtype})")
        lines.append("meta_info")
        for key, value in self.meta_info.items():
            lines.append(f"  {key}: {_type_info(value)}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        items = [] if self.batch is None else self.batch.items()
        tensors = ", ".join(f"{k}: {_shape(v)} {str(v.dtype).replace('torch.', '')}" for k, v in items)
        return (
            f"DataProto(batch_size={len(self)}, batch={{{tensors}}}, "
            f"non_tensor_batch={sorted(self.non_tensor_batch)}, meta_info={sorted(self.meta_info)})"
        )

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

        if self.batch is not None:
            if len(self.batch.batch_size) != 1:
                fail("<batch>", f"expected exactly one batch dim, found batch_size {list(self.batch.batch_size)}")
            for key, value in self.batch.items():
                if not isinstance(value, torch.Tensor):
                    fail(key, f"expected a torch.Tensor, found {type(value).__name__}")
                if value.dim() == 0 or value.shape[0] != size:
                    fail(key, f"expected batch size {size} in dim 0, found shape {_shape(value)}")
        for key, value in self.non_tensor_batch.items():
            if not isinstance(value, np.ndarray):
                fail(key, f"expected a numpy array, found {type(value).__name__}")
            if value.ndim == 0 or value.shape[0] != size:
                fail(key, f"expected batch size {size} in dim 0, found shape {_shape(value)}")
        if self.batch is None:
            return

        self._check_length_family(RESPONSE_LENGTH_FIELDS, "response length", fail)
        self._check_length_family(SEQUENCE_LENGTH_FIELDS, "sequence length", fail)
        keys = self.batch.keys()
        if "position_ids" in keys and "input_ids" in keys:
            # position_ids may carry an extra rope-section dim ([B, 3, L]); the last dim must match.
            pos, ids = self.batch["position_ids"], self.batch["input_ids"]
            if pos.shape[-1] != ids.shape[-1]:
                fail("position_ids", f"expected last dim {ids.shape[-1]} (from 'input_ids'), found shape {_shape(pos)}")
        if all(k in keys for k in ("input_ids", "prompts", "responses")):
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
            for key in [*self.batch.keys(), *self.non_tensor_batch]:
                self.field_producers.setdefault(key, producer)

    def _check_length_family(self, keys: Sequence[str], what: str, fail) -> None:
        present = [k for k in keys if k in self.batch.keys()]
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

    # ----------------------------------------------------------------- transport between ranks
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
        tensors = None
        if self.batch is not None:
            tensors = {}
            for key, value in self.batch.items():
                if not isinstance(value, torch.Tensor):
                    raise DataProtoError(f"to_bytes: batch field '{key}': expected a torch.Tensor, "
                                         f"found {type(value).__name__}")
                tensors[key] = _compact(value)
        payload = {
            "format": _WIRE_FORMAT,
            "batch_size": len(self),
            "batch": tensors,
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
        batch = None
        if payload["batch"] is not None:
            batch = TensorDict(payload["batch"], batch_size=[payload["batch_size"]])
        return cls(batch, non_tensor, payload["meta_info"], payload["field_producers"])

    # ----------------------------------------------------------------- pickling and files (verl's format)
    def __getstate__(self):
        """verl's pickled state (batch bytes or numpy encoding, non_tensor_batch, meta_info), so files
        written by ``save_to_disk`` here and in verl load in either."""
        batch = None
        if self.batch is not None:
            batch = TensorDict({k: _compact(v, to_cpu=False) for k, v in self.batch.items()},
                               batch_size=self.batch.batch_size, device=self.batch.device)
        if os.environ.get(SERIALIZATION_METHOD_ENV) == "numpy":
            return (None if batch is None else serialize_tensordict(batch)), self.non_tensor_batch, self.meta_info
        buffer = io.BytesIO()
        torch.save(batch, buffer)
        return buffer.getvalue(), self.non_tensor_batch, self.meta_info

    def __setstate__(self, state) -> None:
        encoded_batch, non_tensor_batch, meta_info = state
        if isinstance(encoded_batch, (bytes, bytearray)):
            # Whether CUDA tensors can be restored here at all (torch's capability, not the rank's device choice of
            # verl.utils.device, a module of the layer above this one): else every tensor lands on the CPU.
            location = None if torch.cuda.is_available() else "cpu"
            # The batch is torch.save of a TensorDict: tensors and TensorDict's own state, which torch's
            # weights-only loader reads without running any code the bytes name.
            self.batch = torch.load(io.BytesIO(encoded_batch), map_location=location, weights_only=True)
        elif encoded_batch is None:
            self.batch = None
        else:
            self.batch = deserialize_tensordict(encoded_batch)
        self.non_tensor_batch = non_tensor_batch
        self.meta_info = meta_info
        self.field_producers = {}

    def save_to_disk(self, filepath: str | os.PathLike) -> None:
        """Pickle this DataProto to ``filepath`` (verl's file format)."""
        with open(filepath, "wb") as f:
            pickle.dump(self, f)

    @staticmethod
    def load_from_disk(filepath: str | os.PathLike) -> DataProto:
        """Load a file written by ``save_to_disk`` (here or by verl). The file is a pickle, so it is read with an
        unpickler that constructs only what a DataProto holds (numpy arrays, builtin containers, tensors through
        ``torch.load(weights_only=True)``): a file naming any other callable is refused, not run."""
        with open(filepath, "rb") as f:
            data = _DataProtoUnpickler(f, filepath).load()
        if not isinstance(data, DataProto):
            raise DataProtoFileError(f"load_from_disk: expected a pickled DataProto in {filepath}, "
                                 f"found {type(data).__name__}")
        return data


class _DataProtoUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that resolves only the globals a pickled DataProto names (verl's format, and ours)."""

    ALLOWED = frozenset({
        ("verl.protocol", "DataProto"),
        ("numpy", "ndarray"), ("numpy", "dtype"),
        ("numpy._core.multiarray", "_reconstruct"), ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "scalar"), ("numpy.core.multiarray", "scalar"),
        ("torch", "Size"), ("collections", "OrderedDict"), ("codecs", "encode"),
        ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "complex"), ("builtins", "slice"),
        ("builtins", "bytearray"),
    })

    def __init__(self, file, filepath):
        super().__init__(file)
        self.filepath = filepath

    def find_class(self, module: str, name: str):
        if (module, name) not in self.ALLOWED:
            raise DataProtoFileError(f"load_from_disk: {self.filepath}: expected a DataProto file (numpy arrays, "
                                     f"tensors, builtin values), found a reference to {module}.{name}, which is not "
                                     f"loaded")
        return super().find_class(module, name)


def _type_info(value: Any) -> str:
    """A short nested type description for ``get_data_info``: list[int|str], dict[str: float], ..."""
    if isinstance(value, list):
        kinds = sorted({_type_info(v) for v in value[:3]})
        return f"list[{'|'.join(kinds) if kinds else '...'}]"
    if isinstance(value, tuple):
        return f"tuple({', '.join(_type_info(v) for v in value)})"
    if isinstance(value, dict):
        if not value:
            return "dict"
        key, item = next(iter(value.items()))
        return f"dict[{_type_info(key)}: {_type_info(item)}]"
    if isinstance(value, np.ndarray):
        return f"ndarray{value.shape} ({value.dtype})"
    return type(value).__name__


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


# ----------------------------------------------------------------------------- module helpers (verl's)
def pad_dataproto_to_divisor(data: DataProto, size_divisor: int) -> tuple[DataProto, int]:
    """Pad ``data`` with copies of its first rows so len is divisible by ``size_divisor``.

    Returns (padded data, pad_size); undo with :func:`unpad_dataproto`.
    """
    if not isinstance(data, DataProto):
        raise DataProtoError(f"pad_dataproto_to_divisor: expected a DataProto, found {type(data).__name__}")
    if size_divisor <= 0:
        raise DataProtoError(f"pad_dataproto_to_divisor: expected a positive size_divisor, found {size_divisor}")
    if len(data) % size_divisor == 0:
        if len(data) == 0:
            logger.warning("pad_dataproto_to_divisor: padding a DataProto with no rows; nothing changed")
        return data, 0
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


def fold_batch_dim(data: DataProto, new_batch_size: int) -> DataProto:
    """[B, ...] -> [new_batch_size, B / new_batch_size, ...] for every tensor and array: consecutive
    rows become one row, so reorder/chunk move them together."""
    size = len(data)
    if new_batch_size <= 0 or size % new_batch_size != 0:
        raise DataProtoError(f"fold_batch_dim: expected batch size {size} to be divisible by {new_batch_size}")
    batch = None
    if data.batch is not None:
        batch = TensorDict({k: v.reshape(new_batch_size, -1, *v.shape[1:]) for k, v in data.batch.items()},
                           batch_size=[new_batch_size], device=data.batch.device)
    non_tensor = {k: np.reshape(v, (new_batch_size, -1, *v.shape[1:])) for k, v in data.non_tensor_batch.items()}
    return type(data)(batch=batch, non_tensor_batch=non_tensor, meta_info=data.meta_info)


def unfold_batch_dim(data: DataProto, batch_dims: int = 2) -> DataProto:
    """The inverse of :func:`fold_batch_dim`: merge the first ``batch_dims`` dims into the batch dim."""
    if batch_dims < 1:
        raise DataProtoError(f"unfold_batch_dim: expected batch_dims >= 1, found {batch_dims}")

    def merged(key: str, value) -> Any:
        if value.ndim < batch_dims:
            raise DataProtoError(f"unfold_batch_dim: field '{key}': expected at least {batch_dims} dims, "
                                 f"found shape {_shape(value)}")
        return value.reshape(-1, *value.shape[batch_dims:])

    tensors = {} if data.batch is None else {k: merged(k, v) for k, v in data.batch.items()}
    sizes = {v.shape[0] for v in tensors.values()}
    batch = None
    if data.batch is not None:
        batch = TensorDict(tensors, batch_size=[sizes.pop() if sizes else 0], device=data.batch.device)
    non_tensor = {k: merged(k, v) for k, v in data.non_tensor_batch.items()}
    return type(data)(batch=batch, non_tensor_batch=non_tensor, meta_info=data.meta_info)


def all_gather_data_proto(data: DataProto, process_group=None) -> None:
    """All-gather ``data`` over ``process_group`` in place (rank order), like torch.distributed.all_gather:
    every rank must hold the same keys and the same batch size."""
    import torch.distributed as dist

    world = dist.get_world_size(group=process_group)
    if data.batch is not None:
        gathered = {}
        for key, value in data.batch.items():
            value = value.contiguous()
            parts = [torch.empty_like(value) for _ in range(world)]
            dist.all_gather(parts, value, group=process_group)
            gathered[key] = torch.cat(parts, dim=0)
        data.batch = TensorDict(gathered, batch_size=[len(data) * world], device=data.batch.device)
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, data.non_tensor_batch, group=process_group)
    data.non_tensor_batch = {k: np.concatenate([part[k] for part in everyone]) for k in data.non_tensor_batch}
