#!/usr/bin/env bash
# The main job on an embedded local default. Grows with the project (see README).
set -euo pipefail
cd "$(dirname "$0")/.."
hack/bootstrap.sh
echo "==> kvfleet plan for examples/modeldeployment-qwen72b.yaml"
# The flags mirror examples/modeldeployment-qwen72b.yaml (preset, TP 8, 141Gi H200s at 0.92, FP8 E5M2 KV,
# block 16, 2 replicas, maxModelLen 131072, LMCache CPU 256Gi and NVMe 2Ti per replica).
.venv/bin/kvfleet plan --preset qwen2.5-72b --tensor-parallel 8 --gpu-memory 141Gi \
  --gpu-memory-utilization 0.92 --kv-dtype fp8_e5m2 --block-size 16 --replicas 2 \
  --context 131072 --sessions 64 --cpu-tier 256Gi --nvme-tier 2Ti
