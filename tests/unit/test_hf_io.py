"""verl.models.hf_io: config and generation-config resolution, the lazy safetensors reader (single file and
sharded with an index), the streamed sharded atomic writer, and one clear CheckpointError per broken file."""

import json
import os
import socket
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from verl.models.hf_io import (
    SAFETENSORS_INDEX,
    SAFETENSORS_SINGLE,
    HFCheckpoint,
    HFWriteError,
    config_file,
    generation_config,
    has_hf_weights,
    model_dir_problem,
    read_config,
    read_safetensors_header,
    special_token_ids,
    write_hf_dir,
)
from verl.utils.checkpoint import CheckpointError

CONFIG = {"model_type": "qwen2", "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}


def tensors():
    """Every kind the writer must keep bit-exact: float dtypes, ints, bool, a scalar, an empty tensor."""
    g = torch.Generator().manual_seed(0)
    return [
        ("model.embed_tokens.weight", torch.randn(16, 8, generator=g)),
        ("model.layers.0.mlp.up_proj.weight", torch.randn(12, 8, generator=g).to(torch.bfloat16)),
        ("model.layers.0.mlp.down_proj.weight", torch.randn(8, 12, generator=g).half()),
        ("model.norm.weight", torch.randn(8, generator=g).double()),
        ("position_ids", torch.arange(10, dtype=torch.int64)),
        ("mask", torch.tensor([True, False, True])),
        ("scale", torch.tensor(0.5)),
        ("empty", torch.zeros(0, 4)),
    ]


class FakeTokenizer:
    bos_token_id, eos_token_id, pad_token_id = 11, 12, None

    def save_pretrained(self, path):
        with open(os.path.join(path, "tokenizer_config.json"), "w") as fh:
            json.dump({"model_max_length": 64}, fh)


def write_dir(path, max_shard_bytes=1 << 30, **kwargs):
    return write_hf_dir(str(path), iter(tensors()), CONFIG, max_shard_bytes=max_shard_bytes, **kwargs)


# ----------------------------------------------------------------------------- configs
def test_config_of_a_directory_or_of_the_file_itself(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    assert config_file(str(tmp_path)) == str(tmp_path / "config.json")
    assert config_file(str(tmp_path / "config.json")) == str(tmp_path / "config.json")
    assert read_config(str(tmp_path)) == read_config(str(tmp_path / "config.json")) == CONFIG


@pytest.mark.parametrize("content, message", [
    (None, "config.json to exist, found nothing"),
    ("{not json", "config.json: expected JSON, found invalid JSON"),
    (b"\xff\xfe{}", "config.json: expected JSON, found bytes that are not UTF-8"),
    ("[1, 2]", "config.json: expected a JSON object, found list"),
])
def test_bad_config_is_one_clear_error(tmp_path, content, message):
    if isinstance(content, bytes):
        (tmp_path / "config.json").write_bytes(content)
    elif content is not None:
        (tmp_path / "config.json").write_text(content)
    with pytest.raises(CheckpointError, match=message):
        read_config(str(tmp_path))


def test_special_token_ids_prefer_the_tokenizer_and_leave_absent_ones_out():
    assert special_token_ids(FakeTokenizer(), CONFIG) == {"bos_token_id": 11, "eos_token_id": 12, "pad_token_id": 0}
    assert special_token_ids(None, {"eos_token_id": [2, 3]}) == {"eos_token_id": [2, 3]}


def test_generation_config_is_the_file_with_missing_ids_filled(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    # No generation_config.json: the tokenizer's ids, else config.json's.
    assert generation_config(str(tmp_path)) == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    assert generation_config(str(tmp_path), FakeTokenizer())["eos_token_id"] == 12
    assert generation_config(str(tmp_path / "config.json")) == {"bos_token_id": 1, "eos_token_id": 2,
                                                                 "pad_token_id": 0}
    # The file wins for what it sets; an id it leaves out (or null) comes from config.json.
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [7, 8], "pad_token_id": None, "do_sample": True, "temperature": 0.7}))
    assert generation_config(str(tmp_path)) == {"eos_token_id": [7, 8], "pad_token_id": 0, "bos_token_id": 1,
                                                "do_sample": True, "temperature": 0.7}


