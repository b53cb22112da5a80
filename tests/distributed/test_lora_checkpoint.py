"""LoRA checkpoints and HF export (issue 45 item 5), on 2 gloo ranks.

Resume is bit-exact: an engine trained 2 steps and saved, then reloaded into a fresh engine (other random
adapters, the base from the HF checkpoint), takes a step 3 equal to the uninterrupted run's step 3 to the bit,
with ``save_lora_only`` (adapters + their optimizer state only: a far smaller checkpoint) and without it. Megatron
at TP 2 with sequence parallelism and the distributed optimizer, where megatron's default sharded state would save
tp rank 0's rows of every column linear's ``B`` only; the full checkpoint also loads at TP 1 (the gate/up halves of
``linear_fc1``'s ``B`` resharded). FSDP2 over 2 ranks. The HF export of a LoRA actor is a PEFT adapter directory
that ``peft.PeftModel.from_pretrained(base, dir)`` loads with the trained actor's log-probs and greedy tokens, and
the merged model on request equals it.
"""

import json
import os

import pytest
import torch
from helpers.megatron_tiny_models import RESPONSE, VOCAB, hf_model, model_config, padded_batch, save_hf, sft_loss

from verl.launcher.spawn import run_ranks

pytestmark = pytest.mark.distributed

RANK, ALPHA = 4, 8.0


def _batches():
    out = []
    for seed in (1, 2, 3):
        batch = padded_batch(seed=seed, batch=4)
        batch["response_mask"] = batch["attention_mask"][:, -RESPONSE:]
        out.append(batch)
    return out


def _dir_bytes(path):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def _megatron_job(base_dir, root):
    import torch.distributed as dist

    from verl.engine.lora import MEGATRON_TARGETS, LoRASettings
    from verl.engine.megatron.engine import MegatronEngine, OptimConfig
    from verl.engine.megatron.lora import gather_full_adapters
    from verl.engine.megatron.parallel import destroy_megatron, initialize_megatron
    from verl.engine.roles import Actor

    config = model_config(base_dir)
    lora = LoRASettings(rank=RANK, alpha=ALPHA, target_modules=MEGATRON_TARGETS)
    batches = _batches()

    def engine(seed, optim=True):
        e = MegatronEngine(config, optim=OptimConfig(lr=1e-2, weight_decay=0.0, use_distributed_optimizer=True)
                           if optim else None, sequence_parallel=dist.get_world_size() == 2 and optim,
                           lora=lora, lora_seed=seed)
        e.load_hf_weights(base_dir)
        return e

    initialize_megatron(2, 1, seed=3)
    run = engine(0)
    actor = Actor(run, micro_batch_size=2)
    for batch in batches[:2]:
        actor.update_policy(batch, sft_loss, calculate_entropy=True)
    saved = gather_full_adapters(run.module, config)
    for lora_only in (True, False):
        run.save_lora_only = lora_only
        run.save_checkpoint(os.path.join(root, f"mega_{lora_only}"))
    want = actor.update_policy(batches[2], sft_loss, calculate_entropy=True)
    want_adapters = gather_full_adapters(run.module, config)
    out = {}
    for lora_only in (True, False):
        fresh = engine(7)
        assert fresh.load_checkpoint(os.path.join(root, f"mega_{lora_only}")) == 2
        got = Actor(fresh, micro_batch_size=2).update_policy(batches[2], sft_loss, calculate_entropy=True)
        adapters = gather_full_adapters(fresh.module, config)
        out[lora_only] = {"loss_equal": got["loss"] == want["loss"],
                          "grad_norm_equal": got["grad_norm"] == want["grad_norm"],
                          "adapters_equal": all(torch.equal(adapters[k], v) for k, v in want_adapters.items()),
                          "bytes": _dir_bytes(os.path.join(root, f"mega_{lora_only}"))}
    destroy_megatron()
    # the full checkpoint at TP 1 (DP 2): every adapter as saved at TP 2
    initialize_megatron(1, 1, seed=3)
    tp1 = engine(9, optim=False)
    tp1.load_checkpoint(os.path.join(root, "mega_False"))
    at_tp1 = gather_full_adapters(tp1.module, config)
    out["tp1_equal"] = sorted(at_tp1) == sorted(saved) and all(torch.equal(at_tp1[k], v) for k, v in saved.items())
    out["b_moved"] = all(float(v.abs().max()) > 0 for k, v in saved.items() if "lora_B" in k)
    destroy_megatron()
    return out


