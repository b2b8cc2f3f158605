"""The request kinds of scripts/soak.py that sample text: each sends one seeded random request
through the openai client (scripts/soak_client.py's :func:`call` and its checks) and checks what
came back; the kinds of tool calls, reasoning, prompt logprobs and the tokenizer's routes are in
scripts/soak_mix_extras.py, those of the Responses API, embeddings and LoRA adapters in
scripts/soak_mix_apis.py, those of vLLM's scoring routes and sampling constraints in
scripts/soak_mix_vllm.py, SGLang's /generate (its weight version) in scripts/soak_weights.py.
:data:`KINDS` names them all."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import re
import time
from typing import List

import openai

from bench_serving import text  # scripts/, beside this file
from soak_client import (Ctx, Expected, Mismatch, Outcome, as_sent, call, max_tokens, post, prompt, require, sampling,
                         thinks_first, with_extra)
from soak_mix_apis import API_KINDS
from soak_mix_extras import EXTRA_KINDS
from soak_mix_vllm import VLLM_KINDS
from soak_weights import WEIGHT_KINDS

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer"}}, "required": ["name", "age"]}
REGEX = r"[a-z]{2,6}-[0-9]{1,3}"
CHOICES = ["red", "green", "blue pages", "a.b(c)"]
STOPS = ["e", "th", "\n", " a"]


async def plain(ctx: Ctx, rng: random.Random) -> int:
    chat = rng.random() < 0.5
    body = dict(prompt(rng, chat), **sampling(rng), **max_tokens(chat, rng.randint(1, 48)))
    stop = rng.choice(STOPS) if rng.random() < 0.4 else None
    logprobs = rng.randint(0, 4) if rng.random() < 0.4 else None
    _, tokens = await call(ctx, chat, rng.random() < 0.5, rng.randint(1, 3), body, stop, logprobs)
    return tokens


async def prefix(ctx: Ctx, rng: random.Random) -> int:
    """A shared system prompt (the radix caches' and the router's prefix routing's work)."""
    chat = rng.random() < 0.7
    body = dict(prompt(rng, chat, rng.choice(ctx.systems)), **sampling(rng), **max_tokens(chat, 16))
    _, tokens = await call(ctx, chat, rng.random() < 0.5, 1, body)
    return tokens


async def seeded(ctx: Ctx, rng: random.Random) -> int:
    """The same seeded request twice, streamed and not: the same text (the seed makes it reproducible)."""
    chat = rng.random() < 0.5
    body = dict(prompt(rng, chat), temperature=1.0, seed=rng.randrange(1 << 20), **max_tokens(chat, 24))
    (first, t1), (second, t2) = await asyncio.gather(call(ctx, chat, False, 1, body), call(ctx, chat, True, 1, body))
    require(first[0] == second[0], f"seeded answers differ: {first[0]} vs {second[0]}")
    return t1 + t2


def _structured(rng: random.Random):
    """(kind, request fields, check of a finished text)."""
    kind = rng.choice(["json_schema", "json_object", "guided_regex", "guided_choice"])
    if kind == "json_schema":
        fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}

        def check(t):  # (strict=False: xgrammar 0.2.8 lets a length-bounded string take raw control
            v = json.loads(t, strict=False)  # characters, which JSON forbids: mlc-ai/xgrammar#800)
            require(isinstance(v.get("name"), str) and isinstance(v.get("age"), int), f"not the schema: {t!r}")
        return kind, {"response_format": fmt}, check
    if kind == "json_object":
        return kind, {"response_format": {"type": "json_object"}}, json.loads
    if kind == "guided_regex":
        return kind, {"extra_body": {"guided_regex": REGEX}}, lambda t: require(
            re.fullmatch(REGEX, t) is not None, f"{t!r} does not match {REGEX}")
    return kind, {"extra_body": {"guided_choice": CHOICES}}, lambda t: require(t in CHOICES, f"{t!r} not a choice")


