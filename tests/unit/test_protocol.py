"""DataProto: container operations, transport, and strict checks (one named error per mismatch)."""

import io
import pickle

import numpy as np
import pytest
import torch

from verl.protocol import (
    RESPONSE_LENGTH_FIELDS,
    DataProto,
    DataProtoError,
    pad_dataproto_to_divisor,
    unpad_dataproto,
)


@pytest.fixture(autouse=True)
def _strict(monkeypatch):
    monkeypatch.setenv("VERL_STRICT_DATA_CHECK", "1")


def make(n=4, meta=None):
    return DataProto.from_dict(
        {"x": torch.arange(n), "y": torch.arange(2 * n, dtype=torch.float32).reshape(n, 2)},
        {"uid": np.array([f"u{i}" for i in range(n)], dtype=object)},
        meta or {"temperature": 1.0},
    )


def rows(data):
    return data.batch["x"].tolist(), list(data.non_tensor_batch["uid"])


# ----------------------------------------------------------------------------- container ops
def test_construction_rejects_mismatched_batch_sizes():
    with pytest.raises(DataProtoError, match=r"batch field 'b': expected batch size 3 in dim 0, found shape \[2\]"):
        DataProto.from_dict({"a": torch.zeros(3), "b": torch.zeros(2)})
    with pytest.raises(DataProtoError, match=r"non_tensor_batch field 'uid': expected batch size 3"):
        DataProto.from_dict({"a": torch.zeros(3)}, {"uid": np.array(["a", "b"], dtype=object)})
    data = make()
    # data.batch is a tensordict.TensorDict (as in verl): it refuses a tensor of another batch size itself.
    with pytest.raises(RuntimeError, match="batch dimension mismatch.*for key 'z'"):
        data.batch["z"] = torch.zeros(5)


def test_indexing_int_slice_tensor_mask_and_list():
    data = make(5)
    item = data[2]
    assert item.batch["x"].item() == 2 and item.non_tensor_batch["uid"] == "u2"
    assert rows(data[1:3]) == ([1, 2], ["u1", "u2"])
    assert rows(data[torch.tensor([4, 0])]) == ([4, 0], ["u4", "u0"])
    assert rows(data[torch.tensor([True, False, False, False, True])]) == ([0, 4], ["u0", "u4"])
    assert rows(data[[3, 3]]) == ([3, 3], ["u3", "u3"])
    assert len(data[[]]) == 0
    with pytest.raises(IndexError, match="out of range"):
        data[5]


def test_select_and_pop():
    data = make()
    sel = data.select(batch_keys=["y"], non_tensor_batch_keys=[], meta_info_keys=[])
    assert list(sel.batch.keys()) == ["y"] and not sel.non_tensor_batch and not sel.meta_info and len(sel) == 4
    with pytest.raises(DataProtoError, match=r"batch keys \['nope'\] not found"):
        data.select(batch_keys=["nope"])
    popped = data.pop(batch_keys=["y"], non_tensor_batch_keys=["uid"])
    assert list(popped.batch.keys()) == ["y"] and list(popped.non_tensor_batch) == ["uid"]
    assert list(data.batch.keys()) == ["x"] and not data.non_tensor_batch


def test_union_merges_and_rejects_conflicts():
    data = make()
    other = DataProto.from_dict({"x": torch.arange(4), "z": torch.ones(4, 3, dtype=torch.long)}, meta_info={"k": 1})
    assert data.union(other) is data
    assert sorted(data.batch.keys()) == ["x", "y", "z"] and data.meta_info == {"temperature": 1.0, "k": 1}
    with pytest.raises(DataProtoError, match="batch field 'x' differs"):
        data.union(DataProto.from_dict({"x": torch.arange(4) + 1}))
    with pytest.raises(DataProtoError, match="union: expected batch size 4, found 3"):
        data.union(DataProto.from_dict({"w": torch.zeros(3)}))
    with pytest.raises(DataProtoError, match="meta_info 'temperature' differs"):
        data.union(DataProto(meta_info={"temperature": 0.5}, batch={"x": torch.arange(4)}))


def test_concat_chunk_split():
    data = make(6)
    chunks = data.chunk(3)
    assert [rows(c)[0] for c in chunks] == [[0, 1], [2, 3], [4, 5]]
    assert rows(DataProto.concat(chunks)) == rows(data)
    assert [len(p) for p in data.split(4)] == [4, 2]
    with pytest.raises(DataProtoError, match="divisible by chunks=4"):
        data.chunk(4)
    with pytest.raises(DataProtoError, match="part 1 has keys"):
        DataProto.concat([data, data.select(batch_keys=["x"])])


