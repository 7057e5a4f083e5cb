"""logit_bias and allowed_token_ids in the sampler, against hand computations."""

from __future__ import annotations

import pytest
import torch

from sampling.test_sampler import make_batch
from shoal.sampling.params import SamplingParams
from shoal.sampling.sampler import Sampler


def test_logit_bias_then_penalties_and_allowed_token_ids() -> None:
    """logit_bias is added to the logits before the penalties (hand computation); -100 bans a
    token in practice and +100 forces it; allowed_token_ids confines greedy and random rows,
    together with a structured-output mask (their intersection); other rows are untouched."""
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]])
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0,
                            logit_bias={3: -4.0, "1": 1.5})
    masked, _ = Sampler().process(logits, make_batch([params], 6, prompts=[[3, 1]]))
    assert masked[0].tolist() == pytest.approx([2.0, 0.5 / 2, 0.5, -1.0 * 2, -2.0, 1.0])
    assert logits[0, 3] == 3.0  # the caller's logits are not written
    rows = [SamplingParams(temperature=0.0, logit_bias={4: 100.0}),
            SamplingParams(temperature=0.0, logit_bias={3: -100.0}),
            SamplingParams(temperature=0.0, allowed_token_ids=[1, 4, 5]),
            SamplingParams(temperature=0.0)]
    out = Sampler().sample(logits.expand(4, 6), make_batch(rows, 6)).token_ids
    assert out.tolist() == [4, 0, 5, 3]
    vocab = 50
    gen = torch.Generator().manual_seed(8)
    wide = torch.randn(1, vocab, generator=gen).expand(300, vocab)
    allowed = [2, 7, 11, 40]
    sampled = [SamplingParams(allowed_token_ids=allowed)] * 200 + [SamplingParams()] * 100
    mask = torch.ones(300, vocab, dtype=torch.bool)
    mask[:100, 7] = False  # a grammar that forbids 7 in the first hundred rows
    batch = make_batch(sampled, vocab, positions=list(range(300)), allowed_mask=mask)
    tokens = Sampler().sample(wide, batch).token_ids.tolist()
    assert set(tokens[:100]) <= {2, 11, 40} and set(tokens[100:200]) <= set(allowed)
    assert len(set(tokens[200:])) > 10  # unrestricted rows


def test_bad_words_ban_the_last_token_after_their_prefix() -> None:
    """bad_words_token_ids: a one-token word is always banned; a longer one bans its last
    token only right after its other tokens (the outputs' tail), nowhere else."""
    p = SamplingParams(temperature=0.0, bad_words_token_ids=[[4], [1, 2, 3], [2, 5]])
    assert p.reads_outputs and p.banned_after([]) == (4,)
    assert p.banned_after([7, 1, 2]) == (4, 3, 5) and p.banned_after([2]) == (4, 5)
    assert p.banned_after([1, 2, 7]) == (4,) and p.banned_after([1, 7]) == (4,)
    logits = torch.tensor([[0.0, 1.0, 2.0, 9.0, 8.0, 7.0]]).expand(3, 6)
    rows = [p, p, SamplingParams(temperature=0.0)]
    batch = make_batch(rows, 6, outputs=[[1, 2], [0, 0], [1, 2]])
    assert Sampler().sample(logits, batch).token_ids.tolist() == [2, 3, 3]
    for bad in (["x", ""], "word", [1]):
        with pytest.raises(ValueError, match="bad_words"):
            SamplingParams(bad_words=bad)
    for bad in ([[]], [[-1]], [1, 2], "ab"):
        with pytest.raises(ValueError, match="bad_words_token_ids"):
            SamplingParams(bad_words_token_ids=bad)
