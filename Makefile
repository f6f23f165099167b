# moe-backward-lab: every target sets up its own virtual environment (.venv) when it is missing or stale.
#   make report   run every notebook through papermill into reports/<run-id>/ (CPU defaults without a GPU)
#   make test     ruff check, ruff format --check, pytest (GPU tests skip without CUDA)
#   make lab      JupyterLab on notebooks/ with the project's kernel (headless: open the URL it prints;
#                 LAB_PORT=8888, LAB_IP=localhost; as root it passes --allow-root)
#   make bench    benchmark implementations against the peers (python -m moe_lib.bench; see moe_lib/bench/)

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
STAMP := $(VENV)/.installed
KERNEL_NAME := moe-backward-lab
CONFIG ?= report.yaml
ARGS ?=
LAB_STAMP := $(VENV)/.installed-lab
LAB_PORT ?= 8888
LAB_IP ?= localhost
ROOT_FLAG := $(shell [ "$$(id -u)" = 0 ] && echo --allow-root)

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
	@echo "== setting up $(VENV): PyTorch ($(if $(HAS_GPU),CUDA,CPU) build), the project and its Jupyter kernel (minutes the first time)"
ifeq ($(HAS_GPU),yes)
	$(PIP) install "$(TORCH_GPU)"
	@# CUPTI for the harness's official timing method (optional: without it that column is left out)
	-$(PIP) install cupti-python
else
	@echo "== $(TORCH_CPU): from the local wheel cache if it has it, else from $(TORCH_CPU_INDEX)"
	$(PIP) install "$(TORCH_CPU)" || $(PIP) install "$(TORCH_CPU)" --extra-index-url $(TORCH_CPU_INDEX)
endif
	$(PIP) install -e ".[lab,report,dev]"
	$(PY) -m ipykernel install --sys-prefix --name $(KERNEL_NAME) --display-name "Python (moe-backward-lab)"
	@touch $(STAMP)

test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m pytest -q $(ARGS)

report: $(STAMP)
	$(PY) -m moe_lib.report --config $(CONFIG) $(ARGS)

$(LAB_STAMP): $(STAMP)
	$(PIP) install -e ".[lab,report,dev,jupyter]"
	@touch $(LAB_STAMP)

# headless (no browser is opened: open the URL printed); --allow-root where it runs as root (containers, GPU machines)
lab: $(LAB_STAMP)
	@token=$$($(PY) -c "import secrets; print(secrets.token_hex(16))"); \
	echo "== JupyterLab on notebooks/ with the $(KERNEL_NAME) kernel: open http://$(LAB_IP):$(LAB_PORT)/lab?token=$$token (Ctrl-C stops it)"; \
	exec $(VENV)/bin/jupyter lab --notebook-dir=notebooks --no-browser --ip=$(LAB_IP) --port=$(LAB_PORT) \
		--ServerApp.port_retries=0 --IdentityProvider.token=$$token $(ROOT_FLAG)

bench: $(STAMP)
	$(PY) -m moe_lib.bench $(ARGS)

clean:
	rm -rf $(VENV) reports/*/ .pytest_cache .ruff_cache
