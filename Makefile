# Two commands do everything on a fresh machine:
#   make lab    install into .venv, then open JupyterLab on notebooks/
#   make test   install into .venv, then run the tests and every notebook (nbval)
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-labkit

.PHONY: install lab test test-numerics test-browser bench notebooks html student clean gpu-check \
	family-matrix

install: $(STAMP)

# torch is pinned here (pyproject.toml accepts the tested range), and installed first so that
# nothing else picks another torch. Where it comes from, TORCH_INDEX (make lab TORCH_INDEX=cpu):
#   auto     (default) PyTorch's CPU wheel index on Linux without nvidia-smi: PyPI's Linux torch
#            bundles CUDA (GBs a laptop does not need); elsewhere pip's own index (macOS and
#            Windows wheels on PyPI are CPU builds already)
#   cpu      PyTorch's CPU wheel index on any OS;  default: pip's own index and configuration
#   <url>    any other index, e.g. https://download.pytorch.org/whl/cu128 for a CUDA build
# An extra index is added only if it answers within 10 s; otherwise the install goes on from
# pip's own index and says so (a machine that reaches only PyPI still installs).
TORCH_VERSION := 2.13.0
TORCH_INDEX ?= auto
CPU_WHEELS := https://download.pytorch.org/whl/cpu
ifeq ($(TORCH_INDEX),auto)
NO_GPU_LINUX := $(if $(filter Linux,$(shell uname -s)),$(if $(shell command -v nvidia-smi),,yes))
TORCH_URL := $(if $(NO_GPU_LINUX),$(CPU_WHEELS))
else ifeq ($(TORCH_INDEX),cpu)
TORCH_URL := $(CPU_WHEELS)
else ifneq ($(TORCH_INDEX),default)
TORCH_URL := $(TORCH_INDEX)
endif
REACHABLE := import sys, urllib.request; urllib.request.urlopen(sys.argv[1] + "/torch/", timeout=10)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	@if [ -n "$(TORCH_URL)" ] && $(PY) -c '$(REACHABLE)' "$(TORCH_URL)" 2>/dev/null; then \
	  echo "torch $(TORCH_VERSION) from $(TORCH_URL) (TORCH_INDEX=$(TORCH_INDEX))"; \
	  $(PY) -m pip install -q torch==$(TORCH_VERSION) --extra-index-url "$(TORCH_URL)"; \
	else \
	  if [ -n "$(TORCH_URL)" ]; then echo "$(TORCH_URL) does not answer: torch from pip's" \
	    "own index (on Linux that may be the multi-GB CUDA build)"; fi; \
	  $(PY) -m pip install -q torch==$(TORCH_VERSION); \
	fi
	$(PY) -m pip install -q -e ".[test,hf]"
	touch $(STAMP)

# As root (a container, a fresh cloud VM) JupyterLab refuses to start without --allow-root.
lab: install
	$(PY) -m jupyter lab --notebook-dir=notebooks $(if $(filter 0,$(shell id -u)),--allow-root)

test: install
	$(PY) -m pytest tests notebooks --nbval-lax -p no:cacheprovider

# Every block on every decoder-only causal LM of the installed transformers, tiny configs, 2 ranks
# against one device: the table in docs/family-matrix.md (tests/test_family_matrix.py: a subset)
family-matrix: install
	$(PY) scripts/family_matrix.py