def test_repeat_interleave_and_tile():
    data = make(2)
    assert rows(data.repeat(3, interleave=True)) == ([0, 0, 0, 1, 1, 1], ["u0"] * 3 + ["u1"] * 3)
    tiled = data.repeat(2, interleave=False)
    assert rows(tiled) == ([0, 1, 0, 1], ["u0", "u1", "u0", "u1"])
    assert tiled.batch["y"].shape == (4, 2)


def test_reorder_and_to_device():
    data = make(3)
    data.reorder(torch.tensor([2, 0, 1]))
    assert rows(data) == ([2, 0, 1], ["u2", "u0", "u1"])
    assert data.to("cpu") is data and data.batch["x"].device.type == "cpu"
    with pytest.raises(DataProtoError, match="expected 3 indices, found 2"):
        data.reorder(torch.tensor([0, 1]))


def test_pad_to_divisor_and_unpad():
    data = make(5)
    padded, pad = pad_dataproto_to_divisor(data, 4)
    # 5 -> 8: the 3 padding rows are copies of the first rows.
    assert pad == 3 and rows(padded)[0] == [0, 1, 2, 3, 4, 0, 1, 2]
    assert rows(unpad_dataproto(padded, pad)) == rows(data)
    small = make(2)
    padded, pad = pad_dataproto_to_divisor(small, 7)  # needs more padding than rows: wraps around
    assert pad == 5 and rows(padded)[0] == [0, 1, 0, 1, 0, 1, 0]
    same, pad = pad_dataproto_to_divisor(data, 5)
    assert same is data and pad == 0 and unpad_dataproto(same, 0) is data


# ----------------------------------------------------------------------------- transport
def test_bytes_round_trip_keeps_tensors_objects_and_meta():
    data = make(3, meta={"temperature": 0.7, "eos_token_id": [2, 3], "nested": {"a": None}})
    data.non_tensor_batch["reward_model"] = np.array(
        [{"ground_truth": "85", "style": "rule"}, {"ground_truth": "7"}, {"ground_truth": [1, 2]}], dtype=object
    )
    data.non_tensor_batch["index"] = np.array([np.int64(4), 5.5, None], dtype=object)
    data.non_tensor_batch["ints"] = np.array([1, 2, 3], dtype=np.int32)
    data.non_tensor_batch["strs"] = np.array(["a", "bb", "c"])
    data.check_consistency(producer="rollout.generate_sequences")
    back = DataProto.from_bytes(data.to_bytes())
    assert torch.equal(back.batch["y"], data.batch["y"]) and back.batch["x"].dtype == torch.int64
    assert list(back.non_tensor_batch["reward_model"]) == list(data.non_tensor_batch["reward_model"])
    assert list(back.non_tensor_batch["index"]) == [4, 5.5, None]
    assert back.non_tensor_batch["ints"].dtype == np.int32 and back.non_tensor_batch["ints"].tolist() == [1, 2, 3]
    assert back.non_tensor_batch["strs"].tolist() == ["a", "bb", "c"]
    assert back.meta_info == data.meta_info
    assert back.field_producers["y"] == "rollout.generate_sequences"


def test_bytes_of_a_slice_do_not_carry_the_parent_storage():
    big = DataProto.from_dict({"x": torch.zeros(1000, 256)})
    assert len(big[:2].to_bytes()) < len(big.to_bytes()) / 50
    assert torch.equal(DataProto.from_bytes(big[3:5].to_bytes()).batch["x"], big.batch["x"][3:5])


def test_empty_batch_chunks_into_empty_parts():
    assert [len(p) for p in make(4)[:0].chunk(2)] == [0, 0]


def test_to_bytes_rejects_values_json_cannot_carry():
    data = make(2)
    data.non_tensor_batch["bad"] = np.array([{1, 2}, {3}], dtype=object)
    with pytest.raises(DataProtoError, match="field 'bad' holds a value JSON cannot carry"):
        data.to_bytes()
    data = make(2, meta={"fn": print})
    with pytest.raises(DataProtoError, match="meta_info\\['fn'\\]"):
        data.to_bytes()


class _Evil:
    def __reduce__(self):
        return (print, ("pwned",))


def test_from_bytes_refuses_pickled_objects():
    buffer = io.BytesIO()
    torch.save({"format": "verl-hpc.DataProto/1", "evil": _Evil()}, buffer)
    with pytest.raises(pickle.UnpicklingError):
        DataProto.from_bytes(buffer.getvalue())
    buffer = io.BytesIO()
    torch.save({"format": "other"}, buffer)
    with pytest.raises(DataProtoError, match="expected format"):
        DataProto.from_bytes(buffer.getvalue())


# ----------------------------------------------------------------------------- strict checks
B, P, R = 2, 3, 4