async def structured(ctx: Ctx, rng: random.Random) -> int:
    """A grammar's output, checked where it holds the whole output: a completion's, or a chat's with
    the thinking off (where the output opens in the thinking, the server holds the grammar back
    until the thinking's end, which the random model never writes)."""
    chat = rng.random() < 0.5
    _, fields, check = _structured(rng)
    body = dict(prompt(rng, chat), **sampling(rng), **max_tokens(chat, 64), **fields)
    if chat and rng.random() < 0.5:
        body = with_extra(body, chat_template_kwargs={"enable_thinking": False})
    choices, tokens = await call(ctx, chat, rng.random() < 0.5, rng.randint(1, 2), body)
    for c in choices.values():
        if c.finish_reason == "stop" and not thinks_first(ctx, chat, body):  # (a length-cut one: a match's prefix)
            try:
                check(c.text)
            except ValueError as exc:
                raise Mismatch(f"{exc}: {c.text!r}") from None
    return tokens


async def priority(ctx: Ctx, rng: random.Random) -> int:
    """Answered when the workers schedule by priority, else a 400 naming it."""
    chat = rng.random() < 0.5
    body = dict(prompt(rng, chat), **sampling(rng), **max_tokens(chat, rng.randint(4, 32)),
                extra_body={"priority": rng.choice([-20, -5, 1, 5, 20])})
    try:
        _, tokens = await call(ctx, chat, rng.random() < 0.5, 1, body)
    except openai.BadRequestError as exc:
        if ctx.priority or exc.param != "priority":
            raise
        raise Expected() from None
    return tokens


