"""Training engines' logits on the real pretrained chat model (SmolLM2-135M-Instruct, tests/helpers/real_model.py)
against transformers (issue 43 item 1), in one 3-rank job: Megatron at TP 3 (3 query heads and 1 KV head per rank,
the tied 49152-token vocabulary split in three) -- the full-vocabulary logits and the actor's log-probs and entropy
(its response-only path: the output layer on the response positions alone, the chunked vocab-parallel
log-softmax) -- and the FSDP2 engine sharded over the 3 ranks (uneven shards of 576-wide rows). The batch is the
chat prompts of different lengths (left padding) with HF's greedy continuation, one cut short (right padding)."""

import pytest
import torch
from helpers.real_model import IM_END, chat_prompts, smollm2_dir
from helpers.tolerance import log_prob_tolerance, logits_tolerance

from verl.launcher.spawn import run_ranks

pytest.importorskip("megatron.core")

RESPONSE = 6
# Another fp32 summation order than transformers' (3 ranks' partial sums, another kernel) over 30 layers whose widest
# reduction is the MLP's 1536 terms (unit-RMS activations), then the log-softmax's 49152 terms.
LOGITS_TOL = logits_tolerance(torch.float32, width=1536, num_layers=30)
LOG_PROB_TOL = log_prob_tolerance(torch.float32, width=1536, num_layers=30, vocab=49152)


def _job(model_dir, batch):
    import torch.distributed as dist
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    from verl.engine.fsdp.engine import FSDPEngine
    from verl.engine.fsdp.parallel import fsdp_mesh
    from verl.engine.megatron.actor import token_log_probs
    from verl.engine.megatron.engine import MegatronEngine
    from verl.engine.megatron.parallel import destroy_megatron, initialize_megatron
    from verl.engine.padding import restore
    from verl.models.config import ModelConfig
    from verl.models.hf_io import HFCheckpoint
    from verl.models.mcore.weights import load_hf_into_model

    config = ModelConfig.from_pretrained(model_dir)
    initialize_megatron(3, 1, seed=1)
    engine = MegatronEngine(config)
    load_hf_into_model(engine.module, config, HFCheckpoint(model_dir).get)
    logits = engine.forward(batch, 3, lambda lg, ids, sh, mb: {"logits": restore(
        gather_from_tensor_model_parallel_region(lg)[..., :config.vocab_size], sh)})["logits"]
    actor = engine.forward(batch, 3, token_log_probs(engine, compute_entropy=True))
    destroy_megatron()
    fsdp = FSDPEngine(config, model_dir, fsdp_mesh(-1), "lm")
    fsdp_logits = fsdp.forward(batch, 3, lambda lg, ids, sh, mb: {"logits": restore(lg, sh)})["logits"]
    dist.barrier()
    return {"megatron_logits": logits, "log_probs": actor["log_probs"], "entropy": actor["entropy"],
            "fsdp_logits": fsdp_logits}


@pytest.fixture(scope="module")
def report():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = smollm2_dir()
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = chat_prompts(AutoTokenizer.from_pretrained(model_dir))
    width = max(map(len, prompts))
    rows, masks = [], []
    for i, prompt in enumerate(prompts):
        x = torch.tensor([prompt])
        response = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=RESPONSE, min_new_tokens=RESPONSE,
                               do_sample=False, pad_token_id=IM_END)[0, len(prompt):].tolist()
        valid = RESPONSE - 2 if i == 1 else RESPONSE  # one response ends early: right padding
        pad = width - len(prompt)
        rows.append([IM_END] * pad + prompt + response[:valid] + [IM_END] * (RESPONSE - valid))
        masks.append([0] * pad + [1] * (len(prompt) + valid) + [0] * (RESPONSE - valid))
    input_ids, attention_mask = torch.tensor(rows), torch.tensor(masks)
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
    batch = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids,
             "responses": input_ids[:, -RESPONSE:]}
    with torch.no_grad():
        hf_logits = hf(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits.float()
    results = run_ranks(_job, 3, model_dir, batch, timeout_s=300)
    return batch, hf_logits, results


def test_megatron_tp3_and_fsdp_logits_equal_transformers(report):
    batch, hf_logits, results = report
    mask = batch["attention_mask"].bool()
    for rank, result in enumerate(results):
        for key in ("megatron_logits", "fsdp_logits"):
            diff = (result[key] - hf_logits).abs()[mask].max().item()
            assert diff <= LOGITS_TOL, (rank, key, diff, LOGITS_TOL)


def test_megatron_tp3_actor_log_probs_and_entropy_equal_transformers(report):
    batch, hf_logits, results = report
    log_p = torch.log_softmax(hf_logits[:, -RESPONSE - 1:-1], dim=-1)
    want = log_p.gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1)
    entropy = -(log_p.exp() * log_p).sum(-1)
    valid = batch["attention_mask"][:, -RESPONSE:].bool()
    assert not valid.all() and valid.any()
    for result in results:
        assert (result["log_probs"] - want).abs()[valid].max().item() <= LOG_PROB_TOL
        assert (result["entropy"] - entropy).abs()[valid].max().item() <= LOG_PROB_TOL
        assert torch.all(result["log_probs"][~valid] == 0) and torch.all(result["entropy"][~valid] == 0)
