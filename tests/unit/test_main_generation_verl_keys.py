"""verl's generation job (``python -m verl.trainer.main_generation data.path=... model.path=... rollout.*``),
``verl generate --prompt TEXT [--chat]`` and the eos set (tokenizer, config.json, generation_config.json).

One tiny random chat checkpoint (ChatML template, char tokenizer, ``<|im_end|>`` eos) serves every case; the
job runs in this process on one rank with the native engine; transformers' greedy generate is the oracle."""

import json
import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers.chat_models import IM_END, hf_chat_greedy, save_chat_model

from verl.models.hf_io import eos_token_ids
from verl.trainer import generate_text, generation_job

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ROWS = [
    {"data_source": "arithmetic", "prompt": [{"role": "user", "content": "12+30="}],
     "reward_model": {"ground_truth": "42"}, "extra_info": {"index": 0}},
    {"data_source": "arithmetic", "prompt": [{"role": "system", "content": "Be brief."},
                                             {"role": "user", "content": "Name a colour."}],
     "reward_model": {"ground_truth": "1"}, "extra_info": {"index": 1}},
]
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    return save_chat_model(str(tmp_path_factory.mktemp("chat") / "model"))


@pytest.fixture(scope="module")
def plain_model(tmp_path_factory):
    """The same weights, a tokenizer without a chat template."""
    return save_chat_model(str(tmp_path_factory.mktemp("plain") / "model"), chat_template=None)


def _parquet(path, rows=ROWS):
    pq.write_table(pa.Table.from_pylist(rows), str(path))
    return str(path)


def _job_args(model, data, out, *extra):
    return [f"data.path={data}", "data.prompt_key=prompt", "data.n_samples=1", f"data.output_path={out}",
            "data.batch_size=8", f"model.path={model}", "rollout.name=native", "rollout.temperature=0",
            f"rollout.response_length={NEW_TOKENS}", "rollout.dtype=float32", "trainer.nnodes=1",
            "trainer.n_gpus_per_node=1", *extra]


def _hf_greedy(model_dir, messages):
    return hf_chat_greedy(model_dir, messages, NEW_TOKENS)


# ----------------------------------------------------------------------------- the stop-id set
def test_eos_ids_are_the_union_of_generation_config_config_and_tokenizer(chat_model, tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (model / name).write_bytes(open(os.path.join(chat_model, name), "rb").read())
    config = json.loads((model / "config.json").read_text())
    config["eos_token_id"] = 7
    (model / "config.json").write_text(json.dumps(config))
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [9, 7]}))
    # Read from the files, and from a loaded tokenizer: the same set, <|im_end|> from the tokenizer.
    assert eos_token_ids(str(model)) == (9, 7, IM_END)

    class Tok:
        eos_token_id = 3

    assert eos_token_ids(str(model), Tok()) == (9, 7, 3)
    (model / "generation_config.json").unlink()
    assert eos_token_ids(str(model / "config.json")) == (7,)  # a bare config.json: only what it says


# ----------------------------------------------------------------------------- the job, one rank
def test_job_writes_the_table_plus_responses_equal_to_transformers_greedy(chat_model, tmp_path):
    data = _parquet(tmp_path / "in.parquet")
    out = tmp_path / "sub" / "out.parquet"  # a missing directory is created, as verl's job does
    assert generation_job.main(_job_args(chat_model, data, out)) == 0
    table = pq.read_table(str(out))
    assert table.column_names == ["data_source", "prompt", "reward_model", "extra_info", "responses"]
    rows = table.to_pylist()
    for row, source in zip(rows, ROWS, strict=True):
        assert {k: row[k] for k in source} == source  # the input columns unchanged
        assert row["responses"] == [_hf_greedy(chat_model, source["prompt"])]
    assert not [f for f in os.listdir(out.parent) if f != "out.parquet"]  # no temporary left


