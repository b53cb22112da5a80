"""The quickstart's closing report (launch/quickstart.py's format_summary)."""

from launch.quickstart import format_summary


def test_quickstart_summary_says_when_the_rl_stage_stopped_before_its_last_step():
    """verl train exits 0 once it checkpointed after a signal (Ctrl-C on its own, a preemption): the quickstart's
    report then says the run is not finished and how to go on, instead of reading like a finished run."""
    summary = {"val_accuracy_after_sft": 0.5, "val_accuracy_after_rl": None, "val_accuracy_sft_trainer": 0.5,
               "val_num_samples": 256, "rl_steps": 13, "rl_resumed_from_step": 0, "rl_total_steps": 100,
               "tokens_per_s": 1.0, "tokens_per_s_per_rank": 0.5, "step_s": 0.3, "gen_s_per_step": 0.03,
               "update_actor_s_per_step": 0.15, "reshard_s_per_step": 0.002, "reshard_bytes_per_step": 1024.0,
               "val_accuracy_gain_points": None, "wall_s": {"data": 1.0, "sft": 2.0, "grpo": 3.0}}
    text = format_summary(summary, "/out", "GRPO")
    assert "GRPO steps" in text and "13 of 100" in text
    assert text.splitlines()[-1] == ("GRPO stopped at step 13 of 100: the trainer was signalled and checkpointed; "
                                     "rerun the same command to resume")
    done = format_summary({**summary, "rl_steps": 100}, "/out", "GRPO")
    assert "100 of 100" in done and "stopped at step" not in done
