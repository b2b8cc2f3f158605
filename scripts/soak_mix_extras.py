"""The request kinds of scripts/soak.py beyond sampled text: tool calls, reasoning, vLLM's
prompt_logprobs, /tokenize and /detokenize. What the model writes is forced where the check needs
it (guided_regex, guided_choice, a tool's schema); the server's parsers must then give back
exactly that, split as its settings say (soak.py switches on ``server.tool_call_parser: hermes``
and ``server.reasoning_parser: qwen3``; the tool kind forces hermes blocks, and with another parser,
``--set server.tool_call_parser=...``, reads the random model's own text through it). A grammar forces a
thinking only where the output opens in the answer (the thinking off, a leading ``<think>`` in the
forced text): where it opens in the thinking, the server holds the grammar back until the
thinking's end (SGLang's reasoner grammar), and the random model's thinking is free."""

from __future__ import annotations

import asyncio
import json
import random
import re
from typing import Any, Dict, List, Optional

import jsonschema

from soak_client import (THINK_END, THINK_START, Choice, Ctx, Expected, Mismatch, call, max_tokens, post, prompt,
                         require, sampling, thinks_first, with_extra)

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}, "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}},
       "required": ["a"], "additionalProperties": False}
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
TOOLS = [{"type": "function", "function": {"name": name, "parameters": schema}} for name, schema in SCHEMAS.items()]
HERMES = (r'Sure\.\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", '
          r'"unit": "c"\}\}\n</tool_call>')  # the one call tool_choice "auto" must read
THOUGHT = r"[a-z]{1,8}( [a-z]{1,8}){0,2}"
REASONED = ["<think>a thought</think>yes", "thought only</think>\n\nno", "<think></think>empty thought",
            "never closed", "<think>opened, never closed", "</think>closed at once"]  # guided_choice's texts
REASONED_REGEX = rf"(<think>)?{THOUGHT}</think>\n?(yes|no|maybe)"
CALLS = {  # one call in each tool-call parser's format
    "hermes": '<tool_call>\n{"name": "add", "arguments": {"a": 3}}\n</tool_call>',
    "mistral": '[TOOL_CALLS][{"name": "add", "arguments": {"a": 3}}]',
    "mistral_v11": '[TOOL_CALLS]add[ARGS]{"a": 3}',
    "pythonic": "[add(a=3)]",
    "llama4_pythonic": "<|python_start|>[add(a=3)]<|python_end|>",
    "qwen3_coder": "<tool_call>\n<function=add>\n<parameter=a>\n3\n</parameter>\n</function>\n</tool_call>",
    "deepseek_v3": '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>add\n```json\n{"a": 3}\n```'
                   "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
    "deepseek_v31": '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>add<｜tool▁sep｜>{"a": 3}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
    "gpt_oss": '<|channel|>commentary to=functions.add<|message|>{"a": 3}<|call|>',
}
TAG_SOUP = [*CALLS.values(),  # the calls, tags and pieces of calls
    "<tool_call>", "</tool_call>", "<function=add>", "<parameter=a>", "</parameter>", "</function>", "[TOOL_CALLS]",
    "[ARGS]", "[CALL_ID]", "[", "]", "get_weather", '{"a": 3}', "(", ")", ", ", "<｜tool▁call▁begin｜>",
    "<｜tool▁sep｜>", "\n```", "<｜tool▁calls▁end｜>", "<|start|>", "assistant", "<|channel|>", "analysis", "final",
    "<|message|>", "<|end|>", "<|call|>", "<|return|>", "<|python_start|>", "<|python_end|>", "\n", " ", "7", "x"]


def check_arguments(call_: Dict[str, str], schema: Dict[str, Any]) -> None:
    """A call's arguments follow ``schema``. As xgrammar 0.2.8 writes them: raw control characters in
    strings (mlc-ai/xgrammar#800: ``strict=False``), and a UTF-16 surrogate's three bytes (ED A0..BF xx,
    not UTF-8) taken as one character of a ``maxLength``, which the text decodes as three U+FFFD."""
    arguments = call_["arguments"].replace("\ufffd" * 3, "\ufffd")
    try:
        jsonschema.validate(json.loads(arguments, strict=False), schema)
    except (ValueError, jsonschema.ValidationError) as exc:
        raise Mismatch(f"arguments of {call_}: {exc}") from None


