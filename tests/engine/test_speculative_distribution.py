"""Lossless speculative sampling through the engine (`spec_verify="rejection"` on tiny): the
second sampled token, the first that a verified DSpark draft decides (accepted with
min(1, p/q), else sampled from the residual), is distributed as plain decoding's over 20,000
seeds; and the same check fails for a wrong acceptance rule. The first token comes from the
prefill, the same path in both modes. The seeds are fixed, so the test is deterministic."""

from __future__ import annotations

import pytest
import torch

import shoal.sampling.sampler as sampler_mod
from shoal import LLM, SamplingParams
from shoal.model.presets import TINY

OPTS = {"device": "cpu", "max_num_seqs": 512, "max_num_batched_tokens": 4096}
SEEDS = 20_000


def _second_tokens(llm: LLM, n: int, first_seed: int, max_tokens: int) -> torch.Tensor:
    """The second sampled token of n one-token prompts at temperature 1, seeds from
    first_seed on (independent samples for each run)."""
    params = [SamplingParams(temperature=1.0, seed=first_seed + s, max_tokens=max_tokens,
                             ignore_eos=True) for s in range(n)]
    outs = llm.generate([[7]] * n, params, use_tqdm=False)
    return torch.tensor([o.outputs[0].token_ids[1] for o in outs])


def _same_distribution_p(a: torch.Tensor, b: torch.Tensor) -> float:
    """p-value of the chi-square test that two samples of token ids come from one
    distribution (tokens with an expected count under 5 in the smaller sample pooled)."""
    ca, cb = (torch.bincount(x, minlength=TINY.vocab_size).double() for x in (a, b))
    na, nb = ca.sum(), cb.sum()
    big = (ca + cb) * min(na, nb) / (na + nb) >= 5
    ca = torch.cat([ca[big], ca[~big].sum().view(1)])
    cb = torch.cat([cb[big], cb[~big].sum().view(1)])
    keep = (ca + cb) > 0
    ca, cb = ca[keep], cb[keep]
    ea, eb = (ca + cb) * na / (na + nb), (ca + cb) * nb / (na + nb)
    stat = ((ca - ea) ** 2 / ea).sum() + ((cb - eb) ** 2 / eb).sum()
    dof = torch.tensor((ca.numel() - 1) / 2.0, dtype=torch.float64)
    return float(torch.special.gammaincc(dof, stat / 2.0))


@pytest.fixture(scope="module")
def plain_second() -> torch.Tensor:
    return _second_tokens(LLM("tiny", **OPTS), SEEDS, 0, max_tokens=2)


def test_rejection_verified_tokens_follow_plain_sampling(plain_second) -> None:
    spec = LLM("tiny", speculative=True, spec_verify="rejection", **OPTS)
    # max_tokens 3: after the first token one draft is left to verify for the second
    second = _second_tokens(spec, SEEDS, 100_000, max_tokens=3)
    stats = spec.engine.stats
    assert stats.drafts_proposed == SEEDS and 0 < stats.drafts_accepted < SEEDS
    assert _same_distribution_p(plain_second, second) > 0.01


def test_the_check_fails_for_a_wrong_acceptance_rule(plain_second, monkeypatch) -> None:
    monkeypatch.setattr(sampler_mod, "accept_draft", lambda u, p, q: u < 0.9)  # too eager
    spec = LLM("tiny", speculative=True, spec_verify="rejection", **OPTS)
    second = _second_tokens(spec, 4_000, 200_000, max_tokens=3)
    assert _same_distribution_p(plain_second, second) < 1e-6
