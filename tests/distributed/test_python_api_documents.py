"""The documents' snippets (the shared SEED_API list, issue 59), each a user's script in a fresh process with no
launcher, written with the documents' names: the minimal DataFlow (a rollout function of the user's that calls
``model.generate`` itself, a reward named ``scores``), any HF model (``HFActor`` from a ``PeftModel``, ``HFCritic``, a
module's ``forward`` as the reward), the pipeline (``DataPipeline`` / ``RLTrainer``), ``HybridActor`` as 001 calls it,
and the PPO trainer stepped by hand from ``configs/grpo_arith_tiny.yaml`` with a smaller batch (verl's micro-batch
rules). A tiny random chat checkpoint (helpers.chat_models) stands for the hub's chat models."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("megatron.core")

from helpers.chat_models import save_chat_model  # noqa: E402
from helpers.real_model import smollm2_dir  # noqa: E402
from helpers.tiny_models import write_arithmetic_data  # noqa: E402
from helpers.train_runs import REPO  # noqa: E402


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    return save_chat_model(str(tmp_path_factory.mktemp("chat") / "model"))


def run_script(tmp_path, body: str, *args: str, strict: bool = False) -> str:
    path = tmp_path / "snippet.py"
    path.write_text(textwrap.dedent(body))
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "OMPI_", "PMIX_")) and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(PYTHONPATH=REPO, OMP_NUM_THREADS="1", VERL_STRICT_DATA_CHECK="1" if strict else "0")
    proc = subprocess.run([sys.executable, str(path), *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, f"exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def result(out: str):
    return json.loads(next(line for line in reversed(out.splitlines()) if line.startswith("RESULT "))[7:])


MINIMAL = """
    import json
    from verl import DataFlow, register, TrainerConfig
    from verl.models import HFActor

    @register
    def rollout(prompts):
        from transformers import AutoModelForCausalLM, AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(MODEL)
        model = AutoModelForCausalLM.from_pretrained(MODEL)
        responses = []
        for prompt in prompts:
            inputs = tokenizer(prompt, return_tensors="pt")
            out = model.generate(**inputs, max_new_tokens=32, do_sample=True, pad_token_id=tokenizer.pad_token_id)
            responses.append(tokenizer.decode(out[0], skip_special_tokens=True))
        return responses

    @register
    def reward(responses):
        return [1.0 if len(r) > 20 else 0.5 for r in responses]

    def main():
        dataflow = DataFlow()
        dataflow.add_node("rollout", rollout, input_keys=["prompts"], output_keys=["responses"])
        dataflow.add_node("reward", reward, input_keys=["responses"], output_keys=["scores"])
        dataflow.add_node("actor", HFActor.from_pretrained(MODEL))   # the model PPO trains
        dataflow.enable_debug(mode="full")
        trainer = dataflow.build_trainer(config=TrainerConfig(num_epochs=1, batch_size=4, learning_rate=1e-6,
                                                              output_dir="run", **EXTRA))
        history = trainer.train(prompts=["Say hello", "Name a color"])
        print("RESULT " + json.dumps([{k: m[k] for k in ("step", "critic/score/mean", "response_length/mean")}
                                      for m in history]))

    if __name__ == "__main__":
        main()
