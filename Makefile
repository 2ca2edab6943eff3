# The two entry points of the README. Each sets up what it needs (idempotently), then runs.
.PHONY: demo test bench

demo:
	bash scripts/setup.sh
	.venv/bin/kvfabric demo

test:
	bash scripts/setup.sh --test
	.venv/bin/python -m pytest -q
	.venv-vllm/bin/python -m pytest -q tests/test_vllm_connector.py

bench:
	bash scripts/setup.sh
	.venv/bin/kvfabric bench tiers
