"""The PPO run loop: resume, steps from the trainer's batch source until ``total_training_steps`` or a
preemption (SIGUSR1/SIGTERM/SIGHUP/SIGINT: finish the step, checkpoint, exit 0), validation and checkpoints when due,
each step's metrics logged (rank 0), and the final HF export."""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from tqdm import tqdm

from verl.utils.timeline import Timeline
from verl.utils.tracking import rank_zero_tracking


class RunLoop:
    """The trainer's ``fit`` (drives ``train_step`` with what ``source.step_inputs()`` hands out)."""

    def fit(self) -> int:
        """Train to ``total_training_steps`` (or until preempted); returns the process exit code."""
        from verl.launcher.preemption import TRAINER_SIGNALS, PreemptionHandler

        trainer = self.sections.trainer
        if not self.dry_run:
            self.load_checkpoint()
        self.tracking = rank_zero_tracking(self.config, self.rank)
        if self.rank == 0:
            self.timeline = Timeline(trainer.output_dir)
        self._relog_checkpointed_step()
        validate = self.val_dataloader is not None and not self.dry_run
        if validate and trainer.val_before_train and self.global_step == 0:
            with self._timer("testing"):
                val = self.validate()
            self._log(val, 0)
        # A bar only on a terminal: through pipes (spawned ranks, Slurm logs) the console line is the progress.
        progress = tqdm(total=self.total_training_steps, initial=self.global_step, desc="training", file=sys.stderr,
                        disable=self.rank != 0 or not sys.stderr.isatty(), dynamic_ncols=True)
        # Ctrl-C (SIGINT) and a lost terminal (SIGHUP) too: finish the step, checkpoint, exit 0 -- so the run resumes.
        with PreemptionHandler(signals=TRAINER_SIGNALS) as preempt:
            preempted = self._train_loop(validate, preempt, progress)
        progress.close()
        if (trainer.export_hf_at_end and not self.dry_run and not preempted
                and self.global_step >= self.total_training_steps
                and self._exported_step != self.global_step):
            self.export_hf()
        if preempted:
            self._print(f"preempted: stopped after step {self.global_step} with a checkpoint; exiting 0")
        if self.tracking is not None:
            self.tracking.close()
        return 0

    def _train_loop(self, validate: bool, preempt: Any, progress: Any) -> bool:
        """Steps until ``total_training_steps`` or a preemption (returned), each from the batch source's next
        input."""
        from verl.launcher import startup

        preempted, first = False, True
        self.source.start()
        inputs = self.source.step_inputs()
        try:
            while self.global_step < self.total_training_steps and not preempted:
                step_input, extra = next(inputs)
                step = self.global_step + 1
                metrics = self.train_step(step_input, step)
                metrics.update(extra)
                if first:  # this process's first step: how long the run took to get here (verl.launcher.startup)
                    first, now = False, time.time()
                    metrics["perf/time_to_first_step_s"] = now - startup.launch_time()
                    self._print(startup.summary_line(now))
                last, preempted = self._end_step(metrics, step, validate, preempt)
                progress.update(1)
                if last:
                    break
        finally:
            inputs.close()  # the dataloader's pass (and its forked workers) ends with the loop
        return preempted

    def _end_step(self, metrics: dict[str, float], step: int, validate: bool, preempt: Any) -> tuple[bool, bool]:
        """After step ``step``'s update: validation and checkpoint when due (or when preempted), then the step's
        metrics logged; returns (the last step, preempted)."""
        trainer = self.sections.trainer
        metrics["training/global_step"] = step
        self.global_step = step
        last = step >= self.total_training_steps
        if validate and trainer.test_freq > 0 and (step % trainer.test_freq == 0 or last):
            with self._timer("testing"):
                metrics.update(self.validate())
            metrics["timing_s/testing"] = self._timing["testing"]
        saved = False
        self._step_metrics = metrics  # saved with the checkpoint (see _relog_checkpointed_step)
        if not self.dry_run and trainer.save_freq > 0 and (step % trainer.save_freq == 0 or last):
            self.save_checkpoint()
            saved = True
        preempted = preempt.should_stop()
        if preempted and not saved and not self.dry_run:
            self.save_checkpoint()
        if "save_checkpoint" in self._timing:
            metrics["timing_s/save_checkpoint"] = self._timing["save_checkpoint"]
        self._log(metrics, step)
        return last, preempted

    def _relog_checkpointed_step(self) -> None:
        """A resumed run whose checkpoint's step never reached metrics.jsonl (the run died between the save and
        the log line) logs it from the metrics the checkpoint carries."""
        metrics, step = getattr(self, "_resumed_step_metrics", None), self.global_step
        if self.rank != 0 or not metrics or step == 0:
            return
        from verl.utils.tracking import METRICS_FILE, MetricsError, read_metrics

        path = os.path.join(self.sections.trainer.output_dir, METRICS_FILE)
        try:
            logged = {record["step"] for record in read_metrics(path)} if os.path.isfile(path) else set()
        except MetricsError as err:  # a damaged metrics file: say so, and leave it be
            self._print(f"resume: {err}")
            return
        # Only the run that logged the steps before it (a checkpoint resumed into another output directory is
        # not this run's history to complete).
        if step in logged or not any(s < step for s in logged):
            return
        self._print(f"resume: step {step}'s metrics were not logged before the run ended: logging them from its "
                    "checkpoint")
        self._log(dict(metrics), step)

    def _log(self, metrics: dict[str, float], step: int) -> None:
        if self.tracking is not None:
            self.tracking.log(metrics, step, total_steps=self.total_training_steps)
        if self.timeline is not None:
            self.timeline.write(step)
