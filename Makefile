# Two commands (see README):  `make serve`  and  `make test`.
PY      ?= python3.11
VENV    := .venv
BIN     := $(VENV)/bin
TORCH   := torch==2.13.0
STAMP   := $(VENV)/.installed

.PHONY: setup serve embed test bench clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# the CPU torch build first, so nothing later pulls a CUDA build
	$(BIN)/pip install --quiet $(TORCH)
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(STAMP)

setup: $(STAMP)

serve: setup
	$(BIN)/embedpool serve

embed: setup
	$(BIN)/embedpool embed "A sample sentence to embed."

test: setup
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV)
