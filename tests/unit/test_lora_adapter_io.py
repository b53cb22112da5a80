"""PEFT adapter directories (issue 56, fault 11 in part): an adapter whose effect is more than (alpha / r) B A on every
module (rsLoRA's alpha / sqrt(r), DoRA, per-module alpha or rank patterns, trained biases or extra modules) is
refused in one line instead of loaded with the wrong scaling; the writer is as durable as the HF export (every file
and the directories fsynced before and after the rename that publishes it) and leaves no staging directory when it
fails (a full disk)."""

import errno
import json
import os

import pytest
import torch

from verl.engine.lora import LoRAError, LoRASettings, peft_io

SETTINGS = LoRASettings(rank=4, alpha=8.0, where="actor_rollout_ref.model")
TENSORS = {"model.layers.0.self_attn.q_proj.lora_A.weight": torch.ones(4, 16),
           "model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(16, 4)}


@pytest.mark.parametrize("key, value", [("use_rslora", True), ("use_dora", True),
                                        ("alpha_pattern", {"q_proj": 32}), ("rank_pattern", {"q_proj": 8}),
                                        ("bias", "lora_only"), ("modules_to_save", ["lm_head"])])
def test_an_adapter_scaled_otherwise_than_alpha_over_r_is_refused_in_one_line(tmp_path, key, value):
    """Was: an rsLoRA adapter (and the others) loaded with alpha / r: a silently different model."""
    out = tmp_path / "adapter"
    peft_io.write_adapter(str(out), TENSORS, SETTINGS, "base")
    config = json.loads((out / peft_io.CONFIG).read_text())
    config[key] = value
    (out / peft_io.CONFIG).write_text(json.dumps(config))
    with pytest.raises(LoRAError) as err:
        peft_io.read_adapter(str(out), SETTINGS, "unused: refused before the model is read")
    assert str(err.value) == (f"actor_rollout_ref.model.lora_adapter_path: expected adapter_config.json with "
                              f"{key}={peft_io.UNSUPPORTED_ADAPTER_KEYS[key]!r} (verl-hpc applies alpha/r to every "
                              f"module), found {key}={value!r}")


def test_peft_s_own_off_values_are_accepted(tmp_path, monkeypatch):
    out = tmp_path / "adapter"
    peft_io.write_adapter(str(out), TENSORS, SETTINGS, "base")
    config = json.loads((out / peft_io.CONFIG).read_text())
    config.update(alpha_pattern={}, rank_pattern={}, use_rslora=False, bias="none")  # as PEFT writes them
    (out / peft_io.CONFIG).write_text(json.dumps(config))
    monkeypatch.setattr(peft_io, "_hf_shapes", lambda path: {"model.layers.0.self_attn.q_proj.weight": (16, 16)})
    tensors = peft_io.read_adapter(str(out), SETTINGS, "base")
    assert sorted(tensors) == sorted(TENSORS)


def test_the_writer_fsyncs_every_file_before_publishing_and_cleans_up_a_failed_write(tmp_path, monkeypatch):
    """Was: no fsync (a node crash could publish zero-filled files) and a failed write left its staging dir."""
    from verl.utils import checkpoint

    synced = []
    real = checkpoint.fsync_path
    monkeypatch.setattr(checkpoint, "fsync_path", lambda path: (synced.append(path), real(path)))
    out = tmp_path / "adapter"
    peft_io.write_adapter(str(out), TENSORS, SETTINGS, "base")
    names = {os.path.basename(p) for p in synced}
    assert {peft_io.CONFIG, peft_io.WEIGHTS} <= names  # the files, in staging, before the rename
    assert synced[-1] == str(tmp_path)  # the parent after it: the rename itself is durable

    class FullDisk:
        def save_pretrained(self, path):
            raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        peft_io.write_adapter(str(out), TENSORS, SETTINGS, "base", tokenizer=FullDisk())
    assert sorted(os.listdir(tmp_path)) == ["adapter"]  # no .adapter_* staging dir left behind
    assert json.loads((out / peft_io.CONFIG).read_text())["r"] == 4  # the published adapter is untouched


def _base(path, seed):
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    save_file({"model.embed_tokens.weight": torch.randn(64, 16, generator=gen),
               "model.layers.0.self_attn.q_proj.weight": torch.randn(16, 16, generator=gen)},
              os.path.join(path, "model.safetensors"))
    return str(path)


def test_a_lora_only_checkpoint_resumed_on_another_base_is_refused(tmp_path):
    """Was: the manifest recorded rank and alpha only, so adapters trained on one base (a fine-tune of the same
    architecture) loaded silently onto another."""
    import shutil
    import types

    from verl.engine.lora import base_fingerprint
    from verl.engine.megatron.checkpoint import _check_lora, _lora_record
    from verl.utils.checkpoint import CheckpointError

    base_a, base_b = _base(tmp_path / "a", 1), _base(tmp_path / "b", 2)
    shutil.copytree(base_a, tmp_path / "a_copy")
    assert base_fingerprint(base_a) != base_fingerprint(base_b)  # same names, shapes and header
    assert base_fingerprint(base_a) == base_fingerprint(str(tmp_path / "a_copy"))
    assert base_fingerprint(str(tmp_path / "config_only")) is None

    def engine(base):  # what load_hf_weights records on a LoRA engine
        return types.SimpleNamespace(lora=SETTINGS, base_model_path=base, base_fingerprint=base_fingerprint(base))

    manifest = {"lora_only": True, "lora": _lora_record(engine(base_a))}
    assert _check_lora(engine(str(tmp_path / "a_copy")), manifest, "ckpt") is True
    with pytest.raises(CheckpointError, match=rf"^checkpoint ckpt: expected adapters trained on this actor's base "
                       rf"model {base_b} \(fingerprint [0-9a-f]{{8}}\), found adapters of another base"):
        _check_lora(engine(base_b), manifest, "ckpt")
    # a full checkpoint carries its base: another model.path is fine; a manifest before fingerprints resumes too
    assert _check_lora(engine(base_b), {**manifest, "lora_only": False}, "ckpt") is False
    assert _check_lora(engine(base_b), {"lora_only": True, "lora": {"rank": 4, "alpha": 8.0}}, "ckpt") is True
    with pytest.raises(CheckpointError, match="expected a checkpoint of this actor's LoRA"):
        _check_lora(engine(base_a), {"lora_only": True, "lora": {"rank": 8, "alpha": 8.0}}, "ckpt")