def _fsdp_job(base_dir, root, export_dir):
    from verl.engine.fsdp.engine import FSDPEngine
    from verl.engine.fsdp.lora import full_adapters
    from verl.engine.fsdp.parallel import fsdp_mesh
    from verl.engine.lora import LoRASettings
    from verl.engine.megatron.engine import OptimConfig
    from verl.engine.roles import Actor

    config = model_config(base_dir)
    mesh = fsdp_mesh(-1)
    lora = LoRASettings(rank=RANK, alpha=ALPHA, target_modules=("all-linear",))
    batches = _batches()

    def engine(seed):
        return FSDPEngine(config, base_dir, mesh, "lm", OptimConfig(lr=1e-2, weight_decay=0.0), seed=seed, lora=lora)

    run = engine(0)
    actor = Actor(run, micro_batch_size=2)
    for batch in batches[:2]:
        actor.update_policy(batch, sft_loss)
    for lora_only in (True, False):
        run.save_lora_only = lora_only
        run.save_checkpoint(os.path.join(root, f"fsdp_{lora_only}"))
    want = actor.update_policy(batches[2], sft_loss)
    want_adapters = full_adapters(run.module)
    out = {}
    for lora_only in (True, False):
        fresh = engine(7)
        assert fresh.load_checkpoint(os.path.join(root, f"fsdp_{lora_only}")) == 2
        got = Actor(fresh, micro_batch_size=2).update_policy(batches[2], sft_loss)
        adapters = full_adapters(fresh.module)
        out[lora_only] = {"loss_equal": got["loss"] == want["loss"],
                          "grad_norm_equal": got["grad_norm"] == want["grad_norm"],
                          "adapters_equal": all(torch.equal(adapters[k], v) for k, v in want_adapters.items()),
                          "bytes": _dir_bytes(os.path.join(root, f"fsdp_{lora_only}"))}
    # HF export of the trained actor: PEFT directory + merged model; the actor's own log-probs to compare with
    run.export_merged = True
    run.export_hf(base_dir, export_dir, None)
    probe = padded_batch(seed=4, batch=4)
    out["log_probs"] = Actor(run, micro_batch_size=2).compute_log_prob(probe, False)["log_probs"]
    return out


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return save_hf(hf_model("qwen2_gqa_tied"), str(tmp_path_factory.mktemp("lora_ckpt") / "base"), sharded=False)


def _check_resume(result, base_dir):
    for lora_only in (True, False):
        r = result[lora_only]
        assert r["loss_equal"] and r["grad_norm_equal"] and r["adapters_equal"], (lora_only, r)
    # no base weights in a LoRA-only checkpoint (the full one holds each base tensor once)
    base_bytes = os.path.getsize(os.path.join(base_dir, "model.safetensors"))
    assert result[False]["bytes"] - result[True]["bytes"] > 0.9 * base_bytes, (result, base_bytes)


def test_megatron_lora_checkpoint_resumes_bit_exactly(base_dir, tmp_path):
    for result in run_ranks(_megatron_job, 2, base_dir, str(tmp_path), timeout_s=240):
        _check_resume(result, base_dir)
        assert result["tp1_equal"] and result["b_moved"], result


def test_fsdp_lora_checkpoint_and_peft_export(base_dir, tmp_path):
    peft = pytest.importorskip("peft")
    import transformers

    export_dir = str(tmp_path / "actor_hf")
    results = run_ranks(_fsdp_job, 2, base_dir, str(tmp_path), export_dir, timeout_s=240)
    for result in results:
        _check_resume(result, base_dir)
    with open(os.path.join(export_dir, "adapter_config.json")) as f:
        assert json.load(f)["base_model_name_or_path"] == os.path.abspath(base_dir)
    assert os.path.isfile(os.path.join(export_dir, "adapter_model.safetensors"))
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, attn_implementation="eager")
    peft_model = peft.PeftModel.from_pretrained(base, export_dir).eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(export_dir + "_merged",
                                                               attn_implementation="eager").eval()
    probe = padded_batch(seed=4, batch=4)
    with torch.no_grad():
        logits = peft_model(input_ids=probe["input_ids"], attention_mask=probe["attention_mask"],
                            position_ids=probe["position_ids"]).logits
    log_probs = torch.log_softmax(logits[:, -RESPONSE - 1:-1].float(), dim=-1).gather(
        -1, probe["responses"].unsqueeze(-1)).squeeze(-1)
    mask = probe["attention_mask"][:, -RESPONSE:].bool()
    assert float((log_probs - results[0]["log_probs"])[mask].abs().max()) < 1e-4
    prompt = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(9))
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        peft_tokens = peft_model.generate(input_ids=prompt, **kwargs)
        merged_tokens = merged.generate(input_ids=prompt, **kwargs)
        base_logits = hf_model("qwen2_gqa_tied")(input_ids=probe["input_ids"], attention_mask=probe["attention_mask"],
                                                 position_ids=probe["position_ids"]).logits
    assert torch.equal(peft_tokens, merged_tokens)
    assert float((logits - base_logits).abs().max()) > 1e-3  # the trained adapters matter: the test can tell
