"""`shoal generate` and `shoal run-batch`: a file of requests through an LLM into a file of
results, checked before the model loads, ordered, resumable and interruptible.

Invariant: the output file is valid JSONL at every moment (whole lines, flushed); a Ctrl-C
aborts what is running, prints what finished and exits 130; `--resume` skips the requests an
earlier run wrote (by custom_id, else input line) and appends the rest.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from shoal.config import ShoalError
from shoal.engine.outputs import Logprob, RequestOutput
from shoal.offline.openai_batch import batch_result, parse_batch_line
from shoal.offline.output import ResultWriter, check_writable, keys_of, written_keys
from shoal.offline.requests import RequestLine, line_error, read_requests
from shoal.sampling import SamplingParams
from shoal.serve.logprobs import LogprobFormat

INTERRUPTED = 130  # the shell's exit status for SIGINT
FAILED = 1  # the run stopped on an error after it started (a replica died, a collective timed out)


def logprob_entries(position: dict[int, Logprob] | None) -> list[dict] | None:
    """A position's logprobs as a list by rank (the sampled or prompt token may rank lower
    than the top ones): {"token_id", "token", "logprob", "rank"}."""
    if position is None:
        return None
    return [{"token_id": t, "token": v.decoded_token, "logprob": v.logprob, "rank": v.rank}
            for t, v in sorted(position.items(), key=lambda kv: kv[1].rank)]


def record(request: RequestLine, out: RequestOutput) -> dict:
    """`shoal generate`'s result line."""
    rec: dict[str, Any] = {"line": request.line}
    if request.custom_id is not None:
        rec["custom_id"] = request.custom_id
    rec["prompt"] = out.prompt
    if out.error:
        rec["error"] = line_error(request.line, out.error)
    comps = []
    for c in out.outputs:
        d: dict[str, Any] = {"text": c.text, "token_ids": c.token_ids,
                             "finish_reason": c.finish_reason}
        if c.stop_reason is not None:
            d["stop_reason"] = c.stop_reason
        for key in ("reasoning_content", "content", "tool_calls", "cumulative_logprob"):
            if getattr(c, key) is not None:
                d[key] = getattr(c, key)
        if c.logprobs is not None:
            d["logprobs"] = [logprob_entries(p) for p in c.logprobs]
        comps.append(d)
    rec["outputs"] = comps
    if out.prompt_logprobs is not None:
        rec["prompt_logprobs"] = [logprob_entries(p) for p in out.prompt_logprobs]
    if out.metrics and out.metrics.latency is not None:
        rec["latency_s"] = round(out.metrics.latency, 4)
    if out.num_cached_tokens:
        rec["num_cached_tokens"] = out.num_cached_tokens
    return rec


def check_paths(input_path: str | None, output_path: str | None) -> None:
    """ShoalError now (before the model loads) for an unreadable input or unwritable output."""
    try:
        if input_path is not None:
            with open(input_path, encoding="utf-8"):
                pass
        if output_path is not None:
            check_writable(output_path)
    except OSError as exc:
        raise ShoalError(str(exc)) from None


def prefix_summary(stats) -> str:
    """The prefix cache's line of the summary ('' when caching is off)."""
    if stats is None:
        return ""
    return (f" | prefix cache: {stats.hit_tokens}/{stats.query_tokens} prompt tokens hit "
            f"({stats.hit_rate:.0%}; {stats.host_hit_tokens} from host memory, "
            f"{stats.store_hit_tokens} from the store), {stats.snapshots_saved} ring "
            f"snapshots saved, {stats.snapshot_evictions} evicted")


