"""NaiveRewardManager: rule-based scores for each response, placed on its last valid token."""

from __future__ import annotations

import contextlib
import math
import signal
import threading
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from verl.protocol import DataProto, DataProtoError
from verl.utils.logging_utils import get_logger
from verl.utils.reward_score import default_compute_score, scores_last_turn

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


# The agent loops' per-trajectory fields (non-tensor columns of an agent rollout) that reach ``compute_score`` in
# ``extra_info``, under verl's names: ``__num_turns__`` -> ``num_turns``, the tools' ``calc_reward`` per tool
# (``reward_scores``) -> ``rollout_reward_scores``, ``execute``'s rewards in call order -> ``tool_rewards``.
AGENT_EXTRA_INFO = {"__num_turns__": "num_turns", "reward_scores": "rollout_reward_scores",
                    "tool_rewards": "tool_rewards"}


class NonFiniteScoreError(ValueError):
    """A reward that is NaN or infinite (it would reach every advantage of its group): refused, naming its row."""

    def __init__(self, score: float, where: str | None = None, row: int | None = None):
        self.score, self.row = score, row
        super().__init__(f"expected a finite score, found {score!r}" + (f" for {where}" if where else ""))


def last_turn(own: torch.Tensor) -> torch.Tensor:
    """The mask of the last run of True in ``own`` (the model's tokens of one response): its final turn."""
    idx = own.nonzero().flatten()
    keep = torch.zeros_like(own)
    if len(idx):
        end = int(idx[-1]) + 1
        before = (~own[:end]).nonzero().flatten()
        keep[(int(before[-1]) + 1 if len(before) else 0):end] = True
    return keep


def check_finite_scores(scores: torch.Tensor, positions: Any = None) -> torch.Tensor:
    """``scores`` [B, R] (any reward manager's token-level scores), or one ValueError line naming the first row
    with a NaN or infinite score (its position in the step's batch when ``positions`` is given)."""
    bad = ~torch.isfinite(scores)
    if bool(bad.any()):
        row = int(bad.any(dim=-1).nonzero()[0, 0])
        value = float(scores[row][bad[row]][0])
        where = int(positions[row]) if positions is not None else row
        raise NonFiniteScoreError(value, f"row {where} of the step's batch", row=row)
    return scores


class NaiveRewardManager:
    """Decode each response's own tokens, call ``compute_score`` and build ``token_level_scores`` [B, R].

    Reads ``prompts`` [B, P], ``responses`` [B, R], ``attention_mask`` [B, P + R] (left-padded
    prompt, right-padded response), ``response_mask`` [B, R] when present, and the non-tensor fields
    ``reward_model`` (``ground_truth``), ``data_source`` (or ``reward_fn_key``) and optional ``extra_info``.
    ``solution_str`` is the text of the tokens the model sampled (``response_mask`` 1): an agent rollout's tool
    results and other inserted turns (mask 0) are not scored; where the data source scores the final answer
    (:func:`~verl.utils.reward_score.scores_last_turn`), only the model's last turn (the last run of mask 1).
    An agent rollout's ``__num_turns__``, ``reward_scores`` and ``tool_rewards`` columns reach ``compute_score``
    in ``extra_info`` (verl's keys: :data:`AGENT_EXTRA_INFO`); a score computed by the agent loop itself
    (``AgentLoopOutput.reward_score``) arrives as ``rm_scores`` and is returned as is. A score may be a number or
    a dict with a ``score`` key; every key of such dicts is collected into ``reward_extra_info``.
    ``num_examine`` samples per data source are logged at INFO for debugging (``VERL_LOGGING_LEVEL=INFO``). A
    score that raises, is not a number, or is NaN or infinite propagates as an error marked with its sample
    (:func:`mark_failed_sample`): never a silent
    zero.
    """

    # The tensor fields read (with every non-tensor field): what a reward pool sends its processes.
    input_keys = ("prompts", "responses", "attention_mask", "response_mask", "rm_scores")

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
        # reward.timeout_s: the longest one sample may score in this process (None: no limit); a reward pool
        # bounds its processes from the trainer instead.
        self.timeout_s: float | None = None
        # Called with each row's index before it is scored (a reward pool's process reports its progress).
        self.on_row: Callable[[int], None] | None = None

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
        own = data.batch["response_mask"] if "response_mask" in data.batch else None
        agent_columns = {key: data.non_tensor_batch[key] for key in AGENT_EXTRA_INFO if key in data.non_tensor_batch}
        reward_tensor = torch.zeros(responses.shape, dtype=torch.float32, device=responses.device)
        reward_extra_info: dict[str, list] = defaultdict(list)
        printed: dict[str, int] = defaultdict(int)

        for i in range(len(data)):
            valid_prompt = data.batch["prompts"][i, prompt_length - int(prompt_lengths[i]) :]
            response_length = int(response_lengths[i])
            ground_truth = data.non_tensor_batch["reward_model"][i]["ground_truth"]
            data_source = data.non_tensor_batch[self.reward_fn_key][i]
            extra_info = data.non_tensor_batch["extra_info"][i] if "extra_info" in data.non_tensor_batch else None
            ids = responses[i, :response_length]
            if own is not None:  # the model's own tokens: not the tool results between its turns
                keep = own[i, :response_length].bool()
                if scores_last_turn(data_source, extra_info):  # only the model's final turn states the answer
                    keep = last_turn(keep)
                ids = ids[keep]
            response_str = self.tokenizer.decode(ids.tolist(), skip_special_tokens=True)
            if agent_columns:  # a copy: the dataset's row stays as it is
                extra_info = dict(extra_info) if isinstance(extra_info, dict) else {}
                for key, column in agent_columns.items():
                    extra_info[AGENT_EXTRA_INFO[key]] = _plain(column[i])
            if self.on_row is not None:
                self.on_row(i)
            try:
                with _time_limit(getattr(self, "timeout_s", None), i, data_source):
                    result = self.compute_score(
                        data_source=data_source, solution_str=response_str, ground_truth=ground_truth,
                        extra_info=extra_info)
                if isinstance(result, dict):
                    if "score" not in result:
                        raise ValueError(f"compute_score returned a dict without 'score'; found keys {sorted(result)}")
                    score = float(result["score"])
                else:
                    score = float(result)
                if not math.isfinite(score):
                    index = extra_info.get("index") if isinstance(extra_info, dict) else None
                    raise NonFiniteScoreError(score, describe_sample({"row": i, "data_source": data_source,
                                                                      "index": index}))
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


class RewardTimeoutError(TimeoutError):
    """A sample whose score took longer than ``reward.timeout_s`` in the trainer's own process."""


@contextlib.contextmanager
def _time_limit(timeout_s: float | None, row: int, data_source: Any):
    """Raise :class:`RewardTimeoutError` in the scorer past ``timeout_s`` (SIGALRM: only on the main thread, and
    only a scorer running Python code is interrupted; a reward pool bounds any scorer)."""
    if timeout_s is None or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum, frame):
        raise RewardTimeoutError(f"expected a score within reward.timeout_s={timeout_s:g} s, found row {row} "
                                 f"(data_source={data_source!r}) still scoring")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _plain(value: Any) -> Any:
    """A non-tensor cell as the Python value a user's ``compute_score`` expects (an array cell as a list)."""
    return value.tolist() if isinstance(value, np.ndarray) else value
