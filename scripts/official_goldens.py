"""Golden log-probs from the official DeepSeek-V4.1 reference code, for shoal's fixture tests.

Writes scaled-down checkpoints with shoal's own writer, runs the official reference
(`inference/model.py` with the CPU port of its kernels) over them on CPU, and stores, per case:
- in tests/data/official_goldens.json: the prompt, the reference's top-5 log-probs at every
  prompt position and over 16 greedy decode steps, and the greedy tokens (the end-to-end test);
- in tests/data/official_goldens.safetensors, keys "<case>/<name>" (the layer-by-layer test,
  tests/model/test_official_layers.py), over R = prompt + 16 rows (the prefill, then 16 decode
  steps fed the reference's own greedy tokens): `stream` [layers, R, hc, D] bf16 and `pre`
  [layers, R, hc] fp32, entry j the residual stream and pre_mix entering layer j + 1 (before
  its Engram; the last entry: the last layer's output and ffn_pre, what the head collapses;
  layer 0's input is the embedding); `experts` [layers, R, k] uint8 and `expert_gap` (k-th minus
  (k+1)-th biased gate score); per index source L `topk.L` [R, index_topk] int16 (logical
  compressed rows, ascending, -1 padded) and `topk_gap.L`; `candidates` [R, rows] bool (the
  candidate source's mask); `top_ids` / `top_logprobs` [R, 5] (the head on each row).

    python scripts/official_goldens.py --official DIR [--out tests/data/official_goldens.json]
    python scripts/official_goldens.py --official DIR --perturb   # the reference against itself

DIR is a local copy of the reference (model.py, kernel_cpu.py, engram.py; a public copy is
tenstorrent/tt-metal models/demos/deepseek_v3_d_p/reference/deepseek_v41/). Fetch it yourself:
it is not part of shoal and nothing here copies it. Runtime patches, all in this script:
- the vision modules are replaced by empty stand-ins (text only; they need image libraries);
- an index-key owner publishes its keys on every call (the reference publishes them only when
  its compressor emitted a latent, so at decode steps inside an incomplete ratio-2 group the
  ratio-2 indexers would read the last ratio-1 source's keys: its decode would disagree with its
  own prefill);
- `topk` breaks exact ties lowest index first (model.md §2.7: the reference's
  `topk(sorted=False)` leaves the order of ties to the implementation, and with bf16 index
  scores ties are common, e.g. rows where every index head's ReLU is zero);
- the head returns every position's logits (prompt log-probs), not only the last one's;
- checkpoints that use the synthetic `modulo` Engram token map hand the official hash that map
  instead of one built from a tokenizer;
- recording wrappers (Block, Engram, Gate, the top-k of the attention, the candidate filter)
  that only copy tensors out: the JSON goldens are the same bits with or without them.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import sys
import tempfile
import time
import types
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

import official_recorder  # noqa: E402 (beside this script)

from shoal.checkpoint.writer import write_checkpoint  # noqa: E402
from shoal.model.config_formats import _FLAT_TO_OURS  # noqa: E402
from shoal.model.engram_hash import build_token_map, modulo_token_map  # noqa: E402
from shoal.model.presets import TINY  # noqa: E402

TOP = 5
DECODE_STEPS = 16

# Every layer role (SWA-only, compressing and indexing sources at r = 2 and r = 1, Reuse,
# Reindex with the candidate filter), Engram (the tokenizer map and the modulo map), DSpark
# layers present, a checkpoint with none of Engram / DSpark / candidates. The prompts cross
# several 8-row SWA windows, more compressed rows than index_topk and than the candidate pool;
# the longest (136 + 16 decode rows) crosses a 128-token KV page in shoal's test. Lengths are
# bounded by the per-layer fixture (12 streams of 1 KiB per row: 312 rows, 4.0 MB).
CASES = [
    {"name": "tiny-tokenizer-map", "seed": 0, "prompt_len": 136, "token_map": "tokenizer",
     "overrides": {"max_position_embeddings": 512}},
    {"name": "tiny-modulo-map", "seed": 1, "prompt_len": 32, "overrides": {}},
    {"name": "tiny-plain", "seed": 2, "prompt_len": 40,
     "overrides": {"max_position_embeddings": 512, "engram_layer_ids": (),
                   "engram_num_embeddings": (), "num_draft_layers": 0,
                   "compress_ratios": TINY.compress_ratios[:12], "dspark_target_layer_ids": (),
                   "candidate_source_layer": None}},
    {"name": "tiny-wide-window", "seed": 3, "prompt_len": 40,
     "overrides": {"sliding_window": 16, "index_topk": 16, "candidate_topk_blocks": 9}},
]


def case_config(overrides: dict, name: str):
    """The ModelConfig of a case (JSON lists become tuples)."""
    over = {k: tuple(v) if isinstance(v, list) else v for k, v in overrides.items()}
    return dataclasses.replace(TINY, name=name, **over)


def case_prompt(case: dict, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(1000 + case["seed"])
    return torch.randint(3, vocab, (case["prompt_len"],), generator=g).tolist()


# ---------------------------------------------------------------------------- the reference


def import_reference(official: Path):
    """The official package under its directory's name, with the vision modules stubbed."""
    pkg = official.name
    sys.path.insert(0, str(official.parent))
    vision = types.ModuleType(f"{pkg}.vision")
    vision.ViT = vision.Aligner = type("Unused", (torch.nn.Module,), {})
    image = types.ModuleType(f"{pkg}.image_processor")
    image.IMAGE, image.IMAGE_END, image.IMAGE_NEW_LINE, image.IMAGE_START = 0, 1, 2, 3
    sys.modules[f"{pkg}.vision"], sys.modules[f"{pkg}.image_processor"] = vision, image
    model = importlib.import_module(f"{pkg}.model")
    engram = importlib.import_module(f"{pkg}.engram")
    indexer_forward = model.Indexer.forward

    def forward(self, x, qr, latent, start_pos, offset):
        if self.owns_k:  # publish on every call (see the module docstring)
            model.shared_attn.index_k = self.k_cache
        return indexer_forward(self, x, qr, latent, start_pos, offset)

    model.Indexer.forward = forward
    official_recorder.install(model)
    return model, engram


