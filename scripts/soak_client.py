"""What every request of scripts/soak.py goes through: one call with the openai client, its
streamed or whole answer read into the same :class:`Choice` records, and the checks every answer
must pass. The request kinds (scripts/soak_mix.py, scripts/soak_mix_extras.py) add their own.

A kind returns an :class:`Outcome`: ``ok`` (a well-formed answer), ``expected`` (the error class
the request asked for: a 400 for a prompt past the context, a 4xx with an OpenAI-style body for an
invalid one) or ``unexpected`` (anything else, with what was wrong)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import httpx
import openai

from bench_serving import text  # scripts/, beside this file

THINK_START, THINK_END = "<think>", "</think>"  # the reasoning parsers' tags (qwen3's and deepseek_r1's)


@dataclass
class Outcome:
    kind: str
    status: str  # ok | expected | unexpected
    latency: float
    completion_tokens: int = 0
    detail: str = ""


class Mismatch(Exception):
    """An answer that came back but is wrong (an unexpected outcome)."""


class Expected(Exception):
    """The error the request asked for came back."""


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
    reasoning_parser: Optional[str]  # the server's: where a chat answer's thinking goes
    adapters: List[str]  # the LoRA adapters' names (model names beside the base model's)
    tool_call_parser: Optional[str] = None  # the server's
    weights: Any = None  # soak_weights.WeightUpdates of a run that updates the weights, else None


@dataclass
class Choice:
    """One choice as a whole response holds it, or its stream's deltas added up."""

    content: str = ""
    reasoning: str = ""  # reasoning_content
    finish_reason: Optional[str] = None
    num_logprobs: int = 0
    calls: List[Dict[str, str]] = field(default_factory=list)  # {"id", "name", "arguments"}

    @property
    def text(self) -> str:
        """The output's text, less the tags the reasoning parser took out."""
        return self.reasoning + self.content


def require(cond: bool, what: str) -> None:
    if not cond:
        raise Mismatch(what)


def sampling(rng: random.Random) -> Dict[str, Any]:
    """Greedy, or seeded sampling at a random temperature."""
    if rng.random() < 0.5:
        return dict(temperature=0)
    return dict(temperature=rng.choice([0.5, 1.0, 1.5]), seed=rng.randrange(1 << 20), top_p=rng.choice([0.9, 1.0]))


def prompt(rng: random.Random, chat: bool, system: Optional[str] = None):
    question = text(rng, rng.randint(8, 200))
    if not chat:
        return {"prompt": (system or "") + question}
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]
    return {"messages": messages}


def max_tokens(chat: bool, n: int) -> Dict[str, int]:
    return {"max_completion_tokens" if chat else "max_tokens": n}


def with_extra(body: Dict[str, Any], **fields) -> Dict[str, Any]:
    """``body`` with ``fields`` added to its ``extra_body``."""
    return dict(body, extra_body=dict(body.get("extra_body", {}), **fields))


def as_sent(chat: bool, body: Dict[str, Any]) -> Dict[str, Any]:
    """``body`` as the openai client takes it: its completions know no ``response_format`` (vLLM's and
    this server's extra), so it goes in ``extra_body`` there."""
    if chat or "response_format" not in body:
        return body
    body = dict(body)
    body["extra_body"] = dict(body.get("extra_body", {}), response_format=body.pop("response_format"))
    return body


def _extra(obj, name: str):
    return (obj.model_extra or {}).get(name)


def _add_call_delta(choice: Choice, delta) -> None:
    """A streamed tool call's piece: its first names it (id and function), the rest add arguments."""
    if delta.index == len(choice.calls):
        require(bool(delta.id and delta.function.name), f"a call's first delta without id or name: {delta}")
        choice.calls.append({"id": delta.id, "name": delta.function.name, "arguments": ""})
    require(delta.index < len(choice.calls), f"tool call delta {delta.index} after {len(choice.calls)} calls")
    choice.calls[delta.index]["arguments"] += delta.function.arguments or ""


