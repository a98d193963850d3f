#!/usr/bin/env bash
# Install the peer proxies of the gateway benchmark (LiteLLM proxy, vllm-router) into their own virtual
# environment outside the repository, so they never touch the project's .venv.
# litellm is pinned to a release whose [proxy] extra resolves from PyPI alone.
set -euo pipefail
VENV=${KVFLEET_BENCH_VENV:-$HOME/.cache/kvfleet/bench-venv}
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
"$VENV/bin/pip" install --quiet 'litellm[proxy]==1.108.0' 'vllm-router==0.1.17'
echo "peer proxies installed in $VENV"
