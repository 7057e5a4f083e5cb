"""Prefix caching end to end on CPU: requests that resume after a cached prefix (ring snapshot
restored, shared blocks) give bitwise the tokens and log-probs of a run without the cache, in
every tail-only prefill mode, for prefixes ending inside a block, on a block boundary and past
several blocks; and with async scheduling, n > 1 and prompt log-probs in one batch."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest
import torch

from shoal import LLM, SamplingParams
from shoal.checkpoint.writer import write_checkpoint
from shoal.model.cache_layout import CacheLayout
from shoal.model.presets import TINY

BLOCK = 128


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny with room for several 128-token blocks per prompt."""
    config = dataclasses.replace(TINY, name="tiny-long", max_position_embeddings=1024)
    return write_checkpoint(config, tmp_path_factory.mktemp("ckpt") / "tiny-long", seed=0)


def prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randint(3, 500) for _ in range(300)]
    out = [shared + [rng.randint(3, 500) for _ in range(n)] for n in (5, 60, 140)]
    return out + [shared[:256], shared[:200]]  # on a block boundary; inside the second block


def llm(checkpoint: Path, cache: bool, **kwargs) -> LLM:
    return LLM(str(checkpoint), device="cpu", max_model_len=600, kv_cache_memory_gb=0.05,
               block_size=BLOCK, enable_prefix_caching=cache, **kwargs)


def outputs(engine: LLM, batch: list[list[int]], params: SamplingParams) -> list:
    return view(engine.generate([{"prompt_token_ids": p} for p in batch], params,
                                use_tqdm=False))


def view(outs) -> list:
    return [[(c.token_ids, [{t: lp.logprob for t, lp in d.items()} for d in c.logprobs or ()])
             for c in o.outputs] + [o.prompt_logprobs] for o in outs]


GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=5)


@pytest.mark.parametrize("mode, hits", [("full", 768), ("staircase", 768), ("bounded", 384)])
def test_resumed_requests_equal_a_run_without_the_cache(checkpoint: Path, mode: str,
                                                        hits: int) -> None:
    """One request at a time (each finds the earlier ones cached). full: every later prompt
    resumes at its last block boundary with a cached block and snapshot (256, 256, 128, 128);
    bounded: only where the new tail covers the replay window (W = 140). Each output counts
    the prompt tokens it did not compute."""
    batch = prompts(11)
    plain = llm(checkpoint, False, prefill_mode=mode, async_scheduling=False)
    cached = llm(checkpoint, True, prefill_mode=mode, async_scheduling=False)
    spared = []
    for prompt in batch:
        got = cached.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)
        assert view(got) == outputs(plain, [prompt], GREEDY)
        spared.append(got[0].num_cached_tokens)
    stats = cached.engine.scheduler.prefix_stats
    assert stats.hit_tokens == hits
    assert spared[0] == 0 and sum(spared) == hits
    if mode != "bounded":
        assert spared == [0, 256, 256, 128, 128]
    assert stats.queries == len(batch)
    cached.engine.scheduler.check_invariants()


def test_one_batch_with_async_scheduling_n_and_prompt_logprobs(checkpoint: Path) -> None:
    """All requests at once: the later ones wait for the first one's blocks and resume after
    them; n = 2 sampled sequences and a prompt-logprobs request (which computes every row)
    give what a run without the cache gives."""
    batch = prompts(12)
    sampled = SamplingParams(temperature=0.8, max_tokens=5, ignore_eos=True, logprobs=3, n=2,
                             seed=5)
    with_prompt = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True,
                                 prompt_logprobs=2)
    plain = llm(checkpoint, False, prefill_mode="full")
    cached = llm(checkpoint, True, prefill_mode="full")
    for params in (GREEDY, sampled):
        assert outputs(cached, batch, params) == outputs(plain, batch, params)
    hits = cached.engine.scheduler.prefix_stats.hit_tokens
    assert hits > 0
    assert outputs(cached, batch[:1], with_prompt) == outputs(plain, batch[:1], with_prompt)
    assert cached.engine.scheduler.prefix_stats.hit_tokens == hits  # it did not resume
    usage = cached.engine.scheduler.usage()
    assert usage.num_free_blocks == usage.num_blocks


