"""The request kinds of scripts/soak.py over vLLM's scoring routes and sampling constraints: /score
and the rerank routes (embedding similarity, the server's default), ``allowed_token_ids``,
``bad_words`` and ``response_format: structural_tag``. The built-in model's tokenizer is byte-level
(each byte one token), so a one-character word is one token and a constraint on tokens is one on
the characters of the text; what the random model writes in between is free, and each answer is
held to the constraint over all of it."""

from __future__ import annotations

import json
import random
import string
from typing import Any, Dict, List

import jsonschema
import numpy as np

from soak_client import (Ctx, Expected, Mismatch, call, max_tokens, post, prompt, require, sampling, thinks_first,
                         with_extra)
from soak_mix_apis import embed

LETTERS = "abcdefghilmnoprstu"
RERANK_ROUTES = ["/rerank", "/v1/rerank", "/v2/rerank"]
TAG_SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}},
              "required": ["n"], "additionalProperties": False}  # (no text in it: its JSON holds no tag's end)


def _texts(rng: random.Random, num: int) -> List[str]:
    return [prompt(rng, False)["prompt"] for _ in range(num)]


async def _scored(ctx: Ctx, route: str, body: Dict[str, Any]) -> Dict[str, Any]:
    """The route's answer; where the workers do not schedule by priority, a priority is a 400 naming it."""
    answer = await post(ctx, route, dict(body, model=ctx.model))
    if answer.status_code == 400 and body.get("priority") and not ctx.priority:
        require(answer.json()["error"]["param"] == "priority", f"{route}: {answer.text[:300]}")
        raise Expected()
    require(answer.status_code == 200, f"{route} {answer.status_code}: {answer.text[:300]}")
    return answer.json()


async def _cosines(ctx: Ctx, queries: List[str], documents: List[str]) -> np.ndarray:
    """Each pair's cosine over /v1/embeddings' vectors (1→N or N→N, as /score pairs them)."""
    vectors, _ = await embed(ctx, queries + documents)
    return (vectors[:len(queries)] * vectors[len(queries):]).sum(axis=1)


async def score(ctx: Ctx, rng: random.Random) -> int:
    """/score or /v1/score (1→N or N→N, one text twice) or a rerank route (top_n, return_documents):
    each score a cosine in [-1, 1] equal to that of the two texts' /v1/embeddings vectors, the same
    pair's scores equal; a rerank's results best first, the ``top_n`` best, each document its own."""
    documents = _texts(rng, rng.randint(1, 4))
    documents.append(rng.choice(documents))
    queries = _texts(rng, len(documents) if rng.random() < 0.3 else 1)
    body = {"priority": rng.choice([-3, 2])} if rng.random() < 0.2 else {}
    if len(queries) > 1 or rng.random() < 0.5:
        out = await _scored(ctx, rng.choice(["/score", "/v1/score"]),
                            dict(body, text_1=queries if len(queries) > 1 or rng.random() < 0.5 else queries[0],
                                 text_2=documents))
        require([d["index"] for d in out["data"]] == list(range(len(documents))), f"indices of {out['data']}")
        got = {d["index"]: d["score"] for d in out["data"]}
    else:
        top_n, returned = rng.choice([0, 1, len(documents) - 1]), rng.random() < 0.5
        out = await _scored(ctx, rng.choice(RERANK_ROUTES), dict(body, query=queries[0], documents=documents,
                                                                  top_n=top_n, return_documents=returned))
        results = out["results"]
        got = {r["index"]: r["relevance_score"] for r in results}
        require(len(got) == len(results) == (top_n or len(documents)), f"top_n {top_n}: {results}")
        relevance = [r["relevance_score"] for r in results]
        require(relevance == sorted(relevance, reverse=True), f"rerank not best first: {relevance}")
        require(all(r.get("document") == ({"text": documents[r["index"]]} if returned else None) for r in results),
                f"return_documents {returned}: {results}")
    require(out["usage"]["prompt_tokens"] > 0, f"usage {out['usage']}")
    cosines = await _cosines(ctx, queries, documents)
    for i, s in got.items():
        require(-1 - 1e-6 <= s <= 1 + 1e-6 and abs(s - cosines[i]) < 1e-4, f"pair {i}: score {s}, cosine {cosines[i]}")
    twice = documents.index(documents[-1])  # (the same pair where the query is one)
    if len(queries) == 1 and {twice, len(documents) - 1} <= set(got):
        require(abs(got[twice] - got[len(documents) - 1]) < 1e-4, f"the same pair scored {got}")
    return 0


def _token_ids(ctx: Ctx, chars: str) -> List[int]:
    ids = [ctx.tokenizer.encode(ch, add_special_tokens=False) for ch in chars]
    require(all(len(i) == 1 for i in ids), f"{chars!r} are not one token each: {ids}")
    return [i[0] for i in ids]


