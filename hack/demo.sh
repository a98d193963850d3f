#!/usr/bin/env bash
# The main job on an embedded local default. Grows with the project (see README).
set -euo pipefail
cd "$(dirname "$0")/.."
hack/bootstrap.sh
echo "==> kvfleet plan for examples/modeldeployment-qwen72b.yaml"
.venv/bin/kvfleet plan --from-manifest examples/modeldeployment-qwen72b.yaml --context 131072
