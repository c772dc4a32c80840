# The whole set-up on a fresh Linux machine: `make demo` and `make test`.
# Override the torch requirement for a CUDA build, e.g. `make demo TORCH='torch==2.13.0'`
# with your CUDA index configured in pip; the default pin takes the CPU build on disk here.
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
PYTEST_ARGS ?=
# pytest processes: the suite's ranks leave a core idle half the time; 2 workers use it
# (--dist loadgroup: a module marked xdist_group runs on one worker, so its module-scoped jobs run once)
PYTEST_WORKERS ?= 2

.PHONY: demo test docs docs-deps docs-shots bench bench-comm bench-smoke gpu-check system-deps clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

# Re-install when the project's requirements change. pip's own byte-compiling runs on one core
# (half the install here); compileall -j 0 does it on all of them. It must happen: where
# PYTHONDONTWRITEBYTECODE is set, nothing imported later is cached. (compileall's exit status is
# ignored: torch ships a file in newer Python syntax, which pip skips silently too.)
$(VENV)/.installed-%: pyproject.toml | $(VENV)/bin/python
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet --no-compile "$(TORCH)" -e ".[$*]"
	$(PY) -m compileall -q -j 0 "$$($(PY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")" >/dev/null 2>&1 || true
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
# low_precision_decentralized, async, qadam, onebit_grad
ALGORITHM ?= gradient_allreduce

demo: $(VENV)/.installed-examples
	$(VENV)/bin/torchrun --standalone --nproc-per-node 2 examples/train_digits.py --algorithm $(ALGORITHM)
	$(PY) examples/train_digits.py --algorithm $(ALGORITHM)

# The project's own modules compiled first: PYTHONDONTWRITEBYTECODE, where it is set (as on the
# development box), would make each of the suite's hundreds of rank processes compile bagua anew
# (~1 s each); compileall writes the bytecode regardless, and imports read it.
test: system-deps $(VENV)/.installed-test
	$(PY) -m compileall -q bagua kernels lightning_bagua examples benchmarks tests >/dev/null
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadgroup --durations=15 $(PYTEST_ARGS)

# The documentation site into site/ (open site/index.html: it needs no server and no network), built in
# strict mode from docs/ and bagua's docstrings (mkdocs.yml): a broken link or reference fails it.
docs: docs-deps $(VENV)/.installed-docs
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

# Chromium, to look at the built site headless (make docs-shots); the test suite needs no browser.
docs-deps:
	@if ! command -v chromium >/dev/null 2>&1; then \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
			apt-get update -qq && apt-get install -y -qq chromium; \
		else \
			echo "note: chromium missing (only make docs-shots uses it)"; \
		fi; \
	fi

# Screenshots of the site's home and one API page, as a reader's browser shows them, into $(SHOTS).
SHOTS ?= site-shots
docs-shots: docs
	mkdir -p $(SHOTS)
	for page in index api/parallel; do \
		chromium --headless --no-sandbox --disable-gpu --hide-scrollbars --window-size=1280,1600 \
			--screenshot="$(SHOTS)/$$(basename $$page).png" "file://$(CURDIR)/site/$$page.html" 2>/dev/null; \
	done

bench-comm: $(VENV)/.installed-bench
	$(PY) -m benchmarks.comm.allreduce

# Every benchmark once at its smallest, in a scratch copy of the tree: stale scripts fail here (~5 min).
bench-smoke: system-deps $(VENV)/.installed-bench
	$(PY) -m benchmarks.smoke

# Every benchmark (about an hour on 2 cores; the network parts need root and iproute2).
bench: system-deps $(VENV)/.installed-bench
	$(PY) -m benchmarks.comm.allreduce
	$(PY) -m benchmarks.step.ddp
	$(PY) -m benchmarks.comm.stripes
	$(PY) -m benchmarks.scale.elastic
	$(PY) -m benchmarks.data.cache
	$(PY) -m benchmarks.data.sampler
	$(PY) -m benchmarks.optim.fused

# The GPU path in one run, on a machine with a CUDA GPU (about 5 minutes on an H100): every test
# marked gpu, the Triton kernels against their references from 1 to 64M elements, the codec's and
# fused optimizers' speed, the wrapper on NCCL against torch DDP. It uses $(PYTHON) as it is (the
# lent GPU machine has no network: install this checkout there with
# `pip install --no-deps --no-build-isolation -e .`) and writes gpu_check.json and gpu_check.md
# into $(OUT) (default gpu_check_out). Exit 3: no GPU here; 4: a prerequisite is missing.
gpu-check:
	$(PYTHON) -m benchmarks.gpu.check $(if $(OUT),--out $(OUT)) $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info site site-shots
