"""The request kinds of scripts/soak.py over the newest routes: OpenAI's Responses API, embeddings
and LoRA adapters by model name. Each answer is held to another route's (a Responses answer to the
chat completion of the same conversation, a stream to the whole response, an embedding to the same
input's again) rather than to a fixed text, since the model's weights are random."""

from __future__ import annotations

import asyncio
import random
import re
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import openai

from soak_client import Ctx, Expected, Mismatch, call, max_tokens, prompt, require, sampling
from soak_mix_extras import SCHEMAS, TOOLS, WEATHER, check_arguments

FUNCTIONS = [dict(tool["function"], type="function") for tool in TOOLS]  # the Responses API's tool shape
ITEM_ORDER = re.compile(r"(reasoning,)?(message,)?(function_call,)*")  # the output items, as the parsers give them
TEXT_EVENT = {"reasoning": "response.reasoning_text", "message": "response.output_text",
              "function_call": "response.function_call_arguments"}


def _item_text(item) -> str:
    if item.type == "function_call":
        return item.arguments
    return "".join(part.text for part in item.content)


def _text(response) -> str:
    """The reasoning's and the message's text (a chat choice's reasoning_content + content)."""
    return "".join(_item_text(item) for item in response.output if item.type != "function_call")


def _check_response(ctx: Ctx, r, max_output_tokens: int) -> None:
    """What every response must be: its items in the parsers' order, its status and usage."""
    types = "".join(item.type + "," for item in r.output)
    require(r.id.startswith("resp_") and r.object == "response" and r.model == ctx.model
            and ITEM_ORDER.fullmatch(types) is not None, f"response {r.id} {r.model} items {types}")
    usage = r.usage
    require(usage.input_tokens > 0 and usage.total_tokens == usage.input_tokens + usage.output_tokens
            and 0 < usage.output_tokens <= max_output_tokens, f"usage {usage}, max_output_tokens {max_output_tokens}")
    if r.status == "incomplete":
        require(r.incomplete_details.reason == "max_output_tokens" and usage.output_tokens == max_output_tokens,
                f"incomplete {r.incomplete_details} after {usage.output_tokens} tokens")
    else:
        require(r.status == "completed" and all(item.status == "completed" for item in r.output), f"status {r}")


def _request(rng: random.Random, max_output_tokens: int) -> Dict[str, Any]:
    """A Responses request's fields: sampling (seed in extra_body), thinking on or off."""
    fields = sampling(rng)
    extra = {"seed": fields.pop("seed")} if "seed" in fields else {}
    if rng.random() < 0.5:
        extra["chat_template_kwargs"] = {"enable_thinking": False}
    return dict(fields, max_output_tokens=max_output_tokens, extra_body=extra)


def _as_chat(fields: Dict[str, Any], messages: List[Dict[str, Any]]) -> Dict[str, Any]:
    """The chat completion a Responses request means (as the server's chat_request builds it)."""
    body = {k: fields[k] for k in ("temperature", "top_p") if k in fields}
    return dict(body, extra_body=fields["extra_body"], messages=messages,
                max_completion_tokens=fields["max_output_tokens"])


async def _events(ctx: Ctx, fields: Dict[str, Any]):
    """The streamed response's events, checked: numbered from 0, opened and closed as OpenAI's, each
    item's events in order and its deltas adding up to its text; returns the last event's response."""
    stream = await ctx.client.responses.create(model=ctx.model, stream=True, **fields)
    events = [e async for e in stream]
    require([e.sequence_number for e in events] == list(range(len(events))), "sequence numbers")
    final = events[-1].response
    end = "response.completed" if final.status == "completed" else "response.incomplete"
    want = ["response.created", "response.in_progress"]
    for item in final.output:
        part = [] if item.type == "function_call" else ["response.content_part"]
        want += (["response.output_item.added"] + [p + ".added" for p in part] + [TEXT_EVENT[item.type] + ".done"]
                 + [p + ".done" for p in part] + ["response.output_item.done"])
        deltas = "".join(e.delta for e in events if e.type == TEXT_EVENT[item.type] + ".delta" and e.item_id == item.id)
        require(deltas == _item_text(item), f"{item.type} deltas {deltas!r} vs {_item_text(item)!r}")
    got = [e.type for e in events if not e.type.endswith(".delta")]
    require(got == want + [end], f"events {got} for items {[item.type for item in final.output]}")
    return final


async def _create(ctx: Ctx, stream: bool, **fields):
    if stream:
        return await _events(ctx, fields)
    return await ctx.client.responses.create(model=ctx.model, **fields)


