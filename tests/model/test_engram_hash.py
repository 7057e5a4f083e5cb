"""Engram hash constants against the published values (model.md §2.10) and the hash against an
independent pure-Python computation."""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer, models

from shoal.model.engram_hash import (
    build_token_map,
    engram_constants,
    engram_hash,
    modulo_token_map,
    multiplier_bound,
    sequence_history,
    token_map_for,
)
from shoal.model.presets import FLASH, TINY


def test_flash_constants_match_published_values() -> None:
    c = engram_constants(FLASH)
    assert c.rows_per_layer == (384006168, 384016682) == FLASH.engram_num_embeddings
    assert c.primes.shape == (2, 3, 8)
    assert c.primes[0, 0, :3].tolist() == [16000057, 16000079, 16000081]
    assert c.primes[0, -1, -1] == 16000463 and c.primes[1, 0, 0] == 16000477
    assert c.primes[1, -1, -1] == 16000889
    assert len(set(c.primes.flatten().tolist())) == 48
    assert multiplier_bound(99092) == 46539438283891
    assert c.multipliers.tolist() == [
        [76632096046245, 4839876093313, 35959672319349, 73987337458391],
        [67716810739261, 51510806800915, 30921347202721, 82619226485591]]
    assert c.pad_id == 2
    flat = c.primes[0].flatten().tolist()
    assert c.offsets[0].tolist() == [sum(flat[:i]) for i in range(24)]


def test_tiny_constants() -> None:
    c = engram_constants(TINY)
    assert c.primes.tolist() == [[[53, 59], [61, 67], [71, 73]],
                                 [[79, 83], [89, 97], [101, 103]]]
    assert c.rows_per_layer == (384, 552)
    assert c.offsets.tolist() == [[0, 53, 112, 173, 240, 311], [0, 79, 162, 251, 348, 449]]
    assert (c.multipliers % 2 == 1).all()
    assert (c.multipliers < multiplier_bound(301) * 2 + 1).all()


def _python_hash(seq: list[int], dead: list[bool], c, tmap: list[int]) -> list[list[list[int]]]:
    """Independent per-position computation with Python ints (model.md §2.10 steps 1-5)."""
    out = []
    for p in range(len(seq)):
        vals, blocked = [], False
        for s in range(c.max_ngram):
            if p - s < 0 or dead[p - s]:
                blocked = True
            vals.append(c.pad_id if blocked else tmap[seq[p - s]])
        per_layer = []
        for li in range(len(c.layer_ids)):
            m = c.multipliers[li].tolist()
            rolling = vals[0] * m[0]
            rows = []
            for s in range(1, c.max_ngram):
                rolling ^= vals[s] * m[s]
                n = s + 1
                for h in range(c.n_heads):
                    k = (n - 2) * c.n_heads + h
                    rows.append(rolling % int(c.primes[li, n - 2, h]) + int(c.offsets[li, k]))
            per_layer.append(rows)
        out.append(per_layer)
    return out


def test_hand_computed_first_position() -> None:
    c = engram_constants(TINY)
    tmap = modulo_token_map(TINY.vocab_size, 301)
    ids = torch.tensor([305])  # 305 % 301 = 4
    rows = engram_hash(ids, torch.tensor([0]), sequence_history(ids), torch.tensor([False]),
                       tmap, c)
    m = c.multipliers[0].tolist()
    r2 = 4 * m[0] ^ 2 * m[1]  # 2-gram: [4, pad]
    assert rows[0, 0, 0] == r2 % 53 and rows[0, 0, 1] == r2 % 59 + 53
    r4 = 4 * m[0] ^ 2 * m[1] ^ 2 * m[2] ^ 2 * m[3]
    assert rows[0, 0, 4] == r4 % 71 + 240 and rows[0, 0, 5] == r4 % 73 + 311


