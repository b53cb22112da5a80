"""`verl convert` (main(argv)): HF -> megatron (tp2 x pp2, 4 spawned ranks) -> HF is bit-exact;
bad input is one clear line and exit code 2."""

import os

import pytest
import torch

pytest.importorskip("megatron.core")

from helpers.megatron_tiny_models import hf_model, save_hf  # noqa: E402

from verl.engine.megatron.convert import main  # noqa: E402


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return save_hf(hf_model("qwen2_gqa_tied", seed=9), str(tmp_path_factory.mktemp("hf")), sharded=True)


def _tensors(path):
    from verl.models.hf_io import HFCheckpoint

    checkpoint = HFCheckpoint(path)
    return {name: checkpoint.get(name) for name in checkpoint.files}


def test_round_trip_reproduces_every_tensor_bit_exactly(hf_dir, tmp_path):
    ckpt, back = str(tmp_path / "mcore"), str(tmp_path / "hf_back")
    assert main(["hf-to-mcore", "--hf-dir", hf_dir, "--out", ckpt, "--tp", "2", "--pp", "2"]) == 0
    assert main(["mcore-to-hf", "--ckpt", ckpt, "--out", back, "--max-shard-bytes", "30000"]) == 0
    original, restored = _tensors(hf_dir), _tensors(back)
    assert sorted(original) == sorted(restored)
    for name, tensor in original.items():
        assert tensor.dtype == restored[name].dtype and torch.equal(tensor, restored[name]), name
    assert os.path.isfile(os.path.join(back, "model.safetensors.index.json"))
    assert os.path.isfile(os.path.join(back, "config.json"))


def test_tp_not_dividing_heads_is_rejected_with_one_line(hf_dir, tmp_path, capsys):
    out = str(tmp_path / "never")
    assert main(["hf-to-mcore", "--hf-dir", hf_dir, "--out", out, "--tp", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "tp=3: expected a divisor of num_attention_heads=4" in err, err
    assert not os.path.exists(out)


def test_missing_checkpoint_file_is_rejected_with_exit_2(tmp_path, capsys):
    assert main(["mcore-to-hf", "--ckpt", str(tmp_path / "absent"), "--out", str(tmp_path / "o")]) == 2
    assert "expected verl_checkpoint.json, found it missing" in capsys.readouterr().err


def test_moe_round_trip_through_ep2_is_bit_exact_and_generate_runs_at_ep2(tmp_path):
    """Qwen3-MoE: HF -> megatron dist checkpoint at EP2 (2 ranks, each holding half of the experts) -> HF at EP1
    is bit-exact, every expert by name (TP2 x EP2 shards gather bit-exactly in test_megatron_moe.py); `verl
    generate --engine megatron --ep 2` gives transformers' greedy ids; an EP not dividing the experts is one line."""
    from helpers.moe_models import save_model

    from verl.engine.megatron.generate import main as generate_main

    model = save_model("qwen3_moe", tmp_path / "moe", seed=4)
    hf_dir, ckpt, back = str(tmp_path / "moe"), str(tmp_path / "mcore"), str(tmp_path / "back")
    assert main(["hf-to-mcore", "--hf-dir", hf_dir, "--out", ckpt, "--ep", "2"]) == 0
    assert main(["mcore-to-hf", "--ckpt", ckpt, "--out", back]) == 0
    original, restored = _tensors(hf_dir), _tensors(back)
    assert sorted(original) == sorted(restored)
    assert all(torch.equal(tensor, restored[name]) for name, tensor in original.items())
    prompt = [5, 17, 42, 99]
    with torch.no_grad():
        hf = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=6, pad_token_id=0)
    out = tmp_path / "generate.json"
    assert generate_main(["--model", hf_dir, "--ep", "2", "--input-ids", ",".join(map(str, prompt)),
                          "--max-new-tokens", "6", "--json", str(out)]) == 0
    import json

    assert json.loads(out.read_text())["output_ids"] == [hf[0, len(prompt):].tolist()]
    assert main(["hf-to-mcore", "--hf-dir", hf_dir, "--out", str(tmp_path / "never"), "--ep", "3"]) == 2
    assert not os.path.exists(tmp_path / "never")
