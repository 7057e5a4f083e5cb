"""`LLM.chat` end to end: the prompt is `encode_messages` of the conversation, tokenised without
an extra BOS; greedy tokens equal the reference loop on that prompt; reasoning_content /
content / tool_calls agree with `parse_completion` of the completion text (reasoning mode
follows the prompt's last thinking token); a bad conversation fails alone and in place.
"""

from __future__ import annotations

import pytest

from engine.refloop import assert_greedy, main_prompts, shared_llm, tokenizer
from shoal import SamplingParams
from shoal.tokenizer.encoding import encode_messages
from shoal.tokenizer.parser import parse_completion

MAX_TOKENS = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


def check_parse(completion, prompt: str) -> None:
    parsed = parse_completion(completion.text, reasoning=prompt.endswith("<think>"))
    assert completion.reasoning_content == parsed.reasoning_content
    assert completion.content == parsed.content
    assert completion.tool_calls == parsed.tool_calls


def test_chat_mode_prompt_tokens_and_parse() -> None:
    ps = main_prompts()
    ref = ps.refs()[4]
    conv = list(ps.messages)
    bad = [{"role": "robot", "content": "beep"}]
    outs = shared_llm().chat([conv, bad, conv], GREEDY, use_tqdm=False,
                             reasoning_effort="none")
    assert len(outs) == 3
    assert outs[1].error is not None and "role" in outs[1].error and not outs[1].outputs
    prompt = encode_messages(conv, reasoning_effort="none")
    assert prompt.endswith("</think>")  # chat mode: the model answers directly
    for out in (outs[0], outs[2]):
        assert out.error is None, out.error
        assert out.prompt == prompt
        assert out.prompt_token_ids == tokenizer().encode(prompt) == list(ref.prompt)
        (c,) = out.outputs
        assert_greedy(c.token_ids, c.finish_reason, ref, MAX_TOKENS)
        assert c.reasoning_content is None
        check_parse(c, prompt)


def test_thinking_mode_multi_turn_prompt_and_parse() -> None:
    conv = [{"role": "user", "content": "the quick brown fox"},
            {"role": "assistant", "content": "jumps", "reasoning_content": "hmm"},
            {"role": "user", "content": "over the lazy dog"}]
    (out,) = shared_llm().chat(conv, GREEDY.replace(max_tokens=3), use_tqdm=False)
    prompt = encode_messages(conv)
    assert prompt.endswith("<think>")
    assert out.error is None, out.error
    assert out.prompt == prompt
    assert out.prompt_token_ids == tokenizer().encode(prompt)
    assert out.prompt_token_ids.count(0) == 1  # BOS once: the text already starts with it
    (c,) = out.outputs
    assert len(c.token_ids) <= 3
    assert isinstance(c.reasoning_content, str)
    check_parse(c, prompt)


def test_vllm_chat_options() -> None:
    """vLLM's `chat_template_kwargs={"enable_thinking": False}` is chat mode, as
    reasoning_effort="none" is here; `continue_final_message` continues an assistant prefix
    (its prompt ends with the prefix: no end of turn); an unknown template key is refused."""
    conv = [{"role": "user", "content": "the quick brown fox"}]
    llm = shared_llm()
    (off,) = llm.chat(conv, GREEDY, use_tqdm=False, chat_template_kwargs={"enable_thinking": False})
    assert off.prompt == encode_messages(conv, thinking=False) and off.prompt.endswith("</think>")
    prefix = conv + [{"role": "assistant", "content": "jumps over"}]
    (cont,) = llm.chat(prefix, GREEDY, use_tqdm=False, continue_final_message=True)
    assert cont.error is None and cont.prompt.endswith("jumps over")
    with pytest.raises(ValueError, match="chat_template_kwargs"):
        llm.chat(conv, GREEDY, use_tqdm=False, chat_template_kwargs={"x": 1})
