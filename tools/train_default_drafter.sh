#!/usr/bin/env sh
# Reproduces the shipped drafter dflash_jax/drafters/smollm2-135m-instruct from scratch:
# self-distillation data from SmolLM2-135M-Instruct (all 2167 prompts of the recorded list, about
# 35 min on a 2-core CPU), cached target features (about 15 min), then the training run (about
# 60 min including tau evaluations). Each stage resumes when rerun with the same work folder
# (default runs/smollm2); no single command runs longer than about an hour.
set -eu
WORK=${1:-runs/smollm2}
PY=${PYTHON:-python}
"$PY" tools/make_train_data.py --out "$WORK/data" --num-prompts 2193 --batch-size 32 --max-new 160 --prompt-cap 128
"$PY" -m dflash_jax.train.cli --data "$WORK/data" --out "$WORK/run" --features "$WORK/features" \
    --mask-token-id 16 --layers 2 --target-layer-ids 1,10,18,27 --block-size 8 --draft-vocab 8192 \
    --steps 1500 --batch-size 16 --max-len 288 --num-anchors 16 --lr 8e-4 \
    --ckpt-every 50 --eval-every 250 --eval-max-new 64 \
    --export dflash_jax/drafters/smollm2-135m-instruct
