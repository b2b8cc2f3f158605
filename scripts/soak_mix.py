"""The request kinds of scripts/soak.py: each sends one seeded random request through the
openai client and checks what came back. A kind returns an :class:`Outcome`: ``ok`` (a
well-formed answer), ``expected`` (the error class the request asked for: a 400 for a prompt
past the context, a 4xx with an OpenAI-style body for an invalid one) or ``unexpected``
(anything else, with what was wrong)."""

from __future__ import annotations

import asyncio
import json
import random
import re
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import httpx
import openai

from bench_serving import text  # scripts/, beside this file

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer"}}, "required": ["name", "age"]}
REGEX = r"[a-z]{2,6}-[0-9]{1,3}"
CHOICES = ["red", "green", "blue pages", "a.b(c)"]
STOPS = ["e", "th", "\n", " a"]


@dataclass
class Outcome:
    kind: str
    status: str  # ok | expected | unexpected
    latency: float
    completion_tokens: int = 0
    detail: str = ""


class Mismatch(Exception):
    """An answer that came back but is wrong (an unexpected outcome)."""


@dataclass
class Ctx:
    client: openai.AsyncOpenAI
    base_url: str
    model: str
    context_len: int  # prompt + completion, tokens
    max_prompt_len: int
    priority: bool  # the workers schedule by priority
    tokenizer: Any
    systems: List[str]  # the shared prefixes


def sampling(rng: random.Random) -> Dict[str, Any]:
    """Greedy, or seeded sampling at a random temperature."""
    if rng.random() < 0.5:
        return dict(temperature=0)
    return dict(temperature=rng.choice([0.5, 1.0, 1.5]), seed=rng.randrange(1 << 20), top_p=rng.choice([0.9, 1.0]))


def _check(cond: bool, what: str) -> None:
    if not cond:
        raise Mismatch(what)


async def _collect(stream, chat: bool):
    """A stream's choices as ``{index: [text, finish_reason, logprob entries]}`` and its usage."""
    choices: Dict[int, list] = {}
    usage = None
    async for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            entry = choices.setdefault(c.index, ["", None, 0])
            entry[0] += (c.delta.content or "") if chat else c.text
            entry[1] = c.finish_reason or entry[1]
            if c.logprobs is not None:
                entry[2] += len(c.logprobs.content or []) if chat else len(c.logprobs.tokens or [])
    return choices, usage


def _choices_of(out, chat: bool):
    return {c.index: [(c.message.content or "") if chat else c.text, c.finish_reason,
                      (len(c.logprobs.content or []) if chat else len(c.logprobs.tokens or [])) if c.logprobs else 0]
            for c in out.choices}


async def call(ctx: Ctx, chat: bool, stream: bool, n: int, body: Dict[str, Any], stop: Optional[str] = None,
               logprobs: Optional[int] = None):
    """One request; its choices (see :func:`_collect`) after the checks every answer must pass:
    ``n`` choices, each ended by stop or length, no stop string left in a text, logprobs when
    asked, and usage's completion tokens."""
    args = dict(model=ctx.model, n=n, stream=stream, **body)
    if stop is not None:
        args["stop"] = stop
    if logprobs is not None:
        args.update(dict(logprobs=True, top_logprobs=logprobs) if chat else dict(logprobs=logprobs))
    if stream:
        args["stream_options"] = {"include_usage": True}
    api = ctx.client.chat.completions if chat else ctx.client.completions
    out = await api.create(**_as_sent(chat, args))
    choices, usage = await _collect(out, chat) if stream else (_choices_of(out, chat), out.usage)
    _check(sorted(choices) == list(range(n)), f"choice indices {sorted(choices)} for n={n}")
    _check(usage is not None and usage.completion_tokens > 0, f"usage {usage}")
    for text_, reason, num_logprobs in choices.values():
        _check(reason in ("stop", "length"), f"finish_reason {reason!r}")
        _check(stop is None or stop not in text_, f"stop {stop!r} in {text_!r}")
        _check(logprobs is None or num_logprobs > 0, "no logprobs")
    return choices, usage.completion_tokens


def _prompt(rng: random.Random, chat: bool, system: Optional[str] = None):
    question = text(rng, rng.randint(8, 200))
    if not chat:
        return {"prompt": (system or "") + question}
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]
    return {"messages": messages}


def _as_sent(chat: bool, body: Dict[str, Any]) -> Dict[str, Any]:
    """``body`` as the openai client takes it: its completions know no ``response_format`` (vLLM's and
    this server's extra), so it goes in ``extra_body`` there."""
    if chat or "response_format" not in body:
        return body
    body = dict(body)
    body["extra_body"] = dict(body.get("extra_body", {}), response_format=body.pop("response_format"))
    return body


def _max_tokens(chat: bool, n: int) -> Dict[str, int]:
    return {"max_completion_tokens" if chat else "max_tokens": n}


async def plain(ctx: Ctx, rng: random.Random) -> int:
    chat = rng.random() < 0.5
    body = dict(_prompt(rng, chat), **sampling(rng), **_max_tokens(chat, rng.randint(1, 48)))
    stop = rng.choice(STOPS) if rng.random() < 0.4 else None
    logprobs = rng.randint(0, 4) if rng.random() < 0.4 else None
    _, tokens = await call(ctx, chat, rng.random() < 0.5, rng.randint(1, 3), body, stop, logprobs)
    return tokens


async def prefix(ctx: Ctx, rng: random.Random) -> int:
    """A shared system prompt (the radix caches' and the router's prefix routing's work)."""
    chat = rng.random() < 0.7
    body = dict(_prompt(rng, chat, rng.choice(ctx.systems)), **sampling(rng), **_max_tokens(chat, 16))
    _, tokens = await call(ctx, chat, rng.random() < 0.5, 1, body)
    return tokens


