#!/usr/bin/env bash
# GPT-2 small (124M) bf16 train step on one GPU: tokens/s and model FLOP utilisation (MFU)
# against the chip's nominal dense bf16 peak, at two batch sizes, one fresh process each.
#
#   bash benchmarks/gpu_gpt2.sh            # prints the benchmark's lines; logs under $OUT or /tmp
#
# For a machine without network whose image lacks some dependencies (on this workplace's H200
# image, Python 3.12: ml_collections, nest_asyncio, zstandard), download their wheels into .whl/
# beforehand, e.g.
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux2014_x86_64 -d .whl ml_collections nest_asyncio zstandard
# and this script installs them into /tmp/site first.
set -euo pipefail
cd "$(dirname "$0")/.."
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1
logs="${OUT:-/tmp}"
python3 -c 'import jax; print("jax", jax.__version__, jax.devices())'
for batch in 16 32; do
  python3 benchmarks/train_step.py --configs=gpt2 --dtype=bfloat16 --notorch --rounds=1 \
    --batch_size="$batch" 2>&1 | tee "$logs/gpt2_bf16_batch$batch.log"
done
