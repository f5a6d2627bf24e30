#!/usr/bin/env bash
# The one script a session with a lent GPU runs there (under 8 minutes): kvsieve's source on the lent
# machine's own torch, plus the pinned transformers wheel carried beside it.
#
# Here, before the run:   pip download --no-deps -d wheels transformers==5.24.0   (wheels/ is gitignored)
# Then, with the device tool:  run(command="bash benchmarks/device_check.sh", carry=["wheels"], timeout_s=540)
# Tables go to $OUT (or ./out) and to stdout; copy them into docs/results.md with the machine line they print.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-out}"; mkdir -p "$out"
site="$(mktemp -d)"
python3 -m pip install -q --no-index --no-deps --target "$site" wheels/transformers-*.whl || exit 1
export PYTHONPATH="$site:$PWD"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
timeout 60 python3 benchmarks/varlen_check.py 2>&1 | tee "$out/varlen.md"
# batch 1 at 8k-128k, batch 8 at 8k-32k: full, uniform and global at 0.5 / 0.875 (Llama-3.1-8B-shaped, bf16)
timeout 300 python3 benchmarks/gpu.py --lengths 8192,32768,131072 --batches 1 --tokens 32 2>&1 | tee "$out/gpu-b1.md"
timeout 120 python3 benchmarks/gpu.py --lengths 8192,32768 --batches 8 --tokens 16 2>&1 | tee "$out/gpu-b8.md"
