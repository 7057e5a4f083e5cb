"""Which tokens are a response message's (serve/content_tokens.py): after `</think>` when the
output starts thinking, before the DSML tool-call marker (even split over tokens), never the
end-of-sequence token; a `<` that does not become the marker is text; fed a step at a time,
the same tokens as fed whole."""

from __future__ import annotations

import itertools

import pytest

from shoal.serve.content_tokens import ContentTokens, content_entries
from shoal.tokenizer.special import EOS, THINK_END


class Vocab:
    def __init__(self, texts: list[str]) -> None:
        self.texts = texts

    def token_text(self, token: int) -> str:
        return self.texts[token]

    def token_to_id(self, text: str) -> int | None:
        return self.texts.index(text) if text in self.texts else None


CASES = [  # (thinking, output pieces, the message's pieces)
    (True, ["why", THINK_END, "Hel", "lo", EOS], ["Hel", "lo"]),
    (False, ["a ", "<", "b", EOS], ["a ", "<", "b"]),
    (False, ["x", "\\n\\n<", "｜DSML｜", " calls>", "<", "y"], ["x", "\\n\\n<"]),
    (False, ["x<｜DS", "ML｜ calls>"], ["x<｜DS"]),
    (True, ["still thinking"], []),
    (False, ["ends <｜"], ["ends <｜"]),
]


@pytest.mark.parametrize("thinking,pieces,want", CASES)
def test_the_message_tokens(thinking: bool, pieces: list[str], want: list[str]) -> None:
    vocab = Vocab(list(dict.fromkeys([THINK_END, EOS, *pieces])))
    ids = [vocab.token_to_id(p) for p in pieces]
    whole = content_entries(ids, [f"lp{i}" for i in range(len(ids))], vocab, thinking)
    assert [vocab.token_text(t) for t, _ in whole] == want
    for cut in itertools.combinations(range(1, len(ids)), min(2, len(ids) - 1)):
        tokens, got = ContentTokens(vocab, thinking), []
        for a, b in itertools.pairwise((0, *cut, len(ids))):
            got += tokens.feed(list(zip(ids[a:b], [f"lp{i}" for i in range(a, b)], strict=True)))
        assert got + tokens.close() == whole, cut
