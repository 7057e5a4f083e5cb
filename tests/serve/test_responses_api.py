"""OpenAI's Responses API through the real `openai` client on tiny (CPU, loopback): a response
equals the chat completion of the same messages (text, reasoning, usage, status), its stream
equals it item for item with well-formed events, `previous_response_id` continues a stored
conversation, function calls and their outputs round-trip, log-probs are the message tokens'
(streamed or not), and what cannot be served is a 400 naming the field."""

from __future__ import annotations

import json
import urllib.request

import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from support.chat import TOOL_BLOCK
from support.live_server import API_KEY, LiveServer, post

NO_THINKING = {"effort": "none"}


def chat_of(live: LiveServer, messages: list[dict], **kw):
    return live.client().chat.completions.create(model="tiny", messages=messages,
                                                 temperature=0, **kw)


def test_a_response_is_the_chat_completion_of_its_messages(live: LiveServer) -> None:
    client = live.client()
    for effort, chat_effort in ((None, None), ({"effort": "none"}, "none"),
                                ({"effort": "minimal"}, "low")):
        extra = {} if effort is None else {"reasoning": effort}
        r = client.responses.create(model="tiny", instructions="be brief",
                                    input=[{"role": "user", "content": [
                                        {"type": "input_text", "text": "hello "},
                                        {"type": "input_text", "text": "there"}]}],
                                    max_output_tokens=10, temperature=0, **extra)
        chat = chat_of(live, [{"role": "system", "content": "be brief"},
                              {"role": "user", "content": "hello there"}], max_tokens=10,
                       **({} if chat_effort is None else {"reasoning_effort": chat_effort}))
        message = chat.choices[0].message
        assert r.object == "response" and r.id.startswith("resp_") and r.model == "tiny"
        assert r.output_text == (message.content or "")
        reasoning = [i for i in r.output if i.type == "reasoning"]
        assert ("".join(p.text for i in reasoning for p in i.content)
                == (getattr(message, "reasoning_content", None) or ""))
        assert r.usage.input_tokens == chat.usage.prompt_tokens
        assert r.usage.output_tokens == chat.usage.completion_tokens == 10
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
        assert r.output[-1].status == "incomplete"
        thinking = effort is None or effort["effort"] != "none"
        assert (r.usage.output_tokens_details.reasoning_tokens > 0) == thinking


