"""`shoal bench`: end-to-end engine benchmark on `mini` (real per-layer Flash shapes, 8 layers)
with dummy weights on one GPU: decode TPOT per batch size against the step's HBM floor, prefill
tokens/s of the decoder tail-only prefill against `full`, host overhead per step (input
preparation as a share of the step, and on CUDA the share of the step with no device work
queued: scheduling, preparation and output processing that async scheduling does not hide), KV
bytes per token. (benchmarks/bench_e2e.py runs the same.)

    shoal bench [--batches 1 16 64 256] [--prefill-len 8192] [--modes full bounded]

Floor of a decode step = bytes that must move / 4.24 TB/s: every non-expert weight of the
backbone, the expected number of distinct routed experts touched by B tokens
(E * (1 - (1 - k/E)^B) per layer), the LM head, Engram rows and the KV records read.
Prints a table and ends with one JSON line.

Several GPUs: `torchrun --nproc-per-node N -m shoal.cli bench --expert-parallel --model flash`
(one engine per GPU, the experts sharded): B is the batch per rank, and a rank's floor counts
its share, E/N experts touched by the N x B tokens of all ranks, plus its all-to-all bytes
over NVLink (each remote (token, expert) pair out as FP8 codes + scales and back as bf16, at
NVLINK bytes/s per direction); the table is rank 0's, tok/s per GPU = B / TPOT.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
import subprocess
import time

import torch

from shoal import LLM, SamplingParams
from shoal.quant.records import compressed_record_bytes, index_k_record_bytes, swa_record_bytes

HBM = 4.24e12
NVLINK = 450e9  # bytes/s per direction per GPU (H100 / H200 SXM: 18 NVLink 4 links)


def git_commit() -> str:
    """The short HEAD commit, "+dirty" when tracked files differ from it (a benchmark run on a
    working tree, or on a copy whose git metadata lags its files), "?" outside git."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"
    return head + ("+dirty" if dirty else "")


def random_prompt(cfg, length: int, generator: torch.Generator) -> list[int]:
    """`length` token ids drawn uniformly from the ordinary vocabulary of ModelConfig `cfg`:
    ids 3 .. vocab - 1 without the image token (a text engine rejects a prompt holding it)."""
    image = cfg.image_token_id
    skip = image is not None and 3 <= image < cfg.vocab_size
    ids = torch.randint(3, cfg.vocab_size - skip, (length,), generator=generator)
    if skip:
        ids += (ids >= image).long()
    return ids.tolist()


def weight_bytes(llm: LLM) -> tuple[int, int, int]:
    """(non-expert backbone + head bytes, bytes of one routed expert, layers)."""
    params = llm.engine.runner.model.params
    cfg = llm.config.model_config
    dense = 0
    for name in params.names():
        if name.startswith("mtp.") or ".engram.embed." in name or name == "embed.weight":
            continue
        dense += params[name].numel() * params[name].element_size()
    one = params.experts("layers.0.")
    expert = sum(t[0].numel() * t[0].element_size() for t in one.values())
    return dense, expert, cfg.num_layers


