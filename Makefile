# The README's two commands: `make demo` and `make test`. Both set up ./.venv first.
.PHONY: setup demo test lint

# Triton kernels checked on the CPU under the Triton interpreter (on an H200 they run natively
# as part of the main suite; tests/kernels/test_sm90_builds.py skips itself under it).
INTERPRETED_TESTS = tests/kernels

setup:
	bash scripts/setup.sh

demo: setup
	.venv/bin/shoal demo

# The two suites run side by side: the interpreter is one Python thread, so on a 2-core machine
# they overlap well; suites whose torch ops use threads of their own would oversubscribe the
# cores, so they stay in the main lane. The interpreted log prints after the main one.
test: setup
	@mkdir -p build; \
	TRITON_INTERPRET=1 .venv/bin/python -m pytest -p no:cacheprovider $(INTERPRETED_TESTS) \
		> build/interpreted-tests.log 2>&1 & \
	interpreted=$$!; \
	.venv/bin/python -m pytest; main=$$?; \
	wait $$interpreted; kernels=$$?; \
	echo "== tests/kernels under the Triton interpreter (TRITON_INTERPRET=1) =="; \
	cat build/interpreted-tests.log; \
	test $$main -eq 0 -a $$kernels -eq 0

lint: setup
	.venv/bin/ruff check src tests benchmarks
