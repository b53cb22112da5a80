"""A careless user's sweep: bad configs, overrides, datasets, model dirs, checkpoints and arguments
for every `verl` subcommand. Each must end with exit code 2, exactly one line on stderr that says
what was expected and what was found, no traceback anywhere, and nothing half-written; valid inputs
written the way verl users write them (``lr=1e-4``) are accepted.

The commands run in this process (``verl.cli.main``) so that the sweep costs one import of torch,
not one per case; every case fails before any rank or heavy work starts.
"""

from __future__ import annotations

import copy
import json
import os
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from verl.cli import main as verl_main
from verl.utils.engine_env import sglang_importable

pytestmark = pytest.mark.unit

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GRPO = os.path.join(REPO, "configs", "grpo_arith_tiny.yaml")
SFT = os.path.join(REPO, "configs", "sft_arith_tiny.yaml")


# --------------------------------------------------------------------------- fixtures: one good world, broken copies
@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad_inputs")
    data = root / "arith"
    assert verl_main(["data", "arithmetic", "--out", str(data), "--num-train", "200", "--num-test", "16"]) == 0
    rows = pq.read_table(data / "train.parquet").to_pylist()
    bad = root / "bad"
    bad.mkdir()

    def write(name, new_rows, schema=None):
        table = pa.Table.from_pylist(new_rows, schema=schema)
        pq.write_table(table, bad / f"{name}.parquet")

    def edited(fn):
        new = copy.deepcopy(rows)
        fn(new)
        return new

    write("null_prompt", edited(lambda r: r[5].update(prompt=None)))
    write("int_prompt", edited(lambda r: [x.update(prompt=7) for x in r]))
    write("empty_messages", edited(lambda r: [x.update(prompt=[]) for x in r]))
    write("long_row_133", edited(lambda r: r[133]["prompt"][0].update(content="1+1=" * 50)))
    write("huge_row", edited(lambda r: r[3]["prompt"][0].update(content="9" * (8 << 20))))
    write("null_ground_truth", edited(lambda r: r[2]["reward_model"].update(ground_truth=None)))
    write("null_data_source", edited(lambda r: r[9].update(data_source=None)))
    write("few_rows", copy.deepcopy(rows[:10]))
    write("zero_rows", [], schema=pq.read_table(data / "train.parquet").schema)
    write("no_prompt_column", edited(lambda r: [x.pop("prompt") for x in r]))
    (bad / "empty.parquet").write_bytes(b"")
    (bad / "csv.parquet").write_text("a,b\n1,2\n")
    raw = (data / "train.parquet").read_bytes()
    (bad / "cut.parquet").write_bytes(raw[: len(raw) // 2])

    # An HF model directory, a cut copy and a garbled-config copy.
    from helpers.tiny_models import save_tiny_model

    model = save_tiny_model("qwen2", str(root / "model"))
    for name in os.listdir(data / "tokenizer"):  # eval/generate read the tokenizer from the model dir
        shutil.copy(data / "tokenizer" / name, model)
    cut_model = root / "cut_model"
    shutil.copytree(model, cut_model)
    weights = cut_model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    garbled_model = root / "garbled_model"
    shutil.copytree(model, garbled_model)
    (garbled_model / "config.json").write_text("{not json")

    # A trainer checkpoint whose manifest names a file that was cut afterwards.
    ckpt = root / "ckpt" / "global_step_2"
    (ckpt / "actor").mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text(json.dumps({"step": 2}))
    (ckpt / "actor" / "shard.distcp").write_bytes(b"x" * 100)
    from verl.utils.checkpoint import write_manifest

    write_manifest(str(ckpt))
    (ckpt / "actor" / "shard.distcp").write_bytes(b"x" * 10)

    # A complete checkpoint of a Megatron actor (its manifest names no strategy, as Megatron's never did).
    mega_ckpt = root / "mega_ckpt" / "global_step_1"
    (mega_ckpt / "actor").mkdir(parents=True)
    (mega_ckpt / "trainer_state.json").write_text(json.dumps({"step": 1}))
    (mega_ckpt / "actor" / "verl_checkpoint.json").write_text(json.dumps({"iteration": 1, "head": "lm", "files": []}))
    write_manifest(str(mega_ckpt))

    # Metrics files and YAML files of every wrong kind.
    (root / "metrics_bad_middle.jsonl").write_text('{"step": 1}\n{"step": 2,\n{"step": 3}\n')
    (root / "not_utf8.yaml").write_bytes(b"data:\n  tokenizer: \xff\xfe\n")
    (root / "bad_yaml.yaml").write_text("data: [unclosed\n")
    (root / "list.yaml").write_text("- a\n- b\n")
    (root / "gsm8k_bad.jsonl").write_text('{"question": "q"}\nnot json\n')
    (root / "a_file").write_text("x")
    return {"root": root, "data": data, "bad": bad, "model": model, "cut_model": cut_model,
            "garbled_model": garbled_model, "ckpt": ckpt, "mega_ckpt": mega_ckpt}


def _train(w, *extra):
    return ["train", "--config", GRPO, f"data.train_files={w['data'] / 'train.parquet'}",
            f"data.val_files={w['data'] / 'test.parquet'}", f"data.tokenizer={w['data'] / 'tokenizer'}",
            f"trainer.output_dir={w['root'] / 'train_out'}", *extra]


def _sft(w, *extra):
    return ["sft", "--config", SFT, f"data.train_files={w['data'] / 'train.parquet'}",
            f"data.val_files={w['data'] / 'test.parquet'}", f"model.tokenizer_path={w['data'] / 'tokenizer'}",
            f"trainer.output_dir={w['root'] / 'sft_out'}", "data.train_batch_size=100",
            "data.micro_batch_size_per_gpu=50", *extra]


def _bad_train(name):
    """verl train on one of the broken copies of the train file."""
    return lambda w: _train(w, f"data.train_files={w['bad'] / (name + '.parquet')}")


# (case id, argv builder, text the one line must contain)
CASES = [
    # --- verl train: overrides
    ("lr negative", lambda w: _train(w, "actor_rollout_ref.actor.optim.lr=-1"), "expected a value >= 0, found -1"),
    ("weight_decay negative", lambda w: _train(w, "actor_rollout_ref.actor.optim.weight_decay=-1"), ">= 0"),
    ("critic lr negative", lambda w: _train(w, "critic.optim.lr=-0.5"), "critic.optim.lr"),
    ("clip_grad negative", lambda w: _train(w, "actor_rollout_ref.actor.optim.clip_grad=-1"), "clip_grad"),
    ("temperature negative", lambda w: _train(w, "actor_rollout_ref.rollout.temperature=-1"), "temperature"),
    ("top_p above one", lambda w: _train(w, "actor_rollout_ref.rollout.top_p=5"), "> 0 and <= 1, found 5"),
    ("top_k below -1", lambda w: _train(w, "actor_rollout_ref.rollout.top_k=-2"), "top_k"),
    ("val_batch_size negative", lambda w: _train(w, "data.val_batch_size=-5"), "data.val_batch_size"),
    ("bucket_bytes tiny", lambda w: _train(w, "hybrid_engine.bucket_bytes=1"), "expected a value >= 4096"),
    ("clip_ratio_low negative", lambda w: _train(w, "actor_rollout_ref.actor.clip_ratio_low=-5"), "clip_ratio_low"),
    ("clip_ratio_c below one", lambda w: _train(w, "actor_rollout_ref.actor.clip_ratio_c=0.5"), "> 1"),
    ("kl_loss_coef negative", lambda w: _train(w, "actor_rollout_ref.actor.kl_loss_coef=-10"), "kl_loss_coef"),
    ("gamma above one", lambda w: _train(w, "algorithm.gamma=2"), "algorithm.gamma"),
    ("rollout n zero", lambda w: _train(w, "actor_rollout_ref.rollout.n=0"), "rollout.n"),
    ("train_batch_size zero", lambda w: _train(w, "data.train_batch_size=0"), "data.train_batch_size"),
    ("resume_mode typo", lambda w: _train(w, "trainer.resume_mode=autoo"), "found 'autoo'"),
    ("strategy typo", lambda w: _train(w, "actor_rollout_ref.actor.strategy=fdsp"), "found 'fdsp'"),
    ("fsdp actor, megatron critic", lambda w: _train(w, "actor_rollout_ref.actor.strategy=fsdp",
                                                     "algorithm.adv_estimator=gae", "critic.strategy=megatron"),
     "critic.strategy: expected the actor's backend"),
    ("fsdp_size not dividing", lambda w: _train(w, "actor_rollout_ref.actor.strategy=fsdp",
                                                "actor_rollout_ref.actor.fsdp_config.fsdp_size=3",
                                                "trainer.n_gpus_per_node=4"), "fsdp_size=3: expected a divisor"),
    ("fsdp resumes a megatron checkpoint", lambda w: _train(w, "actor_rollout_ref.actor.strategy=fsdp",
                                                            f"trainer.resume_mode={w['mega_ckpt']}"),
     "found a megatron checkpoint"),
    ("fsdp model_dtype typo", lambda w: _train(w, "actor_rollout_ref.actor.strategy=fsdp",
                                               "actor_rollout_ref.actor.fsdp_config.model_dtype=fp33"), "fp33"),
    ("resume_path without path", lambda w: _train(w, "trainer.resume_mode=resume_path"), "resume_from_path"),
    ("unknown key", lambda w: _train(w, "trainer.totl_training_steps=3"), "did you mean"),
    ("bad enum", lambda w: _train(w, "algorithm.adv_estimator=ppo"), "adv_estimator"),
    ("bad truncation", lambda w: _train(w, "data.truncation=mid"), "data.truncation"),
    ("unknown logger", lambda w: _train(w, 'trainer.logger=["console","wandb"]'), "wandb"),
    ("string for int", lambda w: _train(w, "trainer.total_training_steps=abc"), "expected int"),
    ("fractional int", lambda w: _train(w, "trainer.total_training_steps=1.5"), "expected int"),
    ("override without =", lambda w: _train(w, "trainer.seed"), "expected key=value"),
    ("unknown flag", lambda w: _train(w, "--bogus-flag"), "unrecognized arguments"),
    ("log_dir is a file", lambda w: _train(w, f"--log_dir={w['root'] / 'a_file'}"), "--log_dir"),
    ("model path missing", lambda w: _train(w, "actor_rollout_ref.model.path=/nonexistent/model"),
     "actor_rollout_ref.model.path"),
    # --- verl train: verl 0.9's selectors
    ("model_engine torchtitan", lambda w: _train(w, "model_engine=torchtitan"), "TorchTitan is not part of"),
    ("model_engine fsdp", lambda w: _train(w, "model_engine=fsdp"), "found 'fsdp'"),
    ("model_engine against strategy",
     lambda w: _train(w, "model_engine=dp", "actor_rollout_ref.actor.strategy=megatron"),
     "expected fsdp or fsdp2 with model_engine=dp"),
    ("separate_async without a pool", lambda w: _train(w, "trainer.v1.trainer_mode=separate_async"),
     "expected a standalone rollout pool"),
    ("separate_async batch invariant", lambda w: _train(
        w, "trainer.v1.trainer_mode=separate_async", "actor_rollout_ref.rollout.nnodes=1",
        "actor_rollout_ref.rollout.n_gpus_per_node=1", "trainer.v1.separate_async.parameter_sync_step=3"),
     "parameter_sync_step (3) x"),
    ("colocate_async with a pool", lambda w: _train(
        w, "trainer.v1.trainer_mode=colocate_async", "actor_rollout_ref.rollout.nnodes=1",
        "actor_rollout_ref.rollout.n_gpus_per_node=1"), "use separate_async"),
    ("rollout_is threshold", lambda w: _train(w, "algorithm.rollout_correction.rollout_is=token",
                                              "algorithm.rollout_correction.rollout_is_threshold=abc"),
     "rollout_is_threshold"),
    # --- verl train: config files
    ("config missing", lambda w: ["train", "--config", str(w["root"] / "missing.yaml")], "missing.yaml"),
    ("config not utf-8", lambda w: ["train", "--config", str(w["root"] / "not_utf8.yaml")], "not_utf8.yaml"),
    ("config bad yaml", lambda w: ["train", "--config", str(w["root"] / "bad_yaml.yaml")], "bad_yaml.yaml"),
    ("config a list", lambda w: ["train", "--config", str(w["root"] / "list.yaml")], "expected a mapping"),
    # --- verl train: tokenizer, model dirs, checkpoints
    ("tokenizer dir without tokenizer", lambda w: _train(w, f"data.tokenizer={w['data']}"), "expected a tokenizer"),
    ("tokenizer is a file", lambda w: _train(w, f"data.tokenizer={w['data'] / 'train.parquet'}"),
     "expected a tokenizer directory"),
    ("cut model.safetensors", lambda w: _train(w, f"actor_rollout_ref.model.path={w['cut_model']}"), "cut file"),
    ("garbled model config.json", lambda w: _train(w, f"actor_rollout_ref.model.path={w['garbled_model']}"),
     "config.json"),
    ("incomplete resume checkpoint", lambda w: _train(w, f"trainer.resume_mode={w['ckpt']}"),
     "expected 100 bytes, found 10"),
    ("resume_from_path incomplete", lambda w: _train(w, "trainer.resume_mode=resume_path",
                                                     f"trainer.resume_from_path={w['ckpt']}"), "found 10"),
    # --- verl train: datasets
    ("train_files empty list", lambda w: _train(w, "data.train_files=[]"), "expected at least one parquet file"),
    ("train file missing", lambda w: _train(w, "data.train_files=/nonexistent.parquet"), "expected an existing"),
    ("null prompt", _bad_train("null_prompt"), "row 5: prompt"),
    ("integer prompts", _bad_train("int_prompt"), "found int"),
    ("empty message lists", _bad_train("empty_messages"),
     "found an empty list"),
    ("over-long row 133", _bad_train("long_row_133"),
     "row 133: expected a prompt of <= data.max_prompt_length=8 tokens"),
    ("8 MiB prompt", _bad_train("huge_row"), "characters"),
    ("null ground truth", _bad_train("null_ground_truth"),
     "ground_truth"),
    ("null data_source", _bad_train("null_data_source"),
     "data_source"),
    ("fewer rows than a batch", _bad_train("few_rows"),
     "expected at least 64 rows (one batch), found 10"),
    ("zero rows", _bad_train("zero_rows"), "found 0"),
    ("no prompt column", _bad_train("no_prompt_column"),
     "expected columns ['prompt']"),
    ("empty file", _bad_train("empty"), "expected a parquet"),
    ("csv renamed parquet", _bad_train("csv"),
     "expected a parquet"),
    ("cut parquet", _bad_train("cut"), "expected a parquet"),
    ("bad val file", lambda w: _train(w, f"data.val_files={w['bad'] / 'null_prompt.parquet'}"), "row 5"),
    # --- verl sft
    ("sft clip_grad negative", lambda w: _sft(w, "optim.clip_grad=-1"), "optim.clip_grad"),
    ("sft lr text", lambda w: _sft(w, "optim.lr=abc"), "optim.lr"),
    ("sft integer prompts", lambda w: _sft(w, f"data.train_files={w['bad'] / 'int_prompt.parquet'}"), "prompt"),
    ("sft null prompt", lambda w: _sft(w, f"data.train_files={w['bad'] / 'null_prompt.parquet'}"), "prompt"),
    ("sft missing data", lambda w: _sft(w, "data.train_files=/nonexistent.parquet"), "nonexistent"),
    # --- verl eval / generate / convert
    ("eval cut model", lambda w: ["eval", "--model", str(w["cut_model"]), "--data",
                                  str(w["data"] / "test.parquet")], "cut file"),
    ("eval missing model", lambda w: ["eval", "--model", "/nonexistent", "--data", str(w["data"] / "test.parquet")],
     "/nonexistent"),
    ("eval bad data", lambda w: ["eval", "--model", str(w["model"]), "--data", str(w["bad"] / "csv.parquet")],
     "csv.parquet"),
    ("generate cut model", lambda w: ["generate", "--model", str(w["cut_model"]), "--input-ids", "1,2,3"],
     "cut file"),
    ("generate bad ids", lambda w: ["generate", "--model", str(w["model"]), "--input-ids", "a,b"], "input-ids"),
    ("convert cut model", lambda w: ["convert", "hf-to-mcore", "--hf-dir", str(w["cut_model"]), "--out",
                                     str(w["root"] / "conv_out")], "cut file"),
    ("convert missing ckpt", lambda w: ["convert", "mcore-to-hf", "--ckpt", "/nonexistent", "--out",
                                        str(w["root"] / "conv_out2")], "/nonexistent"),
    ("convert tp zero", lambda w: ["convert", "hf-to-mcore", "--hf-dir", str(w["model"]), "--out",
                                   str(w["root"] / "conv_out3"), "--tp", "0"], "tp"),
    # --- verl plot
    ("plot missing metrics", lambda w: ["plot", str(w["root"] / "nope.jsonl"), "--out", str(w["root"] / "p.png")],
     "nope.jsonl"),
    ("plot corrupt middle line", lambda w: ["plot", str(w["root"] / "metrics_bad_middle.jsonl"), "--out",
                                            str(w["root"] / "p2.png")], "line 2"),
    # --- verl data
    ("data zero problems", lambda w: ["data", "arithmetic", "--out", str(w["root"] / "d1"), "--num-train", "0"],
     "num_train=0"),
    ("data bad ops", lambda w: ["data", "arithmetic", "--out", str(w["root"] / "d2"), "--ops", "*"], "ops"),
    ("data out is a file", lambda w: ["data", "arithmetic", "--out", str(w["root"] / "a_file")], "a_file"),
    ("gsm8k missing input", lambda w: ["data", "gsm8k", "--input", "/nonexistent.jsonl", "--out",
                                       str(w["root"] / "g1")], "nonexistent.jsonl"),
    ("gsm8k malformed input", lambda w: ["data", "gsm8k", "--input", str(w["root"] / "gsm8k_bad.jsonl"), "--out",
                                         str(w["root"] / "g2")], "gsm8k_bad.jsonl"),
    # --- verl bench and the dispatcher
    ("bench kernels zero repeats", lambda w: ["bench", "kernels", "--repeats", "0"], "repeats"),
    ("bench kernels bad sizes", lambda w: ["bench", "kernels", "--sizes-mb", "x"], "sizes-mb"),
    ("bench reshard bad layout", lambda w: ["bench", "reshard", "--model", os.path.join(w["model"], "config.json"),
                                            "--train", "tp=3", "--rollout", "tp=1", "--nproc", "3"], "tp"),
    ("bench rollout missing model", lambda w: ["bench", "rollout", "--model", "/nonexistent.json"], "nonexistent"),
    ("unknown command", lambda w: ["bogus"], "expected a command"),
    ("unknown bench", lambda w: ["bench", "bogus"], "expected one of"),
]


def _run(capfd, argv) -> tuple[int, str, str]:
    try:
        code = verl_main(argv)
    except SystemExit as exit_:  # argparse
        code = exit_.code if isinstance(exit_.code, int) else 2
    out, err = capfd.readouterr()
    return code, out, err


@pytest.mark.parametrize("case, build, needle", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(world, capfd, case, build, needle):
    argv = build(world)
    before = set(os.listdir(world["root"]))
    code, out, err = _run(capfd, argv)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, f"{case}: exit {code}\nstdout: {out[-1500:]}\nstderr: {err[-1500:]}"
    assert "Traceback" not in out + err, f"{case}:\n{out[-1500:]}\n{err[-1500:]}"
    assert len(lines) == 1, f"{case}: expected one line on stderr, found {len(lines)}:\n{err[-1500:]}"
    assert needle in lines[0], f"{case}: {needle!r} not in {lines[0]!r}"
    assert ("expected" in lines[0] or "unrecognized" in lines[0] or "No such file" in lines[0]
            or "Is a directory" in lines[0] or "Not a directory" in lines[0]), lines[0]
    created = set(os.listdir(world["root"])) - before
    assert not created, f"{case}: a failed command wrote {sorted(created)}"


def test_the_sweep_is_wide():
    assert len(CASES) >= 60
    commands = {c[1].__code__.co_consts for c in CASES}
    assert commands  # every subcommand appears below
    names = " ".join(c[0] for c in CASES)
    for word in ("sft", "eval", "generate", "convert", "plot", "data", "bench", "resume", "row 133"):
        assert word in names or any(word in c[2] for c in CASES), word


# --------------------------------------------------------------------------- valid inputs verl users write
def test_numbers_as_verl_users_write_them_are_accepted(world, tmp_path):
    from verl.trainer.config import load_config

    cfg_file = tmp_path / "lr.yaml"
    cfg_file.write_text(open(GRPO, encoding="utf-8").read().replace("lr: 5.0e-4", "lr: 1e-5"))
    args = _train(world)[3:]
    config = load_config(str(cfg_file), args + ["actor_rollout_ref.actor.optim.lr=1e-4", "critic.optim.lr=5e-7",
                                                "trainer.total_training_steps=1e3", "data.seed=1_000"])
    assert config.actor_rollout_ref.actor.optim.lr == 1e-4 and config.critic.optim.lr == 5e-7
    assert config.trainer.total_training_steps == 1000 and isinstance(config.trainer.total_training_steps, int)
    assert config.data.seed == 1000
    assert load_config(str(cfg_file), args).actor_rollout_ref.actor.optim.lr == 1e-5
    assert load_config(GRPO, args + ["trainer.logger=console"]).trainer.logger == ["console"]


HEAD_DIM_32 = os.path.join(os.path.dirname(GRPO), "models", "qwen2_0p7m_arith.json")
MOE = os.path.join(os.path.dirname(GRPO), "models", "qwen3moe_tiny_arith.json")


@pytest.mark.parametrize("extra, needle", [
    ([], "vLLM's CPU attention takes head_dim in"),  # the quickstart's tiny model has head_dim 16
    ([f"actor_rollout_ref.model.path={HEAD_DIM_32}"], "rollout.name=vllm: expected vLLM importable"),
    ([f"actor_rollout_ref.model.path={MOE}", "actor_rollout_ref.actor.megatron.expert_model_parallel_size=2",
      "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1",
      "actor_rollout_ref.rollout.tensor_model_parallel_size=2"], "mixture of experts runs TP 1"),
    ([f"actor_rollout_ref.model.path={MOE}", "actor_rollout_ref.actor.megatron.expert_model_parallel_size=2",
      "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1",
      "actor_rollout_ref.rollout.enable_rollout_routing_replay=true", "actor_rollout_ref.actor.router_replay.mode=R3"],
     "lacks the capability routing_recording"),
])
def test_vllm_rollout_refusals_are_one_line(world, capfd, extra, needle):
    """rollout.name=vllm is a registered engine (issue 55): what it cannot do here is one line and exit 2."""
    from verl.utils.engine_env import importable

    if "importable" in needle and importable("vllm"):
        pytest.skip("vLLM is importable in this Python")
    before = set(os.listdir(world["root"]))
    code, out, err = _run(capfd, _train(world, "actor_rollout_ref.rollout.name=vllm", *extra))
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1, err
    assert needle in lines[0], lines[0]
    if "importable" in needle:  # .venv has no vllm: the preflight names the set-up script
        assert "launch/setup_vllm.sh" in lines[0]
    assert set(os.listdir(world["root"])) == before


@pytest.mark.skipif(sglang_importable(), reason="SGLang is importable in this Python")
def test_sglang_rollout_without_sglang_names_the_setup_command(world, capfd):
    before = set(os.listdir(world["root"]))
    code, out, err = _run(capfd, _train(world, "actor_rollout_ref.rollout.name=sglang"))
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1, err
    assert "rollout.name=sglang: expected SGLang importable" in lines[0] and "launch/setup_sglang.sh" in lines[0]
    assert set(os.listdir(world["root"])) == before
