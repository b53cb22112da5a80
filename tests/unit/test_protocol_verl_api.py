"""DataProto's verl 0.9 API on tensordict: what user code written against verl calls, with verl's results."""

import os
import pickle
import subprocess
import sys

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from verl.protocol import (
    DataProto,
    DataProtoConfig,
    DataProtoError,
    DataProtoItem,
    collate_fn,
    deserialize_single_tensor,
    deserialize_tensordict,
    fold_batch_dim,
    serialize_single_tensor,
    serialize_tensordict,
    unfold_batch_dim,
    union_numpy_dict,
    union_tensor_dict,
)
from verl.single_controller import Dispatch, DispatchInfo, MeshRank
from verl.single_controller.decorator import get_dispatch_spec, run_on_fake_world
from verl.trainer.metrics import reduce_metrics

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def labelled(n=6, meta=None):
    return DataProto.from_dict(
        tensors={"obs": torch.arange(1, n + 1), "pair": torch.arange(2 * n).reshape(n, 2)},
        non_tensors={"labels": [chr(ord("a") + i) for i in range(n)]},
        meta_info=meta if meta is not None else {"name": "abc"},
    )


def obs(data):
    return data.batch["obs"].tolist()


# ----------------------------------------------------------------------------- import and containers
def test_from_verl_import_dataproto_without_importing_torch_for_import_verl():
    from verl import DataProto as exported

    assert exported is DataProto
    code = "import sys, verl\nassert 'torch' not in sys.modules, 'import verl imported torch'\n"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_batch_is_a_tensordict_and_a_tensorless_dataproto_has_batch_none():
    data = labelled(3)
    assert type(data.batch) is TensorDict and data.batch.batch_size == torch.Size([3])
    assert data.non_tensor_batch["labels"].dtype == object
    only_labels = DataProto(batch=None, non_tensor_batch={"labels": np.array(["a", "b", "c"], dtype=object)})
    assert only_labels.batch is None and len(only_labels) == 3
    assert len(DataProto(batch=None, non_tensor_batch=None, meta_info={"x": 1})) == 0
    assert DataProto.from_dict(non_tensors={"labels": ["a"]}).batch is None
    # Equal-length lists become a 2-D object array, as np.array(..., dtype=object) makes them in verl.
    pairs = DataProto.from_dict(non_tensors={"pairs": [["a", "b"], ["c", "d"]]})
    assert pairs.non_tensor_batch["pairs"].shape == (2, 2)


def test_errors_are_assertion_errors_too_as_verl_raises_them():
    with pytest.raises(AssertionError):
        labelled(6).chunk(5)
    with pytest.raises(DataProtoError, match="expected num_batch_dims=1, found 2"):
        DataProto.from_dict({"obs": torch.zeros(4, 3), "act": torch.zeros(4, 3, 2)}, num_batch_dims=2)
    with pytest.raises(DataProtoError, match=r"batch field 'act': expected batch size \[4, 3\] in dims 0..1"):
        DataProto.from_dict({"obs": torch.zeros(4, 3), "act": torch.zeros(4, 2)}, num_batch_dims=2)
    with pytest.raises(DataProtoError, match="from_single_dict: field 'labels': expected a torch.Tensor or numpy"):
        DataProto.from_single_dict({"obs": torch.zeros(2), "labels": ["a", "b"]})


def test_from_single_dict_keeps_the_subclass():
    class MyProto(DataProto):
        pass

    made = MyProto.from_single_dict({"x": torch.tensor([0]), "tag": np.array(["t"], dtype=object)})
    assert type(made) is MyProto and type(made[0:1]) is MyProto and type(MyProto.concat([made, made])) is MyProto


def test_int_index_gives_a_dataprotoitem_with_a_tensordict_row():
    data = labelled(4)
    item = data[-1]
    assert isinstance(item, DataProtoItem) and isinstance(item.batch, TensorDict)
    assert item.batch.batch_size == torch.Size([]) and item.batch["obs"].item() == 4
    assert item.non_tensor_batch == {"labels": "d"} and item.meta_info == {"name": "abc"}
    assert obs(data[[True, False, True, False]]) == [1, 3]
    assert obs(data[np.array([3, 0])]) == [4, 1]
    assert data[torch.tensor([0, 2])].batch.batch_size == torch.Size([2])
    with pytest.raises(TypeError, match="found str"):
        data["obs"]


