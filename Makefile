# The three commands of the README do all set-up on a fresh machine, each
# installing what it needs and no more:
#   make demo    builds fastrl, then trains a tiny transformer with GRPO on its fused kernels and on the reference (the main job)
#   make bench   builds fastrl, then benchmarks every op against its peers on the local device
#   make test    builds fastrl, then runs the tests
#
# Where they install: the active virtual or conda environment (VIRTUAL_ENV or
# CONDA_PREFIX set), or PYTHON=... when given; otherwise a virtual environment
# .venv in this checkout, made on first use (so CI, which starts from a fresh
# clone, builds and tests inside a fresh venv). Never the system Python.
ifeq ($(origin PYTHON),undefined)
ifneq ($(VIRTUAL_ENV)$(CONDA_PREFIX),)
PYTHON := python3
else
PYTHON := .venv/bin/python
# Made at parse time, before ENV_PROBE below asks it where it lives; pip
# upgraded to the newest, as on a fresh machine (the venv's bundled pip can be
# years old). Not for `make clean`.
ifneq ($(filter-out clean,$(or $(MAKECMDGOALS),demo)),)
$(shell test -x .venv/bin/python || { python3 -m venv .venv && .venv/bin/python -m pip install -q --upgrade pip; } >&2)
endif
endif
endif
# The torch we test with; installed only when torch is missing, because a bare
# `torch` requirement pulls several GB of CUDA packages.
TORCH_VERSION ?= 2.13.0
# The veRL release the parity tests and the benchmarks compare against (its
# loss and log-prob functions only; --no-deps, their imports come from the
# `verl` extra).
VERL_VERSION ?= 0.9.1
# The OpenRLHF release fastrl.integrations.openrlhf is tested with (--no-deps:
# its loss modules need only torch and deepspeed, from the `openrlhf` extra).
OPENRLHF_VERSION ?= 0.11.2
# Megatron-core, whose vocab_parallel_cross_entropy (and veRL's Megatron helpers on
# its tensor-parallel group) the sharded ops are tested against (--no-deps: it needs
# only torch, numpy and packaging). 0.16.1 is the last release for Python 3.11.
MEGATRON_CORE_VERSION ?= 0.16.1
# NeMo Automodel, which veRL's Automodel engine imports (--no-deps: the engine tests
# build that engine without a model, so its module need only import).
NEMO_AUTOMODEL_VERSION ?= 0.7.0

.PHONY: setup setup-demo setup-bench setup-test bench bench-record bench-quick gpu-quick-dry test demo clean

# Build requirements of pyproject.toml, installed here so that the editable
# build can run without pip's isolated build environment (faster rebuilds).
BUILD_REQUIREMENTS = "setuptools>=77" wheel "pybind11>=2.10" "cmake>=3.18" ninja

