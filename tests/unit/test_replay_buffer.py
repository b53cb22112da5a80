"""The V1 replay buffer of prompt groups (verl.trainer.v1.replay_buffer): verl's staleness rules (age = G - P + 1;
drop evicts finished groups older than the threshold and draws exactly one prompt for each, wait holds
sampling for in-flight groups at the threshold), oldest-first sampling, exact prompt accounting, and a
checkpoint round trip that keeps finished groups and reissues the in-flight prompts."""

import dataclasses
import json

import pytest

from verl.engine.rollout.partial import PromptGroup
from verl.errors import InputError
from verl.trainer.v1.replay_buffer import PromptStream, ReplayBuffer
from verl.utils.dataset.rl_dataset import ResumableSampler

pytestmark = pytest.mark.unit


def make_group(index, epoch, step):
    return PromptGroup(uid=f"{epoch}-{index}", index=index, epoch=epoch, submit_step=step, prompt=[1, 2, index],
                       fields={"index": index}, n=2)


def buffer(threshold=2, strategy="drop", samples=10, shuffle=True):
    return ReplayBuffer(threshold, strategy, make_group, PromptStream(ResumableSampler(samples, shuffle, seed=3)))


def finish(group, version=0):
    for t in group.trajectories:
        t.tokens, t.log_probs, t.finished = [7], [-0.1], True
        t.min_version = t.max_version = version
        t.segments = 1


def test_stream_draws_each_prompt_once_per_epoch():
    stream = PromptStream(ResumableSampler(5, shuffle=True, seed=0))
    draws = [stream.draw() for _ in range(12)]
    epochs = {e: sorted(i for i, ep in draws if ep == e) for e in (0, 1)}
    assert epochs == {0: [0, 1, 2, 3, 4], 1: [0, 1, 2, 3, 4]}
    assert [e for _, e in draws[10:]] == [2, 2]
    assert [i for i, _ in draws[:5]] != [i for i, _ in draws[5:10]]  # each epoch its own permutation


def test_drop_evicts_stale_finished_groups_and_refills_one_each():
    buf = buffer(threshold=2, strategy="drop")
    first = buf.submit(3, step=1)
    for g in first:
        finish(g)
    buf.collect_finished()
    assert buf.evict_stale(step=2) == ([], [])  # age 2 <= 2: trainable
    evicted, refills = buf.evict_stale(step=3)  # age 3 > 2
    assert sorted(g.uid for g in evicted) == sorted(g.uid for g in first)
    assert len(refills) == 3 and sorted(buf.in_flight) == sorted(g.uid for g in refills)
    assert all(g.submit_step == 3 for g in buf.in_flight.values())
    assert buf.ledger.drawn == 6 and buf.ledger.evicted == 3
    metrics = buf.eviction_metrics()
    assert metrics["training/off_policy/evicted_samples"] == 3.0
    assert metrics["training/off_policy/evicted_samples_staleness/max"] == 3.0
    assert buf.ledger.step_evicted_uids and not buf.end_step() and not buf.ledger.step_evicted_uids


def test_wait_holds_sampling_until_groups_at_the_threshold_finish():
    buf = buffer(threshold=2, strategy="wait")
    old = buf.submit(1, step=1)[0]
    young = buf.submit(2, step=2)
    for g in young:
        finish(g)
    buf.collect_finished()
    assert buf.required_uids(step=2) == {old.uid}  # age 2 >= 2
    assert not buf.ready(2, step=2)
    assert buf.evict_stale(step=5) == ([], [])  # wait never evicts
    finish(old)
    buf.collect_finished()
    assert buf.ready(2, step=2)
    assert buf.required_uids(step=2) == set()


def test_sample_takes_the_oldest_first_and_counts():
    buf = buffer(threshold=8)
    early = buf.submit(2, step=1)
    late = buf.submit(2, step=2)
    for g in late + early:  # the late ones finish first
        finish(g)
    buf.collect_finished()
    taken = buf.sample(2, step=2)
    assert [g.uid for g in taken] == [g.uid for g in early]
    with pytest.raises(RuntimeError, match="expected 3 sampleable groups"):
        buf.sample(3, step=2)
    assert buf.ledger.trained == 2 and len(buf.finished) == 2


