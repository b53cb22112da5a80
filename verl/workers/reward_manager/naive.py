"""NaiveRewardManager: rule-based scores for each response, placed on its last valid token."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from verl.protocol import DataProto, DataProtoError
from verl.utils.logging_utils import get_logger
from verl.utils.reward_score import default_compute_score

logger = get_logger(__name__)


def mark_failed_sample(err: BaseException, row: int, data_source: Any, extra_info: Any) -> None:
    """Record on ``err`` the row (of the rows being scored) and data source whose score raised it, as
    ``err.reward_sample`` and a note in its traceback; its type and message stay the user's."""
    index = extra_info.get("index") if isinstance(extra_info, dict) else None
    err.reward_sample = {"row": row, "data_source": data_source, "index": index}
    err.add_note(f"while scoring {describe_sample(err.reward_sample)}")


def describe_sample(sample: dict[str, Any]) -> str:
    """``row R (data_source='d', extra_info.index=I)`` of a sample recorded by :func:`mark_failed_sample`."""
    where = f"data_source={sample['data_source']!r}"
    if sample.get("index") is not None:
        where += f", extra_info.index={sample['index']!r}"
    return f"row {sample['row']} ({where})"


class NaiveRewardManager:
    """Decode each response, call ``compute_score`` and build ``token_level_scores`` [B, R].

    Reads ``prompts`` [B, P], ``responses`` [B, R], ``attention_mask`` [B, P + R] (left-padded
    prompt, right-padded response) and the non-tensor fields ``reward_model`` (``ground_truth``),
    ``data_source`` (or ``reward_fn_key``) and optional ``extra_info``. A score may be a number or a
    dict with a ``score`` key; every key of such dicts is collected into ``reward_extra_info``.
    ``num_examine`` samples per data source are logged at INFO for debugging (``VERL_LOGGING_LEVEL=INFO``).
    A score that raises (or is not a number) propagates unchanged, marked with its sample
    (:func:`mark_failed_sample`): never a silent zero.
    """

    # The tensor fields read (with every non-tensor field): what a reward pool sends its processes.
    input_keys = ("prompts", "responses", "attention_mask", "rm_scores")

    def __init__(
        self,
        tokenizer: Any,
        num_examine: int = 0,
        compute_score: Callable | None = None,
        reward_fn_key: str = "data_source",
    ):
        self.tokenizer = tokenizer
        self.num_examine = num_examine
        self.compute_score = compute_score or default_compute_score
        self.reward_fn_key = reward_fn_key

    def __call__(self, data: DataProto, return_dict: bool = False):
        """Returns ``reward_tensor`` [B, R] (float32), or with ``return_dict`` a dict
        ``{"reward_tensor": ..., "reward_extra_info": {key: list of B values}}``."""
        if "rm_scores" in data.batch:  # a reward model already scored this batch
            scores = data.batch["rm_scores"]
            return {"reward_tensor": scores, "reward_extra_info": {}} if return_dict else scores
        missing = [k for k in ("prompts", "responses", "attention_mask") if k not in data.batch]
        missing += [k for k in ("reward_model", self.reward_fn_key) if k not in data.non_tensor_batch]
        if missing:
            raise DataProtoError(
                f"NaiveRewardManager: expected fields {missing}, found only "
                f"{sorted(data.batch.keys()) + sorted(data.non_tensor_batch)}"
            )

        responses = data.batch["responses"]
        prompt_length = data.batch["prompts"].shape[-1]
        prompt_lengths = data.batch["attention_mask"][:, :prompt_length].sum(dim=-1).tolist()
        response_lengths = data.batch["attention_mask"][:, prompt_length:].sum(dim=-1).tolist()
        reward_tensor = torch.zeros(responses.shape, dtype=torch.float32, device=responses.device)
        reward_extra_info: dict[str, list] = defaultdict(list)
        printed: dict[str, int] = defaultdict(int)

        for i in range(len(data)):
            valid_prompt = data.batch["prompts"][i, prompt_length - int(prompt_lengths[i]) :]
            response_length = int(response_lengths[i])
            response_str = self.tokenizer.decode(responses[i, :response_length].tolist(), skip_special_tokens=True)
            ground_truth = data.non_tensor_batch["reward_model"][i]["ground_truth"]
            data_source = data.non_tensor_batch[self.reward_fn_key][i]
            extra_info = data.non_tensor_batch["extra_info"][i] if "extra_info" in data.non_tensor_batch else None
            try:
                result = self.compute_score(
                    data_source=data_source, solution_str=response_str, ground_truth=ground_truth,
                    extra_info=extra_info)
                if isinstance(result, dict):
                    if "score" not in result:
                        raise ValueError(f"compute_score returned a dict without 'score'; found keys {sorted(result)}")
                    score = float(result["score"])
                else:
                    score = float(result)
            except Exception as err:
                # The same error, carrying which sample failed (a reward pool reports it in its one line).
                mark_failed_sample(err, i, data_source, extra_info)
                raise
            if isinstance(result, dict):
                for key, value in result.items():
                    reward_extra_info[key].append(value)
            # An empty response has no token to carry a reward; its score is still reported.
            if response_length > 0:
                reward_tensor[i, response_length - 1] = score

            if printed[data_source] < self.num_examine:
                printed[data_source] += 1
                prompt_str = self.tokenizer.decode(valid_prompt.tolist(), skip_special_tokens=True)
                logger.info("[prompt] %s\n[response] %s\n[ground_truth] %s\n[score] %s",
                            prompt_str, response_str, ground_truth, result)

        if return_dict:
            return {"reward_tensor": reward_tensor, "reward_extra_info": dict(reward_extra_info)}
        return reward_tensor
