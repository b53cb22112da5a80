"""The FSDP2 engine against transformers on gloo ranks.

* logits of the sharded model (its fp32 linears on oneDNN, verl.ops.cpu_gemm) = transformers' (fp32, within the
  reordered-sum bound of helpers.tolerance), with padded rows and with the rows packed (``remove_padding``), for a
  tied GQA Qwen2 and an untied Llama;
* one training step (global token-mean loss, two micro-batches per rank) at 1 and 2 ranks = the same step
  of a single-process transformers model + AdamW (loss and every updated weight within derived bounds);
* a DCP checkpoint written by 2 ranks and loaded by 1 rank continues with the same next step;
* the HF export of the sharded model loads in transformers with the same logits.
"""

import copy

import pytest
import torch
from helpers.megatron_tiny_models import RESPONSE, VOCAB, hf_model, model_config, padded_batch, save_hf
from helpers.tolerance import decoder_depth, forward_tolerance

from verl.launcher.spawn import run_ranks

pytestmark = pytest.mark.distributed

LR, STEPS = 1e-2, 2
# Sharded and single-process forwards differ in their fp32 summation order only. The tiny models' widest
# reduction is the MLP's (intermediate 64), over 4 decoder layers; activations feeding it are RMS-normalised.
FORWARD_REL = forward_tolerance(torch.float32, width=64, depth=decoder_depth(4))
# The loss is a token mean of log-probs of magnitude up to log(VOCAB), one more reordered sum.
LOSS_TOL = forward_tolerance(torch.float32, width=64, depth=decoder_depth(4) + 1, scale=float(torch.log(
    torch.tensor(VOCAB))))
# Adam moves a weight by lr * m / sqrt(v): a relative gradient error r moves it by about lr * r per step. The
# gradients are one backward pass (as deep as the forward) away from the logits: r <= 2 * FORWARD_REL, twice
# over two steps.
WEIGHT_TOL = LR * 4 * FORWARD_REL
MODELS = ("qwen2_gqa_tied", "llama_gqa_untied")


def _advantages(batch):
    return torch.linspace(-1.0, 1.0, batch["responses"].numel()).view_as(batch["responses"])


def _loss_fn(counts):
    from verl.trainer.ppo import core_algos

    def loss_fn(outputs, mb):
        mask = mb["attention_mask"][:, -RESPONSE:].float()
        loss = core_algos.agg_loss(-outputs["log_probs"] * mb["advantages"], mask, "token-mean", **counts)
        return loss, {}

    return loss_fn


def _batch_share(batch, rank, world):
    rows = batch["input_ids"].size(0) // world
    return {k: v[rank * rows:(rank + 1) * rows] for k, v in batch.items()}


def _full_params(module):
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in
            module.named_parameters()}


