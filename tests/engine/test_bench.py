"""`shoal bench` runs end to end on the tiny model (CPU) and ends with one JSON line holding
every decode batch size and prefill mode asked for."""

import json

import pytest
import torch

from shoal.bench import main


def test_bench_tiny_json_line(tmp_path, capsys):
    rc = main(["--model", "tiny", "--device", "cpu", "--batches", "1", "3", "--prompt-len", "16", "--steps", "3",
               "--prefill-prompts", "2", "--prefill-len", "48", "--prefill-budget", "32",
               "--modes", "full", "bounded", "--plot", str(tmp_path / "p.png")])
    assert rc == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [d["batch"] for d in result["decode"]] == [1, 3]
    assert all(d["tpot_ms"] > 0 and 0 < d["fraction_of_floor"] for d in result["decode"])
    assert all(d["device_idle_share"] is None for d in result["decode"])  # CUDA events only
    assert result["async_scheduling"] is True
    assert all(0.5 < d["overlapped_share"] < 1 for d in result["decode"])  # all but prefill
    assert [p["mode"] for p in result["prefill"]] == ["full", "bounded"]
    assert result["prefill"][0]["speedup_vs_full"] == 1.0
    # the reference backend compiles nothing; on the H200 a non-zero count flags a prefill
    # number that includes JIT compilation
    assert all(p["compiled_in_run"] in (0, None) for p in result["prefill"])
    assert result["kv_bytes_per_token"] > 0
    startup = result["startup_s"]  # on the CPU: no graphs, no warm-up
    assert startup["total"] > 0 and startup["graphs"] == 0 and startup["graph_capture"] == 0.0
    assert result["declined_calls"] == {}


def test_bench_sizes_max_model_len_for_a_budgeted_decode_prefill(tmp_path, capsys):
    """--skip-prefill with a small budget: a batch's prompts take several prefill steps, which
    its requests' max_tokens covers; max_model_len must cover it too (it did not: 2026-12-01 on
    the H200, batch 16 x 256 tokens with a 256-token budget failed every request)."""
    rc = main(["--model", "tiny", "--device", "cpu", "--batches", "4", "--prompt-len", "32",
               "--steps", "2", "--skip-prefill", "--prefill-budget", "8", "--prefill-prompts", "4",
               "--plot", str(tmp_path / "p.png")])
    assert rc == 0
    (row,) = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["decode"]
    assert "error" not in row and row["tpot_ms"] > 0


def test_bench_speculative_reports_drafts(tmp_path, capsys):
    """--speculative: each decode row carries its step time, tokens per request and step, the
    drafts verified / accepted / skipped over the timed steps, the mean accepted length and the
    acceptance rate by draft position (on tiny's random weights
    drafts are verified and almost never accepted)."""
    rc = main(["--model", "tiny", "--device", "cpu", "--batches", "1", "2", "--prompt-len", "16",
               "--steps", "4", "--skip-prefill", "--prefill-budget", "64", "--speculative",
               "--plot", str(tmp_path / "p.png")])
    assert rc == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["speculative"] is True
    for row in result["decode"]:
        assert row["drafts_verified"] > 0 and 0 <= row["drafts_accepted"] <= row[
            "drafts_verified"] and row["drafts_skipped"] == 0
        assert row["tokens_per_step"] >= 1.0
        assert row["tpot_ms"] == pytest.approx(row["step_ms"] / row["tokens_per_step"], rel=0.5)
        rates = row["acceptance_by_position"]
        assert rates and rates[0] is not None and all(r is None or 0 <= r <= 1 for r in rates)
        assert row["mean_accepted_length"] >= 1.0


def test_bench_refuses_a_budget_the_decoding_requests_would_fill(capsys):
    with pytest.raises(SystemExit):
        main(["--model", "tiny", "--device", "cpu", "--batches", "1", "8",
              "--prefill-budget", "15", "--skip-prefill"])
    assert "--prefill-budget 15 must be at least twice the largest of --batches (8)" in (
        capsys.readouterr().err)


def test_bench_decode_reports_a_batch_that_never_runs_whole():
    """More requests than slots: no step decodes them all, and the entry says so (no number)."""
    from shoal import LLM
    from shoal.bench import bench_decode

    llm = LLM("tiny", device="cpu", max_num_seqs=2, max_num_batched_tokens=64)
    d = bench_decode(llm, 3, 8, 2)
    assert "tpot_ms" not in d and "at most 2 ran at once" in d["error"], d
    assert not llm.engine.has_unfinished()


@pytest.mark.parametrize("budget,warm", [(96, 3), (200, 4), (20, 1)])
def test_bench_prefill_warms_up_one_steps_worth_of_prompts(budget, warm):
    """The warm-up prefills as many prompts as one step's budget holds (capped at the timed
    count), so no timed step meets a batch composition first: with one warm-up prompt, a
    16K budget over 8K prompts measured 48K tok/s in bounded mode on the H200 (2026-12-02),
    77K with the warm-up of two."""
    from shoal import LLM
    from shoal.bench import bench_prefill

    llm = LLM("tiny", device="cpu", max_num_batched_tokens=budget, max_num_seqs=4,
              max_model_len=64)
    calls, generate = [], llm.generate
    llm.generate = lambda prompts, *a, **k: calls.append(len(prompts)) or generate(prompts, *a,
                                                                                   **k)
    out = bench_prefill(llm, 4, 32, "full")
    assert calls == [warm, 4] and out["tokens_per_s"] > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA events")
def test_device_idle_share_on_cuda():
    """On CUDA each step's device span (first device work to the end of sampling) is timed:
    positive, below the step's wall time, so the idle share lies in [0, 1)."""
    from shoal import LLM
    from shoal.bench import bench_decode

    llm = LLM("tiny", device="cuda", max_num_seqs=4, max_num_batched_tokens=64,
              cuda_graphs=False)  # (the e2e bench covers graph steps)
    d = bench_decode(llm, 2, 8, 4)
    assert 0 <= d["device_idle_share"] < 1, d
    assert llm.engine.stats.device_time > 0


def test_random_prompts_never_hold_the_image_token():
    """The bench's prompts draw from the ordinary vocabulary: every id in [3, vocab) but the
    image token (a mini batch of 256 x 512 random ids held it once and lost a request)."""
    from types import SimpleNamespace

    import torch

    from shoal.bench import random_prompt

    for image, want in ((7, set(range(3, 12)) - {7}), (3, set(range(4, 12))),
                        (11, set(range(3, 11))), (None, set(range(3, 12)))):
        cfg = SimpleNamespace(vocab_size=12, image_token_id=image)
        ids = random_prompt(cfg, 3000, torch.Generator().manual_seed(0))
        assert len(ids) == 3000 and set(ids) == want, image