def summary(llm, outs: Sequence[RequestOutput], elapsed: float) -> None:
    if not llm.primary:
        return
    where, s, prefix = "", None, None
    if llm.replicas is not None:  # data parallel: the replicas' counters, summed
        where = f" on {llm.replicas.size} replicas"
        with contextlib.suppress(ShoalError):  # (a replica gone: what the outputs say)
            s, prefix = llm.replicas.stats()
    elif llm.engine is not None and llm.torchrun is None:
        s, prefix = llm.engine.stats, llm.engine.scheduler.prefix_stats
    errors = sum(1 for o in outs if o.error)
    if s is None:  # torchrun ranks: what the outputs say
        tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
        size = llm.replicas.size if llm.replicas is not None else llm.torchrun.world
        print(f"{len(outs)} requests ({errors} errors) on {size} replicas | output tokens "
              f"{tokens} | {elapsed:.2f} s | {tokens / max(elapsed, 1e-9):.1f} output tok/s",
              file=sys.stderr)
        return
    share = s.decoder_rows_skipped / s.decoder_rows_total if s.decoder_rows_total else 0.0
    print(f"{len(outs)} requests{where} ({errors} errors, {s.preemptions} preemptions) | prompt "
          f"tokens {s.prompt_tokens} | output tokens {s.output_tokens} | {elapsed:.2f} s | "
          f"{s.output_tokens / max(elapsed, 1e-9):.1f} output tok/s | tail-only prefill "
          f"skipped {share:.0%} of decoder work"
          + prefix_summary(prefix)
          + (f" | drafts accepted {s.drafts_accepted}/{s.drafts_proposed} (mean accepted "
             f"length {s.mean_accepted_length:.2f}; by position "
             + " ".join(f"{a}/{p}" for a, p in zip(s.drafts_accepted_at, s.drafts_proposed_at,
                                                    strict=True))
             + (f"; {s.drafts_skipped} skipped by the confidence rule)" if s.drafts_skipped
                else ")") if s.drafts_proposed or s.drafts_skipped else ""), file=sys.stderr)


def run_requests(llm, requests: list[RequestLine], write: Callable[[int, RequestOutput], None],
                 *, progress: bool) -> tuple[list[RequestOutput], BaseException | None]:
    """Run `requests`, calling `write(position, output)` as each finishes; returns the outputs
    that finished and what stopped the run early: a KeyboardInterrupt (Ctrl-C), a ShoalError
    (a replica died, a collective timed out), or None. What was written stays written."""
    outs: list[RequestOutput] = []
    try:
        for position, out in llm.run([r.item for r in requests], use_tqdm=progress):
            outs.append(out)
            write(position, out)
    except (KeyboardInterrupt, ShoalError) as exc:
        return outs, exc
    return outs, None


def _start(make_llm: Callable[[], Any]):
    """The LLM; on the primary rank, a line of how long its start took and where."""
    llm = make_llm()
    if llm.primary:
        print(f"shoal: {llm.startup_summary()}", file=sys.stderr)
    return llm


def _open_output(llm, path: str | None, resume: bool):
    """The output file (appended to with --resume); torchrun ranks other than 0 write nowhere."""
    if not llm.primary:
        return open(os.devnull, "w", encoding="utf-8")
    return open(path, "a" if resume else "w", encoding="utf-8")


def _pending(requests: list[RequestLine], output: str | None, resume: bool
             ) -> list[RequestLine]:
    """The requests still to run (--resume: those the output does not hold), each item with
    its position in the whole input as its `request_index`, which seeds an unseeded request:
    a resumed run samples what an uninterrupted one would."""
    done = written_keys(output) if resume and output else set()
    return [replace(r, item=dict(r.item, request_index=i))
            for i, (r, key) in enumerate(zip(requests, keys_of(requests), strict=True))
            if key not in done]


def _finish(llm, outs, total: int, skipped: int, stopped: BaseException | None,
            elapsed: float, held: int) -> int:
    if stopped is not None and llm.primary:
        why = "interrupted" if isinstance(stopped, KeyboardInterrupt) else f"error: {stopped}"
        print(f"shoal: {why}: {len(outs)} of {total} requests finished"
              + (f" ({held} of them not written: they wait for an earlier request in input "
                 "order)" if held else "") + "; --resume runs the rest", file=sys.stderr)
    if skipped and llm.primary:
        print(f"shoal: resumed: {skipped} requests were already in the output", file=sys.stderr)
    if not isinstance(stopped, ShoalError):  # a failed group has no stats to give
        summary(llm, outs, elapsed)
    if stopped is None:
        return 0
    return INTERRUPTED if isinstance(stopped, KeyboardInterrupt) else FAILED


