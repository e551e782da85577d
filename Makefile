# tokenmill: `make serve` runs the default model's server, `make test` runs the test suite.
# Both install into ./.venv first (CPU torch pinned, so pip never pulls a CUDA build).

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PYTEST_ARGS ?=

.PHONY: install generate serve test bench clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml requirements-cpu.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -r requirements-cpu.txt
	$(BIN)/pip install --quiet -e '.[test]'
	touch $@

generate: install
	$(BIN)/tokenmill pull
	$(BIN)/tokenmill generate --chat "Write a haiku about a mill by a river."

serve: install
	$(BIN)/tokenmill serve

test: install
	$(BIN)/tokenmill pull
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

bench: install
	$(BIN)/tokenmill bench offline --num-prompts 64 --input-len-min 64 --input-len-max 512 \
		--output-len 128 --json results/offline.jsonl

clean:
	rm -rf $(VENV) .pytest_cache
