.DEFAULT_GOAL := help
SHELL := /bin/bash

help: ## Show the targets.
	@grep -E '^[a-z-]+:.*##' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-12s %s\n", $$1, $$2}'

demo: ## Set everything up and run the main job on the embedded local default.
	@hack/demo.sh

demo-stop: ## Stop what an interrupted `make demo` left behind.
	@hack/demo.sh --stop

test: ## Provision the real components and run every test (what CI runs); a missing component fails it, named with the command that provisions it. KVFLEET_ALLOW_MISSING=1 make test: its tests skip instead.
	@hack/test.sh

images: ## Build the kvfleet and kvfleet-engine images with podman (Debian base + PyPI; no registry needed).
	@hack/images.sh

venv: ## Create .venv with the dev extras.
	@hack/bootstrap.sh

lint: venv ## ruff, mypy --strict and the import contracts (lint-imports).
	@hack/lint.sh

unit: venv ## The light tiers, no provisioning: tests/unit (starts nothing), tests/tools (helm, promtool, scripts as subprocesses), tests/loopback (servers on 127.0.0.1); a test whose real component is missing skips (KVFLEET_ALLOW_MISSING=1).
	@KVFLEET_ALLOW_MISSING=1 .venv/bin/pytest -m "unit or tools or loopback"

generate: venv ## Regenerate CRDs and their chart copies, the chart README, dashboards, alert rules and docs/crd-reference.md.
	@PYTHONPATH=dashboards .venv/bin/python hack/generate.py

bench-docs: venv ## Regenerate docs/benchmarks.md's tables from the results files in benchmarks/results/.
	@.venv/bin/python benchmarks/report.py

.PHONY: help demo demo-stop test venv lint unit generate bench-docs images