# ----------------------------------------------------------------------------- writing
def test_single_file_round_trips_bit_exactly_through_safetensors_and_our_reader(tmp_path):
    out = write_dir(tmp_path / "hf", tokenizer=FakeTokenizer(), generation={"eos_token_id": 2, "do_sample": False})
    assert sorted(os.listdir(out)) == ["config.json", "generation_config.json", SAFETENSORS_SINGLE,
                                       "tokenizer_config.json"]
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config == {**CONFIG, "torch_dtype": "float32"}  # the first floating tensor's dtype
    assert json.loads((tmp_path / "hf" / "generation_config.json").read_text()) == {"eos_token_id": 2,
                                                                                    "do_sample": False}
    by_safetensors = load_file(os.path.join(out, SAFETENSORS_SINGLE))
    checkpoint = HFCheckpoint(out)
    for name, tensor in tensors():
        for loaded in (by_safetensors[name], checkpoint.get(name)):
            assert loaded.dtype == tensor.dtype and loaded.shape == tensor.shape and torch.equal(loaded, tensor), name


def test_shards_stay_under_the_limit_and_are_indexed_as_transformers_names_them(tmp_path):
    limit = 600  # bytes: the 16x8 fp32 embedding (512 B) fits alone, the rest packs around it
    out = write_dir(tmp_path / "hf", max_shard_bytes=limit)
    index = json.loads((tmp_path / "hf" / SAFETENSORS_INDEX).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 2 and files == [f"model-{i:05d}-of-{len(files):05d}.safetensors"
                                         for i in range(1, len(files) + 1)]
    assert set(index["weight_map"]) == {name for name, _ in tensors()}
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for _, t in tensors())
    for file in files:
        header = read_safetensors_header(os.path.join(out, file))
        data = sum(end - start for start, end in (e["data_offsets"] for e in header.values()))
        assert data <= limit or len(header) == 1, file
    assert not [f for f in os.listdir(out) if f.endswith(".partial")]
    checkpoint = HFCheckpoint(out)
    for name, tensor in tensors():
        assert torch.equal(checkpoint.get(name), tensor), name


def test_a_tensor_larger_than_the_limit_gets_a_shard_of_its_own(tmp_path):
    out = write_hf_dir(str(tmp_path / "hf"), [("a", torch.ones(4)), ("big", torch.ones(100)), ("b", torch.ones(4))],
                       {}, max_shard_bytes=64)
    weight_map = json.loads((tmp_path / "hf" / SAFETENSORS_INDEX).read_text())["weight_map"]
    assert weight_map == {"a": "model-00001-of-00003.safetensors", "big": "model-00002-of-00003.safetensors",
                          "b": "model-00003-of-00003.safetensors"}
    assert "torch_dtype" in read_config(out)


def test_a_failing_stream_leaves_the_previous_directory_and_nothing_staged(tmp_path):
    out = write_dir(tmp_path / "hf")
    before = sorted(os.listdir(out))

    def broken():
        yield from tensors()[:3]
        raise RuntimeError("rank died")

    with pytest.raises(RuntimeError, match="rank died"):
        write_hf_dir(out, broken(), CONFIG, max_shard_bytes=100)
    assert sorted(os.listdir(out)) == before and torch.equal(HFCheckpoint(out).get("scale"), torch.tensor(0.5))
    assert sorted(os.listdir(tmp_path)) == ["hf"]  # no .tmp-/.old- directory
    with pytest.raises(RuntimeError):
        write_hf_dir(str(tmp_path / "fresh"), broken(), CONFIG)
    assert sorted(os.listdir(tmp_path)) == ["hf"]


