# The README's two commands: `make demo` and `make test`. Both set up ./.venv first.
.PHONY: setup demo test lint

# Triton kernels checked on the CPU under the Triton interpreter (on an H200 they run natively
# as part of the main suite; tests/kernels/test_sm90_builds.py skips itself under it).
INTERPRETED_TESTS = tests/kernels

setup:
	bash scripts/setup.sh

demo: setup
	.venv/bin/shoal demo

test: setup
	.venv/bin/python -m pytest
	TRITON_INTERPRET=1 .venv/bin/python -m pytest $(INTERPRETED_TESTS)

lint: setup
	.venv/bin/ruff check src tests benchmarks
