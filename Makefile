# Efficient training of transformer models on a single GPU: commands.
#
#   make test      lint, the helpers' tests, the preflight, and every notebook executed with nbval
#                  (the executed copies kept in build/executed-test, for make book)
#   make book      the course as a static site in build/book/, every lesson with make test's
#                  outputs (run make test first); make book-check checks it in headless Chromium
#   make course    execute every notebook in order, keep the executed copies, print the summary
#                  table and, last, the capstone's ablation next to the guide's V100 run
#   make lab       start JupyterLab on the notebooks
#   make browser-check  every notebook run in JupyterLab in headless Chromium, checked as a
#                  reader sees it (errors, bars, widgets after reopening, figure text), then
#                  the calculator; screenshots and summary in build/browser-check/
#   make preflight try every hardware feature the lessons use on this machine (hosts: run it first)
#   make load-test the timing lessons three times under nbval with a bursty CPU load running
#   make load-course  make course with the same bursty load running
#   make gpu-check the course proven on this machine's GPU within a deadline; writes reports/gpu/
#   make compat    the tests and every notebook at the oldest supported versions (.venv-compat)
#   make lint      ruff check + ruff format --check
#   make format    strip notebook outputs, ruff check --fix, ruff format
#   make clean     remove build outputs (make distclean also removes .venv)
#
# By default the commands create .venv with `python3 -m venv` and install the course with every
# extra into it at the exact versions of requirements/lock.txt (pip install -c
# requirements/lock.txt -e ".[optional,jupyter,dev,book]"; again when pyproject.toml or the lock
# changes). pyproject.toml itself states tested ranges, not pins. In an environment that
# already has the dependencies (a GPU image, Colab, a cluster module) name its interpreter
# instead:
#
#   make course PYTHON=python3
#
# Then no virtual environment is created and nothing is installed; `python -m helpers doctor`
# checks that the dependencies import. Either way the checkout is put on PYTHONPATH, so
# `import helpers` always means this checkout.
#
# Variables: PYTHON (interpreter to use, see above), COURSE_SCALE (tiny|full|auto; passed to
# the notebooks only when set), BOOTSTRAP_PYTHON (interpreter that creates .venv; python3),
# VENV (.venv), PLAYWRIGHT_PYTHON (a Python with Playwright for make browser-check;
# .venv-playwright), CHROMIUM (/usr/bin/chromium), GPU_CHECK_DEADLINE (minutes, 9),
# GPU_CHECK_OUT (report folder), COMPAT_PYTHON (a Python 3.12 for make compat; found on PATH or
# under pyenv), TEST_WORKERS (processes for the helpers' tests in make test; 2, 0 for one).

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
LINT_PATHS := $(wildcard helpers tests tools notebooks recipes book)
TEST_RESULTS := $(CURDIR)/build/test-results.jsonl
CLAIMS := $(CURDIR)/build/claims.jsonl
# The lessons that check speed claims (helpers/syllabus.py): make load-test runs them under a
# bursty load. Expanded where a recipe uses it, once the environment exists.
TIMING_NOTEBOOKS = $(shell $(PYTHON) -m helpers.syllabus --timed)
COURSE_RESULTS_FILE := $(CURDIR)/build/results.jsonl
EXECUTED_DIR := build/executed
# make test keeps every notebook it executes here, with its outputs (tools/keep_executed.py);
# make book renders them.
EXECUTED_TEST := $(CURDIR)/build/executed-test

NBVAL_ARGS := --nbval-lax --nbval-current-env --nbval-cell-timeout=600 -p no:cacheprovider

.PHONY: help install check-env test lint test-unit preflight test-notebooks load-test course \
  load-course lab browser-check book book-check format clean distclean gpu-check gpu-wheels gpu-rehearsal compat

help:
	@sed -n '3,20p' $(firstword $(MAKEFILE_LIST)) | sed 's/^# \{0,1\}//'
	@echo
	@echo "Interpreter: $(PYTHON)$(if $(filter check-env,$(ENV_READY)), (yours; nothing is installed), (.venv, created on first use))"

# ---------------------------------------------------------------------------------------------
# Environment

install: $(ENV_READY)

$(VENV)/bin/python:
	@$(BOOTSTRAP_PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else \
	  "$(BOOTSTRAP_PYTHON) is Python %d.%d; the course needs 3.10 or newer (make BOOTSTRAP_PYTHON=python3.11 ...)" % sys.version_info[:2])'
	$(BOOTSTRAP_PYTHON) -m venv $(VENV)

