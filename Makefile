# moe-backward-lab: every target sets up its own virtual environment (.venv) when it is missing or stale.
#   make report   run every notebook through papermill into reports/<run-id>/ (CPU defaults without a GPU)
#   make test     ruff + pytest (GPU tests skip without CUDA)
#   make lab      JupyterLab on notebooks/ with the project's kernel
#   make bench    benchmark implementations against the peers (python -m moe_lib.bench; see moe_lib/bench/)

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
STAMP := $(VENV)/.installed
KERNEL_NAME := moe-backward-lab
CONFIG ?= report.yaml
ARGS ?=

# torch first, so pip never resolves a bare `torch` requirement on its own:
# with a GPU (nvidia-smi answers) the CUDA build that goes with triton 3.6; without one the CPU build,
# never the multi-GB CUDA wheel.
HAS_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo yes)
TORCH_CPU := torch==2.13.0+cpu
TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu
TORCH_GPU := torch==2.11.*

.PHONY: setup test report lab bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
ifeq ($(HAS_GPU),yes)
	$(PIP) install -q "$(TORCH_GPU)"
else
	$(PIP) install -q "$(TORCH_CPU)" 2>/dev/null || $(PIP) install -q "$(TORCH_CPU)" --extra-index-url $(TORCH_CPU_INDEX)
endif
	$(PIP) install -q -e ".[report,dev]"
	$(PY) -m ipykernel install --sys-prefix --name $(KERNEL_NAME) --display-name "Python (moe-backward-lab)" >/dev/null
	@touch $(STAMP)

test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m pytest -q $(ARGS)

report: $(STAMP)
	$(PY) -m moe_lib.report --config $(CONFIG) $(ARGS)

lab: $(STAMP)
	$(PIP) install -q -e ".[report,dev,lab]"
	$(VENV)/bin/jupyter lab --notebook-dir=notebooks

bench: $(STAMP)
	$(PY) -m moe_lib.bench $(ARGS)

clean:
	rm -rf $(VENV) reports/*/ .pytest_cache .ruff_cache
