"""The Python API's snippets (docs/python_api.md, issue 48), each run as a user's script in a fresh process with no
launcher: the PPO trainer stepped by hand (``PPOTrainer(dict)``, ``rollout``/``update``, ``reward_worker``), the
local trainer against `verl train` on the same config, ``HybridActor`` (a generation after optimizer steps samples
the updated weights) and a ``DataFlow`` with a user reward, a module node and a resume. Tiny Qwen2, arithmetic data.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("megatron.core")

from helpers.tiny_models import arithmetic_data_args  # noqa: E402
from helpers.train_runs import REPO, deterministic, read_metrics, run_train, save_arith_reward_model, train_cmd  # noqa: E402

MODEL = os.path.join(REPO, "configs", "models", "qwen2_tiny_arith.json")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    out = tmp_path_factory.mktemp("arith")
    arithmetic_data_args(out, num_train=8, num_test=4)
    return out


def run_script(tmp_path, body: str, name: str = "snippet.py") -> str:
    """``body`` as a script of its own (no launcher variables): its stdout; fails with its output otherwise."""
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "OMPI_", "PMIX_")) and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(path)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, f"{name} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def tiny_config(data, out_dir, **trainer):
    return {
        "data": {"train_files": f"{data}/train.parquet", "tokenizer": f"{data}/tokenizer", "max_prompt_length": 8,
                 "max_response_length": 6, "train_batch_size": 4, "seed": 1},
        "actor_rollout_ref": {
            "model": {"path": MODEL},
            "actor": {"ppo_mini_batch_size": 4, "ppo_micro_batch_size_per_gpu": 8, "use_kl_loss": True,
                      "optim": {"lr": 1e-3}},
            "ref": {"log_prob_micro_batch_size_per_gpu": 8},
            "rollout": {"name": "native", "n": 2, "log_prob_micro_batch_size_per_gpu": 8}},
        "algorithm": {"adv_estimator": "grpo"},
        "trainer": {"nnodes": 1, "n_gpus_per_node": 1, "total_training_steps": 2, "output_dir": str(out_dir),
                    "logger": ["console"], "val_before_train": False, "save_freq": 0, "test_freq": 0, **trainer},
    }


def test_ppo_trainer_from_a_dict_steps_by_hand_and_swaps_the_reward_model(tmp_path, data):
    save_arith_reward_model(tmp_path / "rm")
    save_arith_reward_model(tmp_path / "rm_zero", zero_head=True)
    config = tiny_config(data, tmp_path / "out")
    config["reward_model"] = {"enable": True, "model": {"path": str(tmp_path / "rm")}, "micro_batch_size_per_gpu": 4}
    out = run_script(tmp_path, f"""
        import json
        from verl.trainer.ppo import PPOTrainer
        from verl.trainer.ppo_trainer import PPOTrainer as Alias

        assert Alias is PPOTrainer
        trainer = PPOTrainer({config!r})
        data = trainer.rollout()
        scores = data.batch["token_level_scores"].sum(-1)
        metrics = trainer.update(data)
        trainer.reward_worker.load_model({str(tmp_path / "rm_zero")!r})
        second = trainer.rollout()
        print(json.dumps({{"keys": sorted(data.batch.keys()), "rows": len(data), "step": trainer.global_step,
                          "loss": metrics["loss"], "pg_loss": metrics["actor/pg_loss"],
                          "scores": scores.abs().sum().item(),
                          "zero_scores": second.batch["token_level_scores"].abs().sum().item(),
                          "rm": trainer.reward_worker.path}}))
        trainer.close()
    """)
    result = json.loads(out.strip().splitlines()[-1])
    for key in ("responses", "rollout_log_probs", "old_log_probs", "ref_log_prob", "token_level_scores",
                "token_level_rewards", "advantages"):
        assert key in result["keys"], result["keys"]
    assert result["rows"] == 4 * 2 and result["step"] == 1
    assert result["loss"] == result["pg_loss"]
    # The reward model scored the first batch; its zero-head replacement scores every response 0.
    assert result["scores"] > 0 and result["zero_scores"] == 0.0
    assert result["rm"] == str(tmp_path / "rm_zero")
    assert "[reward_model] swapped to" in out


def test_local_trainer_prints_phase_times_and_matches_verl_train(tmp_path, data):
    import yaml

    config_path = tmp_path / "tiny.yaml"
    config_path.write_text(yaml.safe_dump(tiny_config(data, tmp_path / "local")))
    out = run_script(tmp_path, f"""
        from transformers import AutoTokenizer
        from verl.data.rlhf_dataset import RLHFDataset
        from verl.trainer.local_trainer import LocalPPOTrainer

        dataset = RLHFDataset(data_files={f"{data}/train.parquet"!r},
                              tokenizer=AutoTokenizer.from_pretrained({f"{data}/tokenizer"!r}),
                              config={{"max_prompt_length": 8}})
        LocalPPOTrainer(config_path={str(config_path)!r}, train_dataset=dataset).fit()
    """)
    for phase in ("gen", "ref", "adv", "update_actor"):
        assert f"[{phase}] " in out, out[-2000:]
    run_train(train_cmd(str(config_path), tmp_path / "cli", []))
    local, cli = read_metrics(tmp_path / "local"), read_metrics(tmp_path / "cli")
    assert sorted(local) == sorted(cli) == [1, 2]
    for step in (1, 2):
        assert deterministic(local[step]) == deterministic(cli[step]), step


def test_hybrid_actor_generates_from_the_weights_it_just_trained(tmp_path, data):
    out = run_script(tmp_path, f"""
        import json
        import torch
        from verl import HybridActor

        actor = HybridActor.from_pretrained({MODEL!r}, {f"{data}/tokenizer"!r}, learning_rate=1e-2,
                                            max_prompt_length=8, max_new_tokens=6)
        tok = actor.tokenizer
        ids = torch.tensor([tok.encode("1+2=")])
        target = torch.cat([ids, torch.tensor([tok.convert_tokens_to_ids(list("333333"))])], dim=1)
        before = actor.generate(input_ids=ids, max_new_tokens=6, do_sample=False)
        actor.eval()
        eval_before = float(actor(input_ids=target, labels=target).loss)
        engine = actor.worker.actor.engine
        actor.train()
        losses = [float(actor(input_ids=target, labels=target).loss) for _ in range(15)]
        actor.eval()
        after = actor.generate(input_ids=ids, max_new_tokens=6, do_sample=False)
        print(json.dumps({{"before": before.tolist(), "after": after.tolist(), "target": target.tolist(),
                          "eval_before": eval_before, "losses": losses, "steps": engine.optimizer_steps,
                          "same_engine": actor.worker.actor.engine is engine}}))
    """)
    result = json.loads(out.strip().splitlines()[-1])
    assert result["before"] != result["target"]
    assert result["steps"] == 15 and result["same_engine"]
    assert result["losses"][-1] < 0.1 * result["eval_before"], result["losses"]
    # Greedy generation from the trained weights: the continuation it was trained on.
    assert result["after"] == result["target"]


DATAFLOW = """
    import json
    import sys
    import torch
    from verl import DataFlow, TrainerConfig, register

    @register
    def exact_answer(responses, ground_truth):
        return [float(r.strip() == g) + 0.1 * len(r) for r, g in zip(responses, ground_truth)]

    class TokenCount(torch.nn.Module):
        def forward(self, input_ids):
            return (input_ids != 0).sum(-1).float()

    def main():
        flow = DataFlow()
        flow.add_node("rollout", "rollout", output_keys=["responses", "ground_truth", "input_ids"])
        flow.add_node("tokens", TokenCount(), input_keys=["input_ids"], output_keys=["n_tokens"])
        flow.add_node("reward", exact_answer, input_keys=["responses", "ground_truth"], output_keys=["reward"])
        flow.enable_debug(mode=sys.argv[1])
        config = TrainerConfig(model=MODEL, tokenizer=TOKENIZER, num_epochs=1, batch_size=2, learning_rate=1e-3,
                               rollout_n=2, max_prompt_length=8, max_response_length=6, output_dir="run",
                               total_steps=int(sys.argv[2]), save_freq=2)
        trainer = flow.build_trainer(config=config)
        if sys.argv[3] == "resume":
            metrics = trainer.train(resume_from="run/checkpoints")
        else:
            metrics = trainer.train(prompts=[{"prompt": "1+2=", "ground_truth": "3"},
                                             {"prompt": "2+2=", "ground_truth": "4"}, "3+1=", "1+1="])
        print(json.dumps([{"step": m["step"], "score": m["critic/score/mean"]} for m in metrics]))

    if __name__ == "__main__":  # the checkpoint writer starts processes of its own
        main()
