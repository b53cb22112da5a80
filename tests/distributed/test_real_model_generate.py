"""`verl generate` on a real pretrained chat model (SmolLM2-135M-Instruct, tests/helpers/real_model.py) against
transformers: the native engine at rollout TP 3 (3 query heads and 1 KV head per rank, the tied vocab split in
three), the Megatron engine at PP 2 given several prompts, and the layout the checkpoint cannot take refused."""

import json
import subprocess
import sys

import pytest
import torch
from helpers.real_model import IM_END, chat_prompts, check_against_hf, smollm2_dir
from helpers.tolerance import log_prob_tolerance

NEW_TOKENS = 12  # "17 + 25 = 32.<|im_end|>" is 12 tokens
# Another fp32 summation order (3 ranks' partial sums, Megatron's kernels) than transformers' over 30 layers whose
# widest reduction is the MLP's 1536 terms, then a log-softmax over 49152 logits (unit-RMS activations: scale 1).
TOL = log_prob_tolerance(torch.float32, width=1536, num_layers=30, vocab=49152)


@pytest.fixture(scope="module")
def real():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = smollm2_dir()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model_dir, hf, chat_prompts(tokenizer)


def _generate(engine, model_dir, prompts, tmp_path, *extra):
    out = tmp_path / f"{engine}.json"
    cmd = [sys.executable, "-m", "verl.trainer.main_generation", "--engine", engine, "--model", model_dir,
           "--json", str(out), "--temperature", "0", "--max-new-tokens", str(NEW_TOKENS), *extra]
    for prompt in prompts:
        cmd += ["--input-ids", ",".join(map(str, prompt))]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def _hf_greedy(hf, prompt):
    x = torch.tensor([prompt])
    row = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW_TOKENS, do_sample=False,
                      pad_token_id=IM_END, eos_token_id=IM_END)[0, len(prompt):].tolist()
    return row[:row.index(IM_END) + 1] if IM_END in row else row


def test_native_tp3_greedy_equals_transformers(real, tmp_path):
    model_dir, hf, prompts = real
    result = _generate("native", model_dir, prompts, tmp_path, "--tp", "3")
    assert result["output_ids"] == [_hf_greedy(hf, p) for p in prompts]
    check_against_hf(hf, prompts, result["output_ids"], result["logprobs"], TOL)


def test_megatron_generates_for_every_prompt_and_stops_at_eos(real, tmp_path):
    """Three --input-ids are three answers (not the last prompt's alone), each cut after <|im_end|>."""
    model_dir, hf, prompts = real
    result = _generate("megatron", model_dir, prompts, tmp_path, "--pp", "2")
    want = [_hf_greedy(hf, p) for p in prompts]
    assert IM_END in want[0]  # the arithmetic answer ends its turn within NEW_TOKENS
    assert result["output_ids"] == want
    check_against_hf(hf, prompts, result["output_ids"], result["logprobs"], TOL)


@pytest.mark.parametrize("engine", ["native", "megatron", "sglang"])
def test_tp_the_heads_cannot_take_is_one_line_and_exit_2(real, tmp_path, engine):
    """9 query heads over 3 KV heads cannot be split in two: refused before any rank or SGLang starts."""
    model_dir = real[0]
    proc = subprocess.run([sys.executable, "-m", "verl.trainer.main_generation", "--engine", engine, "--model",
                           model_dir, "--tp", "2", "--input-ids", "1,2", "--max-new-tokens", "2", "--temperature", "0",
                           "--json", str(tmp_path / "out.json")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "num_attention_heads=9" in lines[0], proc.stderr
    assert not (tmp_path / "out.json").exists()
