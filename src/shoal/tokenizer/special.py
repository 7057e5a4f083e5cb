"""The special strings of the DeepSeek-V4.1 chat format (model.md §8): turn markers, thinking
tags, task tokens and the DSML tool-call tags (tag names carry a leading space)."""

from __future__ import annotations

from collections.abc import Mapping

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
THINK_START = "<think>"
THINK_END = "</think>"
DSML = "｜DSML｜"
SYSTEM_TOKEN = "<｜System｜>"
USER_TOKEN = "<｜User｜>"
ASSISTANT_TOKEN = "<｜Assistant｜>"
LATEST_REMINDER_TOKEN = "<｜latest_reminder｜>"
IMAGE_PLACEHOLDER = "<｜deepseek_image｜>"
TASK_TOKENS: Mapping[str, str] = {
    "action": "<｜action｜>",
    "query": "<｜query｜>",
    "authority": "<｜authority｜>",
    "domain": "<｜domain｜>",
    "title": "<｜title｜>",
    "read_url": "<｜read_url｜>",
}

CALLS_OPEN = f"<{DSML} calls>"
CALLS_CLOSE = f"</{DSML} calls>"
INVOKE_OPEN_PREFIX = f"<{DSML} invoke"
INVOKE_CLOSE = f"</{DSML} invoke>"
PARAM_OPEN_PREFIX = f"<{DSML} parameter"
PARAM_CLOSE = f"</{DSML} parameter>"
