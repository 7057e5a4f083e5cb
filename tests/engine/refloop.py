"""The independent oracle of the engine tests: a plain greedy loop over the tiny reference model.

Owns `reference_greedy`: DeepseekV41 built from the synthetic weights (seed 0, the engine's default
for a preset), the prompts prefilled whole in one batch ("full" tail-only mode, every prompt row's
logits kept), then one-token decode steps with argmax (ties to the lowest id). No scheduler, no
chunking, no sampler: only `build_forward_batch`, `RequestChunk.from_sequence` and `KVCaches`.
Also owns the session seed of the engine tests (printed; `SHOAL_TEST_SEED` reproduces a run) and
random prompt helpers. Invariant: results are cached per (prompts, steps) so the equivalence and
engine tests share one reference run.
"""

from __future__ import annotations

import functools
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shoal import LLM
from shoal.checkpoint.writer import generate_weights
from shoal.model.batch import RequestChunk, build_forward_batch
from shoal.model.deepseek_v41 import DeepseekV41
from shoal.model.engram_hash import token_map_for
from shoal.model.params import ModelParams
from shoal.model.presets import TINY
from shoal.model.state import KVCaches
from shoal.ops.registry import resolve_ops
from shoal.tokenizer.encoding import encode_messages
from shoal.tokenizer.synthetic import build_synthetic_tokenizer
from shoal.tokenizer.tokenizer import Tokenizer

EOS = 1  # TINY.eos_token_id (the synthetic tokenizer's layout)
PLAIN_IDS = (3, 471)  # byte-level and merged BPE ids of the synthetic tokenizer (specials: 471+)


@functools.cache
def session_seed() -> int:
    """One fresh seed per test session (override with SHOAL_TEST_SEED to reproduce)."""
    value = int(os.environ.get("SHOAL_TEST_SEED", random.randrange(1 << 30)))
    print(f"engine tests: SHOAL_TEST_SEED={value}")
    return value


WORDS = ("the quick brown fox jumps over lazy dog river sea rain morning machine engineers "
         "numbers notebook library music water children weather answer").split()
REF_STEPS = 6  # greedy tokens the reference computes per main prompt


@functools.cache
def tokenizer() -> Tokenizer:
    return Tokenizer(build_synthetic_tokenizer(TINY), TINY.vocab_size)


@functools.cache
def shared_llm() -> LLM:
    """One default-configured engine shared by the engine tests (128 concurrent sequences)."""
    return LLM("tiny", device="cpu", max_num_seqs=128)


@dataclass(frozen=True)
class PromptSet:
    """The main prompts: [short text, long text, random ids > 40, random ids > 8, chat].

    texts[i] is the text the engine is given (None: pass ids), ids[i] the token ids it sees.
    """

    texts: tuple[str | None, ...]
    ids: tuple[tuple[int, ...], ...]
    messages: tuple[dict, ...]  # the conversation of the chat prompt (last entry; chat mode)

    def refs(self) -> list[Reference]:
        return reference_greedy(self.ids, REF_STEPS)

    def engine_prompts(self) -> list[str | list[int]]:
        """What the engine is given: the text where there is one, else the ids."""
        return [t if t is not None else list(i) for t, i in zip(self.texts, self.ids,
                                                                  strict=True)]


@functools.cache
def main_prompts() -> PromptSet:
    rng = random.Random(session_seed())
    tok = tokenizer()

    def words(lo: int, hi: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))

    short, long = words(1, 2), words(5, 9)
    messages = ({"role": "user", "content": words(1, 3)},)
    chat = encode_messages(list(messages), reasoning_effort="none")  # chat mode: short prompt
    texts = (short, long, None, None, chat)
    ids = (tok.encode(short, add_special_tokens=True), tok.encode(long, add_special_tokens=True),
           random_prompt(rng, rng.randint(41, 50)), random_prompt(rng, rng.randint(9, 20)),
           tok.encode(chat))
    return PromptSet(texts, tuple(tuple(i) for i in ids), messages)


def random_prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(*PLAIN_IDS) for _ in range(length)]


