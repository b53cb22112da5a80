"""One rank-from-environment function (torchrun, Open MPI, Slurm) and one exit-code policy (issue 42 item 6)."""

import types

import pytest

from verl.errors import EXIT_INPUT_ERROR, EXIT_INTERNAL_ERROR, InputError, exit_code, refuse
from verl.launcher.env import discover, launcher_rank

SINGLE_NODE_SLURM = {"SLURM_PROCID": "2", "SLURM_NTASKS": "4", "SLURM_STEP_ID": "0", "SLURM_LOCALID": "2",
                     "SLURM_JOB_NODELIST": "n1", "SLURM_TASKS_PER_NODE": "4", "SLURM_JOB_ID": "7"}


@pytest.mark.parametrize("env, rank", [
    ({}, 0),
    ({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}, 3),
    ({"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "5"}, 5),
    (SINGLE_NODE_SLURM, 2),
    # mpirun inside an sbatch allocation: Open MPI's rank wins over the batch script's SLURM_PROCID=0
    ({**SINGLE_NODE_SLURM, "SLURM_PROCID": "0", "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4",
      "OMPI_COMM_WORLD_LOCAL_RANK": "1"}, 1),
])
def test_launcher_rank_agrees_with_discover(env, rank):
    assert launcher_rank(env) == rank == discover(env).rank


def test_launcher_rank_never_raises_on_a_malformed_environment():
    assert launcher_rank({"RANK": "x", "SLURM_PROCID": "4"}) == 4
    assert launcher_rank({"OMPI_COMM_WORLD_RANK": ""}) == 0


def test_each_mpirun_rank_writes_its_own_traceback_file(tmp_path, monkeypatch, capsys):
    """Under mpirun only OMPI_COMM_WORLD_RANK names the rank: main_ppo once read RANK/SLURM_PROCID only, so
    every rank named itself rank 0 and they all wrote train.rank0.traceback."""
    from verl.trainer import main_ppo

    for key in ("RANK", "SLURM_PROCID", main_ppo.RANK_ERROR_DIR_ENV):
        monkeypatch.delenv(key, raising=False)
    config = types.SimpleNamespace(trainer=types.SimpleNamespace(output_dir=str(tmp_path)))
    for rank in ("1", "3"):
        monkeypatch.setenv("OMPI_COMM_WORLD_RANK", rank)
        try:
            raise InputError("bad data row")
        except InputError as err:
            assert main_ppo._rank_failure(err, config) == EXIT_INPUT_ERROR
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == ["train.rank1.traceback", "train.rank3.traceback"]
    assert capsys.readouterr().err.splitlines()[-1].startswith("verl train: rank 3: InputError: bad data row")


def test_exit_codes_input_2_internal_1(capsys):
    assert (exit_code(InputError("x")), exit_code(RuntimeError("x"))) == (EXIT_INPUT_ERROR, EXIT_INTERNAL_ERROR)
    assert (EXIT_INPUT_ERROR, EXIT_INTERNAL_ERROR) == (2, 1)
    assert refuse("verl bench kernels", "--repeats: expected >= 1, found 0\nmore") == 2
    assert capsys.readouterr().err == "verl bench kernels: --repeats: expected >= 1, found 0\n"


def test_the_exit_codes_are_written_once():
    """Every entry point returns ``verl.errors``' names: a bare ``return 2`` / ``exit(2)`` / a module's own
    ``EXIT_* = 2`` is a second definition of the policy (issue 54 item 7 found 15)."""
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parents[2] / "verl"
    literal = re.compile(r"return 2$|(exit\(|SystemExit\()[12]\)|^\s*EXIT_\w+\s*=\s*\d")
    found = [f"{path.relative_to(root)}:{n}: {line.strip()}"
             for path in sorted(root.rglob("*.py")) if path.name != "errors.py"
             for n, line in enumerate(path.read_text().splitlines(), 1) if literal.search(line)]
    assert not found, "\n".join(found)
