"""Partial rollout (verl.engine.rollout.partial) on the native engine: a generation interrupted and resumed by
re-prefilling the kept prefix continues the same trajectory, the stop rule ends a segment when it should, and
the finished groups become the rollout fields a synchronous rollout produces."""

import dataclasses

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from verl.engine.rollout.base import SamplingParams
from verl.engine.rollout.native.engine import NativeRollout
from verl.engine.rollout.partial import (
    PromptGroup,
    SegmentStop,
    groups_to_batch,
    merge_segment,
    run_segment,
    segment_inputs,
)
from verl.models.config import ModelConfig

pytestmark = pytest.mark.unit

VOCAB, PAD, EOS = 96, 0, 5


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         initializer_range=0.2)
    path = tmp_path_factory.mktemp("partial") / "tiny"
    Qwen2ForCausalLM(config).eval().save_pretrained(path)
    model_config = ModelConfig.from_pretrained(str(path))
    rollout = NativeRollout(model_config, dtype=torch.float32, pad_token_id=PAD)
    rollout.load_hf_checkpoint(str(path))
    return rollout


def _groups(n=2):
    prompts = [[11, 12, 13], [21, 22, 23, 24, 25], [31]]
    return [PromptGroup(uid=f"0-{i}", index=i, epoch=0, submit_step=1, prompt=p, fields={"data_source": "t"}, n=n)
            for i, p in enumerate(prompts)]


GREEDY = SamplingParams(do_sample=False, response_length=12, eos_token_id=(EOS,))


def test_interrupted_greedy_equals_uninterrupted(engine):
    """Greedy decoding stopped after every few tokens and resumed (prefix prefilled again) gives the tokens of
    one uninterrupted run; log-probs agree to fp32 rounding of a different order of the same sums (prefill vs
    decode attention over <= 17 positions, 2 layers of width <= 64): 1e-4 absolute on log-probs of magnitude
    < 10."""
    whole = _groups()
    while not all(g.finished for g in whole):
        run_segment(engine, whole, GREEDY, PAD, version=0, min_groups=len(whole))
    pieces = _groups()
    calls = {"count": 0}

    def abort_every_third_step():
        calls["count"] += 1
        return calls["count"] % 3 == 0

    segments = 0
    while not all(g.finished for g in pieces):
        run_segment(engine, pieces, GREEDY, PAD, version=segments, min_groups=len(pieces),
                    abort=abort_every_third_step)
        segments += 1
    assert segments > 2
    for a, b in zip(whole, pieces, strict=True):
        for ta, tb in zip(a.trajectories, b.trajectories, strict=True):
            assert ta.tokens == tb.tokens
            assert torch.allclose(torch.tensor(ta.log_probs), torch.tensor(tb.log_probs), atol=1e-4, rtol=0)
            assert len(tb.tokens) <= GREEDY.response_length
            assert tb.min_version == 0 and tb.max_version >= tb.min_version
    assert max(t.segments for g in pieces for t in g.trajectories) > 1


def test_stop_after_enough_groups_keeps_the_rest(engine):
    """min_groups=1: the segment ends as soon as one whole group finished; the others keep their prefix."""
    groups = _groups()
    sampling = dataclasses.replace(GREEDY, response_length=40)
    run_segment(engine, groups, sampling, PAD, version=3, min_groups=1)
    finished = [g for g in groups if g.finished]
    assert len(finished) >= 1
    for g in groups:
        for t in g.trajectories:
            assert t.min_version == 3 and t.max_version == 3
            if not t.finished:
                assert 0 < len(t.tokens) < 40 and t.tokens[-1] != EOS


def test_required_rows_finish_before_the_stop(engine):
    groups = _groups()
    sampling = dataclasses.replace(GREEDY, response_length=20)
    required = {groups[1].uid}
    run_segment(engine, groups, sampling, PAD, version=0, min_groups=0, required_uids=required)
    assert groups[1].finished


def test_segment_stop_rule():
    group = torch.tensor([0, 0, 1, 1, 2])
    rule = SegmentStop(group, min_groups=2)
    assert not rule.reached(torch.tensor([True, False, True, True, False]))
    assert rule.reached(torch.tensor([True, True, True, True, False]))
    required = SegmentStop(group, min_groups=1, required=torch.tensor([False, False, False, False, True]))
    assert not required.reached(torch.tensor([True, True, False, False, False]))
    assert required.reached(torch.tensor([True, True, False, False, True]))
    aborted = SegmentStop(group, min_groups=3, abort=lambda: True)
    assert aborted.reached(torch.zeros(5, dtype=torch.bool))


def test_budget_is_what_is_left_and_batch_fields():
    groups = _groups(n=1)
    inputs = segment_inputs(groups, response_length=6, pad=PAD)
    # A fake segment: row 0 stops on EOS after 2 tokens, row 1 is interrupted after 2, row 2 uses its budget.
    responses = torch.tensor([[7, EOS, 0, 0, 0, 0], [8, 9, 0, 0, 0, 0], [1, 2, 3, 4, 6, 7]])
    mask = (responses != 0).long()
    log_probs = -mask.float()
    merge_segment(groups, inputs, responses, mask, log_probs, (EOS,), version=4)
    assert [g.finished for g in groups] == [True, False, True]
    again = segment_inputs(groups, response_length=6, pad=PAD)
    assert again["limits"].tolist() == [4]
    assert again["input_ids"][0].tolist()[-7:] == [21, 22, 23, 24, 25, 8, 9]
    merge_segment(groups, again, torch.tensor([[EOS, 0, 0, 0]]), torch.tensor([[1, 0, 0, 0]]),
                  torch.tensor([[-0.5, 0, 0, 0]]), (EOS,), version=5)
    tensors, fields = groups_to_batch(groups, prompt_length=8, response_length=6, pad=PAD)
    assert tensors["responses"].shape == (3, 6) and tensors["input_ids"].shape == (3, 14)
    assert tensors["responses"][1].tolist() == [8, 9, EOS, 0, 0, 0]
    assert tensors["rollout_log_probs"][1].tolist() == [-1.0, -1.0, -0.5, 0.0, 0.0, 0.0]
    assert fields["min_global_steps"].tolist() == [4, 4, 4] and fields["max_global_steps"].tolist() == [4, 5, 4]
    assert fields["num_segments"].tolist() == [1, 2, 1]
    assert fields["uid"].tolist() == ["0-0", "0-1", "0-2"]
