"""Gemma 3 270M (tests/helpers/gemma3_model.py) through each training engine and the 3D-HybridEngine into the
native rollout engine, against transformers (issue 58 items 2, 3 and 6).

One 2-rank gloo job per training engine, fp32:
  fsdp      the FSDP2 actor sharded over both ranks (uneven shards of 640-wide rows, the tied 262144-row embedding)
  megatron  Megatron at PP 2 (9 layers a stage; TP 2 would split the one KV head: refused), the embedding on the
            first stage and tied to the output layer on the last
computes the actor's log-probs and entropy of a left-padded batch (prompt + transformers' greedy answer, one answer
cut short: right padding); the HybridEngine then reshards the training layout into a native engine at rollout TP 2
(2 query heads per rank over the one KV head, replicated; half the padded vocabulary and of the GeGLU MLP per rank),
which decodes the prompts greedily. transformers on the checkpoint is the oracle of both. Last, the actor exports
itself as an HF directory that transformers loads and whose logits equal the checkpoint's."""

import os
import shutil

import pytest
import torch
from helpers.gemma3_model import ANSWER, PROMPT, gemma3_dir, log_prob_tolerance_fp32
from helpers.tiny_models import left_pad

from verl.launcher.spawn import run_ranks

pytestmark = pytest.mark.distributed

NEW_TOKENS = 8  # " the capital of the country of France." is 8 tokens
PROMPTS = [PROMPT, "Water boils at a temperature of"]
# The batch's responses: transformers' greedy answer (tests/helpers/gemma3_model.py) and a text of ours, cut short.
RESPONSES = [ANSWER, " one hundred degrees Celsius at sea level."]
PAD = 0


def _job(model_dir, batch, prompts, export_dir, strategy):
    import torch.distributed as dist

    from verl.engine.megatron.engine import MegatronEngine, OptimConfig
    from verl.engine.roles import Actor
    from verl.engine.rollout.base import SamplingParams
    from verl.engine.rollout.native.engine import NativeRollout
    from verl.hybrid_engine.groups import derive_groups
    from verl.hybrid_engine.hybrid_engine import HybridEngine, rollout_tp_process_group
    from verl.hybrid_engine.layouts import FSDPLayout, TrainingLayout
    from verl.models.config import ModelConfig

    rank, world = dist.get_rank(), dist.get_world_size()
    config = ModelConfig.from_pretrained(model_dir)
    optim = OptimConfig(lr=1e-6, weight_decay=0.0, clip_grad=0.0)
    if strategy == "fsdp":
        from verl.engine.fsdp.engine import FSDPEngine
        from verl.engine.fsdp.parallel import fsdp_mesh

        engine = FSDPEngine(config, model_dir, fsdp_mesh(-1), "lm", optim)
        training = FSDPLayout(shard=world)
    else:
        from verl.engine.megatron.parallel import initialize_megatron

        initialize_megatron(1, world, seed=1)
        engine = MegatronEngine(config, "lm", optim)
        engine.load_hf_weights(model_dir)
        training = TrainingLayout(1, world)
    actor = Actor(engine, micro_batch_size=len(batch["input_ids"])).compute_log_prob(batch)
    groups = derive_groups(training, 2)
    _, _, tp_group = rollout_tp_process_group(groups, rank)
    rollout = NativeRollout(config, tp_group=tp_group, dtype=torch.float32, pad_token_id=PAD)
    hybrid = HybridEngine(engine, rollout, config, training, 2, 64 << 20, "float32")
    stats = hybrid.to_rollout()
    ids, mask = left_pad(prompts, PAD)
    out = rollout.generate(ids, mask, SamplingParams(temperature=0.0, response_length=NEW_TOKENS))
    hybrid.to_training()
    engine.export_hf(model_dir, export_dir, None)
    return {"log_probs": actor["log_probs"], "entropy": actor["entropy"], "case": groups.case,
            "received": stats.get("perf/reshard_bytes"), "responses": out["responses"],
            "rollout_log_probs": out["rollout_log_probs"], "response_mask": out["response_mask"]}


