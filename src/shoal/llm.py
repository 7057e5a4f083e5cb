"""LLM: the offline API. `generate()` / `chat()` return one output per input, in input order;
`generate_iter()` yields outputs as requests finish. No scheduling logic lives here.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Any

from tqdm import tqdm

from shoal.config import EngineConfig
from shoal.engine.engine import Engine
from shoal.engine.outputs import RequestOutput
from shoal.sampling import SamplingParams
from shoal.tokenizer.encoding import encode_messages
from shoal.tokenizer.parser import OutputParser

PromptLike = str | Sequence[int] | dict


class LLM:
    """`LLM(model="tiny" | "mini" | "flash" | "/path/to/checkpoint", **engine_options)`.

    Engine options are the fields of CacheConfig, SchedulerConfig and RunnerConfig
    (e.g. max_num_seqs=32, prefill_mode="staircase", device="cpu"); unknown ones raise.
    """

    def __init__(self, model: str = "tiny", **kwargs: Any) -> None:
        self.config = EngineConfig.create(model, **kwargs)
        self.engine = Engine(self.config)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    # ---- generate ---------------------------------------------------------------------------
    def generate(self, prompts: PromptLike | Sequence[PromptLike],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Complete each prompt (a string, a list of token ids, or {"prompt": ...} /
        {"prompt_token_ids": [...]}). Returns one RequestOutput per prompt, in order; a bad
        prompt gets an output with `error` set instead of raising."""
        groups = self._add_all(prompts, sampling_params)
        done: dict[str, RequestOutput] = {}
        for out in self._drain(groups, use_tqdm):
            done[out.request_id] = out
        return [done[g] for g in groups]

    def generate_iter(self, prompts: PromptLike | Sequence[PromptLike],
                      sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                      ) -> Iterator[RequestOutput]:
        """Like generate(), but yields each output as soon as its request finishes."""
        yield from self._drain(self._add_all(prompts, sampling_params), use_tqdm=False)

    # ---- chat ---------------------------------------------------------------------------------
    def chat(self, messages: Sequence[dict] | Sequence[Sequence[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, *, tools: Sequence[dict] | None = None,
             reasoning_effort: str | int | None = None, **encode_options: Any,
             ) -> list[RequestOutput]:
        """Chat completions with the official V4.1 encoding: reasoning, content and DSML tool
        calls come back parsed on each CompletionOutput (reasoning_content, content,
        tool_calls). One conversation (a list of messages) or a list of conversations."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts: list[Any] = []
        for conv in convs:
            try:
                prompts.append(encode_messages(list(conv), tools=tools,
                                               reasoning_effort=reasoning_effort,
                                               **encode_options))
            except ValueError as exc:
                prompts.append({"error": f"messages: {exc}"})
        groups = self._add_all(prompts, sampling_params, chat=True)
        done = {o.request_id: o for o in self._drain(groups, use_tqdm)}
        outs = [done[g] for g in groups]
        for prompt, out in zip(prompts, outs, strict=True):
            if isinstance(prompt, str):
                parse_chat_output(out, prompt)
        return outs

    # ---- internals ----------------------------------------------------------------------------
    def _add_all(self, prompts, sampling_params, chat: bool = False) -> list[str]:
        if isinstance(prompts, (str, dict)) or (
                isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"sampling_params: got {len(params)} for {len(prompts)} "
                                 "prompts; pass one, or one per prompt")
        groups = []
        for prompt, sp in zip(prompts, params, strict=True):
            groups.append(self._add_one(prompt, sp, chat))
        return groups

    def _add_one(self, prompt, params, chat: bool) -> str:
        if isinstance(prompt, dict):
            if "error" in prompt:
                return self.engine.add_request(None, params, error=prompt["error"])
            if "prompt_token_ids" in prompt:
                return self.engine.add_request(None, params,
                                               prompt_token_ids=prompt["prompt_token_ids"])
            prompt = prompt.get("prompt")
        if chat and isinstance(prompt, str):
            ids = self.engine.tokenizer.encode(prompt, add_special_tokens=False)
            group = self.engine.add_request(prompt, params, prompt_token_ids=ids)
            return group
        return self.engine.add_request(prompt, params)

    def _drain(self, groups: list[str], use_tqdm: bool) -> Iterator[RequestOutput]:
        pending = set(groups)
        for g in groups:  # requests rejected at add time are already complete
            if self._complete(g):
                pending.discard(g)
                yield self._take(g)
        bar = tqdm(total=len(groups), desc="generate", unit="req", disable=not use_tqdm,
                   initial=len(groups) - len(pending))
        start, tokens = time.perf_counter(), self.engine.stats.output_tokens
        try:
            while pending:
                if not self.engine.has_unfinished():
                    raise RuntimeError("engine idle with requests pending: "
                                       f"{sorted(pending)[:5]}")
                for g in self.engine.step():
                    if g in pending:
                        pending.discard(g)
                        bar.update(1)
                        yield self._take(g)
                elapsed = time.perf_counter() - start
                if use_tqdm and elapsed > 0:
                    bar.set_postfix(tok_s=f"{(self.engine.stats.output_tokens - tokens) / elapsed:.1f}")
        finally:
            bar.close()

    def _complete(self, group: str) -> bool:
        return all(self.engine.requests[r].finished for r in self.engine.groups[group])

    def _take(self, group: str) -> RequestOutput:
        out = self.engine.output(group)
        self.engine.release(group)
        return out


def parse_chat_output(out: RequestOutput, prompt: str) -> None:
    """Fill reasoning_content / content / tool_calls of each completion from its text."""
    for completion in out.outputs:
        parser = OutputParser.for_prompt(prompt)
        parser.feed(completion.text)
        parsed = parser.finish()
        completion.reasoning_content = parsed.reasoning_content
        completion.content = parsed.content
        completion.tool_calls = parsed.tool_calls
        completion.parse_warnings = list(parsed.warnings) + list(parsed.errors)