def decode_floor(llm: LLM, batch: int, context: int, world: int = 1) -> float:
    """Seconds of one decode step of `batch` requests per rank on `world` expert-parallel
    ranks (module docstring)."""
    cfg = llm.config.model_config
    dense, expert, layers = weight_bytes(llm)
    e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    touched = e / world * (1 - (1 - k / e) ** (world * batch))
    pair = cfg.hidden_size * (1 + 1 / 32) + 8 + 2 * cfg.hidden_size  # out (FP8) and back (bf16)
    exchange = layers * batch * k * (world - 1) / world * pair / NVLINK
    kv = 0
    for spec in cfg.backbone:
        kv += min(context, cfg.sliding_window) * swa_record_bytes(cfg.head_dim)
        if spec.compress_ratio:
            rows = context // spec.compress_ratio
            kv += min(rows, cfg.index_topk) * compressed_record_bytes(cfg.head_dim)
            if spec.owns_index_query:
                kv += rows * index_k_record_bytes(cfg.index_head_dim)
    engram = len(cfg.engram_layer_ids) * cfg.engram_heads_total * (cfg.engram_head_dim + 8)
    total = dense + layers * touched * expert + batch * (kv + engram)
    return total / HBM + exchange


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def decode_prefill_steps(batch: int, prompt_len: int, budget: int) -> int:
    """Steps the prompts of a decode batch take at most: the requests already decoding take up
    to one budgeted token each per step (`main` asks for a budget of at least 2 x batch, so
    this stays at most 2 x prompt_len there)."""
    return -(-batch * prompt_len // max(budget - batch, 1))


def bench_decode(llm: LLM, batch: int, prompt_len: int, steps: int) -> dict:
    g = torch.Generator().manual_seed(batch)
    # every request must still be running when the last one finishes its (budgeted) prefill
    prefill_steps = decode_prefill_steps(batch, prompt_len,
                                         llm.config.scheduler.max_num_batched_tokens)
    params = SamplingParams(max_tokens=steps + 2 + prefill_steps, temperature=0.0,
                            ignore_eos=True)
    groups = [llm.engine.add_request(None, params, prompt_token_ids=random_prompt(
        llm.config.model_config, prompt_len, g)) for _ in range(batch)]
    times, prep, dev, peak = [], [], [], 0
    sched = llm.engine.scheduler
    # No sync between steps: a step's time is the interval between two step() returns. With
    # async scheduling one step is in flight while the host prepares the next and processes
    # the previous (a sync per step would serialise them again); without it, step() returns
    # once its tokens are read, so the interval is the whole step.
    stats = llm.engine.stats
    steps0, overlapped0 = stats.steps, stats.overlapped_steps
    tokens = []  # per timed step: output tokens per request (speculative: 1 + accepted)
    spec0 = (stats.drafts_proposed, stats.drafts_accepted, stats.drafts_skipped,
             stats.verify_rows, list(stats.drafts_proposed_at), list(stats.drafts_accepted_at))
    sync()
    last = time.perf_counter()
    while llm.engine.has_unfinished():
        peak = max(peak, len(sched.running))
        pure_decode = len(sched.running) == batch and all(
            r.num_tokens - r.num_computed_tokens == 1 for r in sched.running)
        before = llm.engine.stats.prepare_time
        dev_before = llm.engine.stats.device_time  # (the step finished in this call)
        out_before = stats.output_tokens
        llm.engine.step()
        now = time.perf_counter()
        dt, last = now - last, now
        if pure_decode:
            times.append(dt)
            tokens.append((stats.output_tokens - out_before) / batch)
            prep.append(llm.engine.stats.prepare_time - before)
            dev.append(llm.engine.stats.device_time - dev_before)
    llm.engine.serve_until_idle()  # expert parallelism: until every rank's batch is done
    errors = [e for e in (llm.engine.output(g_id).error for g_id in groups) if e]
    for g_id in groups:
        llm.engine.release(g_id)
    if not times:  # e.g. fewer slots or blocks than requests: say so instead of a number
        return {"batch": batch, "error": f"no step decoded all {batch} requests together "
                f"(at most {peak} ran at once; slots {sched.max_running}, KV blocks "
                f"{sched.kv.num_blocks}; {len(errors)} requests failed"
                + (f", the first: {errors[0]})" if errors else ")")}
    if errors:  # a timing over failed requests would be meaningless
        return {"batch": batch, "error": f"{len(errors)} of {batch} requests failed; the "
                f"first: {errors[0]}"}
    decode = times[1:] if len(times) > 2 else times  # first pure-decode step compiles
    world = llm.engine.ep.world if llm.engine.ep is not None else 1
    floor = decode_floor(llm, batch, prompt_len + steps // 2, world)
    spec = {}
    if llm.config.runner.speculative:  # a step emits 1 + accepted tokens per request
        per = tokens[1:] if len(tokens) > 2 else tokens
        tpot = statistics.median(dt / max(n, 1e-9) for dt, n in zip(decode, per, strict=True))
        proposed, accepted, skipped = (stats.drafts_proposed - spec0[0],
                                       stats.drafts_accepted - spec0[1],
                                       stats.drafts_skipped - spec0[2])
        rows = stats.verify_rows - spec0[3]

        def since(now: list[int], then: list[int]) -> list[int]:
            return [a - (then[i] if i < len(then) else 0) for i, a in enumerate(now)]

        at = zip(since(stats.drafts_accepted_at, spec0[5]),
                 since(stats.drafts_proposed_at, spec0[4]), strict=True)
        spec = {"step_ms": statistics.median(decode) * 1e3,
                "tokens_per_step": statistics.mean(per), "drafts_verified": proposed,
                "drafts_accepted": accepted, "drafts_skipped": skipped,
                "mean_accepted_length": 1.0 + accepted / rows if rows else 0.0,
                "acceptance_by_position": [a / p if p else None for a, p in at]}
    else:
        tpot = statistics.median(decode)
    return {"batch": batch, "world": world, "tpot_ms": tpot * 1e3, "floor_ms": floor * 1e3,
            "tokens_per_s_per_gpu": batch / tpot, **spec,
            "fraction_of_floor": floor / tpot,
            "host_prepare_share": statistics.median(prep[1:] or prep) / tpot,
            # the share of the step with no device work queued (host: scheduling, input
            # preparation, output processing not overlapped with the device); None off CUDA;
            # floored at 0 (a device-bound step's span can exceed the median interval by jitter)
            "device_idle_share": (max(0.0, 1 - statistics.median(dev[1:] or dev) / tpot)
                                  if any(dev) else None),
            # steps launched before the previous one was finished (async scheduling)
            "overlapped_share": (stats.overlapped_steps - overlapped0)
            / max(stats.steps - steps0, 1)}


def bench_prefill(llm: LLM, prompts: int, length: int, mode: str) -> dict:
    """Prefill `prompts` x `length` tokens with the given tail-only mode (one engine, the mode
    swapped in its runner config between runs so the weights are built once). The warm-up
    prefills, in the same mode, as many prompts of the same length as one step's token budget
    holds (one when a prompt fills it): the decoder layers' row counts differ by mode, length
    and prompts per step, and a step first met inside the timed run would pay for it there (the
    engine's prefill warm-up runs one mode; one warm-up prompt under a 16K budget measured
    bounded at 48K instead of 77K tok/s on the H200, 2026-12-02). Triton compilations inside
    the timed run are counted (`compiled_in_run`, 0 when the number is clean; None without
    Triton)."""
    runner = llm.engine.runner
    runner.config = dataclasses.replace(
        runner.config, runner=dataclasses.replace(runner.config.runner, prefill_mode=mode))
    g = torch.Generator().manual_seed(0)
    per_step = min(prompts, max(1, llm.config.scheduler.max_num_batched_tokens // length))
    batch = [random_prompt(llm.config.model_config, length, g) for _ in range(prompts + per_step)]
    params = SamplingParams(max_tokens=1, temperature=0.0)
    llm.generate([{"prompt_token_ids": b} for b in batch[prompts:]], params,
                 use_tqdm=False)  # warm-up
    s = llm.engine.stats
    skipped0, total0 = s.decoder_rows_skipped, s.decoder_rows_total
    sync()
    with compile_counter() as compiled:
        t0 = time.perf_counter()
        llm.generate([{"prompt_token_ids": b} for b in batch[:prompts]], params,
                     use_tqdm=False)
        sync()
        dt = time.perf_counter() - t0
    skipped = (s.decoder_rows_skipped - skipped0) / max(s.decoder_rows_total - total0, 1)
    return {"mode": mode, "seconds": dt, "tokens_per_s": prompts * length / dt,
            "decoder_row_layers_skipped": skipped,
            "compiled_in_run": None if compiled is None else len(compiled)}


@contextlib.contextmanager
def compile_counter():
    """count_triton_compilations() where Triton is importable, else a None placeholder."""
    try:
        from triton import knobs  # noqa: F401
    except ImportError:
        yield None
        return
    from shoal.runner.cuda_graphs import count_triton_compilations

    with count_triton_compilations() as names:
        yield names


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="shoal bench", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="mini")
    ap.add_argument("--device", default="auto",
                    help="auto (cuda when available), cuda or cpu")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--prefill-prompts", type=int, default=8)
    ap.add_argument("--prefill-len", type=int, default=8192)
    ap.add_argument("--prefill-budget", type=int, default=8192,
                    help="max_num_batched_tokens (at least 2 x the largest batch)")
    ap.add_argument("--skip-prefill", action="store_true")
    ap.add_argument("--modes", nargs="+", default=["full", "bounded", "staircase"],
                    help="prefill modes to time (the first is the baseline)")
    ap.add_argument("--plot", default="bench_e2e_tpot.png", help="where to write the PNG")
    ap.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=True,
                    help="replay pure-decode steps as CUDA graphs (RunnerConfig.cuda_graphs; "
                         "--no-cuda-graphs: eager)")
    ap.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                    help="overlap each step's host work with the previous step's device work "
                         "(RunnerConfig.async_scheduling; --no-async-scheduling: synchronous)")
    ap.add_argument("--all-graph-sizes", action="store_true",
                    help="capture the engine's default batch sizes, not only the measured ones "
                         "(start-up as a user sees it)")
    ap.add_argument("--batch-invariant", action="store_true",
                    help="RunnerConfig.batch_invariant: fixed tilings (report its cost)")
    ap.add_argument("--engram-placement", default="auto", choices=["auto", "device", "host"],
                    help="where the Engram tables live (RunnerConfig.engram_placement)")
    ap.add_argument("--backends", default=None, type=lambda v: tuple(v.split(",")),
                    help="op backend priority, e.g. cuda,triton (RunnerConfig.backends)")
    ap.add_argument("--speculative", action="store_true",
                    help="DSpark drafts verified by exact match: the decode table adds the "
                         "step time, tokens per request and step, and the drafts verified, "
                         "accepted and skipped (random weights accept almost nothing: "
                         "benchmarks/bench_spec.py sets the acceptance)")
    ap.add_argument("--spec-confidence", type=float, default=0.0,
                    help="RunnerConfig.spec_confidence with --speculative")
    ap.add_argument("--expert-parallel", action="store_true",
                    help="under torchrun: shard the routed experts over the ranks (--batches "
                         "are per rank; the floor adds the all-to-all bytes)")
    args = ap.parse_args(argv)
    commit = git_commit()
    on_cuda = args.device != "cpu" and torch.cuda.is_available()
    gpu = torch.cuda.get_device_name() if on_cuda else "cpu"
    result = {"bench": "e2e", "commit": commit, "gpu": gpu, "model": args.model,
              "expert_parallel": args.expert_parallel,
              "cuda_graphs": args.cuda_graphs, "async_scheduling": args.async_scheduling,
              "engram_placement": args.engram_placement,
              "batch_invariant": args.batch_invariant, "backends": args.backends,
              "speculative": args.speculative}
    t0 = time.perf_counter()
    budget = args.prefill_budget
    if budget < 2 * max(args.batches):  # decode_prefill_steps would grow to batch x prompt
        ap.error(f"--prefill-budget {budget} must be at least twice the largest of --batches "
                 f"({max(args.batches)}): each decoding request takes one budgeted token per "
                 "step, and the prompts still prefilling share the rest")
    # bench_decode's max_tokens: steps + 2 + the steps the largest batch's prefill may take
    longest = (args.prompt_len + args.steps + 2 + 16
               + decode_prefill_steps(max(args.batches), args.prompt_len, budget))
    if not args.skip_prefill:
        longest = max(longest, args.prefill_len + 16)
    llm = LLM(args.model, device=args.device, load_format="dummy", cuda_graphs=args.cuda_graphs,
              async_scheduling=args.async_scheduling, engram_placement=args.engram_placement,
              batch_invariant=args.batch_invariant, backends=args.backends,
              speculative=args.speculative, spec_confidence=args.spec_confidence,
              cuda_graph_batch_sizes=() if args.all_graph_sizes else tuple(args.batches),
              max_num_seqs=max(max(args.batches), args.prefill_prompts),
              max_num_batched_tokens=budget,
              max_model_len=longest, expert_parallel=args.expert_parallel)
    say = print if llm.primary else (lambda *a, **k: None)  # rank 0 reports
    origins = dict(llm.engine.runner.ops.origin)
    fallback = sorted(op for op, backend in origins.items() if backend == "reference")
    listed = "all" if len(fallback) == len(origins) else ", ".join(fallback) or "none"
    runner = llm.engine.runner
    graphs = runner.graphs
    result["startup_s"] = {"total": time.perf_counter() - t0,
                           "prefill_warmup": runner.warmup_seconds,
                           "graph_capture": graphs.capture_seconds if graphs else 0.0,
                           "graphs": graphs.num_graphs if graphs else 0}
    say(f"engine ready in {result['startup_s']['total']:.1f} s ({args.model}, {gpu}, "
          f"async_scheduling={args.async_scheduling}, engram {args.engram_placement}, "
          f"batch_invariant={args.batch_invariant}, "
          f"cuda_graphs={args.cuda_graphs}: {result['startup_s']['graphs']} graphs captured in "
          f"{result['startup_s']['graph_capture']:.1f} s after a "
          f"{runner.warmup_seconds:.1f} s prefill warm-up; reference ops: {listed})", flush=True)
    prefill = []
    if not args.skip_prefill:
        for mode in args.modes:
            prefill.append(bench_prefill(llm, args.prefill_prompts, args.prefill_len, mode))
            say(f"prefill {mode:9s} {prefill[-1]['tokens_per_s']:10.0f} tok/s "
                  f"({prefill[-1]['decoder_row_layers_skipped']:.1%} decoder row-layers "
                  f"skipped; {prefill[-1]['compiled_in_run']} kernels compiled in the run)",
                  flush=True)
        base = prefill[0]["tokens_per_s"]
        for p in prefill:
            p["speedup_vs_full"] = p["tokens_per_s"] / base
    result["prefill"] = prefill
    result["kv_bytes_per_token"] = llm.engine.runner.layout.bytes_per_context_token()
    result["op_table"] = dict(llm.engine.runner.ops.origin)
    decode = []
    say(f"{'batch':>5s} {'TPOT ms':>9s} {'floor ms':>9s} {'fraction':>9s} {'tok/s/GPU':>9s} "
          f"{'host share':>10s} {'GPU idle':>9s} {'overlap':>8s}"
          + (f" {'step ms':>8s} {'tok/step':>8s} {'accepted':>15s} {'skipped':>7s}"
             if args.speculative else ""))
    for b in args.batches:
        d = bench_decode(llm, b, args.prompt_len, args.steps)
        decode.append(d)
        if "error" in d:
            say(f"{b:5d} {d['error']}", flush=True)
            continue
        idle = d["device_idle_share"]
        extra = (f" {d['step_ms']:8.2f} {d['tokens_per_step']:8.2f} "
                 f"{d['drafts_accepted']:>7d}/{d['drafts_verified']:<7d} "
                 f"{d['drafts_skipped']:7d}" if args.speculative else "")
        say(f"{b:5d} {d['tpot_ms']:9.2f} {d['floor_ms']:9.3f} {d['fraction_of_floor']:9.3f} "
              f"{d['tokens_per_s_per_gpu']:9.1f} {d['host_prepare_share']:10.1%} {'-' if idle is None else f'{idle:.1%}':>9s} "
              f"{d['overlapped_share']:8.0%}{extra}", flush=True)
        if args.speculative:
            say(f"      mean accepted length {d['mean_accepted_length']:.2f}; acceptance "
                  "by draft position " + " ".join("-" if r is None else f"{r:.2f}"
                                                  for r in d["acceptance_by_position"]))
    result["decode"] = decode
    declined = dict(llm.engine.runner.ops.declined)
    result["declined_calls"] = declined  # op -> calls the fast backend handed to the reference
    if declined:
        say("reference ran for unsupported arguments: "
              + ", ".join(f"{op} x{n}" for op, n in sorted(declined.items())))
    if not llm.primary:
        return 0
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        done = [d for d in decode if "error" not in d]
        xs = [d["batch"] for d in done]
        plt.plot(xs, [d["tpot_ms"] for d in done], "o-", label="shoal TPOT")
        plt.plot(xs, [d["floor_ms"] for d in done], "k--", label="HBM floor")
        plt.xscale("log", base=2)
        plt.yscale("log")
        plt.xlabel("batch")
        plt.ylabel("ms per decode step")
        plt.title(f"{args.model} decode on {gpu}")
        plt.legend()
        plt.savefig(args.plot, dpi=120)
    except ImportError:
        say("(matplotlib missing: no plot)")
    say(json.dumps(result))
    return 0
