"""Chat messages and tool calls shared by the chat-encoding and server tests."""

from __future__ import annotations

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


# a whole DSML call of get_weather(city="Paris"), as the model writes one
TOOL_BLOCK = ('\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="get_weather">\n'
              '<｜DSML｜ parameter name="city" string="true">Paris</｜DSML｜ parameter>\n'
              '</｜DSML｜ invoke>\n</｜DSML｜ calls>')


def user(text: str, **kw) -> dict:
    return {"role": "user", "content": text, **kw}
