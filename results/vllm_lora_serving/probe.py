"""vLLM's CPU backend generating with a LoRA adapter served by vLLM (its LoRA layers and punica CPU kernels, the
adapter from a PEFT directory) against the same engine without one, and an engine built without LoRA: the cost of
serving the adapter instead of merging it into the weights first (what verl-hpc's rollout engines do after an
adapter-only sync). Run in .venv-vllm:

    python probe.py MODEL_DIR {base,lora} > logs/<mode>.log

A random rank-16 adapter on every projection of every layer (alpha 32), 32 prompts of 100 tokens, 32 new tokens
each, greedy, fp32, 3 repeats. The first response's token ids and first log-prob show whether the adapter acts."""

import json
import os
import sys
import time

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process, as verl-hpc runs it
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

RANK, ALPHA, PROMPTS, PROMPT_LEN, NEW_TOKENS = 16, 32, 32, 100, 32


def write_adapter(model_dir: str, out: str) -> None:
    cfg = json.load(open(os.path.join(model_dir, "config.json")))
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    kv = cfg["num_key_value_heads"] * (h // cfg["num_attention_heads"])
    parts = {"self_attn.q_proj": (h, h), "self_attn.k_proj": (h, kv), "self_attn.v_proj": (h, kv),
             "self_attn.o_proj": (h, h), "mlp.gate_proj": (h, inter), "mlp.up_proj": (h, inter),
             "mlp.down_proj": (inter, h)}
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for name, (fan_in, fan_out) in parts.items():
            prefix = f"base_model.model.model.layers.{layer}.{name}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(RANK, fan_in, generator=g) / fan_in ** 0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, RANK, generator=g) * 0.1
    os.makedirs(out, exist_ok=True)
    save_file(tensors, os.path.join(out, "adapter_model.safetensors"))
    with open(os.path.join(out, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": RANK, "lora_alpha": ALPHA, "bias": "none", "task_type": "CAUSAL_LM",
                   "target_modules": sorted({p.split(".")[-1] for p in parts}), "base_model_name_or_path": model_dir},
                  f)


def main(model_dir: str, mode: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    adapter = "/tmp/verl_vllm_lora_probe_adapter"
    write_adapter(model_dir, adapter)
    torch.set_num_threads(2)
    start = time.perf_counter()
    llm = LLM(model=model_dir, dtype="float32", enforce_eager=True, max_model_len=256, max_num_seqs=PROMPTS, seed=0,
              enable_lora=mode == "lora", max_lora_rank=RANK, max_loras=1, disable_log_stats=True)
    print(f"engine start-up {time.perf_counter() - start:.1f} s", flush=True)
    prompts = [{"prompt_token_ids": list(range(100 + i, 100 + i + PROMPT_LEN))} for i in range(PROMPTS)]
    sp = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)
    cases = [("no adapter", None)]
    if mode == "lora":
        cases.append(("adapter served", LoRARequest("probe", 1, adapter)))
    for label, request in cases:
        for _ in range(3):
            start = time.perf_counter()
            outs = llm.generate(prompts, sp, lora_request=request, use_tqdm=False)
            first = outs[0].outputs[0]
            logprob = next(iter(first.logprobs[0].values())).logprob
            print(f"RESULT engine={mode} case={label} seconds={time.perf_counter() - start:.3f} "
                  f"first_ids={list(first.token_ids[:6])} first_logprob={logprob:.4f}", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