async def tools(ctx: Ctx, rng: random.Random) -> int:
    """One of tool_choice's ways: a named function (one call, its arguments its schema's), "required"
    without parallel calls (one call of either tool), "auto" over a guided_regex-forced hermes block
    (the server's parser reads the call; after a forced, closed thinking or none: the thinking off,
    so that the grammar holds the whole output; with another parser, "free" instead), "none" over the
    same block (content as written, no call), "free" (:func:`_free`)."""
    way = rng.choice(["named", "required", "auto", "none", "free"])
    stream, n = rng.random() < 0.5, rng.randint(1, 2)
    if way == "free" or way == "auto" and ctx.tool_call_parser != "hermes":
        return await _free(ctx, rng, n)
    logprobs = rng.randint(0, 2) if rng.random() < 0.3 else None
    body = dict(prompt(rng, True), tools=TOOLS, **sampling(rng), **max_tokens(True, 160))
    if way in ("named", "required"):
        name = rng.choice(list(SCHEMAS))
        body.update(tool_choice={"type": "function", "function": {"name": name}} if way == "named" else "required",
                    **({} if way == "named" else {"parallel_tool_calls": False}))
        finish = ("stop", "length") if way == "named" else ("tool_calls", "length")
        choices, tokens = await call(ctx, True, stream, n, body, logprobs=logprobs, finish=finish, tagged=True)
        for c in choices.values():  # (no thinking split: the whole output is the calls' JSON)
            require(not c.text and len(c.calls) <= 1 and all(t["id"].startswith("call_") for t in c.calls),
                    f"{way}: {c}")
            if way == "named":
                require([t["name"] for t in c.calls] == [name], f"named {name}: {c}")
            if c.finish_reason != "length":
                require(len(c.calls) == 1, f"{way} finished without its call: {c}")
                check_arguments(c.calls[0], SCHEMAS[c.calls[0]["name"]])
        return tokens
    thought = rng.choice(["", THINK_START + THOUGHT + THINK_END + r"\n"])
    if way == "auto" and rng.random() < 0.5:
        body["tool_choice"] = "auto"  # (else no tool_choice: auto, the server having a parser)
    body = with_extra(body, guided_regex=thought + HERMES, chat_template_kwargs={"enable_thinking": False})
    if way == "none":
        body["tool_choice"] = "none"
    choices, tokens = await call(ctx, True, stream, n, body, logprobs=logprobs, finish=("stop", "tool_calls"),
                                 tagged=True)
    for c in choices.values():
        require(bool(re.fullmatch(THOUGHT, c.reasoning)) if thought else not c.reasoning, f"reasoning of {c}")
        if way == "none":
            require(re.fullmatch((r"\n" if thought else "") + HERMES, c.content) is not None and not c.calls
                    and c.finish_reason == "stop", f"tool_choice none: {c}")
            continue
        require(c.content.strip() == "Sure." and c.finish_reason == "tool_calls" and len(c.calls) == 1
                and c.calls[0]["name"] == "get_weather", f"auto: {c}")
        require(json.loads(c.calls[0]["arguments"]) in ({"city": "Paris", "unit": "c"}, {"city": "Rome", "unit": "c"}),
                f"auto's arguments {c.calls[0]}")
    return tokens


async def _free(ctx: Ctx, rng: random.Random, n: int) -> int:
    """The random model's own text, or a call in some parser's format (the server's half the time), at
    the start or after a piece, then a random run of calls, tags and pieces of calls (:data:`TAG_SOUP`:
    whole, cut short, malformed), through the server's tool-call parser (any of them), greedy, the
    thinking off: the streamed deltas add up to the whole answer, its content, reasoning and calls."""
    soup, pieces = {}, "(" + "|".join(re.escape(t) for t in TAG_SOUP) + ")"
    if rng.random() < 0.6:
        first = CALLS.get(ctx.tool_call_parser) if rng.random() < 0.5 else None
        soup["guided_regex"] = (rng.choice(["", pieces]) + re.escape(first or rng.choice(list(CALLS.values())))
                                + pieces + "*")
    body = with_extra(dict(prompt(rng, True), tools=TOOLS, temperature=0, **max_tokens(True, rng.randint(32, 200))),
                      chat_template_kwargs={"enable_thinking": False}, **soup)
    (whole, tokens), (streamed, _) = await asyncio.gather(*(
        call(ctx, True, stream, n, body, finish=("stop", "length", "tool_calls"), tagged=True)
        for stream in (False, True)))
    for a, b in zip(whole.values(), streamed.values()):
        calls_a, calls_b = ([(t["name"], t["arguments"]) for t in c.calls] for c in (a, b))
        if (a.content, a.reasoning, a.finish_reason, calls_a) != (b.content, b.reasoning, b.finish_reason, calls_b):
            require(_broken_call_is_content(a, b, calls_a, calls_b), f"whole {a} vs streamed {b}")
    return tokens


