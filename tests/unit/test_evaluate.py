"""Greedy held-out accuracy (verl.trainer.evaluate) with fake generators and a fake rollout engine."""

import os

import pytest
import torch

from verl.trainer.evaluate import EvaluationError, greedy_accuracy, load_eval_set, main, rollout_generate
from verl.utils.dataset import arithmetic


@pytest.fixture(scope="module")
def arith_dir(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("arith"))
    arithmetic.main(["--out", out, "--num-train", "8", "--num-test", "6"])
    return out


@pytest.fixture(scope="module")
def tokenizer(arith_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.path.join(arith_dir, "tokenizer"))


def _oracle(prompt: str) -> str:
    a, b = prompt.rstrip("=").split("+")
    return str(int(a) + int(b))


def test_accuracy_is_the_fraction_of_exact_matches():
    prompts = ["10+10=", "11+11=", "12+12=", "13+13="]
    truths = ["20", "22", "24", "26"]
    answers = {"10+10=": "20", "11+11=": "22 ", "12+12=": "25", "13+13=": "2"}
    assert greedy_accuracy(prompts, truths, lambda batch: [answers[p] for p in batch]) == 0.5


def test_generate_is_called_in_batches_of_at_most_batch_size():
    calls = []

    def generate(batch):
        calls.append(len(batch))
        return [_oracle(p) for p in batch]

    prompts = [f"{a}+10=" for a in range(10, 17)]
    assert greedy_accuracy(prompts, [str(a + 10) for a in range(10, 17)], generate, batch_size=3) == 1.0
    assert calls == [3, 3, 1]


def test_custom_score_and_data_sources_are_passed_through():
    seen = []

    def score(source, response, truth):
        seen.append(source)
        return 1.0 if response == truth else 0.0

    acc = greedy_accuracy(["a", "b"], ["x", "y"], lambda batch: ["x", "z"], data_sources=["s1", "s2"], score=score)
    assert acc == 0.5 and seen == ["s1", "s2"]


@pytest.mark.parametrize("truths, responses, message", [
    (["1"], None, "ground_truths"),
    (["1", "2"], ["1"], "generate: expected 2 responses"),
])
def test_mismatched_lengths_raise_one_clear_error(truths, responses, message):
    with pytest.raises(EvaluationError, match=message):
        greedy_accuracy(["1+0=", "2+0="], truths, lambda batch: responses)


def test_eval_set_reads_prompts_and_ground_truths_from_verl_parquet(arith_dir, tokenizer):
    eval_set = load_eval_set(os.path.join(arith_dir, "test.parquet"), tokenizer, n=4)
    assert len(eval_set) == 4 and eval_set.data_sources == ["arithmetic"] * 4
    pairs = zip(eval_set.prompts, eval_set.ground_truths, strict=True)
    assert all(p.endswith("=") and _oracle(p) == t for p, t in pairs)


class FakeRollout:
    """Answers every prompt correctly, then eos, then a token that must be cut off."""

    def __init__(self, tokenizer, wrong_rows=()):
        self.tokenizer, self.wrong_rows, self.seen = tokenizer, set(wrong_rows), []

    def generate(self, input_ids, attention_mask, params, pad_token_id=None):
        self.seen.append((input_ids.clone(), attention_mask.clone(), params))
        rows = []
        for i, (ids, mask) in enumerate(zip(input_ids, attention_mask, strict=False)):
            prompt = self.tokenizer.decode(ids[mask.bool()].tolist())
            answer = str(int(_oracle(prompt)) + (1 if i in self.wrong_rows else 0))
            rows.append(self.tokenizer(answer, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id])
        width = params.response_length
        responses = torch.full((len(rows), width), self.tokenizer.convert_tokens_to_ids("7"))
        mask = torch.zeros(len(rows), width, dtype=torch.int64)
        for i, row in enumerate(rows):
            responses[i, :len(row)] = torch.tensor(row)
            mask[i, :len(row)] = 1
        return {"responses": responses, "response_mask": mask}


def test_rollout_generate_left_pads_greedy_and_cuts_at_eos(tokenizer):
    rollout = FakeRollout(tokenizer, wrong_rows={1})
    generate = rollout_generate(rollout, tokenizer, max_new_tokens=6)
    assert generate(["5+7=", "12+30=", "99+99="]) == ["12", "43", "198"]
    input_ids, attention_mask, params = rollout.seen[0]
    assert params.greedy and params.stop_ids == (tokenizer.eos_token_id,) and params.response_length == 6
    assert attention_mask.tolist()[0] == [0, 0, 1, 1, 1, 1]  # left padding
    assert int(input_ids[0, 0]) == tokenizer.pad_token_id
    acc = greedy_accuracy(["5+7=", "12+30=", "99+99="], ["12", "42", "198"], generate)
    assert acc == pytest.approx(2 / 3)


def test_cli_with_a_missing_model_exits_2_with_one_line(arith_dir, tmp_path, capsys):
    assert main(["--model", str(tmp_path / "nope"), "--data", os.path.join(arith_dir, "test.parquet")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("verl eval: --model")


def test_rollout_generate_gives_a_templateless_base_model_its_bos():
    """Gemma 3's tokenizer has no chat template: its rendered prompts get its <bos>, as the RL dataset gives them."""
    from helpers.gemma3_model import gemma3_dir
    from transformers import AutoTokenizer

    gemma = AutoTokenizer.from_pretrained(gemma3_dir())

    class Recording:
        def generate(self, input_ids, attention_mask, params, pad_token_id=None):
            self.ids = input_ids[attention_mask.bool()].tolist()
            return {"responses": torch.tensor([[gemma.eos_token_id]]),
                    "response_mask": torch.ones(1, 1, dtype=torch.int64)}

    rollout = Recording()
    rollout_generate(rollout, gemma, max_new_tokens=1)(["The capital of France is"])
    assert rollout.ids == gemma("The capital of France is").input_ids and rollout.ids[0] == gemma.bos_token_id
