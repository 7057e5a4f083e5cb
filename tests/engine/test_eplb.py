"""EPLB: the greedy placement on skewed loads (every expert placed, none twice on a rank, balance
improves), recorded loads count every routed token, and `shoal generate --record-expert-loads`
-> `shoal eplb` -> `--expert-placement` on 2 ranks gives world 1's outputs bitwise."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from shoal import LLM, SamplingParams
from shoal.cli import main
from shoal.parallel.eplb import (
    ExpertPlacement,
    balanced_placement,
    contiguous_placement,
    imbalance,
)


@pytest.mark.parametrize("world,redundant", [(4, 0), (4, 4), (8, 8), (3, 1)])
def test_placement_balances_a_skewed_load(world: int, redundant: int) -> None:
    e = 32 if (32 + redundant) % world == 0 else 32 + world - (32 + redundant) % world
    torch.manual_seed(world * 10 + redundant)
    loads = {f"layers.{i}.": torch.distributions.Pareto(1.0, 1.2).sample((e,)) * 100
             for i in range(3)}
    placement = balanced_placement(loads, world, redundant)
    placement.check(e, world)  # every expert at least once, none twice on one rank
    for prefix in loads:
        assert sorted(set(placement.layers[prefix])) == list(range(e))
    after = imbalance(loads, placement)
    assert after >= 1.0
    if e % world == 0:
        assert after <= imbalance(loads, contiguous_placement(loads, world))
        if redundant:  # copies of the heaviest experts: the busiest rank's share drops
            assert after < imbalance(loads, balanced_placement(loads, world, 0))


def test_a_placement_file_round_trips(tmp_path: Path) -> None:
    p = ExpertPlacement(2, 3, {"layers.0.": (0, 1, 2, 3, 0, 1)})
    p.save(tmp_path / "p.json")
    assert ExpertPlacement.load(tmp_path / "p.json") == p
    with pytest.raises(ValueError, match="twice"):
        ExpertPlacement(2, 3, {"layers.0.": (0, 0, 1, 2, 3, 1)}).check(4, 2)
    with pytest.raises(ValueError, match="not every"):
        ExpertPlacement(2, 2, {"layers.0.": (0, 1, 2, 2)}).check(4, 2)


def test_recorded_loads_count_every_routed_token() -> None:
    llm = LLM("tiny", device="cpu", max_model_len=128, prefill_mode="full",
              record_expert_loads=True)
    prompts = [[5, 6, 7, 8], list(range(1, 40))]
    llm.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True), use_tqdm=False)
    loads = llm.expert_loads()
    cfg = llm.config.model_config
    assert len(loads) == len(cfg.backbone)
    rows = sum(len(p) for p in prompts) + len(prompts) * 5  # the 6th token is never fed back
    for counts in loads.values():
        assert len(counts) == cfg.n_routed_experts
        assert sum(counts) == rows * cfg.num_experts_per_tok


def test_record_place_and_run_from_the_cli(tmp_path: Path) -> None:
    src, loads = tmp_path / "in.jsonl", tmp_path / "loads.json"
    placement, out1, out2 = tmp_path / "p.json", tmp_path / "o1.jsonl", tmp_path / "o2.jsonl"
    src.write_text("".join(json.dumps({"prompt_token_ids": [3 + i] * (5 + 7 * i)}) + "\n"
                           for i in range(6)), encoding="utf-8")
    common = ["--model", "tiny", "--device", "cpu", "--max-model-len", "96", "--max-tokens",
              "5", "--quiet", "--input", str(src)]
    assert main(["generate", *common, "--output", str(out1), "--record-expert-loads",
                 str(loads)]) == 0
    assert main(["eplb", "--loads", str(loads), "--world", "2", "--redundant", "2",
                 "--out", str(placement)]) == 0
    placed = ExpertPlacement.load(placement)
    assert placed.world == 2 and placed.slots_per_rank == 5
    assert main(["generate", *common, "--output", str(out2), "--dp", "2", "--expert-parallel",
                 "--expert-placement", str(placement)]) == 0
    tokens = [[json.loads(x)["outputs"][0]["token_ids"] for x in f.read_text().splitlines()]
              for f in (out1, out2)]
    assert tokens[0] == tokens[1]
