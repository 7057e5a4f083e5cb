"""Server-sent events: one event's text, and several event streams merged as they come."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Sequence
from typing import Any


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def merge(streams: Sequence[AsyncIterator[str]]) -> AsyncIterator[str]:
    """The streams' items in arrival order. An error in one ends the merge with it; closing
    the merge closes every stream (their `finally` blocks run)."""
    if len(streams) == 1:  # no pump task and queue hop per item
        async with contextlib.aclosing(streams[0]) as stream:
            async for item in stream:
                yield item
        return
    items: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(stream: AsyncIterator[str]) -> None:
        try:
            async for item in stream:
                await items.put(item)
        finally:
            await items.put(done)

    tasks = [asyncio.create_task(pump(stream)) for stream in streams]
    try:
        running = len(tasks)
        while running:
            item = await items.get()
            if item is done:
                running -= 1
                continue
            yield item
        for task in tasks:
            task.result()
    finally:
        for task in tasks:
            task.cancel()
