# Efficient training of transformer models on a single GPU: commands.
#
#   make test      lint, the helpers' tests, the preflight, and every notebook executed with nbval
#   make course    execute every notebook in order, keep the executed copies, print the summary
#                  table and, last, the capstone's ablation next to the guide's V100 run
#   make lab       start JupyterLab on the notebooks
#   make preflight try every hardware feature the lessons use on this machine (hosts: run it first)
#   make load-test the timing lessons three times under nbval with a bursty CPU load running
#   make load-course  make course with the same bursty load running
#   make lint      ruff check + ruff format --check
#   make format    strip notebook outputs, ruff check --fix, ruff format
#   make clean     remove build outputs (make distclean also removes .venv)
#
# By default the commands create .venv with `python3 -m venv` and `pip install -e ".[dev]"`
# into it (again only when pyproject.toml changes). In an environment that already has the
# dependencies (a GPU image, Colab, a cluster module) name its interpreter instead:
#
#   make course PYTHON=python3
#
# Then no virtual environment is created and nothing is installed; `python -m helpers doctor`
# checks that the dependencies import. Either way the checkout is put on PYTHONPATH, so
# `import helpers` always means this checkout.
#
# Variables: PYTHON (interpreter to use, see above), COURSE_SCALE (tiny|full|auto; passed to
# the notebooks only when set), BOOTSTRAP_PYTHON (interpreter that creates .venv; python3),
# VENV (.venv).

SHELL := bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help
.SUFFIXES:
# One thing at a time: readable output, one install, notebooks never compete for the machine.
.NOTPARALLEL:

VENV ?= .venv
BOOTSTRAP_PYTHON ?= python3

ifeq ($(origin PYTHON),undefined)
  # Own virtual environment.
  PYTHON := $(VENV)/bin/python
  ENV_READY := $(VENV)/.installed
  # Console scripts of the venv (accelerate, deepspeed, jupyter) come first on PATH, so a
  # notebook that shells out finds the same versions its kernel imports.
  export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)
else
  # The user's interpreter: install nothing, only check.
  ENV_READY := check-env
  # Its console scripts (accelerate, deepspeed, jupyter) first on PATH, as an activated
  # environment would have them, when that folder is not on PATH already.
  PYTHON_SCRIPTS := $(shell $(PYTHON) -c 'import sysconfig; print(sysconfig.get_path("scripts"))' 2>/dev/null)
  ifneq ($(PYTHON_SCRIPTS),)
    ifeq ($(filter $(PYTHON_SCRIPTS),$(subst :, ,$(PATH))),)
      export PATH := $(PYTHON_SCRIPTS):$(PATH)
    endif
  endif
endif

# The checkout first on PYTHONPATH (once, also in recursive makes).
ifeq ($(filter $(CURDIR),$(subst :, ,$(PYTHONPATH))),)
  export PYTHONPATH := $(CURDIR)$(if $(PYTHONPATH),:$(PYTHONPATH))
endif

ifneq ($(strip $(COURSE_SCALE)),)
  export COURSE_SCALE
endif