def test_staging_a_killed_writer_left_is_removed_but_not_a_live_or_another_hosts(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True, timeout=30)
    dead_pid = int(dead.stdout)
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        host = socket.gethostname()
        left = {"killed": f"hf.tmp-{host}-{dead_pid}", "live": f"hf.tmp-{host}-{live.pid}",
                "other host": f"hf.tmp-{host}x-{dead_pid}", "convert's": "hf.tmp-convert-ab12"}
        for name in left.values():
            (tmp_path / name).mkdir()
            (tmp_path / name / "part").write_bytes(b"x")
        write_dir(tmp_path / "hf")
        assert sorted(os.listdir(tmp_path)) == sorted(["hf", left["live"], left["other host"], left["convert's"]])
    finally:
        live.kill()
        live.wait(timeout=30)
    write_dir(tmp_path / "hf")  # its writer has ended now
    assert sorted(os.listdir(tmp_path)) == sorted(["hf", left["other host"], left["convert's"]])


def test_replace_swaps_the_directory_and_replace_false_refuses_an_existing_one(tmp_path):
    out = write_dir(tmp_path / "hf")
    write_hf_dir(out, [("only", torch.zeros(2))], {"model_type": "llama"})
    assert HFCheckpoint(out).files == {"only": os.path.join(out, SAFETENSORS_SINGLE)}
    assert read_config(out)["model_type"] == "llama"
    assert sorted(os.listdir(tmp_path)) == ["hf"]
    with pytest.raises(FileExistsError, match="expected a path that does not exist yet"):
        write_hf_dir(out, [("x", torch.zeros(1))], {}, replace=False)


@pytest.mark.parametrize("stream, message", [
    ([("w", torch.zeros(1)), ("w", torch.zeros(1))], "expected each tensor name once, found w twice"),
    ([("c", torch.zeros(2, dtype=torch.complex64))], "c: expected one of the safetensors dtypes, found .*complex64"),
])
def test_tensors_that_cannot_make_a_checkpoint_are_rejected(tmp_path, stream, message):
    with pytest.raises(HFWriteError, match=message):
        write_hf_dir(str(tmp_path / "hf"), stream, {})
    assert not os.listdir(tmp_path)


def test_max_shard_bytes_must_be_positive(tmp_path):
    with pytest.raises(HFWriteError, match="max_shard_bytes: expected a positive size, found 0"):
        write_hf_dir(str(tmp_path / "hf"), [], {}, max_shard_bytes=0)


# ----------------------------------------------------------------------------- reading
def test_names_and_shapes_come_from_the_headers_and_slices_read_parts(tmp_path):
    out = write_dir(tmp_path / "hf", max_shard_bytes=600)
    checkpoint = HFCheckpoint(out)
    assert checkpoint.shapes == {name: tuple(t.shape) for name, t in tensors()}
    assert "model.norm.weight" in checkpoint and "lm_head.weight" not in checkpoint
    embed = dict(tensors())["model.embed_tokens.weight"]
    assert torch.equal(checkpoint.slice("model.embed_tokens.weight", (16, 8))[4:6], embed[4:6])
    assert torch.equal(checkpoint.slice("model.embed_tokens.weight")[:, 2:3], embed[:, 2:3])
    assert torch.equal(checkpoint.get("model.embed_tokens.weight", (16, 8)), embed)


def test_missing_tensor_and_wrong_shape_name_the_tensor(tmp_path):
    checkpoint = HFCheckpoint(write_dir(tmp_path / "hf"))
    with pytest.raises(CheckpointError, match="expected tensor lm_head.weight, found it missing"):
        checkpoint.get("lm_head.weight")
    with pytest.raises(CheckpointError, match=r"model.norm.weight expected shape \(9,\), found \(8,\)"):
        checkpoint.slice("model.norm.weight", (9,))
    with pytest.raises(CheckpointError, match=r"position_ids expected shape \(2, 5\), found \(10,\)"):
        checkpoint.get("position_ids", (2, 5))