def generate(args, make_llm: Callable[[], Any], default: SamplingParams) -> int:
    check_paths(args.input, args.output)
    def warn(name: str) -> None:
        print(f"shoal: warning: unknown field {name!r} ignored (--strict makes it an error)",
              file=sys.stderr)

    if args.input:
        if args.prompt:
            raise ShoalError("--prompt and --input: give one of them")
        requests = list(read_requests(args.input, default, strict=args.strict, warn=warn))
    else:
        requests = [RequestLine(i + 1, None, {"prompt": p, "sampling_params": default})
                    for i, p in enumerate(args.prompt or ["Hello, shoal!"])]
    pending = _pending(requests, args.output, args.resume)
    llm = _start(make_llm)
    stream = _open_output(llm, args.output, args.resume) if args.output or not llm.primary \
        else sys.stdout
    writer = ResultWriter(stream, args.output_order)
    t0 = time.perf_counter()
    try:
        outs, stopped = run_requests(
            llm, pending, lambda i, out: writer.add(i, record(pending[i], out)),
            progress=not args.quiet and args.output is not None and llm.primary)
    finally:
        if stream is not sys.stdout:
            stream.close()
    if getattr(args, "expert_loads_out", None) and stopped is None:  # `--record-expert-loads`
        loads = llm.expert_loads()
        if llm.primary:
            Path(args.expert_loads_out).write_text(json.dumps(loads))
    return _finish(llm, outs, len(pending), len(requests) - len(pending), stopped,
                   time.perf_counter() - t0, writer.num_held)


def run_batch(args, make_llm: Callable[[], Any], flags: dict[str, Any]) -> int:
    """OpenAI batch file in, OpenAI batch results out (always in input order). `flags`: the
    sampling fields given on the command line (they fill what a body leaves unset)."""
    check_paths(args.input, args.output)
    model = os.path.basename(os.path.normpath(args.model))
    with open(args.input, encoding="utf-8") as f:
        lines = [parse_batch_line(text, n, model, flags,
                                  lambda m: print(f"shoal: warning: {m}", file=sys.stderr))
                 for n, text in enumerate(f, 1) if text.strip()]
    requests = [RequestLine(b.line, b.custom_id, item) for b in lines for item in b.items]
    owner = [i for i, b in enumerate(lines) for _ in b.items]  # request -> its line
    first = {i: j for j, i in reversed(list(enumerate(owner)))}  # a line's first request
    pending = _pending(requests, args.output, args.resume)
    slot = {li: pos for pos, li in enumerate(  # a pending line's place among them
        dict.fromkeys(owner[r.item["request_index"]] for r in pending))}
    llm = _start(make_llm)
    fmt = LogprobFormat(llm.tokenizer)
    done: dict[int, dict[int, RequestOutput]] = {}

    def write(i: int, out: RequestOutput) -> None:  # a line's result once its requests are in
        index = pending[i].item["request_index"]
        li = owner[index]
        outs = done.setdefault(li, {})
        outs[index - first[li]] = out
        if len(outs) == len(lines[li].items):
            writer.add(slot[li], batch_result(lines[li], [outs[k] for k in range(len(outs))],
                                              model, fmt))

    with _open_output(llm, args.output, args.resume) as stream:
        writer = ResultWriter(stream, "input")
        t0 = time.perf_counter()
        outs, stopped = run_requests(llm, pending, write, progress=not args.quiet and llm.primary)
    return _finish(llm, outs, len(pending), len(requests) - len(pending), stopped,
                   time.perf_counter() - t0, writer.num_held)
