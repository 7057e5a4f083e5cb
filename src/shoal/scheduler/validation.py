"""A new request's checks before it queues (`validate`) and the message of a request the whole KV
pool cannot hold (`capacity_message`): each bad request finishes alone with a clear reason."""

from __future__ import annotations

from shoal.scheduler.kv_cache_manager import KVCacheManager
from shoal.scheduler.request import FINISH_ERROR, FINISH_KV_CAPACITY, Request


def validate(request: Request, max_model_len: int, kv: KVCacheManager) -> tuple[str | None, str]:
    """(None, "") for a request that may queue, else (message, finish reason: `error`, or
    `kv_capacity` when its prompt alone needs more blocks than the pool has)."""
    n_prompt = request.num_prompt_tokens
    if n_prompt < 1:
        return "prompt_token_ids is empty; a prompt needs at least one token", FINISH_ERROR
    if request.max_tokens is not None and request.max_tokens < 1:
        return f"max_tokens={request.max_tokens}: expected >= 1", FINISH_ERROR
    if request.min_tokens < 0:
        return f"min_tokens={request.min_tokens}: expected >= 0", FINISH_ERROR
    if request.max_tokens is not None and request.min_tokens > request.max_tokens:
        return (f"min_tokens={request.min_tokens} exceeds max_tokens="
                f"{request.max_tokens}", FINISH_ERROR)
    wanted = n_prompt + (request.max_tokens if request.max_tokens is not None else 1)
    if wanted > max_model_len:
        what = (f"+ max_tokens {request.max_tokens}" if request.max_tokens is not None
                else "+ 1 output token")
        return (f"prompt of {n_prompt} tokens {what} = {wanted} exceeds max_model_len="
                f"{max_model_len}; shorten the prompt or lower max_tokens", FINISH_ERROR)
    if kv.blocks_for_tokens(n_prompt) > kv.num_blocks:
        return capacity_message(request, kv), FINISH_KV_CAPACITY
    return None, ""


def capacity_message(request: Request, kv: KVCacheManager) -> str:
    capacity = kv.num_blocks * kv.block_size
    return (f"request needs KV for {request.num_tokens} tokens but the whole cache holds "
            f"{capacity} ({kv.num_blocks} blocks of {kv.block_size}); "
            "raise the KV memory budget or shorten the request")