$(VENV)/.installed: pyproject.toml requirements/lock.txt | $(VENV)/bin/python
	@echo "Installing the course at the locked versions into $(VENV) (a few minutes the first time)"
	$(VENV)/bin/python -m pip install -c requirements/lock.txt -e ".[optional,jupyter,dev,book]"
	@# The course's JupyterLab settings for this environment's Jupyter too (no news pop-up,
	@# widget state saved): \`.venv/bin/jupyter lab\` outside make gets them, as Binder does.
	mkdir -p $(VENV)/share/jupyter/lab/settings
	cp tools/lab-settings/overrides.json $(VENV)/share/jupyter/lab/settings/overrides.json
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
	@rm -rf $(TEST_RESULTS) $(CLAIMS) $(EXECUTED_TEST)
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

# The helpers' tests run in TEST_WORKERS processes (pytest-xdist, where it is installed), each
# test file in one of them, so that a module's shared fixture runs once. On 2 cores two workers
# took the suite from 632 s to 432 s (2026-11-29): much of it is single-threaded Python
# (fake-tensor traces, fresh processes starting). TEST_WORKERS=0: one process.
TEST_WORKERS ?= 2
XDIST = $(if $(filter-out 0,$(TEST_WORKERS)),$(shell $(PYTHON) -c 'import xdist' 2>/dev/null \
  && printf '%s' '-n $(TEST_WORKERS) --dist loadfile'))

test-unit: $(ENV_READY)
	@mkdir -p build
	$(PYTHON) -m pytest $(XDIST) --durations=15 tests

preflight: $(ENV_READY)
	$(PYTHON) -m helpers preflight

# A speed claim fails a notebook only when a second measurement confirms it decided the wrong
# way; undecided ones are listed by the summary that ends the run (it exits 1 on a confirmed one).
test-notebooks: export COURSE_CLAIMS := $(CLAIMS)
test-notebooks: $(ENV_READY)
ifeq ($(NOTEBOOKS),)
	@echo "No notebooks in notebooks/: nothing to execute"
else
	@mkdir -p build
	@status=0; PYTHONPATH=$(CURDIR)/tools:$$PYTHONPATH $(PYTHON) -m pytest $(NBVAL_ARGS) \
	  -p keep_executed --keep-executed $(EXECUTED_TEST) notebooks/ || status=$$?; \
	echo; $(PYTHON) -m helpers claims --claims $(CLAIMS) || status=1; exit $$status
endif

# The timing lessons three times in a row with a bursty load on one core (tools/bursty_load.py):
# rounds the load disturbs are set aside, so a claim may come out undecided (reported and
# counted), never confirmed the wrong way.
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
# Jupyter news over every notebook, no update checks (make's .venv has the locked versions).
LAB_ARGS := --LabApp.app_settings_dir=$(CURDIR)/tools/lab-settings

lab: export COURSE_RESULTS := $(COURSE_RESULTS_FILE)
lab: $(ENV_READY)
	@mkdir -p build
	$(PYTHON) -m jupyter lab $(if $(filter 0,$(shell id -u)),--allow-root) $(LAB_ARGS) notebooks/

# Every notebook (or NOTEBOOKS=...) run in a JupyterLab with the course's settings, in headless
# Chromium, then the memory calculator driven (tools/browser_check.py). Playwright and the
# browser stay out of the course's environment:
#   python3 -m venv .venv-playwright && .venv-playwright/bin/pip install playwright
#   apt-get install -y chromium
PLAYWRIGHT_PYTHON ?= $(CURDIR)/.venv-playwright/bin/python
CHROMIUM ?= /usr/bin/chromium

browser-check: $(ENV_READY)
	@$(BOOTSTRAP_PYTHON) tools/browser_check.py --python $(PLAYWRIGHT_PYTHON) \
	  --chromium $(CHROMIUM) --lab-python $(PYTHON) $(NOTEBOOKS)

# The course as a static site (tools/book.py: Sphinx, MyST-NB, the Sphinx Book Theme), from the
# notebooks make test executed (build/executed-test), and its check in headless Chromium (the
# browser-check setup): every page offline, links, figures, navigation, search.
book: $(ENV_READY)
	$(PYTHON) tools/book.py --executed $(EXECUTED_TEST) --out build/book

book-check:
	@$(BOOTSTRAP_PYTHON) tools/book_check.py --python $(PLAYWRIGHT_PYTHON) --chromium $(CHROMIUM) \
	  --book build/book --shots build/book-check

