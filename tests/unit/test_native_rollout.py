"""The native rollout engine at rollout TP 1, against HF transformers as the oracle.

Tiny random Qwen2/Llama checkpoints are written with ``save_pretrained`` and read back through the
production loader (``load_hf_checkpoint``), so the loader, the layout and the forward are all under
test. HF's ``generate`` gives the greedy ids, and ``log_softmax`` of its scores the logprobs.
"""

import dataclasses

import numpy as np
import pytest
import torch
from helpers.tolerance import log_prob_tolerance
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from verl.engine.rollout.base import RolloutInputError, SamplingParams
from verl.engine.rollout.native.engine import NativeRollout
from verl.engine.rollout.native.sampler import sample_tokens, truncation_mask
from verl.engine.rollout.native.weights import CheckpointError
from verl.models.config import ModelConfig

VOCAB = 320
PAD = 0
# Left-padded prompts of lengths 3, 6 and 1.
PROMPTS = torch.tensor([[0, 0, 0, 11, 12, 13], [21, 22, 23, 24, 25, 26], [0, 0, 0, 0, 0, 31]])
MASK = (torch.arange(6)[None, :] >= torch.tensor([[3], [0], [5]])).long()


def log_prob_tol(reference: torch.Tensor) -> float:
    """The rollout's log-probs against transformers': same weights, another fp32 summation order (KV-cache
    decoding, other kernels). 2 layers, widest reduction the MLP's 128 terms, a log-softmax over VOCAB;
    initializer_range 0.2 makes logits larger than 1, so the scale is the reference's magnitude."""
    return log_prob_tolerance(torch.float32, width=128, num_layers=2, vocab=VOCAB,
                              scale=max(1.0, float(reference.abs().max())))


def build_hf(tmp_path, family="qwen2", kv_heads=2, tied=False, rope_theta=10000.0, seed=0):
    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=kv_heads, tie_word_embeddings=tied,
                  max_position_embeddings=256, initializer_range=0.2, rope_theta=rope_theta)
    if family == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common))
    model = model.eval()
    path = tmp_path / f"{family}-kv{kv_heads}-{'tied' if tied else 'untied'}-{seed}"
    model.save_pretrained(path)
    # The HF config writes theta under rope_parameters; take it from the HF model explicitly.
    config = dataclasses.replace(ModelConfig.from_pretrained(str(path)), rope_theta=rope_theta)
    return model, str(path), config


def native_engine(path, config, dtype=torch.float32):
    engine = NativeRollout(config, dtype=dtype, pad_token_id=PAD)
    engine.load_hf_checkpoint(path)
    return engine


def hf_greedy(model, steps, eos=None):
    with torch.no_grad():
        out = model.generate(input_ids=PROMPTS, attention_mask=MASK, do_sample=False, max_new_tokens=steps,
                             output_scores=True, return_dict_in_generate=True, pad_token_id=PAD,
                             eos_token_id=eos)
    responses = out.sequences[:, PROMPTS.shape[1]:]
    log_probs = torch.stack(out.scores, 1).float().log_softmax(-1).gather(-1, responses[..., None]).squeeze(-1)
    return responses, log_probs


@pytest.fixture(scope="module", autouse=True)
def one_intra_op_thread():
    # Tiny models are latency-bound; on a shared 2-core machine extra OpenMP threads only spin.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return build_hf(tmp_path_factory.mktemp("qwen"), "qwen2", kv_heads=2, tied=False, rope_theta=5000.0)


@pytest.mark.parametrize("family,kv_heads,tied", [
    ("qwen2", 2, False), ("qwen2", 4, True), ("llama", 2, True), ("llama", 4, False)])
