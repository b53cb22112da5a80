"""Rewards under hostile scorers and agent rollouts (issue 56, faults 7 and 9): the reward reads the model's own
tokens (``response_mask`` 1), not the tool results between its turns; the agent loop's tool rewards reach
``compute_score`` under verl's ``extra_info`` keys; a NaN or infinite score, a hung scorer and a dead reward worker
each end as one line naming the row (a dead worker is first restarted and its rows scored again)."""

import logging
import math
import os
import time

import numpy as np
import pytest
import torch

from verl.protocol import DataProto
from verl.utils.dataset.arithmetic import build_char_tokenizer
from verl.utils.reward_score import load_reward_fn
from verl.workers.reward_manager import NaiveRewardManager
from verl.workers.reward_manager.async_pool import RewardPool, RewardScoreError

# (what these tests add to verl is imported in each test: on the code before them each test fails on its own)

SCORER = '''import os, signal, time


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "888":  # hung: a lock, a regex backtracking forever, a network call
        time.sleep(600)
    if solution_str == "555" and not os.path.exists(os.environ["VERL_TEST_ONCE"]):  # the OOM killer, once
        open(os.environ["VERL_TEST_ONCE"], "w").close()
        os.kill(os.getpid(), signal.SIGKILL)
    if solution_str == "444":  # the OOM killer, every time
        os.kill(os.getpid(), signal.SIGKILL)
    if solution_str == "333":
        return float("nan")
    if solution_str == "22":
        return {"score": float("-inf")}
    return float(solution_str == ground_truth)
'''


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(build_char_tokenizer(str(tmp_path_factory.mktemp("tok"))))


@pytest.fixture(scope="module")
def manager(tokenizer, tmp_path_factory):
    root = tmp_path_factory.mktemp("scorer")
    (root / "scorer.py").write_text(SCORER)
    os.environ["VERL_TEST_ONCE"] = str(root / "once")  # inherited by the spawned workers
    return NaiveRewardManager(tokenizer, compute_score=load_reward_fn(str(root / "scorer.py")))


def batch_of(tokenizer, texts, sources=None, own=None):
    """Prompts left-padded to 6, responses (+eos) right-padded to 8; ``own``: each response's response_mask."""
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    prompts, responses, masks, owns = [], [], [], []
    for i, text in enumerate(texts):
        p = tokenizer("12+3=", add_special_tokens=False)["input_ids"]
        r = (tokenizer(text, add_special_tokens=False)["input_ids"] + [eos])[:8]
        prompts.append([pad] * (6 - len(p)) + p)
        responses.append(r + [pad] * (8 - len(r)))
        masks.append([0] * (6 - len(p)) + [1] * len(p) + [1] * len(r) + [0] * (8 - len(r)))
        mine = own[i] if own is not None else [1] * len(r)
        owns.append(list(mine) + [0] * (8 - len(mine)))
    n = len(texts)
    return DataProto.from_dict(
        {"prompts": torch.tensor(prompts), "responses": torch.tensor(responses),
         "attention_mask": torch.tensor(masks), "response_mask": torch.tensor(owns)},
        {"data_source": np.array(sources or ["arithmetic"] * n, dtype=object),
         "reward_model": np.array([{"ground_truth": "15"}] * n, dtype=object),
         "extra_info": np.array([{"index": 100 + i} for i in range(n)], dtype=object)})


# ----------------------------------------------------------------------------- fault 7: the model's own tokens
def test_the_reward_reads_the_models_tokens_not_the_tool_results(tokenizer):
    """Was: the whole response was decoded, tool output included: "7" (the model) + "15" (a tool) read "715"."""
    seen = []

    def record(data_source, solution_str, ground_truth, extra_info=None):
        seen.append(solution_str)
        return float(solution_str == ground_truth)

    # "1" sampled, "99" a tool's result (mask 0), "5" sampled again, then eos (sampled).
    rows = batch_of(tokenizer, ["1995", "715"], own=[[1, 0, 0, 1, 1], [1, 0, 0, 1]])
    reward = NaiveRewardManager(tokenizer, compute_score=record)(rows)
    assert seen == ["15", "7"]
    # the score still sits on the last valid response token
    assert reward[0, 4] == 1.0 and reward[1, 3] == 0.0 and reward.sum() == 1.0


