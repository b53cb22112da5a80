"""`verl train` config validation: each malformed kind exits 2 with one line, before any rank starts."""

import os

import pytest
from helpers.tiny_models import write_arithmetic_data

from verl.trainer import main_ppo
from verl.trainer.config import ConfigError, load_config

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GRPO = os.path.join(REPO, "configs", "grpo_arith_tiny.yaml")
PPO = os.path.join(REPO, "configs", "ppo_arith_tiny.yaml")


@pytest.fixture(scope="module")
def data_args(tmp_path_factory):
    # At least one batch of the quickstart configs (64 prompts).
    return write_arithmetic_data(tmp_path_factory.mktemp("arith"), 80, 8)


@pytest.fixture
def no_ranks(monkeypatch):
    """Fail the test if `verl train` starts a rank, locally or in this process; record spawns."""
    spawned = []
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr("verl.launcher.spawn.spawn_local",
                        lambda nproc, argv, **kwargs: spawned.append((nproc, argv)) or 0)

    def run_rank(config, dry_run):
        raise AssertionError("a rank was started")

    monkeypatch.setattr(main_ppo, "run_rank", run_rank)
    return spawned


def expect_exit_2(capsys, argv, *fragments):
    assert main_ppo.main(argv) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1, f"expected one error line, found:\n{err}"
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def test_quickstart_configs_load_and_spawn_two_local_ranks(data_args, no_ranks):
    for path in (GRPO, PPO):
        config = load_config(path, data_args)
        assert config.trainer.n_gpus_per_node == 2
    assert main_ppo.main(["--config", GRPO, *data_args]) == 0
    (nproc, argv), = no_ranks
    assert nproc == 2 and argv[1:3] == ["-m", "verl.trainer.main_ppo"]


def test_unknown_override_key_suggests_the_right_one(data_args, no_ranks, capsys):
    expect_exit_2(capsys, ["--config", GRPO, *data_args, "trainer.total_trainig_steps=3"],
                  "trainer.total_trainig_steps: unknown key", "did you mean 'trainer.total_training_steps'")
    assert not no_ranks


