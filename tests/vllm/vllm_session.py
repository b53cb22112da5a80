"""Runs under .venv-vllm: ``python vllm_session.py SPEC OUT``. SPEC: ``{"cases": {name: case}}``, a case
``{"model_dir", "push_model_dir", "prompts", "new_tokens", "dtype", "sample": {"temperature", "n", "seed"} | null,
"tp"}``.

Per case: one :class:`VLLMRollout` starts on ``model_dir``'s checkpoint (vLLM loads it itself) and generates greedy
("before"); then ``push_model_dir``'s weights, laid out as the rollout layout by the native engine's HF reader (what
the 3D-HybridEngine writes), go through the engine's flat buffer and ``push_weights`` (vLLM's in-place reload) and it
generates again ("after", and "sampled" when asked), and greedy once more through partial rollout, every segment
aborted after one round of 3 tokens and resumed ("segmented"). OUT: per case and phase the responses' ids and log-probs.

A case with ``"tp": N`` runs on N ranks (verl.launcher.spawn), each a vLLM TP worker (the external launcher) fed its own
shard of the rollout layout; OUT holds rank 0's outputs and, under ``"ranks"``, every rank's.
"""

import json
import os
import sys

import torch

ROUND_TOKENS = 3


def segmented_greedy(engine, prompts, params, round_tokens):
    """Greedy through partial rollout (verl.engine.rollout.partial): rounds of ``round_tokens``, every segment
    stopped after its first round (abort), each resumed by resubmitting prompt + the tokens so far."""
    import verl.engine.rollout.vllm.engine as vllm_engine
    from verl.engine.rollout.partial import PromptGroup, run_segment

    vllm_engine.SEGMENT_ROUND_TOKENS = round_tokens
    groups = [PromptGroup(uid=str(i), index=i, epoch=0, submit_step=0, prompt=list(p), fields={}, n=1)
              for i, p in enumerate(prompts)]
    segments = 0
    while not all(g.finished for g in groups) and segments <= params.response_length:
        run_segment(engine, groups, params, 0, version=segments, min_groups=len(groups), abort=lambda: True)
        segments += 1
    trajectories = [g.trajectories[0] for g in groups]
    return {"ids": [t.tokens for t in trajectories], "logprobs": [t.log_probs for t in trajectories],
            "segments": segments, "versions": [[t.min_version, t.max_version] for t in trajectories]}


def run_case(case: dict, tp_group=None) -> dict:
    """One case on this rank (``tp_group``: the rollout TP group of an SPMD case, each rank a vLLM TP worker)."""
    from verl.engine.rollout.base import SamplingParams
    from verl.engine.rollout.native.engine import NativeRollout
    from verl.engine.rollout.vllm.engine import VLLMRollout
    from verl.models.config import ModelConfig
    from verl.utils.torch_dtypes import DTYPES

    dtype = DTYPES[case.get("dtype", "float32")]
    config = ModelConfig.from_pretrained(case["model_dir"])
    prompts = case["prompts"]
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    greedy = SamplingParams(do_sample=False, response_length=case["new_tokens"], eos_token_id=case.get("eos", ()))

    def run(engine, params):
        out = engine.generate(ids, mask, params)
        rows = out["response_mask"].sum(-1).tolist()
        return {"ids": [r[:n] for r, n in zip(out["responses"].tolist(), rows, strict=True)],
                "logprobs": [r[:n] for r, n in zip(out["rollout_log_probs"].tolist(), rows, strict=True)]}

    with VLLMRollout(config, case["model_dir"], dtype=dtype, load_format="auto", max_rows=16,
                     max_seq_len=width + case["new_tokens"] + 8, tp_group=tp_group) as engine:
        result = {"before": run(engine, greedy)}
        # the rank's shard of the rollout layout (what the 3D-HybridEngine writes into this rank's buffer)
        native = NativeRollout(ModelConfig.from_pretrained(case["push_model_dir"]), tp_group=tp_group, dtype=dtype)
        native.load_hf_checkpoint(case["push_model_dir"])
        engine.weight_buffer().copy_(native.weight_buffer())
        result["buffer_numel"] = native.weight_buffer().numel()
        del native
        result["push"] = engine.push_weights()
        result["after"] = run(engine, greedy)
        result["segmented"] = segmented_greedy(engine, prompts, greedy, ROUND_TOKENS)
        if case.get("sample"):
            s = case["sample"]
            result["sampled"] = run(engine, SamplingParams(temperature=s["temperature"], n=s["n"], seed=s["seed"],
                                                           response_length=case["new_tokens"]))
    return result


def tp_case(case: dict) -> dict:
    """A rank of an SPMD case: the rollout TP group is every rank of the job."""
    import torch.distributed as dist

    return run_case(case, dist.new_group(list(range(dist.get_world_size()))))


def main(spec_path: str, out_path: str) -> None:
    cases = json.load(open(spec_path))["cases"]
    results = {}
    for name, case in cases.items():
        tp = case.get("tp", 1)
        if tp == 1:
            results[name] = run_case(case)
            continue
        import vllm_session  # this file by its module name: the ranks import what they run

        from verl.launcher.spawn import run_ranks

        ranks = run_ranks(vllm_session.tp_case, tp, case, timeout_s=600)  # every rank's outputs and buffer size
        results[name] = {**ranks[0], "ranks": ranks}
    with open(out_path, "w") as fh:
        json.dump(results, fh)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tp_case: importable by the rank processes
    main(sys.argv[1], sys.argv[2])
