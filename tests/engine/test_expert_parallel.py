"""Expert parallelism on the CPU (gloo): the routed experts sharded over 2 and 4 replicas give
world 1's outputs bitwise with the reference ops (tokens, logprobs, seeded samples) for mixed
batches, uneven shares, a replica with no requests, a tight KV pool (preemption) and a request
too long; the MoE exchange alone equals the reference op; each rank loads only its experts; an
interrupt leaves the replicas usable; a dead or hung rank ends the call with an error;
speculative decoding; uneven splits fail clearly."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from shoal import LLM, SamplingParams
from shoal.cli import main
from shoal.config import EngineConfig, ShoalError
from shoal.model.params import ExpertShard, ModelParams
from shoal.ops.reference.moe import _moe_case, moe_mxfp4
from shoal.ops.registry import resolve_ops
from shoal.parallel.data_parallel import _free_port
from shoal.parallel.expert_parallel import ExpertParallel
from shoal.runner.loading import iter_weights
from support.interrupt import interrupt_after

OPTS = {"device": "cpu", "max_num_seqs": 6, "max_model_len": 128}
G = torch.Generator().manual_seed(11)
PROMPTS = [torch.randint(0, 500, (n,), generator=G).tolist()
           for n in (3, 41, 7, 1, 66, 12, 25, 2, 90, 5, 33, 17, 4, 58, 9, 21)]
PARAMS = [SamplingParams(temperature=0.0, max_tokens=5, logprobs=3, ignore_eos=True),
          SamplingParams(temperature=0.9, seed=7, max_tokens=4, logprobs=2, ignore_eos=True),
          SamplingParams(temperature=0.7, max_tokens=6, ignore_eos=True),  # seed from index
          SamplingParams(temperature=0.0, max_tokens=3, n=2, ignore_eos=True)] * 4


def _view(outs):
    return [(o.error, [(c.token_ids, c.finish_reason,
                        None if c.logprobs is None else
                        [sorted((t, v.logprob) for t, v in e.items()) for e in c.logprobs])
                       for c in o.outputs]) for o in outs]


def _ranks_give(world: int, opts: dict, *calls) -> None:
    """On `world` expert-parallel ranks, each call (prompts, params, want) gives `want`."""
    llm = LLM("tiny", data_parallel_size=world, expert_parallel=True, **opts)
    try:
        for prompts, params, want in calls:
            assert _view(llm.generate(prompts, params, use_tqdm=False)) == want
    finally:
        llm.close()


@pytest.fixture(scope="module")
def expected():
    return _view(LLM("tiny", **OPTS).generate(PROMPTS, PARAMS, use_tqdm=False))


@pytest.mark.parametrize("world", [2, 4])
def test_world_n_equals_world_1(expected, world) -> None:
    # then one request: every other rank only serves its experts
    _ranks_give(world, OPTS, (PROMPTS, PARAMS, expected),
                (PROMPTS[4:5], PARAMS[4:5], expected[4:5]))


def test_a_tight_pool_and_a_request_too_long() -> None:
    """6 blocks of 128 per rank for 4 running requests: requests are preempted on some
    ranks while the others step; a prompt over max_model_len gets its error, the rest
    complete."""
    opts = dict(OPTS, max_model_len=256, block_size=128, kv_cache_memory_gb=0.00015,
                max_num_seqs=4)
    prompts = [(p * 130)[:122 + i] for i, p in enumerate(PROMPTS[:4])] + [list(range(1, 300))]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = LLM("tiny", **opts)
    want = _view(alone.generate(prompts, params, use_tqdm=False))
    assert alone.engine.stats.preemptions > 0
    assert want[-1][0] is not None and all(w[0] is None for w in want[:-1])
    _ranks_give(2, opts, (prompts, params, want))


def test_an_interrupt_leaves_the_ranks_usable(expected) -> None:
    llm = LLM("tiny", data_parallel_size=2, expert_parallel=True, **OPTS)
    try:
        with pytest.raises(KeyboardInterrupt), interrupt_after(1.5):
            llm.generate([[5, 6, 7]] * 8, SamplingParams(max_tokens=120, ignore_eos=True),
                         use_tqdm=False)
        # the interrupted call used request indices: compare the requests with fixed seeds
        fixed = [i for i, p in enumerate(PARAMS) if p.seed is not None or p.temperature == 0]
        got = _view(llm.generate(PROMPTS, PARAMS, use_tqdm=False))
        assert [got[i] for i in fixed] == [expected[i] for i in fixed]
    finally:
        llm.close()


def _exchange_rank(rank: int, world: int, port: int, rows: list[int], fixed: bool,
                   errors) -> None:
    """Case t >= 0: every rank its own t rows; t < 0: -t rows on rank 0, the others serve."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=60))
    try:
        ops = resolve_ops("cpu", ["reference"])
        for case, n in enumerate(rows):  # every rank makes every case; uses its own rows
            t = abs(n)
            kw = _moe_case(max(map(abs, rows)) * world, 64, 32, 8, 3, shared=True).make(
                torch.Generator().manual_seed(100 + case), torch.device("cpu"))
            lo = rank * t
            args = {k: kw[k][lo:lo + t] for k in ("x", "ids", "weights", "shared")}
            want = moe_mxfp4(**args, **{k: kw[k] for k in ("w13", "w13_scale", "w2",
                                                           "w2_scale", "limit")})
            ep = ExpertParallel(rank, world)
            local = ep.local_experts(8)
            experts = {k: kw[k][local.start:local.stop]
                       for k in ("w13", "w13_scale", "w2", "w2_scale")}
            with ep.fixed_exchange(t) if fixed else contextlib.nullcontext():
                if n >= 0 or rank == 0:
                    got = ep.moe(ops, args["x"], args["ids"], args["weights"], args["shared"],
                                 experts, kw["limit"])
                    if not torch.equal(got, want):
                        errors.put(f"rank {rank} case {case}: max diff "
                                   f"{(got.float() - want.float()).abs().max()}")
                else:  # no tokens here: serve the others
                    ep.serve(ops, experts, kw["limit"], torch.device("cpu"), 3)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        errors.put(f"rank {rank}: {type(exc).__name__}: {exc}")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("fixed", [False, True], ids=["by-counts", "fixed"])
