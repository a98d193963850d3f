#!/usr/bin/env bash
# The main job on the embedded local default (`make demo`): installs what is needed (cached after the
# first run), then runs the whole system and prints a report (hack/demo.py): in real pods on the local
# cluster's real node where the machine allows it (root), else as local processes; the report says which.
#   hack/demo.sh --keep    keep everything running until Ctrl-C
#   hack/demo.sh --stop    stop what an interrupted run left behind
#
# What it prints before the report fits on one screen: hack/provision.sh's lines (the same provisioning
# driver and lanes as `make test`: one line per step start and end, a running clock; each step's output in
# a log under ~/.cache/kvfleet/logs/, printed when it fails), one line of `kvfleet plan`, and hack/demo.py's
# progress.
set -euo pipefail
cd "$(dirname "$0")/.."
hack/bootstrap.sh
if [ "${1:-}" != "--stop" ]; then
  # KEDA serves only the autoscaling tests; the demo does not scale (13 min of Go build saved when cold).
  provision=(--for "make demo" --skip 25-keda-modules --skip 35-keda)
  if [ "${CI:-}" != true ]; then
    # Real pods need root, the node tier and the images; without them the demo runs on local processes,
    # and its report says why (hack/demo.py probes the machine). Under CI=true a failure here stops it.
    provision+=(--may-fail 30-node --may-fail 40-images
      --may-fail-note "the demo runs on local processes instead (its report says why)")
  fi
  hack/provision.sh "${provision[@]}"
  # What the example ModelDeployment holds: the flags mirror examples/modeldeployment-qwen72b.yaml (preset,
  # TP 8, 141Gi H200s at 0.92, FP8 E5M2 KV, block 16, 2 replicas, maxModelLen 131072, LMCache CPU 256Gi and
  # NVMe 2Ti per replica). The whole table goes to a file; one line of it here.
  plan=${KVFLEET_CACHE:-$HOME/.cache/kvfleet}/logs/kvfleet-plan.txt
  .venv/bin/kvfleet plan --preset qwen2.5-72b --tensor-parallel 8 --gpu-memory 141Gi \
    --gpu-memory-utilization 0.92 --kv-dtype fp8_e5m2 --block-size 16 --replicas 2 \
    --context 131072 --sessions 64 --cpu-tier 256Gi --nvme-tier 2Ti >"$plan"
  echo "==> kvfleet plan of examples/modeldeployment-qwen72b.yaml: KV for" \
    "$(sed -n 's/^tokens per replica  *\(.*\)/\1 tokens per replica/p' "$plan")," \
    "$(sed -n 's/^sessions of \([0-9,]*\) tokens  *\([0-9]*\) per replica.*/\2 sessions of \1 tokens/p' "$plan")" \
    "(the whole table: ${plan/#"$HOME"/\~})"
fi
PYTHONPATH=hack exec .venv/bin/python hack/demo.py "$@"