def model_args(module, config, max_seq_len: int):
    flat = {}
    for key, ours in _FLAT_TO_OURS.items():
        if key == "engram_pad_token_id" or not hasattr(config, ours):
            continue
        value = getattr(config, ours)
        flat[key] = -1 if key == "candidate_source_layer" and value is None else value
    flat.update(max_batch_size=1, max_seq_len=max_seq_len, dtype="fp8", expert_dtype="fp4",
                score_func="sqrtsoftplus", norm_topk_prob=True, vision_n_layers=0,
                temperature=0.0)
    if not config.candidate_source_layer:
        flat.update(candidate_topk_blocks=0, candidate_block_size=0)
    names = {f.name for f in dataclasses.fields(module.ModelArgs)}
    return module.ModelArgs(**{k: v for k, v in flat.items() if k in names})


class _TokenizerView:
    """What the official Engram map builder reads of an HF tokenizer."""

    def __init__(self, tok) -> None:
        self.backend_tokenizer = tok

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)


def _dequant_fp8_weight(w: torch.Tensor, s: torch.Tensor, block: int) -> torch.Tensor:
    sc = s.view(torch.float8_e8m0fnu).float()
    sc = sc.repeat_interleave(block, 0)[: w.shape[0]].repeat_interleave(block, 1)[:, : w.shape[1]]
    return (w.float() * sc).to(torch.bfloat16)