# ----------------------------------------------------------------------------- chunk, padding
def test_chunk_uneven_with_auto_padding_sizes_as_torch_chunk():
    data = DataProto.from_dict({"obs": torch.arange(7)}, {"labels": list("abcdefg")}, auto_padding=True)
    assert data.is_padding_enabled()
    parts = data.chunk(3)  # torch.chunk: ceil(7 / 3) = 3 rows each, the last gets 1
    assert [obs(p) for p in parts] == [[0, 1, 2], [3, 4, 5], [6]]
    assert [list(p.non_tensor_batch["labels"]) for p in parts] == [list("abc"), list("def"), ["g"]]
    assert [len(p) for p in data.chunk(2)] == [4, 3]
    with pytest.raises(DataProtoError, match="only 2 torch.chunk pieces"):  # ceil(4/3) = 2 -> [2, 2]: 2 pieces
        DataProto.from_dict({"obs": torch.arange(4)}, auto_padding=True).chunk(3)
    # Without tensors verl splits as np.array_split does.
    labels_only = DataProto.from_dict(non_tensors={"labels": list("abcde")}, auto_padding=True)
    assert [len(p) for p in labels_only.chunk(3)] == [2, 2, 1]


def test_auto_padding_from_config_and_environment(monkeypatch):
    data = labelled(5)
    with pytest.raises(DataProtoError, match="divisible by chunks=2"):
        data.chunk(2)
    monkeypatch.setenv("VERL_AUTO_PADDING", "1")
    assert [len(p) for p in data.chunk(2)] == [3, 2]
    monkeypatch.delenv("VERL_AUTO_PADDING")
    DataProtoConfig.auto_padding = True
    try:
        assert [len(p) for p in data.chunk(2)] == [3, 2]
    finally:
        DataProtoConfig.auto_padding = False
    with pytest.raises(DataProtoError, match="expected a bool"):
        DataProtoConfig.auto_padding = "yes"


def test_padding_appends_copies_of_the_first_or_last_row():
    data = labelled(3)
    data.padding(2, padding_candidate="first")
    assert obs(data) == [1, 2, 3, 1, 1] and list(data.non_tensor_batch["labels"]) == ["a", "b", "c", "a", "a"]
    data = labelled(3)
    data.padding(1)
    assert obs(data) == [1, 2, 3, 3]


# ----------------------------------------------------------------------------- concat merges worker meta_info
def test_concat_collects_metrics_of_every_worker_into_lists():
    def part(start, meta):
        return DataProto.from_dict({"obs": torch.tensor([start, start + 1])}, meta_info=meta)

    merged = DataProto.concat([
        part(1, {"flag": True}),  # the first worker has no metrics: the others' are kept
        part(3, {"metrics": [{"loss": 0.6, "acc": 0.85}], "flag": True, "only_here": "B"}),
        part(5, {"metrics": {"loss": 0.55, "acc": 0.88}, "flag": True}),
    ])
    assert obs(merged) == [1, 2, 3, 4, 5, 6]
    assert merged.meta_info == {"flag": True, "only_here": "B", "metrics": {"loss": [0.6, 0.55], "acc": [0.85, 0.88]}}
    with pytest.raises(AssertionError, match="Conflicting values for meta_info key 'config'"):
        DataProto.concat([part(1, {"config": "A"}), part(3, {"config": "B"})])


def test_worker_group_outputs_merge_metrics_per_dp_replica_and_the_driver_reduces_them():
    info = DispatchInfo((0, 1, 2), {"dp": tuple(MeshRank(i, 3, True) for i in range(3))})

    def update(rank, args, kwargs):
        return DataProto(meta_info={"metrics": {"actor/loss": float(rank), "actor/grad_norm_max": 10.0 + rank}})

    out = run_on_fake_world(info, get_dispatch_spec(Dispatch.DP_COMPUTE_PROTO), update,
                            (DataProto.from_dict({"x": torch.arange(3)}),))
    assert out.meta_info["metrics"] == {"actor/loss": [0.0, 1.0, 2.0], "actor/grad_norm_max": [10.0, 11.0, 12.0]}
    # verl's reduce_metrics: "max" in the name -> max, "min" -> min, otherwise the mean.
    assert reduce_metrics(out.meta_info["metrics"]) == {"actor/loss": 1.0, "actor/grad_norm_max": 12.0}