def test_a_data_source_scored_on_its_final_answer_reads_the_models_last_turn_only(tokenizer):
    """Issue 56 item 4: the calculator task (and any row with extra_info.reward_last_turn) is scored on the model's
    last turn; was: every model turn, so an answer stated before the tool calls counted though the last turn
    dropped it."""
    from verl.workers.reward_manager.naive import last_turn

    seen = []

    def record(data_source, solution_str, ground_truth, extra_info=None):
        seen.append(solution_str)
        return 0.0

    # "15" sampled, "99" a tool's result (mask 0), "7" and eos sampled: the model's text is "157", its last turn "7".
    rows = batch_of(tokenizer, ["15997"] * 3, sources=["calculator_word_problems", "arithmetic", "arithmetic"],
                    own=[[1, 1, 0, 0, 1, 1]] * 3)
    rows.non_tensor_batch["extra_info"][2]["reward_last_turn"] = True
    NaiveRewardManager(tokenizer, compute_score=record)(rows)
    assert seen == ["7", "157", "7"]
    mask = lambda *bits: torch.tensor(bits, dtype=torch.bool)  # noqa: E731
    assert last_turn(mask(1, 0, 1, 1, 0)).tolist() == [False, False, True, True, False]
    assert last_turn(mask(1, 1)).tolist() == [True, True] and not last_turn(mask(0, 0)).any()


def test_the_agent_loops_tool_rewards_reach_compute_score_under_verls_keys(tokenizer):
    """Was: execute's rewards and calc_reward were collected by the loop and dropped before the reward."""
    seen = []

    def record(data_source, solution_str, ground_truth, extra_info=None):
        seen.append(extra_info)
        return sum(extra_info["tool_rewards"]) + sum(extra_info["rollout_reward_scores"].values())

    rows = batch_of(tokenizer, ["15", "7"])
    rows.non_tensor_batch["tool_rewards"] = np.array([[0.25, 0.5], []], dtype=object)
    rows.non_tensor_batch["reward_scores"] = np.array([{"calc": 1.0}, {}], dtype=object)
    rows.non_tensor_batch["__num_turns__"] = np.array([4, 2], dtype=object)
    reward = NaiveRewardManager(tokenizer, compute_score=record)(rows)
    assert reward.sum(-1).tolist() == [1.75, 0.0]
    assert seen[0] == {"index": 100, "tool_rewards": [0.25, 0.5], "rollout_reward_scores": {"calc": 1.0},
                       "num_turns": 4}
    assert rows.non_tensor_batch["extra_info"][0] == {"index": 100}  # the dataset's row is not changed


# ----------------------------------------------------------------------------- fault 9: scores and workers
@pytest.mark.parametrize("text, found", [("333", "nan"), ("22", "-inf")])
def test_a_non_finite_score_is_refused_naming_its_row_in_process(tokenizer, manager, text, found):
    """Was: NaN and inf scores flowed into the advantages."""
    from verl.workers.reward_manager.naive import NonFiniteScoreError

    rows = batch_of(tokenizer, ["15", text], ["a", "b"])
    with pytest.raises(NonFiniteScoreError, match=rf"expected a finite score, found {found} for row 1 "
                       r"\(data_source='b', extra_info.index=101\)"):
        manager(rows)


def test_a_custom_managers_non_finite_scores_are_refused_too():
    from verl.workers.reward_manager.naive import NonFiniteScoreError, check_finite_scores

    scores = torch.zeros(3, 4)
    scores[2, 1] = math.inf
    with pytest.raises(NonFiniteScoreError, match=r"found inf for row 7 of the step's batch"):
        check_finite_scores(scores, positions=[5, 6, 7])
    assert check_finite_scores(torch.ones(2, 2)) is not None


def test_in_process_a_hung_scorer_ends_within_reward_timeout_s_naming_its_row(tokenizer, manager):
    from verl.workers.reward_manager.naive import RewardTimeoutError

    manager.timeout_s = 0.5
    try:
        start = time.monotonic()
        with pytest.raises(RewardTimeoutError, match=r"expected a score within reward.timeout_s=0.5 s, found "
                           r"row 1 \(data_source='b'\) still scoring"):
            manager(batch_of(tokenizer, ["15", "888"], ["a", "b"]))
        assert time.monotonic() - start < 5
    finally:
        manager.timeout_s = None


@pytest.fixture(scope="module")
def pool(manager):
    pool = RewardPool(manager, num_workers=1, timeout_s=1.5)  # one process: each restart boots one
    yield pool
    pool.close()


def test_in_the_pool_a_non_finite_score_is_one_line_naming_its_row(tokenizer, pool):
    rows = batch_of(tokenizer, ["15", "7", "15", "333"], ["a", "b", "c", "d"])
    with pytest.raises(RewardScoreError, match=r"^reward function raised NonFiniteScoreError: expected a finite "
                       r"score, found nan \(on row 13 \(data_source='d', extra_info.index=103\) of the step's "
                       r"batch\)\n"):
        pool.submit(rows, positions=[10, 11, 12, 13]).result()


