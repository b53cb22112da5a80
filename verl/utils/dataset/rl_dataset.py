"""Parquet prompt dataset in verl's format, a seeded resumable sampler, and the batch collate_fn.

Columns: ``data_source``, ``prompt`` (list of chat messages ``{"role", "content"}``), ``ability``,
``reward_model`` (with ``ground_truth``), ``extra_info``. Each item holds left-padded
``input_ids``/``attention_mask``/``position_ids`` [max_prompt_length] and the non-tensor fields.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import torch
from torch.utils.data import Dataset, Sampler

from verl.utils.dataset.errors import DatasetError
from verl.utils.logging_utils import get_logger

logger = get_logger(__name__)

REQUIRED_COLUMNS = ("data_source", "reward_model")
TRUNCATION_MODES = ("error", "left", "right", "middle")
# No tokenizer we know packs more characters than this into one token: a prompt longer than
# max_prompt_length * MAX_CHARS_PER_TOKEN characters is over-long without tokenizing it, so a huge
# row costs nothing (tokenizing one 64 MiB prompt took a rank to 13 GB).
MAX_CHARS_PER_TOKEN = 64


def row_problem(row: dict, prompt_key: str, need_ground_truth: bool) -> str | None:
    """What makes ``row`` unusable as a verl RL prompt row (types, nulls), or None."""
    prompt = row.get(prompt_key)
    if prompt is None:
        return f"{prompt_key}: expected a string or a list of chat messages, found null"
    if isinstance(prompt, str):
        pass
    elif isinstance(prompt, (list, tuple)) and prompt and all(
            isinstance(m, dict) and isinstance(m.get("content"), str) for m in prompt):
        pass
    else:
        found = "an empty list" if isinstance(prompt, (list, tuple)) and not prompt else \
            f"{type(prompt).__name__} {str(prompt)[:40]!r}"
        return f"{prompt_key}: expected a string or a list of {{role, content}} messages, found {found}"
    if not isinstance(row.get("data_source"), str):
        return f"data_source: expected a string naming the reward function, found {row.get('data_source')!r}"
    reward = row.get("reward_model")
    if not isinstance(reward, dict):
        return f"reward_model: expected a mapping with ground_truth, found {type(reward).__name__}"
    if need_ground_truth and reward.get("ground_truth") is None:
        return "reward_model.ground_truth: expected the answer a rule-based reward compares with, found null"
    return None


def prompt_chars(row: dict, prompt_key: str) -> int:
    prompt = row[prompt_key]
    return len(prompt) if isinstance(prompt, str) else sum(len(m["content"]) for m in prompt)


def _cfg(config: Any, key: str, default: Any) -> Any:
    if config is None:
        return default
    if isinstance(config, dict) or hasattr(config, "get"):
        return config.get(key, default)
    return getattr(config, key, default)


def compute_position_id_with_mask(mask: torch.Tensor) -> torch.Tensor:
    """Positions counting only attended tokens (left padding gets 0): [..., L] -> [..., L]."""
    return torch.clamp(torch.cumsum(mask, dim=-1) - 1, min=0)


def render_prompt(messages, tokenizer) -> str:
    """A prompt string, or chat messages rendered with the tokenizer's chat template (or their
    contents joined when it has none): the one place prompts become text, for RL and SFT alike."""
    if isinstance(messages, str):
        return messages
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
    return "".join(message["content"] for message in messages)


def encode_prompt(text: str, tokenizer, templated: bool) -> list[int]:
    """Token ids of a prompt as the model reads it. A chat template writes the special tokens it wants (a BOS among
    them), so none are added to ``templated`` text; plain text gets the tokenizer's own, as ``tokenizer(text)`` and
    transformers' pipelines give it: a base model's BOS (Gemma's; SmolLM2's and Qwen's tokenizers add none)."""
    return list(tokenizer(text, add_special_tokens=not templated)["input_ids"])


def is_templated(messages, tokenizer) -> bool:
    """Whether :func:`render_prompt` renders ``messages`` through the tokenizer's chat template."""
    return not isinstance(messages, str) and bool(getattr(tokenizer, "chat_template", None))


class RLHFDataset(Dataset):
    """Prompts from one or more parquet files, tokenised and left-padded to ``max_prompt_length``.

    config keys (verl's ``data.*``): ``prompt_key`` ("prompt"), ``max_prompt_length`` (512),
    ``truncation`` ("error" | "left" keeps the last tokens | "right" keeps the first tokens),
    ``filter_overlong_prompts`` (False; drops prompts longer than max_prompt_length at load and
    reports the count in ``num_filtered``).
    ``max_samples`` (verl's ``data.train_max_samples`` / ``data.val_max_samples``; -1 or 0 = every row):
    at most that many rows, chosen before the over-long filter as verl's RLHFDataset chooses them: with
    ``shuffle`` (data.shuffle: true in the trainer's defaults) a random subset seeded by ``seed`` (data.seed),
    else (or without a config) the first rows.
    The prompt text is the tokenizer's chat template applied to the messages (with the generation
    prompt) when the tokenizer has one, else the message contents concatenated.
    """

    def __init__(self, data_files: str | Sequence[str], tokenizer: Any, config: Any = None, max_samples: int = -1):
        self.tokenizer = tokenizer
        self.prompt_key = _cfg(config, "prompt_key", "prompt")
        self.max_prompt_length = int(_cfg(config, "max_prompt_length", 512))
        self.truncation = _cfg(config, "truncation", "error")
        self.filter_overlong_prompts = bool(_cfg(config, "filter_overlong_prompts", False))
        if self.truncation not in TRUNCATION_MODES:
            raise DatasetError(f"data.truncation: expected one of {list(TRUNCATION_MODES)}, found {self.truncation!r}")
        if self.max_prompt_length < 1:
            raise DatasetError(f"data.max_prompt_length: expected >= 1, found {self.max_prompt_length}")
        if tokenizer.pad_token_id is None:
            raise DatasetError("RLHFDataset: expected a tokenizer with a pad token, found pad_token_id=None")

        self.data_files = [data_files] if isinstance(data_files, str) else list(data_files)
        if not self.data_files:
            raise DatasetError("data files: expected at least one parquet file, found an empty list")
        self.rows: list[dict] = []
        self._file_rows: list[tuple[str, int, int]] = []  # (path, first row, rows) to name a bad row's file
        for path in self.data_files:
            self.rows.extend(self._read(path))
        # The row of the files each kept row came from (to name a bad row's file and row).
        self._origin = list(range(len(self.rows)))

        self.max_samples = int(max_samples)
        self.num_rows_read = len(self.rows)
        if 0 < self.max_samples < len(self.rows):
            self._origin = select_max_samples(len(self.rows), self.max_samples, bool(_cfg(config, "shuffle", False)),
                                              _cfg(config, "seed", None))
            self.rows = [self.rows[i] for i in self._origin]

        self.num_filtered = 0
        if self.filter_overlong_prompts:
            keep = [i for i, row in enumerate(self.rows) if not self._raw_too_long(row)
                    and len(self._prompt_ids(row)) <= self.max_prompt_length]
            self.num_filtered = len(self.rows) - len(keep)
            self.rows = [self.rows[i] for i in keep]
            self._origin = [self._origin[i] for i in keep]
            logger.warning("RLHFDataset: filtered %d prompts longer than max_prompt_length=%d; %d remain",
                           self.num_filtered, self.max_prompt_length, len(self.rows))

    def _read(self, path: str) -> list[dict]:
        try:
            table = pq.read_table(path)
        except (OSError, ValueError) as err:
            first = (str(err).strip().splitlines() or [type(err).__name__])[0]
            raise DatasetError(f"{path}: expected a parquet file, found unreadable data ({first})") from None
        missing = [c for c in (self.prompt_key,) + REQUIRED_COLUMNS if c not in table.column_names]
        if missing:
            raise DatasetError(f"{path}: expected columns {missing} (verl's RL format), found {table.column_names}")
        try:
            rows = table.to_pylist()
        except UnicodeDecodeError as err:  # a binary column that is not UTF-8 text
            raise DatasetError(f"RLHFDataset: {path}: expected UTF-8 text, found undecodable bytes ({err.reason})") \
                from None
        first = sum(count for _, _, count in self._file_rows)
        self._file_rows.append((path, first, len(rows)))
        return rows

    def _raw_too_long(self, row: dict) -> bool:
        return prompt_chars(row, self.prompt_key) > self.max_prompt_length * MAX_CHARS_PER_TOKEN

    def check(self, min_rows: int = 1, need_ground_truth: bool = True) -> None:
        """One pass over every row before training (verl train runs it before any rank starts): types
        and nulls, and with ``truncation=error`` each prompt's length in tokens (a raw-size guard
        first); at least ``min_rows`` rows (one batch) must remain. Raises one-line DatasetErrors."""
        for index, row in enumerate(self.rows):
            where = self._where(index)
            problem = row_problem(row, self.prompt_key, need_ground_truth)
            if problem is not None:
                raise DatasetError(f"{where}: {problem}")
            if self.truncation != "error" or self.filter_overlong_prompts:
                continue
            chars = prompt_chars(row, self.prompt_key)
            if chars > self.max_prompt_length * MAX_CHARS_PER_TOKEN:
                raise DatasetError(f"{where}: expected a prompt of <= data.max_prompt_length={self.max_prompt_length} "
                                   f"tokens, found {chars} characters (set data.filter_overlong_prompts=True or "
                                   f"data.truncation=left|right|middle)")
            tokens = len(self._prompt_ids(row))
            if tokens > self.max_prompt_length:
                raise DatasetError(f"{where}: expected a prompt of <= data.max_prompt_length={self.max_prompt_length} "
                                   f"tokens, found {tokens} (set data.filter_overlong_prompts=True or "
                                   f"data.truncation=left|right|middle)")
        if len(self.rows) < min_rows:
            kept = []
            if 0 < self.max_samples < self.num_rows_read:
                kept.append(f"max_samples={self.max_samples} of {self.num_rows_read} rows")
            if self.num_filtered:
                kept.append(f"filtering {self.num_filtered} over-long prompts")
            after = f" after {' and '.join(kept)}" if kept else ""
            raise DatasetError(f"{', '.join(self.data_files)}: expected at least {min_rows} rows (one batch), "
                               f"found {len(self.rows)}{after}")

    def _where(self, index: int) -> str:
        origin = self._origin[index]
        for path, first, count in self._file_rows:
            if first <= origin < first + count:
                return f"{path} row {origin - first}"
        return f"row {origin}"

    def prompt_text(self, row: dict) -> str:
        return render_prompt(row[self.prompt_key], self.tokenizer)

    def _prompt_ids(self, row: dict) -> list[int]:
        return encode_prompt(self.prompt_text(row), self.tokenizer, is_templated(row[self.prompt_key], self.tokenizer))

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict:
        row = self.rows[index]
        ids = self._prompt_ids(row)
        if len(ids) > self.max_prompt_length:
            if self.truncation == "left":
                ids = ids[-self.max_prompt_length :]
            elif self.truncation == "right":
                ids = ids[: self.max_prompt_length]
            elif self.truncation == "middle":  # verl: keep both ends, drop the middle
                head = self.max_prompt_length // 2
                ids = ids[:head] + ids[len(ids) - (self.max_prompt_length - head):]
            else:
                raise DatasetError(
                    f"RLHFDataset: prompt {index} has {len(ids)} tokens, expected <= max_prompt_length="
                    f"{self.max_prompt_length}; set data.truncation=left|right or data.filter_overlong_prompts=True"
                )
        pad = self.max_prompt_length - len(ids)
        input_ids = torch.tensor([self.tokenizer.pad_token_id] * pad + ids, dtype=torch.long)
        attention_mask = torch.tensor([0] * pad + [1] * len(ids), dtype=torch.long)
        extra_info = row.get("extra_info") or {}
        prompt = row[self.prompt_key]
        item = {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": compute_position_id_with_mask(attention_mask),
            "raw_prompt_ids": ids,
            # verl's agent loops render the chat messages themselves (rollout.multi_turn): the messages as read
            "raw_prompt": [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt),
            "data_source": row["data_source"],
            "ability": row.get("ability"),
            "reward_model": row["reward_model"],
            "extra_info": extra_info,
            "index": extra_info.get("index", index) if isinstance(extra_info, dict) else index,
            "tools_kwargs": (extra_info.get("tools_kwargs") if isinstance(extra_info, dict) else None) or {},
        }
        if "agent_name" in row:  # verl's column (every row of a file has it): which agent loop runs this row
            item["agent_name"] = row["agent_name"]
        return item


def select_max_samples(total: int, max_samples: int, shuffle: bool, seed: int | None) -> list[int]:
    """The rows ``max_samples`` keeps out of ``total`` (0 < max_samples < total), as verl's RLHFDataset picks
    them: with ``shuffle`` ``max_samples`` distinct rows drawn by numpy's default_rng(seed) (in draw order),
    else the first ``max_samples``. Every rank draws the same rows (the trainer's seed is never null)."""
    if not shuffle:
        return list(range(max_samples))
    rng = np.random.default_rng(*(() if seed is None else (int(seed),)))
    return [int(i) for i in rng.choice(total, size=max_samples, replace=False)]


class ResumableSampler(Sampler[int]):
    """Sequential or seeded-shuffled indices whose position survives a checkpoint.

    Epoch e uses the permutation seeded by ``seed + e``; ``state_dict`` records (epoch, position).
    The position counts indices handed out, which a DataLoader with workers takes ahead of the
    batches its loop consumed: checkpoint ``state_at(epoch, consumed samples)`` there (the trainer
    does) to resume at the first batch not yet consumed.
    """

    def __init__(self, num_samples: int, shuffle: bool = True, seed: int = 0):
        self.num_samples = num_samples
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.position = 0

    def epoch_order(self, epoch: int) -> list[int]:
        """The dataset indices in epoch ``epoch``'s order (seeded: the same on every rank and after a resume)."""
        if not self.shuffle:
            return list(range(self.num_samples))
        generator = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(self.num_samples, generator=generator).tolist()

    def __iter__(self):
        order = self.epoch_order(self.epoch)
        while self.position < self.num_samples:
            index = order[self.position]
            self.position += 1
            yield index
        self.epoch += 1
        self.position = 0

    def __len__(self) -> int:
        return self.num_samples

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_samples": self.num_samples,
        }

    def state_at(self, epoch: int, position: int) -> dict:
        """The state of this sampler at ``position`` samples into ``epoch`` (what the loop consumed)."""
        if not 0 <= position <= self.num_samples:
            raise ValueError(f"sampler position: expected 0..{self.num_samples}, found {position}")
        return {**self.state_dict(), "epoch": int(epoch), "position": int(position)}

    def load_state_dict(self, state: dict) -> None:
        for key in ("seed", "shuffle", "num_samples"):
            if state[key] != getattr(self, key):
                raise DatasetError(
                    f"sampler state: expected {key}={getattr(self, key)!r} (this dataset/config), "
                    f"found {state[key]!r} in the checkpoint"
                )
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


def create_rl_sampler(data_config: Any, dataset: Dataset) -> ResumableSampler:
    """Sampler for ``data.shuffle`` (True) and ``data.seed`` (1)."""
    return ResumableSampler(
        len(dataset), shuffle=bool(_cfg(data_config, "shuffle", True)), seed=int(_cfg(data_config, "seed", 1))
    )


def collate_fn(data_list: list[dict]) -> dict:
    """Stack tensors into [B, ...]; gather every other field into a length-B numpy object array."""
    tensors: dict[str, list] = defaultdict(list)
    non_tensors: dict[str, list] = defaultdict(list)
    for item in data_list:
        for key, value in item.items():
            (tensors if isinstance(value, torch.Tensor) else non_tensors)[key].append(value)
    batch: dict[str, Any] = {key: torch.stack(values, dim=0) for key, values in tensors.items()}
    for key, values in non_tensors.items():
        array = np.empty(len(values), dtype=object)
        for i, value in enumerate(values):
            array[i] = value
        batch[key] = array
    return batch