def test_greedy_ids_and_logprobs_equal_hf_for_left_padded_batch(tmp_path, family, kv_heads, tied):
    model, path, config = build_hf(tmp_path, family, kv_heads, tied, rope_theta=20000.0 if tied else 10000.0)
    out = native_engine(path, config).generate(PROMPTS, MASK, SamplingParams(temperature=0, response_length=24))
    hf_ids, hf_log_probs = hf_greedy(model, 24)
    assert torch.equal(out["responses"], hf_ids)
    assert (out["rollout_log_probs"] - hf_log_probs).abs().max() <= log_prob_tol(hf_log_probs)
    assert bool(out["response_mask"].all())


def test_output_fields_join_prompt_and_response(qwen):
    model, path, config = qwen
    out = native_engine(path, config).generate(PROMPTS, MASK, SamplingParams(temperature=0, response_length=5))
    assert torch.equal(out["prompts"], PROMPTS)
    assert torch.equal(out["input_ids"], torch.cat([PROMPTS, out["responses"]], -1))
    assert torch.equal(out["attention_mask"], torch.cat([MASK, out["response_mask"]], -1))
    # Positions count real tokens only: row 0 has 3 prompt tokens, so its response starts at 3.
    assert out["position_ids"][0].tolist() == [0, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7]
    assert out["position_ids"][1].tolist() == list(range(11))
    assert out["rollout_log_probs"].dtype == torch.float32


def test_eos_stops_each_row_and_pads_like_hf(qwen):
    model, path, config = qwen
    free_run, _ = hf_greedy(model, 12)
    eos = int(free_run[0, 3])  # row 0 emits it at step 3; other rows stop where they emit it, if ever
    hf_ids, hf_log_probs = hf_greedy(model, 12, eos=eos)
    out = native_engine(path, config).generate(
        PROMPTS, MASK, SamplingParams(temperature=0, response_length=12, eos_token_id=eos))
    length = hf_ids.shape[1]
    assert torch.equal(out["responses"][:, :length], hf_ids)
    assert bool((out["responses"][:, length:] == PAD).all())
    expected_mask = torch.cumsum((hf_ids == eos).long(), -1) - (hf_ids == eos).long() == 0
    assert torch.equal(out["response_mask"][:, :length].bool(), expected_mask)
    assert out["response_mask"][0].tolist() == [1, 1, 1, 1] + [0] * 8
    assert (out["rollout_log_probs"][:, :length] - hf_log_probs * expected_mask).abs().max() <= log_prob_tol(
        hf_log_probs)
    assert bool((out["rollout_log_probs"][out["response_mask"] == 0] == 0).all())


def test_decoding_exits_early_once_every_row_stopped(qwen):
    model, path, config = qwen
    engine = native_engine(path, config)
    first = engine.generate(PROMPTS, MASK, SamplingParams(temperature=0, response_length=1))["responses"][:, 0]
    calls = []
    forward = engine.model.forward
    engine.model.forward = lambda *a: calls.append(1) or forward(*a)
    out = engine.generate(PROMPTS, MASK, SamplingParams(temperature=0, response_length=50,
                                                        stop_token_ids=first.tolist()))
    assert len(calls) == 1  # the prefill only: every row stopped on its first token
    assert out["response_mask"].sum(-1).tolist() == [1, 1, 1]
    assert out["responses"].shape == (3, 50)


def test_ignore_eos_keeps_generating_but_stop_token_ids_still_stop(qwen):
    model, path, config = qwen
    engine = native_engine(path, config)
    free = engine.generate(PROMPTS, MASK, SamplingParams(temperature=0, response_length=6))["responses"]
    token = int(free[1, 2])
    ignored = engine.generate(PROMPTS, MASK, SamplingParams(temperature=0, response_length=6, eos_token_id=token,
                                                            ignore_eos=True))
    assert torch.equal(ignored["responses"], free)
    stopped = engine.generate(PROMPTS, MASK, SamplingParams(temperature=0, response_length=6, eos_token_id=token,
                                                            ignore_eos=True, stop_token_ids=[token]))
    assert stopped["response_mask"][1].tolist() == [1, 1, 1, 0, 0, 0]