def test_blocks_evicted_to_the_host_tier_come_back_for_a_hit(checkpoint: Path) -> None:
    """A device pool of 7 blocks: two long unrelated prompts evict the shared prefix's blocks;
    with a host tier they move to host memory and the next request sharing the prefix copies
    them back (a quarter of its hit) and still gets bitwise the tokens and log-probs of a run
    without the cache."""
    layout = CacheLayout.from_model_config(
        dataclasses.replace(TINY, max_position_embeddings=1024), block_size=BLOCK)
    snapshots = 8
    budget = (2 * layout.bytes_per_slot + 7.5 * layout.bytes_per_block
              + snapshots * layout.bytes_per_snapshot)
    rng = random.Random(3)
    shared = [rng.randint(3, 500) for _ in range(300)]

    def other(n: int) -> list[int]:
        return [rng.randint(3, 500) for _ in range(n)]

    batch = [shared + other(10), other(500), other(500), shared + other(50), shared[:260]]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=5)
    runs = []
    for cache, host in ((False, 0.0), (True, 0.0), (True, 0.001)):
        engine = LLM(str(checkpoint), device="cpu", max_model_len=600,
                     kv_cache_memory_gb=budget / 1e9, max_num_seqs=2, prefill_mode="full",
                     block_size=BLOCK, enable_prefix_caching=cache,
                     num_prefix_snapshots=snapshots, kv_host_memory_gb=host,
                     async_scheduling=False)
        runs.append(([outputs(engine, [p], params) for p in batch],
                     engine.engine.scheduler.prefix_stats))
        if cache:
            engine.engine.scheduler.check_invariants()
    (plain, _), (device_only, device_stats), (tiered, host_stats) = runs
    assert device_only == plain and tiered == plain
    assert (device_stats.hit_tokens, device_stats.host_hit_tokens) == (256, 0)
    assert (host_stats.hit_tokens, host_stats.host_hit_tokens) == (512, 256)


def test_one_request_at_a_time_keeps_the_whole_budget_as_cache(checkpoint: Path) -> None:
    """max_num_seqs = 1: the device pool is the whole budget, not one request's blocks, so a
    prefix seen two requests earlier still hits."""
    rng = random.Random(4)
    shared = [rng.randint(3, 500) for _ in range(300)]
    batch = [shared + [7], [rng.randint(3, 500) for _ in range(500)], shared + [9, 9]]
    engine = llm(checkpoint, True, prefill_mode="full", max_num_seqs=1, num_prefix_snapshots=8,
                 async_scheduling=False)
    assert engine.engine.scheduler.usage().num_blocks > 5  # (one request: 5 blocks)
    spared = [engine.generate([{"prompt_token_ids": p}], GREEDY, use_tqdm=False)[0]
              .num_cached_tokens for p in batch]
    assert spared == [0, 0, 256]


def test_the_store_serves_a_new_engine_and_a_corrupt_store_is_a_miss(
        checkpoint: Path, tmp_path: Path) -> None:
    """An engine writes its blocks and its prompt-end snapshot to the store; a new engine (a
    restart) on the same directory resumes a request sharing the prefix from it, with the
    tokens and log-probs of a run without the cache. With 3 of each object's 12 shards
    corrupted, the objects are misses: nothing resumes, the outputs are still right."""
    rng = random.Random(4)
    shared = [rng.randint(3, 500) for _ in range(300)]
    first, second = shared + [7] * 10, shared + [rng.randint(3, 500) for _ in range(50)]
    store = tmp_path / "kv"
    plain = llm(checkpoint, False, prefill_mode="full")
    expected = outputs(plain, [second], GREEDY)

    def run(prompt: list[int]) -> tuple[list, object]:
        engine = llm(checkpoint, True, prefill_mode="full", kv_store_path=str(store))
        got = outputs(engine, [prompt], GREEDY)
        engine.engine.runner.offload.flush()
        return got, engine.engine.scheduler.prefix_stats

    run(first)
    got, stats = run(second)
    assert got == expected
    assert (stats.hit_tokens, stats.store_hit_tokens) == (256, 256)
    for shard_dir in sorted(store.iterdir())[:3]:
        for path in shard_dir.rglob("*.kvs"):
            data = bytearray(path.read_bytes())
            data[-1] ^= 0xFF
            path.write_bytes(bytes(data))
    got, stats = run(second)
    assert got == expected and stats.hit_tokens == 0


