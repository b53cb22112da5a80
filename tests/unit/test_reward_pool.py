"""The reward pool (issue 47, item 3: verl's ``reward.num_workers``, the legacy ``launch_reward_fn_async``): the
scores and extra info of spawned workers equal the in-process manager's, scorers pickle by name, a raising sample
is one line naming its row and data source, and the config keys fold."""

import os
import pickle

import numpy as np
import pytest
import torch

from verl.errors import InputError, exit_code
from verl.protocol import DataProto
from verl.utils.dataset.arithmetic import build_char_tokenizer
from verl.utils.reward_score import load_reward_fn
from verl.workers.reward_manager import NaiveRewardManager
from verl.workers.reward_manager.async_pool import RewardPool, RewardScoreError, RewardScoreInputError

PPO = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs",
                   "ppo_arith_tiny.yaml")
SCORER = '''import os

from verl.errors import InputError


class Unscorable(Exception):
    """Defined only in this file: the parent process cannot unpickle it."""


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "666":
        raise Unscorable(f"cannot score {solution_str!r}\\nsecond line")
    if solution_str == "777":
        raise InputError("ground truth missing")
    return {"score": float(solution_str == ground_truth) + 0.1 * len(solution_str), "pid": os.getpid()}
'''


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(build_char_tokenizer(str(tmp_path_factory.mktemp("tok"))))


@pytest.fixture(scope="module")
def manager(tokenizer, tmp_path_factory):
    path = tmp_path_factory.mktemp("scorer") / "scorer.py"
    path.write_text(SCORER)
    return NaiveRewardManager(tokenizer, compute_score=load_reward_fn(str(path)))


@pytest.fixture(scope="module")
def pool(manager):
    pool = RewardPool(manager, num_workers=2)
    yield pool
    pool.close()


def batch_of(tokenizer, texts, sources=None):
    """Prompts left-padded to 6, responses (+eos) right-padded to 5, as a rollout returns them."""
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    prompts, responses, masks = [], [], []
    for text in texts:
        p = tokenizer("12+3=", add_special_tokens=False)["input_ids"]
        r = (tokenizer(text, add_special_tokens=False)["input_ids"] + [eos])[:5]
        prompts.append([pad] * (6 - len(p)) + p)
        responses.append(r + [pad] * (5 - len(r)))
        masks.append([0] * (6 - len(p)) + [1] * len(p) + [1] * len(r) + [0] * (5 - len(r)))
    n = len(texts)
    return DataProto.from_dict(
        {"prompts": torch.tensor(prompts), "responses": torch.tensor(responses), "attention_mask": torch.tensor(masks),
         "old_log_probs": torch.zeros(n, 5)},
        {"data_source": np.array(sources or ["arithmetic"] * n, dtype=object),
         "reward_model": np.array([{"ground_truth": "15"}] * n, dtype=object),
         "extra_info": np.array([{"index": 100 + i} for i in range(n)], dtype=object)})


def test_pool_scores_equal_the_in_process_managers(tokenizer, manager, pool):
    rows = batch_of(tokenizer, ["15", "7", "15 9", "", "1", "15", "99"], ["a", "b", "a", "b", "a", "b", "a"])
    expected = manager(rows, return_dict=True)
    got = pool.submit(rows).result(return_dict=True)
    torch.testing.assert_close(got["reward_tensor"], expected["reward_tensor"], rtol=0, atol=0)
    assert got["reward_extra_info"]["score"] == expected["reward_extra_info"]["score"]
    # Scored in the pool's processes, not here.
    assert os.getpid() not in got["reward_extra_info"]["pid"]
    torch.testing.assert_close(pool.submit(rows).result(), expected["reward_tensor"], rtol=0, atol=0)