def test_unknown_key_in_the_yaml_file_suggests_the_right_one(data_args, no_ranks, capsys, tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(open(GRPO).read().replace("ppo_mini_batch_size:", "ppo_mini_batchsize:"))
    expect_exit_2(capsys, ["--config", str(path), *data_args], "actor_rollout_ref.actor.ppo_mini_batchsize",
                  "did you mean 'actor_rollout_ref.actor.ppo_mini_batch_size'")


def test_wrong_type_names_the_key_expected_and_found(data_args, no_ranks, capsys):
    expect_exit_2(capsys, ["--config", GRPO, *data_args, "data.train_batch_size=many"],
                  "data.train_batch_size: expected int, found str 'many'")
    expect_exit_2(capsys, ["--config", GRPO, *data_args, "actor_rollout_ref.actor.use_kl_loss=3"],
                  "actor_rollout_ref.actor.use_kl_loss: expected bool, found int")


def test_tensor_parallel_size_must_divide_the_attention_heads(data_args, no_ranks, capsys):
    expect_exit_2(capsys, ["--config", GRPO, *data_args, "trainer.n_gpus_per_node=3",
                           "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=3"],
                  "tp=3", "num_attention_heads=4")


def test_batch_sizes_must_divide(data_args, no_ranks, capsys):
    expect_exit_2(capsys, ["--config", GRPO, *data_args, "data.train_batch_size=4",
                           "actor_rollout_ref.actor.ppo_mini_batch_size=3"],
                  "actor_rollout_ref.actor.ppo_mini_batch_size=3", "data.train_batch_size=4")
    expect_exit_2(capsys, ["--config", PPO, *data_args, "critic.ppo_micro_batch_size_per_gpu=3"],
                  "critic.ppo_micro_batch_size_per_gpu=3")


def test_world_size_must_match_the_launcher(data_args, no_ranks, capsys, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29999")
    expect_exit_2(capsys, ["--config", GRPO, *data_args], "expected the launcher's world size 4", "= 2")


POOL = ["actor_rollout_ref.rollout.nnodes=1", "actor_rollout_ref.rollout.n_gpus_per_node=3"]


def test_a_rollout_pool_spawns_both_pools_and_bad_sizes_are_one_line(data_args, no_ranks, capsys, monkeypatch):
    assert main_ppo.main(["--config", GRPO, *data_args, *POOL[:1], "actor_rollout_ref.rollout.n_gpus_per_node=2"]) == 0
    (nproc, _), = no_ranks
    assert nproc == 4  # 2 training ranks, then the pool's 2
    expect_exit_2(capsys, ["--config", GRPO, *data_args, *POOL,
                           "actor_rollout_ref.rollout.tensor_model_parallel_size=2"],
                  "rollout.tensor_model_parallel_size=2: expected a divisor of the rollout pool", "=3")
    expect_exit_2(capsys, ["--config", GRPO, *data_args, "actor_rollout_ref.rollout.nnodes=2"],
                  "actor_rollout_ref.rollout.nnodes=2: expected 1 outside a launcher")
    for var, value in (("RANK", "0"), ("WORLD_SIZE", "4"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1"),
                       ("MASTER_PORT", "29999")):
        monkeypatch.setenv(var, value)
    expect_exit_2(capsys, ["--config", GRPO, *data_args, *POOL], "expected the launcher's world size 4",
                  "found 1 * 2 + 1 * 3 = 5")


def test_world_size_must_be_divisible_by_the_model_parallel_size(data_args, no_ranks, capsys):
    expect_exit_2(capsys, ["--config", GRPO, *data_args, "trainer.n_gpus_per_node=3"],
                  "tensor_model_parallel_size * pipeline_model_parallel_size=2", "=3")


def test_missing_data_and_bad_yaml_are_one_line_errors(data_args, no_ranks, capsys, tmp_path):
    expect_exit_2(capsys, ["--config", GRPO, "data.train_files=/nonexistent/train.parquet"],
                  "data.train_files", "verl data arithmetic")
    path = tmp_path / "broken.yaml"
    path.write_text("data: [unclosed\n")
    expect_exit_2(capsys, ["--config", str(path)], "expected valid YAML")
    expect_exit_2(capsys, ["--config", GRPO, *data_args, "trainer.total_training_steps"], "expected key=value")


def test_group_estimators_need_several_samples_per_prompt(data_args):
    with pytest.raises(ConfigError, match="rollout.n: expected >= 2 for grpo"):
        load_config(GRPO, data_args + ["actor_rollout_ref.rollout.n=1", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                                       "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
                                       "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
                                       "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2"])


def test_remax_is_accepted(data_args):
    assert load_config(GRPO, [*data_args, "algorithm.adv_estimator=remax"]).algorithm.adv_estimator == "remax"


def test_reward_model_config_needs_a_compatible_hf_directory(data_args, no_ranks, capsys, tmp_path):
    import json

    expect_exit_2(capsys, ["--config", GRPO, *data_args, "reward_model.enable=true"],
                  "reward_model.model.path: expected an HF reward model directory", "found null")
    rm = tmp_path / "rm"
    rm.mkdir()
    actor = json.load(open(os.path.join(REPO, "configs", "models", "qwen2_tiny_arith.json")))
    (rm / "config.json").write_text(json.dumps({**actor, "vocab_size": 64}))
    expect_exit_2(capsys, ["--config", GRPO, *data_args, "reward_model.enable=true", f"reward_model.model.path={rm}"],
                  "reward_model.model.path: expected the actor's vocab_size=32", "found 64")
    (rm / "config.json").write_text(json.dumps(actor))
    config = load_config(GRPO, [*data_args, "reward_model.enable=true", f"reward_model.model.path={rm}"])
    assert config.reward_model.enable
    expect_exit_2(capsys, ["--config", GRPO, *data_args, "reward_model.enable=true", f"reward_model.model.path={rm}",
                           "reward_model.hot_swap.at_step=2"], "reward_model.hot_swap.path and", "both or neither")
    expect_exit_2(capsys, ["--config", GRPO, *data_args, "reward_model.hot_swap.watch=true"],
                  "reward_model.hot_swap: expected reward_model.enable=true")
    # verl's split: a shorter last micro-batch (512 rows by 3), except where pipeline stages need equal ones.
    assert load_config(GRPO, [*data_args, "reward_model.enable=true", f"reward_model.model.path={rm}",
                              "reward_model.micro_batch_size_per_gpu=3"])
    expect_exit_2(capsys, ["--config", GRPO, *data_args, "reward_model.enable=true", f"reward_model.model.path={rm}",
                           "reward_model.micro_batch_size_per_gpu=3",
                           "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1",
                           "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2"],
                  "reward_model.micro_batch_size_per_gpu=3", "pipeline stages exchange")


# --------------------------------------------------------------------------- verl's config grammar (issue 15)
def test_packaged_defaults_are_verls_command_line(data_args, no_ranks):
    """`python3 -m verl.trainer.main_ppo --config-path=config --config-name=ppo_megatron_trainer.yaml k=v`:
    no --config, Hydra's grammar, verl's defaults and interpolations."""
    model = os.path.join(REPO, "configs", "models", "qwen2_tiny_arith.json")
    argv = ["--config-path=config", "--config-name=ppo_megatron_trainer.yaml", *data_args,
            f"actor_rollout_ref.model.path={model}", "trainer.n_gpus_per_node=2", "data.train_batch_size=8",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.optim.lr=1e-6",
            "trainer.total_training_steps=1e3", "trainer.logger=['console','file']", "data.max_prompt_length=16",
            "data.max_response_length=6",
            "+actor_rollout_ref.actor.megatron.override_transformer_config.apply_rope_fusion=False",
            "~trainer.resume_from_path"]
    assert main_ppo.main(argv) == 0
    (nproc, spawned), = no_ranks
    assert nproc == 2 and "--config-path=config" in spawned
    config = load_config(None, argv[2:])
    assert config.actor_rollout_ref.actor.optim.lr == 1e-6 and config.trainer.total_training_steps == 1000
    assert config.trainer.logger == ["console", "file"]
    assert config.critic.optim.lr == 1e-5  # verl's critic default
    assert config.critic.ppo_mini_batch_size == 4  # follows the actor's, as verl interpolates it
    assert config.actor_rollout_ref.actor.megatron.use_distributed_optimizer is True
    assert config.actor_rollout_ref.actor.megatron.override_transformer_config.apply_rope_fusion is False
    assert config.hybrid_engine.bucket_bytes == 4 * 2**20  # rollout.checkpoint_engine.update_weights_bucket_megabytes


def test_override_grammar_errors_are_one_line(data_args, no_ranks, capsys):
    expect_exit_2(capsys, ["--config", GRPO, *data_args, "actor_rollout_ref.actor.optim.lrr=1e-6"],
                  "actor_rollout_ref.actor.optim.lrr: unknown key", "did you mean 'actor_rollout_ref.actor.optim.lr'")
    expect_exit_2(capsys, ["--config", GRPO, *data_args, "+actor_rollout_ref.actor.optim.lr=1"],
                  "actor_rollout_ref.actor.optim.lr=1", "already")
    expect_exit_2(capsys, ["--config", GRPO, *data_args, "trainer.logger=[console"], "Hydra's override grammar")
    expect_exit_2(capsys, ["--config", GRPO, *data_args, "~actor_rollout_ref.actor.optim.lr"],
                  "actor_rollout_ref.actor.optim.lr: expected a value", "deleted")
    expect_exit_2(capsys, ["--config", GRPO, *data_args, "trainer.total_training_steps=${trainer.nope}"],
                  "trainer.total_training_steps", "interpolation")
    expect_exit_2(capsys, ["--config-name=ppo_trainer_typo", *data_args], "--config-name", "ppo_megatron_trainer")
    expect_exit_2(capsys, ["--config-path=/nonexistent", *data_args], "--config-path", "/nonexistent")


def test_keys_without_meaning_here_are_refused_with_the_reason(data_args, no_ranks, capsys):
    for override, fragment in (("actor_rollout_ref.rollout.name=hf", "use native"),
                               ("actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size=2",
                                "interleaved"),
                               ("actor_rollout_ref.actor.megatron.context_parallel_size=2", "context parallelism"),
                               ("actor_rollout_ref.model.lora_rank=8", "LoRA"),
                               ("trainer.device=npu", "cuda or cpu")):
        expect_exit_2(capsys, ["--config", GRPO, *data_args, override], override.split("=")[0], fragment)


def test_dtype_and_role_layouts_are_checked_against_the_actor(data_args, no_ranks, capsys):
    expect_exit_2(capsys, ["--config", GRPO, *data_args, "actor_rollout_ref.rollout.dtype=bfloat16"],
                  "actor_rollout_ref.rollout.dtype", "float32", "bfloat16")
    expect_exit_2(capsys, ["--config", GRPO, *data_args, "actor_rollout_ref.ref.megatron.tensor_model_parallel_size=1"],
                  "actor_rollout_ref.ref.megatron.tensor_model_parallel_size", "expected the actor's 2")
    config = load_config(GRPO, [*data_args, "actor_rollout_ref.actor.megatron.dtype=bfloat16",
                                "actor_rollout_ref.rollout.dtype=bfloat16"])
    assert config.actor_rollout_ref.ref.megatron.dtype == "bfloat16"  # follows the actor's


def test_engine_options_follow_verls_megatron_keys(data_args):
    import torch

    from verl.engine.base import optim_config
    from verl.engine.megatron.engine import engine_options

    config = load_config(GRPO, [*data_args, "actor_rollout_ref.actor.megatron.dtype=bfloat16",
                                "actor_rollout_ref.rollout.dtype=bfloat16",
                                "actor_rollout_ref.model.enable_gradient_checkpointing=True",
                                "actor_rollout_ref.actor.megatron.sequence_parallel=true",
                                "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.1",
                                "actor_rollout_ref.actor.optim.lr_decay_steps=50"])
    arr = config.actor_rollout_ref
    options = engine_options(arr.actor.megatron, arr.model)
    assert options["params_dtype"] == torch.bfloat16 and options["sequence_parallel"] is True
    assert options["transformer_overrides"] == {"recompute_granularity": "full", "recompute_method": "uniform",
                                                "recompute_num_layers": 1}
    optim = optim_config(arr.actor.optim, total_training_steps=100)
    assert optim.lr_warmup_steps == 10 and optim.lr_decay_steps == 50  # verl: lr_warmup_steps=-1 -> the ratio


def test_the_real_size_gpu_config_validates(data_args):
    """configs/grpo_qwen2_0p5b_gpu.yaml (Qwen2.5-0.5B shape, bf16, 1 GPU) passes every config check on CPU."""
    config = load_config(os.path.join(REPO, "configs", "grpo_qwen2_0p5b_gpu.yaml"), data_args)
    assert config.actor_rollout_ref.actor.megatron.dtype == config.actor_rollout_ref.rollout.dtype == "bfloat16"
    assert config.trainer.n_gpus_per_node == 1 and config.actor_rollout_ref.rollout.n == 8


def test_train_max_samples_below_one_batch_is_refused_and_preflight_counts_after_the_limit(data_args, no_ranks,
                                                                                           capsys):
    expect_exit_2(capsys, ["--config", GRPO, *data_args, "data.train_max_samples=32"],
                  "data.train_max_samples=32: expected -1 (every row) or at least data.train_batch_size=64")
    # 80 rows; the limit keeps 64 (one batch), then the over-long filter drops some: fewer than a batch.
    expect_exit_2(capsys, ["--config", GRPO, *data_args, "data.train_max_samples=64", "data.max_prompt_length=5",
                           "data.filter_overlong_prompts=true"],
                  "expected at least 64 rows (one batch)", "after max_samples=64 of 80 rows and filtering")
    assert main_ppo.main(["--config", GRPO, *data_args, "data.train_max_samples=64"]) == 0
    assert len(no_ranks) == 1


def test_dynamic_bsz_is_accepted_with_a_budget_that_fits_a_sequence_and_one_pipeline_stage(data_args, no_ranks,
                                                                                          capsys):
    # verl: actor.use_dynamic_bsz turns on the rollout's, the reference's and the critic's too (interpolations);
    # the micro-batch sizes are then unused (3 divides nothing here).
    config = load_config(PPO, data_args + ["actor_rollout_ref.actor.use_dynamic_bsz=true",
                                           "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=64",
                                           "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3",
                                           "critic.ppo_micro_batch_size_per_gpu=3"])
    assert config.critic.use_dynamic_bsz and config.actor_rollout_ref.rollout.log_prob_use_dynamic_bsz
    assert config.actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu == 64
    expect_exit_2(capsys, ["--config", PPO, *data_args, "actor_rollout_ref.actor.use_dynamic_bsz=true",
                           "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=10"],
                  "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=10: expected at least "
                  "data.max_prompt_length + data.max_response_length=14")
    expect_exit_2(capsys, ["--config", PPO, *data_args, "critic.use_dynamic_bsz=true",
                           "critic.forward_max_token_len_per_gpu=13"],
                  "critic.forward_max_token_len_per_gpu=13: expected at least")
    expect_exit_2(capsys, ["--config", GRPO, *data_args, "actor_rollout_ref.actor.use_dynamic_bsz=true",
                           "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1",
                           "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2"],
                  "actor_rollout_ref.actor.use_dynamic_bsz=true", "pipeline_model_parallel_size=1, found 2")


def test_hydra_job_overrides_are_ignored_and_verl_config_names_compose(data_args, no_ranks, capsys, caplog):
    import logging

    from verl.trainer.config import PACKAGED_CONFIG_DIR

    with caplog.at_level(logging.WARNING):
        config = load_config(GRPO, [*data_args, "hydra.run.dir=outputs/x", "hydra.job.chdir=False"])
    assert "hydra" not in config and "Hydra's job runner" in caplog.text
    # verl's FSDP trainer name gives the same keys with every role on FSDP.
    fsdp = load_config(None, data_args, config_dir=PACKAGED_CONFIG_DIR, config_name="ppo_trainer", resolve_only=True)
    assert [fsdp.actor_rollout_ref.actor.strategy, fsdp.actor_rollout_ref.ref.strategy, fsdp.critic.strategy,
            fsdp.reward_model.strategy] == ["fsdp"] * 4
    expect_exit_2(capsys, ["--config-name=ppo_trainr", *data_args], "ppo_trainr", "ppo_megatron_trainer")


def test_keys_of_the_other_backend_warn(data_args, caplog):
    import logging

    with caplog.at_level(logging.WARNING):
        load_config(GRPO, [*data_args, "actor_rollout_ref.actor.strategy=fsdp"])
    # The Megatron quickstart file sets tp=2 and sequence_parallel=false: said once each, for the actor.
    assert "megatron.tensor_model_parallel_size=2 has no effect with actor_rollout_ref.actor.strategy=fsdp" \
        in caplog.text
    assert caplog.text.count("has no effect with") == 2
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        load_config(GRPO, [*data_args, "actor_rollout_ref.actor.fsdp_config.fsdp_size=1"])
    assert caplog.text.count("has no effect with actor_rollout_ref.actor.strategy=megatron") == 1


def test_keys_without_effect_here_warn_when_set_and_stay_quiet_at_their_default(data_args, caplog):
    import logging

    with caplog.at_level(logging.WARNING):
        load_config(GRPO, data_args)
    assert "has no effect" not in caplog.text
    with caplog.at_level(logging.WARNING):
        load_config(GRPO, [*data_args, "actor_rollout_ref.rollout.enforce_eager=False", "data.return_raw_chat=False"])
    assert "actor_rollout_ref.rollout.enforce_eager=False has no effect in verl-hpc" in caplog.text
    assert "data.return_raw_chat=False has no effect" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):  # the vLLM rollout reads verl's vLLM keys itself
        config = load_config(GRPO, [*data_args, "actor_rollout_ref.rollout.name=vllm",
                                    "actor_rollout_ref.rollout.enforce_eager=False",
                                    "actor_rollout_ref.rollout.max_num_seqs=7",
                                    "actor_rollout_ref.rollout.max_num_batched_tokens=4096",
                                    "actor_rollout_ref.rollout.max_model_len=96",
                                    "actor_rollout_ref.rollout.enable_chunked_prefill=False",
                                    "actor_rollout_ref.rollout.disable_log_stats=False"])
    assert "has no effect" not in caplog.text
    from verl.engine.rollout.registry import vllm_engine_args

    assert vllm_engine_args(config.actor_rollout_ref.rollout, max_rows=16) == dict(
        enforce_eager=False, enable_prefix_caching=config.actor_rollout_ref.rollout.enable_prefix_caching,
        max_num_batched_tokens=4096, enable_chunked_prefill=False, disable_log_stats=False, max_num_seqs=7,
        max_model_len=96)  # no gpu_memory_utilization on CPU (vLLM's CPU backend reads it as host memory)
    assert vllm_engine_args(config.actor_rollout_ref.rollout, max_rows=4)["max_num_seqs"] == 4  # the KV pool's rows
    caplog.clear()
    with caplog.at_level(logging.WARNING):  # the native engine reads none of them
        load_config(GRPO, [*data_args, "actor_rollout_ref.rollout.max_num_seqs=7"])
    assert "max_num_seqs=7 has no effect" in caplog.text


# --------------------------------------------------------------------------- verl 0.9's command line (issue 27)
def test_model_engine_picks_the_backend_and_the_config_as_verl_0_9(data_args, no_ranks, capsys, tmp_path):
    """verl 0.9: no --config-name; `model_engine=megatron|dp` (absent: dp, verl's ppo_trainer) picks the config
    and every role's strategy; a verl-hpc --config file keeps the Megatron defaults it is written for."""
    def backend(path=None, *overrides, config_name=None):
        cfg = load_config(path, [*data_args, *overrides], config_name=config_name, resolve_only=True)
        arr = cfg.actor_rollout_ref
        strategies = {arr.actor.strategy, arr.ref.strategy, cfg.critic.strategy, cfg.reward_model.strategy}
        assert len(strategies) == 1, strategies
        return cfg.model_engine, strategies.pop()

    assert backend() == ("dp", "fsdp")  # verl 0.9's main_ppo default
    assert backend(None, "model_engine=megatron") == ("megatron", "megatron")
    assert backend(None, "model_engine=dp") == ("dp", "fsdp")
    assert backend(GRPO) == ("megatron", "megatron")
    assert backend(GRPO, "model_engine=dp") == ("dp", "fsdp")
    assert backend(os.path.join(REPO, "configs", "grpo_arith_tiny_fsdp.yaml")) == ("dp", "fsdp")
    # An explicit --config-name is composed, and the command line's model_engine still wins, as Hydra's
    # group override does in verl.
    assert backend(None, "model_engine=dp", config_name="ppo_megatron_trainer") == ("dp", "fsdp")
    assert backend(None, "actor_rollout_ref.actor.strategy=fsdp2", config_name="ppo_megatron_trainer") \
        == ("dp", "fsdp2")
    engine_file = tmp_path / "engine.yaml"
    engine_file.write_text("model_engine: dp\n")
    assert backend(str(engine_file)) == ("dp", "fsdp")
    # verl 0.9's Megatron command line through `python3 -m verl.trainer.main_ppo`: validated and spawned.
    model = os.path.join(REPO, "configs", "models", "qwen2_tiny_arith.json")
    argv = [*data_args, f"actor_rollout_ref.model.path={model}", "model_engine=megatron", "trainer.n_gpus_per_node=2",
            "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=4", "data.max_prompt_length=16",
            "data.max_response_length=6", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2"]
    assert main_ppo.main(argv) == 0
    (nproc, spawned), = no_ranks
    assert nproc == 2 and "model_engine=megatron" in spawned  # the ranks compose the same config


def test_model_engine_refusals_and_conflicts_are_one_line(data_args, no_ranks, capsys):
    for engine, reason in (("torchtitan", "TorchTitan is not part of verl-hpc"), ("veomni", "VeOmni"),
                           ("mindspeed", "Ascend NPUs")):
        expect_exit_2(capsys, [*data_args, f"model_engine={engine}"], f"model_engine={engine!r}: not supported",
                      reason, "expected megatron (Megatron-core) or dp (FSDP2)")
    expect_exit_2(capsys, [*data_args, "model_engine=fsdp"], "model_engine: expected one of ['megatron', 'dp']",
                  "found 'fsdp'")
    expect_exit_2(capsys, ["--config", GRPO, *data_args, "model_engine=megatron",
                           "actor_rollout_ref.actor.strategy=fsdp"],
                  "actor_rollout_ref.actor.strategy: expected megatron with model_engine=megatron", "found 'fsdp'")
    assert not no_ranks


def test_ray_kwargs_are_ignored_with_one_warning_line(data_args, caplog, tmp_path):
    import logging

    with caplog.at_level(logging.WARNING):
        config = load_config(GRPO, [*data_args, "ray_kwargs.ray_init.runtime_env.py_executable=null",
                                    "+ray_kwargs.ray_init.num_gpus=8", "ray_kwargs.timeline_json_file=t.json"])
    assert "ray_kwargs" not in config
    ray_lines = [r.getMessage() for r in caplog.records if "ray_kwargs" in r.getMessage()]
    assert len(ray_lines) == 1 and "runs no Ray" in ray_lines[0] and "num_gpus=8" in ray_lines[0], ray_lines
    caplog.clear()
    path = tmp_path / "with_ray.yaml"
    path.write_text(open(GRPO).read() + "ray_kwargs:\n  ray_init:\n    num_cpus: 4\n")
    with caplog.at_level(logging.WARNING):
        assert "ray_kwargs" not in load_config(str(path), data_args)
    assert [r.getMessage() for r in caplog.records if "ray_kwargs" in r.getMessage()] == [
        "config: ray_kwargs ignored: verl-hpc runs no Ray: its ranks start under Slurm, torchrun, mpirun or the "
        "local spawner (verl.launcher)"]


def test_v1_trainer_modes_pick_their_trainer_and_check_their_placement(data_args, no_ranks, capsys):
    from verl.trainer.ppo.trainer import PPOTrainer
    from verl.trainer.v1 import trainer_class
    from verl.trainer.v1.colocate_async import ColocateAsyncTrainer

    config = load_config(GRPO, [*data_args, "trainer.use_v1=true", "trainer.v1.trainer_mode=sync"])
    assert trainer_class(config) is PPOTrainer
    config = load_config(GRPO, [*data_args, "trainer.v1.trainer_mode=colocate_async"])
    assert trainer_class(config) is ColocateAsyncTrainer
    expect_exit_2(capsys, ["--config", GRPO, *data_args, "trainer.v1.trainer_mode=separate_async"],
                  "trainer.v1.trainer_mode=separate_async: expected a standalone rollout pool")
    # separate_async scores each mini-batch as it arrives: the log-prob micro-batches divide a mini-batch's rows.
    pool = ["trainer.v1.trainer_mode=separate_async", "actor_rollout_ref.rollout.nnodes=1",
            "actor_rollout_ref.rollout.n_gpus_per_node=1"]
    assert trainer_class(load_config(GRPO, [*data_args, *pool]))
    # As verl: a log-prob micro-batch (128) larger than a mini-batch's 64 rows is one micro-batch.
    assert trainer_class(load_config(GRPO, [*data_args, *pool, "actor_rollout_ref.actor.ppo_mini_batch_size=8",
                                            "data.train_batch_size=16"]))
    expect_exit_2(capsys, ["--config", GRPO, *data_args, "trainer.v1.trainer_mode=async"],
                  "trainer.v1.trainer_mode: expected one of ['sync', 'colocate_async', 'separate_async']")
    # verl's legacy trainer (use_v1=false) never reads the mode: the synchronous loop.
    config = load_config(GRPO, [*data_args, "trainer.use_v1=false", "trainer.v1.trainer_mode=colocate_async"])
    assert trainer_class(config) is PPOTrainer
    # wait bounds staleness only while the buffer is shallower than the threshold (warm-up batches + 1 deep).
    wait = ["trainer.v1.trainer_mode=colocate_async", "trainer.v1.sampler.max_off_policy_strategy=wait",
            "trainer.v1.sampler.max_off_policy_threshold=2"]
    assert trainer_class(load_config(GRPO, [*data_args, *wait, "trainer.v1.colocate_async.num_warmup_batches=1"]))
    expect_exit_2(capsys, ["--config", GRPO, *data_args, *wait, "trainer.v1.colocate_async.num_warmup_batches=2"],
                  "trainer.v1.colocate_async.num_warmup_batches=2: expected < trainer.v1.sampler."
                  "max_off_policy_threshold (2) with max_off_policy_strategy=wait")
    assert not no_ranks


def test_verl_0_9_critic_sections_land_on_this_configs_keys(data_args, tmp_path):
    """verl 0.9 names the critic's FSDP section `critic.fsdp`; its model keys default to the actor's."""
    config = load_config(GRPO, [*data_args, "model_engine=dp", "algorithm.adv_estimator=gae",
                                "actor_rollout_ref.model.use_remove_padding=True",
                                "critic.fsdp.param_offload=True", "critic.model.enable_gradient_checkpointing=True"],
                         resolve_only=True)
    assert config.critic.fsdp_config.param_offload is True and "fsdp" not in config.critic
    assert config.critic.model.enable_gradient_checkpointing is True
    assert config.critic.model.use_remove_padding is True  # the actor's
    with pytest.raises(ConfigError, match=r"critic.fsdp_config.forward_prefetc: unknown key.*written critic.fsdp"):
        load_config(GRPO, [*data_args, "critic.fsdp.forward_prefetc=True"], resolve_only=True)
    path = tmp_path / "both.yaml"
    path.write_text("critic:\n  fsdp:\n    param_offload: true\n  fsdp_config:\n    param_offload: false\n")
    with pytest.raises(ConfigError, match="critic.fsdp_config.param_offload: expected it once"):
        load_config(str(path), data_args, resolve_only=True)


@pytest.mark.parametrize("strategy", ["fsdp", "megatron"])
def test_the_critic_engine_reads_the_critic_model_keys(data_args, monkeypatch, strategy):
    """critic.model.enable_gradient_checkpointing / use_remove_padding reach the critic's engine (verl's keys)."""
    from verl.engine.fsdp import engine as fsdp_engine
    from verl.engine.megatron import engine as megatron_engine
    from verl.workers import critic_worker
    from verl.workers.config import CriticConfig

    seen = {}

    class Built(Exception):
        pass

    def capture(name):
        def build(*args, **kwargs):
            seen[name] = args
            raise Built

        return build

    monkeypatch.setattr(fsdp_engine, "fsdp_engine", capture("fsdp"))
    monkeypatch.setattr(megatron_engine, "engine_options", capture("megatron"))
    monkeypatch.setattr(megatron_engine, "ensure_megatron", lambda *args: None)
    config = load_config(PPO, [*data_args, f"model_engine={'dp' if strategy == 'fsdp' else 'megatron'}",
                               "critic.model.enable_gradient_checkpointing=True"])
    with pytest.raises(Built):
        critic_worker.CriticWorker(CriticConfig.from_tree(config.critic, "critic"), rollout_n=1, seed=1)
    model = seen["fsdp"][4] if strategy == "fsdp" else seen["megatron"][1]
    assert model.enable_gradient_checkpointing is True and model.use_remove_padding is False


MOE = os.path.join(REPO, "configs", "grpo_qwen3moe_tiny.yaml")
ARR = "actor_rollout_ref"


def test_the_moe_config_validates_and_bad_expert_layouts_are_one_line(data_args, no_ranks, capsys):
    assert main_ppo.main(["--config", MOE, *data_args]) == 0
    assert main_ppo.main(["--config", MOE, *data_args, f"{ARR}.actor.router_replay.mode=R3",
                          f"{ARR}.rollout.enable_rollout_routing_replay=true"]) == 0
    expect_exit_2(capsys, ["--config", MOE, *data_args, f"{ARR}.actor.megatron.expert_model_parallel_size=3"],
                  "ep=3: expected a divisor of num_experts=8")
    expect_exit_2(capsys, ["--config", MOE, *data_args, f"{ARR}.actor.megatron.expert_model_parallel_size=4"],
                  "ep*etp=4: expected a divisor of the 2 ranks of a pipeline stage")
    expect_exit_2(capsys, ["--config", MOE, *data_args, f"{ARR}.actor.megatron.tensor_model_parallel_size=2",
                           f"{ARR}.actor.megatron.expert_model_parallel_size=1"],
                  "sequence_parallel: expected true for the MoE model")
    expect_exit_2(capsys, ["--config", MOE, *data_args, f"{ARR}.actor.strategy=fsdp"],
                  "actor.strategy: expected megatron for the MoE model qwen3_moe")
    expect_exit_2(capsys, ["--config", GRPO, *data_args, f"{ARR}.actor.megatron.tensor_model_parallel_size=1",
                           f"{ARR}.actor.megatron.expert_model_parallel_size=2"],
                  "expected ep=1 and etp=tp for a dense qwen2 model")


@pytest.mark.parametrize("overrides,fragment", [
    ([f"{ARR}.actor.router_replay.mode=R3"], "enable_rollout_routing_replay: expected true with"),
    ([f"{ARR}.actor.router_replay.mode=R2"], "R2 (replaying the actor's own old-log-prob routing) is not implemented"),
    ([f"{ARR}.actor.router_replay.record_file=/tmp/x"], "router_replay.record_file: expected null"),
    ([f"{ARR}.rollout.enable_rollout_routing_replay=true", "trainer.use_v1=true",
      "trainer.v1.trainer_mode=colocate_async"], "expected a colocated synchronous run"),
    ([f"{ARR}.rollout.enable_rollout_routing_replay=true", f"{ARR}.actor.router_replay.mode=R3",
      f"{ARR}.actor.megatron.pipeline_model_parallel_size=2", f"{ARR}.actor.megatron.expert_model_parallel_size=1",
      f"{ARR}.model.enable_gradient_checkpointing=true"],
     "with activation recompute and pipeline_model_parallel_size=2"),
])
def test_routing_replay_misconfigurations_are_one_line(data_args, no_ranks, capsys, overrides, fragment):
    expect_exit_2(capsys, ["--config", MOE, *data_args, *overrides], fragment)


def test_routing_replay_needs_an_moe_model(data_args, no_ranks, capsys):
    expect_exit_2(capsys, ["--config", GRPO, *data_args, f"{ARR}.rollout.enable_rollout_routing_replay=true"],
                  "expected false for the dense model qwen2")


def test_the_qwen3_30b_a3b_gpu_config_validates_and_its_memory_estimate_follows_the_layout(data_args):
    """configs/grpo_qwen3moe_30b_a3b_gpu.yaml (Qwen3-30B-A3B's shape, 2 x 8 GPUs, TP2 PP2 EP8 ETP1) passes every
    config check on CPU; the dry run's estimate counts a rank's share: 30.5B parameters in all, of which the
    fullest rank (the first stage, with the embedding) holds its 24 layers' dense parts over TP 2 and 16 of
    their 128 experts whole."""
    from verl.models.config import ModelConfig
    from verl.models.memory import estimate_rank_memory
    from verl.models.spec.registry import model_spec
    from verl.trainer.main_ppo import actor_memory_estimate

    config = load_config(os.path.join(REPO, "configs", "grpo_qwen3moe_30b_a3b_gpu.yaml"), data_args)
    mega = config.actor_rollout_ref.actor.megatron
    assert (mega.expert_model_parallel_size, mega.expert_tensor_parallel_size, mega.sequence_parallel) == (8, 1, True)
    model = ModelConfig.from_pretrained(os.path.join(REPO, config.actor_rollout_ref.model.path))
    total = sum(a * (b if len(s) > 1 else 1) for s in model_spec("qwen3_moe").hf_shapes(model).values()
                for a, b in [(s[0], s[-1])])
    assert 30.4e9 < total < 30.6e9
    estimate = estimate_rank_memory(model, tp=2, pp=2, dp=4, ep=8, etp=1, rollout_tp=4)
    h, e = model.hidden_size, model.moe_intermediate_size
    assert estimate.expert_params == 24 * 16 * 3 * h * e
    assert estimate.weights_bytes == 2 * estimate.params and estimate.grad_bytes == 4 * estimate.params
    line = actor_memory_estimate(config)
    assert line.startswith("estimated memory per rank: 2.20B training params (1.81B in experts)"), line
    assert "tp=2 pp=2 ep=8" in line


def test_micro_batch_sizes_follow_verls_rules(data_args, no_ranks, capsys):
    """verl splits a forward pass's rows into micro-batches of the given size (the last one shorter, one micro-batch
    when the size is at least the rows): grpo_arith_tiny's log-prob micro-batches of 128 over 8 x 8 = 64 rows are
    taken. What verl refuses (a mini-batch larger than the batch, a training micro-batch that does not divide the
    mini-batch) stays refused, and what it takes but would break here says why."""
    small = ["data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=8"]
    config = load_config(GRPO, [*data_args, *small])
    assert config.actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu == 128
    assert load_config(GRPO, [*data_args, *small, "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=48",
                              "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=100"])
    expect_exit_2(capsys, ["--config", GRPO, *data_args, "data.train_batch_size=8"],
                  "actor_rollout_ref.actor.ppo_mini_batch_size=32: expected at most data.train_batch_size=8",
                  "as verl")
    expect_exit_2(capsys, ["--config", GRPO, *data_args, "data.train_batch_size=48"],
                  "ppo_mini_batch_size=32: expected a divisor of data.train_batch_size=48", "shorter last mini-batch")
    # Pipeline stages exchange one micro-batch shape: a shorter last micro-batch is refused, a larger one taken.
    pipeline = ["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1",
                "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2"]
    assert load_config(GRPO, [*data_args, *small, *pipeline])
    expect_exit_2(capsys, ["--config", GRPO, *data_args, *small, *pipeline,
                           "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=48"],
                  "log_prob_micro_batch_size_per_gpu=48: expected a divisor of data.train_batch_size * rollout.n / "
                  "dp=64 or at least it", "pipeline stages exchange activations of one micro-batch shape")
    assert not no_ranks


def test_split_micro_batches_is_verls_split():
    import torch

    from verl.engine.micro_batches import split_micro_batches

    batch = {"input_ids": torch.arange(10).reshape(5, 2), "attention_mask": torch.ones(5, 2)}
    assert [mb["input_ids"].shape[0] for mb in split_micro_batches(batch, 2)] == [2, 2, 1]
    assert [mb["input_ids"].shape[0] for mb in split_micro_batches(batch, 128)] == [5]
    with pytest.raises(ValueError, match="micro_batch_size: expected >= 1, found 0"):
        split_micro_batches(batch, 0)


def test_sft_micro_batch_at_least_the_ranks_batch_is_one_micro_batch(data_args):
    from verl.trainer.main_sft import load_sft_config

    sft = os.path.join(REPO, "configs", "sft_arith_tiny.yaml")
    paths = [a for a in data_args if not a.startswith("data.tokenizer")]
    tokenizer = [f"model.tokenizer_path={a.split('=', 1)[1]}" for a in data_args if a.startswith("data.tokenizer")]
    cfg = load_sft_config(sft, [*paths, *tokenizer, "data.train_batch_size=64", "data.micro_batch_size_per_gpu=128"])
    assert cfg["data"]["micro_batch_size_per_gpu"] == 128
    with pytest.raises(ConfigError, match="micro_batch_size_per_gpu=48: expected a divisor of data.train_batch_size "
                                          "/ dp = 64 / 1 or at least 64 .*equal micro-batches' losses"):
        load_sft_config(sft, [*paths, *tokenizer, "data.train_batch_size=64", "data.micro_batch_size_per_gpu=48"])


def test_rollout_stop_token_ids_end_training_and_validation_samples_and_are_checked_against_the_vocabulary(
        data_args, no_ranks, capsys):
    """actor_rollout_ref.rollout.stop_token_ids (vLLM's and SGLang's sampling key; a base model's few-shot task stops
    at the blank line that ends each worked answer): both samplings stop on them and on eos."""
    from types import SimpleNamespace

    from verl.workers.actor_rollout_ref_worker import ActorRolloutRefWorker

    cfg = load_config(GRPO, [*data_args, "actor_rollout_ref.rollout.stop_token_ids=[5,3]"])
    worker = SimpleNamespace(eos_token_id=2)
    ActorRolloutRefWorker._build_sampling(worker, cfg.actor_rollout_ref, 8)
    assert worker.train_sampling.stop_ids == (2, 3, 5) and worker.val_sampling.stop_ids == (2, 3, 5)
    ActorRolloutRefWorker._build_sampling(worker, load_config(GRPO, data_args).actor_rollout_ref, 8)
    assert worker.train_sampling.stop_ids == (2,)  # null: eos only, as before
    for bad in ("[32]", "[-1]", "[x]"):
        expect_exit_2(capsys, ["--config", GRPO, *data_args, f"actor_rollout_ref.rollout.stop_token_ids={bad}"],
                      "actor_rollout_ref.rollout.stop_token_ids", "[0, 32)")
    expect_exit_2(capsys, ["--config", GRPO, *data_args, "actor_rollout_ref.rollout.stop_token_ids=7"],
                  "actor_rollout_ref.rollout.stop_token_ids", "expected list or null")