def test_sampling_frequencies_match_softmax_of_logits_over_temperature(qwen):
    model, path, config = qwen
    prompt = torch.tensor([[5, 6, 7]])
    with torch.no_grad():
        logits = model(prompt).logits[0, -1].double()
    temperature = 0.7
    probs = (logits / temperature).softmax(-1)
    draws = 10_000
    out = native_engine(path, config).generate(
        prompt, torch.ones_like(prompt), SamplingParams(temperature=temperature, response_length=1, n=draws, seed=7))
    tokens = out["responses"][:, 0]
    counts = torch.bincount(tokens, minlength=VOCAB).double()
    expected = probs * draws
    keep = expected >= 5  # pool the rare tokens into one bin, as the test requires
    observed = torch.cat([counts[keep], counts[~keep].sum(0, keepdim=True)])
    expected = torch.cat([expected[keep], expected[~keep].sum(0, keepdim=True)])
    chi2 = ((observed - expected) ** 2 / expected).sum()
    dof = observed.numel() - 1
    p_value = torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), chi2 / 2)
    assert p_value > 1e-3, f"chi2={chi2:.1f} dof={dof} p={p_value:.2e}"
    # The returned logprob is log_softmax(logits / temperature) at the sampled token.
    assert (out["rollout_log_probs"][:, 0].double() - probs.log()[tokens]).abs().max() <= log_prob_tol(
        probs.log()[tokens])


def test_sampling_is_reproducible_per_seed(qwen):
    model, path, config = qwen
    engine = native_engine(path, config)
    params = SamplingParams(temperature=1.0, response_length=16, n=2, seed=123)
    a = engine.generate(PROMPTS, MASK, params)["responses"]
    b = engine.generate(PROMPTS, MASK, params)["responses"]
    c = engine.generate(PROMPTS, MASK, dataclasses.replace(params, seed=124))["responses"]
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_top_k_and_top_p_never_emit_excluded_tokens():
    logits = torch.linspace(3.0, -3.0, 12)  # distinct, sorted: token 0 most likely
    rows = logits.expand(10_000, -1)
    generator = torch.Generator().manual_seed(0)
    probs = logits.softmax(-1)
    nucleus = int((probs.cumsum(-1) < 0.8).sum()) + 1  # smallest top set with mass >= 0.8
    for params, allowed in [
        (SamplingParams(top_k=3), 3),
        (SamplingParams(top_p=0.8), nucleus),
        (SamplingParams(top_k=2, top_p=0.8), min(2, nucleus)),
    ]:
        tokens, _ = sample_tokens(rows, params, generator)
        assert int(tokens.max()) < allowed, params
        assert set(tokens.tolist()) == set(range(allowed)), params  # every kept token does occur


def test_top_p_mask_keeps_smallest_set_reaching_mass():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert truncation_mask(logits, -1, 0.5).tolist() == [[False, True, True, True]]
    assert truncation_mask(logits, -1, 0.79).tolist() == [[False, False, True, True]]
    assert truncation_mask(logits, -1, 0.81).tolist() == [[False, False, False, True]]
    assert truncation_mask(logits, -1, 1.0) is None


def test_engine_top_k_sampling_stays_inside_top_k_of_hf_logits(qwen):
    model, path, config = qwen
    prompt = torch.tensor([[9, 8, 7, 6]])
    with torch.no_grad():
        logits = model(prompt).logits[0, -1]
    out = native_engine(path, config).generate(
        prompt, torch.ones_like(prompt), SamplingParams(temperature=1.5, top_k=4, response_length=1, n=2000, seed=3))
    assert set(out["responses"][:, 0].tolist()) == set(torch.topk(logits, 4).indices.tolist())


def test_n_samples_are_interleaved_per_prompt(qwen):
    model, path, config = qwen
    out = native_engine(path, config).generate(PROMPTS, MASK, SamplingParams(response_length=4, n=3, seed=1))
    assert out["responses"].shape == (9, 4)
    assert torch.equal(out["prompts"], PROMPTS.repeat_interleave(3, 0))
    assert torch.equal(out["attention_mask"][:, :6], MASK.repeat_interleave(3, 0))


