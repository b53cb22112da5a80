"""SFT pairs from verl-format parquet: prompt -> response, tokenised into the RL batch layout.

verl's SFT keys (``data.prompt_key`` / ``data.response_key``, optionally nested with ``*_dict_keys``);
chat-message prompts are rendered as the rollout renders them. The loss sees the response tokens and
the eos after them (the prompt is masked). ``data.label_noise`` relabels a seeded fraction of the
training targets (:mod:`verl.utils.dataset.arithmetic` holds the two noise modes). Every problem
raises one :class:`DatasetError` naming the config key.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from verl.utils.dataset.arithmetic import add_drop_carry_noise, add_label_noise
from verl.utils.dataset.errors import DatasetError
from verl.utils.dataset.rl_dataset import render_prompt


@dataclasses.dataclass
class SFTData:
    """Tokenised pairs in the RL batch layout: left-padded prompt [N, P] then response + eos [N, R].

    ``input_ids``/``attention_mask`` [N, P+R]; ``responses`` [N, R]; ``response_mask`` [N, R] is 1
    on the response tokens and the eos (the tokens the loss sees). ``noisy`` counts relabelled rows.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    responses: torch.Tensor
    response_mask: torch.Tensor
    noisy: int = 0

    def __len__(self) -> int:
        return self.input_ids.size(0)

    def batch(self, index: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"input_ids": self.input_ids[index], "attention_mask": self.attention_mask[index],
                "responses": self.responses[index], "response_mask": self.response_mask[index]}


def _field(row: dict[str, Any], key: str, nested: list[str] | None, what: str) -> Any:
    value = row[key]
    for name in nested or []:
        if not isinstance(value, dict) or name not in value:
            raise DatasetError(f"data.{what}_dict_keys: expected key {name!r} inside column {key!r}, "
                               f"found {sorted(value) if isinstance(value, dict) else type(value).__name__}")
        value = value[name]
    return value


def _as_text(value: Any, tokenizer: Any, where: str, what: str) -> str:
    """A string, or chat messages rendered as the rollout renders them (RLHFDataset.prompt_text); a
    response may also be a number (a ground-truth answer)."""
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)) and value and all(
            isinstance(m, dict) and isinstance(m.get("content"), str) for m in value):
        return render_prompt(value, tokenizer)
    if what == "response" and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    found = "null" if value is None else f"{type(value).__name__} {str(value)[:40]!r}"
    raise DatasetError(f"{where}: {what}: expected a string or a list of {{role, content}} messages, found {found}")


def read_pairs(files: Sequence[str], data_cfg: dict[str, Any], tokenizer: Any) -> list[tuple]:
    """(prompt text, response text) for every row of ``files``."""
    import pyarrow.parquet as pq

    pairs = []
    for path in files:
        try:
            rows = pq.read_table(path).to_pylist()
        except (OSError, ValueError) as err:
            first = (str(err).strip().splitlines() or [type(err).__name__])[0]
            raise DatasetError(f"{path}: expected a parquet file, found unreadable data ({first})") from None
        for key, what in ((data_cfg["prompt_key"], "prompt"), (data_cfg["response_key"], "response")):
            if rows and key not in rows[0]:
                raise DatasetError(f"data.{what}_key: expected a column of {path}, found {key!r} missing "
                                   f"(columns: {sorted(rows[0])})")
        for index, row in enumerate(rows):
            prompt = _field(row, data_cfg["prompt_key"], data_cfg["prompt_dict_keys"], "prompt")
            response = _field(row, data_cfg["response_key"], data_cfg["response_dict_keys"], "response")
            where = f"{path} row {index}"
            pairs.append((_as_text(prompt, tokenizer, where, "prompt"),
                          _as_text(response, tokenizer, where, "response")))
    if not pairs:
        raise DatasetError(f"data: expected at least one row in {list(files)}, found none")
    return pairs


def encode_pairs(pairs: list[tuple], tokenizer: Any, max_length: int) -> list[tuple]:
    """(prompt ids, response ids + eos) per pair; every pair must fit in ``max_length`` tokens."""
    encoded = [(tokenizer(p, add_special_tokens=False)["input_ids"],
                tokenizer(r, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]) for p, r in pairs]
    longest = max(len(p) + len(r) for p, r in encoded)
    if longest > max_length:
        raise DatasetError(f"data.max_length: expected every prompt + response + eos to fit, found {longest} tokens "
                           f"> {max_length}")
    return encoded


def pad_pairs(encoded: list[tuple], prompt_width: int, response_width: int, pad_token_id: int) -> SFTData:
    """SFTData: prompts left-padded to ``prompt_width``, responses right-padded to ``response_width``."""
    P, R = prompt_width, response_width
    ids = torch.full((len(encoded), P + R), pad_token_id, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for i, (p, r) in enumerate(encoded):
        ids[i, P - len(p):P] = torch.tensor(p)
        ids[i, P:P + len(r)] = torch.tensor(r)
        mask[i, P - len(p):P + len(r)] = 1
    return SFTData(ids, mask, ids[:, P:].clone(), mask[:, P:].clone())


def prepare_data(cfg: dict[str, Any], vocab_size: int) -> tuple:
    """(train SFTData, val SFTData or None, tokenizer): every data problem raises DatasetError here.

    ``cfg`` is a validated SFT config; ``vocab_size`` is the model's (the tokenizer must fit in it).
    Train and val share one (prompt, response) width: the longest of either, over both splits.
    """
    from transformers import AutoTokenizer

    data = cfg["data"]
    tokenizer = AutoTokenizer.from_pretrained(cfg["model"]["tokenizer_path"])
    if tokenizer.eos_token_id is None or tokenizer.pad_token_id is None:
        raise DatasetError(f"model.tokenizer_path: expected a tokenizer with eos and pad tokens, found eos="
                           f"{tokenizer.eos_token_id} pad={tokenizer.pad_token_id}")
    if len(tokenizer) > vocab_size:
        raise DatasetError(f"model.path: expected vocab_size >= the tokenizer's {len(tokenizer)} tokens, "
                           f"found {vocab_size}")
    train_pairs = read_pairs(data["train_files"], data, tokenizer)
    if len(train_pairs) < data["train_batch_size"]:
        raise DatasetError(f"data.train_batch_size: expected at most the {len(train_pairs)} training rows, "
                           f"found {data['train_batch_size']}")
    noise = add_drop_carry_noise if data["label_noise_mode"] == "drop_carry" else add_label_noise
    train_pairs, noisy = noise(train_pairs, data["label_noise"], cfg["trainer"]["seed"])
    train = encode_pairs(train_pairs, tokenizer, data["max_length"])
    val = encode_pairs(read_pairs(data["val_files"], data, tokenizer), tokenizer, data["max_length"]) \
        if data["val_files"] else []
    widths = (max(len(p) for p, _ in train + val), max(len(r) for _, r in train + val))
    train_data = pad_pairs(train, *widths, tokenizer.pad_token_id)
    train_data.noisy = noisy
    return train_data, pad_pairs(val, *widths, tokenizer.pad_token_id) if val else None, tokenizer