# ----------------------------------------------------------------------------- iteration
def test_make_iterator_yields_seeded_shuffled_mini_batches_for_each_epoch():
    data = labelled(8, meta={"temperature": 0.5})
    batches = list(data.make_iterator(mini_batch_size=4, epochs=2, seed=1, dataloader_kwargs={"shuffle": True}))
    again = list(data.make_iterator(mini_batch_size=4, epochs=2, seed=1, dataloader_kwargs={"shuffle": True}))
    assert [obs(b) for b in batches] == [obs(b) for b in again]
    # Each epoch is one shuffled pass over every row; the two epochs draw different orders.
    epochs = [obs(batches[0]) + obs(batches[1]), obs(batches[2]) + obs(batches[3])]
    assert all(sorted(e) == list(range(1, 9)) for e in epochs) and epochs[0] != epochs[1]
    other_seed = data.make_iterator(mini_batch_size=4, epochs=1, seed=2, dataloader_kwargs={"shuffle": True})
    assert [x for b in other_seed for x in obs(b)] != epochs[0]
    first = batches[0]
    assert isinstance(first, DataProto) and first.meta_info == {"temperature": 0.5}
    assert [ord(c) - ord("a") + 1 for c in first.non_tensor_batch["labels"]] == obs(first)
    assert first.batch["pair"].tolist() == [[2 * (i - 1), 2 * (i - 1) + 1] for i in obs(first)]
    in_order = list(data.make_iterator(mini_batch_size=2, epochs=1))
    assert [obs(b) for b in in_order] == [[1, 2], [3, 4], [5, 6], [7, 8]]
    with pytest.raises(DataProtoError, match="divisible by mini_batch_size=3"):
        data.make_iterator(mini_batch_size=3, epochs=1)


def test_collate_fn_stacks_items_back():
    data = labelled(3)
    back = collate_fn([data[2], data[0]])
    assert obs(back) == [3, 1] and list(back.non_tensor_batch["labels"]) == ["c", "a"]


# ----------------------------------------------------------------------------- row transforms
def test_sample_level_repeat_repeats_each_row_its_own_count():
    data = labelled(3)
    out = data.sample_level_repeat([3, 1, 2])
    assert obs(out) == [1, 1, 1, 2, 3, 3] and list(out.non_tensor_batch["labels"]) == list("aaabcc")
    assert obs(data.sample_level_repeat(torch.tensor([0, 2, 1]))) == [2, 2, 3]
    assert out.meta_info == {"name": "abc"}
    with pytest.raises(DataProtoError, match="expected 3 non-negative counts"):
        data.sample_level_repeat([1, 2])


def test_fold_then_reorder_then_unfold_moves_groups_together():
    data = labelled(3).repeat(2, interleave=True)
    folded = fold_batch_dim(data, new_batch_size=3)
    assert folded.batch["pair"].shape == (3, 2, 2) and folded.non_tensor_batch["labels"].shape == (3, 2)
    folded.reorder(torch.tensor([1, 2, 0]))
    flat = unfold_batch_dim(folded, batch_dims=2)
    assert obs(flat) == [2, 2, 3, 3, 1, 1] and list(flat.non_tensor_batch["labels"]) == list("bbccaa")
    assert flat.meta_info == {"name": "abc"}
    with pytest.raises(DataProtoError, match="divisible by 4"):
        fold_batch_dim(data, 4)


def test_unfold_column_chunks_splits_named_keys_and_repeats_the_rest():
    data = DataProto.from_dict(
        {"wide": torch.arange(12).reshape(3, 4), "narrow": torch.tensor([[1, 2], [5, 6], [9, 10]])},
        {"labels": [["a1", "a2"], ["b1", "b2"], ["c1", "c2"]], "tag": ["a", "b", "c"]},
    )
    out = data.unfold_column_chunks(2, split_keys=["wide", "labels"])
    assert out.batch["wide"].tolist() == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11]]
    assert out.batch["narrow"].tolist() == [[1, 2], [1, 2], [5, 6], [5, 6], [9, 10], [9, 10]]
    assert out.non_tensor_batch["labels"].tolist() == [["a1"], ["a2"], ["b1"], ["b2"], ["c1"], ["c2"]]
    assert list(out.non_tensor_batch["tag"]) == list("aabbcc")


