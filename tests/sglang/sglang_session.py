"""Runs under .venv-sglang/bin/python (the tests drive SGLang from .venv through this script).

    python sglang_session.py SPEC.json OUT.json

SPEC: {"cases": {NAME: {"model_dir", "tp", "prompts": [[ids]], "new_tokens", "push_model_dir" or
"push_buffers" (optional), "bucket_bytes" (optional), "segment_round_tokens" (optional: also greedy through
partial rollout, segments of one round of that many tokens)}}}. The cases run one after another in this one
process (SGLang's import is paid once). Each case is one SGLangRollout session: greedy generate on
the start weights; then, if a push is given, push every rollout TP rank's flat buffer into the
running engine and greedy-generate again. The buffers are built from the HF checkpoint
``push_model_dir`` through the project's rollout-layout code, or read from ``push_buffers`` (a
``torch.save``'d list, one flat buffer per rollout TP rank, e.g. the hybrid engine's reshard output).
OUT: {NAME: {"before": {"ids", "logprobs"}, "after": {...}, "buckets": int, "seconds": {...}, "listening":
[[address, port, process name]] (every TCP listener of this process and the engine's, after the first generate)}}.
"""

import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from helpers.listeners import listening_sockets, process_tree  # noqa: E402  (tests/, not a package)
from helpers.tiny_models import left_pad  # noqa: E402


def rank_buffers(model_dir, config, tp, dtype):
    """Each rollout TP rank's flat buffer, filled from an HF checkpoint by the layout loader."""
    from verl.engine.rollout.native.flat_params import FlatParams
    from verl.engine.rollout.native.weights import load_hf_checkpoint
    from verl.hybrid_engine.rollout_layout import rollout_param_specs

    buffers = []
    for rank in range(tp):
        params = FlatParams(rollout_param_specs(config, tp, rank), dtype)
        load_hf_checkpoint(model_dir, config, tp, rank, params.views)
        buffers.append(params.flat)
    return buffers


def greedy(rollout, ids, mask, new_tokens):
    from verl.engine.rollout.base import SamplingParams

    out = rollout.generate(ids, mask, SamplingParams(temperature=0.0, response_length=new_tokens))
    lengths = out["response_mask"].sum(-1).tolist()
    return {"ids": [r[:n] for r, n in zip(out["responses"].tolist(), lengths, strict=False)],
            "logprobs": [r[:n] for r, n in zip(out["rollout_log_probs"].tolist(), lengths, strict=False)]}


def segmented_greedy(rollout, prompts, new_tokens, round_tokens):
    """Greedy through partial rollout (verl.engine.rollout.partial): rounds of ``round_tokens``, every segment
    stopped after its first round (abort), each resumed by resubmitting prompt + the tokens so far."""
    from verl.engine.rollout import sglang_rollout
    from verl.engine.rollout.base import SamplingParams
    from verl.engine.rollout.partial import PromptGroup, run_segment

    sglang_rollout.SEGMENT_ROUND_TOKENS = round_tokens
    groups = [PromptGroup(uid=str(i), index=i, epoch=0, submit_step=0, prompt=list(p), fields={}, n=1)
              for i, p in enumerate(prompts)]
    params = SamplingParams(temperature=0.0, response_length=new_tokens)
    segments = 0
    while not all(g.finished for g in groups) and segments <= new_tokens:
        run_segment(rollout, groups, params, 0, version=segments, min_groups=len(groups), abort=lambda: True)
        segments += 1
    trajectories = [g.trajectories[0] for g in groups]
    return {"ids": [t.tokens for t in trajectories], "logprobs": [t.log_probs for t in trajectories],
            "segments": segments, "versions": [[t.min_version, t.max_version] for t in trajectories]}


def process_name(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().split(b"\0")[0].decode(errors="replace")
    except OSError:
        return "?"


def run_case(spec):
    from verl.engine.rollout.sglang_rollout import SGLangRollout
    from verl.models.config import ModelConfig

    config = ModelConfig.from_pretrained(spec["model_dir"])
    ids, mask = left_pad(spec["prompts"])
    result, seconds = {}, {}
    start = time.perf_counter()
    # A small KV pool: SGLang otherwise sizes it from free host memory (GBs, seconds to allocate).
    with SGLangRollout(config, spec["model_dir"], tp_size=spec["tp"], dtype=torch.float32,
                       max_total_tokens=spec.get("max_total_tokens", 4096)) as rollout:
        seconds["engine_start"] = time.perf_counter() - start
        rollout.resume()
        result["before"] = greedy(rollout, ids, mask, spec["new_tokens"])
        result["listening"] = [[addr, port, process_name(pid)]
                               for addr, port, pid in listening_sockets(process_tree(os.getpid()))]
        if spec.get("segment_round_tokens"):
            result["segmented"] = segmented_greedy(rollout, spec["prompts"], spec["new_tokens"],
                                                   spec["segment_round_tokens"])
        rollout.release()
        if spec.get("push_model_dir") or spec.get("push_buffers"):
            if spec.get("push_buffers"):
                buffers = torch.load(spec["push_buffers"], weights_only=True)
            else:
                buffers = rank_buffers(spec["push_model_dir"], config, spec["tp"], torch.float32)
            rollout.resume()
            start = time.perf_counter()
            result["buckets"] = rollout.update_weights(buffers, bucket_bytes=spec.get("bucket_bytes", 64 << 20))
            seconds["push"] = time.perf_counter() - start
            result["after"] = greedy(rollout, ids, mask, spec["new_tokens"])
    result["seconds"] = seconds
    return result


def main(spec_path, out_path):
    with open(spec_path) as fh:
        spec = json.load(fh)
    results = {name: run_case(case) for name, case in spec["cases"].items()}
    with open(out_path, "w") as fh:
        json.dump(results, fh)


if __name__ == "__main__":
    main(*sys.argv[1:])
