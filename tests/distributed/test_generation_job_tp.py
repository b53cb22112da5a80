"""verl's generation job (``python -m verl.trainer.main_generation`` with verl's keys) at rollout TP 2: two local
ranks spawned over gloo, as ``verl generate --tp 2``; greedy responses equal to the one-rank job's."""

import pyarrow as pa
import pyarrow.parquet as pq
from helpers.chat_models import save_chat_model

from verl.trainer import generation_job

PROMPTS = [[{"role": "user", "content": "12+30="}],
           [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour, please."}],
           [{"role": "user", "content": "7"}]]


def test_tp2_job_equals_one_rank(tmp_path):
    model = save_chat_model(str(tmp_path / "model"))
    data = str(tmp_path / "in.parquet")
    pq.write_table(pa.Table.from_pylist([{"prompt": p, "data_source": "x"} for p in PROMPTS]), data)
    common = [f"data.path={data}", "data.n_samples=1", "data.batch_size=2", f"model.path={model}",
              "rollout.temperature=0", "rollout.response_length=6", "rollout.dtype=float32"]
    one = tmp_path / "tp1.parquet"
    assert generation_job.main([*common, f"data.output_path={one}"]) == 0
    two = tmp_path / "tp2.parquet"
    # This process reads, checks and writes; it spawns the two TP ranks (the unit tier runs `python -m`).
    assert generation_job.main([*common, f"data.output_path={two}", "trainer.nnodes=1", "trainer.n_gpus_per_node=2",
                                "rollout.tensor_model_parallel_size=2"]) == 0
    expected = pq.read_table(str(one)).column("responses").to_pylist()
    assert len(expected) == 3 and all(len(r) == 1 for r in expected)
    assert pq.read_table(str(two)).column("responses").to_pylist() == expected
