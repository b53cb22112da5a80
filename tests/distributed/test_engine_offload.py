"""The engine contract's offload / onload (verl's param_offload, grad_offload, optimizer_offload).

On 2 gloo ranks, for Megatron at TP2, Megatron at DP2 with the distributed optimizer (parameters inside
its contiguous buffer) and FSDP2 at DP2: two engines from the same checkpoint take a step; one offloads its
parameters, gradients and Adam state, is refused a forward while away, and comes back; both take a second
step. Offloaded, every storage behind that state holds zero bytes (the device memory is free; on CPU the
bytes went to host copies); back, the second step's metrics and every weight equal the engine that never
left, bit for bit (the same bytes and the same arithmetic, so no tolerance).
"""

import pytest
import torch
from helpers.megatron_tiny_models import RESPONSE, hf_model, model_config, padded_batch, save_hf, sft_loss

from verl.launcher.spawn import run_ranks

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.distributed

CASES = {"megatron tp2": ("megatron", 2, False), "megatron dp2 distopt": ("megatron", 1, True),
         "fsdp dp2": ("fsdp", 1, False)}


def _storage_bytes(tensors):
    from verl.engine.offload import local_tensor

    storages = {}  # each storage once: Megatron's gradients are views of one buffer
    for t in tensors:
        storage = local_tensor(t).untyped_storage()
        storages[storage._cdata] = storage.nbytes()
    return sum(storages.values())


def _state(engine):
    params = list(engine.module.parameters())
    grads = [g for p in params for g in (p.grad, getattr(p, "main_grad", None)) if g is not None]
    optim = [v for opt in engine.torch_optimizers() for s in opt.state.values() for v in s.values()
             if isinstance(v, torch.Tensor) and v.dim() > 0]
    return {"params": params, "grads": grads, "optimizer": optim}


def _weights(engine):
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in engine.module.named_parameters()}


def _build(backend, tp, distopt, hf_dir):
    from verl.engine.megatron.engine import OptimConfig

    optim = OptimConfig(lr=1e-2, weight_decay=0.01, clip_grad=1.0, use_distributed_optimizer=distopt)
    if backend == "fsdp":
        from verl.engine.fsdp.engine import FSDPEngine
        from verl.engine.fsdp.parallel import fsdp_mesh

        return FSDPEngine(model_config(hf_dir), hf_dir, fsdp_mesh(-1), "lm", optim)
    from verl.engine.megatron.engine import MegatronEngine
    from verl.models.hf_io import HFCheckpoint
    from verl.models.mcore.weights import load_hf_into_model

    engine = MegatronEngine(model_config(hf_dir), optim=optim)
    load_hf_into_model(engine.module, engine.config, HFCheckpoint(hf_dir).get)
    return engine


def _offload_job(hf_dir):
    from verl.engine.fsdp.parallel import reset_fsdp_mesh
    from verl.engine.megatron.parallel import destroy_megatron, initialize_megatron
    from verl.engine.roles import Actor

    batch = padded_batch(batch=4)
    batch["response_mask"] = batch["attention_mask"][:, -RESPONSE:]
    out = {}
    for name, (backend, tp, distopt) in CASES.items():
        if backend == "megatron":
            initialize_megatron(tp, 1, seed=3)
        stay, away = _build(backend, tp, distopt, hf_dir), _build(backend, tp, distopt, hf_dir)
        actors = [Actor(engine, micro_batch_size=2) for engine in (stay, away)]
        first = [a.update_policy(batch, sft_loss) for a in actors]
        state = _state(away)
        before = {k: _storage_bytes(v) for k, v in state.items()}
        moved = away.offload()
        offloaded = {k: _storage_bytes(v) for k, v in state.items()}
        again = away.offload()  # already away: nothing moves twice
        try:
            actors[1].compute_log_prob(batch, calculate_entropy=False)
            refused = ""
        except RuntimeError as err:
            refused = str(err)
        back = away.onload()
        second = [a.update_policy(batch, sft_loss) for a in actors]
        out[name] = {"before": before, "offloaded": offloaded, "moved": moved, "again": again, "back": back,
                     "refused": refused, "first": first, "second": second,
                     "weights": [_weights(stay), _weights(away)]}
        if backend == "megatron":
            destroy_megatron()
        else:
            reset_fsdp_mesh()
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    hf_dir = save_hf(hf_model("qwen2_gqa_tied"), str(tmp_path_factory.mktemp("offload") / "hf"), sharded=False)
    return run_ranks(_offload_job, 2, hf_dir, timeout_s=300)


@pytest.mark.parametrize("case", list(CASES))
def test_offload_frees_every_storage_and_onload_resumes_bit_for_bit(ranks, case):
    for rank, results in enumerate(ranks):
        r = results[case]
        # FSDP's optimizer step sets gradients to None (nothing to hold); Megatron keeps its grad buffer.
        held = ("params", "optimizer") if CASES[case][0] == "fsdp" else ("params", "grads", "optimizer")
        assert all(r["before"][k] > 0 for k in held), (rank, r["before"])
        assert r["offloaded"] == {"params": 0, "grads": 0, "optimizer": 0}, (rank, r["offloaded"])
        assert r["moved"] >= max(r["before"].values()) and r["again"] == 0 and r["back"] == r["moved"], rank
        assert "offloaded" in r["refused"] and "onload() first" in r["refused"], (rank, r["refused"])
        assert r["first"][0] == r["first"][1] and r["second"][0] == r["second"][1], rank
        stay, away = r["weights"]
        assert stay.keys() == away.keys()
        for name in stay:
            assert torch.equal(stay[name], away[name]), (rank, name)
