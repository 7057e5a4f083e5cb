"""Serving cost: the same workload through `LLM.generate` (offline) and through `shoal serve`
(a loopback server over the same engine, streaming clients of the `openai` library at a given
concurrency and request rate, in a separate process so that they do not share the server's
interpreter lock), in one run. Reports output tok/s of both, the server's share of
the offline throughput, TTFT / inter-token / end-to-end latency percentiles, and the CPU
seconds of the engine's thread and of the web thread in each phase (/proc, Linux): the
server's host work shares one interpreter lock with the engine loop.

    python benchmarks/bench_serve.py --model mini --load-format dummy --num-prompts 256 \\
        --concurrency 64 --prompt-len 512 --output-len 128
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import socket
import statistics
import sys
import threading
import time

from shoal import LLM, SamplingParams
from shoal.bench import git_commit


def _thread_cpu() -> dict[str, float]:
    """CPU seconds so far of this process's Python threads, by thread name (Linux)."""
    tick = os.sysconf("SC_CLK_TCK")
    cpu = {}
    for t in threading.enumerate():
        try:
            with open(f"/proc/self/task/{t.native_id}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        cpu[t.name] = (int(fields[11]) + int(fields[12])) / tick  # utime + stime
    return cpu


def _spent(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {name: round(v - before.get(name, 0.0), 2) for name, v in after.items()
            if v - before.get(name, 0.0) > 0.005}


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    qs = statistics.quantiles(values, n=100, method="inclusive") if len(values) > 1 \
        else [values[0]] * 99
    return {"mean": statistics.fmean(values) * 1e3, "p50": qs[49] * 1e3, "p90": qs[89] * 1e3,
            "p99": qs[98] * 1e3}


async def _clients(base: str, prompts: list[list[int]], output_len: int, concurrency: int,
                   rate: float) -> tuple[list[dict], float]:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=3600)
    gate = asyncio.Semaphore(concurrency)
    rng = random.Random(0)

    async def one(ids: list[int]) -> dict:
        async with gate:
            start, times, tokens = time.perf_counter(), [], 0
            # logprobs=0 puts each step's tokens in its chunk, so latency is timed per token
            # even where a token's text is empty (an incomplete UTF-8 sequence)
            stream = await client.completions.create(
                model="bench", prompt=ids, max_tokens=output_len, temperature=0.0, stream=True,
                logprobs=0, stream_options={"include_usage": True},
                extra_body={"ignore_eos": True})
            async for chunk in stream:
                lp = chunk.choices[0].logprobs if chunk.choices else None
                if lp is not None and lp.tokens:
                    times.append((time.perf_counter(), len(lp.tokens)))
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
            end = time.perf_counter()
            return {"ttft": times[0][0] - start if times else end - start, "e2e": end - start,
                    # a chunk of n tokens after the first spreads its interval over n tokens
                    "itl": [(b - a) / n for (a, _), (b, n) in zip(times, times[1:],
                                                                  strict=False)],
                    "tokens": tokens}

    tasks = []
    t0 = time.perf_counter()
    for ids in prompts:
        tasks.append(asyncio.create_task(one(ids)))
        if rate != float("inf"):
            await asyncio.sleep(rng.expovariate(rate))
    results = await asyncio.gather(*tasks)
    return results, time.perf_counter() - t0


def _client_process(base: str, prompts: list[list[int]], output_len: int, concurrency: int,
                    rate: float, out: multiprocessing.Queue) -> None:
    out.put(asyncio.run(_clients(base, prompts, output_len, concurrency, rate)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="mini")
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--request-rate", type=float, default=float("inf"))
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--switch-intervals", type=float, nargs="+", default=None,
                    help="serve once per interpreter switch interval (sys.setswitchinterval, "
                         "seconds; default: the interpreter's)")
    args = ap.parse_args()
    import uvicorn

    from shoal.serve.app import create_app
    from shoal.serve.engine_loop import Limits

    llm = LLM(args.model, device=args.device, load_format=args.load_format,
              max_num_seqs=args.max_num_seqs,
              max_model_len=args.prompt_len + args.output_len + 8)
    rng = random.Random(1)
    vocab = llm.config.model_config.vocab_size
    prompts = [[rng.randrange(100, vocab) for _ in range(args.prompt_len)]
               for _ in range(args.num_prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True,
                            logprobs=0)
    llm.generate(prompts[: min(8, len(prompts))], params, use_tqdm=False)  # warm
    cpu0, t0 = _thread_cpu(), time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    offline_s = time.perf_counter() - t0
    offline_cpu = _spent(cpu0, _thread_cpu())
    offline_tokens = sum(len(o.outputs[0].token_ids) for o in outs)

    app = create_app(llm, model_name="bench", limits=Limits(max_queued_requests=1 << 20,
                                                            max_queued_prompt_tokens=1 << 40))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    ctx = multiprocessing.get_context("spawn")
    default_interval = sys.getswitchinterval()
    for interval in args.switch_intervals or [default_interval]:
        sys.setswitchinterval(interval)
        queue = ctx.Queue()
        client = ctx.Process(target=_client_process, args=(
            f"http://127.0.0.1:{port}", prompts, args.output_len, args.concurrency,
            args.request_rate, queue))
        cpu0 = _thread_cpu()
        client.start()
        results, served_s = queue.get()
        served_cpu = _spent(cpu0, _thread_cpu())
        client.join()
        served_tokens = sum(r["tokens"] for r in results)
        summary = {
            "bench": "serve", "commit": git_commit(), "model": args.model,
            "num_prompts": args.num_prompts, "concurrency": args.concurrency,
            "request_rate": args.request_rate, "prompt_len": args.prompt_len,
            "output_len": args.output_len, "switch_interval_s": interval,
            "offline": {"seconds": offline_s, "output_tok_s": offline_tokens / offline_s,
                        "thread_cpu_s": offline_cpu},
            "served": {"seconds": served_s, "output_tok_s": served_tokens / served_s,
                       "thread_cpu_s": served_cpu},
            "served_share_of_offline": (served_tokens / served_s) / (offline_tokens / offline_s),
            "ttft_ms": _percentiles([r["ttft"] for r in results]),
            "itl_ms": _percentiles([x for r in results for x in r["itl"]]),
            "e2e_ms": _percentiles([r["e2e"] for r in results]),
        }
        print(f"switch interval {interval * 1e3:g} ms: offline "
              f"{summary['offline']['output_tok_s']:.1f} tok/s | served "
              f"{summary['served']['output_tok_s']:.1f} tok/s "
              f"({summary['served_share_of_offline']:.1%} of offline)")
        print("thread CPU s: offline", offline_cpu, "| served", served_cpu)
        for key in ("ttft_ms", "itl_ms", "e2e_ms"):
            print(key, {k: round(v, 2) for k, v in summary[key].items()})
        print(json.dumps(summary))
    sys.setswitchinterval(default_interval)
    server.should_exit = True
    thread.join(60)


if __name__ == "__main__":
    main()