def test_a_raising_sample_is_one_line_with_its_row_and_data_source(tokenizer, pool):
    rows = batch_of(tokenizer, ["15", "7", "1", "666", "15"], ["a", "b", "a", "gsm8k", "a"])
    with pytest.raises(RewardScoreError) as caught:
        pool.submit(rows).result()
    assert str(caught.value) == ("reward function raised Unscorable: cannot score '666' (on row 3 "
                                 "(data_source='gsm8k', extra_info.index=103) of the step's batch)")
    assert exit_code(caught.value) == 1 and not isinstance(caught.value, InputError)
    assert "in compute_score" in "".join(caught.value.__notes__)  # the user's traceback
    # Rows of a data-plane rank: the row named is the one's position in the step's batch.
    with pytest.raises(RewardScoreInputError, match=r"raised InputError: ground truth missing \(on row 41 "
                       r"\(data_source='b', extra_info.index=101\)") as caught:
        pool.submit(batch_of(tokenizer, ["15", "777"], ["a", "b"]), positions=[40, 41]).result()
    assert exit_code(caught.value) == 2


def test_in_process_the_error_is_the_users_own_marked_with_its_sample(tokenizer, manager):
    with pytest.raises(Exception, match="cannot score '666'") as caught:
        manager(batch_of(tokenizer, ["15", "666"]))
    assert type(caught.value).__name__ == "Unscorable"
    assert caught.value.reward_sample == {"row": 1, "data_source": "arithmetic", "index": 101}
    assert "while scoring row 1 (data_source='arithmetic', extra_info.index=101)" in caught.value.__notes__


def test_scorers_pickle_by_name_and_unpicklable_reward_fns_are_refused(tmp_path):
    builtin = pickle.loads(pickle.dumps(load_reward_fn("arithmetic")))
    assert builtin("anything", "12", "12") == 1.0
    path = tmp_path / "mine.py"
    path.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                    "    return len(solution_str)\n")
    loaded = pickle.loads(pickle.dumps(load_reward_fn(str(path))))
    assert loaded("d", "abc", "x") == 3 and loaded.__name__ == "compute_score"
    with pytest.raises(InputError, match=r"reward.num_workers=2: the reward function runs in spawned processes and "
                       r"must pickle; function does not"):
        RewardPool(lambda rows, return_dict=False: rows, num_workers=2)


def test_num_workers_and_the_legacy_async_flag_fold(tmp_path):
    from helpers.tiny_models import write_arithmetic_data

    from verl.trainer.config import ConfigError, load_config

    data_args = write_arithmetic_data(tmp_path, 8, 4)
    assert load_config(PPO, data_args).reward.num_workers == 0
    assert load_config(PPO, [*data_args, "reward_model.launch_reward_fn_async=true"]).reward.num_workers == 1
    assert load_config(PPO, [*data_args, "reward.num_workers=3",
                             "reward_model.launch_reward_fn_async=true"]).reward.num_workers == 3
    with pytest.raises(ConfigError, match="reward.num_workers: expected at least 1 with "
                       "reward_model.launch_reward_fn_async=true"):
        load_config(PPO, [*data_args, "reward.num_workers=0", "reward_model.launch_reward_fn_async=true"])
    with pytest.raises(ConfigError, match="reward.num_workers"):
        load_config(PPO, [*data_args, "reward.num_workers=-1"])


def test_the_workers_die_with_a_sigkilled_rank(manager, tmp_path):
    """An orphaned worker would wait on its queue forever (seen: a rank's workers left behind by a Slurm test)."""
    import signal
    import subprocess
    import sys
    import time

    from helpers.tiny_models import alive_pids

    (tmp_path / "manager.pkl").write_bytes(pickle.dumps(manager))
    script = tmp_path / "rank.py"
    script.write_text(
        "import pickle, time\n"
        "from verl.workers.reward_manager.async_pool import RewardPool\n"
        "if __name__ == '__main__':  # spawned workers import this file again\n"
        "    pool = RewardPool(pickle.load(open('manager.pkl', 'rb')), num_workers=2)\n"
        "    pool.wait_ready()\n"
        "    print(*pool._executor._processes, flush=True)\n"
        "    time.sleep(600)\n")
    rank = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        workers = [int(p) for p in rank.stdout.readline().split()]
        assert len(workers) == 2 and alive_pids(workers) == workers
        rank.send_signal(signal.SIGKILL)
        rank.wait(timeout=30)
        deadline = time.monotonic() + 30
        while alive_pids(workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert alive_pids(workers) == [], "a reward worker outlived its SIGKILLed rank"
    finally:
        rank.kill()
