"""`shoal generate | chat | info | make-checkpoint | demo | bench`.

Errors at start-up (bad model path, bad option) exit non-zero with one line naming the problem;
bad input lines become per-request errors in the output, which is written one JSON object per
line as requests finish (an interrupted run leaves a valid file of what finished).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from typing import Any

from shoal.config import ShoalError

SAMPLING_FIELDS = ("n", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                   "presence_penalty", "frequency_penalty", "seed", "max_tokens", "min_tokens",
                   "stop", "stop_token_ids", "ignore_eos", "logprobs", "prompt_logprobs",
                   "include_stop_str_in_output", "skip_special_tokens")


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny", help="preset (tiny, mini, flash) or checkpoint dir")
    p.add_argument("--device", default="auto")
    p.add_argument("--prefill-mode", dest="prefill_mode", default=None,
                   choices=["full", "staircase", "bounded"])
    p.add_argument("--replay-window", dest="replay_window", type=int, default=None)
    p.add_argument("--max-num-seqs", dest="max_num_seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", dest="max_num_batched_tokens", type=int,
                   default=None)
    p.add_argument("--max-model-len", dest="max_model_len", type=int, default=None)
    p.add_argument("--kv-cache-memory-gb", dest="kv_cache_memory_gb", type=float, default=None)
    p.add_argument("--load-format", dest="load_format", default=None,
                   choices=["auto", "dummy", "safetensors"])
    p.add_argument("--seed", type=int, default=None, help="engine seed")
    p.add_argument("--speculative", action="store_true", default=None,
                   help="DSpark drafts with exact-match verification")
    p.add_argument("--no-async-scheduling", dest="async_scheduling", action="store_false",
                   default=None, help="run each step synchronously (no host/device overlap)")


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", dest="max_tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", dest="top_p", type=float, default=1.0)
    p.add_argument("--top-k", dest="top_k", type=int, default=0)
    p.add_argument("--stop", action="append", default=None)


def _make_llm(args):
    from shoal.llm import LLM

    opts = {k: getattr(args, k) for k in ("device", "prefill_mode", "replay_window",
                                           "max_num_seqs", "max_num_batched_tokens",
                                           "max_model_len", "kv_cache_memory_gb",
                                           "load_format", "seed", "speculative",
                                           "async_scheduling")
            if getattr(args, k, None) is not None}
    return LLM(args.model, **opts)


def _default_params(args):
    from shoal.sampling import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                          top_p=args.top_p, top_k=args.top_k, stop=args.stop)


def _read_jsonl(path: str, default) -> list[dict]:
    """One LLM.run item per non-empty line; a malformed line becomes an error item."""
    items = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                if not isinstance(obj, dict):
                    raise ValueError("expected a JSON object")
                fields = {k: obj[k] for k in SAMPLING_FIELDS if k in obj}
                params = default.replace(**fields) if fields else default
                keys = [k for k in ("prompt", "prompt_token_ids", "messages") if k in obj]
                if len(keys) != 1:
                    raise ValueError("expected exactly one of 'prompt', 'prompt_token_ids' "
                                     "or 'messages'")
                item = {keys[0]: obj[keys[0]], "sampling_params": params}
                if keys[0] == "messages":
                    item.update({k: obj[k] for k in ("tools", "reasoning_effort") if k in obj})
                items.append(item)
            except (ValueError, TypeError) as exc:
                items.append({"error": f"line {n}: {exc}", "sampling_params": default})
    return items


def _record(index: int, out) -> dict:
    rec: dict[str, Any] = {"index": index, "request_id": out.request_id, "prompt": out.prompt}
    if out.error:
        rec["error"] = out.error
    comps = []
    for c in out.outputs:
        d = {"text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason}
        if c.stop_reason is not None:
            d["stop_reason"] = c.stop_reason
        for key in ("reasoning_content", "content", "tool_calls"):
            if getattr(c, key) is not None:
                d[key] = getattr(c, key)
        comps.append(d)
    rec["outputs"] = comps
    if out.metrics and out.metrics.latency is not None:
        rec["latency_s"] = round(out.metrics.latency, 4)
    return rec


def cmd_generate(args) -> int:
    llm = _make_llm(args)
    default = _default_params(args)
    if args.input:
        items = _read_jsonl(args.input, default)
    else:
        items = [{"prompt": p, "sampling_params": default}
                 for p in (args.prompt or ["Hello, shoal!"])]
    t0 = time.perf_counter()
    results: list[Any] = [None] * len(items)
    out_f = open(args.output, "w", encoding="utf-8") if args.output else None
    try:  # one line per request as it finishes: an interrupted run leaves a valid file
        for index, out in llm.run(items, use_tqdm=not args.quiet):
            results[index] = out
            if out_f is not None:
                out_f.write(json.dumps(_record(index, out), ensure_ascii=False) + "\n")
                out_f.flush()
    finally:
        if out_f is not None:
            out_f.close()
    if not args.output:
        for index, out in enumerate(results):
            print(json.dumps(_record(index, out), ensure_ascii=False))
    _summary(llm, results, time.perf_counter() - t0)
    return 0


def _summary(llm, results, elapsed: float) -> None:
    s = llm.engine.stats
    layout = llm.engine.runner.layout
    rows = s.decoder_rows_skipped / s.decoder_rows_total if s.decoder_rows_total else 0.0
    print(f"requests {len(results)} ({sum(1 for r in results if r.error)} errors) | input tokens "
          f"{s.prompt_tokens} | output tokens {s.output_tokens} | {elapsed:.2f} s | "
          f"{s.output_tokens / max(elapsed, 1e-9):.1f} tok/s | KV "
          f"{layout.bytes_per_context_token():.0f} B/token | decoder row-layers skipped by "
          f"tail-only prefill {s.decoder_rows_skipped} ({rows:.1%})"
          + (f" | drafts accepted {s.drafts_accepted}/{s.drafts_proposed}"
             if s.drafts_proposed else ""), file=sys.stderr)


def cmd_chat(args) -> int:
    from shoal.sampling import SamplingParams

    llm = _make_llm(args)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    messages: list[dict] = []
    print("shoal chat: an empty line or Ctrl-D quits", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        messages.append({"role": "user", "content": line})
        out = llm.chat(messages, params, use_tqdm=False,
                       reasoning_effort=args.reasoning_effort)[0]
        if out.error:
            print(f"error: {out.error}")
            messages.pop()
            continue
        c = out.outputs[0]
        if c.reasoning_content:
            print(f"[reasoning] {c.reasoning_content}")
        print(c.content)
        messages.append({"role": "assistant", "content": c.content or "",
                         "reasoning_content": c.reasoning_content})
    return 0


def cmd_info(args) -> int:
    from shoal.config import resolve_model_config
    from shoal.runner.cache_memory import plan_memory

    cfg = resolve_model_config(args.model)
    print(f"model {args.model}: {cfg.name}, {cfg.num_layers} layers + {cfg.num_draft_layers} "
          f"draft, hidden {cfg.hidden_size}, vocab {cfg.vocab_size}")
    layout = _print_roles(cfg)
    budget = int(args.kv_cache_memory_gb * 1e9)
    plan = plan_memory(layout, budget, args.max_num_seqs, args.max_model_len)
    print(f"memory plan for {args.kv_cache_memory_gb} GB: {plan.num_blocks} blocks of "
          f"{plan.block_size} tokens ({plan.max_context_tokens} context tokens), "
          f"{plan.num_slots} request slots")
    return 0


def _print_roles(cfg):
    """Print the layer table and the KV sizes; returns the cache layout."""
    from shoal.runner.cache_memory import CacheLayout

    print(f"decoder (tail-only prefill) layers {cfg.decoder_start}..{cfg.num_layers - 1}")
    print("layer ratio role      kv_src topk_src extras")
    for s in cfg.layers:
        extras = " ".join(x for x, on in (("engram", s.has_engram),
                                          ("candidate-source", s.is_candidate_source),
                                          ("candidates", s.uses_candidates),
                                          ("draft", s.is_draft)) if on)
        print(f"{s.layer_id:5d} {s.compress_ratio:5d} {s.role.name:9s} "
              f"{'-' if s.kv_source is None else s.kv_source:>6} "
              f"{'-' if s.topk_source is None else s.topk_source:>8} {extras}")
    layout = CacheLayout.from_model_config(cfg)
    print(f"KV bytes per context token: {layout.bytes_per_context_token():.0f}; per request "
          f"slot (SWA rings + compressor state): {layout.bytes_per_slot / 2**20:.2f} MiB")
    return layout


def cmd_demo(args) -> int:
    """Write the tiny checkpoint, load it back, and generate from it."""
    from shoal.checkpoint.writer import write_checkpoint
    from shoal.llm import LLM
    from shoal.model.presets import TINY
    from shoal.sampling import SamplingParams

    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        write_checkpoint(TINY, tmp, seed=0)
        print(f"wrote a synthetic tiny checkpoint to {tmp} ({time.perf_counter() - t0:.1f} s)")
        llm = LLM(tmp, device="cpu")
        print(f"loaded it back: {llm.config.model_config.name}")
        _print_roles(llm.config.model_config)
        prompts = ["The quick brown fox", "Hello, shoal!", "def add(a, b):"]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0.8, seed=1),
                            use_tqdm=False)
        for o in outs:
            print(json.dumps({"prompt": o.prompt, "text": o.outputs[0].text,
                              "finish_reason": o.outputs[0].finish_reason}, ensure_ascii=False))
        _summary(llm, outs, time.perf_counter() - t0)
        print("(random weights: the text is noise; the pipeline is real)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shoal", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="offline generation (prompts or a JSONL file)")
    _engine_args(g)
    _sampling_args(g)
    g.add_argument("--prompt", action="append")
    g.add_argument("--input", help="JSONL: {'prompt': ...} or {'messages': [...]} per line")
    g.add_argument("--output", help="JSONL output, one object per request")
    g.add_argument("--quiet", action="store_true", help="no progress bar")
    c = sub.add_parser("chat", help="interactive chat")
    _engine_args(c)
    c.add_argument("--max-tokens", dest="max_tokens", type=int, default=256)
    c.add_argument("--temperature", type=float, default=0.6)
    c.add_argument("--reasoning-effort", dest="reasoning_effort", default=None)
    i = sub.add_parser("info", help="config, layer roles and memory plan")
    i.add_argument("--model", default="tiny")
    i.add_argument("--kv-cache-memory-gb", dest="kv_cache_memory_gb", type=float, default=40.0)
    i.add_argument("--max-num-seqs", dest="max_num_seqs", type=int, default=64)
    i.add_argument("--max-model-len", dest="max_model_len", type=int, default=65536)
    sub.add_parser("make-checkpoint", add_help=False,
                   help="write a synthetic checkpoint (--preset NAME --out DIR [--seed N])")
    sub.add_parser("demo", help="write the tiny checkpoint, load it back, generate")
    sub.add_parser("bench", add_help=False,
                   help="end-to-end mini benchmark on the GPU (shoal bench --help)")
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:  # its own parser (shoal.bench)
        from shoal.bench import main as bench_main

        return bench_main(argv[1:])
    if argv[:1] == ["make-checkpoint"]:  # its own parser (writer.make_checkpoint_main)
        from shoal.checkpoint.writer import make_checkpoint_main

        try:
            return make_checkpoint_main(argv[1:])
        except (ShoalError, OSError, ValueError) as exc:
            print(f"shoal: error: {exc}", file=sys.stderr)
            return 2
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return {"generate": cmd_generate, "chat": cmd_chat, "info": cmd_info,
                "demo": cmd_demo}[args.command](args)
    except ShoalError as exc:
        print(f"shoal: error: {exc}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as exc:
        print(f"shoal: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