async def _same_as_chat(ctx: Ctx, rng: random.Random, fields: Dict[str, Any], messages) -> int:
    """The response (streamed or not) against the chat completion of the same conversation: the same
    text (greedy or seeded) and token counts; its output_text logprobs its text's tokens."""
    if rng.random() < 0.3:
        fields = dict(fields, include=["message.output_text.logprobs"], top_logprobs=rng.randint(0, 3))
    response, chat = await asyncio.gather(
        _create(ctx, rng.random() < 0.5, **fields),
        ctx.client.chat.completions.create(model=ctx.model, **_as_chat(fields, messages)))
    _check_response(ctx, response, fields["max_output_tokens"])
    choice = chat.choices[0]
    said = (getattr(choice.message, "reasoning_content", None) or "") + (choice.message.content or "")
    require(_text(response) == said, f"response {_text(response)!r} vs chat {said!r}")
    require((response.usage.input_tokens, response.usage.output_tokens)
            == (chat.usage.prompt_tokens, chat.usage.completion_tokens), f"usage {response.usage} vs {chat.usage}")
    texts = [part for item in response.output if item.type == "message" for part in item.content]
    for part in texts if "include" in fields else ():  # (a piece of a character's token text is U+FFFD)
        tokens = "".join(entry.token for entry in part.logprobs)
        require(len(part.logprobs) <= response.usage.output_tokens and (part.text in tokens or "\ufffd" in tokens),
                f"logprobs {tokens!r} of {part.text!r} ({response.usage.output_tokens} tokens)")
    return response.usage.output_tokens


async def _continued(ctx: Ctx, rng: random.Random) -> int:
    """previous_response_id: the second turn's prompt is the chat's over the first turn's messages (its
    reasoning left out); both responses come back from GET as they were answered, the second's
    input_items its own input only; a response not stored is a 400 previous_response_not_found."""
    first_input, second_input = prompt(rng, True)["messages"][0]["content"], prompt(rng, True)["messages"][0]["content"]
    store = rng.random() < 0.85
    first_fields, fields = _request(rng, rng.randint(1, 16)), _request(rng, rng.randint(1, 16))
    first = await _create(ctx, rng.random() < 0.5, input=first_input, store=store, **first_fields)
    _check_response(ctx, first, first_fields["max_output_tokens"])
    try:
        second = await ctx.client.responses.create(model=ctx.model, input=second_input, previous_response_id=first.id,
                                                   **fields)
    except openai.BadRequestError as exc:
        require(not store and exc.code == "previous_response_not_found", f"{exc.status_code} {exc.body}")
        raise Expected() from None
    require(store, f"continued a response not stored: {second.id}")
    _check_response(ctx, second, fields["max_output_tokens"])
    said = [{"role": "assistant", "content": _item_text(item)} for item in first.output if item.type == "message"]
    messages = [{"role": "user", "content": first_input}] + said + [{"role": "user", "content": second_input}]
    chat = await ctx.client.chat.completions.create(model=ctx.model, **dict(_as_chat(fields, messages),
                                                                            max_completion_tokens=1))
    require(second.usage.input_tokens == chat.usage.prompt_tokens and second.previous_response_id == first.id,
            f"second turn's {second.usage.input_tokens} input tokens vs the chat's {chat.usage.prompt_tokens}")
    stored = await asyncio.gather(*(ctx.client.responses.retrieve(r.id) for r in (first, second)))
    require(stored == [first, second], f"stored {stored} vs answered {[first, second]}")
    items = (await ctx.client.responses.input_items.list(second.id, order="asc")).data
    require(len(items) == 1 and items[0].role == "user" and items[0].content[0].text == second_input, f"items {items}")
    return first.usage.output_tokens + second.usage.output_tokens


async def responses(ctx: Ctx, rng: random.Random) -> int:
    """/v1/responses: a text answer (the chat's), a json_schema format, a named function tool, or a
    conversation continued by previous_response_id; streamed or not."""
    way = rng.choice(["text", "text", "json_schema", "tool", "continued"])
    question = prompt(rng, True)["messages"][0]["content"]
    if way == "continued":
        return await _continued(ctx, rng)
    if way == "text":
        fields = dict(_request(rng, rng.randint(1, 32)), input=question)
        instructions = rng.random() < 0.3 and rng.choice(ctx.systems)
        messages = [{"role": "user", "content": question}]
        if instructions:
            fields["instructions"], messages = instructions, [{"role": "system", "content": instructions}] + messages
        return await _same_as_chat(ctx, rng, fields, messages)
    fields = _request(rng, 160)
    if way == "json_schema":
        fields["text"] = {"format": {"type": "json_schema", "name": "weather", "schema": WEATHER}}
    else:
        name = rng.choice(list(SCHEMAS))
        fields.update(tools=FUNCTIONS, tool_choice={"type": "function", "name": name})
    r = await _create(ctx, rng.random() < 0.5, input=question, **fields)
    _check_response(ctx, r, 160)
    thinking = "chat_template_kwargs" not in fields["extra_body"]  # (the grammar then waits for the thinking's end)
    if way == "json_schema":
        require(not thinking or [item.type for item in r.output] == ["reasoning"], f"thinking first: {r.output}")
        if r.status == "completed" and not thinking:
            check_arguments({"arguments": _text(r)}, WEATHER)
    if way == "tool":
        calls = [item for item in r.output if item.type == "function_call"]
        require(len(calls) == len(r.output) <= 1 and all(c.name == name for c in calls), f"tool {name}: {r.output}")
        if r.status == "completed":
            require(len(calls) == 1 and calls[0].call_id.startswith("call_"), f"completed without its call: {r}")
            check_arguments({"arguments": calls[0].arguments}, SCHEMAS[name])
    return r.usage.output_tokens


