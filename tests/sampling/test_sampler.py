"""Sampler against independent computations: argmax, explicit sorted-loop support sets, empirical
distributions, hand-computed penalties, min_tokens, masks, logprobs and batch independence."""

from __future__ import annotations

import math
import random

import pytest
import torch

from shoal.sampling.batch import SamplingBatch, bitmask_to_bool
from shoal.sampling.params import SamplingParams
from shoal.sampling.sampler import LogprobsMode, Sampler, compute_prompt_logprobs


def make_batch(
    params: list[SamplingParams],
    vocab: int,
    *,
    seeds: list[int] | None = None,
    positions: list[int] | None = None,
    outputs: list[list[int]] | None = None,
    prompts: list[list[int]] | None = None,
    **kwargs: object,
) -> SamplingBatch:
    rows = len(params)
    return SamplingBatch.from_params(
        params,
        seeds=seeds if seeds is not None else list(range(rows)),
        positions=positions if positions is not None else [0] * rows,
        output_token_ids=outputs if outputs is not None else [[] for _ in range(rows)],
        prompt_token_ids=prompts,
        vocab_size=vocab,
        **kwargs,  # type: ignore[arg-type]
    )


def reference_support(logits: list[float], p: SamplingParams) -> set[int]:
    """min_p -> top_k -> top_p with an explicit sorted loop in float64 (ties at a boundary kept)."""
    z = [x / p.temperature for x in logits]
    alive = list(range(len(z)))
    if p.min_p > 0:
        top = max(z[i] for i in alive)
        alive = [i for i in alive if math.exp(z[i] - top) >= p.min_p]
    if p.top_k > 0:
        ordered = sorted(alive, key=lambda i: -z[i])
        kth = z[ordered[min(p.top_k, len(ordered)) - 1]]
        alive = [i for i in alive if z[i] >= kth]
    if p.top_p < 1:
        ordered = sorted(alive, key=lambda i: -z[i])
        top = z[ordered[0]]
        weights = [math.exp(z[i] - top) for i in ordered]
        total = sum(weights)
        mass = 0.0
        boundary = z[ordered[-1]]
        for i, w in zip(ordered, weights, strict=True):
            mass += w / total
            if mass >= p.top_p:
                boundary = z[i]
                break
        alive = [i for i in alive if z[i] >= boundary]
    return set(alive)


def test_greedy_is_argmax_with_ties_to_lowest_id() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 83, generator=gen)
    logits[3, 10] = logits[3, 50] = logits[3].max() + 1.0  # tie: id 10 must win
    params = [SamplingParams(temperature=0.0, top_k=5, seed=9)] * 7
    out = Sampler().sample(logits, make_batch(params, 83, positions=list(range(7))))
    expected = [max(range(83), key=lambda i, r=r: (float(logits[r, i]), -i)) for r in range(7)]
    assert out.token_ids.tolist() == expected
    assert out.token_ids[3] == 10 and bool(out.valid.all())
    assert out.logprobs is None


def test_support_sets_match_sorted_loop() -> None:
    rng = random.Random(5)
    vocab = 97
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(64, vocab, generator=gen) * 3
    params = []
    for _ in range(64):
        params.append(
            SamplingParams(
                temperature=rng.choice([0.3, 0.7, 1.0, 1.8]),
                top_k=rng.choice([0, 1, 2, 10, 50, 200]),
                top_p=rng.choice([1.0, 0.95, 0.6, 0.2, 0.01]),
                min_p=rng.choice([0.0, 0.01, 0.1, 0.5]),
            )
        )
    _, scaled = Sampler().process(logits, make_batch(params, vocab))
    for r, p in enumerate(params):
        got = set(torch.nonzero(torch.isfinite(scaled[r])).flatten().tolist())
        assert got == reference_support(logits[r].double().tolist(), p), r


