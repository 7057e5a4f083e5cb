# The README's two commands: `make demo` and `make test`. Both set up ./.venv first.
.PHONY: setup demo test lint
setup:
	bash scripts/setup.sh

demo: setup
	.venv/bin/shoal demo

test: setup
	.venv/bin/python -m pytest

lint: setup
	.venv/bin/ruff check src tests benchmarks