def _long_prompt(ctx: Ctx, rng: random.Random, num_tokens: int) -> List[int]:
    """A completions prompt of exactly ``num_tokens`` token ids (a text's, repeated)."""
    ids = ctx.tokenizer.encode(text(rng, 400), add_special_tokens=False)
    return (ids * (num_tokens // len(ids) + 1))[:num_tokens]


async def long(ctx: Ctx, rng: random.Random) -> int:
    """Just under the context: answered."""
    prompt_len = ctx.max_prompt_len - rng.randint(0, 64)
    room = ctx.context_len - prompt_len
    body = {"prompt": _long_prompt(ctx, rng, prompt_len), "max_tokens": rng.randint(1, min(16, room)), "temperature": 0}
    _, tokens = await call(ctx, False, rng.random() < 0.5, 1, body)
    return tokens


async def too_long(ctx: Ctx, rng: random.Random) -> int:
    """Past the context (the prompt alone, or with max_tokens): a 400 context_length_exceeded."""
    if rng.random() < 0.5:
        prompt_len, max_tokens = ctx.max_prompt_len + rng.randint(1, 64), 4
    else:
        prompt_len = ctx.max_prompt_len - rng.randint(0, 64)
        max_tokens = ctx.context_len - prompt_len + rng.randint(1, 64)
    try:
        await ctx.client.completions.create(model=ctx.model, prompt=_long_prompt(ctx, rng, prompt_len),
                                            max_tokens=max_tokens, stream=rng.random() < 0.5)
    except openai.BadRequestError as exc:
        require(exc.code == "context_length_exceeded" and exc.param == "prompt", f"400 body {exc.body}")
        raise Expected() from None
    raise Mismatch(f"a prompt of {prompt_len} + {max_tokens} tokens was answered")


async def disconnect(ctx: Ctx, rng: random.Random) -> int:
    """A stream whose client goes away (its task cancelled) after a few chunks or none."""
    chat = rng.random() < 0.5
    api = ctx.client.chat.completions if chat else ctx.client.completions
    body = dict(prompt(rng, chat), **sampling(rng), **max_tokens(chat, 64), n=rng.randint(1, 3),
                stream=True, extra_body={"ignore_eos": True})
    wanted, seen = rng.randint(0, 4), asyncio.Event()

    async def read():
        count = 0
        async for _ in await api.create(model=ctx.model, **body):
            count += 1
            if count >= wanted:
                seen.set()
        seen.set()

    task = asyncio.ensure_future(read())
    waiter = asyncio.ensure_future(seen.wait())
    await asyncio.wait((task, waiter), timeout=None if wanted else rng.uniform(0.0, 0.3),
                       return_when=asyncio.FIRST_COMPLETED)
    waiter.cancel()
    task.cancel()
    result = await asyncio.gather(task, return_exceptions=True)
    if isinstance(result[0], Exception):
        raise result[0]
    return 0


INVALID = [  # (request fields, status, param)
    ({"temperature": 3.0}, 400, "temperature"),
    ({"model": "no-such-model"}, 404, "model"),
    ({"extra_body": {"max_tokenz": 4}}, 400, "max_tokenz"),
    ({"n": 0}, 400, "n"),
    ({"stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     400, "response_format"),
    ({"extra_body": {"guided_regex": "(unclosed"}}, 400, "guided_regex"),
    ({"logit_bias": {"999999": 1}}, 400, "logit_bias"),
    ({"extra_body": {"guided_choice": ["a"], "guided_regex": "b"}}, 400, "guided_choice"),
    ({"extra_body": {"allowed_token_ids": [5, 999999]}}, 400, "allowed_token_ids"),
    ({"extra_body": {"bad_words": [" "]}}, 400, "bad_words"),
    ({"response_format": {"type": "structural_tag", "structures": [{"begin": "<a>", "schema": {}, "end": "</a>"}],
                          "triggers": ["<b"]}}, 400, "response_format"),
]


async def invalid(ctx: Ctx, rng: random.Random) -> int:
    """A bad field: its 4xx with an OpenAI-style body naming it; or malformed JSON."""
    if rng.random() < 0.15:
        answer = await post(ctx, "/v1/completions", b'{"prompt": "x",')
        error = answer.json().get("error", {})
        require(answer.status_code == 400 and error.get("code") == "invalid_json", f"{answer.status_code} {error}")
        raise Expected()
    fields, status, param = rng.choice(INVALID)
    chat = rng.random() < 0.5
    body = dict(dict(prompt(rng, chat), model=ctx.model, **max_tokens(chat, 4)), **fields)
    try:
        await (ctx.client.chat.completions if chat else ctx.client.completions).create(**as_sent(chat, body))
    except openai.APIStatusError as exc:
        require(exc.status_code == status and exc.param == param and isinstance(exc.body, dict)
                and exc.body.get("message") and exc.body.get("type"), f"{exc.status_code} {exc.body} for {fields}")
        raise Expected() from None
    raise Mismatch(f"{fields} was answered")


KINDS = {"plain": (plain, 6), "prefix": (prefix, 4), "seeded": (seeded, 2), "structured": (structured, 4),
         "priority": (priority, 2), "long": (long, 1), "too_long": (too_long, 1), "disconnect": (disconnect, 2),
         "invalid": (invalid, 2), **EXTRA_KINDS, **API_KINDS, **VLLM_KINDS, **WEIGHT_KINDS}  # name: (sender, weight)
COMPARING = {"seeded", "tools", "responses", "embeddings", "lora", "score"}  # answers held to other requests' answers


async def one(ctx: Ctx, rng: random.Random, kind: str) -> Outcome:
    """Request ``kind``'s outcome; a kind that holds answers to each other's (:data:`COMPARING`) runs
    between weight updates (its latency counts a wait for one to end)."""
    start = time.perf_counter()
    steady = ctx.weights.steady() if ctx.weights is not None and kind in COMPARING else contextlib.nullcontext()
    try:
        async with steady:
            tokens = await KINDS[kind][0](ctx, rng)
        return Outcome(kind, "ok", time.perf_counter() - start, tokens)
    except Expected:
        return Outcome(kind, "expected", time.perf_counter() - start)
    except Exception as exc:  # a wrong answer, an error status nobody asked for, a broken stream
        return Outcome(kind, "unexpected", time.perf_counter() - start, detail=f"{type(exc).__name__}: {exc}")
