"""``data.label_noise_mode=drop_carry``: the SFT warm start's systematic "forgot the carry" labels."""

import os
import subprocess
import sys

import pytest

from verl.trainer import main_sft
from verl.trainer.config import ConfigError
from verl.utils.dataset.arithmetic import add_drop_carry_noise, drop_carry_answer


@pytest.mark.parametrize("prompt, dropped", [
    ("37+48=", "75"),    # 7+8=15: the 1 is forgotten
    ("57+68=", "115"),   # 3-digit sum: only the ones carry is dropped
    ("99+99=", "188"),
    ("15+25=", "30"),    # 5+5=10 is a carry too
    ("12+13=", None),    # no carry: unchanged
    ("40+59=", None),
    ("52-37=", "25"),    # 2-7 borrows; the tens forget to pay it back
    ("37-52=", "-25"),   # the same slip on 52-37, sign kept
    ("58-23=", None),    # no borrow
    ("50-50=", None),
    ("hello", None),     # not an arithmetic prompt
])
def test_drop_carry_answer(prompt, dropped):
    assert drop_carry_answer(prompt) == dropped


def test_drop_carry_noise_relabels_that_fraction_of_the_carry_problems_only():
    pairs = [(f"{a}+{b}=", str(a + b)) for a in range(10, 30) for b in range(10, 30)]
    carry = [i for i, (p, _) in enumerate(pairs) if drop_carry_answer(p) is not None]
    noisy, count = add_drop_carry_noise(pairs, 0.5, seed=3)
    changed = [i for i, (old, new) in enumerate(zip(pairs, noisy, strict=False)) if old != new]
    assert count == round(0.5 * len(carry)) == len(changed) and set(changed) <= set(carry)
    assert all(noisy[i] == (pairs[i][0], drop_carry_answer(pairs[i][0])) for i in changed)
    assert all(int(noisy[i][1]) == int(pairs[i][1]) - 10 for i in changed)
    assert noisy == add_drop_carry_noise(pairs, 0.5, seed=3)[0]  # seeded
    assert add_drop_carry_noise(pairs, 0.0, seed=3) == (pairs, 0)
    assert add_drop_carry_noise([("12+13=", "25")], 0.9, seed=3) == ([("12+13=", "25")], 0)


def test_label_noise_mode_is_validated(tmp_path):
    with pytest.raises(ConfigError, match="label_noise_mode"):
        main_sft.read_sft_config_tree(None, ["data.label_noise_mode=forget"])


def _local_env():
    """This environment minus any launcher's variables, so that the command runs as a local job."""
    return {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "SLURM_PROCID")
            and not k.startswith("OMPI_COMM_WORLD")}


@pytest.mark.parametrize("entry", [["-m", "verl.cli", "sft"], ["-m", "verl.trainer.sft_trainer"]])
def test_sft_entry_points_reach_the_cli(tmp_path, entry):
    """`verl sft` routes to verl.trainer.main_sft; `python -m verl.trainer.sft_trainer` (what
    launch/quickstart.py runs) is the same command: a missing config is one line, exit 2."""
    missing = tmp_path / "nope.yaml"
    out = subprocess.run([sys.executable, *entry, "--config", str(missing)], capture_output=True, text=True,
                         timeout=120, env=_local_env())
    err = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(err) == 1 and err[0].startswith("verl sft: ") and str(missing) in err[0], out
