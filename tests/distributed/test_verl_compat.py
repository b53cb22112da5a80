"""verl's own command lines run unchanged on verl-hpc (issue 15).

Each case is verl's Megatron example script as a user would run it: ``python3 -m verl.trainer.main_ppo
--config-path=config --config-name='ppo_megatron_trainer.yaml'`` followed by the example's overrides
(``verl_examples/*.overrides``: verl's GRPO and PPO Megatron examples with the model and data paths
swapped for local ones), through bash so the script's own quoting applies, and a machine-fit suffix
appended the way users append ``$@`` (2 CPU ranks, ``rollout.name=native``, tiny sizes, 2 steps).
verl's ``file`` logger must hold ``actor/pg_loss`` at step 2.
"""

import json
import os
import shlex
import subprocess
import sys

import pytest

pytest.importorskip("megatron.core")

from tiny_models import arithmetic_data_args  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "verl_examples")
MODEL = os.path.join(REPO, "configs", "models", "qwen2_tiny_arith.json")
RUN_TIMEOUT_S = 300

# What a user with 2 CPU ranks appends: sizes, the native rollout, 2 steps, the file logger.
SUFFIX = {
    "grpo_megatron": [
        "trainer.n_gpus_per_node=2", "actor_rollout_ref.rollout.name=native",
        "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=1",
        "actor_rollout_ref.ref.megatron.pipeline_model_parallel_size=1",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
    ],
    "ppo_megatron": [
        "trainer.n_gpus_per_node=2", "actor_rollout_ref.rollout.name=native",
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1",
        "actor_rollout_ref.ref.megatron.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
    ],
}
COMMON_SUFFIX = [
    "data.train_batch_size=8", "data.max_prompt_length=16", "data.max_response_length=6",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4", "trainer.total_training_steps=2",
    "trainer.logger=[console,file]", "trainer.val_before_train=False", "trainer.export_hf_at_end=False",
]


def example_overrides(name: str) -> list[str]:
    with open(os.path.join(EXAMPLES, f"{name}.overrides"), encoding="utf-8") as fh:
        return [line.strip() for line in fh if line.strip() and not line.startswith("#")]


@pytest.fixture(scope="module")
def arithmetic(tmp_path_factory):
    out = tmp_path_factory.mktemp("arith")
    arithmetic_data_args(out, num_train=64, num_test=16)
    return out


@pytest.mark.parametrize("name", ["grpo_megatron", "ppo_megatron"])
def test_verl_example_command_line_runs_two_steps(name, arithmetic, tmp_path):
    # The script exactly as verl writes it, with the paths swapped and "$@" at the end.
    lines = [f"{shlex.quote(sys.executable)} -m verl.trainer.main_ppo --config-path=config "
             f"--config-name='ppo_megatron_trainer.yaml'", *example_overrides(name), '"$@"']
    script = tmp_path / "run.sh"
    script.write_text("set -e\n" + " \\\n    ".join(lines) + "\n")
    file_log = tmp_path / "verl_file_logger.jsonl"
    env = {**os.environ, "TRAIN_FILES": f"['{arithmetic}/train.parquet', '{arithmetic}/test.parquet']",
           "VAL_FILES": f"['{arithmetic}/test.parquet']", "MODEL": MODEL,
           "VERL_FILE_LOGGER_PATH": str(file_log), "PYTHONPATH": REPO}
    suffix = [*SUFFIX[name], *COMMON_SUFFIX, f"data.tokenizer={arithmetic}/tokenizer",
              f"trainer.output_dir={tmp_path / 'out'}"]
    proc = subprocess.run(["bash", str(script), *suffix], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = [json.loads(line) for line in file_log.read_text().splitlines()]
    by_step = {r["step"]: r["data"] for r in records}
    assert sorted(by_step) == [1, 2], records
    assert "actor/pg_loss" in by_step[2], sorted(by_step[2])
    if name == "ppo_megatron":
        assert "critic/vf_loss" in by_step[2], sorted(by_step[2])


def test_cfg_job_prints_the_resolved_verl_config(tmp_path):
    """``--cfg job`` (Hydra's) prints the composed config with verl's keys and the overrides applied."""
    proc = subprocess.run([sys.executable, "-m", "verl.trainer.main_ppo", "--config-path=config",
                           "--config-name=ppo_megatron_trainer", "--cfg", "job",
                           "actor_rollout_ref.actor.optim.lr=1e-6", "critic.optim.lr=2e-5",
                           "+actor_rollout_ref.actor.megatron.override_transformer_config.apply_rope_fusion=False",
                           "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": REPO})
    assert proc.returncode == 0, proc.stderr[-2000:]
    import yaml

    cfg = yaml.safe_load(proc.stdout)
    assert cfg["actor_rollout_ref"]["actor"]["optim"]["lr"] == pytest.approx(1e-6)
    assert cfg["critic"]["optim"]["lr"] == pytest.approx(2e-5)
    # verl's interpolations: the reference and critic follow the actor's layout.
    assert cfg["actor_rollout_ref"]["ref"]["megatron"]["tensor_model_parallel_size"] == 2
    assert cfg["critic"]["megatron"]["tensor_model_parallel_size"] == 2
    assert cfg["actor_rollout_ref"]["actor"]["megatron"]["override_transformer_config"]["apply_rope_fusion"] is False