def test_cut_file_is_one_clear_error_naming_it(tmp_path):
    out = write_dir(tmp_path / "hf")
    weights = os.path.join(out, SAFETENSORS_SINGLE)
    with open(weights, "rb") as fh:
        raw = fh.read()
    with open(weights, "wb") as fh:
        fh.write(raw[:-10])
    with pytest.raises(CheckpointError, match=rf"{weights}: expected {len(raw)} bytes .* found {len(raw) - 10} "
                                              r"\(cut file\)"):
        HFCheckpoint(out)
    assert "cut file" in model_dir_problem(out)
    with open(weights, "wb") as fh:
        fh.write(raw[:20])  # cut inside the header
    with pytest.raises(CheckpointError, match="expected a safetensors header of .* found a 20-byte file"):
        HFCheckpoint(out)
    with open(weights, "wb") as fh:
        fh.write(raw[:3])
    with pytest.raises(CheckpointError, match="expected a safetensors file, found 3 bytes"):
        HFCheckpoint(out)


def test_garbled_header_is_one_clear_error(tmp_path):
    out = write_dir(tmp_path / "hf")
    weights = os.path.join(out, SAFETENSORS_SINGLE)
    with open(weights, "r+b") as fh:
        fh.seek(8)
        fh.write(b"\xff\xfe")
    with pytest.raises(CheckpointError, match="expected a safetensors JSON header, found unreadable bytes"):
        HFCheckpoint(out)


def test_missing_shard_named_by_the_index_is_one_clear_error(tmp_path):
    out = write_dir(tmp_path / "hf", max_shard_bytes=600)
    victim = json.loads((tmp_path / "hf" / SAFETENSORS_INDEX).read_text())["weight_map"]["model.norm.weight"]
    os.remove(os.path.join(out, victim))
    message = f"expected shard {victim} \\(named by {SAFETENSORS_INDEX}\\), found it missing"
    with pytest.raises(CheckpointError, match=message):
        HFCheckpoint(out)
    assert victim in model_dir_problem(out)


def test_index_naming_a_tensor_its_shard_lacks_is_rejected(tmp_path):
    out = write_dir(tmp_path / "hf", max_shard_bytes=600)
    index = json.loads((tmp_path / "hf" / SAFETENSORS_INDEX).read_text())
    index["weight_map"]["ghost"] = index["weight_map"]["model.norm.weight"]
    (tmp_path / "hf" / SAFETENSORS_INDEX).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=f"expected tensor ghost \\(named by {SAFETENSORS_INDEX}\\)"):
        HFCheckpoint(out)


@pytest.mark.parametrize("content, message", [
    ("{not json", "expected a safetensors index with weight_map, found an unreadable file"),
    ("[]", "expected a safetensors index with weight_map, found an unreadable file"),
    ('{"metadata": {}}', "expected a 'weight_map' object of tensor name -> file, found NoneType"),
])
def test_bad_index_is_one_clear_error(tmp_path, content, message):
    out = write_dir(tmp_path / "hf", max_shard_bytes=600)
    (tmp_path / "hf" / SAFETENSORS_INDEX).write_text(content)
    with pytest.raises(CheckpointError, match=message):
        HFCheckpoint(out)


def test_directory_without_weights(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    assert not has_hf_weights(str(tmp_path)) and not has_hf_weights(str(tmp_path / "config.json"))
    assert model_dir_problem(str(tmp_path)) is None  # a seeded init, not a broken checkpoint
    with pytest.raises(CheckpointError, match="expected model.safetensors or model.safetensors.index.json, "
                                              "found neither"):
        HFCheckpoint(str(tmp_path))
    # Shards without their index are weights the loader cannot place: reported, not silently skipped.
    save_file({"w": torch.zeros(1)}, str(tmp_path / "model-00001-of-00002.safetensors"))
    assert has_hf_weights(str(tmp_path)) and "found neither" in model_dir_problem(str(tmp_path))


def test_checkpoint_written_by_transformers_reads_back(tmp_path):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False))
    model.save_pretrained(str(tmp_path), max_shard_size="10KB")
    assert os.path.isfile(tmp_path / SAFETENSORS_INDEX)
    checkpoint = HFCheckpoint(str(tmp_path))
    state = model.state_dict()
    assert set(checkpoint.files) == set(state)
    for name in checkpoint.files:
        assert torch.equal(checkpoint.get(name, tuple(state[name].shape)), state[name]), name
    assert read_config(str(tmp_path))["model_type"] == "qwen2"
