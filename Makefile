# The README's two commands: `make demo` and `make test`. Both set up ./.venv first.
.PHONY: setup demo test lint

# Triton kernels checked on the CPU under the Triton interpreter (on an H200 they run natively
# as part of the main suite; tests/kernels/test_sm90_builds.py skips itself under it).
INTERPRETED_TESTS = tests/kernels

setup:
	bash scripts/setup.sh

demo: setup
	.venv/bin/shoal demo

# Two lanes side by side on a 2-core machine: the main suite, and the Triton kernels under the
# interpreter (one Python thread) followed by the server and prefix-cache suites (LANE2), so that
# both lanes take about as long. The second lane's log prints after the main one.
LANE2 = tests/serve tests/engine/test_prefix_caching.py

test: setup
	@mkdir -p build; \
	( TRITON_INTERPRET=1 .venv/bin/python -m pytest -p no:cacheprovider $(INTERPRETED_TESTS); \
	  kernels=$$?; .venv/bin/python -m pytest -p no:cacheprovider $(LANE2); \
	  exit $$(( kernels | $$? )) ) > build/lane2-tests.log 2>&1 & \
	lane2=$$!; \
	.venv/bin/python -m pytest $(addprefix --ignore=,$(LANE2)); main=$$?; \
	wait $$lane2; second=$$?; \
	echo "== lane 2: tests/kernels under the Triton interpreter, then $(LANE2) =="; \
	cat build/lane2-tests.log; \
	test $$main -eq 0 -a $$second -eq 0

lint: setup
	.venv/bin/ruff check src tests benchmarks