async def allowed_tokens(ctx: Ctx, rng: random.Random) -> int:
    """vLLM's allowed_token_ids (a few letters' ids, the EOS's at times): every output token is one of
    them, read as /generate's output_ids or as the characters of a completion's or chat's text."""
    chars = "".join(rng.sample(LETTERS, rng.randint(1, 5)))
    ids = _token_ids(ctx, chars) + ([ctx.tokenizer.eos_token_id] if rng.random() < 0.3 else [])
    if rng.random() < 0.3:
        answer = await post(ctx, "/generate", {"text": prompt(rng, False)["prompt"], "sampling_params": dict(
            sampling(rng), max_new_tokens=rng.randint(1, 32), allowed_token_ids=ids)})
        require(answer.status_code == 200, f"/generate {answer.status_code}: {answer.text[:300]}")
        out = answer.json()
        require(out["output_ids"] and set(out["output_ids"]) <= set(ids), f"output_ids {out['output_ids']} of {ids}")
        return len(out["output_ids"])
    chat = rng.random() < 0.5
    body = with_extra(dict(prompt(rng, chat), **sampling(rng), **max_tokens(chat, rng.randint(1, 32))),
                      allowed_token_ids=ids)
    choices, tokens = await call(ctx, chat, rng.random() < 0.5, rng.randint(1, 2), body)
    for c in choices.values():
        require(set(c.text) <= set(chars), f"{c.text!r} outside {chars!r}")
    return tokens


async def bad_words(ctx: Ctx, rng: random.Random) -> int:
    """vLLM's bad_words: one-letter words (one token: never written) and a two-letter one (its second
    letter never right after its first): no word in any choice's text. Mostly with allowed_token_ids
    of a few letters, the words among them (two letters left free), where the random model, which
    spreads over every byte, would write them."""
    letters = rng.sample(LETTERS, rng.randint(2, 6))
    words = letters[2:rng.randint(2, len(letters))] + ["".join(rng.sample(letters, 2))]
    chat = rng.random() < 0.5
    extra = {"allowed_token_ids": _token_ids(ctx, "".join(letters))} if rng.random() < 0.7 else {}
    body = with_extra(dict(prompt(rng, chat), **sampling(rng), **max_tokens(chat, rng.randint(8, 48))),
                      bad_words=words, **extra)
    choices, tokens = await call(ctx, chat, rng.random() < 0.5, rng.randint(1, 2), body)
    for c in choices.values():
        require(not any(w in c.text for w in words), f"a bad word of {words} in {c.text!r}")
    return tokens


def _tag(rng: random.Random, triggers: str) -> Dict[str, Any]:
    """A structural tag per trigger letter (``x=`` begins it, ``;`` ends it), in vLLM's legacy shape
    or xgrammar's."""
    if rng.random() < 0.5:
        return {"type": "structural_tag", "triggers": list(triggers),
                "structures": [{"begin": t + "=", "schema": TAG_SCHEMA, "end": ";"} for t in triggers]}
    tags = [{"type": "tag", "begin": t + "=", "content": {"type": "json_schema", "json_schema": TAG_SCHEMA},
             "end": ";"} for t in triggers]
    return {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": list(triggers), "tags": tags}}


def check_tagged(text: str, triggers: str, cut: bool) -> int:
    """Every trigger letter in the free text opens ``x=`` JSON of the schema ``;``; only a ``cut``
    output (finish_reason length) may end inside one. Returns how many structures it holds."""
    at, found = 0, 0
    while True:
        starts = [i for i in (text.find(t, at) for t in triggers) if i >= 0]
        if not starts:
            return found
        start = min(starts) + 2
        require(text[start - 1:start] == "=" or (cut and start - 1 == len(text)), f"trigger at {start - 2}: {text!r}")
        end = text.find(";", start)
        if end < 0:
            require(cut, f"a structure never closed in {text!r}")
            return found
        try:
            jsonschema.validate(json.loads(text[start:end]), TAG_SCHEMA)
        except (ValueError, jsonschema.ValidationError) as exc:
            raise Mismatch(f"structure {text[start:end]!r} in {text!r}: {exc}") from None
        at, found = end + 1, found + 1


async def structural_tag(ctx: Ctx, rng: random.Random) -> int:
    """response_format structural_tag with many letters as triggers (the random model spreads over
    every byte: a few letters would seldom come): the text after each is its structure, held to the
    schema (a completion's, or a chat's with the thinking off: thinking first, the grammar waits for
    the thinking's end, which the random model never writes)."""
    triggers = "".join(rng.sample(string.ascii_lowercase, rng.randint(8, 26)))
    chat = rng.random() < 0.5
    body = dict(prompt(rng, chat), **sampling(rng), **max_tokens(chat, rng.randint(8, 64)),
                response_format=_tag(rng, triggers))
    if chat and rng.random() < 0.7:
        body = with_extra(body, chat_template_kwargs={"enable_thinking": False})
    choices, tokens = await call(ctx, chat, rng.random() < 0.5, rng.randint(1, 2), body)
    if not thinks_first(ctx, chat, body):
        for c in choices.values():
            check_tagged(c.text, triggers, c.finish_reason == "length")
    return tokens


VLLM_KINDS = {"score": (score, 2), "allowed": (allowed_tokens, 2), "bad_words": (bad_words, 2),
              "struct_tag": (structural_tag, 2)}  # name: (sender, weight)
