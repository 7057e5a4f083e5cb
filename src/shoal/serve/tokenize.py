"""`/tokenize` and `/detokenize` (vLLM's): the token ids the engine would see for a prompt or for
chat messages (the same encoding as /v1/completions and /v1/chat/completions), and ids back to
text. Bad input is a 400, another model's name a 404, like the generation endpoints."""

from __future__ import annotations

import asyncio
from typing import Any

from pydantic import BaseModel, ConfigDict

from shoal.serve.protocol import ChatCompletionRequest, ChatMessage
from shoal.tokenizer.encoding import encode_messages


class TokenizeRequest(BaseModel):
    """Either `prompt` (text; `add_special_tokens` as a completion's prompt gets them) or
    `messages` (with the chat options that change their encoding)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    tools: list[dict[str, Any]] | None = None
    reasoning_effort: str | int | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[int]


async def tokenize(body: TokenizeRequest, tokenizer, model_name: str,
                   max_model_len: int) -> dict[str, Any]:
    """{"count", "max_model_len", "tokens"[, "token_strs"]}; ValueError on bad input."""
    if (body.prompt is None) == (body.messages is None):
        raise ValueError("tokenize: give exactly one of prompt and messages")
    if body.messages is not None:
        chat = ChatCompletionRequest(
            model=model_name, messages=body.messages, tools=body.tools,
            reasoning_effort=body.reasoning_effort,
            chat_template_kwargs=body.chat_template_kwargs,
            **{k: getattr(body, k) for k in ("add_generation_prompt", "continue_final_message")
               if k in body.model_fields_set})
        text = encode_messages(chat.message_dicts(), **chat.encode_options())
        ids = await asyncio.to_thread(tokenizer.encode, text, add_special_tokens=False)
    else:
        ids = await asyncio.to_thread(tokenizer.encode, body.prompt,
                                      add_special_tokens=body.add_special_tokens)
    out: dict[str, Any] = {"count": len(ids), "max_model_len": max_model_len, "tokens": ids}
    if body.return_token_strs:
        out["token_strs"] = [tokenizer.id_to_token(t) for t in ids]
    return out


async def detokenize(body: DetokenizeRequest, tokenizer, vocab_size: int) -> dict[str, str]:
    """{"prompt": the text of `tokens`}; ValueError for an id outside the vocabulary."""
    bad = [t for t in body.tokens if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"tokens: {len(bad)} id(s) outside the vocabulary [0, {vocab_size}), "
                         f"e.g. {bad[0]}")
    return {"prompt": await asyncio.to_thread(tokenizer.decode, body.tokens)}
