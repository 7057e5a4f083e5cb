"""Lossless speculative sampling (`spec_verify="rejection"`): tokens verified against drafts
drawn from a draft distribution q come out distributed as the target p, and the check that
shows it catches a wrong acceptance rule."""

from __future__ import annotations

import torch

from shoal.sampling.batch import SamplingBatch
from shoal.sampling.params import SamplingParams
from shoal.sampling.sampler import Sampler


def _chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of observed `counts` against `probs` (cells of expected count < 5 merged)."""
    n = counts.sum()
    expected = probs * n
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum().view(1)]).double()
    exp = torch.cat([expected[big], expected[~big].sum().view(1)]).double()
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), stat / 2.0))


def _rejection_samples(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """n rows of one target distribution p, each verifying a draft drawn from its own q."""
    g = torch.Generator().manual_seed(seed)
    vocab = 12
    logits = torch.randn(vocab, generator=g) * 1.5
    q_logits = logits + torch.randn(vocab, generator=g)  # a draft head that is close, not equal
    q = torch.softmax(q_logits, dim=0)
    drafts = torch.multinomial(q, n, replacement=True, generator=g)
    params = [SamplingParams(temperature=1.0, seed=s) for s in range(n)]
    batch = SamplingBatch.from_params(
        params, seeds=list(range(n)), positions=[7] * n, output_token_ids=[[]] * n,
        vocab_size=vocab, draft_token_ids=drafts.tolist(), draft_probs=q.expand(n, vocab))
    out = Sampler().sample(logits.expand(n, vocab).clone(), batch)
    return out.token_ids, torch.softmax(logits, dim=0)


def test_rejection_sampling_of_drafts_is_lossless(monkeypatch) -> None:
    """Tokens verified against drafts drawn from q come out distributed as p (chi-square over
    20,000 rows), and the same check catches a wrong acceptance rule."""
    import shoal.sampling.sampler as sampler_mod

    tokens, p = _rejection_samples(20_000, seed=3)
    counts = torch.bincount(tokens, minlength=p.numel()).float()
    assert _chi_square_p(counts, p) > 0.01
    monkeypatch.setattr(sampler_mod, "accept_draft", lambda u, pd, qd: u < 0.9)  # too eager
    tokens, p = _rejection_samples(20_000, seed=3)
    counts = torch.bincount(tokens, minlength=p.numel()).float()
    assert _chi_square_p(counts, p) < 1e-6