"""


@pytest.mark.parametrize("model", ["tiny_chat", "smollm2"])
def test_000_minimal_dataflow_trains_on_its_own_rollout_function_and_scores(tmp_path, chat, model):
    """On the tiny chat checkpoint, and on SmolLM2-135M-Instruct (the snippet's chat model; rollout.n 2, responses
    cut at 16 tokens and no HF export at the end, to keep it to a few CPU seconds)."""
    if model == "smollm2":
        chat, extra = smollm2_dir(), {"rollout_n": 2, "max_response_length": 16,
                                      "overrides": {"trainer.export_hf_at_end": False}}
    else:
        extra = {}
    # strict data checks on: the fields made of the function's texts pass them at every union and worker return
    out = run_script(tmp_path, f"MODEL = {chat!r}\nEXTRA = {extra!r}\n" + textwrap.dedent(MINIMAL), strict=True)
    steps = result(out)
    n = extra.get("rollout_n", 4)
    assert [s["step"] for s in steps] == [1]
    # Two prompts under batch_size=4: one batch of both, said in one line.
    assert "[dataflow] train(prompts): 2 prompts, fewer than batch_size=4: one batch of 2 per epoch" in out
    # The rollout function ran once on the prompts as written (2 prompts x rollout.n) and its texts were trained.
    calls = [line for line in out.splitlines() if line.startswith("[dataflow] rollout: inputs {'prompts': [")]
    assert len(calls) == 1 and calls[0].count("'Say hello'") == n, out[-3000:]
    line = next(line for line in out.splitlines() if line.startswith("[dataflow] reward: inputs {'responses': ["))
    scores = eval(line[line.index("-> outputs ") + len("-> outputs "):])["scores"]  # noqa: S307 (our own print)
    responses = eval(line[len("[dataflow] reward: inputs "):line.index(" -> outputs ")])["responses"]  # noqa: S307
    assert scores == [1.0 if len(r) > 20 else 0.5 for r in responses] and len(scores) == 2 * n
    # The step's score is the reward node's 'scores'; its responses the function's texts, tokenized (+ eos).
    assert steps[0]["critic/score/mean"] == pytest.approx(sum(scores) / len(scores))
    assert 1 < steps[0]["response_length/mean"] <= extra.get("max_response_length", 32)
    if model == "smollm2":  # a real tokenizer round-trips: model.generate's echo of the prompt is cut off
        assert not any(r.startswith(("Say hello", "Name a color")) for r in responses), responses


HF_MODELS = """
    import json
    import torch
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM
    from verl import DataFlow, TrainerConfig
    from verl.models import HFActor, HFCritic

    class RewardModel(torch.nn.Module):
        def forward(self, input_ids):
            return (input_ids % 7 == 0).sum(-1).float()

    def main():
        get_peft_model(AutoModelForCausalLM.from_pretrained(MODEL),
                       LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])).save_pretrained("adapter")
        base_model = AutoModelForCausalLM.from_pretrained(MODEL)
        peft_model = PeftModel.from_pretrained(base_model, "adapter")
        actor = HFActor.from_pretrained(peft_model)
        critic = HFCritic.from_pretrained(MODEL)
        reward_model = RewardModel()
        dataflow = DataFlow()
        dataflow.add_node("actor", actor)
        dataflow.add_node("critic", critic)
        dataflow.add_node("reward", reward_model.forward, input_keys=["input_ids"])
        trainer = dataflow.build_trainer(config=TrainerConfig(num_epochs=1, batch_size=2, learning_rate=1e-4,
                                                              rollout_n=2, max_response_length=8, output_dir="run"))
        history = trainer.train(prompts=["hi", "yo"])
        config = trainer.trainer.config
        print("RESULT " + json.dumps({"last": history.last(), "lora_rank": config.actor_rollout_ref.model.lora_rank,
                                      "adapter": config.actor_rollout_ref.model.lora_adapter_path,
                                      "strategy": config.actor_rollout_ref.actor.strategy,
                                      "critic": config.critic.model.path}))

    if __name__ == "__main__":
        main()
