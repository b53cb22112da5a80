#!/usr/bin/env bash
# The sentiment figure (issue 57 item 3): do the RM- and judge-trained reviews get more positive by the rule that
# defines sentiment (positive minus negative words, verl/data/sentiment.py), on prompts about films the policy never
# trained on? Per seed (trainer.seed 0, 1, 2) and reward (the BERT RM, the Qwen2 judge): the config's 40 PPO steps,
# validated before step 1 and after step 40 on the held-out films, each validation's reviews dumped
# (trainer.validation_data_dir); twice, once validating with 4 samples a prompt at the training temperature (1.0),
# once greedy. summarize.py scores the dumps by the rule, beside the reward model's own score in training.
# Data, RM and judge: one build (seed 0). ~3 min on 2 idle cores (each run ~10 s, the data ~20 s).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
cd "$ROOT"
LOGS="$HERE/logs"
DATA="${DATA:-outputs/sentiment_data}"
rm -rf "$LOGS" && mkdir -p "$LOGS"
rm -rf "$DATA"  # built afresh: the held-out split is the current code's
OMP_NUM_THREADS=1 .venv/bin/python -m verl.data.sentiment --out "$DATA" | tee "$LOGS/data.log"
cp "$DATA/report.json" "$LOGS/data_report.json"
for REWARD in rm judge; do
  for SEED in 0 1 2; do
    for VAL in sampled greedy; do
      if [ "$VAL" = sampled ]; then
        VAL_KWARGS=(actor_rollout_ref.rollout.val_kwargs.do_sample=true actor_rollout_ref.rollout.val_kwargs.temperature=1.0
                    actor_rollout_ref.rollout.val_kwargs.n=4)
      else
        VAL_KWARGS=(actor_rollout_ref.rollout.val_kwargs.do_sample=false actor_rollout_ref.rollout.val_kwargs.n=1)
      fi
      RUN="${REWARD}_seed${SEED}_$VAL"
      OUT="outputs/sentiment_$RUN"
      rm -rf "$OUT"
      OMP_NUM_THREADS=1 .venv/bin/verl train --config "configs/ppo_sentiment_$REWARD.yaml" \
        "data.train_files=$DATA/train.parquet" "data.val_files=$DATA/test.parquet" "data.tokenizer=$DATA/tokenizer" \
        "reward.reward_model.model_path=$DATA/$REWARD" "trainer.seed=$SEED" "trainer.output_dir=$OUT" \
        trainer.val_before_train=true trainer.test_freq=40 "trainer.validation_data_dir=$OUT/validation" \
        "${VAL_KWARGS[@]}" > "$LOGS/$RUN.log" 2>&1
      mkdir -p "$LOGS/$RUN"
      cp "$OUT/metrics.jsonl" "$LOGS/$RUN/"
      cp "$OUT"/validation/*.jsonl "$LOGS/$RUN/"
    done
  done
done
bash "$HERE/machine.sh" > "$LOGS/machine.txt"
.venv/bin/python "$HERE/summarize.py" "$LOGS" | tee "$LOGS/summary.txt"