def test_top_k_keeps_ties_at_the_boundary() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 2.0, 0.0]])
    _, scaled = Sampler().process(logits, make_batch([SamplingParams(top_k=2)], 5))
    assert torch.isfinite(scaled[0]).tolist() == [False, True, True, True, False]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.6, top_k=5),
        SamplingParams(temperature=1.3, top_p=0.8),
        SamplingParams(temperature=0.9, min_p=0.05, top_p=0.9, top_k=8),
    ],
)
def test_empirical_distribution_matches_softmax_on_support(params: SamplingParams) -> None:
    vocab, draws = 12, 20000
    logits = torch.tensor([[2.0, 1.5, 1.2, 1.0, 0.7, 0.5, 0.2, 0.0, -0.5, -1.0, -2.0, -3.0]])
    support = sorted(reference_support(logits[0].double().tolist(), params))
    z = [float(logits[0, i]) / params.temperature for i in support]
    weights = [math.exp(v - max(z)) for v in z]
    expected = {i: draws * w / sum(weights) for i, w in zip(support, weights, strict=True)}
    # 20000 draws of one request: same seed, consecutive positions (the RNG's counter).
    batch = make_batch([params] * draws, vocab, seeds=[1234] * draws, positions=list(range(draws)))
    out = Sampler().sample(logits.expand(draws, vocab), batch)
    counts = torch.bincount(out.token_ids, minlength=vocab).tolist()
    assert sum(counts[i] for i in range(vocab) if i not in expected) == 0
    chi2 = sum((counts[i] - e) ** 2 / e for i, e in expected.items())
    dof = max(len(expected) - 1, 1)
    assert chi2 < dof + 6 * math.sqrt(2 * dof) + 6, (chi2, counts, expected)


def test_same_seed_and_position_same_token_regardless_of_batch() -> None:
    rng = random.Random(7)
    vocab = 300
    gen = torch.Generator().manual_seed(2)
    rows = 24
    logits = torch.randn(rows, vocab, generator=gen)
    params = [
        SamplingParams(
            temperature=rng.choice([0.0, 0.5, 1.0, 2.0]),
            top_k=rng.choice([0, 20]),
            top_p=rng.choice([1.0, 0.9]),
            min_p=rng.choice([0.0, 0.02]),
            frequency_penalty=rng.choice([0.0, 0.5]),
        )
        for _ in range(rows)
    ]
    seeds = [rng.randrange(2**64) for _ in range(rows)]
    positions = [rng.randrange(10**6) for _ in range(rows)]
    outputs = [[rng.randrange(vocab) for _ in range(rng.randrange(5))] for _ in range(rows)]

    def run(order: list[int]) -> list[int]:
        batch = make_batch(
            [params[i] for i in order],
            vocab,
            seeds=[seeds[i] for i in order],
            positions=[positions[i] for i in order],
            outputs=[outputs[i] for i in order],
        )
        return Sampler().sample(logits[order], batch).token_ids.tolist()

    full = run(list(range(rows)))
    shuffled = list(range(rows))
    rng.shuffle(shuffled)
    assert run(shuffled) == [full[i] for i in shuffled]
    for i in range(0, rows, 5):
        assert run([i]) == [full[i]]
    assert run(list(range(3, 9))) == full[3:9]
    # And a different position gives (almost surely) different tokens for random rows.
    moved = [(positions[i] + 1) for i in range(rows)]
    batch = make_batch(params, vocab, seeds=seeds, positions=moved, outputs=outputs)
    assert Sampler().sample(logits, batch).token_ids.tolist() != full


def test_penalties_against_hand_computation() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]])
    params = SamplingParams(
        repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25, temperature=0.0
    )
    prompt, output = [0, 4], [1, 3, 3]
    batch = make_batch([params], 6, outputs=[output], prompts=[prompt])
    masked, _ = Sampler().process(logits, batch)
    # Repetition over prompt+output {0,1,3,4}: positive / 2, negative * 2.
    # Then output counts {1: 1, 3: 2}: - 0.5 * count - 0.25 * present.
    expected = [2.0 / 2, -1.0 * 2 - 0.5 - 0.25, 0.5, 3.0 / 2 - 1.0 - 0.25, -2.0 * 2, 1.0]
    assert masked[0].tolist() == pytest.approx(expected, abs=1e-6)
    # Penalties touch only their own row: a neighbour without penalties is unchanged.
    two = make_batch([params, SamplingParams()], 6, outputs=[output, [3]], prompts=[prompt, [0]])
    masked, _ = Sampler().process(logits.expand(2, 6), two)
    assert masked[1].tolist() == logits[0].tolist()


def test_min_tokens_blocks_eos_and_stop_ids() -> None:
    vocab, eos = 10, 2
    logits = torch.zeros(4, vocab)
    logits[:, eos] = 10.0
    logits[:, 7] = 9.0
    logits[:, 5] = 8.0
    params = [
        SamplingParams(temperature=0.0, min_tokens=3),  # 2 outputs so far: EOS banned
        SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[7]),  # EOS and 7 banned
        SamplingParams(temperature=0.0, min_tokens=2),  # 2 outputs: EOS allowed again
        SamplingParams(temperature=0.0, min_tokens=3, ignore_eos=True),  # EOS is no stop (vLLM)
    ]
    batch = make_batch(params, vocab, outputs=[[1, 1]] * 4, eos_token_ids=[eos])
    assert Sampler().sample(logits, batch).token_ids.tolist() == [7, 5, eos, eos]
    random_rows = [SamplingParams(min_tokens=1, stop_token_ids=[7])] * 200
    batch = make_batch(random_rows, vocab, positions=list(range(200)), eos_token_ids=[eos])
    tokens = Sampler().sample(logits[:1].expand(200, vocab), batch).token_ids
    assert not bool(((tokens == eos) | (tokens == 7)).any())