def test_the_stream_equals_the_response(live: LiveServer) -> None:
    client = live.client()
    args = {"model": "tiny", "input": "once upon a time", "max_output_tokens": 40,
            "temperature": 0.8, "extra_body": {"seed": 3}}
    whole = client.responses.create(**args)
    events = list(client.responses.create(**args, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    final = events[-1].response
    assert events[-1].type == f"response.{whole.status}" and final.status == whole.status
    assert final.id == events[0].response.id and final.usage == whole.usage
    assert [(i.type, i.status) for i in final.output] == [(i.type, i.status)
                                                          for i in whole.output]
    assert final.output_text == whole.output_text
    for index, item in enumerate(final.output):  # each item: added, deltas, done
        mine = [e for e in events if getattr(e, "output_index", None) == index]
        assert mine[0].type == "response.output_item.added" and mine[0].item.id == item.id
        assert mine[-1].type == "response.output_item.done" and mine[-1].item == item
        deltas = "".join(e.delta for e in mine if e.type.endswith(".delta"))
        assert deltas == item.content[0].text
        assert all(e.item_id == item.id for e in mine if hasattr(e, "item_id"))
    assert client.responses.retrieve(final.id).output_text == whole.output_text


def test_previous_response_id_continues_the_conversation(live: LiveServer) -> None:
    client = live.client()
    first = client.responses.create(model="tiny", input="hi", max_output_tokens=6,
                                    temperature=0, reasoning=NO_THINKING)
    second = client.responses.create(model="tiny", input="and then?", max_output_tokens=6,
                                     temperature=0, reasoning=NO_THINKING,
                                     previous_response_id=first.id)
    chat = chat_of(live, [{"role": "user", "content": "hi"},
                          {"role": "assistant", "content": first.output_text},
                          {"role": "user", "content": "and then?"}],
                   max_tokens=6, reasoning_effort="none")
    assert second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert second.previous_response_id == first.id
    unstored = client.responses.create(model="tiny", input="hi", max_output_tokens=2,
                                       store=False)
    for rid in (unstored.id, "resp_nothing"):
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(rid)
        with pytest.raises(openai.NotFoundError, match="previous_response_id"):
            client.responses.create(model="tiny", input="x", previous_response_id=rid)
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)


def test_function_calls_and_their_outputs(live: LiveServer) -> None:
    """A DSML call in the output is a function_call item (forced here by a grammar: random
    weights make no call); sent back with its output, the next turn's prompt is the chat
    encoding of the assistant's tool call and the tool's result."""
    client = live.client()
    forced = client.responses.create(
        model="tiny", input="weather in Paris?", max_output_tokens=100, temperature=0,
        reasoning=NO_THINKING, extra_body={"guided_choice": [TOOL_BLOCK]})
    (call,) = [i for i in forced.output if i.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert call.call_id.startswith("call_") and forced.status == "completed"
    streamed = list(client.responses.create(
        model="tiny", input="weather in Paris?", max_output_tokens=100, temperature=0,
        reasoning=NO_THINKING, extra_body={"guided_choice": [TOOL_BLOCK]}, stream=True))
    (done,) = [e for e in streamed if e.type == "response.function_call_arguments.done"]
    assert json.loads(done.arguments) == {"city": "Paris"}
    result = client.responses.create(
        model="tiny", previous_response_id=forced.id, max_output_tokens=5, temperature=0,
        reasoning=NO_THINKING,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    chat = chat_of(live, [
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": forced.output_text, "tool_calls": [
            {"id": call.call_id, "type": "function",
             "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"}],
        max_tokens=5, reasoning_effort="none")
    assert result.output_text == chat.choices[0].message.content
    assert result.usage.input_tokens == chat.usage.prompt_tokens


def test_a_reasoning_only_turn_stays_in_the_conversation(live: LiveServer) -> None:
    """A turn cut while thinking is one reasoning item: continued by previous_response_id or
    sent back as items, it is an assistant turn of reasoning alone, as in chat."""
    client = live.client()
    first = client.responses.create(model="tiny", input="hi", max_output_tokens=4,
                                    temperature=0)
    assert [i.type for i in first.output] == ["reasoning"] and first.status == "incomplete"
    chat = chat_of(live, [{"role": "user", "content": "hi"},
                          {"role": "assistant", "content": "", "reasoning_content": "".join(
                              p.text for p in first.output[0].content)},
                          {"role": "user", "content": "and then?"}], max_tokens=2)
    by_id = client.responses.create(model="tiny", input="and then?", max_output_tokens=2,
                                    temperature=0, previous_response_id=first.id)
    as_items = client.responses.create(
        model="tiny", max_output_tokens=2, temperature=0,
        input=[{"role": "user", "content": "hi"},
               *[i.model_dump(exclude_none=True) for i in first.output],
               {"role": "user", "content": "and then?"}])
    assert by_id.usage.input_tokens == as_items.usage.input_tokens == chat.usage.prompt_tokens
    assert by_id.output_text == as_items.output_text == (chat.choices[0].message.content or "")


def test_a_call_cut_by_max_output_tokens_is_incomplete(live: LiveServer) -> None:
    """The token limit inside a DSML call: the call item is `incomplete` (an agent must not
    run it), streamed or not; a whole call in an incomplete response stays `completed`."""
    client = live.client()
    args = {"model": "tiny", "input": "weather?", "temperature": 0, "reasoning": NO_THINKING,
            "extra_body": {"guided_choice": [TOOL_BLOCK + TOOL_BLOCK]}}
    for limit, status in ((30, "incomplete"), (100, "completed")):  # (one block: 86 tokens)
        r = client.responses.create(**args, max_output_tokens=limit)
        streamed = list(client.responses.create(**args, max_output_tokens=limit, stream=True))
        for output in (r.output, streamed[-1].response.output):
            calls = [i for i in output if i.type == "function_call"]
            assert calls[0].status == status and r.status == "incomplete"


def test_json_schema_text_format(live: LiveServer) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False, "x-guidance": {"whitespace_flexible": False}}
    r = live.client().responses.create(
        model="tiny", input="answer", max_output_tokens=24, temperature=1.0,
        extra_body={"seed": 9}, reasoning=NO_THINKING,
        text={"format": {"type": "json_schema", "name": "r", "schema": schema}})
    value = json.loads(r.output_text)
    assert set(value) == {"ok"} and isinstance(value["ok"], bool)
    assert r.text.format.type == "json_schema"


def test_objects_and_events_validate_as_the_sdk_types(live: LiveServer) -> None:
    """Strict validation (the client itself parses leniently): the response object and every
    streamed event, with reasoning, text cut by the limit, a function call, and log-probs."""
    events = TypeAdapter(ResponseStreamEvent)
    for body in ({"input": "hi", "max_output_tokens": 8},
                 {"input": "hi", "max_output_tokens": 100, "temperature": 0,
                  "reasoning": NO_THINKING, "guided_choice": [TOOL_BLOCK]},
                 {"input": "hi", "max_output_tokens": 8, "reasoning": NO_THINKING,
                  "include": ["message.output_text.logprobs"], "top_logprobs": 1}):
        code, raw = post(live, "/v1/responses", {"model": "tiny", **body})
        assert code == 200
        Response.model_validate(raw)
        req = urllib.request.Request(
            live.base + "/v1/responses", data=json.dumps(
                {"model": "tiny", "stream": True, **body}).encode(),
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"})
        with urllib.request.urlopen(req, timeout=60) as r:
            text = r.read().decode()
        lines = [line for line in text.split("\n") if line]
        assert [line.split(": ", 1)[0] for line in lines] == ["event", "data"] * (len(lines) // 2)
        for name, data in zip(lines[::2], lines[1::2], strict=True):
            event = events.validate_python(json.loads(data[len("data: "):]))
            assert name == f"event: {event.type}"


def test_log_probs_are_the_message_tokens(live: LiveServer) -> None:
    """`include: ["message.output_text.logprobs"]` with `top_logprobs`: the message's tokens,
    with the chat completion's values; the stream's deltas carry them in order, and they add
    up to the done event's and the response's."""
    client = live.client()
    args = {"model": "tiny", "input": "hi", "max_output_tokens": 12, "temperature": 0,
            "reasoning": NO_THINKING, "include": ["message.output_text.logprobs"],
            "top_logprobs": 2}
    r = client.responses.create(**args)
    (message,) = [i for i in r.output if i.type == "message"]
    lps = message.content[0].logprobs
    chat = chat_of(live, [{"role": "user", "content": "hi"}], max_tokens=12,
                   reasoning_effort="none", logprobs=True, top_logprobs=2)
    want = [(c.token, c.logprob, [t.token for t in c.top_logprobs])
            for c in chat.choices[0].logprobs.content]
    assert lps and [(x.token, x.logprob, [t.token for t in x.top_logprobs])
                    for x in lps] == want[:len(lps)]
    assert r.status == "incomplete" and len(lps) == r.usage.output_tokens == 12  # (no call)
    events = list(client.responses.create(**args, stream=True))
    streamed = [x for e in events if e.type == "response.output_text.delta" for x in e.logprobs]
    (done,) = [e for e in events if e.type == "response.output_text.done"]
    final = [i for i in events[-1].response.output if i.type == "message"][0]
    def dumped(xs):  # (each event type has its own Logprob class)
        return [x.model_dump() for x in xs]

    assert (dumped(streamed) == dumped(done.logprobs) == dumped(final.content[0].logprobs)
            == dumped(lps))
    plain = client.responses.create(**{k: v for k, v in args.items()
                                       if k not in ("include", "top_logprobs")})
    assert plain.output[-1].content[0].logprobs == []


BAD = [  # (body, text the 400's message names)
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0]"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "x", "tool_choice": {"type": "allowed_tools"}}, "tool_choice"),
    ({"input": [{"type": "computer_call"}]}, "input[0].type"),
    ({"input": [{"type": "function_call", "name": "f"}]}, "input[0]"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "n": 2}, "n"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "reasoning": {"effort": "extreme"}}, "reasoning_effort"),
    ({"input": "x", "top_logprobs": 21}, "top_logprobs"),
]


def test_what_cannot_be_served_is_a_400_naming_it(live: LiveServer) -> None:
    for body, text in BAD:
        code, reply = post(live, "/v1/responses", {"model": "tiny", **body})
        assert code == 400 and text in reply["error"]["message"], (body, reply)
    code, reply = post(live, "/v1/responses", {"model": "other", "input": "x"})
    assert code == 404
    code, reply = post(live, "/v1/responses", {"model": "tiny", "input": "x", "max_output_tokens":
                                              2, "include": ["reasoning.encrypted_content"]})
    assert code == 200  # (what agent SDKs send by default: nothing to include here)
