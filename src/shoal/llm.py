"""LLM: the offline API. `generate()` / `chat()` return one output per input, in input order;
`generate_iter()` and `run()` yield outputs as requests finish. No scheduling logic lives here.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from tqdm import tqdm

from shoal.config import EngineConfig, RunnerConfig
from shoal.engine.engine import Engine
from shoal.engine.outputs import RequestOutput
from shoal.parallel.torchrun import launched_world
from shoal.sampling import SamplingParams
from shoal.tokenizer.encoding import encode_messages, template_kwargs_options
from shoal.tokenizer.parser import OutputParser

PromptLike = str | Sequence[int] | dict


class LLM:
    """`LLM(model="tiny" | "mini" | "flash" | "/path/to/checkpoint", **engine_options)`.

    Engine options are the fields of CacheConfig, SchedulerConfig and RunnerConfig
    (e.g. max_num_seqs=32, prefill_mode="staircase", device="cpu"); unknown ones raise.
    `data_parallel_size=N` runs N engine replicas in their own processes (one per GPU), each
    with its own scheduler and KV pool; outputs are those of one engine. Under `torchrun`
    (one node or several) each process is one replica (`parallel/torchrun.py`): every rank
    returns every output.
    """

    def __init__(self, model: str = "tiny", *, data_parallel_size: int = 1,
                 **kwargs: Any) -> None:
        self.replicas = None
        self.torchrun = None
        self._tokenizer = None
        if launched_world() > 1:
            from shoal.parallel.torchrun import TorchrunRank

            self.torchrun = TorchrunRank(data_parallel_size, kwargs.get("device", "auto"),
                                         kwargs.get("collective_timeout_s",
                                                    RunnerConfig.collective_timeout_s))
            kwargs = dict(kwargs, device=self.torchrun.device)
            data_parallel_size = 1
        self.config = EngineConfig.create(model, **kwargs)
        start = time.perf_counter()
        if data_parallel_size == 1:
            self.engine: Engine | None = Engine(self.config)
        else:
            from shoal.parallel.data_parallel import DataParallel

            self.engine = None
            self.replicas = DataParallel(model, data_parallel_size, kwargs)
        self.startup_seconds = time.perf_counter() - start

    def startup_summary(self) -> str:
        """How long the start took, and where (one engine in this process: weights, prefill
        warm-up, CUDA graph capture)."""
        where = f"{self.replicas.size} replicas" if self.replicas is not None else \
            str(self.engine.runner.device)
        line = f"{self.config.model} ready on {where} in {self.startup_seconds:.1f} s"
        if self.engine is not None:
            runner = self.engine.runner
            graphs = runner.graphs
            line += (f" (weights {runner.load_seconds:.1f} s, prefill warm-up "
                     f"{runner.warmup_seconds:.1f} s, "
                     + (f"{graphs.num_graphs} CUDA graphs in {graphs.capture_seconds:.1f} s)"
                        if graphs is not None else "no CUDA graphs)"))
        return line

    @property
    def tokenizer(self):
        if self.engine is not None:
            return self.engine.tokenizer
        if self._tokenizer is None:
            from shoal.tokenizer.tokenizer import load_tokenizer

            self._tokenizer = load_tokenizer(self.config)
        return self._tokenizer

    def expert_loads(self) -> dict[str, list[int]]:
        """Tokens routed to each expert of each MoE layer so far (`record_expert_loads=True`;
        summed over the data-parallel replicas): the input of `shoal eplb`."""
        if self.replicas is not None:
            return self.replicas.expert_loads()
        loads = self.engine.runner.model.expert_loads
        if loads is None:
            raise ValueError("expert_loads(): create the LLM with record_expert_loads=True")
        mine = {prefix: counts.tolist() for prefix, counts in sorted(loads.items())}
        return mine if self.torchrun is None else self.torchrun.summed(mine)

    @property
    def primary(self) -> bool:
        """Whether this process writes files and prints summaries (False on torchrun ranks
        other than 0)."""
        return self.torchrun is None or self.torchrun.primary

    def close(self) -> None:
        """Stop the data-parallel replicas (a single engine needs no closing)."""
        if self.replicas is not None:
            self.replicas.close()
            self.replicas = None

    # ---- generate ---------------------------------------------------------------------------
    def generate(self, prompts: PromptLike | Sequence[PromptLike],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None,
                 ) -> list[RequestOutput]:
        """Complete each prompt (a string, a list of token ids, or {"prompt": ...} /
        {"prompt_token_ids": [...]}). Returns one RequestOutput per prompt, in order; a bad
        prompt gets an output with `error` set instead of raising. `priority`: one per prompt
        (lower runs sooner under scheduling_policy='priority')."""
        items = self._items(_as_list(prompts), sampling_params)
        if priority is not None:
            if len(priority) != len(items):
                raise ValueError(f"priority: got {len(priority)} for {len(items)} prompts")
            for item, p in zip(items, priority, strict=True):
                item["priority"] = p
        return _in_order(self.run(items, use_tqdm), len(items))

    def generate_iter(self, prompts: PromptLike | Sequence[PromptLike],
                      sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                      ) -> Iterator[RequestOutput]:
        """Like generate(), but yields each output as soon as its request finishes."""
        for _, out in self.run(self._items(_as_list(prompts), sampling_params), False):
            yield out

    # ---- chat ---------------------------------------------------------------------------------
    def chat(self, messages: Sequence[dict] | Sequence[Sequence[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, *, tools: Sequence[dict] | None = None,
             reasoning_effort: str | int | None = None,
             chat_template_kwargs: dict[str, Any] | None = None, **encode_options: Any,
             ) -> list[RequestOutput]:
        """Chat completions with the official V4.1 encoding: reasoning, content and DSML tool
        calls come back parsed on each CompletionOutput (reasoning_content, content,
        tool_calls). One conversation (a list of messages) or a list of conversations.
        `encode_options`: `encode_messages`' (thinking, add_generation_prompt,
        continue_final_message, ...); `chat_template_kwargs`: vLLM's (`enable_thinking`)."""
        encode_options = {**template_kwargs_options(chat_template_kwargs), **encode_options}
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        items = self._items([{"messages": list(c)} for c in convs], sampling_params)
        for item in items:
            item.update(tools=tools, reasoning_effort=reasoning_effort, **encode_options)
        return _in_order(self.run(items, use_tqdm), len(items))

    # ---- mixed batches --------------------------------------------------------------------------
    def run(self, items: Sequence[dict], use_tqdm: bool = True,
            ) -> Iterator[tuple[int, RequestOutput]]:
        """Submit a mixed batch and yield (input index, output) as requests finish.

        Each item is a dict with one of "prompt" (text or token ids), "prompt_token_ids",
        "messages" (chat; optional "tools", "reasoning_effort" and other encode_messages
        options) or "error" (a request already known to be bad: it comes back with that
        error), plus optional "sampling_params", "priority" and "request_index" (what seeds a
        request without its own seed; default: its place among this LLM's requests, on one
        engine or several). Chat outputs come back parsed.

        An exception while it runs (a KeyboardInterrupt, or the caller closing the iterator)
        aborts the requests of this call that have not come back, and the LLM stays usable."""
        if self.replicas is not None:
            yield from self.replicas.run(items, use_tqdm)
            return
        if self.torchrun is not None:
            yield from self.torchrun.run(items, lambda share: self._run_local(share, use_tqdm),
                                         self.engine.serve_until_idle)
            return
        yield from self._run_local(items, use_tqdm)

    def _run_local(self, items: Sequence[dict], use_tqdm: bool
                   ) -> Iterator[tuple[int, RequestOutput]]:
        batch: list | None = list(enumerate(items))

        def feed(wait: bool) -> list | None:  # every item at once, then no more
            nonlocal batch
            got, batch = batch, None
            return got

        bar = tqdm(total=len(items), desc="generate", unit="req", disable=not use_tqdm)
        start, tokens = time.perf_counter(), self.engine.stats.output_tokens
        try:
            for index, out in self.run_fed(feed):
                bar.update(1)
                elapsed = time.perf_counter() - start
                if use_tqdm and elapsed > 0:
                    rate = (self.engine.stats.output_tokens - tokens) / elapsed
                    bar.set_postfix(tok_s=f"{rate:.1f}")
                yield index, out
        finally:
            bar.close()

    def run_fed(self, feed: Callable[[bool], list[tuple[Any, dict]] | None]
                ) -> Iterator[tuple[Any, RequestOutput]]:
        """`run` for requests that arrive while it runs (a data-parallel replica's loop):
        feed(wait) gives the next (key, item) pairs, [] when none is ready (it may block only
        when `wait`, which is asked when nothing is running), or None once no more will come.
        Yields (key, output) as requests finish; an exception aborts the unfinished ones."""
        keys: dict[str, Any] = {}
        chat_prompts: dict[str, str] = {}
        ended = False
        try:
            while True:
                if not ended:
                    if not keys:
                        self.engine.flush()  # no step in flight while waiting for work
                    got = feed(not keys)
                    ended = got is None
                    for key, item in got or ():
                        group, prompt = self._submit(item)
                        keys[group] = key
                        if prompt is not None:
                            chat_prompts[group] = prompt
                    for group in [g for g in keys if self._complete(g)]:  # rejected at add
                        yield keys.pop(group), self._take(group, chat_prompts)
                if not keys:
                    if ended:
                        break
                    continue
                if not self.engine.has_unfinished():
                    raise RuntimeError(f"engine idle with requests pending: {sorted(keys)[:5]}")
                for group in self.engine.step():
                    if group in keys:
                        yield keys.pop(group), self._take(group, chat_prompts)
            self.engine.flush()
        except BaseException:
            self.engine.cancel(list(keys))
            raise

    # ---- internals ----------------------------------------------------------------------------
    @staticmethod
    def _items(prompts: list, sampling_params) -> list[dict]:
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"sampling_params: got {len(params)} for {len(prompts)} "
                                 "prompts; pass one, or one per prompt")
        items = []
        for prompt, sp in zip(prompts, params, strict=True):
            item = dict(prompt) if isinstance(prompt, dict) else {"prompt": prompt}
            item.setdefault("sampling_params", sp)
            items.append(item)
        return items

    def _submit(self, item: dict) -> tuple[str, str | None]:
        """Queue one item; returns (group id, the chat prompt text if it is a chat item)."""
        params = item.get("sampling_params")
        add = functools.partial(self.engine.add_request, request_index=item.get("request_index"),
                                priority=item.get("priority", 0))
        if "error" in item:
            return add(None, params, error=item["error"]), None
        if "messages" in item:
            options = {k: v for k, v in item.items()
                       if k not in ("messages", "sampling_params", "request_index",
                                    "priority") and v is not None}
            try:
                prompt = encode_messages(list(item["messages"]), **options)
            except (ValueError, TypeError) as exc:
                return add(None, params, error=f"messages: {exc}"), None
            ids = self.engine.tokenizer.encode(prompt, add_special_tokens=False)
            return add(prompt, params, prompt_token_ids=ids), prompt
        if "prompt_token_ids" in item:
            return add(None, params, prompt_token_ids=item["prompt_token_ids"]), None
        return add(item.get("prompt"), params), None

    def _complete(self, group: str) -> bool:
        return all(self.engine.requests[r].finished for r in self.engine.groups[group])

    def _take(self, group: str, chat_prompts: dict[str, str] | None = None) -> RequestOutput:
        out = self.engine.output(group)
        self.engine.release(group)
        if chat_prompts and group in chat_prompts:
            parse_chat_output(out, chat_prompts[group])
        return out


def _as_list(prompts) -> list:
    if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)):
        return [prompts]
    return list(prompts)


def _in_order(pairs: Iterator[tuple[int, RequestOutput]], n: int) -> list[RequestOutput]:
    outs: list[RequestOutput | None] = [None] * n
    for i, out in pairs:
        outs[i] = out
    return outs  # type: ignore[return-value]


def parse_chat_output(out: RequestOutput, prompt: str) -> None:
    """Fill reasoning_content / content / tool_calls of each completion from its text."""
    for completion in out.outputs:
        parser = OutputParser.for_prompt(prompt)
        parser.feed(completion.text)
        parsed = parser.finish()
        completion.reasoning_content = parsed.reasoning_content
        completion.content = parsed.content
        completion.tool_calls = parsed.tool_calls
        completion.tool_call_cut = parsed.call_cut
        completion.parse_warnings = list(parsed.warnings) + list(parsed.errors)
