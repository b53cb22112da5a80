"""Rule-based rewards, the reward-function loader and NaiveRewardManager."""

import numpy as np
import pytest
import torch

from verl.protocol import DataProto, DataProtoError
from verl.utils.dataset.arithmetic import build_char_tokenizer
from verl.utils.reward_score import RewardFunctionError, arithmetic, default_compute_score, gsm8k, load_reward_fn
from verl.workers.reward_manager import NaiveRewardManager, get_reward_manager_cls


@pytest.mark.parametrize(
    "solution,truth,expected",
    [
        ("85", "85", 1.0),
        ("85 and more", "85", 1.0),  # the answer ends at the first non-digit
        (" 85", 85, 1.0),
        ("37+48=85", "85", 1.0),  # prompt included: read right after '='
        ("8", "85", 0.0),
        ("855", "85", 0.0),
        ("-7", "-7", 1.0),
        ("x85", "85", 0.0),
        ("", "85", 0.0),
        ("085", "85", 1.0),  # the same integer
        ("-0", "0", 1.0),
        ("9" * 5000, "85", 0.0),  # more digits than int() parses (4300): scored, not raised
        ("9" * 5000, "9" * 5000, 1.0),
    ],
)
def test_arithmetic_exact_match(solution, truth, expected):
    assert arithmetic.compute_score(solution, truth) == expected


def test_gsm8k_strict_and_flexible_extraction():
    assert gsm8k.compute_score("so 3 + 4 = 7\n#### 7", "7") == 1.0
    assert gsm8k.compute_score("#### 1,234", "1234") == 1.0
    assert gsm8k.compute_score("#### 5\n#### 8", "8") == 1.0  # the last one counts
    assert gsm8k.compute_score("the answer is 7", "7") == 0.0  # strict needs '#### '
    assert gsm8k.compute_score("#### 6", "7", format_score=0.1) == 0.1
    assert gsm8k.compute_score("3 apples, then 7", "7", method="flexible") == 1.0
    assert gsm8k.extract_solution("no numbers . here", method="flexible") is None
    with pytest.raises(ValueError, match="'strict' or 'flexible'"):
        gsm8k.extract_solution("1", method="loose")


def test_default_compute_score_dispatches_on_data_source():
    assert default_compute_score("openai/gsm8k", "#### 12", "12") == 1.0
    assert default_compute_score("arithmetic", "12", "12") == 1.0
    assert default_compute_score("arithmetic", "13", "12") == 0.0
    # The sentiment task's defining rule (what its validation reports): positive minus negative words.
    assert default_compute_score("sentiment", "great plot but slow and dull ending", "positive") == -1.0
    assert default_compute_score("sentiment", "good good fun", "positive") == 3.0
    with pytest.raises(NotImplementedError, match="no built-in reward for data_source 'lean'"):
        default_compute_score("lean", "x", "y")


def test_load_reward_fn_builtin_and_user_file(tmp_path):
    assert load_reward_fn(None) is default_compute_score
    builtin = load_reward_fn("arithmetic")
    assert builtin(data_source="anything", solution_str="5", ground_truth="5", extra_info=None) == 1.0

    user_file = tmp_path / "my_reward.py"
    user_file.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return {'score': float(len(solution_str)), 'length': len(solution_str)}\n"
        "def other(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return -1.0\n"
        "NOT_A_FUNCTION = 3\n"
    )
    assert load_reward_fn(str(user_file))("d", "abc", "x")["score"] == 3.0
    assert load_reward_fn(str(user_file), function_name="other")("d", "abc", "x") == -1.0
    with pytest.raises(RewardFunctionError, match="expected a function 'missing' in .*my_reward.py, found nothing"):
        load_reward_fn(str(user_file), function_name="missing")
    with pytest.raises(RewardFunctionError, match="found int"):
        load_reward_fn(str(user_file), function_name="NOT_A_FUNCTION")
    with pytest.raises(RewardFunctionError, match="found no file at .*nope.py"):
        load_reward_fn(str(tmp_path / "nope.py"))
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('boom')\n")
    with pytest.raises(RewardFunctionError, match="importing .*broken.py failed: RuntimeError: boom"):
        load_reward_fn(str(broken))


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(build_char_tokenizer(str(tmp_path_factory.mktemp("tok"))))