def _model_job(hf_dir, ckpt_dir, export_dir, world):
    import torch.distributed as dist

    from verl.engine.fsdp.checkpoint import load_checkpoint, save_checkpoint
    from verl.engine.fsdp.engine import FSDPEngine
    from verl.engine.fsdp.hf_export import export_actor_hf
    from verl.engine.fsdp.parallel import fsdp_mesh
    from verl.engine.megatron.engine import OptimConfig
    from verl.engine.padding import restore
    from verl.engine.roles import Actor

    rank = dist.get_rank()
    config = model_config(hf_dir)
    mesh = fsdp_mesh(-1)
    batch = padded_batch(batch=4)
    batch["advantages"] = _advantages(batch)
    out = {}
    for remove_padding in (False, True):
        engine = FSDPEngine(config, hf_dir, mesh, "lm", remove_padding=remove_padding)
        logits = engine.forward(batch, 2, lambda lg, ids, sh, mb: {"logits": restore(lg, sh)})["logits"]
        out[f"logits_packed{remove_padding}"] = logits
    share = _batch_share(batch, rank, world)
    counts = {"dp_size": world, "batch_num_tokens": int(batch["attention_mask"][:, -RESPONSE:].sum())}
    optim = OptimConfig(lr=LR, weight_decay=0.01, clip_grad=0.0, total_training_steps=STEPS)

    def step(engine, **actor_options):
        actor = Actor(engine, **{"micro_batch_size": 1, **actor_options})
        return actor.update_policy(share, _loss_fn(counts), calculate_entropy=False, global_loss=True)

    engine = FSDPEngine(config, hf_dir, mesh, "lm", optim, remove_padding=True)
    # fp32 on CPU: the engine's linears run on oneDNN, the reference below on torch's own F.linear
    out["onednn_linears"] = torch.tensor(engine.onednn_linears)
    out["loss"] = torch.tensor(step(engine)["loss"])
    out["step1"] = _full_params(engine.module)
    if world == 2:  # save after step 1, then take step 2 here
        save_checkpoint(engine, ckpt_dir, engine.optimizer_steps)
        export_actor_hf(engine, hf_dir, export_dir, tokenizer=None)
    else:  # a fresh engine continues from the 2-rank checkpoint
        engine = FSDPEngine(config, hf_dir, mesh, "lm", optim, remove_padding=True)
        out["loaded_iteration"] = torch.tensor(load_checkpoint(engine, ckpt_dir))
    step(engine)
    out["step2"] = _full_params(engine.module)
    if world == 2:
        # The same first step through the other options: padded rows with one micro-batch per rank, token-budget
        # micro-batches (verl's use_dynamic_bsz), activation checkpointing with CPU offload of the shards.
        variants = {"padded": (dict(remove_padding=False), dict(micro_batch_size=2)),
                    "token_budget": (dict(remove_padding=False), dict(max_token_len=12)),  # packs anyway
                    "recompute_offload": (dict(gradient_checkpointing=True, offload=True), {})}
        for name, (engine_options, actor_options) in variants.items():
            engine = FSDPEngine(config, hf_dir, mesh, "lm", optim, **engine_options)
            step(engine, **actor_options)
            out[f"variant_{name}"] = _full_params(engine.module)
    return out


def _engine_job(cases, world):
    """Every model's checks, then (2 ranks) HYBRID_SHARD: fsdp_size 1 replicates the whole model on both."""
    from verl.engine.fsdp.engine import FSDPEngine
    from verl.engine.fsdp.parallel import fsdp_mesh, reset_fsdp_mesh
    from verl.engine.megatron.engine import OptimConfig

    results = {name: _model_job(*paths, world) for name, paths in cases.items()}
    if world == 2:
        import torch.distributed as dist

        reset_fsdp_mesh()
        mesh = fsdp_mesh(1)
        batch = padded_batch(batch=4)
        batch["advantages"] = _advantages(batch)
        share = _batch_share(batch, dist.get_rank(), world)
        counts = {"dp_size": world, "batch_num_tokens": int(batch["attention_mask"][:, -RESPONSE:].sum())}
        for name, (hf_dir, _, _) in cases.items():
            from verl.engine.roles import Actor

            optim = OptimConfig(lr=LR, weight_decay=0.01, clip_grad=0.0, total_training_steps=STEPS)
            engine = FSDPEngine(model_config(hf_dir), hf_dir, mesh, "lm", optim)
            Actor(engine, micro_batch_size=1).update_policy(share, _loss_fn(counts), calculate_entropy=False,
                                                                global_loss=True)
            results[name]["variant_hsdp"] = _full_params(engine.module)
            results[name]["hsdp_mesh"] = torch.tensor(tuple(mesh.mesh.shape))
    return results


