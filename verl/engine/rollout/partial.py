"""Partial rollout: generation that stops before every response has finished, and resumes later, possibly on
newer weights (verl's V1 asynchronous trainers abort requests at a weight sync and resume them after).

A :class:`PromptGroup` is one prompt and its ``n`` trajectories (a GRPO group). Each trajectory keeps the tokens
and per-token log-probs generated so far and the first and last model version that produced any of them
(``min_version``/``max_version``, verl's ``min_global_steps``/``max_global_steps``). :func:`run_segment` runs one
*segment* of generation over every unfinished trajectory of a set of groups: each row's input is its prompt
followed by the tokens it already has (the kept prefix is prefilled again, as verl does on resume) and its
budget is what is left of ``response_length``. The segment ends when every row finished or the
:class:`SegmentStop` rule says so: enough whole groups finished, none of the ``required`` rows still running,
or ``abort()`` (a weight sync is waiting). :func:`groups_to_batch` turns finished groups into the rollout
fields the trainer reads (the same shapes as a synchronous rollout's).

Engines whose offline ``generate`` returns a batch whole (SGLang's, vLLM's) stop a segment between *rounds* of a
few tokens: :func:`generate_in_rounds` resubmits each running row's prompt and tokens so far (their prefix caches
hold it, so only the new tokens are computed) and checks the stop rule after each round.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from verl.engine.rollout.base import RolloutInputError, SamplingParams, assemble_rollout_batch, check_prompts
from verl.errors import InputError

ROUND_SEED_STRIDE = 1_000_003  # a round's sampling seeds: never one of another round's rows
# An agent trajectory's fields the reward function reads (verl's non-tensor columns): its turn count, its tools'
# ``execute`` rewards in call order and each tool's ``calc_reward``; compute_score gets them in extra_info.
AGENT_REWARD_COLUMNS = ("__num_turns__", "tool_rewards", "reward_scores")


@dataclasses.dataclass
class SegmentStop:
    """When a segment stops although some rows are still generating.

    ``group`` [rows]: each row's group (0..G-1); ``min_groups``: stop once that many groups have every row
    finished; ``required`` [rows] (bool, optional): rows that must finish before the segment may stop;
    ``abort``: polled after every decode step, True stops the segment at once (it wins over ``required``).
    Under rollout TP every rank must stop at the same step: the decision is agreed by a MAX all-reduce."""

    group: torch.Tensor
    min_groups: int
    required: torch.Tensor | None = None
    abort: Callable[[], bool] | None = None

    def __post_init__(self):
        self._groups = int(self.group.max()) + 1 if self.group.numel() else 0

    def reached(self, done: torch.Tensor, tp_group: Any = None) -> bool:
        running = torch.zeros(self._groups, dtype=torch.int64, device=done.device)
        running.index_add_(0, self.group.to(done.device), (~done).to(torch.int64))
        enough = int((running == 0).sum()) >= self.min_groups
        if enough and self.required is not None:
            enough = not bool((self.required.to(done.device) & ~done).any())
        aborted = self.abort is not None and self.abort()
        decision = torch.tensor([int(enough or aborted)], dtype=torch.int64)
        if tp_group is not None and dist.get_world_size(tp_group) > 1:
            dist.all_reduce(decision, op=dist.ReduceOp.MAX, group=tp_group)
        return bool(decision.item())


@dataclasses.dataclass
class GroupSample:
    """One sampled response of a group, possibly unfinished."""

    tokens: list[int] = dataclasses.field(default_factory=list)
    log_probs: list[float] = dataclasses.field(default_factory=list)
    finished: bool = False
    min_version: int | None = None
    max_version: int | None = None
    segments: int = 0  # how many segments produced its tokens (1 = never interrupted)
    # An agent trajectory's (rollout.multi_turn): 1 on sampled tokens, 0 on tool / user tokens (None: all
    # sampled), and its own prompt (the chat template with the tools' schemas; None: the group's).
    mask: list[int] | None = None
    prompt: list[int] | None = None
    # ... and its (turns, tool calls, tool errors), verl's num_turns / tool metrics of the step that trains it
    # (None: not an agent's, or restored from a checkpoint, which does not keep them)
    turns: tuple[int, int, int] | None = None
    # ... and what its agent loop returned for the reward (None: not an agent's): verl's per-trajectory columns
    # (AGENT_REWARD_COLUMNS) and "reward_score", the loop's own score or None; checkpointed, as the step reads it
    agent_rewards: dict[str, Any] | None = None


@dataclasses.dataclass
class PromptGroup:
    """A prompt and its n trajectories, tagged as verl's replay buffer tags them.

    ``uid``: unique in the run (``<epoch>-<dataset index>``); ``index``/``epoch``: where the sampler drew it;
    ``submit_step``: the global step it was submitted at (verl's prompt ``global_steps``: staleness is counted
    from it); ``fields``: the dataset's per-prompt values (data_source, reward_model, ...)."""

    uid: str
    index: int
    epoch: int
    submit_step: int
    prompt: list[int]
    fields: dict[str, Any]
    n: int
    trajectories: list[GroupSample] = dataclasses.field(default_factory=list)
    finish_order: int = -1  # when the replay buffer saw it finish (sampling breaks ties of submit_step by it)

    def __post_init__(self):
        if not self.trajectories:
            self.trajectories = [GroupSample() for _ in range(self.n)]

    @property
    def finished(self) -> bool:
        return all(t.finished for t in self.trajectories)

    def reset(self, submit_step: int) -> None:
        """Drop what was generated (a resumed run reissues the prompt, tagged with the current step)."""
        self.trajectories = [GroupSample() for _ in range(self.n)]
        self.submit_step = submit_step