def scored_batch(tokenizer, responses_text, truths, data_sources=None):
    """Prompts left-padded to P=6, responses (+eos) right-padded to R=4, as a rollout returns them."""
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    P, R = 6, 4
    prompts, responses, masks = [], [], []
    for text in responses_text:
        p = tokenizer("12+3=", add_special_tokens=False)["input_ids"]
        r = tokenizer(text, add_special_tokens=False)["input_ids"] + [eos]
        r = r[:R]
        prompts.append([pad] * (P - len(p)) + p)
        responses.append(r + [pad] * (R - len(r)))
        masks.append([0] * (P - len(p)) + [1] * len(p) + [1] * len(r) + [0] * (R - len(r)))
    n = len(responses_text)
    return DataProto.from_dict(
        {
            "prompts": torch.tensor(prompts),
            "responses": torch.tensor(responses),
            "attention_mask": torch.tensor(masks),
        },
        {
            "data_source": np.array(data_sources or ["arithmetic"] * n, dtype=object),
            "reward_model": np.array([{"ground_truth": g} for g in truths], dtype=object),
        },
    )


def test_naive_reward_manager_scores_last_valid_token(tokenizer):
    data = scored_batch(tokenizer, ["15", "7", "15 9"], ["15", "15", "15"])
    # Valid response lengths: "15"+eos = 3, "7"+eos = 2, "15 9"+eos truncated to 4 tokens.
    reward = get_reward_manager_cls("naive")(tokenizer, num_examine=0)(data)
    assert reward.dtype == torch.float32
    torch.testing.assert_close(reward, torch.tensor([[0, 0, 1.0, 0], [0, 0, 0, 0], [0, 0, 0, 1.0]]))


def test_naive_reward_manager_collects_extra_info_and_passes_rm_scores(tokenizer):
    def score_with_details(data_source, solution_str, ground_truth, extra_info=None):
        return {"score": 0.5 if solution_str == ground_truth else -0.5, "pred": solution_str}

    data = scored_batch(tokenizer, ["15", "7"], ["15", "15"])
    out = NaiveRewardManager(tokenizer, compute_score=score_with_details)(data, return_dict=True)
    torch.testing.assert_close(out["reward_tensor"], torch.tensor([[0, 0, 0.5, 0], [0, -0.5, 0, 0]]))
    assert out["reward_extra_info"] == {"score": [0.5, -0.5], "pred": ["15", "7"]}

    data.batch["rm_scores"] = torch.full((2, 4), 2.0)
    assert NaiveRewardManager(tokenizer)(data) is data.batch["rm_scores"]


def test_naive_reward_manager_names_missing_fields(tokenizer):
    data = scored_batch(tokenizer, ["1"], ["1"])
    data.pop(non_tensor_batch_keys=["reward_model"])
    with pytest.raises(DataProtoError, match=r"expected fields \['reward_model'\]"):
        NaiveRewardManager(tokenizer)(data)
    with pytest.raises(ValueError, match="expected one of \\['naive'\\], found 'prime'"):
        get_reward_manager_cls("prime")


def test_naive_reward_manager_logs_num_examine_samples_per_source_at_info(tokenizer, caplog):
    def exact(data_source, solution_str, ground_truth, extra_info=None):
        return float(solution_str == ground_truth)

    data = scored_batch(tokenizer, ["15", "7", "16"], ["15", "15", "16"], ["a", "b", "a"])
    with caplog.at_level("INFO", logger="verl"):
        NaiveRewardManager(tokenizer, num_examine=1, compute_score=exact)(data)
    examined = [r for r in caplog.records if r.name == "verl.workers.reward_manager.naive"]
    assert [r.levelname for r in examined] == ["INFO", "INFO"]  # one per data source
    assert "[response] 15" in examined[0].getMessage() and "[response] 7" in examined[1].getMessage()
    caplog.clear()
    with caplog.at_level("WARNING", logger="verl"):  # the default level says nothing
        NaiveRewardManager(tokenizer, num_examine=1, compute_score=exact)(data)
    assert not caplog.records
