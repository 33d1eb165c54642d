# Two commands do everything on a fresh machine:
#   make lab    install into .venv, then open JupyterLab on notebooks/
#   make test   install into .venv, then run the tests and every notebook (nbval)
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-labkit

.PHONY: install lab test bench notebooks html student clean

install: $(STAMP)

# torch is pinned: on these machines torch==2.13.0 is a local CPU wheel (an unpinned torch
# would pull a multi-GB CUDA build). Installed first so nothing else picks another torch.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

lab: install
	$(PY) -m jupyter lab --notebook-dir=notebooks

test: install
	$(PY) -m pytest tests notebooks --nbval-lax -p no:cacheprovider

bench: install
	for b in bench/*.py; do $(PY) $$b || exit 1; done

# Rebuild every notebook from its generator (notebooks/make/*.py) and save it executed.
notebooks: install
	for g in notebooks/make/*.py; do $(PY) $$g || exit 1; done

# The executed lessons as static HTML in site/ (index.html links them), and the student edition
# in student/ (solution cells stubbed, outputs cleared): nbconvert, see labkit/editions.py.
html: install
	$(PY) -m labkit.editions html site

student: install
	$(PY) -m labkit.editions student student

clean:
	rm -rf $(VENV) .pytest_cache