def test_in_the_pool_a_hung_scorer_ends_within_the_bound_naming_its_row(tokenizer, pool):
    """Was: no timeout: a hung scorer hung a one-rank job forever (the other ranks died at the collective's)."""
    from verl.workers.reward_manager.async_pool import RewardScoreTimeout

    pool.wait_ready()
    rows = batch_of(tokenizer, ["15", "7", "888", "15"], ["a", "b", "c", "d"])
    start = time.monotonic()
    with pytest.raises(RewardScoreTimeout, match=r"expected a score within reward.timeout_s=1.5 s, found row 2 "
                       r"\(data_source='c'\) of the step's batch still scoring after"):
        pool.submit(rows).result()
    assert time.monotonic() - start < 1.5 + 10  # bounded (the scorer sleeps 600 s), with room for a loaded box
    assert pool.restarts == 1  # the hung processes were replaced (the next test scores with the new ones)


def test_a_dead_worker_is_restarted_and_its_rows_scored_again(tokenizer, pool, caplog):
    """Was: an OOM-killed worker raised BrokenProcessPool at every later step, never restarted."""
    restarts = pool.restarts
    rows = batch_of(tokenizer, ["15", "7", "555", "15"], ["a", "b", "c", "d"])
    with caplog.at_level(logging.WARNING, logger="verl.workers.reward_manager.async_pool"):
        scores = pool.submit(rows).result()
    assert scores.sum(-1).tolist() == [1.0, 0.0, 0.0, 1.0]
    assert pool.restarts == restarts + 1
    assert "reward worker process was killed by SIGKILL while scoring row 2 (data_source='c')" in caplog.text


def test_a_worker_that_dies_again_on_the_same_rows_is_one_line_naming_the_row(tokenizer, pool):
    from verl.workers.reward_manager.async_pool import RewardWorkerDied

    rows = batch_of(tokenizer, ["15", "7", "15", "444"], ["a", "b", "c", "d"])
    with pytest.raises(RewardWorkerDied, match=r"reward worker process was killed by SIGKILL again while scoring "
                       r"row 3 \(data_source='d'\) of the step's batch"):
        pool.submit(rows).result()
    assert pool.submit(batch_of(tokenizer, ["15"])).result().sum().item() == 1.0


# ----------------------------------------------------------------------------- fault 7 end to end: an agent rollout
class Oracle:
    """A tool whose result states a (wrong) answer, with a step reward and its own calc_reward."""

    def __new__(cls):
        from verl.tools.base_tool import BaseTool
        from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

        class _Oracle(BaseTool):
            async def execute(self, instance_id, parameters, **kwargs):
                return ToolResponse(text="The answer is 99."), 0.25, {}

            async def calc_reward(self, instance_id, **kwargs):
                return 2.0

        schema = {"type": "function", "function": {"name": "oracle", "description": "answers",
                                                   "parameters": {"type": "object", "properties": {}}}}
        return _Oracle({}, OpenAIFunctionToolSchema.model_validate(schema))


def agent_rows(outputs, tok, n_truth="15"):
    from verl.experimental.agent_loop import pad_outputs
    from verl.experimental.agent_loop.runner import reward_columns

    fields = pad_outputs(outputs, 512, 1200, tok.pad_token_id)
    non_tensor = {"data_source": np.array(["calculator_word_problems"] * len(outputs), dtype=object),
                  "reward_model": np.array([{"ground_truth": n_truth}] * len(outputs), dtype=object),
                  **reward_columns(outputs)}
    return DataProto.from_dict(fields, non_tensor)


def test_after_tool_turns_the_final_answer_scores_and_a_tool_results_answer_does_not():
    """Was: the manager decoded the tool results too and the scorer took the first marker in 600 characters:
    the tool's "The answer is 99." after a long call was the answer, the model's own final answer never read."""
    import asyncio

    from test_agent_loop import CHATML, call, char_tokenizer, make_loop

    from verl.experimental.agent_loop.scripted import ScriptedServerManager

    tok = char_tokenizer(CHATML)
    # the model's final answer past its own first 600 characters
    script = [call("oracle", question="x" * 700) + "<|im_end|>", "I checked: The answer is 15.<|im_end|>"]
    out = asyncio.run(make_loop(tok, ScriptedServerManager(tok, script), [Oracle()], response_length=1200).run(
        {}, raw_prompt=[{"role": "user", "content": "12+3?"}]))
    assert out.extra_fields["tool_rewards"] == [0.25] and out.extra_fields["reward_scores"] == {"oracle": 2.0}
    rows = agent_rows([out], tok)
    assert NaiveRewardManager(tok)(rows).sum().item() == 1.0
    # the same trajectory with the truth the tool stated: the tool's words are not the model's answer
    assert NaiveRewardManager(tok)(agent_rows([out], tok, "99")).sum().item() == 0.0

    seen = []

    def tool_aware(data_source, solution_str, ground_truth, extra_info=None):
        seen.append(extra_info)
        return extra_info["rollout_reward_scores"]["oracle"] + sum(extra_info["tool_rewards"])

    assert NaiveRewardManager(tok, compute_score=tool_aware)(rows).sum().item() == 2.25
    assert seen[0]["num_turns"] == out.num_turns