def test_checkpoint_keeps_finished_groups_and_reissues_in_flight_prompts():
    buf = buffer(threshold=8, samples=6)
    groups = buf.submit(4, step=1)
    finish(groups[0], version=0)
    groups[1].trajectories[0].tokens = [5, 6]  # running, partially generated
    buf.collect_finished()
    state = json.loads(json.dumps(buf.state_dict(trajectories_inline=True)))  # older checkpoints: all in JSON
    restored = buffer(threshold=8, samples=6)
    restored.load_state_dict(state, step=4)
    assert [g.uid for g in restored.finished] == [groups[0].uid]
    assert restored.finished[0].trajectories[0].tokens == [7]
    assert restored.finished[0].submit_step == 1
    assert sorted(restored.in_flight) == sorted(g.uid for g in groups[1:])
    assert all(g.submit_step == 4 and not any(t.tokens for t in g.trajectories) for g in restored.in_flight.values())
    assert restored.ledger.reissued == 3
    # The stream goes on where it stopped: the next draws are the prompts not yet drawn this epoch.
    rest = {g.index for g in restored.submit(2, step=4)}
    assert rest.isdisjoint({g.index for g in groups})
    assert rest | {g.index for g in groups} == set(range(6))


def run_wait_steps(threshold, warmup, steps=6, batch=2):
    """The trainer's schedule under wait: warm-up batches before step 1, one batch a step, every in-flight group
    finishing within its step; the ages each step trained."""
    buf = buffer(threshold=threshold, strategy="wait", samples=100)
    buf.submit(warmup * batch, step=1)
    ages = []
    for step in range(1, steps + 1):
        buf.submit(batch, step)
        for g in list(buf.in_flight.values()):
            finish(g, version=step - 1)
        buf.collect_finished()
        ages.append(max(buf.age(g, step) for g in buf.sample(batch, step)))
    return ages


def test_wait_bounds_the_age_when_the_warmup_is_below_the_threshold_and_trips_otherwise():
    # The buffer stays warmup + 1 batches deep and wait evicts nothing: groups train at age warmup + 1.
    assert run_wait_steps(threshold=2, warmup=1) == [1, 2, 2, 2, 2, 2]
    assert max(run_wait_steps(threshold=3, warmup=0)) == 1
    # warmup >= threshold (refused by the config check): sampling past the threshold is an error, never silent.
    with pytest.raises(RuntimeError, match="sampled a group of age 3 > threshold 2"):
        run_wait_steps(threshold=2, warmup=2)


def test_ledger_truncation_on_resume_drops_a_torn_line_and_later_steps(tmp_path, caplog):
    from verl.trainer.v1.colocate_async import truncate_ledger

    path = tmp_path / "prompt_ledger.jsonl"
    path.write_text("".join(json.dumps({"step": s, "trained": [f"0-{s}"]}) + "\n" for s in (1, 2, 3))
                    + '{"step": 4, "trained": ["0-')
    truncate_ledger(str(path), 2)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2]
    assert "dropped 1 line(s)" in caplog.text


def test_checkpoint_writes_trajectories_as_tensor_shards_and_reads_them_at_any_world_size(tmp_path):
    buf = buffer(threshold=8, samples=40)
    groups = buf.submit(5, step=1)
    for k, g in enumerate(groups):
        for j, t in enumerate(g.trajectories):
            t.tokens = list(range(k * 100, k * 100 + 3 + j))
            t.log_probs = [-0.1 / (k + 1) - 1e-17 * j] * len(t.tokens)  # float64 values that float32 would round
            t.finished, t.min_version, t.max_version, t.segments = True, k, k + 1, 1 + j
            if k % 2 == 0:  # an agent trajectory: tool tokens masked out, its own prompt (the others: None)
                t.mask = [1 - i % 2 for i in range(len(t.tokens))]
                t.prompt = [5, 6, k, j]
    buf.collect_finished()
    state = json.loads(json.dumps(buf.state_dict()))
    assert all("trajectories" not in g for g in state["finished"])  # the JSON keeps no token
    for rank in range(2):  # two ranks holding the same buffer each write half
        buf.save_trajectories(str(tmp_path), rank, 2)
    assert sorted(p.name for p in (tmp_path / "replay_buffer").iterdir()) == ["shard0-of-2.pt", "shard1-of-2.pt"]
    restored = buffer(threshold=8, samples=40)
    restored.load_state_dict(state, step=2, trajectories=ReplayBuffer.load_trajectories(str(tmp_path)))
    assert [[dataclasses.asdict(t) for t in g.trajectories] for g in restored.finished] == \
        [[dataclasses.asdict(t) for t in g.trajectories] for g in buf.finished]
    first, second = restored.finished[0].trajectories[1], restored.finished[1].trajectories[0]
    assert first.mask == [1, 0, 1, 0] and first.prompt == [5, 6, 0, 1] and second.mask is None
    (tmp_path / "replay_buffer" / "shard1-of-2.pt").unlink()
    with pytest.raises(InputError, match="shard<r>-of-<w>.pt for every r < w"):
        ReplayBuffer.load_trajectories(str(tmp_path))
