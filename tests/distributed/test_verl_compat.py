"""verl's own command lines run unchanged on verl-hpc (issues 15 and 27).

verl 0.9's example scripts (``verl_examples/*_v09.overrides``: GRPO and PPO, Megatron and FSDP) call
``python3 -m verl.trainer.main_ppo`` with no ``--config-path``/``--config-name``: ``model_engine=megatron``
picks the Megatron config, and without it verl's default engine (dp, FSDP) applies; the Megatron GRPO
script also carries ``ray_kwargs.*``, which is ignored with one warning. Each runs as a user would: the
script's override lines (model and data paths swapped for local ones) through bash, so its quoting and
``$(...)`` apply, with a machine-fit suffix appended the way users append ``"$@"`` (2 CPU ranks,
``rollout.name=native``, tiny sizes, 2 steps). verl's ``file`` logger must hold ``actor/pg_loss`` at step 2.

verl's earlier scripts (``grpo_megatron.overrides``, ``ppo_megatron.overrides``) name the config
(``--config-path=config --config-name='ppo_megatron_trainer.yaml'``); each must compose the same config as
the same lines under verl 0.9's ``model_engine=megatron`` (``--cfg job``), the selector the runs above train.
"""

import json
import os
import shlex
import subprocess
import sys

import pytest
import yaml

pytest.importorskip("megatron.core")

from helpers.tiny_models import arithmetic_data_args  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "verl_examples")
MODEL = os.path.join(REPO, "configs", "models", "qwen2_tiny_arith.json")
RUN_TIMEOUT_S = 300
CFG_TIMEOUT_S = 120

# What a user with 2 CPU ranks appends: 2 ranks and the native rollout; one pipeline stage, since the
# scripts' tp=2 x pp=2 needs 4 ranks (and their token-budget micro-batches need pp=1).
ONE_STAGE = [f"{role}.megatron.pipeline_model_parallel_size=1"
             for role in ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic")]
SUFFIX = {
    "grpo_megatron_v09": ONE_STAGE[:2],
    "ppo_megatron_v09": ONE_STAGE,
    "grpo_fsdp_v09": [],
    "ppo_fsdp_v09": [],
    "grpo_megatron": [
        "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=1",
        "actor_rollout_ref.ref.megatron.pipeline_model_parallel_size=1",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
    ],
    "ppo_megatron": [
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1",
        "actor_rollout_ref.ref.megatron.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
    ],
}
COMMON_SUFFIX = [
    "trainer.n_gpus_per_node=2", "actor_rollout_ref.rollout.name=native",
    "data.train_batch_size=8", "data.max_prompt_length=16", "data.max_response_length=6",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4", "trainer.total_training_steps=2",
    "trainer.logger=[console,file]", "trainer.val_before_train=False", "trainer.export_hf_at_end=False",
]
# (example, backend its command line selects, the roles' strategy)
VERL_09_EXAMPLES = [("grpo_megatron_v09", "megatron", "megatron"), ("ppo_megatron_v09", "megatron", "megatron"),
                    ("grpo_fsdp_v09", "dp", "fsdp"), ("ppo_fsdp_v09", "dp", "fsdp")]


def example_overrides(name: str) -> list[str]:
    with open(os.path.join(EXAMPLES, f"{name}.overrides"), encoding="utf-8") as fh:
        return [line.strip() for line in fh if line.strip() and not line.startswith("#")]


@pytest.fixture(scope="module")
def arithmetic(tmp_path_factory):
    out = tmp_path_factory.mktemp("arith")
    arithmetic_data_args(out, num_train=64, num_test=16)
    return out


def run_script(tmp_path, arithmetic, head: str, name: str, *extra: str) -> subprocess.CompletedProcess:
    """The example as its script writes it -- ``head``, one override per line, ``"$@"`` -- run by bash with the
    machine-fit suffix (and ``extra``) as its arguments."""
    script = tmp_path / f"{name}.sh"
    script.write_text("set -e\n" + " \\\n    ".join([head, *example_overrides(name), '"$@"']) + "\n")
    env = {**os.environ, "TRAIN_FILES": f"['{arithmetic}/train.parquet', '{arithmetic}/test.parquet']",
           "VAL_FILES": f"['{arithmetic}/test.parquet']", "MODEL": MODEL,
           "VERL_FILE_LOGGER_PATH": str(tmp_path / "verl_file_logger.jsonl"), "PYTHONPATH": REPO}
    suffix = [*SUFFIX[name], *COMMON_SUFFIX, f"data.tokenizer={arithmetic}/tokenizer",
              f"trainer.output_dir={tmp_path / 'out'}", *extra]
    return subprocess.run(["bash", str(script), *suffix], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=CFG_TIMEOUT_S if "--cfg" in extra else RUN_TIMEOUT_S)


VERL_09_HEAD = f"{shlex.quote(sys.executable)} -m verl.trainer.main_ppo"
CONFIG_NAME_HEAD = f"{VERL_09_HEAD} --config-path=config --config-name='ppo_megatron_trainer.yaml'"


@pytest.mark.parametrize("name, engine, strategy", VERL_09_EXAMPLES, ids=[e[0] for e in VERL_09_EXAMPLES])
def test_verl_0_9_example_command_line_runs_two_steps(name, engine, strategy, arithmetic, tmp_path):
    # The config the command line composes: the backend it selects, Ray's keys dropped with one warning line.
    proc = run_script(tmp_path, arithmetic, VERL_09_HEAD, name, "--cfg", "job")
    assert proc.returncode == 0, proc.stderr[-3000:]
    cfg = yaml.safe_load(proc.stdout)
    assert cfg["model_engine"] == engine and "ray_kwargs" not in cfg
    arr = cfg["actor_rollout_ref"]
    assert {arr["actor"]["strategy"], arr["ref"]["strategy"], cfg["critic"]["strategy"]} == {strategy}
    ray_lines = [line for line in proc.stderr.splitlines() if "ray_kwargs" in line]
    if "grpo_megatron" in name:
        assert len(ray_lines) == 1 and "runs no Ray" in ray_lines[0], proc.stderr[-3000:]
    if name == "ppo_fsdp_v09":  # verl 0.9's critic keys reached the critic
        assert cfg["critic"]["fsdp_config"]["param_offload"] is False
        assert cfg["critic"]["model"]["enable_gradient_checkpointing"] is True

    proc = run_script(tmp_path, arithmetic, VERL_09_HEAD, name)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "verl_file_logger.jsonl").read_text().splitlines()]
    by_step = {r["step"]: r["data"] for r in records}
    assert sorted(by_step) == [1, 2], records
    assert "actor/pg_loss" in by_step[2], sorted(by_step[2])
    if name.startswith("ppo"):
        assert "critic/vf_loss" in by_step[2], sorted(by_step[2])


