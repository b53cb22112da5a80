"""HF export streams (issue 14, row 4): on 2 gloo ranks at Megatron TP=2, with the parameters bound to
one flat buffer as the 3D-HybridEngine binds them in training, exporting a ~30 MB untied Qwen2 grows
no rank's RSS by more than ~2x the model (the gather-everything path grew a rank by > 10x), the
shards carry an index, and transformers loads the export with the source model's logits."""

import json
import os
import threading
import time

import pytest
import torch

from verl.launcher.spawn import run_ranks

# Untied, ~7.3M parameters (~29 MB in fp32), 51 tensors.
CONFIG = dict(model_type="qwen2", vocab_size=8192, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
SHARD_BYTES = 8 * 1024 ** 2


class PeakRSS:
    """The largest RSS of this process while the ``with`` block runs, sampled every millisecond."""

    def __enter__(self):
        import psutil

        self.process = psutil.Process()
        self.base = self.peak = self.process.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.process.memory_info().rss)
            time.sleep(0.001)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.process.memory_info().rss)

    @property
    def growth(self) -> int:
        return self.peak - self.base


def _export_job(model_dir, out_dir, shard_bytes):
    import gc

    from verl.engine.megatron.engine import MegatronEngine
    from verl.engine.megatron.parallel import destroy_megatron, initialize_megatron
    from verl.models.config import ModelConfig
    from verl.models.hf_export import export_actor_hf
    from verl.models.hf_io import HFCheckpoint
    from verl.models.mcore.weights import load_hf_into_model

    initialize_megatron(2, 1, seed=1)
    config = ModelConfig.from_pretrained(model_dir)
    engine = MegatronEngine(config, optim=None)
    load_hf_into_model(engine.module, config, HFCheckpoint(model_dir).get)
    # Training binds every parameter to a view of one flat buffer (the 3D-HybridEngine's, or Megatron's
    # distributed-optimizer buffer): what the reshard copies from.
    params = list(engine.module.parameters())
    flat = torch.empty(sum(p.numel() for p in params))
    offset = 0
    with torch.no_grad():
        for p in params:
            view = flat[offset:offset + p.numel()].view(p.shape)
            view.copy_(p.data)
            p.data = view
            offset += p.numel()
    gc.collect()
    with PeakRSS() as rss:
        export_actor_hf(engine, config, model_dir, out_dir, tokenizer=None, max_shard_bytes=shard_bytes)
    destroy_megatron()
    return {"growth": rss.growth, "base": rss.base}


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    from transformers import AutoConfig, AutoModelForCausalLM

    root = tmp_path_factory.mktemp("hf_export_memory")
    cfg = dict(CONFIG)
    config = AutoConfig.for_model(cfg.pop("model_type"), max_position_embeddings=128, bos_token_id=1,
                                  eos_token_id=2, pad_token_id=0, **cfg)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(str(root / "src"))
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    start = time.perf_counter()
    ranks = run_ranks(_export_job, 2, str(root / "src"), str(root / "out"), SHARD_BYTES, timeout_s=240)
    return {"root": root, "ranks": ranks, "model_bytes": model_bytes, "seconds": time.perf_counter() - start}


def test_export_peak_rss_growth_is_bounded(export):
    model_bytes = export["model_bytes"]
    assert model_bytes > 25 * 1024 ** 2
    for rank, result in enumerate(export["ranks"]):
        print(f"rank {rank}: RSS +{result['growth'] / 2 ** 20:.1f} MiB during export "
              f"({result['growth'] / model_bytes:.2f}x the {model_bytes / 2 ** 20:.1f} MiB model)")
        assert result["growth"] < 2 * model_bytes, (rank, result["growth"], model_bytes)


def test_export_is_sharded_with_an_index_and_nothing_staged(export):
    out = export["root"] / "out"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 3 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert all(os.path.getsize(out / f) <= SHARD_BYTES + 65536 or len(_names(out / f)) == 1 for f in files)
    assert index["metadata"]["total_size"] == export["model_bytes"]
    assert not [p for p in os.listdir(export["root"]) if ".tmp" in p or ".old" in p]
    config = json.loads((out / "config.json").read_text())
    assert config["torch_dtype"] == "float32" and config["architectures"] == ["Qwen2ForCausalLM"]
    assert (out / "generation_config.json").is_file()


def _names(path):
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as fh:
        return list(fh.keys())


def test_transformers_loads_the_export_with_the_source_logits(export):
    from transformers import AutoModelForCausalLM

    src = AutoModelForCausalLM.from_pretrained(str(export["root"] / "src"), attn_implementation="eager").eval()
    out = AutoModelForCausalLM.from_pretrained(str(export["root"] / "out"), attn_implementation="eager").eval()
    ids = torch.randint(0, CONFIG["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(src(ids).logits, out(ids).logits)
    for (name, a), (_, b) in zip(sorted(src.state_dict().items()), sorted(out.state_dict().items()), strict=True):
        assert torch.equal(a, b), name