async def _collect(stream, chat: bool) -> Tuple[Dict[int, Choice], Any]:
    choices: Dict[int, Choice] = {}
    usage = None
    async for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            choice = choices.setdefault(c.index, Choice())
            choice.finish_reason = c.finish_reason or choice.finish_reason
            if chat:
                choice.content += c.delta.content or ""
                choice.reasoning += _extra(c.delta, "reasoning_content") or ""
                for delta in c.delta.tool_calls or ():
                    _add_call_delta(choice, delta)
            else:
                choice.content += c.text
            if c.logprobs is not None:
                choice.num_logprobs += len(c.logprobs.content or []) if chat else len(c.logprobs.tokens or [])
    return choices, usage


def _choices_of(out, chat: bool) -> Dict[int, Choice]:
    if not chat:
        return {c.index: Choice(c.text, "", c.finish_reason, len(c.logprobs.tokens or []) if c.logprobs else 0)
                for c in out.choices}
    return {c.index: Choice(c.message.content or "", _extra(c.message, "reasoning_content") or "", c.finish_reason,
                            len(c.logprobs.content or []) if c.logprobs else 0,
                            [{"id": t.id, "name": t.function.name, "arguments": t.function.arguments}
                             for t in c.message.tool_calls or ()]) for c in out.choices}


def thinks_first(ctx: Ctx, chat: bool, body: Dict[str, Any]) -> Optional[bool]:
    """Whether the server's reasoning parser opens this request's output in the thinking (the
    built-in template writes no tag in the prompt: the family's default decides); None where
    nothing is split (a completion, no parser, ``separate_reasoning`` off)."""
    extra = body.get("extra_body", {})
    if not chat or ctx.reasoning_parser is None or extra.get("separate_reasoning") is False:
        return None
    switch = extra.get("chat_template_kwargs", {}).get("enable_thinking")  # (qwen3's; deepseek_r1 always thinks)
    return ctx.reasoning_parser == "deepseek_r1" or switch is not False


async def call(ctx: Ctx, chat: bool, stream: bool, n: int, body: Dict[str, Any], stop: Optional[str] = None,
               logprobs: Optional[int] = None, finish: Sequence[str] = ("stop", "length"),
               tagged: bool = False) -> Tuple[Dict[int, Choice], int]:
    """One request; its choices after the checks every answer must pass: ``n`` choices, each
    ended by a reason in ``finish``, no stop string left in a text, logprobs when asked, usage's
    completion tokens, and, unless the output may hold the reasoning tags (``tagged``: the kind
    checks the split), the whole text in reasoning_content where the output opens in the thinking
    (a random model never closes it), else in content."""
    args = dict(dict(model=ctx.model, n=n, stream=stream), **body)  # (a body's model: an adapter's name)
    if stop is not None:
        args["stop"] = stop
    if logprobs is not None:
        args.update(dict(logprobs=True, top_logprobs=logprobs) if chat else dict(logprobs=logprobs))
    if stream:
        args["stream_options"] = {"include_usage": True}
    api = ctx.client.chat.completions if chat else ctx.client.completions
    out = await api.create(**as_sent(chat, args))
    choices, usage = await _collect(out, chat) if stream else (_choices_of(out, chat), out.usage)
    require(sorted(choices) == list(range(n)), f"choice indices {sorted(choices)} for n={n}")
    require(usage is not None and usage.completion_tokens > 0, f"usage {usage}")
    thinking = thinks_first(ctx, chat, body)
    for c in choices.values():
        require(c.finish_reason in finish, f"finish_reason {c.finish_reason!r}")
        require(stop is None or stop not in c.text, f"stop {stop!r} in {c.text!r}")
        require(logprobs is None or c.num_logprobs > 0, "no logprobs")
        require(tagged or not (c.content if thinking else c.reasoning),
                f"thinking first {thinking}, yet content {c.content!r} and reasoning {c.reasoning!r}")
    return choices, usage.completion_tokens


async def post(ctx: Ctx, route: str, body: Union[Dict[str, Any], bytes]) -> httpx.Response:
    """A request the openai client has no method for (vLLM's /tokenize, /detokenize; malformed JSON)."""
    headers = {"Authorization": f"Bearer {ctx.client.api_key}"}
    async with httpx.AsyncClient(base_url=ctx.base_url, timeout=60, headers=headers) as raw:
        if isinstance(body, bytes):
            return await raw.post(route, content=body, headers={"Content-Type": "application/json"})
        return await raw.post(route, json=body)