def load_weights(model: torch.nn.Module, ckpt: Path, block: int) -> None:
    """Checkpoint tensors into the reference's parameters, converted as its convert.py does:
    UE8M0 / e2m1 bytes viewed as their dtypes, wo_a dequantised to bf16, bf16 tensors widened
    where the reference keeps fp32 parameters. Every parameter must be filled."""
    from safetensors import safe_open

    index = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    handles = {f: safe_open(str(ckpt / f), "pt") for f in set(index.values())}

    def get(name: str) -> torch.Tensor:
        return handles[index[name]].get_tensor(name)

    missing = []
    for name, p in model.named_parameters():
        if name.endswith("attn.wo_a.weight"):
            value = _dequant_fp8_weight(get(name), get(name[: -len("weight")] + "scale"), block)
        elif name not in index:
            missing.append(name)
            continue
        else:
            value = get(name)
        if p.dtype in (torch.float8_e8m0fnu, torch.float4_e2m1fn_x2):
            value = value.view(p.dtype)
        elif p.dtype != value.dtype:
            value = value.to(p.dtype)
        if tuple(value.shape) != tuple(p.shape):
            raise ValueError(f"{name}: checkpoint {tuple(value.shape)}, reference "
                             f"{tuple(p.shape)}")
        p.data = value.contiguous()
    if missing:
        raise ValueError(f"parameters missing from the checkpoint: {missing[:10]}")


def run_reference(model_mod, engram_mod, config, ckpt: Path, prompt: list[int], top_n: int = TOP,
                  perturb: bool = False, record: dict | None = None) -> dict:
    """The reference's top-`top_n` log-probs and greedy tokens. `perturb`: add one bf16 ulp to
    the first element of every prompt position's embedding (the self-sensitivity check).
    `record`: a dict that receives the per-layer tensors of `official_recorder.assemble`, and top_ids [R, top_n]
    int32 / top_logprobs [R, top_n] fp32 of every row, the decode then also feeding its last
    greedy token (R = prompt + DECODE_STEPS rows)."""
    args = model_args(model_mod, config, len(prompt) + DECODE_STEPS + 8)
    if config.engram_layer_ids and config.engram_token_map == "modulo":
        table = modulo_token_map(config.vocab_size, config.engram_compressed_vocab_size)
        engram_mod.build_compressed_token_map = \
            lambda _tok: (table.tolist(), config.engram_compressed_vocab_size)
    from tokenizers import Tokenizer

    tokenizer = _TokenizerView(Tokenizer.from_file(str(ckpt / "tokenizer.json")))
    prev, topk = torch.get_default_dtype(), torch.Tensor.topk
    torch.set_default_dtype(torch.bfloat16)  # as the reference's generate.py
    torch.Tensor.topk = official_recorder.stable_topk
    try:
        model_mod.shared_attn.__init__()
        model = model_mod.Transformer(args, tokenizer)
        load_weights(model, ckpt, config.weight_block_size)
        model.eval()
        head = model.head
        head.forward = lambda x, full_logits=False: type(head).forward(head, x, True)
        if perturb:
            embed = model.embed

            def bumped(x, first=[True]):  # noqa: B006 (once: the prefill)
                y = type(embed).forward(embed, x)
                if first[0]:
                    first[0] = False
                    y.view(torch.int16)[..., 0] += 1
                return y

            embed.forward = bumped
        if record is not None:
            official_recorder.start(config.num_layers)
        ids = torch.tensor([prompt])
        _, logits, _ = model(ids, 0)
        rows = [logits[0, i] for i in range(len(prompt))]
        tokens = []
        for step in range(DECODE_STEPS):
            token = int(rows[-1].argmax())
            tokens.append(token)
            if step + 1 < DECODE_STEPS or record is not None:
                _, logits, _ = model(torch.tensor([[token]]), len(prompt) + step)
                rows.append(logits[0, -1])
        if record is not None:
            record.update(official_recorder.assemble())
            lp = torch.log_softmax(torch.stack(rows).double(), dim=-1)
            v, i = lp.topk(top_n)
            record.update(top_ids=i.int().contiguous(), top_logprobs=v.float().contiguous())
            rows = rows[:-1]
    finally:
        official_recorder.stop()
        torch.set_default_dtype(prev)
        torch.Tensor.topk = topk

    def top(row: torch.Tensor) -> list[list[float]]:
        lp = torch.log_softmax(row.double(), dim=-1)
        v, i = lp.topk(top_n)
        return [[int(a), round(float(b), 6)] for a, b in zip(i, v, strict=True)]

    n = len(prompt)
    return {"prompt_top": [top(r) for r in rows[: n - 1]],
            "decode_top": [top(r) for r in rows[n - 1:]], "decode_tokens": tokens}