"""


def test_000_any_hf_model_a_peft_actor_a_critic_and_a_module_reward(tmp_path, chat):
    pytest.importorskip("peft")
    out = run_script(tmp_path, f"MODEL = {chat!r}\n" + textwrap.dedent(HF_MODELS))
    res = result(out)
    assert res["lora_rank"] == 4 and os.path.isfile(os.path.join(res["adapter"], "adapter_config.json"))
    assert res["strategy"] == "fsdp" and res["critic"] == chat
    last = res["last"]
    assert last["step"] == 1 and "critic/vf_loss" in last and "actor/pg_loss" in last


ONE_ACTOR = """
    import json
    import torch
    from safetensors.torch import load_file
    from transformers import AutoTokenizer
    from verl import DataPipeline, HybridActor, RLTrainer
    from verl.data import DataLoader
    from verl.data.rlhf_dataset import RLHFDataset
    from verl.models import HFCritic

    class RewardModel(torch.nn.Module):
        def forward(self, input_ids):
            return (input_ids > 20).float().mean(-1)

    def main():
        # 001: one actor, two modes
        actor = HybridActor.from_pretrained(MODEL)
        tokenizer = AutoTokenizer.from_pretrained(MODEL)
        ids = actor.generate(**tokenizer("Hello", return_tensors="pt"), max_new_tokens=32, do_sample=True,
                             temperature=0.7)
        engine = actor.worker.actor.engine
        actor.train()
        loss = actor(input_ids=ids, labels=ids).loss
        actor.eval()
        again = actor(input_ids=ids, labels=ids).loss
        # 001: the pipeline, from that actor's weights
        critic = HFCritic.from_pretrained(MODEL)
        rm = RewardModel()
        dataset = RLHFDataset(data_files=DATA, tokenizer=tokenizer, config={"max_prompt_length": 32})
        pipeline = DataPipeline(actors=[actor], reward_models=[rm], critics=[critic],
                                rollout_config={"max_length": 40, "max_prompt_length": 32, "n": 2},
                                train_config={"num_epochs": 2, "batch_size": 2, "output_dir": "run"},
                                dataset=DataLoader(dataset, batch_size=2))
        start = pipeline.trainer_config.model
        moved = any(not torch.equal(t, load_file(MODEL + "/model.safetensors")[k])
                    for k, t in load_file(start + "/model.safetensors").items())
        history = RLTrainer(pipeline=pipeline).run()
        print("RESULT " + json.dumps({
            "shape": list(ids.shape), "loss": float(loss), "eval": float(again), "steps": engine.optimizer_steps,
            "same": actor.worker.actor.engine is engine, "start": start, "moved": moved,
            "history": [{k: m.get(k) for k in ("step", "critic/vf_loss", "response_length/max")} for m in history]}))

    if __name__ == "__main__":
        main()
"""


def test_001_one_actor_two_modes_then_the_pipeline_of_it_a_reward_model_and_a_critic(tmp_path, chat):
    data = tmp_path / "data"
    data.mkdir()
    write_arithmetic_data(data, 2, 1)
    res = result(run_script(tmp_path, f"MODEL = {chat!r}\nDATA = {str(data / 'train.parquet')!r}\n"
                            + textwrap.dedent(ONE_ACTOR)))
    assert res["shape"][0] == 1 and 5 < res["shape"][1] <= 5 + 32
    assert res["steps"] == 1 and res["same"]  # one optimizer step in train mode, none in eval, one engine
    assert res["eval"] < res["loss"]  # the step lowered the loss on what it trained
    # The pipeline starts from the actor's weights after that step (written under the job's output_dir).
    assert res["start"] == str(tmp_path / "run" / "hybrid_actor_hf") and res["moved"]
    # num_epochs=2 over 2 prompts in batches of 2: two steps, PPO with the critic, responses of max_length - prompt.
    steps = res["history"]
    assert [s["step"] for s in steps] == [1, 2]
    assert all(s["critic/vf_loss"] is not None and s["response_length/max"] <= 8 for s in steps)


MANUAL = """
    import json
    from omegaconf import OmegaConf
    import verl
    from verl.data import DataLoader
    from verl.data.rlhf_dataset import RLHFDataset
    from verl.trainer import RLTrainer
    from verl.trainer.ppo import PPOTrainer
    from verl.utils.env_check import check_env

    config = OmegaConf.load(CONFIG)
    config.data.update(train_files=DATA + "/train.parquet", val_files=DATA + "/test.parquet",
                       tokenizer=DATA + "/tokenizer", train_batch_size=8)
    config.actor_rollout_ref.model.path = MODEL
    config.actor_rollout_ref.actor.ppo_mini_batch_size = 8
    # one process: the file's TP=2 over 2 ranks becomes one rank
    config.actor_rollout_ref.actor.megatron.tensor_model_parallel_size = 1
    config.trainer.update(n_gpus_per_node=1, output_dir="run", logger=["console"], val_before_train=False)
    trainer = PPOTrainer(config)
    loader = DataLoader(RLHFDataset(data_files=DATA + "/train.parquet", tokenizer=trainer.tokenizer,
                                    config={"max_prompt_length": 8}), batch_size=8)
    losses = []
    for batch in loader:
        rollout_data = trainer.rollout(batch)
        out = trainer.update(rollout_data)
        losses.append(out["loss"])
    rc = check_env()
    print("RESULT " + json.dumps({"step": trainer.global_step, "losses": losses, "rows": len(rollout_data),
                                  "version": verl.__version__, "rl_trainer": RLTrainer.__module__, "env": rc}))
    trainer.close()

    # 003: the local trainer on a YAML of trainer / actor_rollout / critic / data sections
    from transformers import AutoTokenizer
    from verl.trainer.local_trainer import LocalPPOTrainer

    tok = AutoTokenizer.from_pretrained(DATA + "/tokenizer")
    ds = RLHFDataset(data_files=[DATA + "/train.parquet"], tokenizer=tok, config={"max_prompt_length": 8})
    LocalPPOTrainer(config_path=LOCAL_YAML, train_dataset=ds).fit()