NOTEBOOKS := $(sort $(wildcard notebooks/*.ipynb))
LINT_PATHS := $(wildcard helpers tests tools notebooks)
TEST_RESULTS := $(CURDIR)/build/test-results.jsonl
CLAIMS := $(CURDIR)/build/claims.jsonl
# The lessons that check speed claims (all but 07): make load-test runs them under a bursty load.
TIMING_NOTEBOOKS := $(addprefix notebooks/,00_setup_and_measuring.ipynb 01_anatomy_of_memory.ipynb \
  02_batch_size.ipynb 03_gradient_accumulation.ipynb 04_gradient_checkpointing.ipynb \
  05_mixed_precision.ipynb 06_optimizers.ipynb 08_deepspeed_zero.ipynb \
  09_mixture_of_experts.ipynb 10_sdpa_flash_attention.ipynb 11_data_loading.ipynb \
  12_torch_compile.ipynb 13_peft_lora.ipynb 14_putting_it_together.ipynb \
  16_more_memory.ipynb)
COURSE_RESULTS_FILE := $(CURDIR)/build/results.jsonl
EXECUTED_DIR := build/executed

NBVAL_ARGS := --nbval-lax --nbval-current-env --nbval-cell-timeout=600 -p no:cacheprovider

.PHONY: help install check-env test lint test-unit preflight test-notebooks load-test course \
  load-course lab format clean distclean

help:
	@sed -n '3,12p' $(firstword $(MAKEFILE_LIST)) | sed 's/^# \{0,1\}//'
	@echo
	@echo "Interpreter: $(PYTHON)$(if $(filter check-env,$(ENV_READY)), (yours; nothing is installed), (.venv, created on first use))"

# ---------------------------------------------------------------------------------------------
# Environment

install: $(ENV_READY)

$(VENV)/bin/python:
	@$(BOOTSTRAP_PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else \
	  "$(BOOTSTRAP_PYTHON) is Python %d.%d; the course needs 3.10 or newer (make BOOTSTRAP_PYTHON=python3.11 ...)" % sys.version_info[:2])'
	$(BOOTSTRAP_PYTHON) -m venv $(VENV)

$(VENV)/.installed: pyproject.toml | $(VENV)/bin/python
	@echo "Installing the course's pinned dependencies into $(VENV) (a few minutes the first time)"
	$(VENV)/bin/python -m pip install -e ".[dev]"
	@touch $@

check-env:
	@echo "Using $(PYTHON) as it is (no virtual environment, nothing installed)"
	$(PYTHON) -m helpers doctor

# ---------------------------------------------------------------------------------------------
# Tests: lint, helpers' tests, notebooks. All three run; the target fails if any failed.

test lint test-unit preflight test-notebooks: export COURSE_RESULTS := $(TEST_RESULTS)
# No progress bars in test runs: nobody watches them (helpers/progress.py).
test lint test-unit preflight test-notebooks load-test: export COURSE_PROGRESS := 0

test:
	@rm -f $(TEST_RESULTS) $(CLAIMS)
	@mkdir -p build
	@$(MAKE) --no-print-directory -k lint test-unit preflight test-notebooks LINT_REQUIRED=1

lint: $(ENV_READY)
	@if $(PYTHON) -c 'import ruff' 2>/dev/null; then \
	  echo "ruff check and ruff format --check on: $(LINT_PATHS)"; \
	  ok=0; \
	  $(PYTHON) -m ruff check $(LINT_PATHS) || ok=1; \
	  $(PYTHON) -m ruff format --check $(LINT_PATHS) || ok=1; \
	  if [ $$ok -ne 0 ]; then echo "lint failed: 'make format' fixes most of it"; fi; \
	  exit $$ok; \
	elif [ -n "$(LINT_REQUIRED)" ]; then \
	  echo "ruff is not installed for $(PYTHON): make test lints, so pip install ruff==0.17.6"; \
	  exit 1; \
	else \
	  echo "ruff is not installed for $(PYTHON): skipping lint (pip install ruff==0.17.6 to lint)"; \
	fi

test-unit: $(ENV_READY)
	@mkdir -p build
	$(PYTHON) -m pytest tests

preflight: $(ENV_READY)
	$(PYTHON) -m helpers preflight

# On a quiet machine (make test) a speed claim that the interleaved rounds cannot decide fails.
test-notebooks: export COURSE_STRICT_TIMING := 1
test-notebooks: export COURSE_CLAIMS := $(CLAIMS)
test-notebooks: $(ENV_READY)
ifeq ($(NOTEBOOKS),)
	@echo "No notebooks in notebooks/: nothing to execute"
else
	@mkdir -p build
	$(PYTHON) -m pytest $(NBVAL_ARGS) notebooks/
	@$(PYTHON) -m helpers claims --claims $(CLAIMS)
endif

# The timing lessons three times in a row with a bursty load on one core (tools/bursty_load.py):
# a claim may come out undecided (reported and counted), never decided the wrong way.
load-test: export COURSE_RESULTS := $(CURDIR)/build/load-results.jsonl
load-test: export COURSE_CLAIMS := $(CURDIR)/build/load-claims.jsonl
load-test: $(ENV_READY)
	@mkdir -p build
	@rm -f build/load-claims.jsonl
	@$(PYTHON) tools/bursty_load.py --seconds 5400 & load=$$!; \
	trap 'kill $$load 2>/dev/null' EXIT; \
	for run in 1 2 3; do \
	  echo "=== run $$run of 3 under the bursty load"; start=$$(date +%s); \
	  $(PYTHON) -m pytest $(NBVAL_ARGS) $(TIMING_NOTEBOOKS); \
	  echo "=== run $$run passed in $$(( $$(date +%s) - start )) s"; \
	done
	@$(PYTHON) -m helpers claims --claims build/load-claims.jsonl

# ---------------------------------------------------------------------------------------------
# The course: every notebook in order on this machine's hardware, then the summary table.

course: export COURSE_RESULTS := $(COURSE_RESULTS_FILE)
course: export COURSE_CLAIMS := $(CURDIR)/build/course-claims.jsonl
course: $(ENV_READY)
	@mkdir -p $(EXECUTED_DIR)
	@rm -f $(COURSE_RESULTS_FILE) build/course-claims.jsonl
	@$(PYTHON) tools/run_course.py --out $(EXECUTED_DIR) $(NOTEBOOKS)

# make course with the bursty load running the whole time.
load-course: $(ENV_READY)
	@$(PYTHON) tools/bursty_load.py --seconds 7200 & load=$$!; \
	trap 'kill $$load 2>/dev/null' EXIT; \
	$(MAKE) --no-print-directory course

# The course's JupyterLab defaults (tools/lab-settings/overrides.json): no pop-up asking about
# Jupyter news over every notebook, no update checks (the versions are pinned).
LAB_ARGS := --LabApp.app_settings_dir=$(CURDIR)/tools/lab-settings

lab: export COURSE_RESULTS := $(COURSE_RESULTS_FILE)
lab: $(ENV_READY)
	@mkdir -p build
	$(PYTHON) -m jupyter lab $(if $(filter 0,$(shell id -u)),--allow-root) $(LAB_ARGS) notebooks/

# ---------------------------------------------------------------------------------------------
# Housekeeping

format: $(ENV_READY)
	$(PYTHON) tools/clean_notebooks.py $(NOTEBOOKS)
	@if $(PYTHON) -c 'import ruff' 2>/dev/null; then \
	  set -x; \
	  $(PYTHON) -m ruff check --fix --exit-zero $(LINT_PATHS); \
	  $(PYTHON) -m ruff format $(LINT_PATHS); \
	else \
	  echo "ruff is not installed for $(PYTHON): notebooks cleaned, code not formatted"; \
	fi

clean:
	rm -rf build results .pytest_cache .ruff_cache *.egg-info notebooks/.ipynb_checkpoints
	rm -f notebooks/*.jsonl
	rm -rf notebooks/traces
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV)
