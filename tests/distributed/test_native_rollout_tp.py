"""The native rollout engine at rollout TP 2 and 4, through `verl generate` (gloo, file rendezvous).

Each case runs the CLI as a subprocess that spawns the TP ranks; HF transformers on the same
checkpoint is the oracle. TP 4 over 2 KV heads exercises KV-head replication, and TP > 1 splits
the (padded) vocabulary of both the embedding and the logits.
"""

import json
import os
import signal
import subprocess
import sys

import pytest
import torch
from helpers.tolerance import log_prob_tolerance
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROMPTS = [[11, 12, 13], [21, 22, 23, 24, 25, 26], [31]]
TIMEOUT_S = 120
VOCAB = 320


def log_prob_tol(reference: torch.Tensor) -> float:
    """The rollout's log-probs against transformers': same weights, another fp32 summation order (KV-cache
    decoding, TP shards). 2 layers, widest reduction the MLP's 128 terms, a log-softmax over VOCAB;
    initializer_range 0.2 makes logits larger than 1, so the scale is the reference's magnitude."""
    return log_prob_tolerance(torch.float32, width=128, num_layers=2, vocab=VOCAB,
                              scale=max(1.0, float(reference.abs().max())))


def build_hf(path, family, kv_heads, tied, seed=0):
    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=kv_heads, tie_word_embeddings=tied,
                  max_position_embeddings=256, initializer_range=0.2)
    model = (Qwen2ForCausalLM(Qwen2Config(**common)) if family == "qwen2"
             else LlamaForCausalLM(LlamaConfig(**common))).eval()
    model.save_pretrained(path)
    return model


def left_padded():
    width = max(map(len, PROMPTS))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in PROMPTS])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in PROMPTS])
    return ids, mask


def run_generate(model_dir, tmp_path, tp, *extra):
    output = tmp_path / f"tp{tp}.json"
    cmd = [sys.executable, "-m", "verl.trainer.main_generation", "--engine", "native", "--model", model_dir,
           "--tp", str(tp), "--json", str(output), *extra]
    for prompt in PROMPTS:
        cmd += ["--input-ids", ",".join(map(str, prompt))]
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)  # the launcher forwards it to the ranks
        try:
            log, _ = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            log, _ = proc.communicate()
        pytest.fail(f"verl generate --tp {tp} did not finish in {TIMEOUT_S}s:\n{log}")
    assert proc.returncode == 0, log
    with open(output, encoding="utf-8") as fh:
        return json.load(fh)


@pytest.mark.parametrize("family,kv_heads,tied,tp", [
    ("qwen2", 2, False, 2),  # one KV head per rank
    ("llama", 2, True, 4),   # each KV head replicated on two ranks; tied embeddings
])
def test_tp_greedy_ids_and_logprobs_equal_hf(tmp_path, family, kv_heads, tied, tp):
    model = build_hf(tmp_path / "model", family, kv_heads, tied)
    steps = 12
    result = run_generate(str(tmp_path / "model"), tmp_path, tp, "--temperature", "0", "--max-new-tokens", str(steps))
    ids, mask = left_padded()
    with torch.no_grad():
        hf = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=steps,
                            output_scores=True, return_dict_in_generate=True, pad_token_id=0)
    hf_ids = hf.sequences[:, ids.shape[1]:]
    hf_log_probs = torch.stack(hf.scores, 1).log_softmax(-1).gather(-1, hf_ids[..., None]).squeeze(-1)
    assert result["output_ids"] == hf_ids.tolist()
    assert (torch.tensor(result["logprobs"]) - hf_log_probs).abs().max() <= log_prob_tol(hf_log_probs)


def test_tp_sampling_ranks_agree_on_tokens_without_a_seed(tmp_path):
    """Had the ranks drawn different tokens, their all-reduces would mix two sequences and rank 0's
    logprobs would not match HF teacher-forced on rank 0's own output."""
    model = build_hf(tmp_path / "model", "qwen2", 2, False, seed=1)
    temperature = 0.8
    result = run_generate(str(tmp_path / "model"), tmp_path, 2, "--temperature", str(temperature),
                          "--max-new-tokens", "10", "--n", "2")
    assert len(result["output_ids"]) == 2 * len(PROMPTS)
    for row, (tokens, log_probs) in enumerate(zip(result["output_ids"], result["logprobs"], strict=False)):
        prompt = PROMPTS[row // 2]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
        expected = (logits / temperature).log_softmax(-1).gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)
        assert (torch.tensor(log_probs) - expected).abs().max() <= log_prob_tol(expected), row


@pytest.mark.parametrize("name,tp", [("qwen3_moe", 2)])
def test_moe_tp_greedy_ids_and_logprobs_equal_hf(tmp_path, name, tp):
    """Every expert split over the rollout TP ranks (its moe_intermediate_size / tp slice), the router
    replicated: greedy ids and log-probs = HF's (TP 4, KV-head replication, is the dense tests' case)."""
    from helpers.moe_models import save_model

    model = save_model(name, tmp_path / "model")
    steps = 12
    result = run_generate(str(tmp_path / "model"), tmp_path, tp, "--temperature", "0", "--max-new-tokens", str(steps))
    ids, mask = left_padded()
    with torch.no_grad():
        hf = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=steps,
                            output_scores=True, return_dict_in_generate=True, pad_token_id=0)
    hf_ids = hf.sequences[:, ids.shape[1]:]
    hf_log_probs = torch.stack(hf.scores, 1).log_softmax(-1).gather(-1, hf_ids[..., None]).squeeze(-1)
    assert result["output_ids"] == hf_ids.tolist()
    tol = log_prob_tolerance(torch.float32, width=64, num_layers=4, vocab=model.config.vocab_size,
                             scale=max(1.0, float(hf_log_probs.abs().max())))
    assert (torch.tensor(result["logprobs"]) - hf_log_probs).abs().max() <= tol
