"""verl's generation job with vLLM (``python -m verl.trainer.main_generation data.path=... rollout.name=vllm``, verl's
keys), run as a verl user runs it from the project venv: the job re-runs itself under the vLLM environment's python
(VERL_VLLM_PYTHON) and writes the table plus ``responses``. On the real SmolLM2-135M-Instruct with its chat template,
greedy: the responses are transformers' greedy texts."""

import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
from helpers.chat_models import hf_chat_greedy
from helpers.real_model import smollm2_dir

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NEW_TOKENS = 12
ROWS = [
    {"data_source": "chat", "prompt": [{"role": "user", "content": "What is 17 + 25? Answer with the number only."}],
     "extra_info": {"index": 0}},
    {"data_source": "chat", "prompt": [{"role": "user", "content": "Name one colour of the rainbow."}],
     "extra_info": {"index": 1}},
]


def test_verls_generation_job_runs_on_vllm_and_answers_as_transformers(vllm_python, tmp_path):
    model = smollm2_dir()
    data, out = tmp_path / "in.parquet", tmp_path / "out.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), str(data))
    cmd = [sys.executable, "-m", "verl.trainer.main_generation", f"data.path={data}", "data.prompt_key=prompt",
           "data.n_samples=1", f"data.output_path={out}", "data.batch_size=8", f"model.path={model}",
           "rollout.name=vllm", "rollout.temperature=0", f"rollout.response_length={NEW_TOKENS}",
           "rollout.dtype=float32", "trainer.nnodes=1", "trainer.n_gpus_per_node=1"]
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="2", VERL_VLLM_PYTHON=vllm_python)
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = pq.read_table(str(out)).to_pylist()
    assert [r["extra_info"] for r in rows] == [r["extra_info"] for r in ROWS]  # the input columns kept, in order
    assert [r["responses"] for r in rows] == [[hf_chat_greedy(model, r["prompt"], NEW_TOKENS)] for r in ROWS]
    assert rows[0]["responses"][0] == "17 + 25 = 32."  # the 135M model's own (wrong) sum, as transformers says it