def test_n_samples_of_a_prompt_share_one_prefill(qwen):
    """A prompt's n samples are prefilled once (its K/V copied to their rows, as SGLang and vLLM share the prefix):
    the same tokens and log-probs as prefilling every row (the prompts repeated, n=1) under the same seed, for
    prompts of 3 lengths (left padding); prefilled_tokens counts the 3 prompts' columns, not 9 rows'."""
    model, path, config = qwen
    engine = native_engine(path, config)
    shared = engine.generate(PROMPTS, MASK, SamplingParams(temperature=1.0, response_length=12, n=3, seed=7))
    assert engine.prefilled_tokens == 3 * PROMPTS.shape[1]
    each = engine.generate(PROMPTS.repeat_interleave(3, 0), MASK.repeat_interleave(3, 0),
                           SamplingParams(temperature=1.0, response_length=12, n=1, seed=7))
    assert engine.prefilled_tokens == 9 * PROMPTS.shape[1]
    assert torch.equal(shared["responses"], each["responses"])
    tol = log_prob_tol(each["rollout_log_probs"])
    assert (shared["rollout_log_probs"] - each["rollout_log_probs"]).abs().max() <= tol
    # the 3 samples of a prompt differ (each row samples on its own), so the copies are not one row thrice
    assert len({tuple(r.tolist()) for r in shared["responses"][:3]}) > 1


def test_generate_sequences_takes_and_returns_dataproto(qwen):
    from verl.protocol import DataProto

    model, path, config = qwen
    engine = native_engine(path, config)
    batch = DataProto(batch={"input_ids": PROMPTS, "attention_mask": MASK, "position_ids": MASK.cumsum(-1)},
                      non_tensor_batch={"uid": np.array(["a", "b", "c"], dtype=object)})
    sampled = engine.generate_sequences(batch, SamplingParams(response_length=3, n=2, seed=0))
    assert isinstance(sampled, DataProto) and len(sampled) == 6
    assert sampled.non_tensor_batch["uid"].tolist() == ["a", "a", "b", "b", "c", "c"]
    sampled.check_consistency("native.generate_sequences")

    batch.meta_info.update(do_sample=False)  # verl's validation switch: greedy, one sample
    greedy = engine.generate_sequences(batch, SamplingParams(response_length=5, n=4))
    hf_ids, _ = hf_greedy(model, 5)
    assert torch.equal(greedy.batch["responses"], hf_ids)


def test_bf16_error_is_no_larger_than_hf_bf16_error(qwen):
    model, path, config = qwen
    out = native_engine(path, config, dtype=torch.bfloat16).generate(
        PROMPTS, MASK, SamplingParams(temperature=0, response_length=8))

    def teacher_forced_log_probs(m):  # on the engine's own sequence, so a near-tie cannot derail it
        with torch.no_grad():
            logits = m(input_ids=out["input_ids"], attention_mask=out["attention_mask"],
                       position_ids=out["position_ids"]).logits.float()
        return logits[:, PROMPTS.shape[1] - 1:-1].log_softmax(-1).gather(-1, out["responses"][..., None]).squeeze(-1)

    reference = teacher_forced_log_probs(model)
    try:
        hf_error = (teacher_forced_log_probs(model.to(torch.bfloat16)) - reference).abs()
    finally:
        model.to(torch.float32)
    native_error = (out["rollout_log_probs"] - reference).abs()
    assert native_error.mean() <= 1.5 * hf_error.mean() and native_error.max() <= 1.5 * hf_error.max()


def test_parameters_are_views_of_one_flat_buffer_in_layout_order(qwen):
    model, path, config = qwen
    engine = native_engine(path, config)
    flat = engine.weight_buffer()
    offset = 0
    for spec in engine.params.specs:
        view = engine.params.views[spec.name]
        assert view.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
        assert view.storage_offset() == offset and tuple(view.shape) == spec.shape
        offset += spec.numel
    assert offset == flat.numel()