def drift(base: dict, other: dict) -> tuple[float, int, int]:
    """(largest |log-prob change| over base's top tokens, missing from other's rows: 99; the
    first row over 0.01 or -1; greedy steps that agree before the first difference)."""
    worst, first = 0.0, -1
    for i, (b, o) in enumerate(zip(base["prompt_top"] + base["decode_top"],
                                   other["prompt_top"] + other["decode_top"], strict=True)):
        row = dict((t, v) for t, v in o)
        w = max(abs(row[t] - v) if t in row else 99.0 for t, v in b)
        worst = max(worst, w)
        if w > 0.01 and first < 0:
            first = i
    pairs = zip(base["decode_tokens"], other["decode_tokens"], strict=True)
    agree = next((i for i, (a, b) in enumerate(pairs) if a != b), DECODE_STEPS)
    return worst, first, agree


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--official", type=Path, required=True,
                    help="directory of the reference's model.py, kernel_cpu.py, engram.py")
    ap.add_argument("--out", type=Path, default=ROOT / "tests/data/official_goldens.json",
                    help="the JSON file; the per-layer tensors go beside it (.safetensors)")
    ap.add_argument("--perturb", action="store_true",
                    help="write nothing: rerun each case with one bf16 ulp added to one element of "
                         "each prompt position's embedding and print how far the reference moves against itself")
    args = ap.parse_args()
    model_mod, engram_mod = import_reference(args.official.resolve())
    out = {"source": "official DeepSeek-V4.1 reference (inference/model.py, CPU kernel port), "
                     "scripts/official_goldens.py", "top": TOP, "decode_steps": DECODE_STEPS,
           "cases": []}
    tensors: dict[str, torch.Tensor] = {}
    for case in CASES:
        start = time.perf_counter()
        overrides = dict(case["overrides"])
        if case.get("token_map") == "tokenizer":  # the key count the tokenizer yields
            from shoal.tokenizer.synthetic import build_synthetic_tokenizer

            tok = build_synthetic_tokenizer(case_config(overrides, case["name"]))
            overrides["engram_token_map"] = "tokenizer"
            overrides["engram_compressed_vocab_size"] = build_token_map(tok)[1]
        config = case_config(overrides, case["name"])
        with tempfile.TemporaryDirectory() as tmp:
            ckpt = write_checkpoint(config, Path(tmp) / case["name"], seed=case["seed"])
            prompt = case_prompt(case, config.vocab_size)
            record: dict = {}
            result = run_reference(model_mod, engram_mod, config, ckpt, prompt,
                                   record=None if args.perturb else record)
            tensors.update({f"{case['name']}/{k}": v for k, v in record.items()})
            if args.perturb:
                moved = run_reference(model_mod, engram_mod, config, ckpt, prompt, top_n=20,
                                      perturb=True)
                worst, first, agree = drift(result, moved)
                print(f"{case['name']}: one bf16 ulp per prompt embedding moves the "
                      f"reference's top-{TOP} log-probs by up to {worst:.4f} (99: a top token leaves the top 20; first "
                      f"row over 0.01: {first}); greedy tokens agree for {agree} of "
                      f"{DECODE_STEPS} steps")
                continue
        entry = {"name": case["name"], "seed": case["seed"],
                 "overrides": {k: list(v) if isinstance(v, tuple) else v
                               for k, v in overrides.items()},
                 "prompt": prompt, **result}
        out["cases"].append(entry)
        print(f"{case['name']}: {len(prompt)} prompt tokens, greedy {result['decode_tokens']} "
              f"({time.perf_counter() - start:.1f} s)")
    if args.perturb:
        return
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, separators=(",", ":")) + "\n")
    from safetensors.torch import save_file

    layers = args.out.with_suffix(".safetensors")
    save_file(tensors, str(layers), metadata={"source": out["source"], "top": str(TOP),
                                              "decode_steps": str(DECODE_STEPS)})
    print(f"wrote {args.out} ({args.out.stat().st_size} bytes), {layers} "
          f"({layers.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
