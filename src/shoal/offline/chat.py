"""`shoal chat`: an interactive conversation with the model, each reply streamed (the model's
modules are imported only when it runs)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any


def chat_args(c: argparse.ArgumentParser) -> None:
    c.add_argument("--max-tokens", dest="max_tokens", type=int, default=None,
                   help="per reply (default: a quarter of the context, at most 1024)")
    c.add_argument("--temperature", type=float, default=0.6)
    c.add_argument("--reasoning-effort", dest="reasoning_effort", default=None,
                   type=lambda v: int(v) if v.isdigit() else v,
                   help="none (chat mode), low, high, xhigh, max or 1-100 (default: thinking)")


def cmd_chat(args, check_config: Callable[[Any], None], make_llm: Callable[[Any], Any]) -> int:
    """A conversation on stdin / stdout, each reply streamed as the engine steps (reasoning
    marked); the reply options are checked before the model loads."""
    from shoal.sampling import SamplingParams
    from shoal.tokenizer.encoding import RELEASE_EFFORT_TABLE, encode_messages
    from shoal.tokenizer.parser import OutputParser

    check_config(args)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    if args.reasoning_effort != "none":
        RELEASE_EFFORT_TABLE.resolve(args.reasoning_effort)
    llm = make_llm(args)
    engine = llm.engine
    context = llm.config.scheduler.max_model_len
    max_tokens = args.max_tokens or max(1, min(1024, context // 4))
    params = params.replace(max_tokens=max_tokens)
    messages: list[dict] = []
    print(f"shoal chat ({args.model}, context {context} tokens, up to {max_tokens} per "
          "reply): an empty line or Ctrl-D quits", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            break
        if not line.strip():
            break
        messages.append({"role": "user", "content": line})
        prompt = encode_messages(messages, reasoning_effort=args.reasoning_effort)
        ids = engine.tokenizer.encode(prompt, add_special_tokens=False)
        room = context - len(ids) - 1
        group = engine.add_request(prompt, params.replace(max_tokens=max(1, min(max_tokens,
                                                                                room))),
                                   prompt_token_ids=ids)
        parser, shown, kind = OutputParser.for_prompt(prompt), 0, None
        try:  # stream: print each step's new text, reasoning marked as it comes
            while not all(engine.requests[r].finished for r in engine.groups[group]):
                engine.step()
                text = engine.requests[engine.groups[group][0]].text
                for event in parser.feed(text[shown:]):
                    if event.kind in ("reasoning", "content") and event.text:
                        if kind != event.kind:
                            kind = event.kind
                            print("[reasoning] " if kind == "reasoning" else "\n", end="")
                        print(event.text, end="", flush=True)
                shown = len(text)
            engine.flush()
        except KeyboardInterrupt:
            engine.cancel([group])
            print("\n(interrupted)", file=sys.stderr)
            messages.pop()
            continue
        out = engine.output(group)
        engine.release(group)
        print()
        if out.error:
            print(f"error: {out.error}", file=sys.stderr)
            messages.pop()
            continue
        parsed = parser.finish()
        messages.append({"role": "assistant", "content": parsed.content or "",
                         "reasoning_content": parsed.reasoning_content})
    return 0
