"""Generative reward models (issue 47, item 2): an LLM judge served by the rollout registry's native engine, its
verdict parsed by a user function into the score; a verdict that times out or does not parse scores the default,
counted in reward_model/judge_default_frac; a template without {response} is one line before any rank starts."""

import subprocess
import sys
import time

import pytest
import torch
from helpers.judge_models import hf_greedy_verdict, save_judge
from helpers.reward_models import save_rm_tokenizer

TEMPLATE = "rate the answer {response} to {question} given {reference}"
PARSE = '''
def parse(verdict, *, question, response, reference, data_source, extra_info):
    if "x" in verdict:
        return None
    return float(len(verdict)) + (0.5 if reference == "4" else 0.0)
'''


def _section(template=TEMPLATE, parse_path=None, timeout_s=60.0, response_length=12, free=True, score_range=(-100, 100),
             prompt_length=200):
    from verl.workers.config.reward import RewardModelKeysConfig

    tree = {"enable": True, "enable_resource_pool": False, "n_gpus_per_node": 8, "nnodes": 0, "model_path": None,
            "rollout": {"name": "native", "dtype": "float32", "free_cache_engine": free,
                        "tensor_model_parallel_size": 1, "temperature": 1.0, "top_k": -1, "top_p": 1.0,
                        "do_sample": False, "prompt_length": prompt_length, "response_length": response_length,
                        "seed": 1},
            "judge": {"prompt_template": template, "parse_function": {"path": parse_path, "name": "parse"},
                      "default_score": -3.0, "timeout_s": timeout_s, "score_min": score_range[0],
                      "score_max": score_range[1]}}
    return RewardModelKeysConfig.from_tree(tree, "reward.reward_model")


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("judge")
    model = save_judge(str(root / "judge"), seed=3)
    save_rm_tokenizer(str(root / "actor_tok"), chat_template=None)  # the actor's: same characters, no template
    (root / "parse.py").write_text(PARSE)
    return root, model


def _batch(actor_tok, rows):
    """(fields, non_tensor) as the worker receives them: left-padded prompts, right-padded responses."""
    prompts = [actor_tok(p, add_special_tokens=False)["input_ids"] for p, _ in rows]
    responses = [actor_tok(r, add_special_tokens=False)["input_ids"] for _, r in rows]
    p_len, r_len = max(map(len, prompts)), max(map(len, responses))
    ids = torch.zeros(len(rows), p_len + r_len, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        ids[i, p_len - len(p):p_len] = torch.tensor(p)
        ids[i, p_len:p_len + len(r)] = torch.tensor(r)
        mask[i, p_len - len(p):p_len + len(r)] = 1
    non_tensor = {"raw_prompt": [[{"role": "user", "content": p}] for p, _ in rows],
                  "reward_model": [{"ground_truth": "4"}, {"ground_truth": "9"}, {"ground_truth": "4"}][:len(rows)],
                  "data_source": ["t"] * len(rows), "extra_info": [{}] * len(rows)}
    return {"input_ids": ids, "attention_mask": mask, "responses": ids[:, p_len:]}, non_tensor, r_len


ROWS = [("what is two plus two", "four"), ("nine", "it is nine"), ("say four", "")]


def _judge(root, section):
    from verl.workers.reward_judge import Judge
    from verl.workers.reward_model.plan import load_tokenizer

    return Judge(str(root / "judge"), section, load_tokenizer(str(root / "actor_tok"), "t"), seed=0)


def test_judge_verdicts_are_transformers_greedy_and_parsed_by_the_user_function(judge_dir):
    from verl.workers.reward_model.plan import load_tokenizer

    root, model = judge_dir
    judge = _judge(root, _section(parse_path=str(root / "parse.py")))
    assert judge.resident_bytes() == 0  # asleep until asked
    fields, non_tensor, r_len = _batch(judge.actor_tokenizer, ROWS)
    scores, metrics, texts = judge.score(fields, non_tensor, r_len)
    assert judge.resident_bytes() == 0  # asleep again after judging
    tok = load_tokenizer(str(root / "judge"), "t")
    expected, defaults, verdicts = [], 0, []
    for (question, response), info in zip(ROWS, non_tensor["reward_model"], strict=True):
        text = TEMPLATE.format(question=question, response=response, reference=info["ground_truth"])
        ids = tok(tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                          add_generation_prompt=True), add_special_tokens=False)["input_ids"]
        assert ids[-1] == tok.convert_tokens_to_ids("<|assistant|>")
        verdict = tok.decode(hf_greedy_verdict(model, tok, ids, 12), skip_special_tokens=True)
        verdicts.append(verdict)
        if "x" in verdict:
            defaults += 1
            expected.append(-3.0)
        else:
            expected.append(len(verdict) + (0.5 if info["ground_truth"] == "4" else 0.0))
    assert texts == verdicts
    assert scores.tolist() == pytest.approx(expected)
    assert metrics["reward_model/judge_default_frac"] == pytest.approx(defaults / 3)
    assert metrics["reward_model/judge_timeout_frac"] == 0.0


def test_a_judge_past_its_timeout_scores_the_default_without_waiting(judge_dir):
    root, model = judge_dir
    # 400 new tokens would take seconds; the deadline stops the call after its first decode step.
    judge = _judge(root, _section(parse_path=str(root / "parse.py"), timeout_s=1e-6, response_length=300))
    fields, non_tensor, r_len = _batch(judge.actor_tokenizer, ROWS)
    start = time.monotonic()
    scores, metrics, _ = judge.score(fields, non_tensor, r_len)
    assert time.monotonic() - start < 5.0
    assert scores.tolist() == [-3.0, -3.0, -3.0]
    assert metrics["reward_model/judge_timeout_frac"] == 1.0
    assert metrics["reward_model/judge_default_frac"] == 1.0