def test_engines_sharing_a_store_serve_each_other(checkpoint: Path, tmp_path: Path) -> None:
    """Two engines open one store directory (data-parallel replicas): blocks one writes after
    both opened serve the other's request sharing the prefix, with the outputs of a run
    without the cache."""
    rng = random.Random(5)
    shared = [rng.randint(3, 500) for _ in range(300)]
    first, second = shared + [7] * 10, shared + [rng.randint(3, 500) for _ in range(50)]
    expected = outputs(llm(checkpoint, False, prefill_mode="full"), [second], GREEDY)
    store = str(tmp_path / "kv")
    writer, reader = (llm(checkpoint, True, prefill_mode="full", kv_store_path=store)
                      for _ in range(2))
    outputs(writer, [first], GREEDY)
    writer.engine.runner.offload.flush()
    assert outputs(reader, [second], GREEDY) == expected
    stats = reader.engine.scheduler.prefix_stats
    assert (stats.hit_tokens, stats.store_hit_tokens) == (256, 256)


def pages(caches, blocks: list[int]) -> list[torch.Tensor]:
    """Copies of `blocks`' pages in every source's compressed-KV and index-K planes."""
    return [plane[b * caches.rows_per_block(source):][:caches.rows_per_block(source)].clone()
            for planes in (caches.compressed, caches.index_k)
            for source, plane in planes.items() for b in blocks]


def test_bounded_resume_replays_without_touching_the_shared_blocks(checkpoint: Path) -> None:
    """prefix_resume='bounded': no snapshots; a hit recomputes the replay_window rows below its
    boundary (rings only, SWA reads floored there). With a window past tiny's SWA dependency
    depth (8 x 12 layers) that is exact; with 8 rows it drifts. Either way the shared cached
    blocks keep their bytes."""
    batch = prompts(13)
    plain = outputs(llm(checkpoint, False, prefill_mode="full"), batch[:3], GREEDY)
    for window, exact in ((140, True), (8, False)):
        engine = llm(checkpoint, True, prefill_mode="full", prefix_resume="bounded",
                     replay_window=window, async_scheduling=False)
        got = [outputs(engine, [batch[0]], GREEDY)[0]]
        caches = engine.engine.runner.caches
        shared = engine.engine.scheduler.kv.prefix.cached_blocks()
        before = pages(caches, shared)
        got += [outputs(engine, [p], GREEDY)[0] for p in batch[1:3]]
        assert all(torch.equal(x, y) for x, y in zip(pages(caches, shared), before, strict=True))
        stats = engine.engine.scheduler.prefix_stats
        assert stats.hit_tokens == 2 * 256 and stats.snapshots_saved == 0
        assert (got == plain) == exact, window


def test_speculative_decoding_over_resumed_requests(checkpoint: Path) -> None:
    """DSpark drafts with exact verification on requests that resume from the cache (the
    draft layers' rings are not in the snapshots, so drafts may differ): the outputs are still
    plain decoding's."""
    batch = prompts(14)[:3]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    plain = llm(checkpoint, False, prefill_mode="full")
    spec = llm(checkpoint, True, prefill_mode="full", speculative=True)
    expected = [outputs(plain, [p], params) for p in batch]
    assert [outputs(spec, [p], params) for p in batch] == expected
    assert spec.engine.scheduler.prefix_stats.hit_tokens == 2 * 256
    assert spec.engine.stats.drafts_proposed > 0
