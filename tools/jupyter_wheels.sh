#!/usr/bin/env bash
# Wheels for executing the notebooks on the GPU machine, which has torch, triton and transformers
# but no Jupyter (and no network beyond this machine): downloaded here into .whl/jupyter (ignored
# by git) for Python 3.12 on x86-64 Linux, then carried with the working tree to the GPU machine,
# where `tools/gpu_check.sh notebooks` installs them offline. numpy is left out: torch brings it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
rm -rf .whl/jupyter && mkdir -p .whl/jupyter
"$PY" -m pip download -q -d .whl/jupyter --python-version "${WHEEL_PYTHON:-3.12}" --only-binary=:all: \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    nbclient nbformat ipykernel jupyter_client ipywidgets matplotlib
rm -f .whl/jupyter/numpy-*.whl
du -sh .whl/jupyter
