"""`shoal generate | run-batch | serve | chat | info | make-checkpoint | demo | bench`.

Errors at start-up (bad model path, bad option, unreadable input, unwritable output) exit
non-zero with one line naming the problem, before the model loads; bad input lines become
per-request errors in the output (`shoal/offline/`), which is valid JSONL at every moment.
Ctrl-C during a run prints what finished and exits 130.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import tempfile
import time

from shoal.config import ShoalError
from shoal.offline.chat import chat_args, cmd_chat
from shoal.serve.command import cmd_serve, serve_args


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny", help="preset (tiny, mini, flash) or checkpoint dir")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads for torch (default: OMP_NUM_THREADS, else the cores)")
    p.add_argument("--prefill-mode", dest="prefill_mode", default=None,
                   choices=["full", "staircase", "bounded"])
    for name, kind in (("replay_window", int), ("max_num_seqs", int), ("max_model_len", int),
                       ("max_num_batched_tokens", int), ("kv_cache_memory_gb", float),
                       ("gpu_memory_utilization", float), ("block_size", int),
                       ("kv_store_ttl_days", float), ("collective_timeout_s", float)):
        p.add_argument("--" + name.replace("_", "-"), dest=name, type=kind, default=None)
    p.add_argument("--load-format", dest="load_format", default=None,
                   choices=["auto", "dummy", "safetensors"])
    p.add_argument("--scheduling-policy", dest="scheduling_policy", default=None,
                   choices=["fcfs", "priority"],
                   help="priority: waiting requests by their 'priority' (lower first)")
    p.add_argument("--seed", type=int, default=None, help="engine seed")
    p.add_argument("--speculative", action="store_true", default=None,
                   help="DSpark drafts with exact-match verification")
    p.add_argument("--spec-verify", dest="spec_verify", default=None,
                   choices=["exact", "rejection"],
                   help="exact: outputs identical to plain decoding; rejection: lossless "
                   "speculative sampling (same distribution, more drafts accepted)")
    p.add_argument("--spec-confidence", dest="spec_confidence", type=float, default=None,
                   help="verify drafts while their chance of acceptance is >= this (0: all)")
    p.add_argument("--spec-verify-budget", dest="spec_verify_budget", type=int, default=None,
                   help="at most this many drafts verified per step, the likeliest (0: all)")
    p.add_argument("--spec-overlap", dest="spec_overlap", action="store_true", default=None,
                   help="plan each verify step while the previous one runs")
    p.add_argument("--batch-invariant", dest="batch_invariant", action="store_true", default=None)
    p.add_argument("--backends", dest="backends", default=None,
                   type=lambda v: tuple(v.split(",")),
                   help="op backend priority, e.g. cuda,triton (default: triton on sm_90+)")
    p.add_argument("--no-async-scheduling", dest="async_scheduling", action="store_false",
                   default=None, help="run each step synchronously (no host/device overlap)")
    p.add_argument("--enable-prefix-caching", dest="enable_prefix_caching", default=None,
                   action="store_true", help="resume after the longest cached prefix (exact)")
    p.add_argument("--prefix-resume", dest="prefix_resume", default=None,
                   choices=["exact", "bounded"])
    p.add_argument("--num-prefix-snapshots", dest="num_prefix_snapshots", type=int,
                   default=None, help="ring snapshots kept for prefix caching (default 64)")
    p.add_argument("--kv-host-memory-gb", dest="kv_host_memory_gb", type=float, default=None,
                   help="prefix caching's host tier: evicted blocks and snapshots kept in "
                   "pinned host memory (default 0: none)")
    p.add_argument("--kv-store-path", dest="kv_store_path", default=None,
                   help="prefix caching's persistent tier: blocks written to this directory "
                   "(10 + 2 erasure-coded shards) and read back by later runs")
    p.add_argument("--kv-store-max-gb", dest="kv_store_max_gb", type=float, default=None,
                   help="the persistent tier's size bound in GB (1e9 bytes); least recently "
                   "used objects are evicted beyond it (default: unbounded)")


ENGINE_FLAGS = ("device", "prefill_mode", "replay_window", "max_num_seqs", "max_num_batched_tokens",
                "max_model_len", "kv_cache_memory_gb", "gpu_memory_utilization", "load_format",
                "seed", "speculative",
                "spec_confidence", "spec_verify_budget", "spec_verify", "async_scheduling",
                "enable_prefix_caching", "num_prefix_snapshots", "kv_host_memory_gb",
                "kv_store_path", "kv_store_ttl_days", "kv_store_max_gb", "block_size",
                "prefix_resume", "expert_parallel", "expert_placement", "batch_invariant",
                "backends", "collective_timeout_s", "scheduling_policy", "spec_overlap")
# the CLI's own defaults: short greedy completions
CLI_SAMPLING_DEFAULTS = {"max_tokens": 32, "temperature": 0.0}
STRUCTURED_FLAGS = ("json_schema", "regex", "grammar", "choice")


def _sampling_args(p: argparse.ArgumentParser, batch: bool = False) -> None:
    """One flag per SamplingParams field (the request seed is --request-seed: --seed is the
    engine's); a JSONL line's own fields override them. batch: `run-batch`'s, which fill only
    the fields a body leaves unset (else the OpenAI defaults apply, as in the server)."""
    from shoal.sampling import SamplingParams

    g = p.add_argument_group("sampling (for the fields a request body leaves unset)" if batch
                             else "sampling (defaults for every request)")
    for f in dataclasses.fields(SamplingParams):
        name, default = f.name, f.default
        if name == "structured":
            continue
        flag = "--request-seed" if name == "seed" else "--" + name.replace("_", "-")
        shown = default if batch else CLI_SAMPLING_DEFAULTS.get(name, default)
        if isinstance(default, bool):
            g.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None,
                           help=f"default {shown}")
        elif name in ("stop", "bad_words"):
            g.add_argument(flag, dest=name, action="append", default=None,
                           help=f"a {'stop string' if name == 'stop' else 'bad word'} "
                           "(repeatable)")
        elif name == "bad_words_token_ids":
            continue  # (bad words as strings; a JSONL line can give token-id lists)
        elif name in ("stop_token_ids", "allowed_token_ids"):
            g.add_argument(flag, dest=name, type=int, nargs="+", default=None)
        elif name == "logit_bias":
            g.add_argument(flag, dest=name, action="append", type=_bias_pair, default=None,
                           metavar="ID=BIAS", help="add BIAS to token ID's logit (repeatable)")
        else:
            kind = float if isinstance(default, float) else int
            g.add_argument(flag, dest=name, type=kind, default=None, help=f"default {shown}")
    g.add_argument("--json-schema", dest="json_schema", default=None,
                   help="structured output: a JSON schema (text, or @file)")
    g.add_argument("--regex", default=None, help="structured output: a regex to match")
    g.add_argument("--grammar", default=None, help="structured output: a Lark grammar")
    g.add_argument("--choice", action="append", default=None,
                   help="structured output: one of these strings (repeatable)")


def _bias_pair(text: str) -> tuple[int, float]:
    token, sep, bias = text.partition("=")
    try:
        return int(token), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ID=BIAS, got {text!r}") from None


def _sampling_flags(args) -> dict:
    """The SamplingParams fields given on the command line."""
    from shoal.sampling import SamplingParams
    from shoal.sampling.structured import StructuredOutputSpec

    fields = {f.name: getattr(args, f.name) for f in dataclasses.fields(SamplingParams)
              if f.name != "structured" and getattr(args, f.name, None) is not None}
    given = {k: getattr(args, k) for k in STRUCTURED_FLAGS if getattr(args, k, None)}
    if given.get("json_schema", "").startswith("@"):
        with open(given["json_schema"][1:], encoding="utf-8") as f:
            given["json_schema"] = f.read()
    if given:
        fields["structured"] = StructuredOutputSpec(**given)
    return fields


def _default_params(args):
    """`shoal generate`'s defaults: the CLI's own under the given flags."""
    from shoal.sampling import SamplingParams

    return SamplingParams(**{**CLI_SAMPLING_DEFAULTS, **_sampling_flags(args)})


def _threads(args) -> None:
    import torch

    env = os.environ.get("OMP_NUM_THREADS", "").strip()  # torch's own default reads it too
    n = args.threads if args.threads is not None else (
        int(env) if env.isdigit() and int(env) > 0 else len(os.sched_getaffinity(0)))
    if n < 1:
        raise ShoalError(f"--threads: got {n}, expected >= 1")
    torch.set_num_threads(n)


def _make_llm(args):
    from shoal.llm import LLM

    _threads(args)
    opts = {k: getattr(args, k) for k in ENGINE_FLAGS if getattr(args, k, None) is not None}
    if getattr(args, "expert_loads_out", None):
        opts["record_expert_loads"] = True
    return LLM(args.model, data_parallel_size=getattr(args, "data_parallel_size", 1), **opts)


def _check_config(args) -> None:
    """The engine options alone (model, device, limits), before anything loads."""
    from shoal.config import EngineConfig

    opts = {k: getattr(args, k) for k in ENGINE_FLAGS if getattr(args, k, None) is not None}
    EngineConfig.create(args.model, **opts)


def _parallel_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data-parallel-size", "--dp", dest="data_parallel_size", type=int,
                   default=1, help="engine replicas in their own processes (one per GPU)")
    p.add_argument("--expert-parallel", dest="expert_parallel", action="store_true",
                   default=None, help="shard the routed experts over the --dp replicas")
    p.add_argument("--expert-placement", dest="expert_placement", default=None,
                   help="an EPLB placement file (shoal eplb)")


def _batch_args(p: argparse.ArgumentParser) -> None:
    _parallel_args(p)
    p.add_argument("--record-expert-loads", dest="expert_loads_out", default=None,
                   help="write the tokens routed to each expert to this JSON file")
    p.add_argument("--resume", action="store_true",
                   help="skip the requests already in --output (by custom_id, else input line) "
                   "and append the rest")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def cmd_generate(args) -> int:
    from shoal.offline.commands import generate

    _check_config(args)
    return generate(args, lambda: _make_llm(args), _default_params(args))


def cmd_run_batch(args) -> int:
    from shoal.offline.commands import run_batch

    _check_config(args)
    return run_batch(args, lambda: _make_llm(args), _sampling_flags(args))


def cmd_info(args) -> int:
    from shoal.info import print_info

    return print_info(args)


def cmd_eplb(args) -> int:
    from shoal.parallel.eplb import eplb_command

    return eplb_command(args)


def cmd_demo(args) -> int:
    """Write the tiny checkpoint, load it back, and generate from it."""
    from shoal.checkpoint.writer import write_checkpoint
    from shoal.info import print_roles
    from shoal.llm import LLM
    from shoal.model.presets import TINY
    from shoal.offline.commands import summary
    from shoal.sampling import SamplingParams

    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        write_checkpoint(TINY, tmp, seed=0)
        print(f"wrote a synthetic tiny checkpoint to {tmp} ({time.perf_counter() - t0:.1f} s)")
        llm = LLM(tmp, device="cpu")
        print(f"loaded it back: {llm.config.model_config.name}")
        print_roles(llm.config.model_config)
        prompts = ["The quick brown fox", "Hello, shoal!", "def add(a, b):"]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0.8, seed=1),
                            use_tqdm=False)
        for o in outs:
            print(json.dumps({"prompt": o.prompt, "text": o.outputs[0].text,
                              "finish_reason": o.outputs[0].finish_reason}, ensure_ascii=False))
        summary(llm, outs, time.perf_counter() - t0)
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
    g.add_argument("--input", help="JSONL: {'prompt' | 'prompt_token_ids' | 'messages': ...} "
                   "per line, with optional sampling fields and 'custom_id'")
    g.add_argument("--output", help="JSONL output, one object per request")
    _batch_args(g)
    g.add_argument("--output-order", dest="output_order", default="input",
                   choices=["input", "completion"],
                   help="input: lines in input order (finished results wait for earlier "
                   "ones); completion: as requests finish")
    g.add_argument("--strict", action="store_true",
                   help="an unknown field in a line makes that line an error (default: a "
                   "warning)")
    b = sub.add_parser("run-batch", help="an OpenAI batch file (/v1/chat/completions, "
                       "/v1/completions) to an OpenAI batch results file")
    _engine_args(b)
    _sampling_args(b, batch=True)
    b.add_argument("-i", "--input", required=True)
    b.add_argument("-o", "--output", required=True)
    _batch_args(b)
    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server")
    _engine_args(s)
    _parallel_args(s)
    serve_args(s)
    c = sub.add_parser("chat", help="interactive chat (streamed)")
    _engine_args(c)
    chat_args(c)
    i = sub.add_parser("info", help="config, layer roles and memory plan")
    i.add_argument("--model", default="tiny")
    i.add_argument("--kv-cache-memory-gb", dest="kv_cache_memory_gb", type=float, default=40.0)
    i.add_argument("--max-num-seqs", dest="max_num_seqs", type=int, default=64)
    i.add_argument("--max-model-len", dest="max_model_len", type=int, default=None,
                   help="default: the model's positions, at most 65536")
    i.add_argument("--gpus", type=int, default=None, help="plan per GPU, experts over N GPUs")
    i.add_argument("--gpu-memory-gb", dest="gpu_memory_gb", type=float, default=141.0)
    i.add_argument("--host-memory-gb", dest="host_memory_gb", type=float, default=None)
    i.add_argument("--enable-prefix-caching", dest="enable_prefix_caching", action="store_true",
                   help="plan the pool as prefix caching sizes it (every block the budget holds)")
    i.add_argument("--num-prefix-snapshots", dest="num_prefix_snapshots", type=int, default=64)
    sub.add_parser("make-checkpoint", add_help=False,
                   help="write a synthetic checkpoint (--preset NAME --out DIR [--seed N])")
    sub.add_parser("demo", help="write the tiny checkpoint, load it back, generate")
    e = sub.add_parser("eplb", help="balanced expert placement from recorded loads")
    e.add_argument("--loads", nargs="+", required=True, help="--record-expert-loads files")
    e.add_argument("--world", type=int, required=True, help="expert-parallel ranks")
    e.add_argument("--redundant", type=int, default=0, help="extra expert copies per layer")
    e.add_argument("--out", required=True, help="the placement file (--expert-placement)")
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
        return {"generate": cmd_generate, "run-batch": cmd_run_batch, "serve": lambda a: cmd_serve(a, _check_config, _make_llm),
                "chat": lambda a: cmd_chat(a, _check_config, _make_llm), "info": cmd_info, "demo": cmd_demo,
                "eplb": cmd_eplb}[args.command](args)
    except (ShoalError, OSError, ValueError) as exc:
        print(f"shoal: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