def _vectors(out, num_inputs: int, dimensions: Optional[int]) -> np.ndarray:
    """The response's vectors (the client decodes base64 ones), checked: one per input in order, all
    of one length (``dimensions`` if asked), each L2-normalised."""
    require([d.index for d in out.data] == list(range(num_inputs)), f"indices {[d.index for d in out.data]}")
    vectors = np.asarray([d.embedding for d in out.data], dtype=np.float64)
    require(vectors.ndim == 2 and (dimensions is None or vectors.shape[1] == dimensions), f"shape {vectors.shape}")
    require(np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-4), f"norms {np.linalg.norm(vectors, axis=1)}")
    return vectors


def _close(a: np.ndarray, b: np.ndarray, what: str) -> None:
    require(a.shape == b.shape and np.allclose(a, b, atol=1e-4), f"{what}: max diff "
            f"{np.abs(a - b).max() if a.shape == b.shape else (a.shape, b.shape)}")


async def embed(ctx: Ctx, inputs, model: Optional[str] = None, **fields) -> Tuple[np.ndarray, int]:
    """The vectors of ``inputs`` (checked) and usage's prompt tokens."""
    out = await ctx.client.embeddings.create(model=model or ctx.model, input=inputs, **fields)
    require(out.model == (model or ctx.model) and out.usage.total_tokens == out.usage.prompt_tokens, f"{out.usage}")
    return _vectors(out, len(inputs), fields.get("dimensions")), out.usage.prompt_tokens


async def embeddings(ctx: Ctx, rng: random.Random) -> int:
    """/v1/embeddings of a batch of texts or token ids, one of them twice: float or base64 (the client's
    default, decoded by it), perhaps cut to ``dimensions`` (Matryoshka: the full vector's head,
    normalised again); the same input gives the same vector in the batch and alone, in either encoding;
    usage counts the inputs' tokens as the tokenizer gives them."""
    texts = [prompt(rng, False)["prompt"] for _ in range(rng.randint(1, 3))]
    inputs = [ctx.tokenizer.encode(t) for t in texts] if rng.random() < 0.3 else texts
    inputs = inputs + [rng.choice(inputs)]
    dimensions = rng.randint(1, 32) if rng.random() < 0.3 else None
    fmt = {"encoding_format": "float"} if rng.random() < 0.5 else {}
    cut = {"dimensions": dimensions} if dimensions else {}
    (batch, num_tokens), (alone, _) = await asyncio.gather(embed(ctx, inputs, **fmt, **cut),
                                                           embed(ctx, inputs[-1:], **cut))
    want = sum(len(i) if isinstance(i, list) else len(ctx.tokenizer.encode(i)) for i in inputs)
    require(num_tokens == want, f"usage.prompt_tokens {num_tokens} for {want} tokens")
    twice = inputs.index(inputs[-1])
    _close(batch[twice], batch[-1], "the same input twice in a batch")
    _close(batch[-1], alone[0], "an input in a batch and alone")
    if dimensions:
        full = (await embed(ctx, inputs[-1:]))[0][0][:dimensions]
        _close(alone[0], full / np.linalg.norm(full), f"dimensions {dimensions}")
    return 0


async def lora(ctx: Ctx, rng: random.Random) -> int:
    """A LoRA adapter by its model name: the same greedy prompt twice (streamed and not) gives the same
    text, which is not the base model's; an embedding under it is the same twice and not the base's;
    /v1/models lists each adapter under the base model."""
    adapter = rng.choice(ctx.adapters)
    if rng.random() < 0.2:
        served = {m.id: m for m in (await ctx.client.models.list()).data}
        require(set(ctx.adapters) | {ctx.model} == set(served)
                and all(getattr(served[a], "parent", None) == ctx.model for a in ctx.adapters), f"models {served}")
    if rng.random() < 0.3:
        text = prompt(rng, False)["prompt"]
        (a, _), (b, _), (base, _) = await asyncio.gather(embed(ctx, [text], adapter), embed(ctx, [text], adapter),
                                                          embed(ctx, [text]))
        _close(a, b, f"{adapter}'s embedding twice")
        require(not np.allclose(a, base, atol=1e-3), f"{adapter}'s embedding is the base model's")
        return 0
    chat = rng.random() < 0.5
    body = dict(prompt(rng, chat), temperature=0, **max_tokens(chat, 16), extra_body={"ignore_eos": True})
    (first, t1), (second, t2), (base, t3) = await asyncio.gather(
        call(ctx, chat, False, 1, dict(body, model=adapter)), call(ctx, chat, True, 1, dict(body, model=adapter)),
        call(ctx, chat, rng.random() < 0.5, 1, body))
    require(first[0].text == second[0].text, f"{adapter} twice: {first[0].text!r} vs {second[0].text!r}")
    if first[0].text == base[0].text:
        raise Mismatch(f"{adapter} says what the base model says: {base[0].text!r}")
    return t1 + t2 + t3


API_KINDS = {"responses": (responses, 4), "embeddings": (embeddings, 2), "lora": (lora, 3)}  # name: (sender, weight)