@pytest.fixture(scope="module", params=["fsdp", "megatron"])
def report(tmp_path_factory, request):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = gemma3_dir()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = [tokenizer(p).input_ids for p in PROMPTS]
    answers = [tokenizer(r, add_special_tokens=False).input_ids[:NEW_TOKENS] for r in RESPONSES]
    assert len(answers[0]) == NEW_TOKENS
    width = max(map(len, prompts))
    rows, masks = [], []
    for i, (prompt, answer) in enumerate(zip(prompts, answers, strict=True)):
        valid = NEW_TOKENS - 3 if i == 1 else NEW_TOKENS  # one response ends early: right padding
        pad = width - len(prompt)
        rows.append([PAD] * pad + prompt + answer[:valid] + [PAD] * (NEW_TOKENS - valid))
        masks.append([0] * pad + [1] * (len(prompt) + valid) + [0] * (NEW_TOKENS - valid))
    input_ids, attention_mask = torch.tensor(rows), torch.tensor(masks)
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
    batch = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids,
             "responses": input_ids[:, -NEW_TOKENS:]}
    with torch.no_grad():
        hf_logits = hf(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                       logits_to_keep=NEW_TOKENS + 1).logits[:, :-1].float()
    export_dir = str(tmp_path_factory.mktemp("gemma3_export") / "hf")
    results = run_ranks(_job, 2, model_dir, batch, prompts, export_dir, request.param, timeout_s=300)
    exported = AutoModelForCausalLM.from_pretrained(export_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        results[0]["exported_logits"] = exported(input_ids=input_ids, attention_mask=attention_mask,
                                                 position_ids=position_ids, logits_to_keep=NEW_TOKENS + 1
                                                 ).logits[:, :-1].float()
    results[0]["exported_class"] = type(exported).__name__
    del exported
    shutil.rmtree(os.path.dirname(export_dir))  # 1 GB of fp32 weights: read once, not kept for the session
    # transformers teacher-forced on each rank's greedy rows: its logits at every response position
    greedy = {}
    for result in results:
        for prompt, response in zip(prompts, result["responses"].tolist(), strict=True):
            if (tuple(prompt), tuple(response)) not in greedy:
                with torch.no_grad():
                    greedy[tuple(prompt), tuple(response)] = hf(torch.tensor([prompt + response[:-1]]),
                                                                logits_to_keep=NEW_TOKENS).logits[0].float()
    return prompts, batch, hf_logits, greedy, results


def test_transformers_greedy_answer_is_the_measured_one(report):
    """Row 0's response is transformers' own greedy answer: its argmax at each position."""
    _, batch, hf_logits, _, _ = report
    assert hf_logits[0].argmax(-1).tolist() == batch["responses"][0].tolist()


def test_actor_log_probs_and_entropy_equal_transformers(report):
    _, batch, hf_logits, _, results = report
    log_p = torch.log_softmax(hf_logits, dim=-1)
    want = log_p.gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1)
    entropy = -(log_p.exp() * log_p).sum(-1)
    valid = batch["attention_mask"][:, -NEW_TOKENS:].bool()
    assert not valid.all() and valid.any()
    tol = log_prob_tolerance_fp32(float(hf_logits.abs().max()))
    for result in results:
        assert (result["log_probs"] - want).abs()[valid].max().item() <= tol
        assert (result["entropy"] - entropy).abs()[valid].max().item() <= tol
        assert torch.all(result["log_probs"][~valid] == 0)


def test_reshard_into_native_tp2_then_greedy_equals_transformers(report):
    """Each greedy token is transformers' argmax on the engine's own prefix (where its top-2 gap exceeds twice the
    tolerance; a closer call may go either way) and its log-prob transformers' within the tolerance."""
    prompts, batch, _, greedy, results = report
    for rank, result in enumerate(results):
        assert result["responses"][0].tolist() == batch["responses"][0].tolist(), rank  # ' the capital of the ...'

        assert result["received"] > 0, f"rank {rank}: nothing moved between the training shards and the rollout"
        for prompt, response, reported in zip(prompts, result["responses"].tolist(), result["rollout_log_probs"],
                                              strict=True):
            logits = greedy[tuple(prompt), tuple(response)]
            tol = log_prob_tolerance_fp32(float(logits.abs().max()))
            log_p = logits.log_softmax(-1)
            top2 = log_p.topk(2, dim=-1).values
            for t, token in enumerate(response):
                if float(top2[t, 0] - top2[t, 1]) > 2 * tol:
                    assert token == int(log_p[t].argmax()), (rank, t)
                assert abs(float(log_p[t, token]) - float(reported[t])) <= tol, (rank, t)


def test_export_is_a_directory_transformers_loads_with_equal_logits(report):
    """The weights went through the engine's shards and back unchanged (fp32, no arithmetic): the same logits, bit
    for bit, as the checkpoint's under the same transformers forward."""
    _, _, hf_logits, _, results = report
    assert results[0]["exported_class"] == "Gemma3ForCausalLM"
    assert torch.equal(results[0]["exported_logits"], hf_logits)