def test_rename_select_pop_as_verl():
    data = labelled(2)
    assert data.rename("obs", "observation") is data and sorted(data.batch.keys()) == ["observation", "pair"]
    data.rename(["observation", "pair"], ["obs", "p"])
    assert sorted(data.batch.keys()) == ["obs", "p"]
    with pytest.raises(DataProtoError, match="as many new_keys"):
        data.rename(["obs"], ["a", "b"])
    # Missing non-tensor and meta keys are skipped (a missing batch key is an error); deepcopy copies arrays.
    picked = data.select(batch_keys=["obs"], non_tensor_batch_keys=["labels", "absent"], meta_info_keys=["nope"],
                         deepcopy=True)
    assert list(picked.batch.keys()) == ["obs"] and picked.meta_info == {}
    picked.non_tensor_batch["labels"][0] = "z"
    assert data.non_tensor_batch["labels"][0] == "a"
    labels_only = DataProto.from_dict(non_tensors={"labels": ["a", "b"]})
    assert list(labels_only.pop(non_tensor_batch_keys=["labels"]).non_tensor_batch["labels"]) == ["a", "b"]
    assert labels_only.non_tensor_batch == {}


def test_union_helpers_compare_nan_and_nested_arrays_and_refuse_differences():
    nan_row = np.array([1.0, np.nan, 3.0])
    union_numpy_dict({"a": nan_row}, {"a": nan_row.copy()})
    nested = np.array([np.array([1, 2]), "text", None], dtype=object)
    union_numpy_dict({"a": nested}, {"a": np.array([np.array([1, 2]), "text", None], dtype=object)})
    with pytest.raises(AssertionError, match="'a' differs"):
        union_numpy_dict({"a": nan_row}, {"a": np.array([1.0, 2.0, 3.0])})
    shared = torch.randn(4, 2)
    left = TensorDict({"obs": shared}, batch_size=[4])
    union_tensor_dict(left, TensorDict({"obs": shared, "rew": torch.ones(4)}, batch_size=[4]))
    assert sorted(left.keys()) == ["obs", "rew"]
    with pytest.raises(AssertionError, match="'obs' differs"):
        union_tensor_dict(left, TensorDict({"obs": shared + 1}, batch_size=[4]))
    data = DataProto.from_dict(non_tensors={"labels": ["a", "b"]})
    data.union(DataProto.from_dict({"obs": torch.arange(2)}))  # a tensorless DataProto takes the other's batch
    assert obs(data) == [0, 1]


# ----------------------------------------------------------------------------- tensordict and files
def test_to_tensordict_and_back_keeps_nested_non_tensors_and_meta():
    data = DataProto.from_dict(
        {"obs": torch.tensor([1, 2, 3])},
        {"turn_scores": [[], [0.5, 0.8], [0.9]], "extra": [{"acc": 1.0}, {"acc": 0.0}, {"acc": 1.0}]},
        {"experiment": "nested", "step": 4},
    )
    td = data.to_tensordict()
    assert isinstance(td, TensorDict) and td.batch_size == torch.Size([3])
    assert td["turn_scores"][1] == [0.5, 0.8] and td["extra"][0] == {"acc": 1.0} and td["experiment"] == "nested"
    back = DataProto.from_tensordict(td)
    assert obs(back) == [1, 2, 3]
    assert back.non_tensor_batch["turn_scores"].tolist() == [[], [0.5, 0.8], [0.9]]
    assert back.non_tensor_batch["extra"].tolist() == [{"acc": 1.0}, {"acc": 0.0}, {"acc": 1.0}]
    assert back.meta_info == {"experiment": "nested", "step": 4}
    with pytest.raises(DataProtoError, match=r"keys \['obs'\] appear in more than one"):
        DataProto.from_dict({"obs": torch.zeros(1)}, meta_info={"obs": 1}).to_tensordict()


