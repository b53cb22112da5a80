"""Generation dumps (verl's ``trainer.rollout_data_dir`` / ``trainer.validation_data_dir``): each step's or each
validation's generations as ``<dir>/<step>.jsonl`` (input, output, gts, score, step), written by rank 0."""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import torch

from verl.protocol import DataProto


def _jsonable(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    return str(value)


def generation_records(batch: DataProto, scores: torch.Tensor, extra_info: dict[str, list], tokenizer: Any,
                       step: int) -> list[dict[str, Any]]:
    """verl's dumped generation fields per row: input (the prompt's text), output (the response's), gts
    (reward_model.ground_truth), score (the sequence score), step, and the reward function's extra info."""
    prompts, responses = batch.batch["prompts"], batch.batch["responses"]
    mask = batch.batch["attention_mask"].bool()
    prompt_mask, response_mask = mask[:, :prompts.shape[-1]], mask[:, prompts.shape[-1]:]
    rows = len(batch)
    reward_models = batch.non_tensor_batch.get("reward_model", [None] * rows)
    score = scores.sum(-1).tolist()
    extra = {k: v for k, v in (extra_info or {}).items() if len(v) == rows}
    records = []
    for i in range(rows):
        ground_truth = reward_models[i].get("ground_truth") if isinstance(reward_models[i], dict) else None
        records.append({
            "input": tokenizer.decode(prompts[i][prompt_mask[i]].tolist(), skip_special_tokens=True),
            "output": tokenizer.decode(responses[i][response_mask[i]].tolist(), skip_special_tokens=True),
            "gts": ground_truth, "score": score[i], "step": step, **{k: v[i] for k, v in extra.items()}})
    return records


def write_generations(directory: str, step: int, records: list[dict[str, Any]]) -> str:
    """``<directory>/<step>.jsonl``, one record a line (verl's rollout/validation dumps), written atomically."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"{step}.jsonl")
    with open(path + ".tmp", "w", encoding="utf-8") as fh:
        for record in records:
            fh.write(json.dumps(record, ensure_ascii=False, default=_jsonable) + "\n")
    os.replace(path + ".tmp", path)
    return path
