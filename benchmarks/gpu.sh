#!/usr/bin/env bash
# One device-tool call on the H200 (<= 8 minutes, no network): ingest throughput against a
# plain forward, bf16, random-weight SmolLM2-shaped and Llama-1B-shaped models.
#   run(command="bash benchmarks/gpu.sh", timeout_s=480)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${OUT:-.}"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
PYTHONPATH=. timeout 450 python3 benchmarks/bench_gpu.py --device cuda --prompts 2048 --batch 64 --rounds 2 \
  --out "$OUT_DIR/gpu-result.json"