def _broken_call_is_content(whole, streamed, calls_whole, calls_streamed) -> bool:
    """The one way a whole answer may differ from its stream, as vLLM's parsers differ: a call cut short or
    broken after its name went out in the stream (its deltas cannot be taken back), while the whole answer
    keeps only the calls before it (hermes, Mistral: none) and gives the rest of the text as content."""
    finishes = {whole.finish_reason, streamed.finish_reason}
    return (len(calls_whole) < len(calls_streamed) and calls_streamed[:len(calls_whole)] == calls_whole
            and whole.reasoning == streamed.reasoning and whole.content.startswith(streamed.content)
            and (len(finishes) == 1 or finishes == {"stop", "tool_calls"}))


def _split(text: str, thinking: Optional[bool]):
    """``(reasoning, content)`` as the server's reasoning parser must split ``text``: a leading start
    tag opens the thinking, the first end tag after it closes it. ``thinking`` None: no parser."""
    if thinking is None:
        return "", text
    if text.startswith(THINK_START):
        text, thinking = text[len(THINK_START):], True
    if not thinking:
        return "", text
    reasoning, _, content = text.partition(THINK_END)
    return reasoning, content


def _unsplit(c: Choice) -> List[str]:
    """The texts a choice's reasoning and content may have been split from (the tags dropped)."""
    r, a = c.reasoning, c.content
    return [r + a, r + THINK_END + a, THINK_START + r + a, THINK_START + r + THINK_END + a]


async def reasoning(ctx: Ctx, rng: random.Random) -> int:
    """A guided_choice or guided_regex-forced answer with ``<think>..</think>`` in it (or not), the
    output opening in the answer (qwen3's enable_thinking off) or separate_reasoning off: each
    choice's reasoning_content and content, streamed or not, must be the split of a text the
    grammar allows (a thinking never closed all reasoning). Where the output opens in the thinking,
    the grammar waits for its end, which the random model never writes: all of it is reasoning."""
    body = dict(prompt(rng, True), **sampling(rng), **max_tokens(True, 96))
    forced = rng.choice([{"guided_choice": REASONED}, {"guided_regex": REASONED_REGEX}])
    switch = rng.choice([{}, {"chat_template_kwargs": {"enable_thinking": False}}, {"separate_reasoning": False}])
    body = with_extra(body, **forced, **switch)
    thinking = thinks_first(ctx, True, body)
    logprobs = rng.randint(0, 2) if rng.random() < 0.3 else None
    choices, tokens = await call(ctx, True, rng.random() < 0.5, rng.randint(1, 2), body, logprobs=logprobs,
                                 finish=("stop", "length") if thinking else ("stop",), tagged=not thinking)
    if thinking:  # (call checked it is all reasoning)
        return tokens

    def allowed(text: str) -> bool:
        return text in REASONED if "guided_choice" in forced else re.fullmatch(REASONED_REGEX, text) is not None

    for c in choices.values():
        require(any(_split(t, thinking) == (c.reasoning, c.content) and allowed(t) for t in _unsplit(c)),
                f"thinking first {thinking}: no allowed text splits to {c.reasoning!r} and {c.content!r}")
    return tokens


def _check_scored(ctx: Ctx, scored, ids: List[int], k: int) -> None:
    """vLLM's prompt_logprobs of the prompt ``ids``: None first, then at each position the prompt's
    token (rank ≥ 1; past ``k`` it is not among the best) and the ``k`` best, ranked 1..k by logprob."""
    require(isinstance(scored, list) and len(scored) == len(ids) and scored[0] is None,
            f"prompt_logprobs of {len(ids)} tokens: {str(scored)[:200]}")
    for tid, position in zip(ids[1:], scored[1:]):
        own = position.get(str(tid))
        require(own is not None and own["rank"] >= 1, f"the prompt's token {tid} in {position}")
        best = sorted((v["rank"], v["logprob"]) for t, v in position.items() if t != str(tid))
        ranks = [r for r, _ in best]  # (k - 1 where the prompt's token is among the best; k, a tie aside, where not)
        require(len(set(ranks)) == len(ranks) and all(1 <= r <= k for r in ranks)
                and len(ranks) in ((k,) if own["rank"] > k else (k - 1, k)), f"k={k}, prompt token {tid}: {position}")
        logprobs = [lp for _, lp in best]
        require(all(a >= b for a, b in zip(logprobs, logprobs[1:])) and all(lp <= 1e-4 for lp in logprobs + [
            own["logprob"]]) and (not best or best[0][0] > 1 or own["logprob"] <= best[0][1] + 1e-4),
            f"logprobs out of rank order: {position}")
        require(all(v["decoded_token"] == ctx.tokenizer.decode([int(t)]) for t, v in position.items()),
                f"decoded tokens {position}")