def test_allowed_mask_and_bitmask_unpacking() -> None:
    vocab = 70
    gen = torch.Generator().manual_seed(4)
    words = torch.randint(-(2**31), 2**31 - 1, (3, 3), generator=gen, dtype=torch.int64)
    bitmask = words.to(torch.int32)
    allowed = bitmask_to_bool(bitmask, vocab)
    for r in range(3):
        for t in range(vocab):
            bit = (int(words[r, t // 32]) >> (t % 32)) & 1
            assert bool(allowed[r, t]) == bool(bit)
    logits = torch.randn(3, vocab, generator=gen)
    params = [SamplingParams(temperature=0.0), SamplingParams(), SamplingParams(top_p=0.5)]
    out = Sampler().sample(logits, make_batch(params, vocab, allowed_mask=allowed))
    for r in range(3):
        assert bool(allowed[r, out.token_ids[r]])
    masked_greedy = logits[0].masked_fill(~allowed[0], -math.inf).argmax()
    assert out.token_ids[0] == masked_greedy


def test_invalid_rows_are_flagged_without_affecting_others() -> None:
    logits = torch.randn(3, 16, generator=torch.Generator().manual_seed(6))
    logits[1, 4] = math.nan
    allowed = torch.ones(3, 16, dtype=torch.bool)
    allowed[2] = False
    params = [SamplingParams(seed=1)] * 3
    out = Sampler().sample(logits, make_batch(params, 16, allowed_mask=allowed))
    assert out.valid.tolist() == [True, False, False]
    alone = Sampler().sample(logits[:1], make_batch(params[:1], 16))
    assert out.token_ids[0] == alone.token_ids[0]


def test_logprobs_equal_log_softmax_of_raw_logits() -> None:
    vocab = 50
    gen = torch.Generator().manual_seed(8)
    logits = torch.randn(3, vocab, generator=gen) * 2
    before = logits.clone()
    params = [
        SamplingParams(logprobs=5, temperature=0.5, top_k=3, repetition_penalty=1.5),
        SamplingParams(logprobs=0, temperature=0.0),
        SamplingParams(temperature=1.0),
    ]
    batch = make_batch(params, vocab, outputs=[[1, 2], [], []], prompts=[[3], [], []])
    out = Sampler().sample(logits, batch)
    assert torch.equal(logits, before)  # the input is not modified
    assert out.logprobs is not None
    ref = logits.double()
    ref = ref - torch.logsumexp(ref, dim=1, keepdim=True)
    for r in range(3):
        chosen = int(out.token_ids[r])
        values = ref[r].tolist()
        assert out.logprobs.token_ids[r, 0] == chosen
        assert out.logprobs.logprobs[r, 0] == pytest.approx(values[chosen], abs=1e-5)
        assert out.logprobs.ranks[r] == 1 + sum(v > values[chosen] for v in values)
        top = sorted(range(vocab), key=lambda i: -values[i])[:5]
        assert out.logprobs.token_ids[r, 1:].tolist() == top
        assert out.logprobs.logprobs[r, 1:].tolist() == pytest.approx(
            [values[i] for i in top], abs=1e-5
        )


def test_processed_logprobs_mode() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.0]])
    params = [SamplingParams(logprobs=1, temperature=2.0, top_k=2, seed=3)]
    out = Sampler(LogprobsMode.PROCESSED).sample(logits, make_batch(params, 4))
    assert out.logprobs is not None
    # softmax over {2: 1.5, 1: 1.0} only.
    denom = math.log(math.exp(1.5) + math.exp(1.0))
    lp = {2: 1.5 - denom, 1: 1.0 - denom}
    chosen = int(out.token_ids[0])
    assert chosen in lp
    assert float(out.logprobs.logprobs[0, 0]) == pytest.approx(lp[chosen], abs=1e-6)
    assert out.logprobs.token_ids[0, 1] == 2