def test_the_exchange_equals_the_reference_op(fixed: bool) -> None:
    """Random tokens and routes on 2 ranks, each with its own rows (then rank 1 with none):
    bitwise the reference moe_mxfp4 over all 8 experts, exchanging by counts or fixed sizes
    (every rank the same number of rows, as in a CUDA graph step)."""
    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    port = _free_port()
    rows = [5, 1, 37, -9] if fixed else [5, 1, 37, 0, -4]
    procs = [ctx.Process(target=_exchange_rank, args=(r, 2, port, rows, fixed, errors))
             for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    found = []
    while not errors.empty():
        found.append(errors.get())
    assert not found, found
    assert all(p.exitcode == 0 for p in procs)


def test_each_rank_loads_only_its_experts() -> None:
    config = EngineConfig.create("tiny", device="cpu")
    cfg = config.model_config
    whole = ModelParams.load(cfg, iter_weights(config, torch.device("cpu")))
    names = [n for n, _ in iter_weights(config, torch.device("cpu"), ExpertShard(1, 4))]
    assert not [n for n in names if ".ffn.experts.0." in n or ".ffn.experts.4." in n]
    part = ModelParams.load(cfg, iter_weights(config, torch.device("cpu"), ExpertShard(1, 4)),
                            "cpu", ExpertShard(1, 4))
    for prefix in ("layers.0.", f"layers.{cfg.num_layers - 1}."):
        got, full = part.experts(prefix), whole.experts(prefix)
        per = cfg.n_routed_experts // 4
        assert got["w13"].shape[0] == per
        for key in ("w13", "w13_scale", "w2", "w2_scale"):
            assert torch.equal(got[key], full[key][per:2 * per])


def test_speculative_decoding_on_two_ranks() -> None:
    """DSpark drafting and verification with the experts sharded (a rank without drafts
    serves the draft block's experts): world 1's tokens and logprobs."""
    opts = dict(OPTS, speculative=True)
    prompts, params = PROMPTS[:6], PARAMS[:6]
    want = _view(LLM("tiny", **opts).generate(prompts, params, use_tqdm=False))
    _ranks_give(2, opts, (prompts, params, want), (prompts[1:2], params[1:2], want[1:2]))


def test_an_uneven_split_fails_clearly() -> None:
    config = EngineConfig.create("tiny", device="cpu").model_config
    with pytest.raises(ShoalError, match="do not split evenly"):
        ExpertParallel(0, 3).shard(config)
    assert ExpertParallel(1, 2).shard(config).local(config, "layers.0.") == {
        4: 0, 5: 1, 6: 2, 7: 3}


def test_generate_cli_with_expert_parallel(tmp_path) -> None:
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(f'{{"prompt_token_ids": [{5 + i}, 6]}}\n' for i in range(3)),
                   encoding="utf-8")
    assert main(["generate", "--model", "tiny", "--device", "cpu", "--max-model-len", "64",
                 "--max-tokens", "3", "--quiet", "--dp", "2", "--expert-parallel",
                 "--input", str(src), "--output", str(dst)]) == 0
    want = LLM("tiny", device="cpu", max_model_len=64).generate(
        [[5 + i, 6] for i in range(3)], SamplingParams(max_tokens=3, temperature=0.0),
        use_tqdm=False)
    got = [json.loads(x) for x in dst.read_text().splitlines()]
    assert [r["outputs"][0]["token_ids"] for r in got] == [o.outputs[0].token_ids for o in want]


