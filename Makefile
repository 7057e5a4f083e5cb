# The README's two commands: `make demo` and `make test`. Both set up ./.venv first.
.PHONY: setup demo test lint

# Triton kernels checked on the CPU under the Triton interpreter (on an H200 they run natively
# as part of the main suite).
INTERPRETED_TESTS = tests/gpu/test_triton_attention_path.py tests/gpu/test_moe_kernels.py \
	tests/gpu/test_fp4_tiles.py \
	tests/gpu/test_triton_remaining_ops.py tests/gpu/test_triton_head.py tests/gpu/test_gemm_fp8.py

setup:
	bash scripts/setup.sh

demo: setup
	.venv/bin/shoal demo

test: setup
	.venv/bin/python -m pytest
	TRITON_INTERPRET=1 .venv/bin/python -m pytest $(INTERPRETED_TESTS)

lint: setup
	.venv/bin/ruff check src tests benchmarks