@pytest.mark.parametrize("name", ["grpo_megatron", "ppo_megatron"])
def test_config_name_command_line_composes_what_model_engine_megatron_does(name, arithmetic, tmp_path):
    """verl's earlier scripts name ppo_megatron_trainer; verl 0.9's select it with model_engine=megatron."""
    named = run_script(tmp_path, arithmetic, CONFIG_NAME_HEAD, name, "--cfg", "job")
    selected = run_script(tmp_path, arithmetic, f"{VERL_09_HEAD} model_engine=megatron", name, "--cfg", "job")
    assert named.returncode == 0 and selected.returncode == 0, named.stderr[-2000:] + selected.stderr[-2000:]
    cfg = yaml.safe_load(named.stdout)
    assert cfg["model_engine"] == "megatron" and cfg["actor_rollout_ref"]["actor"]["strategy"] == "megatron"
    assert cfg == yaml.safe_load(selected.stdout)


def test_cfg_job_prints_the_resolved_verl_config(tmp_path):
    """``--cfg job`` (Hydra's) prints the composed config with verl's keys and the overrides applied."""
    proc = subprocess.run([sys.executable, "-m", "verl.trainer.main_ppo", "--config-path=config",
                           "--config-name=ppo_megatron_trainer", "--cfg", "job",
                           "actor_rollout_ref.actor.optim.lr=1e-6", "critic.optim.lr=2e-5",
                           "+actor_rollout_ref.actor.megatron.override_transformer_config.apply_rope_fusion=False",
                           "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=CFG_TIMEOUT_S,
                          env={**os.environ, "PYTHONPATH": REPO})
    assert proc.returncode == 0, proc.stderr[-2000:]
    cfg = yaml.safe_load(proc.stdout)
    assert cfg["actor_rollout_ref"]["actor"]["optim"]["lr"] == pytest.approx(1e-6)
    assert cfg["critic"]["optim"]["lr"] == pytest.approx(2e-5)
    # verl's interpolations: the reference and critic follow the actor's layout.
    assert cfg["actor_rollout_ref"]["ref"]["megatron"]["tensor_model_parallel_size"] == 2
    assert cfg["critic"]["megatron"]["tensor_model_parallel_size"] == 2
    assert cfg["actor_rollout_ref"]["actor"]["megatron"]["override_transformer_config"]["apply_rope_fusion"] is False
