#!/usr/bin/env bash
# One batched GPU session on a bare H200 machine (torch + Triton preinstalled, no network):
#   bash scripts/h200_run.sh STAGE[:SECONDS] ...      results under $OUT (default ./h200_out)
# Stages: tests (tests/kernels, tests/cuda and tests/ops: on the H200 about 4 min for the
# kernels and tests/cuda without test_cuda_graphs.py, 3+ min for that file, 2 min for the
# conformance suite; the whole suite also runs the engine tests on CUDA and does not fit one
# 10-minute call; TEST_ARGS replaces the paths, e.g. "tests/kernels -k moe"), probe (every Triton op at real shapes, one fresh process
# each), ops (benchmarks/bench_ops.py), moe (benchmarks/bench_moe.py --quick), profile
# (benchmarks/profile_decode.py at batch 1 and 64; PROFILE_ARGS adds arguments), e2e (shoal bench; E2E_ARGS adds arguments),
# invariance (scripts/probe_row_invariance.py: which fast ops change a row's bits with the batch),
# spec (benchmarks/bench_spec.py; SPEC_ARGS adds arguments), startup (benchmarks/bench_startup.py:
# a cold then a warm LLM("mini")), official (the fast ops against the official reference's
# fixture: tests/model/test_official_layers.py and test_official_goldens.py, CUDA cases),
# ep (machines of several GPUs: `shoal bench --expert-parallel` under torchrun on every GPU,
# EP_MODEL (default flash), EP_ARGS adds arguments, e.g. "--engram-placement host"), dp (the
# offline workload: `shoal generate --dp N --expert-parallel` on DP_REQUESTS (default 4000)
# requests of 1-4K random prompt tokens and 256 output tokens; requests/s and tok/s on stderr),
# epmoe (benchmarks/bench_ep.py on every GPU: one MoE layer's exchange against its experts;
# EPMOE_ARGS adds arguments, e.g. "--model flash").
# Packages the machine lacks travel as wheels in .whl/ (README, Tests and benchmarks).
set -u
OUT=${OUT:-h200_out}
mkdir -p "$OUT"
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader > "$OUT/gpu.txt"
git rev-parse --short HEAD >> "$OUT/gpu.txt" 2>/dev/null

for spec in "$@"; do
    stage=${spec%%:*}
    limit=${spec#*:}
    [ "$limit" = "$spec" ] && limit=300
    start=$(date +%s)
    case $stage in
        tests) per_test=""  # one hung test must not eat the stage (pytest-timeout, if present;
               # 300 s: a mini engine test starts two engines of about 80 s each)
               python3 -c "import pytest_timeout" 2>/dev/null && per_test="--timeout 300"
               timeout "$limit" python3 -m pytest ${TEST_ARGS:-tests/kernels tests/cuda tests/ops} -rfEs \
                   --tb=short -p no:cacheprovider --durations=25 $per_test > "$OUT/tests.log" 2>&1 ;;
        probe) for op in ${PROBE_OPS:-index_scores index_scores@decode index_scores@prefill \
                   index_scores@odd sparse_attn_sink topk_rows candidate_mask swa_write \
                   compressed_write index_k_write index_q_quant rope_tail rmsnorm hc_coeffs \
                   hc_collapse_norm hc_post router moe_mxfp4 act_quant_fp8}; do
                   timeout 60 python3 scripts/probe_triton_ops.py "$op" 2>&1 | tail -1
               done > "$OUT/probe.log" ;;
        ops) timeout "$limit" python3 benchmarks/bench_ops.py --quick --out "$OUT" \
                 ${OPS_ARGS:-} > "$OUT/ops.txt" 2>&1 ;;
        moe) timeout "$limit" python3 benchmarks/bench_moe.py --quick ${MOE_ARGS:-} \
                 > "$OUT/moe.txt" 2>&1 ;;
        invariance) PYTHONPATH=$PYTHONPATH:scripts timeout "$limit" \
                 python3 scripts/probe_row_invariance.py > "$OUT/invariance.txt" 2>&1 ;;
        profile) timeout "$limit" python3 benchmarks/profile_decode.py --batch 1 --batch 64 ${PROFILE_ARGS:-} \
                     --out "$OUT" > /dev/null 2> "$OUT/profile_err.log" ;;
        e2e) timeout "$limit" python3 -m shoal.cli bench --plot "$OUT/bench_e2e_tpot.png" \
                 ${E2E_ARGS:-} > "$OUT/e2e.txt" 2>&1 ;;
        spec) timeout "$limit" python3 benchmarks/bench_spec.py ${SPEC_ARGS:-} \
                  > "$OUT/spec.txt" 2>&1 ;;
        startup) timeout "$limit" python3 benchmarks/bench_startup.py > "$OUT/startup.txt" 2>&1 ;;
        official) timeout "$limit" python3 -m pytest tests/model/test_official_layers.py \
                      tests/model/test_official_goldens.py -k cuda -rfEsx -s --tb=short \
                      -p no:cacheprovider > "$OUT/official.txt" 2>&1 ;;
        ep) timeout "$limit" python3 -m torch.distributed.run --standalone \
                --nproc-per-node "$(nvidia-smi -L | wc -l)" -m shoal.cli bench --expert-parallel \
                --model "${EP_MODEL:-flash}" --plot "$OUT/bench_ep_tpot.png" ${EP_ARGS:-} \
                > "$OUT/ep.txt" 2>&1 ;;
        epmoe) timeout "$limit" python3 -m torch.distributed.run --standalone \
                   --nproc-per-node "$(nvidia-smi -L | wc -l)" benchmarks/bench_ep.py \
                   ${EPMOE_ARGS:-} > "$OUT/epmoe.txt" 2>&1 ;;
        dp) python3 -c "import json, random; r = random.Random(0); print('\n'.join(json.dumps(
                {'prompt_token_ids': [r.randrange(1000, 100000) for _ in range(r.randint(1024, 4096))]})
                for _ in range(${DP_REQUESTS:-4000})))" > "$OUT/dp_in.jsonl"
            timeout "$limit" python3 -m shoal.cli generate --model "${EP_MODEL:-flash}" \
                --load-format dummy --dp "$(nvidia-smi -L | wc -l)" --expert-parallel \
                --max-tokens 256 --ignore-eos --temperature 0 --quiet --input "$OUT/dp_in.jsonl" \
                --output "$OUT/dp_out.jsonl" ${DP_ARGS:-} > "$OUT/dp.txt" 2>&1
            echo "output lines: $(wc -l < "$OUT/dp_out.jsonl")" >> "$OUT/dp.txt"
            rm -f "$OUT/dp_in.jsonl" "$OUT/dp_out.jsonl" ;;
        *) echo "unknown stage $stage" >&2; exit 2 ;;
    esac
    echo "$stage rc=$? $(( $(date +%s) - start ))s" | tee -a "$OUT/stages.txt"
done
