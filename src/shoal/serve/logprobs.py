"""Log-probs in OpenAI's two shapes (chat `content` items, completion token lists), with each
token's text from the tokenizer's per-id cache (a logprobs stream asks for every token)."""

from __future__ import annotations

from itertools import accumulate


class LogprobFormat:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.text = tokenizer.token_text

    @staticmethod
    def top(lp: dict, n_top: int) -> list:
        """The top-n entries of a position's logprobs (the sampled token may rank lower)."""
        return sorted(((t, v) for t, v in lp.items() if v.rank <= n_top),
                      key=lambda kv: kv[1].rank)

    def chat(self, entries, n_top: int) -> dict:
        """(token, its position's logprobs) pairs as a chat choice's `logprobs`."""
        def item(token: int, logprob: float) -> dict:
            text = self.text(token)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return {"content": [{**item(token, lp[token].logprob), "top_logprobs": [
            item(t, v.logprob) for t, v in self.top(lp, n_top)]} for token, lp in entries]}

    def completion(self, entries, n_top: int, offset: int = 0) -> dict:
        """(token, its position's logprobs or None: an echoed prompt's first token) pairs as a
        completion choice's `logprobs`; `text_offset` counts characters of the tokens' texts
        from `offset` (where the first token starts in the choice's text)."""
        tokens = [self.text(t) for t, _ in entries]
        starts = list(accumulate((len(x) for x in tokens[:-1]), initial=offset))[:len(tokens)]
        return {"tokens": tokens, "text_offset": starts,
                "token_logprobs": [None if lp is None else lp[t].logprob for t, lp in entries],
                "top_logprobs": [None if lp is None else {
                    self.text(t): v.logprob for t, v in self.top(lp, n_top)}
                    for _, lp in entries]}
