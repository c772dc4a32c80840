# The whole set-up on a fresh Linux machine: `make demo` and `make test`.
# Override the torch requirement for a CUDA build, e.g. `make demo TORCH='torch==2.13.0'`
# with your CUDA index configured in pip; the default pin takes the CPU build on disk here.
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
PYTEST_ARGS ?=

.PHONY: demo test bench bench-comm system-deps clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

# Re-install when the project's requirements change.
$(VENV)/.installed-%: pyproject.toml | $(VENV)/bin/python
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet "$(TORCH)" -e ".[$*]"
	touch $@

# System packages the test suite uses (iproute2 for network namespaces in the comm tests,
# redis-server for the Redis cache tests).
system-deps:
	@missing=""; \
	if ! command -v ip >/dev/null 2>&1 || ! command -v tc >/dev/null 2>&1; then missing="$$missing iproute2"; fi; \
	if ! command -v redis-server >/dev/null 2>&1; then missing="$$missing redis-server"; fi; \
	if [ -n "$$missing" ]; then \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
			apt-get update -qq && apt-get install -y -qq $$missing; \
		else \
			echo "note: missing$$missing (iproute2: bandwidth-capped benchmark; redis-server: Redis cache tests)"; \
		fi; \
	fi

# make demo ALGORITHM=bytegrad: any of gradient_allreduce, bytegrad, decentralized,
# low_precision_decentralized, async, qadam
ALGORITHM ?= gradient_allreduce

demo: $(VENV)/.installed-examples
	$(VENV)/bin/torchrun --standalone --nproc-per-node 2 examples/train_digits.py --algorithm $(ALGORITHM)
	$(PY) examples/train_digits.py --algorithm $(ALGORITHM)

test: system-deps $(VENV)/.installed-test
	$(PY) -m pytest -q --durations=15 $(PYTEST_ARGS)

bench-comm: $(VENV)/.installed-bench
	$(PY) benchmarks/comm.py

# Every benchmark (about an hour on 2 cores; the network parts need root and iproute2).
bench: system-deps $(VENV)/.installed-bench
	$(PY) benchmarks/comm.py
	$(PY) benchmarks/ddp.py
	$(PY) benchmarks/stripes.py
	$(PY) benchmarks/elastic.py
	$(PY) benchmarks/cache.py
	$(PY) benchmarks/sampler.py
	$(PY) benchmarks/fused_optimizer.py

clean:
	rm -rf $(VENV) build *.egg-info