def test_unparseable_and_wrongly_typed_verdicts(judge_dir, tmp_path):
    from verl.workers.reward_judge import JudgeParseError, parse_verdict

    root, _ = judge_dir
    (tmp_path / "none.py").write_text("def parse(verdict, **ctx):\n    return None\n")
    (tmp_path / "text.py").write_text("def parse(verdict, **ctx):\n    return 'good'\n")
    judge = _judge(root, _section(parse_path=str(tmp_path / "none.py"), free=False))
    fields, non_tensor, r_len = _batch(judge.actor_tokenizer, ROWS[:2])
    scores, metrics, _ = judge.score(fields, non_tensor, r_len)
    assert scores.tolist() == [-3.0, -3.0] and metrics["reward_model/judge_unparsed_frac"] == 1.0
    assert judge.resident_bytes() >= judge.weight_bytes > 0  # free_cache_engine=false: stays awake
    judge = _judge(root, _section(parse_path=str(tmp_path / "text.py")))
    with pytest.raises(JudgeParseError, match=r"expected a number or None .* found str 'good' for row 0"):
        judge.score(fields, non_tensor, r_len)
    assert parse_verdict("Score: 3 then 7.5") == 7.5 and parse_verdict("no digits") is None


@pytest.mark.parametrize("template, found", [("rate {question}", "found {question}"),
                                             ("rate {answer} {response}", "found {answer}"),
                                             ("rate {response", "does not parse")])
def test_bad_templates_are_one_config_error(template, found):
    from verl.utils.config_checks import ConfigError
    from verl.workers.reward_judge import template_fields

    with pytest.raises(ConfigError, match="reward.reward_model.judge.prompt_template") as info:
        template_fields(template)
    assert found in str(info.value) and "\n" not in str(info.value)


def test_verl_train_refuses_a_template_without_response_before_any_rank_starts(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "verl.cli", "train", "--config", "configs/ppo_arith_tiny.yaml",
         "reward.reward_model.enable=true", "reward.reward_model.judge.prompt_template='rate {question}'",
         f"trainer.default_local_dir={tmp_path / 'ckpt'}"],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "expected a {response} placeholder" in lines[0], proc.stderr
    assert not (tmp_path / "ckpt").exists()


# ----------------------------------------------------------------------------- issue 56, fault 8
def test_a_huge_parsed_score_is_clamped_to_the_declared_range(judge_dir, tmp_path):
    """Was: any finite number was the reward ("Score: 1e300" became 1e300 in the advantages)."""
    root, _ = judge_dir
    (tmp_path / "huge.py").write_text("def parse(verdict, **ctx):\n"
                                      "    return 1e300 if ctx['reference'] == '4' else -7.0\n")
    judge = _judge(root, _section(parse_path=str(tmp_path / "huge.py"), score_range=(0.0, 1.0), response_length=1))
    fields, non_tensor, r_len = _batch(judge.actor_tokenizer, ROWS[:2])
    scores, metrics, _ = judge.score(fields, non_tensor, r_len)
    assert scores.tolist() == [1.0, 0.0]
    assert metrics["reward_model/judge_clamped_frac"] == 1.0


def test_the_default_parse_of_score_1e300_is_clamped_too(judge_dir):
    from verl.workers.reward_judge import parse_verdict

    assert parse_verdict("Score: 1e300") == 1e300  # the parse reads it; the judge's range bounds it
    root, _ = judge_dir
    judge = _judge(root, _section(score_range=(0.0, 10.0), response_length=1))
    judge.parse = lambda verdict, **ctx: parse_verdict("Score: 1e300")
    fields, non_tensor, r_len = _batch(judge.actor_tokenizer, ROWS[:1])
    scores, _, _ = judge.score(fields, non_tensor, r_len)
    assert scores.tolist() == [10.0]


def test_score_min_must_be_below_score_max():
    from verl.utils.config_checks import ConfigError

    with pytest.raises(ConfigError, match=r"reward.reward_model.judge.score_min: expected less than "
                       r"reward.reward_model.judge.score_max=1.0, found 2.0"):
        _section(score_range=(2.0, 1.0))


def test_a_long_response_is_cut_in_its_middle_never_the_instructions_or_the_reference(judge_dir):
    """Was: the prompt lost tokens from its left, so a long response pushed out the instructions."""
    root, _ = judge_dir
    template = "judge this answer {response} the reference is {reference} done"
    judge = _judge(root, _section(template=template, prompt_length=120, response_length=1))
    response = "a" * 60 + "b" * 300 + "c" * 60
    ids, cut = judge.fit("q", response, "4", 120)
    assert cut and len(ids) <= 120
    text = judge.tokenizer.decode(ids, skip_special_tokens=True)  # (this tokenizer has no space)
    assert text.startswith("judgethisansweraaaa") and text.endswith("ccccthereferenceis4done")
    assert "truncated" in text and "bbbb" not in text  # the middle went, both ends stayed
    ids, cut = judge.fit("q", "short", "4", 120)
    assert not cut and "short" in judge.tokenizer.decode(ids, skip_special_tokens=True)


def test_instructions_that_alone_exceed_the_prompt_length_are_one_line(judge_dir):
    from verl.errors import InputError

    root, _ = judge_dir
    judge = _judge(root, _section(template="x" * 200 + " {response}", prompt_length=50, response_length=1))
    with pytest.raises(InputError, match=r"expected room for the judge template's instructions and reference "
                       r"\(\d+ tokens with an empty response and question\), found prompt_length=50"):
        judge.fit("q", "r" * 100, None, 50)