def rollout_output():
    """What a rollout returns: prompts [B, P], responses [B, R], full sequences [B, P + R]."""
    return DataProto.from_dict(
        {
            "prompts": torch.zeros(B, P, dtype=torch.long),
            "responses": torch.zeros(B, R, dtype=torch.long),
            "response_mask": torch.ones(B, R, dtype=torch.long),
            "input_ids": torch.zeros(B, P + R, dtype=torch.long),
            "attention_mask": torch.ones(B, P + R, dtype=torch.long),
            "position_ids": torch.arange(P + R).repeat(B, 1),
            "rollout_log_probs": torch.zeros(B, R),
        },
        {"uid": np.array(["a", "b"], dtype=object)},
    )


def test_consistent_batch_passes_and_records_producer():
    data = rollout_output()
    data.check_consistency(producer="actor_rollout.generate_sequences")
    assert data.field_producers["responses"] == "actor_rollout.generate_sequences"


@pytest.mark.parametrize("field", [f for f in RESPONSE_LENGTH_FIELDS if f != "responses"])
def test_response_length_mismatch_names_field_shapes_and_producer(field):
    data = rollout_output()
    dtype = torch.long if field == "response_mask" else torch.float32
    data.batch[field] = torch.zeros(B, R - 1, dtype=dtype)
    expected = (
        rf"\[worker.produce\] field '{field}': "
        r"expected shape \[2, 4\] \(response length from 'responses'\), found \[2, 3\]"
    )
    with pytest.raises(DataProtoError, match=expected):
        data.check_consistency(producer="worker.produce")


def test_responses_field_itself_must_be_two_dimensional():
    data = DataProto.from_dict({"responses": torch.zeros(B, R, 1, dtype=torch.long)})
    with pytest.raises(
        DataProtoError, match=r"field 'responses': expected shape \[B, response length\], found \[2, 4, 1\]"
    ):
        data.check_consistency(producer="rollout.generate_sequences")


def test_non_tensor_batch_size_mismatch_is_named():
    data = rollout_output()
    data.non_tensor_batch["uid"] = np.array(["a", "b", "c"], dtype=object)  # bypasses the constructor
    with pytest.raises(
        DataProtoError, match=r"\[reward.compute\] field 'uid': expected batch size 2 in dim 0, found shape \[3\]"
    ):
        data.check_consistency(producer="reward.compute")


def test_sequence_length_mismatches_are_named():
    data = rollout_output()
    data.batch["attention_mask"] = torch.ones(B, P + R + 1, dtype=torch.long)
    with pytest.raises(
        DataProtoError,
        match=r"field 'attention_mask': expected shape \[2, 7\] \(sequence length from 'input_ids'\), found \[2, 8\]",
    ):
        data.check_consistency(producer="p")
    data = rollout_output()
    data.batch["position_ids"] = torch.zeros(B, P + R - 1, dtype=torch.long)
    with pytest.raises(DataProtoError, match=r"field 'position_ids': expected last dim 7"):
        data.check_consistency(producer="p")
    data = rollout_output()
    data.batch["prompts"] = torch.zeros(B, P + 1, dtype=torch.long)
    with pytest.raises(
        DataProtoError, match=r"field 'input_ids': expected shape \[2, 8\] \(prompts \+ responses\), found \[2, 7\]"
    ):
        data.check_consistency(producer="p")


@pytest.mark.parametrize(
    "field,dtype,expected",
    [
        ("response_mask", torch.float32, "integer or bool mask dtype"),
        ("attention_mask", torch.float16, "integer or bool mask dtype"),
        ("responses", torch.float32, "integer dtype"),
        ("input_ids", torch.bool, "integer dtype"),
        ("old_log_probs", torch.long, "floating-point dtype"),
        ("ref_log_prob", torch.int32, "floating-point dtype"),
        ("rollout_log_probs", torch.long, "floating-point dtype"),
        ("values", torch.long, "floating-point dtype"),
    ],
)
def test_dtype_mismatch_is_named(field, dtype, expected):
    data = rollout_output()
    shape = data.batch[field].shape if field in data.batch else (B, R)
    data.batch[field] = torch.zeros(shape, dtype=dtype)
    with pytest.raises(DataProtoError, match=rf"\[p\] field '{field}': expected an? {expected}, found {dtype}"):
        data.check_consistency(producer="p")


def test_union_in_strict_mode_names_the_producer_of_the_bad_field():
    batch = rollout_output()
    batch.check_consistency(producer="actor_rollout.generate_sequences")
    values = DataProto.from_dict({"values": torch.zeros(B, R - 1)})
    values.check_consistency(producer="critic.compute_values")  # alone it is consistent
    with pytest.raises(DataProtoError, match=r"\[critic.compute_values\] field 'values': expected shape \[2, 4\]"):
        batch.union(values)


def test_strict_mode_off_skips_length_checks(monkeypatch):
    monkeypatch.setenv("VERL_STRICT_DATA_CHECK", "0")
    batch = rollout_output()
    batch.union(DataProto.from_dict({"values": torch.zeros(B, R - 1)}))
    assert batch.batch["values"].shape == (B, R - 1)