def test_writing_the_flat_buffer_in_place_switches_the_model(tmp_path, qwen):
    model_a, path_a, config = qwen
    model_b, path_b, _ = build_hf(tmp_path, "qwen2", kv_heads=2, tied=False, rope_theta=5000.0, seed=1)
    engine = native_engine(path_a, config)
    greedy = SamplingParams(temperature=0, response_length=10)
    assert torch.equal(engine.generate(PROMPTS, MASK, greedy)["responses"], hf_greedy(model_a, 10)[0])
    engine.weight_buffer().copy_(native_engine(path_b, config).weight_buffer())  # what a reshard does
    assert torch.equal(engine.generate(PROMPTS, MASK, greedy)["responses"], hf_greedy(model_b, 10)[0])


def test_release_frees_memory_and_resume_plus_reload_restores_generation(qwen):
    model, path, config = qwen
    engine = native_engine(path, config)
    greedy = SamplingParams(temperature=0, response_length=6)
    before = engine.generate(PROMPTS, MASK, greedy)["responses"]
    engine.release()
    assert engine.weight_buffer().untyped_storage().nbytes() == 0 and engine.kv_cache.keys is None
    with pytest.raises(RuntimeError, match="released"):
        engine.generate(PROMPTS, MASK, greedy)
    engine.resume()
    engine.load_hf_checkpoint(path)
    assert torch.equal(engine.generate(PROMPTS, MASK, greedy)["responses"], before)


def test_kv_cache_is_reused_across_requests_of_the_same_size(qwen):
    model, path, config = qwen
    engine = native_engine(path, config)
    engine.generate(PROMPTS, MASK, SamplingParams(temperature=0, response_length=8))
    keys = engine.kv_cache.keys
    engine.generate(PROMPTS[:2], MASK[:2], SamplingParams(temperature=0, response_length=8))
    assert engine.kv_cache.keys is keys
    assert keys.shape == (2, 3, 2, 6 + 8, 16)  # [layers, batch, kv heads, max_len, head_dim]


def test_load_weights_by_name_checks_names_and_shapes(qwen):
    model, path, config = qwen
    engine = native_engine(path, config)
    with pytest.raises(KeyError, match="q_proj"):
        engine.load_weights([("model.layers.0.self_attn.q_proj.weight", torch.zeros(64, 64))])
    with pytest.raises(ValueError, match=r"expected shape \(64,\), found \(63,\)"):
        engine.load_weights([("model.norm.weight", torch.zeros(63))])


@pytest.mark.parametrize("ids,mask,params,message", [
    (PROMPTS, MASK * torch.tensor([[1], [0], [1]]), {}, "prompt 1: expected at least one token"),
    (PROMPTS, MASK.flip(-1), {}, "expected left padding"),
    (PROMPTS, MASK, {"response_length": 251}, "prompt length 6 \\+ response_length 251 exceeds"),
    (PROMPTS + VOCAB, MASK, {}, "expected token ids in \\[0, 320\\)"),
])
def test_bad_prompts_give_one_clear_error(qwen, ids, mask, params, message):
    model, path, config = qwen
    with pytest.raises(RolloutInputError, match=message):
        native_engine(path, config).generate(ids, mask, SamplingParams(**params))