# Set-up runs again only when something it depends on changed: a stamp per
# set-up and Python environment (and native-build switches) under build/stamps/,
# older than one of the files below, or missing. A changed csrc/ file makes the
# next set-up re-run `pip install -e`, which recompiles that file alone (setup.py
# keeps the CMake build directory in build/cmake/); Python sources need nothing
# (editable install). The stamps are dropped when the `fastrl` this Python
# imports is not this tree's (another checkout installed, or none).
BUILD_INPUTS = pyproject.toml setup.py CMakeLists.txt $(wildcard csrc/*)
ENV_PROBE := $(shell $(PYTHON) -I -c "import hashlib, importlib.util, os, sys; \
	key = '|'.join([sys.prefix] + [os.environ.get(v, '') for v in ('FASTRL_NO_NATIVE', 'FASTRL_BUILD_TYPE')]); \
	spec = importlib.util.find_spec('fastrl'); \
	print(hashlib.sha1(key.encode()).hexdigest()[:12], os.path.realpath(spec.origin) if spec and spec.origin else '-')" 2>/dev/null)
STAMPS := build/stamps/$(or $(word 1,$(ENV_PROBE)),unknown)
ifneq ($(word 2,$(ENV_PROBE)),$(realpath $(CURDIR)/fastrl/__init__.py))
$(shell rm -rf $(STAMPS))
endif

# The extras (pyproject.toml) each set-up installs.
DEMO_EXTRAS = demo
BENCH_EXTRAS = bench,verl,trl
TEST_EXTRAS = test,demo,bench,verl,trl,openrlhf

# torch (only when missing), the build tools, then this tree in editable mode
# with the extras $(1).
define install
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install "torch==$(TORCH_VERSION)"
	$(PYTHON) -m pip install $(BUILD_REQUIREMENTS)
	$(PYTHON) -m pip install --no-build-isolation -e ".[$(1)]"
endef

# make demo: fastrl and what the example imports (tqdm, matplotlib).
setup-demo: $(STAMPS)/demo
$(STAMPS)/demo: $(BUILD_INPUTS)
	$(call install,$(DEMO_EXTRAS))
	@mkdir -p $(@D) && touch $@

# make bench: the benchmark tools and the peers it times fastrl against that run
# here (veRL's and TRL's functions; Liger, flash-attn, FlashInfer and quack are
# GPU-only: bench/gpu/peers.sh).
setup-bench: $(STAMPS)/bench
$(STAMPS)/bench: $(BUILD_INPUTS) Makefile
	$(call install,$(BENCH_EXTRAS))
	$(PYTHON) -m pip install --no-deps "verl==$(VERL_VERSION)"
	@mkdir -p $(@D) && touch $@

# make test: the test tools, the demo's and the benchmarks' packages (their tests
# run them), and the three frameworks the integration tests run against. A
# superset of the other two, so their stamps are renewed too.
setup-test: $(STAMPS)/test
$(STAMPS)/test: $(BUILD_INPUTS) Makefile
	$(call install,$(TEST_EXTRAS))
	$(PYTHON) -m pip install --no-deps "verl==$(VERL_VERSION)" "openrlhf==$(OPENRLHF_VERSION)" \
		"megatron-core==$(MEGATRON_CORE_VERSION); python_version == '3.11'" "nemo-automodel==$(NEMO_AUTOMODEL_VERSION)"
	@mkdir -p $(@D) && touch $@ $(@D)/demo $(@D)/bench

# Everything (what `make test` installs).
setup: setup-test

# Every op against every peer on this machine; writes build/bench/<device>.json
# and its plots, and changes no committed file.
bench: setup-bench
	$(PYTHON) -m bench --results-dir build/bench --plot build/bench/plots

# Maintainers: the same, recorded as this machine's results in
# bench/results/<device>.json (plots in bench/results/plots/), then the README's
# performance section regenerated from every results file.
bench-record: setup-bench
	$(PYTHON) -m bench --plot bench/results/plots
	$(PYTHON) -m bench.report

# CI: small shapes; fails if a result is off the reference, or if fastrl is
# slower than the torch reference or than torch.compile of it (the LM head's
# GEMM-bound cases aside) measured in the same run; a ratio that falls short is
# measured again (three rounds, best of each) before it fails. The margins
# leave room for a busy 2-core machine. Measured idle on a 2-core Intel Xeon
# (AVX-512), the closest cases were 1.70x torch's log_softmax + gather (log-probs
# of [256, 32000] fp32) and 1.26x torch.compile (log-probs of [32, 151936] bf16);
# with the kernels at x86-64-v3 (--cpu-isa, the AVX2 code), 1.41x and 1.26x.
# On AVX2 CPUs (AMD EPYC CI machines) the eager margin stays at 0.6x: before
# the AVX2 loops vectorised, busy machines measured 0.73x there.
bench-quick: setup-bench
	$(PYTHON) -m bench --quick --check-speed 1.0 --check-speed-avx2 0.6 --check-speed-compiled 1.0 \
		--json build/bench-quick.json --plot build/bench-quick-plots

# The quick GPU plan (bash bench/gpu/session.sh quick on a lent GPU) run dry here:
# the same stages on the CPU at tiny shapes, into build/gpu-quick-dry/ (what
# tests/test_gpu_plan.py checks).
gpu-quick-dry: setup-bench
	rm -rf build/gpu-quick-dry && mkdir -p build/gpu-quick-dry
	FASTRL_QUICK_DRY=1 OUT=build/gpu-quick-dry PY=$(PYTHON) bash bench/gpu/session.sh quick

# The tests run in one pytest-xdist worker per core (TEST_WORKERS=0: in this
# process): most of their time is the Triton interpreter, one Python thread each.
# The 30 slowest are listed at the end (CI must stay under 30 minutes: make the
# slowest cheaper first).
TEST_WORKERS ?= auto
test: setup-test
	$(PYTHON) -m pytest -n $(TEST_WORKERS) --durations=30

# End to end: GRPO on a tiny transformer (examples/grpo_tiny.py), once on the
# fused kernels and once on the PyTorch reference; prints the reward and the
# per-op times side by side and writes the reward curve. About two minutes on 2 CPU cores.
demo: setup-demo
	$(PYTHON) examples/grpo_tiny.py --compare --plot build/demo/reward_curve.png

clean:
	rm -rf build dist *.egg-info fastrl/_C*.so .pytest_cache .benchmarks .venv