# ---------------------------------------------------------------------------------------------
# A GPU host, and the oldest supported versions
#
# make gpu-check on a machine with a GPU: parts a-d of helpers/course/gpu_check.py within the deadline,
# the report written as it goes (reports/gpu/<date>-<card>.md and .json). On a CPU it is the
# rehearsal (tiny scale, two notebooks, build/gpu-check/).
#
# A GPU host with only its image's libraries gets the wheels the run needs from here:
#   make gpu-wheels                      # .whl/core (notebook runner, datasets), .whl/extras
#   bash tools/gpu_host.sh OUT 9         # on the host: wheels into a folder of their own, run
# make gpu-rehearsal runs exactly that here, in .venv-compat (the host's image), with a short
# deadline. make compat runs the tests and every notebook there (no optional packages).

GPU_CHECK_DEADLINE ?= 9
GPU_CHECK_OUT ?=
COMPAT_VENV := .venv-compat
COMPAT_PYTHON ?= $(shell for p in python3.12 $$HOME/.pyenv/versions/3.12*/bin/python3.12; do \
  $$p -c '' 2>/dev/null && { echo $$p; break; }; done)
COMPAT_SITE := $(CURDIR)/$(COMPAT_VENV)/carried

gpu-check: $(ENV_READY)
	$(PYTHON) -m helpers gpu-check --deadline $(GPU_CHECK_DEADLINE) \
	  $(if $(GPU_CHECK_OUT),--out $(GPU_CHECK_OUT))

gpu-wheels:
	$(BOOTSTRAP_PYTHON) tools/gpu_wheels.py

$(COMPAT_VENV)/.installed: requirements/floor.txt
	@[ -n "$(COMPAT_PYTHON)" ] || { echo "make compat needs Python 3.12, the GPU images' own:"; \
	  echo "install it, or name one: make compat COMPAT_PYTHON=/path/to/python3.12"; exit 1; }
	rm -rf $(COMPAT_VENV)
	$(COMPAT_PYTHON) -m venv $(COMPAT_VENV)
	@echo "Installing the oldest supported versions (requirements/floor.txt) into $(COMPAT_VENV)"
	@echo "(torch 2.11 from PyPI is a CUDA build: about 3 GB, and it runs on a CPU too)"
	$(COMPAT_VENV)/bin/python -m pip install -q -r requirements/floor.txt
	@touch $@

# The tests and every notebook at the floor: the image's libraries, the carried wheels (the
# notebook runner and datasets, installed as tools/gpu_host.sh does), no optional packages.
compat: export PATH := $(CURDIR)/$(COMPAT_VENV)/bin:$(COMPAT_SITE)/bin:$(PATH)
compat: export PYTHONPATH := $(CURDIR):$(COMPAT_SITE)
compat: export COURSE_PROGRESS := 0
compat: export COURSE_RESULTS := $(CURDIR)/build/compat-results.jsonl
compat: export COURSE_CLAIMS := $(CURDIR)/build/compat-claims.jsonl
compat: $(COMPAT_VENV)/.installed
	$(BOOTSTRAP_PYTHON) tools/gpu_wheels.py --core-only
	$(COMPAT_VENV)/bin/python -m pip install -q --no-index --no-deps --no-compile --upgrade \
	  --target $(COMPAT_SITE) .whl/core/*.whl
	@mkdir -p build && rm -f build/compat-claims.jsonl
	$(COMPAT_VENV)/bin/python -m helpers doctor
	$(COMPAT_VENV)/bin/python -m pytest -p no:cacheprovider tests
	$(COMPAT_VENV)/bin/python -m pytest $(NBVAL_ARGS) notebooks/
	@$(COMPAT_VENV)/bin/python -m helpers claims --claims build/compat-claims.jsonl

# What the GPU host runs (tools/gpu_host.sh), here: the image's libraries, every carried wheel,
# a short deadline. It prints what a device call would carry (under 64 MiB).
gpu-rehearsal: $(COMPAT_VENV)/.installed
	$(BOOTSTRAP_PYTHON) tools/gpu_wheels.py
	rm -rf build/gpu-rehearsal
	PATH=$(CURDIR)/$(COMPAT_VENV)/bin:$$PATH PYTHON=$(COMPAT_VENV)/bin/python \
	  SITE=$(CURDIR)/build/gpu-rehearsal/site bash tools/gpu_host.sh build/gpu-rehearsal 6

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
	rm -rf $(VENV) $(COMPAT_VENV) .venv-playwright .whl