def test_a_dead_rank_ends_the_call_with_an_error() -> None:
    llm = LLM("tiny", data_parallel_size=2, expert_parallel=True, **OPTS)
    try:
        llm.replicas.processes[1].kill()
        with pytest.raises(ShoalError, match="rank 1"):
            llm.generate(PROMPTS[:4], PARAMS[:4], use_tqdm=False)
        with pytest.raises(ShoalError, match="stopped after an error"):
            llm.generate(PROMPTS[:1], PARAMS[:1], use_tqdm=False)
    finally:
        llm.close()


def test_a_hung_rank_ends_the_call_within_the_collective_timeout() -> None:
    llm = LLM("tiny", data_parallel_size=2, expert_parallel=True, collective_timeout_s=5,
              **OPTS)
    pid = llm.replicas.processes[1].pid
    try:
        os.kill(pid, signal.SIGSTOP)  # alive, but it never joins the next collective
        start = time.monotonic()
        with pytest.raises(ShoalError, match="replica 0"):  # rank 0's collective times out
            llm.generate(PROMPTS[:4], PARAMS[:4], use_tqdm=False)
        assert time.monotonic() - start < 120  # the timeout, not the 30-minute answer bound
        with pytest.raises(ShoalError, match="stopped after an error"):
            llm.generate(PROMPTS[:1], PARAMS[:1], use_tqdm=False)
    finally:
        os.kill(pid, signal.SIGCONT)
        llm.close()


def _shared_rank(rank: int, port: int, errors) -> None:
    from shoal.model.weights import is_engram_table
    from shoal.runner.loading import NodeShare

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=60))
    try:
        ep = ExpertParallel(rank, 2)
        config = EngineConfig.create("tiny", device="cpu")
        share = NodeShare(ep.shared_key(), rank == 0, ep.barrier)
        got = dict(iter_weights(config, torch.device("cpu"), ExpertShard(rank, 2),
                                is_engram_table, share))
        want = dict(iter_weights(config, torch.device("cpu"), ExpertShard(rank, 2)))
        tables = [n for n in want if is_engram_table(n)]
        assert tables and got.keys() == want.keys()
        for name, tensor in want.items():
            assert torch.equal(got[name].view(torch.uint8), tensor.view(torch.uint8)), name
        ep.barrier()  # both compared: the files are gone, the mappings live on
        leftover = list(Path("/dev/shm").glob(f"shoal-{share.key}-*"))
        assert not leftover, leftover
    except Exception as exc:  # noqa: BLE001 - reported to the test
        errors.put(f"rank {rank}: {type(exc).__name__}: {exc}")
    finally:
        dist.destroy_process_group()


def test_host_tables_are_shared_by_the_ranks_of_a_node() -> None:
    """The Engram tables under host placement: rank 0 writes them into /dev/shm once, both
    ranks map them, get the tensors the plain loader gives, and no file is left behind."""
    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_shared_rank, args=(r, port, errors)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    found = []
    while not errors.empty():
        found.append(errors.get())
    assert not found, found
    assert all(p.exitcode == 0 for p in procs)