def _reference_steps(model, batch, restart=None):
    """Two AdamW steps of (a copy of) the unsharded transformers model on the whole batch; also which elements
    had a first gradient clearly away from zero (Adam's first update is g / (|g| + eps): for |g| near rounding
    noise its sign, and so a 2 x lr difference, is decided by the last bit of the reduction order).

    ``restart``: the weights the second step starts from (the engine's own after its first step, the
    reference's Adam state kept). The few elements whose first update is such a coin toss differ by 2 x lr
    between two runs and move every second-step gradient by far more than rounding, so the second step is
    compared from a common start."""
    from verl.trainer.ppo import core_algos

    model = copy.deepcopy(model).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    mask = batch["attention_mask"]
    states, losses, conditioned = [], [], {}
    for step in range(STEPS):
        if step and restart is not None:
            with torch.no_grad():
                for name, param in model.named_parameters():
                    param.copy_(restart[name])
        logits = model(input_ids=batch["input_ids"], attention_mask=mask, position_ids=batch["position_ids"]).logits
        log_probs = torch.log_softmax(logits.float(), dim=-1)[:, :-1].gather(
            -1, batch["input_ids"][:, 1:, None]).squeeze(-1)[:, -RESPONSE:]
        loss = core_algos.agg_loss(-log_probs * batch["advantages"], mask[:, -RESPONSE:].float(), "token-mean")
        optimizer.zero_grad()
        loss.backward()
        if step == 0:
            conditioned = {n: (p.grad.abs() > 1e-6) | (p.grad == 0) for n, p in model.named_parameters()}
        optimizer.step()
        losses.append(loss.detach())
        states.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return losses, states, conditioned


def _allclose_where_conditioned(got, want, conditioned, what):
    for pname, ref in want.items():
        ok = conditioned[pname]
        assert torch.allclose(got[pname][ok], ref[ok], atol=WEIGHT_TOL, rtol=0), (what, pname)


def test_fsdp_engine_matches_transformers(tmp_path):
    import transformers

    models, cases = {}, {}
    for name in MODELS:
        models[name] = hf_model(name)
        hf_dir = save_hf(models[name], str(tmp_path / name / "hf"), sharded=False)
        cases[name] = (hf_dir, str(tmp_path / name / "ckpt"), str(tmp_path / name / "export"))
    two = run_ranks(_engine_job, 2, cases, 2, timeout_s=300)
    one = run_ranks(_engine_job, 1, cases, 1, timeout_s=300)
    batch = padded_batch(batch=4)
    batch["advantages"] = _advantages(batch)
    mask = batch["attention_mask"].bool()
    inputs = dict(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                  position_ids=batch["position_ids"])
    for name, model in models.items():
        with torch.no_grad():
            expected = model(**inputs).logits
        logits_tol = FORWARD_REL * max(1.0, float(expected[mask].abs().max()))
        losses, states, conditioned = _reference_steps(model, batch)
        # Both second steps start from the 2-rank run's first: its own, and the 1-rank job's from its checkpoint.
        restarted = _reference_steps(model, batch, restart=two[0][name]["step1"])[1]
        covered = sum(int(m.sum()) for m in conditioned.values()) / sum(m.numel() for m in conditioned.values())
        assert covered > 0.99  # the comparison covers nearly every element
        for result in (two[0][name], two[1][name], one[0][name]):
            for packed in (False, True):
                assert (result[f"logits_packed{packed}"][mask] - expected[mask]).abs().max() <= logits_tol, name
        for result in (two[0][name], one[0][name]):
            # every projection of the 4 layers (q, k, v, o, gate, up, down) and the head
            assert int(result["onednn_linears"]) == 4 * 7 + 1, name
            # Loss shares are added over micro-batches and averaged over ranks: the whole batch's loss.
            assert abs(float(result["loss"]) - float(losses[0])) <= LOSS_TOL
            _allclose_where_conditioned(result["step1"], states[0], conditioned, (name, "step1"))
            _allclose_where_conditioned(result["step2"], restarted[1], conditioned, (name, "step2"))
        for variant in ("padded", "token_budget", "recompute_offload", "hsdp"):
            _allclose_where_conditioned(two[0][name][f"variant_{variant}"], states[0], conditioned, (name, variant))
        assert two[0][name]["hsdp_mesh"].tolist() == [2, 1]
        assert int(one[0][name]["loaded_iteration"]) == 1
        # The HF export (written after step 1 by the 2-rank job) loads in transformers with step 1's logits.
        exported = transformers.AutoModelForCausalLM.from_pretrained(cases[name][2]).eval()
        after_one = model.__class__(model.config).eval()
        after_one.load_state_dict(states[0], strict=False)
        with torch.no_grad():
            assert (exported(**inputs).logits[mask] - after_one(**inputs).logits[mask]).abs().max() <= logits_tol, name