async def seeded(ctx: Ctx, rng: random.Random) -> int:
    """The same seeded request twice, streamed and not: the same text (the seed makes it reproducible)."""
    chat = rng.random() < 0.5
    body = dict(_prompt(rng, chat), temperature=1.0, seed=rng.randrange(1 << 20), **_max_tokens(chat, 24))
    (first, t1), (second, t2) = await asyncio.gather(call(ctx, chat, False, 1, body), call(ctx, chat, True, 1, body))
    _check(first[0][0] == second[0][0], f"seeded texts differ: {first[0][0]!r} vs {second[0][0]!r}")
    return t1 + t2


def _structured(rng: random.Random):
    """(kind, request fields, check of a finished text)."""
    kind = rng.choice(["json_schema", "json_object", "guided_regex", "guided_choice"])
    if kind == "json_schema":
        fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}

        def check(t):  # (strict=False: xgrammar 0.2.8 lets a length-bounded string take raw control
            v = json.loads(t, strict=False)  # characters, which JSON forbids: mlc-ai/xgrammar#800)
            _check(isinstance(v.get("name"), str) and isinstance(v.get("age"), int), f"not the schema: {t!r}")
        return kind, {"response_format": fmt}, check
    if kind == "json_object":
        return kind, {"response_format": {"type": "json_object"}}, json.loads
    if kind == "guided_regex":
        return kind, {"extra_body": {"guided_regex": REGEX}}, lambda t: _check(
            re.fullmatch(REGEX, t) is not None, f"{t!r} does not match {REGEX}")
    return kind, {"extra_body": {"guided_choice": CHOICES}}, lambda t: _check(t in CHOICES, f"{t!r} not a choice")


async def structured(ctx: Ctx, rng: random.Random) -> int:
    chat = rng.random() < 0.5
    _, fields, check = _structured(rng)
    body = dict(_prompt(rng, chat), **sampling(rng), **_max_tokens(chat, 64), **fields)
    choices, tokens = await call(ctx, chat, rng.random() < 0.5, rng.randint(1, 2), body)
    for text_, reason, _ in choices.values():
        if reason == "stop":  # (a length-cut one is a prefix of a match)
            try:
                check(text_)
            except ValueError as exc:
                raise Mismatch(f"{exc}: {text_!r}") from None
    return tokens


async def priority(ctx: Ctx, rng: random.Random) -> int:
    """Answered when the workers schedule by priority, else a 400 naming it."""
    chat = rng.random() < 0.5
    body = dict(_prompt(rng, chat), **sampling(rng), **_max_tokens(chat, rng.randint(4, 32)),
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


class Expected(Exception):
    """The error the request asked for came back."""


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
        _check(exc.code == "context_length_exceeded" and exc.param == "prompt", f"400 body {exc.body}")
        raise Expected() from None
    raise Mismatch(f"a prompt of {prompt_len} + {max_tokens} tokens was answered")


async def disconnect(ctx: Ctx, rng: random.Random) -> int:
    """A stream whose client goes away (its task cancelled) after a few chunks or none."""
    chat = rng.random() < 0.5
    api = ctx.client.chat.completions if chat else ctx.client.completions
    body = dict(_prompt(rng, chat), **sampling(rng), **_max_tokens(chat, 64), n=rng.randint(1, 3),
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
]


async def invalid(ctx: Ctx, rng: random.Random) -> int:
    """A bad field: its 4xx with an OpenAI-style body naming it; or malformed JSON."""
    if rng.random() < 0.15:
        async with httpx.AsyncClient(base_url=ctx.base_url, timeout=60) as raw:
            answer = await raw.post("/v1/completions", content=b'{"prompt": "x",', headers={
                "Content-Type": "application/json", "Authorization": f"Bearer {ctx.client.api_key}"})
        error = answer.json().get("error", {})
        _check(answer.status_code == 400 and error.get("code") == "invalid_json", f"{answer.status_code} {error}")
        raise Expected()
    fields, status, param = rng.choice(INVALID)
    chat = rng.random() < 0.5
    body = dict(dict(_prompt(rng, chat), model=ctx.model, **_max_tokens(chat, 4)), **fields)
    try:
        await (ctx.client.chat.completions if chat else ctx.client.completions).create(**_as_sent(chat, body))
    except openai.APIStatusError as exc:
        _check(exc.status_code == status and exc.param == param and isinstance(exc.body, dict)
               and exc.body.get("message") and exc.body.get("type"), f"{exc.status_code} {exc.body} for {fields}")
        raise Expected() from None
    raise Mismatch(f"{fields} was answered")


KINDS = {"plain": (plain, 6), "prefix": (prefix, 4), "seeded": (seeded, 2), "structured": (structured, 4),
         "priority": (priority, 2), "long": (long, 1), "too_long": (too_long, 1), "disconnect": (disconnect, 2),
         "invalid": (invalid, 2)}  # name: (sender, weight)


async def one(ctx: Ctx, rng: random.Random, kind: str) -> Outcome:
    start = time.perf_counter()
    try:
        tokens = await KINDS[kind][0](ctx, rng)
        return Outcome(kind, "ok", time.perf_counter() - start, tokens)
    except Expected:
        return Outcome(kind, "expected", time.perf_counter() - start)
    except Exception as exc:  # a wrong answer, an error status nobody asked for, a broken stream
        return Outcome(kind, "unexpected", time.perf_counter() - start, detail=f"{type(exc).__name__}: {exc}")