"""


def test_dataflow_trains_on_a_user_reward_and_resumes(tmp_path, data):
    script = f"MODEL = {MODEL!r}\nTOKENIZER = {f'{data}/tokenizer'!r}\n" + textwrap.dedent(DATAFLOW)
    (tmp_path / "flow.py").write_text(script)

    def run(*args):
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
        env.update(PYTHONPATH=REPO, OMP_NUM_THREADS="1")
        proc = subprocess.run([sys.executable, "flow.py", *args], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=240)
        assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        return proc.stdout

    out = run("full", "2", "fresh")
    steps = json.loads(out.strip().splitlines()[-1])
    assert [s["step"] for s in steps] == [1, 2]
    # full debug: every node's inputs and outputs as Python values, every step.
    node_lines = [line for line in out.splitlines() if line.startswith("[dataflow] reward: inputs {'responses': [")]
    assert len(node_lines) == 2, out[-2000:]
    assert "[dataflow] tokens: inputs {'input_ids': [[" in out
    # The reward is the user's: each response's length / 10 at least, so the mean score is positive.
    assert all(s["score"] > 0 for s in steps)

    out = run("none", "3", "resume")
    assert "resumed from" in out and "[dataflow]" not in out
    resumed = json.loads(out.strip().splitlines()[-1])
    assert resumed[-1]["step"] == 3


def test_a_process_group_the_api_started_ends_before_the_interpreter_shuts_down(tmp_path, data):
    # A gloo group left to the interpreter's shutdown aborted a torchrun'd API script now and then (CI: "terminate
    # called without an active exception", exit -6, after its last step); the API ends the group it started at exit.
    config = json.dumps(tiny_config(data, tmp_path / "run"))
    out = run_script(tmp_path, f"""
        import atexit, json
        import torch.distributed as dist
        from verl.trainer.prepare import ensure_distributed, resolve_config

        atexit.register(lambda: print("group at exit:", dist.is_initialized(), flush=True))  # runs last (LIFO)
        print("started:", ensure_distributed(resolve_config(json.loads({config!r}))), dist.is_initialized())
    """)
    assert "started: True True" in out and "group at exit: False" in out, out
