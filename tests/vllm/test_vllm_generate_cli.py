"""`verl generate --engine vllm`: the same prompts and JSON as `--engine native`, through real vLLM.

The command runs under .venv's python, where vllm is not importable, so it re-runs itself with the vLLM environment's
python (VERL_VLLM_PYTHON): the route a user of the project venv takes. Greedy ids equal the native engine's on a tiny
random Qwen2 (head_dim 64, the smallest vLLM's CPU attention takes); log-probs within 1e-4. Bad input is one line
and exit 2 before vLLM starts.
"""

import json

import pytest
import torch
from helpers import generate_cli
from helpers.generate_cli import PROMPTS, engine_vs_native, max_logprob_diff

NEW_TOKENS = 12
LOGPROB_ATOL = 1e-4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    path = tmp_path_factory.mktemp("generate-cli") / "qwen2"
    config = Qwen2Config(vocab_size=320, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                         initializer_range=0.2, bos_token_id=None, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(11)
    Qwen2ForCausalLM(config).save_pretrained(path)
    return str(path)


def test_vllm_greedy_ids_equal_native_through_verl_generate(vllm_python, model_dir, tmp_path):
    common = ["--temperature", "0", "--max-new-tokens", str(NEW_TOKENS)]
    results = engine_vs_native("vllm", model_dir, tmp_path, common, "VERL_VLLM_PYTHON", vllm_python, threads=2)
    assert [len(row) for row in results["vllm"]["output_ids"]] == [NEW_TOKENS] * len(PROMPTS)
    assert results["vllm"]["output_ids"] == results["native"]["output_ids"]
    assert max_logprob_diff(results["vllm"], results["native"]) <= LOGPROB_ATOL


def test_vllm_tp2_runs_its_own_workers_and_equals_native(vllm_python, model_dir, tmp_path):
    """``verl generate --engine vllm --tp 2``: one process driving vLLM's own two TP worker processes on the
    checkpoint (its multiprocessing executor), greedy ids equal to the native engine's at TP 1."""
    common = ["--temperature", "0", "--max-new-tokens", str(NEW_TOKENS)]
    proc = generate_cli.verl_generate("native", model_dir, tmp_path / "native.json", *common)
    assert proc.returncode == 0, proc.stderr[-4000:]
    native = json.loads((tmp_path / "native.json").read_text())
    proc = generate_cli.verl_generate("vllm", model_dir, tmp_path / "tp2.json", *common, "--tp", "2",
                                      python_var="VERL_VLLM_PYTHON", python=vllm_python, threads=2)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "tensor_parallel_size=2" in proc.stdout + proc.stderr  # vLLM says so: not a silent TP 1
    tp2 = json.loads((tmp_path / "tp2.json").read_text())
    assert tp2["output_ids"] == native["output_ids"]
    assert max_logprob_diff(tp2, native) <= LOGPROB_ATOL


@pytest.mark.parametrize("extra,message", [
    (["--tp", "3"], "expected a divisor of the model's sizes"),
    (["--input-ids", ""], "empty prompt"),
])
def test_bad_vllm_inputs_give_one_error_line_before_vllm_starts(model_dir, tmp_path, extra, message):
    proc = generate_cli.verl_generate("vllm", model_dir, tmp_path / "out.json", *extra,
                                      python_var="VERL_VLLM_PYTHON", python="/nonexistent/python", timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("verl generate: error:") and message in lines[0], proc.stderr
