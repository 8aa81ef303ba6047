# Two commands do everything on a fresh machine:
#   make book   - create .venv, install, build the site into _build/html (warnings are errors)
#   make test   - create .venv, install, run unit tests, nbval over the notebooks, the browser test
# Other targets: make lab (JupyterLab on a working copy of the notebooks), make bench (GPU sweep),
# make notebooks (re-execute in place)

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# torch is installed first, only when .venv has none. On this project's CI machines pip finds the
# CPU build of 2.13.0 on disk. Elsewhere, PyPI's Linux wheel is a CUDA build: pass
# TORCH_INDEX=https://download.pytorch.org/whl/cpu for the CPU one, or TORCH_SPEC= to install none
# (a GPU workstation that put its own torch in .venv first).
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
STAMP  := $(VENV)/.installed

.PHONY: install book test unit nbval browser lab lab-reset bench notebooks clean

install: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@if [ -n "$(TORCH_SPEC)" ] && ! $(PY) -c "import torch" 2>/dev/null; then \
		$(PY) -m pip install -q $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) "$(TORCH_SPEC)"; fi
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps -e .
	touch $(STAMP)

MATHJAX := .site/extra/mathjax/tex-chtml.js

# MathJax 3 from npm, so the site renders math with no network at read time. Never committed.
$(MATHJAX):
	npm install --silent --prefix .site --no-save --no-audit --no-fund mathjax@3
	rm -rf .site/extra/mathjax && mkdir -p .site/extra
	cp -r .site/node_modules/mathjax/es5 .site/extra/mathjax

book: install $(MATHJAX)
	rm -rf _build/html
	$(VENV)/bin/jupyter-book build . --warningiserror --keep-going --path-output .

# One pytest run: docstring examples, unit tests, every notebook re-executed and compared (nbval),
# the built site in headless Chromium, and two notebooks in JupyterLab. Workers take one file each
# at a time (a notebook's cells must run in order in one kernel).
# One worker per core (measured on 2 cores: a third worker made the run 1 minute slower).
WORKERS ?= auto

# One torch thread per worker: with a worker per core, torch's default (a thread per core in each
# worker) oversubscribes the cores and OpenMP's waiting threads slow every small op (measured on 2
# cores: two notebooks under 2 workers took 53 s, and 37 s with one thread each).
TEST_THREADS ?= 1

test: install book
	OMP_NUM_THREADS=$(TEST_THREADS) \
	$(PY) -m pytest -n $(WORKERS) --dist loadfile --durations=25 --doctest-modules --nbval --nbval-current-env \
		--nbval-sanitize-with tests/nbval_sanitize.cfg moe_kernels tests notebooks

# JupyterLab on a working copy of the notebooks (.lab/, ignored by git): opening a notebook, running
# it and autosave never touch the committed ones. The copy is made once; `make lab-reset` refreshes
# it. As root (the default user of rented GPU containers) JupyterLab needs --allow-root.
LAB_DIR := .lab
lab: install
	test -d $(LAB_DIR) || cp -r notebooks $(LAB_DIR)
	$(VENV)/bin/jupyter lab $(if $(filter 0,$(shell id -u)),--allow-root) $(LAB_DIR)

lab-reset:
	rm -rf $(LAB_DIR)

bench: install
	$(PY) -m moe_kernels.bench

notebooks: install
	$(PY) tools/execute_notebooks.py notebooks/*.ipynb

clean:
	rm -rf _build .site $(LAB_DIR)