def test_hash_matches_python_and_blocks_at_start_and_dead() -> None:
    c = engram_constants(TINY)
    tmap = modulo_token_map(TINY.vocab_size, 301)
    g = torch.Generator().manual_seed(0)
    seq = torch.randint(0, TINY.vocab_size, (23,), generator=g)
    dead = torch.zeros(23, dtype=torch.bool)
    dead[9:12] = True
    rows = engram_hash(seq, torch.arange(23), sequence_history(seq, dead), dead, tmap, c)
    assert rows.shape == (23, 2, 6) and rows.dtype == torch.int64
    expected = _python_hash(seq.tolist(), dead.tolist(), c, tmap.tolist())
    assert rows.tolist() == expected
    assert (rows[..., :] < torch.tensor([384, 552]).view(1, 2, 1)).all()
    # Position 0: every order sees only pad before the token; positions 0 and a fresh sequence
    # starting with the same token agree; a dead token hashes as all-pad.
    alone = engram_hash(seq[:1], torch.tensor([0]), sequence_history(seq[:1]),
                        torch.tensor([False]), tmap, c)
    assert torch.equal(alone[0], rows[0])
    all_pad = _python_hash([2], [True], c, list(range(512)))[0]
    assert rows[10].tolist() == all_pad
    # Position 12 (first after the dead span) sees pad for every older slot.
    first_after = engram_hash(seq[12:13], torch.tensor([0]), sequence_history(seq[12:13]),
                              torch.tensor([False]), tmap, c)
    assert torch.equal(first_after[0], rows[12])


def test_decode_steps_with_history_equal_whole_sequence() -> None:
    c = engram_constants(TINY)
    tmap = modulo_token_map(TINY.vocab_size, 301)
    seq = torch.tensor([7, 300, 511, 5, 42, 42, 1])
    whole = engram_hash(seq, torch.arange(7), sequence_history(seq),
                        torch.zeros(7, dtype=torch.bool), tmap, c)
    for p in range(7):
        hist = torch.tensor([[seq[p - s].item() if p - s >= 0 else -1 for s in (1, 2, 3)]])
        step = engram_hash(seq[p : p + 1], torch.tensor([p]), hist, torch.tensor([False]),
                           tmap, c)
        assert torch.equal(step[0], whole[p])


def _word_tokenizer(words: list[str]) -> Tokenizer:
    return Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))


def test_token_map_normalisation() -> None:
    words = ["<unk>", "</s>", "<pad>", "The", "the", " the", "Ä", "a", " ", "  ", "\t", "ﬁ", "fi",
             "Ｘ", "x", "cat"]
    tok = _word_tokenizer(words)
    tmap, n_keys = build_token_map(tok, vocab_size=20)
    m = dict(zip(words, tmap.tolist(), strict=False))
    assert m["The"] == m["the"] == m[" the"]  # lowercase, strip
    assert m["Ä"] == m["a"]  # NFD + strip accents
    assert m[" "] == m["  "] == m["\t"]  # whitespace runs -> one space, kept (not emptied)
    assert m[" "] != m["<unk>"]
    assert m["ﬁ"] == m["fi"] and m["Ｘ"] == m["x"]  # NFKC
    assert [m["<unk>"], m["</s>"], m["<pad>"]] == [0, 1, 2]  # ids in order of first appearance
    assert n_keys == len(set(m.values())) == 9
    assert tmap.shape == (20,) and tmap.dtype == torch.int32
    assert tmap[16:].tolist() == [m["<pad>"]] * 4  # beyond the tokenizer: pad (open question)


def test_token_map_partial_utf8_keys_by_raw_token() -> None:
    from shoal.tokenizer.synthetic import build_synthetic_tokenizer

    tok = build_synthetic_tokenizer(TINY)
    tmap, n_keys = build_token_map(tok)
    partial = [i for i in range(3, 259) if "\ufffd" in tok.decode([i])]
    assert len(partial) == 128  # bytes 0x80..0xFF alone are not valid UTF-8
    assert len({int(tmap[i]) for i in partial}) == 128  # keyed by distinct raw token strings
    assert n_keys < tok.get_vocab_size()
    with pytest.raises(ValueError, match="engram_compressed_vocab_size"):
        token_map_for(TINY.replace(engram_token_map="tokenizer"), tok)


def test_modulo_map() -> None:
    tmap = token_map_for(TINY)
    assert tmap.tolist() == [i % 301 for i in range(512)]
    assert engram_constants(TINY, tmap).pad_id == 2