# "Equals one device" on other CPU kernels: the tests marked `numerics` and the lessons that print
# such verdicts, once per ATen CPU capability this CPU has (default, avx2, avx512: torch picks
# its kernels, so its rounding, by it) and once with MKL held to SSE4.2. The CPU's own best
# capability is skipped: `make test` ran everything on it. A tolerance fitted to one machine
# fails here; labkit.numerics' rule (a few times float32's own error against a float64 run)
# holds, and no lesson's checked verdict may change.
NUMERICS_LESSONS := $(wildcard notebooks/0[1348]_*.ipynb)
CPU_CAPABILITY = $(PY) -c 'import torch; print(torch.backends.cpu.get_cpu_capability().lower())'
test-numerics: install
	@native=$$($(CPU_CAPABILITY)); caps="default"; \
	grep -qw avx2 /proc/cpuinfo 2>/dev/null && caps="$$caps avx2"; \
	grep -qw avx512f /proc/cpuinfo 2>/dev/null && caps="$$caps avx512"; \
	for setting in $$(for c in $$caps; do [ "$$c" = "$$native" ] || echo ATEN_CPU_CAPABILITY=$$c; done) \
	               MKL_ENABLE_INSTRUCTIONS=SSE4_2; do \
	  echo "== test-numerics, $$setting (torch kernels: $$(env $$setting $(CPU_CAPABILITY));" \
	    "this CPU's own, $$native, is what make test ran)"; \
	  env $$setting $(PY) -m pytest tests -m numerics -p no:cacheprovider || exit 1; \
	  env $$setting $(PY) -m pytest $(NUMERICS_LESSONS) --nbval-lax -p no:cacheprovider || exit 1; \
	done

# Every lesson run in JupyterLab in headless Chromium (browser_tests/): no error output, every
# widget rendered, the explorer's slider changes the plot; run and redraw times reported in
# build/browser-report.{json,md}, screenshots in build/screens/. And the reading site (make html,
# built into build/site): the index, a lesson page and the search (browser_tests/test_site.py). Debian's chromium (installed
# here when root with apt-get), driven by the playwright package; no browser download.
CHROMIUM ?= /usr/bin/chromium
test-browser: install
	$(PY) -c "import playwright, jupyter_book" 2>/dev/null || \
	  $(PY) -m pip install -q -e ".[test,browser,docs]"
	@if [ ! -x "$(CHROMIUM)" ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; fi
	@if [ ! -x "$(CHROMIUM)" ]; then \
	  echo "test-browser: SKIPPED: no Chromium at $(CHROMIUM) and it cannot be installed here" \
	       "(needs root and apt-get; or: make test-browser CHROMIUM=/path/to/chromium)"; \
	else CHROMIUM="$(CHROMIUM)" $(PY) -m pytest browser_tests -p no:cacheprovider -rs; fi

bench: install
	for b in bench/*.py; do $(PY) $$b || exit 1; done

# Build each lesson whose source changed (notebooks/src/NN_name.py, jupytext py:percent) into
# notebooks/NN_name.ipynb, executed, with stable cell ids (notebooks/build.py; FORCE=1: all).
notebooks: install
	$(PY) notebooks/build.py $(if $(FORCE),--force)

# The reading site in site/ (open site/index.html): a Jupyter Book of the executed lessons, with
# navigation, search and a table of contents per page; Jupyter Book 1.x (the `docs` extra) is
# installed by this target only. HUB=https://hub.example.org adds to each page a link that opens
# the lesson on that JupyterHub, in each user's HUB_FOLDER (where the student edition is copied).
# And the student edition in student/ (solution cells stubbed, outputs cleared). See
# labkit/editions.py.
HUB ?=
HUB_FOLDER ?= student
html: install
	$(PY) -c "import jupyter_book" 2>/dev/null || $(PY) -m pip install -q -e ".[docs]"
	$(PY) -m labkit.editions html site $(if $(HUB),--hub "$(HUB)" --hub-folder "$(HUB_FOLDER)")

student: install
	$(PY) -m labkit.editions student student

# On a machine with a CUDA GPU (no venv needed, so no `install`: the system's python3 with torch):
# calibrate --quick, every building block on NCCL/CUDA at world size 1 against one device, CUDA
# memory against the tracker, measured steps against the model; one table, under 5 minutes.
# Results in $(GPU_CHECK_OUT)/ (table.md, rows.json, profile.json).
GPU_CHECK_OUT ?= build/gpu-check
gpu-check:
	PYTHONPATH=. $(PYTHON) -m labkit gpu-check --out-dir $(GPU_CHECK_OUT)

clean:
	rm -rf $(VENV) .pytest_cache