@dataclass(frozen=True)
class Reference:
    """Greedy continuation of one prompt by the plain loop.

    tokens: `steps` argmax tokens (the loop does not stop at EOS).
    step_logits: [steps, V] fp32, the logits each token was chosen from.
    prompt_logits: [P, V] fp32, logits at every prompt position (row p predicts p + 1).
    """

    prompt: tuple[int, ...]
    tokens: tuple[int, ...]
    step_logits: torch.Tensor
    prompt_logits: torch.Tensor

    def expected(self, max_tokens: int) -> list[int]:
        """What a greedy request with `max_tokens` returns: stops after EOS (inclusive)."""
        out = list(self.tokens[:max_tokens])
        assert len(out) == max_tokens, f"reference has only {len(self.tokens)} steps"
        return out[: out.index(EOS) + 1] if EOS in out else out


@functools.cache
def tiny_model() -> DeepseekV41:
    params = ModelParams.load(TINY, generate_weights(TINY, seed=0))
    return DeepseekV41(TINY, params, resolve_ops("cpu"), token_map_for(TINY))


@functools.cache
def _reference(prompts: tuple[tuple[int, ...], ...], steps: int) -> tuple[Reference, ...]:
    model = tiny_model()
    n = len(prompts)
    block = 256  # >= TINY.max_position_embeddings: one block per request
    caches = KVCaches.allocate(TINY, num_blocks=n, num_slots=n,
                               max_tokens=max(sum(map(len, prompts)), n), block_size=block)
    seqs = [list(p) for p in prompts]
    chunks = [RequestChunk.from_sequence(s, 0, len(s), slot=i, block_ids=(i,),
                                         prefill_len=len(s), logits="all")
              for i, s in enumerate(seqs)]
    with torch.inference_mode():
        logits = model.forward(build_forward_batch(TINY, chunks, prefill_mode="full"),
                               caches).logits  # [sum P, V]
        prompt_logits = list(torch.split(logits, [len(p) for p in prompts]))
        step_logits = [[pl[-1]] for pl in prompt_logits]
        for _ in range(steps - 1):
            for i, s in enumerate(seqs):
                s.append(int(step_logits[i][-1].argmax()))
            chunks = [RequestChunk.from_sequence(s, len(s) - 1, 1, slot=i, block_ids=(i,),
                                                 prefill_len=len(prompts[i]))
                      for i, s in enumerate(seqs)]
            logits = model.forward(build_forward_batch(TINY, chunks, prefill_mode="full"),
                                   caches).logits  # [n, V]
            for i in range(n):
                step_logits[i].append(logits[i])
    out = []
    for i, p in enumerate(prompts):
        sl = torch.stack(step_logits[i]).float()
        out.append(Reference(p, tuple(int(t) for t in sl.argmax(dim=-1)), sl,
                             prompt_logits[i].float()))
    return tuple(out)


def reference_greedy(prompts: Sequence[Sequence[int]], steps: int) -> list[Reference]:
    """Greedy continuations (`steps` tokens each) of `prompts`, computed together."""
    return list(_reference(tuple(tuple(p) for p in prompts), steps))


TIE_GAP = 1e-4  # logits closer than this may legitimately swap under fp32 reordering


def trusted_steps(ref: Reference, max_tokens: int) -> int:
    """Number of leading greedy tokens that no near-tie can flip (<= max_tokens)."""
    for step in range(max_tokens):
        top = ref.step_logits[step].topk(2).values
        if float(top[0] - top[1]) < TIE_GAP:
            print(f"near-tie at step {step} of prompt {ref.prompt[:6]}...: compare a prefix")
            return step
    return max_tokens


def assert_greedy(token_ids: Sequence[int], finish_reason: str | None, ref: Reference,
                  max_tokens: int) -> None:
    """A greedy engine completion equals the plain loop (up to any near-tie)."""
    expected = ref.expected(max_tokens)
    n = trusted_steps(ref, max_tokens)
    assert list(token_ids[:n]) == expected[:n], (list(token_ids), expected)
    if n == max_tokens:
        assert list(token_ids) == expected
        assert finish_reason == ("stop" if expected[-1] == EOS else "length")