"""

LOCAL_YAML = """
    trainer: {total_training_steps: 1, output_dir: local, logger: [console], val_before_train: false, save_freq: 0,
              test_freq: 0}
    actor_rollout:
      model: {path: MODEL}
      actor: {ppo_mini_batch_size: 4, ppo_micro_batch_size_per_gpu: 8, use_kl_loss: true}
      ref: {log_prob_micro_batch_size_per_gpu: 8}
      rollout: {name: native, n: 2, log_prob_micro_batch_size_per_gpu: 8}
    critic: {model: {path: MODEL}, ppo_mini_batch_size: 4, ppo_micro_batch_size_per_gpu: 8}
    data: {train_files: DATA/train.parquet, tokenizer: DATA/tokenizer, max_prompt_length: 8, max_response_length: 6,
           train_batch_size: 4}
"""


def test_002_ppo_trainer_by_hand_from_the_tiny_grpo_config_with_a_smaller_batch_and_003_the_local_trainer(tmp_path):
    """002: configs/grpo_arith_tiny.yaml with data.train_batch_size=8: its log-prob micro-batches of 128 exceed the
    8 x 8 rows, one micro-batch each (as verl), where they were refused as 'expected a divisor'. 003: the local
    trainer on a YAML whose actor section is `actor_rollout`, with the strict data checks on, printing its phases."""
    data = tmp_path / "data"
    data.mkdir()
    write_arithmetic_data(data, 16, 4)
    model = os.path.join(REPO, "configs", "models", "qwen2_tiny_arith.json")
    (tmp_path / "local.yaml").write_text(textwrap.dedent(LOCAL_YAML).replace("MODEL", model)
                                         .replace("DATA", str(data)))
    script = (f"CONFIG = {os.path.join(REPO, 'configs', 'grpo_arith_tiny.yaml')!r}\nDATA = {str(data)!r}\n"
              f"MODEL = {model!r}\nLOCAL_YAML = {str(tmp_path / 'local.yaml')!r}\n" + textwrap.dedent(MANUAL))
    out = run_script(tmp_path, script, strict=True)
    res = result(out)
    assert res["step"] == 2 and len(res["losses"]) == 2 and res["rows"] == 8 * 8
    assert res["version"] == verl_version() and res["rl_trainer"] == "verl.trainer.api.pipeline"
    assert isinstance(res["env"], int) and "torch" in out
    local = out[out.index("RESULT "):]
    for phase in ("gen", "ref", "values", "adv", "update_actor"):
        assert f"[{phase}] " in local, local[-2000:]


def verl_version() -> str:
    import verl

    return verl.__version__