def test_prompt_logprobs_chunked() -> None:
    gen = torch.Generator().manual_seed(9)
    logits = torch.randn(7, 20, generator=gen)
    targets = torch.randint(0, 20, (7,), generator=gen)
    result = compute_prompt_logprobs(logits, targets, num_logprobs=2, chunk_rows=3)
    ref = logits.double() - torch.logsumexp(logits.double(), dim=1, keepdim=True)
    for t in range(7):
        row = ref[t].tolist()
        target = int(targets[t])
        assert result.token_ids[t, 0] == target
        assert float(result.logprobs[t, 0]) == pytest.approx(row[target], abs=1e-5)
        assert result.ranks[t] == 1 + sum(v > row[target] for v in row)
        assert result.token_ids[t, 1:].tolist() == sorted(range(20), key=lambda i: -row[i])[:2]
    empty = compute_prompt_logprobs(logits[:0], targets[:0], num_logprobs=2)
    assert empty.token_ids.shape == (0, 3)


def test_batch_construction_errors() -> None:
    with pytest.raises(ValueError, match="one entry per row"):
        SamplingBatch.from_params(
            [SamplingParams()], seeds=[], positions=[0], output_token_ids=[[]], vocab_size=4
        )
    with pytest.raises(ValueError, match="prompt_token_ids"):
        make_batch([SamplingParams(repetition_penalty=1.1)], 4)
    with pytest.raises(ValueError, match="allowed_mask"):
        make_batch([SamplingParams()], 4, allowed_mask=torch.ones(1, 5, dtype=torch.bool))
    batch = make_batch([SamplingParams()], 4)
    with pytest.raises(ValueError, match="vocab_size=4"):
        Sampler().sample(torch.zeros(1, 5), batch)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cpu_and_cuda_sample_the_same_tokens() -> None:
    rng = random.Random(11)
    vocab, rows = 129280, 64
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(12)) * 2
    params = [
        SamplingParams(
            temperature=rng.choice([0.0, 0.7, 1.0]),
            top_k=rng.choice([0, 50]),
            top_p=rng.choice([1.0, 0.9]),
            min_p=rng.choice([0.0, 0.05]),
            presence_penalty=rng.choice([0.0, 0.3]),
            logprobs=3,
        )
        for _ in range(rows)
    ]
    kwargs = dict(
        seeds=[rng.randrange(2**63) for _ in range(rows)],
        positions=[rng.randrange(10**5) for _ in range(rows)],
        outputs=[[rng.randrange(vocab) for _ in range(4)] for _ in range(rows)],
    )
    cpu = Sampler().sample(logits, make_batch(params, vocab, **kwargs))  # type: ignore[arg-type]
    gpu = Sampler().sample(
        logits.cuda(),
        make_batch(params, vocab, device="cuda", **kwargs),  # type: ignore[arg-type]
    )
    assert torch.equal(cpu.token_ids, gpu.token_ids.cpu())
    assert cpu.logprobs is not None and gpu.logprobs is not None
    torch.testing.assert_close(gpu.logprobs.logprobs.cpu(), cpu.logprobs.logprobs)


def test_one_max_pass_gives_argmax_and_validity() -> None:
    """The sampler's single `max(dim=1)` equals the definition it replaced: argmax (first
    maximum) and valid = no NaN in the row and some token above -inf, on rows with NaNs, +inf,
    all -inf, ties and ordinary values."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(64, 50, generator=g).round()  # many ties
    x[3, 7] = math.nan
    x[5] = -math.inf
    x[6, 2] = math.inf
    x[7, [1, 9]] = math.inf
    x[8, 4] = math.nan
    x[8, 5] = math.inf
    x[9, :49] = -math.inf
    best, ids = x.max(dim=1)
    want_valid = ~torch.isnan(x).any(dim=1) & (x > -math.inf).any(dim=1)
    assert torch.equal(~torch.isnan(best) & (best > -math.inf), want_valid)
    assert torch.equal(ids[want_valid], x.argmax(dim=1)[want_valid])


@pytest.mark.parametrize("v", [129280, 4096, 1000, 97, 5])
def test_row_max_equals_one_pass_max(v: int) -> None:
    """The two-pass row max gives `max(dim=1)`'s values and first-maximum indices: ties across
    chunk boundaries go to the lowest id, a NaN anywhere gives NaN, all -inf stays -inf."""
    from shoal.sampling.sampler import row_max

    g = torch.Generator().manual_seed(v)
    x = torch.randn(7, v, generator=g)
    x[1] = 3.0  # every entry tied
    x[2, v // 3] = x[2, v - 1] = 50.0  # a tie in two chunks
    x[3, v // 2] = float("nan")
    x[4] = -math.inf
    x[5, 0] = x[5, v - 1] = 99.0
    best, ids = row_max(x)
    want_best, want_ids = x.max(dim=1)
    assert torch.equal(best.isnan(), want_best.isnan())
    ok = ~want_best.isnan()
    assert torch.equal(best[ok], want_best[ok]) and torch.equal(ids[ok], want_ids[ok])
    assert ids[1] == 0 and ids[2] == v // 3 and ids[5] == 0