def test_job_samples_n_per_prompt_and_takes_plain_string_prompts(chat_model, tmp_path):
    rows = [{**ROWS[0], "prompt": "12+30="}, {**ROWS[1], "prompt": "a plain text prompt"}]  # one type per column
    data = _parquet(tmp_path / "in.parquet", rows)
    out = tmp_path / "out.parquet"
    args = _job_args(chat_model, data, out, "data.n_samples=3", "rollout.temperature=1.0", "rollout.top_p=1.0",
                     "rollout.top_k=-1", "rollout.seed=5", "data.batch_size=1")
    assert generation_job.main(args) == 0
    responses = pq.read_table(str(out)).column("responses").to_pylist()
    assert [len(r) for r in responses] == [3, 3]
    assert all(isinstance(t, str) for r in responses for t in r)
    # The same seed gives the same samples (each batch its own stream).
    again = tmp_path / "again.parquet"
    assert generation_job.main(args[:3] + [f"data.output_path={again}"] + args[4:]) == 0
    assert pq.read_table(str(again)).column("responses").to_pylist() == responses


@pytest.mark.parametrize("case", ["no_prompt_column", "n_samples_0", "output_not_writable", "chat_without_template",
                                  "greedy_n_samples_2", "trtllm"])
def test_job_bad_input_is_one_line_exit_2_and_nothing_written(case, chat_model, plain_model, tmp_path, capsys):
    data = _parquet(tmp_path / "in.parquet")
    out = tmp_path / "out" / "out.parquet"
    model, extra = chat_model, []
    if case == "no_prompt_column":
        extra = ["data.prompt_key=question"]
    elif case == "n_samples_0":
        extra = ["data.n_samples=0"]
    elif case == "output_not_writable":
        blocker = tmp_path / "a_file"
        blocker.write_text("")
        out = blocker / "out.parquet"  # its directory is a file: not writable, even as root
    elif case == "chat_without_template":
        model = plain_model
    elif case == "greedy_n_samples_2":
        extra = ["data.n_samples=2"]
    elif case == "trtllm":
        extra = ["rollout.name=trtllm"]
    before = sorted(os.listdir(tmp_path))
    assert generation_job.main(_job_args(model, data, out, *extra)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("main_generation: error:"), err
    expected = {"no_prompt_column": "'question'", "n_samples_0": "data.n_samples",
                "output_not_writable": "data.output_path", "chat_without_template": "chat_template",
                "greedy_n_samples_2": "data.n_samples", "trtllm": "rollout.name"}[case]
    assert expected in err[0]
    assert sorted(os.listdir(tmp_path)) == before and not out.exists()


def test_hydra_keys_are_routed_to_the_job_and_options_to_verl_generate():
    assert generation_job.is_job_argv(["data.path=x", "model.path=y"])
    assert generation_job.is_job_argv(["+rollout.foo=1"])
    assert not generation_job.is_job_argv(["--model", "m", "--input-ids", "1,2"])
    assert not generation_job.is_job_argv([])
    assert generation_job.replica_rows(5, 2, 0) == range(0, 3)
    assert generation_job.replica_rows(5, 2, 1) == range(3, 5)
    assert [len(generation_job.replica_rows(2, 3, r)) for r in range(3)] == [1, 1, 0]


def test_python_m_main_generation_runs_the_job(chat_model, tmp_path):
    """verl's exact entry point: ``python -m verl.trainer.main_generation`` with its Hydra keys."""
    data = _parquet(tmp_path / "in.parquet", ROWS[:1])
    out = tmp_path / "out.parquet"
    proc = subprocess.run([sys.executable, "-m", "verl.trainer.main_generation",
                           *_job_args(chat_model, data, out)], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert pq.read_table(str(out)).column("responses").to_pylist() == [[_hf_greedy(chat_model, ROWS[0]["prompt"])]]


# ----------------------------------------------------------------------------- verl generate --prompt
def test_generate_prompt_chat_prints_text_and_stops_at_config_json_eos(chat_model, tmp_path, capsys):
    base = ["--model", chat_model, "--temperature", "0", "--max-new-tokens", str(NEW_TOKENS), "--dtype", "float32"]
    out = tmp_path / "g.json"
    assert generate_text.main([*base, "--prompt", "12+30=", "--chat", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["text"] == [_hf_greedy(chat_model, ROWS[0]["prompt"])]
    ids = result["output_ids"][0]
    assert generate_text.main([*base, "--prompt", "12+30=", "--chat"]) == 0
    assert capsys.readouterr().out.strip() == result["text"][0].strip()

    # A stop id only config.json names (generation_config.json names another): the response ends there.
    k = next(i for i in range(1, len(ids)) if ids[i] not in ids[:i])
    assert k < len(ids) - 1  # so stopping there is visible
    model = tmp_path / "model"
    model.mkdir()
    for name in os.listdir(chat_model):
        (model / name).write_bytes(open(os.path.join(chat_model, name), "rb").read())
    config = json.loads((model / "config.json").read_text())
    config["eos_token_id"] = ids[k]
    (model / "config.json").write_text(json.dumps(config))
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": IM_END}))
    assert generate_text.main(["--model", str(model), *base[2:], "--prompt", "12+30=", "--chat",
                               "--json", str(out)]) == 0
    assert json.loads(out.read_text())["output_ids"] == [ids[:k + 1]]


def test_generate_prompt_without_chat_uses_the_text_as_is(chat_model, tmp_path):
    from transformers import AutoTokenizer

    out = tmp_path / "g.json"
    assert generate_text.main(["--model", chat_model, "--temperature", "0", "--max-new-tokens", "3",
                               "--prompt", "12+30=", "--prompt", "7", "--json", str(out)]) == 0
    tok = AutoTokenizer.from_pretrained(chat_model)
    by_ids = tmp_path / "ids.json"
    assert generate_text.main(["--model", chat_model, "--temperature", "0", "--max-new-tokens", "3",
                               "--input-ids", ",".join(map(str, tok("12+30=")["input_ids"])),
                               "--input-ids", ",".join(map(str, tok("7")["input_ids"])), "--json", str(by_ids)]) == 0
    result = json.loads(out.read_text())
    assert result["output_ids"] == json.loads(by_ids.read_text())["output_ids"]
    assert len(result["text"]) == 2


@pytest.mark.parametrize("case", ["chat_without_template", "chat_without_prompt", "prompt_and_ids"])
def test_generate_prompt_bad_input_is_one_line_exit_2(case, chat_model, plain_model, tmp_path, capsys):
    out = tmp_path / "g.json"
    argv = {"chat_without_template": ["--model", plain_model, "--prompt", "hi", "--chat"],
            "chat_without_prompt": ["--model", chat_model, "--input-ids", "5,6", "--chat"],
            "prompt_and_ids": ["--model", chat_model, "--prompt", "hi", "--input-ids", "5,6"]}[case]
    assert generate_text.main([*argv, "--json", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("verl generate: error:"), err
    assert not out.exists()


def test_verl_generate_samples_as_the_models_generation_config_says_unless_flags_say_otherwise(tmp_path):
    """transformers' generate is greedy unless generation_config.json sets do_sample; verl generate follows it
    (a real checkpoint run with no flag answered with a temperature-1 sample before)."""
    import argparse

    from verl.trainer.main_generation import sampling_defaults

    def defaults(config, **flags):
        (tmp_path / "generation_config.json").write_text(json.dumps(config))
        (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
        args = argparse.Namespace(model=str(tmp_path), temperature=None, top_p=None, top_k=None)
        return sampling_defaults(argparse.Namespace(**{**vars(args), **flags}))

    args = argparse.Namespace(model=str(tmp_path), temperature=None, top_p=None, top_k=None)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert sampling_defaults(args) == (0.0, 1.0, -1)
    assert "greedy" in args.sampling_note  # said on stderr once the rest of the input is checked
    assert defaults({"do_sample": True, "temperature": 0.6, "top_p": 0.9}) == (0.6, 0.9, 50)  # transformers' top_k
    assert defaults({"do_sample": True, "top_k": 0}) == (1.0, 1.0, -1)
    assert defaults({"do_sample": True, "temperature": 0.6}, temperature=0.0, top_k=5) == (0.0, 1.0, 5)