@pytest.mark.parametrize("params,message", [
    ({"temperature": -1}, "temperature: expected >= 0"),
    ({"top_p": 0}, "top_p: expected 0 < top_p <= 1"),
    ({"top_k": -2}, "top_k"),
    ({"response_length": 0}, "response_length"),
    ({"n": 0}, "n: expected a positive integer"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
])
def test_bad_sampling_params_give_one_clear_error(params, message):
    with pytest.raises(RolloutInputError, match=message):
        SamplingParams(**params)


def test_sampling_params_from_verl_config_accepts_max_new_tokens():
    assert SamplingParams.from_config({"max_new_tokens": 7, "temperature": 0}).response_length == 7
    with pytest.raises(RolloutInputError, match="disagree"):
        SamplingParams.from_config({"max_new_tokens": 7, "response_length": 8})
    with pytest.raises(RolloutInputError, match="found \\['tempreature'\\]"):
        SamplingParams.from_config({"tempreature": 1.0})


def test_checkpoint_that_does_not_match_the_config_is_rejected(qwen):
    model, path, config = qwen
    wrong = dataclasses.replace(config, intermediate_size=96)
    with pytest.raises(CheckpointError, match=r"gate_proj.weight expected shape \(96, 64\), found \(128, 64\)"):
        NativeRollout(wrong).load_hf_checkpoint(path)
    tied_path = build_hf_tied_only(path, config)
    with pytest.raises(CheckpointError, match="lm_head.weight.*missing"):
        NativeRollout(dataclasses.replace(config, tie_word_embeddings=False)).load_hf_checkpoint(tied_path)


def build_hf_tied_only(path, config):
    """A copy of the checkpoint without lm_head.weight (what a tied model saves)."""
    import os

    from safetensors.torch import load_file, save_file

    tensors = load_file(os.path.join(path, "model.safetensors"))
    tensors.pop("lm_head.weight")
    out = path + "-no-lm-head"
    os.makedirs(out, exist_ok=True)
    save_file(tensors, os.path.join(out, "model.safetensors"))
    return out


# ------------------------------------------------------------------------------ verl generate (TP 1)
def test_generate_cli_writes_greedy_ids_and_logprobs_equal_to_hf_and_stops_at_model_eos(tmp_path):
    import json

    from verl.trainer.main_generation import main

    # Default theta: the CLI reads the config through ModelConfig, which takes `rope_theta` only.
    model, path, config = build_hf(tmp_path, "llama", kv_heads=2, tied=False)
    eos = int(hf_greedy(model, 7)[0][0, 3])
    model.generation_config.eos_token_id = eos  # the CLI must pick it up from generation_config.json
    model.generation_config.save_pretrained(path)
    output = tmp_path / "out.json"
    argv = ["--engine", "native", "--model", path, "--tp", "1", "--max-new-tokens", "7", "--temperature", "0",
            "--json", str(output)]
    for prompt, mask in zip(PROMPTS.tolist(), MASK.tolist(), strict=False):
        argv += ["--input-ids", ",".join(str(t) for t, m in zip(prompt, mask, strict=False) if m)]
    assert main(argv) == 0
    result = json.loads(output.read_text())
    hf_ids, hf_log_probs = hf_greedy(model, 7, eos=eos)
    assert len(result["output_ids"][0]) == 4 and result["output_ids"][0][-1] == eos
    for row, (ids, log_probs) in enumerate(zip(result["output_ids"], result["logprobs"], strict=False)):
        assert ids == hf_ids[row, :len(ids)].tolist()
        assert (torch.tensor(log_probs) - hf_log_probs[row, :len(ids)]).abs().max() <= log_prob_tol(hf_log_probs)
        assert len(ids) == 7 or ids[-1] == eos


@pytest.mark.parametrize("args,message", [
    (["--input-ids", ""], "--input-ids #0: expected at least one token id, found an empty prompt"),
    (["--input-ids", "1,2", "--max-new-tokens", "255"], "prompt length 2 + response_length 255 exceeds"),
    (["--input-ids", "1", "--engine", "trtllm"],
     "--engine: expected one of native, sglang, vllm, megatron, found 'trtllm'"),
    (["--input-ids", "1", "--tp", "3"], "does not divide num_attention_heads=4"),
    (["--input-ids", "1,x"], "expected comma-separated integers, found '1,x'"),
    (["--input-ids", "1", "--tp"], "argument --tp: expected one argument"),
])
def test_generate_cli_bad_input_is_one_line_and_exit_2(qwen, capsys, args, message):
    from verl.trainer.main_generation import main

    model, path, config = qwen
    assert main(["--model", path, *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


@pytest.mark.parametrize("name", ["qwen3", "qwen3_moe", "qwen3_moe_raw", "mixtral"])
def test_qwen3_and_moe_greedy_ids_and_log_probs_equal_hf(tmp_path, name):
    """Qwen3's per-head q/k norms and Qwen3-MoE's router + experts (a dense layer among MoE ones; the
    top-k weights renormalised or raw) in the native engine: greedy ids = HF generate's."""
    from helpers.moe_models import save_model

    model = save_model(name, tmp_path / name)
    config = ModelConfig.from_pretrained(str(tmp_path / name))
    engine = native_engine(str(tmp_path / name), config)
    steps = 12
    out = engine.generate(PROMPTS, MASK, SamplingParams(temperature=0, response_length=steps))
    responses, log_probs = hf_greedy(model, steps)
    assert torch.equal(out["responses"], responses)
    # 4 layers whose widest reduction is the dense MLP's 64 terms (an expert's is 16), vocab 200.
    tol = log_prob_tolerance(torch.float32, width=64, num_layers=4, vocab=config.vocab_size,
                             scale=max(1.0, float(log_probs.abs().max())))
    assert (out["rollout_log_probs"] - log_probs).abs().max() <= tol


def test_recorded_routing_is_transformers_choice_for_every_token(tmp_path):
    """rollout.enable_rollout_routing_replay: routed_experts [B, P+R, MoE layers, k] holds, for every prompt and
    fed response token, the experts HF's routers pick when teacher-forced on the same sequence (sampled, n=2)."""
    from helpers.moe_models import hf_routing, save_model

    model = save_model("qwen3_moe", tmp_path / "moe")
    config = ModelConfig.from_pretrained(str(tmp_path / "moe"))
    engine = native_engine(str(tmp_path / "moe"), config)
    engine.record_routing = True
    out = engine.generate(PROMPTS, MASK, SamplingParams(temperature=1.0, response_length=8, n=2, seed=3))
    routed = out["routed_experts"]
    assert routed.shape == (*out["input_ids"].shape, len(config.moe_layers), config.num_experts_per_tok)
    expected = hf_routing(model, out["input_ids"], out["attention_mask"], out["position_ids"])
    # Every valid token but each row's last one (sampled, never fed back through the model).
    valid = out["attention_mask"].bool().clone()
    last = valid.long().cumsum(1).argmax(1)
    valid[torch.arange(valid.size(0)), last] = False
    assert torch.equal(routed.long().sort(-1).values[valid], expected.sort(-1).values[valid])
    engine.record_routing = False
    assert "routed_experts" not in engine.generate(PROMPTS, MASK, SamplingParams(temperature=0, response_length=4))


@pytest.mark.parametrize("name", ["qwen2", "qwen3_moe"])
def test_a_swapped_in_weight_buffer_is_what_every_layer_reads(tmp_path, name):
    """A standalone pool fills a staging buffer and swaps it in (FlatParams.swap rebinds the views): every weight
    the forward reads, the stacked experts included, must come from the new buffer (a kept derived view of the
    old one once left the experts on stale memory: the pool's first step failed its rollout check)."""
    if name == "qwen2":
        model, path, config = build_hf(tmp_path)
    else:
        from helpers.moe_models import save_model

        model = save_model(name, tmp_path / name)
        path = str(tmp_path / name)
        config = ModelConfig.from_pretrained(path)
    engine = NativeRollout(config, pad_token_id=PAD)
    loaded = native_engine(path, config).weight_buffer().clone()
    engine.weight_buffer().fill_(float("nan"))
    old = engine.swap_weight_buffer(loaded)
    assert torch.isnan(old).all()
    old.fill_(float("nan"))  # the old buffer must not be read any more
    out = engine.generate(PROMPTS, MASK, SamplingParams(temperature=0, response_length=6))
    responses, _ = hf_greedy(model, 6)
    assert torch.equal(out["responses"], responses)
