# vllm-ddtree: vLLM 0.34.0 + the patch stack in patches/ + our files in overlay/ (see README.md).
# LINE=<vLLM version> works on the release line in lines/<version>/ instead
# (e.g. `make wheel LINE=0.26.0`, the measured line); overlay/ is shared by every line.
PYTHON ?= python3
.DEFAULT_GOAL := all
LINE ?=
ifeq ($(LINE),)
LINE_DIR := .
TOOL := $(PYTHON) apply_patches.py
SRC ?= build/src
else
LINE_DIR := lines/$(LINE)
TOOL := $(PYTHON) apply_patches.py --line $(LINE)
SRC ?= build/src-$(LINE)
endif
# The other release lines, which `make test` tests too (see `line-test`).
OTHER_LINES := $(notdir $(patsubst %/,%,$(dir $(wildcard lines/*/upstream.lock))))
PYTEST_ARGS ?=
# Files and directories we own that ruff checks with vLLM's settings (add a path
# to cover more).
LINT_PATHS ?= overlay tests apply_patches.py patchstack bench
# One directory of rebase reports per line: the primary line's at the top,
# each other line's in from-<version>/.
ifeq ($(LINE),)
REPORT_DIR ?= docs/rebase
else
REPORT_DIR ?= docs/rebase/from-$(LINE)
endif

# Python requirements. Every target runs apply_patches.py, which needs
# requirements-build.txt; `test` also needs requirements-dev.txt. Each file is
# pip-installed into $(PYTHON)'s environment on first use and a stamp under
# $(DEPS_DIR), named by the sha256 of the requirements files and of that
# environment's prefix, skips pip from then on (a changed file or another
# environment installs again). Run make inside a virtualenv, or pass
# PIP_FLAGS (e.g. --user) where the system Python refuses pip installs.
DEPS_DIR ?= .cache/deps
PIP_FLAGS ?=
PIP_INSTALL = $(PYTHON) -m pip install --disable-pip-version-check --progress-bar off -q $(PIP_FLAGS)
deps_key = $(shell $(PYTHON) -c 'import hashlib, sys; h = hashlib.sha256(sys.prefix.encode()); [h.update(open(f, "rb").read()) for f in sys.argv[1:]]; print(h.hexdigest()[:16])' $(1))
BUILD_DEPS := $(DEPS_DIR)/build-$(call deps_key,requirements-build.txt).mk
TEST_DEPS := $(DEPS_DIR)/dev-$(call deps_key,requirements-build.txt requirements-dev.txt).stamp

# make reads this file first and, when it is missing, runs its rule (pip) and
# restarts: VERSION and WHEEL below then come from apply_patches.py.
include $(BUILD_DEPS)

$(BUILD_DEPS):
	@echo "== installing requirements-build.txt ($(PYTHON))"
	$(PIP_INSTALL) -r requirements-build.txt
	@mkdir -p $(DEPS_DIR) && echo "# requirements-build.txt is installed for $(PYTHON)" > $@

$(TEST_DEPS):
	@echo "== installing requirements-dev.txt ($(PYTHON))"
	$(PIP_INSTALL) -r requirements-dev.txt
	@mkdir -p $(DEPS_DIR) && touch $@

ifneq ($(wildcard $(BUILD_DEPS)),)
VERSION := $(shell $(TOOL) version)
WHEEL := dist/$(shell $(TOOL) wheel-name)
else
# first pass, before the restart
WHEEL := dist/.wheel
endif
IMAGE ?= vllm-ddtree:$(subst +,-,$(VERSION))
# Where pip puts console scripts (hadolint) for $(PYTHON).
SCRIPTS = $$($(PYTHON) -c 'import sysconfig; print(sysconfig.get_path("scripts"))')

.PHONY: all deps fetch check apply export wheel lint test test-gpu lint-docker image clean rebase-check line-check line-test

all: wheel

# Install both requirements files now (make does it on first use anyway).
deps: $(BUILD_DEPS) $(TEST_DEPS)

fetch:
	$(TOOL) fetch

check:
	$(TOOL) check

apply: fetch
	$(TOOL) apply --src $(SRC) --verify

export:
	$(TOOL) export --src $(SRC)

wheel: $(WHEEL)

OVERLAY_FILES := $(shell find overlay -name '*.py' -not -path '*/__pycache__/*' 2>/dev/null)

$(WHEEL): $(LINE_DIR)/upstream.lock $(LINE_DIR)/patches/series $(wildcard $(LINE_DIR)/patches/*.patch) $(OVERLAY_FILES) apply_patches.py $(wildcard patchstack/*.py)
	@echo "== wheel $(VERSION): fetch, apply, repack"
	$(TOOL) fetch
	$(TOOL) apply --src $(SRC) --verify
	$(TOOL) wheel --src $(SRC)

lint-docker: $(TEST_DEPS)
	PATH="$(SCRIPTS):$$PATH" hadolint Dockerfile

# ruff (vLLM's settings, ruff.toml) on LINT_PATHS and on the lines the patches add
# to upstream files (needs build/src: `make apply`).
lint: $(TEST_DEPS)
	$(TOOL) lint --src $(SRC) $(LINT_PATHS)

# The wheel's venv (tests/helpers/ddtree_venv.py): vLLM's dependencies
# installed once per set of them (about 8 GB, minutes), our wheel over them.
WHEEL_VENV = $$($(PYTHON) tests/helpers/ddtree_venv.py $(WHEEL))

test: $(TEST_DEPS)
	@echo "== [1/10] fetch (cache: $${VLLM_DDTREE_CACHE:-~/.cache/vllm-ddtree})"
	$(TOOL) fetch
	@echo "== [2/10] apply --verify into $(SRC)"
	$(TOOL) apply --src $(SRC) --verify
	@echo "== [3/10] check"
	$(TOOL) check
	@echo "== [4/10] export --dry-run (drift gate: patches and overlay)"
	$(TOOL) export --src $(SRC) --dry-run
	@echo "== [5/10] lint (ruff, vLLM's settings)"
	$(MAKE) --no-print-directory lint
	@echo "== [6/10] wheel + Dockerfile lint"
	$(MAKE) --no-print-directory wheel lint-docker
	@echo "== [7/10] the wheel's venv (the first time: about 8 GB of dependencies, minutes)"
	$(PYTHON) tests/helpers/ddtree_venv.py $(WHEEL) >/dev/null
	@echo "== [8/10] pytest: tests/unit, tests/tooling, tests/bench"
	$(PYTHON) -m pytest $(PYTEST_ARGS)
	@echo "== [9/10] pytest inside the wheel's venv: tests/in_vllm (imports the patched vLLM)"
	VENV=$(WHEEL_VENV) && \
	  $$VENV/bin/python -m pytest -c tests/in_vllm/pytest.ini tests/in_vllm $(PYTEST_ARGS)
	@echo "== [10/10] the other release lines: $(if $(LINE),none (LINE=$(LINE)),$(OTHER_LINES))"
	@for line in $(if $(LINE),,$(OTHER_LINES)); do \
	  $(MAKE) --no-print-directory line-test LINE=$$line || exit 1; done

# Every GPU test (a CUDA host; `make test` skips them): those of tests/unit
# with $(PYTHON), those of tests/in_vllm in the wheel's venv.
test-gpu: $(TEST_DEPS) $(WHEEL)
	$(PYTHON) -m pytest -m gpu $(PYTEST_ARGS)
	VENV=$(WHEEL_VENV) && \
	  $$VENV/bin/python -m pytest -c tests/in_vllm/pytest.ini -m gpu tests/in_vllm $(PYTEST_ARGS)

# The checks of one other release line that need no wheel venv of its own
# (docs/maintaining.md, "Release lines"): series and headers, the stack on its pristine
# sdist (tree id), no export drift, ruff with that release's settings.
line-check: $(TEST_DEPS)
	@echo "== line $(LINE): check, apply --verify, export --dry-run, lint (fetches vLLM $(LINE)'s sdist, about 50 MB, unless cached)"
	$(TOOL) check
	$(TOOL) apply --src $(SRC) --verify
	$(TOOL) export --src $(SRC) --dry-run
	$(MAKE) --no-print-directory lint LINE=$(LINE)

# What `make test` runs for each other release line: line-check, then that
# line's wheel and tests/in_vllm in its own venv (a folder per vLLM version:
# tests/helpers/ddtree_venv.py).
line-test: line-check
	@echo "== line $(LINE): wheel, its venv, pytest tests/in_vllm inside it"
	$(MAKE) --no-print-directory wheel LINE=$(LINE)
	VENV=$(WHEEL_VENV) && \
	  $$VENV/bin/python -m pytest -c tests/in_vllm/pytest.ini tests/in_vllm $(PYTEST_ARGS)

# Scheduled CI (.ci/rebase-check): would the stack move to vLLM $(VERSION)
# (`latest`: the newest final release on PyPI)? Dry run; writes
# $(REPORT_DIR)/<version>.md and .json; fails when a patch conflicts.
rebase-check:
	@if [ "$(origin VERSION)" = file ]; then \
	  echo "usage: make rebase-check VERSION=<vLLM release, e.g. 0.27.0>" >&2; exit 2; fi
	$(TOOL) rebase --onto $(VERSION) --report-dir $(REPORT_DIR)

# Needs a Docker engine (GPU hosts); our CI/dev machines have none. The
# Dockerfile's base image is the primary line's.
image: $(WHEEL)
	@if [ -n "$(LINE)" ]; then \
	  echo "make image: the Dockerfile builds on the primary line's image, not vLLM $(LINE)'s" >&2; exit 2; fi
	docker build \
	  --build-arg DDTREE_VERSION=$(VERSION) \
	  --build-arg UPSTREAM_COMMIT=$$($(TOOL) lock-get upstream.commit) \
	  --build-arg SERIES_SHA256=$$($(TOOL) series-hash) \
	  -t $(IMAGE) .

clean:
	rm -rf build dist .pytest_cache