def test_a_loops_own_reward_score_is_the_reward_and_some_but_not_all_is_refused():
    from verl.errors import InputError
    from verl.experimental.agent_loop import AgentLoopOutput, pad_outputs

    def output(score):
        return AgentLoopOutput(prompt_ids=[5, 6], response_ids=[7, 8, 9], response_mask=[1, 1, 1],
                               reward_score=score)

    fields = pad_outputs([output(0.5), output(-1.0)], 4, 5, 0)
    assert fields["rm_scores"].tolist() == [[0, 0, 0.5, 0, 0], [0, 0, -1.0, 0, 0]]
    assert "rm_scores" not in pad_outputs([output(None)], 4, 5, 0)
    with pytest.raises(InputError, match=r"AgentLoopOutput.reward_score: expected every trajectory of a batch or "
                       r"none to carry the loop's own score, found 1 of 2"):
        pad_outputs([output(0.5), output(None)], 4, 5, 0)


# ----------------------------------------------------------------------------- fault 9: trajectories without log-probs
class _Runner:
    """An agent loop runner whose (custom) loop returns ``out``."""

    default_agent_loop = "my_loop"

    def __init__(self, out):
        self.out = out

    async def run_one(self, row, sampling, server_manager=None):
        return self.out


def _stream_record(out):
    import asyncio
    import queue

    from verl.workers.agent_stream import AgentStream

    stream = object.__new__(AgentStream)  # its trajectory coroutine alone: no engine, no event-loop thread
    stream.runner, stream.server, stream.sampling, stream._finished = _Runner(out), None, {}, queue.Queue()
    asyncio.run(stream._trajectory(("g", 0), {"raw_prompt": []}))
    return stream._finished.get_nowait()


def test_a_custom_loop_without_log_probs_is_refused_by_the_async_trainer_not_given_zeros():
    """Was: its sampled tokens got 0.0 rollout log-probs (probability 1), the old policy's under bypass mode."""
    from verl.experimental.agent_loop import AgentLoopOutput

    out = AgentLoopOutput(prompt_ids=[1, 2], response_ids=[3, 4, 5], response_mask=[1, 0, 1])
    record = _stream_record(out)
    assert record.input_error and record.response_logprobs == []
    assert record.error == ("AgentStreamInputError: agent loop 'my_loop': expected AgentLoopOutput.response_logprobs "
                            "for its 2 sampled tokens (the async trainer's rollout log-probs), found none: return "
                            "the server's log_probs")
    scored = AgentLoopOutput(prompt_ids=[1], response_ids=[3], response_mask=[1], response_logprobs=[-0.5],
                             reward_score=1.0)
    assert _stream_record(scored).error is None  # its own score travels with it (the test below)
    fine = AgentLoopOutput(prompt_ids=[1], response_ids=[3], response_mask=[1], response_logprobs=[-0.5],
                           extra_fields={"tool_rewards": [0.0], "reward_scores": {"calculator": 0.0}})
    record = _stream_record(fine)
    assert record.error is None and record.response_logprobs == [-0.5]


def _async_batch(records, truth="15"):
    """What the async trainers train on: ``records`` (finished agent trajectories, one prompt group each) written
    into the replay buffer's groups, then verl's batch (``groups_to_batch``)."""
    from verl.engine.rollout.partial import PromptGroup, groups_to_batch

    groups = []
    for i, record in enumerate(records):
        group = PromptGroup(uid=f"g{i}", index=i, epoch=0, submit_step=0, prompt=[5], n=1,
                            fields={"data_source": "calculator_word_problems", "reward_model": {"ground_truth": truth},
                                    "extra_info": {"index": i}})
        record.into(group.trajectories[0], 512, 1200, version=0)
        groups.append(group)
    tensors, fields = groups_to_batch(groups, 512, 1200, 0)
    return groups, DataProto.from_dict(tensors, fields)


