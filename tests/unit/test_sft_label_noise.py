"""``data.label_noise_mode=drop_carry``: the SFT warm start's systematic "forgot the carry" labels."""

import pytest

from verl.trainer import sft_trainer
from verl.trainer.config import ConfigError
from verl.trainer.sft_trainer import add_drop_carry_noise, drop_carry_answer


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
        sft_trainer.read_config_tree(None, ["data.label_noise_mode=forget"], sft_trainer.SCHEMA)
