"""`verl generate --engine megatron` entry point (main(argv)): JSON output and bad input."""

import json
import os

import pytest
import torch

pytest.importorskip("megatron.core")

from helpers.megatron_tiny_models import VOCAB, hf_model, save_hf  # noqa: E402
from helpers.tolerance import log_prob_tolerance  # noqa: E402

from verl.engine.megatron.generate import main  # noqa: E402


def test_greedy_json_matches_hf_generate(tmp_path):
    model = hf_model("llama_mha_tied", seed=3)
    model_dir = save_hf(model, str(tmp_path / "hf"), sharded=False)
    out = str(tmp_path / "out.json")
    assert main(["--model", model_dir, "--input-ids", "3,1,4,1,5", "--max-new-tokens", "5",
                 "--temperature", "0", "--json", out]) == 0
    result = json.load(open(out))
    hf = model.generate(torch.tensor([[3, 1, 4, 1, 5]]), do_sample=False, max_new_tokens=5, min_new_tokens=5,
                        pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    assert result["output_ids"] == [hf.sequences[0, 5:].tolist()]
    # raw logits: min_new_tokens masks EOS in the processed scores
    hf_logprobs = [torch.log_softmax(score[0], -1)[tok].item()
                   for score, tok in zip(hf.logits, hf.sequences[0, 5:], strict=True)]
    # Megatron's generation against transformers': another fp32 summation order over the tiny model (4 layers,
    # widest reduction the MLP's 64 terms, a log-softmax over VOCAB).
    tol = log_prob_tolerance(torch.float32, width=64, num_layers=4, vocab=VOCAB,
                             scale=max(1.0, max(abs(v) for v in hf_logprobs)))
    assert max(abs(a - b) for a, b in zip(result["logprobs"][0], hf_logprobs, strict=False)) <= tol


def test_sampling_temperature_is_rejected_with_exit_2(tmp_path, capsys):
    out = str(tmp_path / "out.json")
    assert main(["--model", str(tmp_path), "--input-ids", "1,2", "--max-new-tokens", "2",
                 "--temperature", "0.7", "--json", out]) == 2
    assert "--temperature: expected 0" in capsys.readouterr().err
    assert not os.path.exists(out)