def _left_padded(rows: Sequence[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.int64)
    mask = torch.zeros((len(rows), width), dtype=torch.int64)
    for i, row in enumerate(rows):
        if row:
            ids[i, width - len(row):] = torch.tensor(row, dtype=torch.int64)
            mask[i, width - len(row):] = 1
    return ids, mask


def segment_inputs(groups: Sequence[PromptGroup], response_length: int, pad: int,
                   required_uids: set[str] | None = None) -> dict[str, torch.Tensor] | None:
    """The rows of a segment: every unfinished trajectory as prompt + kept prefix (left padded), its remaining
    budget (``limits``), its group's position in ``groups`` (``group``), whether it must finish (``required``)
    and where it belongs (``group_pos``, ``sample``). None when nothing is left to generate."""
    rows, limits, group, sample, required = [], [], [], [], []
    for g, prompt_group in enumerate(groups):
        for s, traj in enumerate(prompt_group.trajectories):
            if traj.finished:
                continue
            rows.append(prompt_group.prompt + traj.tokens)
            limits.append(response_length - len(traj.tokens))
            group.append(g)
            sample.append(s)
            required.append(required_uids is not None and prompt_group.uid in required_uids)
    if not rows:
        return None
    input_ids, attention_mask = _left_padded(rows, pad)
    return {"input_ids": input_ids, "attention_mask": attention_mask,
            "limits": torch.tensor(limits, dtype=torch.int64), "group": torch.tensor(group, dtype=torch.int64),
            "sample": torch.tensor(sample, dtype=torch.int64), "required": torch.tensor(required, dtype=torch.bool)}


@dataclasses.dataclass
class RoundRequest:
    """One row's request in a round: its prompt followed by the tokens it has so far, the new tokens it may take
    and its sampling seed (None: greedy, or no seed asked for)."""

    tokens: list[int]
    max_new_tokens: int
    seed: int | None


@dataclasses.dataclass
class RoundResult:
    """What an engine returned for a :class:`RoundRequest`: the new tokens, their log-probs, and whether a stop
    token ended the row (not the round's cap)."""

    ids: list[int]
    log_probs: list[float]
    stopped: bool


def generate_in_rounds(prompts: Sequence[list[int]], budgets: Sequence[int], params: SamplingParams,
                       run_round: Callable[[list[RoundRequest]], list[RoundResult]], width: int, pad: int,
                       stop: SegmentStop | None = None, round_tokens: int = 16, tp_group: Any = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows generated up to their ``budgets`` through ``run_round`` (an engine's batch generate), in rounds of at
    most ``round_tokens`` new tokens when a ``stop`` rule is given (checked after every round), else in one:
    (responses, response_mask, log_probs) [rows, ``width``]. Sampled rows get seed ``params.seed + row`` in the first
    round and a fresh one in each later round, so a row's stream is reproducible and its own. ``tp_group``: the
    engine's TP ranks, which take the stop decision together (one rank's abort stops them all)."""
    tokens: list[list[int]] = [[] for _ in prompts]
    token_log_probs: list[list[float]] = [[] for _ in prompts]
    done = [b <= 0 for b in budgets]
    for round_index in itertools.count():
        active = [row for row in range(len(prompts)) if not done[row]]
        if not active:
            break
        requests = []
        for row in active:
            left = budgets[row] - len(tokens[row])
            seed = None if params.greedy or params.seed is None else params.seed + row + round_index * ROUND_SEED_STRIDE
            requests.append(RoundRequest(list(prompts[row]) + tokens[row],
                                         left if stop is None else min(left, round_tokens), seed))
        results = run_round(requests)
        if len(results) != len(requests):
            raise RuntimeError(f"generate: expected {len(requests)} outputs, found {len(results)}")
        for row, request, result in zip(active, requests, results, strict=True):
            ids = list(result.ids[:request.max_new_tokens])
            tokens[row] += ids
            token_log_probs[row] += [float(lp) for lp in result.log_probs[:len(ids)]]
            # Finished: a stop token ended it, or its budget is spent (a round's cap is not a finish).
            done[row] = result.stopped or len(tokens[row]) >= budgets[row]
        if stop is None or stop.reached(torch.tensor(done), tp_group):
            break
    responses = torch.full((len(prompts), width), pad, dtype=torch.int64)
    response_mask = torch.zeros(len(prompts), width, dtype=torch.int64)
    log_probs = torch.zeros(len(prompts), width, dtype=torch.float32)
    for row, ids in enumerate(tokens):
        responses[row, :len(ids)] = torch.tensor(ids, dtype=torch.int64)
        response_mask[row, :len(ids)] = 1
        log_probs[row, :len(ids)] = torch.tensor(token_log_probs[row], dtype=torch.float32)
    return responses, response_mask, log_probs


def generate_segment(engine: Any, inputs: dict[str, torch.Tensor], params: SamplingParams, pad: int,
                     min_groups: int, abort: Callable[[], bool] | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One segment on ``engine`` (an engine whose ``generate_responses`` takes ``limits``/``stop``: the native
    engine checks the rule after every decode step, SGLang between rounds of a few tokens): (new tokens, their
    mask, their log-probs), [rows, max budget]."""
    limits = inputs["limits"]
    budget = int(limits.max())
    params = dataclasses.replace(params, n=1, response_length=budget)
    # Each row needs its own length + budget positions (<= prompt + response_length); the padded width plus the
    # largest budget is only the batch's cache width (RoPE and the cache grow past the context for it).
    width = inputs["input_ids"].shape[1]
    check_prompts(inputs["input_ids"], inputs["attention_mask"], engine.config.vocab_size, width + budget, budget)
    need = inputs["attention_mask"].sum(-1) + limits
    context = engine.config.max_position_embeddings
    if bool((need > context).any()):
        row = int((need > context).nonzero()[0])
        raise RolloutInputError(f"partial rollout row {row}: {int(need[row])} positions (tokens so far + budget), "
                                f"expected at most the model context (max_position_embeddings={context})")
    required = inputs["required"] if bool(inputs["required"].any()) else None
    stop = SegmentStop(inputs["group"], min_groups, required, abort)
    return engine.generate_responses(inputs["input_ids"], inputs["attention_mask"], params, pad, limits=limits,
                                     stop=stop)


def merge_segment(groups: Sequence[PromptGroup], inputs: dict[str, torch.Tensor], responses: torch.Tensor,
                  response_mask: torch.Tensor, log_probs: torch.Tensor, stop_ids: Sequence[int],
                  version: int) -> None:
    """Append a segment's new tokens to their trajectories; a trajectory finishes on a stop token or when its
    budget is used up (otherwise it was interrupted and keeps its prefix for the next segment)."""
    stops = set(int(i) for i in stop_ids)
    lengths = response_mask.sum(-1).tolist()
    for row, (g, s) in enumerate(zip(inputs["group"].tolist(), inputs["sample"].tolist(), strict=True)):
        traj = groups[g].trajectories[s]
        count = int(lengths[row])
        if count == 0:
            continue
        new = responses[row, :count].tolist()
        traj.tokens.extend(new)
        traj.log_probs.extend(log_probs[row, :count].tolist())
        traj.min_version = version if traj.min_version is None else traj.min_version
        traj.max_version = version
        traj.segments += 1
        traj.finished = new[-1] in stops or count >= int(inputs["limits"][row])


def run_segment(engine: Any, groups: Sequence[PromptGroup], params: SamplingParams, pad: int, version: int,
                min_groups: int, required_uids: set[str] | None = None,
                abort: Callable[[], bool] | None = None) -> int:
    """Generate on every unfinished trajectory of ``groups`` until ``min_groups`` of them finished (or all, or
    ``abort``); returns the number of rows that ran."""
    inputs = segment_inputs(groups, params.response_length, pad, required_uids)
    if inputs is None:
        return 0
    responses, mask, log_probs = generate_segment(engine, inputs, params, pad, min_groups, abort)
    merge_segment(groups, inputs, responses, mask, log_probs, params.stop_ids, version)
    return len(inputs["limits"])


def groups_to_batch(groups: Sequence[PromptGroup], prompt_length: int, response_length: int,
                    pad: int) -> tuple[dict[str, torch.Tensor], dict[str, np.ndarray]]:
    """Finished groups -> (verl's rollout tensor fields, per-row non-tensor fields), ``n`` rows per group in
    order; prompts left-padded to ``prompt_length``, responses right-padded to ``response_length``. Non-tensor
    fields: the dataset's fields, ``uid``, and the tags ``min_global_steps``/``max_global_steps`` (the model
    versions of a trajectory's first and last token), ``prompt_global_steps`` (its submission step) and
    ``num_segments``."""
    prompts, prompt_masks, responses, masks, attended, log_probs = [], [], [], [], [], []
    non_tensor: dict[str, list] = {"uid": [], "min_global_steps": [], "max_global_steps": [],
                                   "prompt_global_steps": [], "num_segments": []}
    keys = sorted(set().union(*(g.fields for g in groups))) if groups else []
    for key in keys:
        non_tensor.setdefault(key, [])
    for group in groups:
        for traj in group.trajectories:
            if not traj.finished:
                raise RuntimeError(f"prompt group {group.uid}: expected finished trajectories, found one running")
            ids = group.prompt if traj.prompt is None else traj.prompt
            prompt = torch.full((prompt_length,), pad, dtype=torch.int64)
            prompt_mask = torch.zeros(prompt_length, dtype=torch.int64)
            prompt[prompt_length - len(ids):] = torch.tensor(ids, dtype=torch.int64)
            prompt_mask[prompt_length - len(ids):] = 1
            response = torch.full((response_length,), pad, dtype=torch.int64)
            mask = torch.zeros(response_length, dtype=torch.int64)
            lp = torch.zeros(response_length, dtype=torch.float32)
            count = len(traj.tokens)
            response[:count] = torch.tensor(traj.tokens, dtype=torch.int64)
            attend = torch.zeros(response_length, dtype=torch.int64)
            attend[:count] = 1
            mask[:count] = 1 if traj.mask is None else torch.tensor(traj.mask, dtype=torch.int64)
            lp[:count] = torch.tensor(traj.log_probs, dtype=torch.float32)
            prompts.append(prompt)
            prompt_masks.append(prompt_mask)
            responses.append(response)
            masks.append(mask)
            attended.append(attend)
            log_probs.append(lp)
            non_tensor["uid"].append(group.uid)
            non_tensor["min_global_steps"].append(traj.min_version)
            non_tensor["max_global_steps"].append(traj.max_version)
            non_tensor["prompt_global_steps"].append(group.submit_step)
            non_tensor["num_segments"].append(traj.segments)
            for key in keys:
                non_tensor[key].append(group.fields.get(key))
    tensors = assemble_rollout_batch(torch.stack(prompts), torch.stack(prompt_masks), torch.stack(responses),
                                     torch.stack(masks), torch.stack(log_probs), torch.stack(attended))
    rewards = [t.agent_rewards for g in groups for t in g.trajectories]
    if any(r is not None for r in rewards):  # agent trajectories: what their loops returned for the reward
        # (one restored from a checkpoint written before the field has none: no turns, tool rewards or score)
        rewards = [r or {"__num_turns__": 0, "tool_rewards": [], "reward_scores": {}} for r in rewards]
        for key in AGENT_REWARD_COLUMNS:
            non_tensor[key] = [r[key] for r in rewards]
        own = last_token_scores([r.get("reward_score") for r in rewards],
                                [len(t.tokens) for g in groups for t in g.trajectories], response_length,
                                "AgentLoopOutput.reward_score")
        if own is not None:
            tensors["rm_scores"] = own
    arrays = {}
    for key, values in non_tensor.items():
        array = np.empty(len(values), dtype=object)
        for i, value in enumerate(values):
            array[i] = value
        arrays[key] = array
    return tensors, arrays


def last_token_scores(scores: Sequence[float | None], lengths: Sequence[int], response_length: int,
                      what: str) -> torch.Tensor | None:
    """verl's ``rm_scores`` [rows, response_length] from scores the rollout brought itself (an agent loop's own
    ``reward_score``): each row's score on its last response token; None when no row has one. Some rows but not
    all is bad input, one line naming ``what``: the reward would mix the loop's scores and the reward function's."""
    given = [s is not None for s in scores]
    if not any(given):
        return None
    if not all(given):
        raise InputError(f"{what}: expected every trajectory of a batch or none to carry the loop's own "
                         f"score, found {sum(given)} of {len(scores)}")
    out = torch.zeros((len(scores), response_length), dtype=torch.float32)
    for i, (score, length) in enumerate(zip(scores, lengths, strict=True)):
        if min(length, response_length):
            out[i, min(length, response_length) - 1] = float(score)
    return out
