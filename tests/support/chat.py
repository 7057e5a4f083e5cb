"""Chat messages shared by the chat-encoding tests."""

from __future__ import annotations

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def user(text: str, **kw) -> dict:
    return {"role": "user", "content": text, **kw}
