"""`verl sft` on the Megatron engine: a few steps train, export a loadable HF directory whose
transformers logits equal the trained Megatron model's (TP1 x DP2 and TP2), and bad configs fail
early with one line."""

import json
import os

import pytest
import torch

pytest.importorskip("megatron.core")

from verl.launcher.spawn import run_ranks  # noqa: E402
from verl.trainer import main_sft, sft_trainer  # noqa: E402
from verl.utils.dataset import arithmetic  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join(ROOT, "configs", "sft_arith_tiny.yaml")
STEPS = 30


@pytest.fixture(scope="module")
def arith_dir(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("arith"))
    arithmetic.main(["--out", out, "--num-train", "256", "--num-test", "32"])
    return out


def overrides(arith_dir, out_dir, *extra):
    return [f"data.train_files={arith_dir}/train.parquet", f"data.val_files={arith_dir}/test.parquet",
            f"model.tokenizer_path={arith_dir}/tokenizer", f"trainer.output_dir={out_dir}",
            f"trainer.total_training_steps={STEPS}", "trainer.log_freq=10", "trainer.logger=[]",
            "data.train_batch_size=32", "data.micro_batch_size_per_gpu=16", *extra]


def test_sft_cli_trains_logs_and_exports_hf_dir(arith_dir, tmp_path, capfd):
    out = tmp_path / "sft"
    assert main_sft.main(["--config", CONFIG, *overrides(arith_dir, out)]) == 0
    console = capfd.readouterr().out
    assert f"step {STEPS}/{STEPS}" in console and "val/accuracy" in console

    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    losses = [r["train/loss"] for r in records]
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5, losses
    assert 0.0 <= records[-1]["val/accuracy"] <= 1.0 and records[-1]["val/loss"] < losses[0]

    hf = out / "hf"
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
                 "tokenizer_config.json"):
        assert (hf / name).is_file(), name
    assert json.loads((hf / "generation_config.json").read_text())["eos_token_id"] == 2
    assert sorted(os.listdir(out)) == ["hf", "metrics.jsonl", "sft_config.json"]  # no staging dirs left


def _train_and_logits(cfg, train, val, out_root):
    """Per rank: for TP1 (x DP2) and TP2, train a few steps, export, and return full-vocab logits."""
    import copy

    import torch.distributed as dist
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region
    from transformers import AutoTokenizer

    from verl.engine.megatron.parallel import destroy_megatron
    from verl.engine.padding import restore

    tokenizer = AutoTokenizer.from_pretrained(cfg["model"]["tokenizer_path"])
    batch = val.batch(torch.arange(8))
    results = {}
    for tp in (1, 2):
        run_cfg = copy.deepcopy(cfg)
        run_cfg["megatron"]["tensor_model_parallel_size"] = tp
        trainer = sft_trainer.SFTTrainer(run_cfg, train, val)
        metrics = trainer.fit()
        hf_dir = trainer.export_hf(os.path.join(out_root, f"tp{tp}"), tokenizer)

        def logits_fn(output, aligned_ids, shifts, micro_batch):
            return {"logits": restore(gather_from_tensor_model_parallel_region(output), shifts)}

        logits = trainer.engine.forward(batch, 8, logits_fn)["logits"][..., :trainer.model_config.vocab_size]
        results[f"tp{tp}"] = {"hf_dir": hf_dir, "logits": logits, "loss": metrics["train/loss"]}
        destroy_megatron()
    return results if dist.get_rank() == 0 else {}


def test_exported_hf_logits_equal_megatron_logits_tp1_dp2_and_tp2(arith_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    cfg = main_sft.load_sft_config(CONFIG, overrides(arith_dir, tmp_path / "unused", "trainer.nproc=2",
                                                        "trainer.total_training_steps=5"))
    train, val, _ = main_sft.load_data(cfg)
    results = run_ranks(_train_and_logits, 2, cfg, train, val, str(tmp_path), timeout_s=180)[0]
    batch = val.batch(torch.arange(8))
    mask = batch["attention_mask"]
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    for name, result in results.items():
        model = AutoModelForCausalLM.from_pretrained(result["hf_dir"], attn_implementation="eager").eval()
        with torch.no_grad():
            hf_logits = model(input_ids=batch["input_ids"], attention_mask=mask, position_ids=positions).logits
        valid = mask.bool()
        torch.testing.assert_close(hf_logits[valid], result["logits"][valid], atol=2e-4, rtol=1e-4, msg=name)


@pytest.mark.parametrize("extra, message", [
    (["data.label_nosie=0.1"], "did you mean 'data.label_noise'"),
    (["data.label_noise=1.5"], "data.label_noise: expected a fraction in [0, 1)"),
    (["megatron.tensor_model_parallel_size=3"], "expected a divisor of num_attention_heads"),
    (["trainer.nproc=2", "megatron.tensor_model_parallel_size=2", "data.micro_batch_size_per_gpu=5"],
     "data.micro_batch_size_per_gpu=5"),
    (["data.max_length=4"], "data.max_length"),
    (["data.response_key=answer"], "data.response_key"),
])
def test_malformed_config_exits_2_with_one_line_and_writes_nothing(arith_dir, tmp_path, capsys, extra, message):
    out = tmp_path / "sft"
    assert main_sft.main(["--config", CONFIG, *overrides(arith_dir, out, *extra)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("verl sft: ") and message in err, err
    assert not out.exists()


def test_label_noise_relabels_the_configured_fraction_with_wrong_answers():
    pairs = [(f"{a}+1=", str(a + 1)) for a in range(10, 110)]
    noisy, count = arithmetic.add_label_noise(pairs, 0.3, seed=7)
    changed = [i for i, (old, new) in enumerate(zip(pairs, noisy, strict=False)) if old != new]
    assert count == 30 and len(changed) == 30
    assert all(noisy[i][0] == pairs[i][0] for i in range(len(pairs)))  # prompts untouched
    assert noisy == arithmetic.add_label_noise(pairs, 0.3, seed=7)[0]  # seeded


def test_sft_batch_masks_the_prompt_and_ends_the_response_with_eos(arith_dir, tmp_path):
    cfg = main_sft.load_sft_config(CONFIG, overrides(arith_dir, tmp_path / "unused", "data.label_noise=0.0"))
    train, val, tokenizer = main_sft.load_data(cfg)
    assert train.input_ids.shape[1] == val.input_ids.shape[1] and len(val) == 32
    row = 0
    ids, mask = train.input_ids[row], train.attention_mask[row]
    R = train.responses.size(1)
    prompt = tokenizer.decode(ids[:-R][mask[:-R].bool()].tolist())
    response = train.responses[row][train.response_mask[row].bool()].tolist()
    assert response[-1] == tokenizer.eos_token_id
    a, b = prompt.rstrip("=").split("+")
    assert tokenizer.decode(response[:-1]) == str(int(a) + int(b))
    assert torch.equal(train.responses, train.input_ids[:, -R:])
