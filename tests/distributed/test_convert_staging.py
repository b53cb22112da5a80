"""`verl convert`'s time limit and staging: ``--timeout-s`` (default derived from the input's size), and on a
failure -- here the limit, which kills the ranks -- nothing is left beside ``--out``."""

import os

import pytest

pytest.importorskip("megatron.core")

from helpers.megatron_tiny_models import hf_model, save_hf  # noqa: E402

from verl.engine.megatron.convert import BYTES_PER_S, MIN_TIMEOUT_S, default_timeout_s, main  # noqa: E402
from verl.launcher.spawn import RankFailure  # noqa: E402


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return save_hf(hf_model("qwen2_gqa_tied", seed=9), str(tmp_path_factory.mktemp("hf")), sharded=True)


def test_the_default_limit_grows_with_the_input():
    assert default_timeout_s(0) == MIN_TIMEOUT_S
    assert default_timeout_s(70 << 30) == MIN_TIMEOUT_S + (70 << 30) // BYTES_PER_S > 3600  # a 70 GB model


def test_a_conversion_past_its_limit_leaves_nothing_behind(hf_dir, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    out = work / "ckpt"
    # Killed while starting (its private staging directory already exists): the limit is the forced failure.
    with pytest.raises(RankFailure, match=r"nothing was written to .*ckpt.*--timeout-s"):
        main(["hf-to-mcore", "--hf-dir", hf_dir, "--out", str(out), "--timeout-s", "1"])
    assert os.listdir(work) == []


def test_a_conversion_within_its_limit_round_trips_and_leaves_only_its_outputs(hf_dir, tmp_path):
    ckpt, back = tmp_path / "ckpt", tmp_path / "back"
    assert main(["hf-to-mcore", "--hf-dir", hf_dir, "--out", str(ckpt), "--timeout-s", "300"]) == 0
    assert main(["mcore-to-hf", "--ckpt", str(ckpt), "--out", str(back), "--timeout-s", "300"]) == 0
    assert sorted(os.listdir(tmp_path)) == ["back", "ckpt"]
    assert os.path.isfile(back / "config.json")


@pytest.mark.parametrize("value", ["0", "-5", "nan"])
def test_a_limit_that_is_not_positive_is_one_line_and_exit_2(hf_dir, tmp_path, capsys, value):
    assert main(["hf-to-mcore", "--hf-dir", hf_dir, "--out", str(tmp_path / "o"), f"--timeout-s={value}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--timeout-s" in err
    assert not os.path.exists(tmp_path / "o")