@pytest.mark.parametrize("method", ["torch", "numpy"])
def test_save_to_disk_and_load_from_disk_round_trip_any_python_objects(tmp_path, monkeypatch, method):
    if method == "numpy":
        monkeypatch.setenv("VERL_DATAPROTO_SERIALIZATION_METHOD", "numpy")
    rows = 20000  # 80 kB of bf16 in the parent
    big = DataProto.from_dict({"obs": torch.arange(2.0 * rows).reshape(rows, 2).to(torch.bfloat16)},
                              {"sets": [{i} for i in range(rows)]}, {"info": "test"})
    data = big[:3]  # a view: the file holds its 3 rows, not the parent's storage
    path = tmp_path / "data.pkl"
    data.save_to_disk(path)
    loaded = DataProto.load_from_disk(path)
    assert torch.equal(loaded.batch["obs"], data.batch["obs"]) and loaded.batch["obs"].dtype == torch.bfloat16
    assert list(loaded.non_tensor_batch["sets"]) == [{0}, {1}, {2}] and loaded.meta_info == {"info": "test"}
    assert os.path.getsize(path) < 10_000
    # verl's pickled state: (batch, non_tensor_batch, meta_info), so files move between verl and verl-hpc.
    state = data.__getstate__()
    assert len(state) == 3 and state[1] is data.non_tensor_batch and state[2] is data.meta_info
    assert isinstance(state[0], bytes if method == "torch" else tuple)
    assert len(pickle.loads(pickle.dumps(DataProto(meta_info={"m": 1})))) == 0


def test_load_from_disk_refuses_a_pickle_that_names_code_to_run(tmp_path):
    """A DataProto file is a pickle (verl's format); loading one must not run what a crafted file names."""
    from verl.errors import InputError

    class Payload:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "ran"),))

    crafted = tmp_path / "crafted.pkl"
    crafted.write_bytes(pickle.dumps(Payload()))
    with pytest.raises(InputError, match=r"crafted.pkl: expected a DataProto file .* found a reference to "
                                         r"(posix|os)\.system, which is not loaded"):
        DataProto.load_from_disk(crafted)
    assert not (tmp_path / "ran").exists()
    not_a_dataproto = tmp_path / "list.pkl"
    not_a_dataproto.write_bytes(pickle.dumps([1, 2]))
    with pytest.raises(InputError, match="expected a pickled DataProto"):
        DataProto.load_from_disk(not_a_dataproto)


def test_serialize_helpers_round_trip_plain_and_nested_tensors():
    tensors = (torch.randn(3, 4), torch.arange(6, dtype=torch.int32).reshape(2, 3), torch.ones(2, dtype=torch.bfloat16))
    for tensor in tensors:
        dtype, shape, raw = serialize_single_tensor(tensor)
        assert dtype == str(tensor.dtype).removeprefix("torch.") and shape == tensor.shape
        assert torch.equal(deserialize_single_tensor((dtype, shape, raw)), tensor)
    jagged = torch.nested.nested_tensor([torch.arange(2.0), torch.arange(3.0)], layout=torch.jagged)
    td = TensorDict({"plain": torch.arange(2), "jagged": jagged}, batch_size=[2])
    back = deserialize_tensordict(serialize_tensordict(td))
    assert back.batch_size == td.batch_size and torch.equal(back["plain"], td["plain"])
    assert [t.tolist() for t in back["jagged"].unbind()] == [[0.0, 1.0], [0.0, 1.0, 2.0]]


def test_transport_of_a_tensorless_dataproto_keeps_batch_none():
    back = DataProto.from_bytes(DataProto(meta_info={"metrics": {"loss": 1.0}}).to_bytes())
    assert back.batch is None and len(back) == 0 and back.meta_info == {"metrics": {"loss": 1.0}}


def test_inspection_helpers(capsys):
    data = DataProto.from_dict({"obs": torch.zeros(2, 3)}, {"labels": ["a", "b"]},
                               {"ids": [1, 2], "cfg": {"k": 0.5}, "pair": (1, "x")})
    info = data.get_data_info()
    assert info.splitlines() == [
        "batch", "  obs: (2, 3) (torch.float32) cpu",
        "non_tensor_batch", "  labels: ndarray(2,) (object)",
        "meta_info", "  ids: list[int]", "  cfg: dict[str: float]", "  pair: tuple(int, str)",
    ]
    data.print_size(prefix="step 1")
    out = capsys.readouterr().out
    assert out.startswith("step 1, Size of tensordict: ") and f"{24 / 1024**3} GB" in out
