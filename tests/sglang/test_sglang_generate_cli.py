"""`verl generate --engine sglang`: the same prompts and JSON as `--engine native`, through real SGLang.

The command runs under .venv's python, where sglang is not importable, so it re-runs itself with the
SGLang environment's python (VERL_SGLANG_PYTHON): the route a user of the project venv takes.
Greedy ids must equal the native engine's on a tiny random Qwen2 at rollout TP 2 (SGLang's two
worker processes vs two native gloo ranks); logprobs within 1e-4.
"""

import json
import os
import subprocess
import sys

import pytest
import torch
from helpers import generate_cli
from helpers.generate_cli import PROMPTS, REPO, engine_vs_native, max_logprob_diff

NEW_TOKENS = 12
TP = 2
LOGPROB_ATOL = 1e-4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    path = tmp_path_factory.mktemp("generate-cli") / "qwen2"
    config = Qwen2Config(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         initializer_range=0.2, bos_token_id=None, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(11)
    Qwen2ForCausalLM(config).save_pretrained(path)
    return str(path)


def verl_generate(engine, model_dir, out, *extra, sglang_python=None, timeout=300):
    return generate_cli.verl_generate(engine, model_dir, out, *extra, python_var="VERL_SGLANG_PYTHON",
                                      python=sglang_python, timeout=timeout)


def test_sglang_greedy_ids_equal_native_through_verl_generate(sglang_python, model_dir, tmp_path):
    common = ["--tp", str(TP), "--temperature", "0", "--max-new-tokens", str(NEW_TOKENS)]
    results = engine_vs_native("sglang", model_dir, tmp_path, common, "VERL_SGLANG_PYTHON", sglang_python)
    assert [len(row) for row in results["sglang"]["output_ids"]] == [NEW_TOKENS] * len(PROMPTS)
    assert results["sglang"]["output_ids"] == results["native"]["output_ids"]
    assert max_logprob_diff(results["sglang"], results["native"]) <= LOGPROB_ATOL


@pytest.mark.parametrize("extra,message", [
    (["--tp", "4"], "expected a tp dividing num_key_value_heads=2"),  # native replicates KV heads; SGLang on CPU pads
    (["--tp", "3"], "tp"),
    (["--input-ids", ""], "empty prompt"),
])
def test_bad_sglang_inputs_give_one_error_line_before_sglang_starts(model_dir, tmp_path, extra, message):
    proc = verl_generate("sglang", model_dir, tmp_path / "out.json", *extra, sglang_python="/nonexistent/python",
                         timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("verl generate: error:") and message in lines[0], proc.stderr


def test_sglang_runs_an_all_sparse_qwen3_moe_as_transformers_and_refuses_dense_layers(sglang_python, tmp_path):
    """Qwen3-MoE through SGLang's fused-MoE layer on CPU (every layer sparse, top-k renormalised as Qwen3-30B-A3B;
    HF's raw top-k weights were checked the same way by hand): greedy ids = transformers'; a checkpoint with a
    dense layer among MoE ones is one line and exit 2 (SGLang 0.5.x diverges from transformers on it)."""
    sys.path.insert(0, os.path.join(REPO, "tests"))
    from helpers.moe_models import CONFIGS, save_model

    CONFIGS.setdefault("qwen3_moe_all_sparse_norm", dict(CONFIGS["qwen3_moe_raw"], norm_topk_prob=True))
    prompt = [11, 12, 13, 40]
    for name in ("qwen3_moe_all_sparse_norm",):
        model = save_model(name, tmp_path / name)
        with torch.no_grad():
            hf = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=NEW_TOKENS, pad_token_id=0)
        out = tmp_path / f"{name}.json"
        cmd = [sys.executable, "-m", "verl.trainer.main_generation", "--engine", "sglang", "--model",
               str(tmp_path / name), "--json", str(out), "--tp", "1", "--temperature", "0", "--max-new-tokens",
               str(NEW_TOKENS), "--input-ids", ",".join(map(str, prompt))]
        env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1", VERL_SGLANG_PYTHON=sglang_python)
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-4000:]
        assert json.loads(out.read_text())["output_ids"] == [hf[0, len(prompt):].tolist()], name
    save_model("qwen3_moe", tmp_path / "mixed")
    cmd[cmd.index("--model") + 1] = str(tmp_path / "mixed")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "expected every layer sparse for the SGLang rollout" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
