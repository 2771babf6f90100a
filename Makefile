# specd: `make demo` sets everything up and runs the main job; `make test` runs the checks and tests.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin

.PHONY: setup demo test lint typecheck unit bench mutants protos wheel clean llama-server

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(BIN)/specd demo

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: setup
	$(BIN)/mypy

# The llama.cpp server is built first where it can be (cached; tests/llama skip, saying why, where it cannot).
unit: setup
	-$(BIN)/specd llama-server-build
	$(BIN)/pytest -q

# llama.cpp's server, built from the llama-cpp-python source distribution (minutes the first time; cached under
# ~/.cache/specd): the tests run the shipped pair through it.
llama-server: setup
	$(BIN)/specd llama-server-build

test: lint typecheck unit

protos: setup
	$(BIN)/python -m specd.protos

# The one wheel: `pip install dist/specd-*.whl` is the controller, `'dist/specd-*.whl[worker]'` adds the worker.
wheel: setup
	$(BIN)/pip wheel --no-deps --no-build-isolation -w dist .

bench: setup
	$(BIN)/python benchmarks/decode_loop.py

# Plant the named bugs of benchmarks/mutations.py in a temporary copy and check that the tests catch each (~15 min).
mutants: setup
	$(BIN)/python benchmarks/mutations.py

clean:
	rm -rf $(VENV) .cache .mypy_cache .ruff_cache .pytest_cache *.egg-info build dist