def test_the_async_trainers_carry_the_loops_rewards_to_the_reward_and_through_a_checkpoint(tmp_path):
    """Issue 56 item 4: was refused in one line (the replay buffer kept tokens only). A trajectory's tool rewards,
    its tools' calc_reward and the loop's own score reach the reward as they do in the sync trainer, and a resumed
    run's replay buffer still has them."""
    import asyncio

    from test_agent_loop import CHATML, call, char_tokenizer, make_loop

    from verl.errors import InputError
    from verl.experimental.agent_loop import AgentLoopOutput
    from verl.experimental.agent_loop.scripted import ScriptedServerManager
    from verl.trainer.v1.replay_buffer import ReplayBuffer

    tok = char_tokenizer(CHATML)
    script = [call("oracle", question="12+3") + "<|im_end|>", "I checked: The answer is 15.<|im_end|>"]
    out = asyncio.run(make_loop(tok, ScriptedServerManager(tok, script), [Oracle()], response_length=1200).run(
        {}, raw_prompt=[{"role": "user", "content": "12+3?"}]))
    record = _stream_record(out)
    assert record.error is None, record.error
    groups, batch = _async_batch([record])
    assert list(batch.non_tensor_batch["tool_rewards"]) == [[0.25]]
    assert list(batch.non_tensor_batch["reward_scores"]) == [{"oracle": 2.0}]
    assert "rm_scores" not in batch.batch

    def tool_aware(data_source, solution_str, ground_truth, extra_info=None):
        return float(solution_str.endswith("15.")) + extra_info["rollout_reward_scores"]["oracle"] + sum(
            extra_info["tool_rewards"])

    assert NaiveRewardManager(tok, compute_score=tool_aware)(batch).sum().item() == 3.25  # 1 + 2.0 + 0.25
    assert NaiveRewardManager(tok)(batch).sum().item() == 1.0  # the final answer, as the sync trainer scores it

    # through a checkpoint: the replay buffer's trajectory shards keep them (read back with weights_only)
    buffer = object.__new__(ReplayBuffer)
    buffer.finished = groups
    buffer.save_trajectories(str(tmp_path), 0, 1)
    restored = ReplayBuffer.load_trajectories(str(tmp_path))[0][0]
    assert restored.agent_rewards == groups[0].trajectories[0].agent_rewards
    assert restored.agent_rewards["reward_scores"] == {"oracle": 2.0}

    def own(score):
        return _stream_record(AgentLoopOutput(prompt_ids=[1], response_ids=[3, 4], response_mask=[1, 1],
                                              response_logprobs=[-0.5, -0.5], reward_score=score))

    _, scored = _async_batch([own(0.5), own(-1.0)])
    assert scored.batch["rm_scores"][:, :3].tolist() == [[0.0, 0.5, 0.0], [0.0, -1.0, 0.0]]
    assert NaiveRewardManager(tok)(scored).sum(-1).tolist() == [0.5, -1.0]
    with pytest.raises(InputError, match=r"AgentLoopOutput.reward_score: expected every trajectory of a batch or "
                       r"none to carry the loop's own score, found 1 of 2"):
        _async_batch([own(0.5), own(None)])


def test_bypass_mode_over_a_batch_without_rollout_log_probs_is_one_line():
    """Was (sync trainer): a custom loop without log-probs left rollout_log_probs out of the batch and bypass mode
    failed on the missing field deep in the step (the async trainer's zeros: see the test above)."""
    import contextlib
    import types

    from verl.errors import InputError
    from verl.experimental.agent_loop import AgentLoopOutput, pad_outputs
    from verl.trainer.ppo.step import PPOStep

    outputs = [AgentLoopOutput(prompt_ids=[1], response_ids=[3, 4], response_mask=[1, 1]),
               AgentLoopOutput(prompt_ids=[1], response_ids=[3], response_mask=[1], response_logprobs=[-0.1])]
    batch = DataProto.from_dict(pad_outputs(outputs, 2, 3, 0))
    step = types.SimpleNamespace(sections=types.SimpleNamespace(trainer=types.SimpleNamespace(balance_batch=False)),
                                 use_rm=False, bypass_old_log_prob=True, _start_rewards=lambda batch: None,
                                 timer=lambda name: contextlib.nullcontext())
    with pytest.raises(InputError, match=r"^algorithm.rollout_correction.bypass_mode=true: expected the rollout's "
                       r"log-probs \(rollout_log_probs\) as the old policy's, found a batch without them"):
        PPOStep.experience(step, batch, {}, 0)
