"""Prefix affinity of data-parallel placement: chained chunk keys (token blocks, text,
messages), the longest-prefix owner within a slack of the least busy candidate, the bounded
table; through LLM(data_parallel_size=2, enable_prefix_caching=True): requests sharing a
prefix go to one replica, hits rise, and the outputs stay one engine's."""

from __future__ import annotations

import random

from shoal import LLM, SamplingParams
from shoal.parallel.prefix_affinity import PrefixAffinity


def test_keys_are_chained_over_full_chunks() -> None:
    a = PrefixAffinity(block_size=4)
    ids = list(range(11))
    keys = a.keys(ids)
    assert len(keys) == 2  # full blocks only
    assert a.keys(ids[:8] + [99, 98, 97, 96])[:2] == keys  # same first two blocks
    assert a.keys([0] + ids[1:])[0] == keys[0] and a.keys([7] + ids[1:])[0] != keys[0]
    assert a.keys([50] * 4 + ids[4:8])[1] != keys[1]  # chained: a block's key names its past
    text = "x" * 40  # 4 characters per token: 16 per chunk
    assert len(a.keys(text)) == 2 and a.keys(text) != a.keys([ord("x")] * 10)
    for bad in ([1, None, 3, 4], [1, 2 ** 70, 3, 4], {"text": "hi"}, {"role": "user"},
                [{"role": "user", "content": b"hi"}], [{1: "x", "a": "y"}],
                (t for t in [1, 2, 3])):  # not a prompt: no keys (the engine reports it)
        assert a.keys(bad) == []
    chat = [{"role": "system", "content": "s" * 64}]
    assert a.keys(chat + [{"role": "user", "content": "a"}])[:4] == \
        a.keys(chat + [{"role": "user", "content": "b"}])[:4]


def test_the_longest_owned_prefix_wins_within_the_slack() -> None:
    a = PrefixAffinity(block_size=2)
    short, long = a.keys([1, 2]), a.keys([1, 2, 3, 4])
    a.record(long, 1)
    a.record(short, 0)  # the last replica sent a prefix owns it
    held = [0, 0, 0]
    assert a.choose(a.keys([1, 2, 3, 4, 5, 6]), 2, [0, 1, 2], held, slack=1) == 1
    assert a.choose(a.keys([1, 2, 9, 9]), 2, [0, 1, 2], held, slack=1) == 0
    assert a.choose(a.keys([7, 7]), 2, [0, 1, 2], held, slack=1) == 2  # no owner: least busy
    busy = [0, 3, 0]
    assert a.choose(long, 2, [0, 1, 2], busy, slack=2) == 0  # 1 is too busy: the next owner
    assert a.choose(long, 2, [0, 2], held, slack=2) == 0  # 1 is no candidate (full)
    assert a.place([1, 2, 9, 9], 2, [0, 1, 2], held, slack=1) == 0
    assert a.place([1, 2, 3, 4], 2, [0, 1, 2], [1, 3, 0], slack=0) == 2  # 0, 1 too busy
    assert a.place([8, 8], 2, [0, 1, 2], held, slack=1) == 2
    assert a.placed == {"matched": 1, "busy": 1, "unmatched": 1}
    small = PrefixAffinity(block_size=2, capacity=2)
    small.record(small.keys([1, 2, 3, 4, 5, 6]), 1)
    assert small.choose(small.keys([1, 2]), 0, [0, 1], held, slack=1) == 0  # forgotten


def test_replicas_get_the_requests_sharing_their_prefix() -> None:
    """Two families of prompts, A A A B B B: fed by load alone they alternate over the
    replicas; by affinity each family stays on one replica, whose cache serves the rest."""
    rng = random.Random(3)
    families = [[rng.randint(3, 500) for _ in range(200)] for _ in range(2)]
    prompts = [families[f] + [rng.randint(3, 500) for _ in range(20)]
               for f in (0, 0, 0, 1, 1, 1)]
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    opts = {"device": "cpu", "max_num_seqs": 8, "max_model_len": 256, "block_size": 128,
            "prefill_mode": "full"}
    odd = [{"prompt_token_ids": [1, None]}, {"messages": [{"role": "user", "content": "hi"}]},
           "a text prompt", {"prompt": {"text": "hi"}}]  # (a bad one: its error, as on one engine)

    def view(outs):
        return [(o.error, [c.token_ids for c in o.outputs]) for o in outs]

    expected = view(LLM("tiny", **opts).generate(prompts + odd, greedy, use_tqdm=False))
    hits = {}
    for caching in (False, True):
        llm = LLM("tiny", data_parallel_size=2, enable_prefix_caching=True, **opts)
        if not caching:
            llm.replicas.affinity = None  # placement by load alone, the same caches
        try:
            got = view(llm.generate(prompts + odd, greedy, use_tqdm=False))
            served = [llm.replicas.served_by[p] for p in range(6)]
            hits[caching] = llm.replicas.stats()[1].hit_tokens
        finally:
            llm.close()
        assert got == expected
        if caching:
            assert served[:3] == [served[0]] * 3 and served[3:] == [served[3]] * 3
            assert served[0] != served[3]
        else:
            assert len(set(served[:3])) == 2  # a family split over both
    assert hits[True] > hits[False]
