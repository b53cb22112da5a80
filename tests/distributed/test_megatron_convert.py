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
