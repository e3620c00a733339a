# One task runner. `make run` and `make test` are the two commands a newcomer needs;
# both install what they need first (into .venv), so neither assumes a prepared machine.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed-$(shell cat pyproject.toml | sha256sum | cut -c1-12)
LISTEN  ?= 127.0.0.1:50051

.PHONY: install run test test-unit test-integration lint proto proto-check demo bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	rm -f $(VENV)/.installed-*
	touch $@

## Run the service; with no DATABASE_URL it starts an embedded PostgreSQL under .context-engine/.
run: install
	$(BIN)/context-engine serve --listen $(LISTEN)

## The whole test suite (unit, integration against real PostgreSQL, end-to-end clients).
test: install
	$(BIN)/python -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)

test-unit: install
	$(BIN)/python -m pytest -q tests/unit

lint: install
	$(BIN)/ruff format --check service tests bench scripts
	$(BIN)/ruff check service tests bench scripts
	$(BIN)/mypy

## Regenerate the committed gRPC stubs from proto/.
proto: install
	$(BIN)/python scripts/gen_protos.py

## Fails when the committed stubs differ from what proto/ generates.
proto-check: install
	$(BIN)/python scripts/gen_protos.py --check

## A few turns through a live server (start it with `make run` in another terminal).
demo: install
	$(BIN)/python -m context_engine.demo --target $(LISTEN)

bench: install
	$(BIN)/python -m bench

clean:
	rm -rf $(VENV) .context-engine .pytest_cache .hypothesis
