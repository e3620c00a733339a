# One task runner. `make run` and `make test` are the two commands a newcomer needs;
# both install what they need first (into .venv), so neither assumes a prepared machine.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed-$(shell cat pyproject.toml | sha256sum | cut -c1-12)
LISTEN  ?= 127.0.0.1:50051
TS      := clients/typescript
# Go toolchain, protoc and Go libraries for the Go client, all from Debian's packages (the
# Go module proxy is not needed: clients/go/check.sh builds in GOPATH mode over these).
GO_DEBS := golang-go protobuf-compiler protoc-gen-go protoc-gen-go-grpc golang-google-grpc-dev \
           golang-google-genproto-dev golang-google-protobuf-dev golang-github-golang-protobuf-1-5-dev

.PHONY: install install-go run test test-unit test-integration lint proto proto-check demo bench \
        clean clean-data

install: $(STAMP) $(TS)/node_modules/.installed install-go

## The venv counts as made only once its pip runs on Python 3.11 or newer: a `$(PY) -m venv`
## that failed half way (Debian and Ubuntu without python3-venv) leaves .venv/bin/python
## behind with no pip, and one made by an older python3 kept being used after the README's
## `PY=python3.11` (an audit); either is removed and made again rather than used.
## Debian and Ubuntu ship venv apart (python3-venv, python3.X-venv): it is installed where
## `$(PY) -m venv` fails and root or passwordless sudo can (scripts/apt-install.sh), and the
## venv made again.
NEW_ENOUGH := -c 'import sys; sys.exit(sys.version_info < (3, 11))'
PY_VENV_DEB = python$$($(PY) -c 'import sys; print("%d.%d" % sys.version_info[:2])')-venv
$(STAMP): pyproject.toml
	{ $(BIN)/python $(NEW_ENOUGH) && $(BIN)/python -m pip --version; } >/dev/null 2>&1 \
	  || { rm -rf $(VENV) && $(PY) -m venv $(VENV); } \
	  || { rm -rf $(VENV) && command -v $(PY) >/dev/null \
	       && scripts/apt-install.sh python3-venv $(PY_VENV_DEB) && $(PY) -m venv $(VENV); } \
	  || { rm -rf $(VENV); echo "$(PY) -m venv failed: is $(PY) installed? On Debian/Ubuntu" \
	       "install python3-venv (python3.11-venv for PY=python3.11)" >&2; exit 1; }
	$(BIN)/python $(NEW_ENOUGH) \
	  || { rm -rf $(VENV); echo "$(PY) is $$($(PY) -V 2>&1): the engine needs Python 3.11 or" \
	       "newer; name one, e.g. make run PY=python3.11" >&2; exit 1; }
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	rm -f $(VENV)/.installed-*
	touch $@

## The TypeScript client's packages (npm ci also builds it); tests/e2e/test_node_client.py.
## Node.js and npm from Debian's packages (Node 18 on Debian 12; older releases ship older
## ones, which are not used) where npm is missing and root or passwordless sudo can.
NODE_18 := node -e 'process.exit(parseInt(process.versions.node, 10) < 18 ? 1 : 0)'
$(TS)/node_modules/.installed: $(TS)/package.json $(TS)/package-lock.json
	@command -v npm >/dev/null 2>&1 || scripts/apt-install.sh nodejs npm || true
	@if command -v npm >/dev/null 2>&1 && $(NODE_18) 2>/dev/null; then \
	  cd $(TS) && npm ci --no-audit --no-fund && touch node_modules/.installed; \
	else echo "no npm with Node.js >= 18: install them for the TypeScript client" >&2; fi

## The Go client's toolchain (tests/e2e/test_go_client.py), installed where missing as root
## or through passwordless sudo (scripts/apt-install.sh); else it says what to install.
install-go:
	@scripts/apt-install.sh $(GO_DEBS) || echo "the Go client check needs: apt-get install $(GO_DEBS)" >&2

## Run the service; with no DATABASE_URL it starts an embedded PostgreSQL under .context-engine/.
run: $(STAMP)
	$(BIN)/context-engine serve --listen $(LISTEN)

## The whole test suite (unit, integration against real PostgreSQL, end-to-end clients).
test: install
	$(BIN)/python -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)

## One layer at a time: pure units (no database), or integration against real PostgreSQL.
test-unit: install
	$(BIN)/python -m pytest -q -p no:cacheprovider tests/unit

test-integration: install
	$(BIN)/python -m pytest -q -p no:cacheprovider tests/integration

## ruff over the code and tests; strict mypy over the whole service (service/context_engine:
## errors inside the generated _gen/ are ignored, its .pyi still types the callers) and the
## Python client.
lint: install
	$(BIN)/ruff format --check service tests bench scripts
	$(BIN)/ruff check service tests bench scripts
	$(BIN)/mypy
	$(BIN)/ruff format --check clients/python/src/context_engine_client/*.py
	$(BIN)/ruff check clients/python/src/context_engine_client/*.py
	cd clients/python && ../../$(BIN)/mypy

## Regenerate the committed gRPC stubs from proto/ (service, Python and TypeScript clients, Go).
proto: install
	$(BIN)/python scripts/gen_protos.py
	clients/go/generate.sh

## Fails when the committed stubs differ from what proto/ generates.
proto-check: install
	$(BIN)/python scripts/gen_protos.py --check
	@tmp=$$(mktemp -d) && clients/go/generate.sh $$tmp \
	  && diff -r $$tmp/contextenginev1 clients/go/contextenginev1 \
	  && rm -rf $$tmp && echo "Go stubs are current"

## A few turns through a live server (start it with `make run` in another terminal).
demo: $(STAMP)
	$(BIN)/python -m context_engine.demo --target $(LISTEN)

## Benchmarks (bench/): ratios measured in one run. LangChain lives only in .venv-bench.
bench: install
	.venv-bench/bin/python -m pip --version >/dev/null 2>&1 \
	  || { rm -rf .venv-bench && $(PY) -m venv .venv-bench; }
	.venv-bench/bin/python -m pip install --quiet -e '.[dev]' langchain-core langchain-openai
	.venv-bench/bin/python -m bench $(BENCH_ARGS)

## What install and the tests leave behind. The sessions of the embedded database `make run`
## starts (.context-engine/pgdata) are kept: they are data, not build output.
clean:
	rm -rf $(VENV) .pytest_cache .hypothesis

## Deletes the embedded database and every session in it (stop `make run` first).
clean-data:
	rm -rf .context-engine