async def _tokenized(ctx: Ctx, body: Dict[str, Any]) -> Dict[str, Any]:
    answer = await post(ctx, "/tokenize", dict(body, model=ctx.model))
    require(answer.status_code == 200, f"/tokenize {answer.status_code} {answer.text[:200]}")
    out = answer.json()
    require(out["count"] == len(out["tokens"]) and out["max_model_len"] == ctx.context_len, f"/tokenize {out}")
    return out


async def prompt_logprobs(ctx: Ctx, rng: random.Random) -> int:
    """vLLM's prompt_logprobs (never streamed): a completion's on each choice (with echo, then
    max_tokens 0 at times), a chat's on the response; over the prompt /tokenize gives."""
    chat, k, n = rng.random() < 0.5, rng.randint(0, 5), rng.randint(1, 2)
    body = prompt(rng, chat, rng.choice(ctx.systems) if rng.random() < 0.3 else None)
    ids = (await _tokenized(ctx, body))["tokens"]
    echo = not chat and rng.random() < 0.4
    new_tokens = 0 if echo and rng.random() < 0.5 else rng.randint(1, 8)  # (0 returns nothing without echo: a 400)
    api = ctx.client.chat.completions if chat else ctx.client.completions
    out = await api.create(model=ctx.model, n=n, **body, **max_tokens(chat, new_tokens), temperature=0,
                           extra_body=dict(prompt_logprobs=k, **({"echo": True} if echo else {})))
    require(out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens <= n * new_tokens, f"usage {out.usage}")
    require(sorted(c.index for c in out.choices) == list(range(n)), f"choices {out.choices}")
    for c in out.choices:
        require(c.finish_reason in ("stop", "length"), f"finish_reason {c.finish_reason!r}")
        if not chat:
            head = body["prompt"] if echo else ""
            require(c.text.startswith(head) and (new_tokens > 0 or c.text == head), f"text {c.text!r}")
            _check_scored(ctx, (c.model_extra or {}).get("prompt_logprobs"), ids, k)
    if chat:
        _check_scored(ctx, (out.model_extra or {}).get("prompt_logprobs"), ids, k)
    return out.usage.completion_tokens


async def tokenize(ctx: Ctx, rng: random.Random) -> int:
    """/tokenize's count is the prompt the endpoints run (usage.prompt_tokens of a chat, with or
    without tools, or of a completion, special tokens or not); /detokenize gives a text's tokens
    back as that text and any ids as the tokenizer decodes them; an id past the vocabulary a 400."""
    way = rng.choice(["chat", "completion", "detokenize", "bad_id"])
    if way in ("chat", "completion"):
        chat = way == "chat"
        body = prompt(rng, chat, rng.choice(ctx.systems) if rng.random() < 0.3 else None)
        fields = {"tools": TOOLS} if chat and rng.random() < 0.5 else {"add_special_tokens": rng.random() < 0.5}
        strs = rng.random() < 0.3
        out = await _tokenized(ctx, dict(body, **fields, return_token_strs=strs))
        require(not strs or len(out["token_strs"]) == out["count"], f"token_strs {out}")
        require(chat or out["tokens"] == ctx.tokenizer.encode(body["prompt"], **fields), f"/tokenize {out}")
        api = ctx.client.chat.completions if chat else ctx.client.completions
        extra = {"extra_body": fields} if "add_special_tokens" in fields else fields
        answer = await api.create(model=ctx.model, **body, **extra, **max_tokens(chat, 1), temperature=0)
        require(answer.usage.prompt_tokens == out["count"], f"usage {answer.usage} for /tokenize's {out['count']}")
        return answer.usage.completion_tokens
    if way == "detokenize":
        text_ = prompt(rng, False)["prompt"] + rng.choice(["", " é", " 日本", "\n\t"])
        ids = (await _tokenized(ctx, {"prompt": text_, "add_special_tokens": False}))["tokens"]
        anyway = [rng.randrange(len(ctx.tokenizer)) for _ in range(rng.randint(1, 16))]
        for tokens, want in ((ids, text_), (anyway, ctx.tokenizer.decode(anyway))):
            answer = await post(ctx, "/detokenize", {"model": ctx.model, "tokens": tokens})
            require(answer.status_code == 200 and answer.json()["prompt"] == want,
                    f"/detokenize {tokens}: {answer.status_code} {answer.text[:200]} for {want!r}")
        return 0
    answer = await post(ctx, "/detokenize", {"model": ctx.model, "tokens": [1, len(ctx.tokenizer) + rng.randrange(9)]})
    error = answer.json().get("error", {})
    require(answer.status_code == 400 and error.get("param") == "tokens", f"{answer.status_code} {error}")
    raise Expected()


EXTRA_KINDS = {"tools": (tools, 3), "reasoning": (reasoning, 3), "prompt_lp": (prompt_logprobs, 2),
               "tokenize": (tokenize, 2)}  # name: (sender, weight)
