"""The Responses API's shapes over a chat answer's: a response object, or its stream of events.

A :class:`ResponsesFormatter` wraps the :class:`~cluster.openai_format.ChatFormatter` of the chat
request a Responses request became (``cluster.openai_responses``) and reads what it writes: the
whole chat message, or each streamed delta. Its output items, in the order the model wrote them:

* ``reasoning`` — the thinking the server's reasoning parser split off (``summary: []``, the text in
  ``content: [{"type": "reasoning_text"}]``, as vLLM's);
* ``message`` — the answer, ``content: [{"type": "output_text", "text", "annotations": [], "logprobs"}]``;
* ``function_call`` — each tool call (``call_id``, ``name``, ``arguments`` as JSON text).

``status`` is "completed", or "incomplete" with ``incomplete_details.reason`` "max_output_tokens"
when the output ran out of tokens (chat's "length"; the last item is then "incomplete" too).
Usage: ``input_tokens`` (``cached_tokens`` among them), ``output_tokens``, and of those
``reasoning_tokens``: the reasoning text's tokens, encoded again (its tags not counted).

``logprobs`` (empty unless the chat request asked for them, as a Responses request's ``include``
``message.output_text.logprobs`` does): the chat answer's, ``{"token", "logprob", "bytes",
"top_logprobs": [{"token", "logprob", "bytes"}]}`` per token. The output_text's are its text's tokens
(:class:`OutputTokens`), whole or streamed: not the thinking's before it nor a tool call's after it
(vLLM's whole output_text has every output token's). Streamed, ``response.output_text.delta`` carries
those of its text not on an earlier delta (``bytes`` left out, as OpenAI's delta events), and the
output_text's ``.done``, its part and item those of every delta.

Streamed, each event has a ``type`` and a ``sequence_number`` counting from 0:
``response.created``, ``response.in_progress``, then per item ``response.output_item.added``,
(a reasoning or message item) ``response.content_part.added``, its deltas
(``response.reasoning_text.delta``, ``response.output_text.delta``,
``response.function_call_arguments.delta``), their ``.done``, (``response.content_part.done``),
``response.output_item.done``; last ``response.completed`` (``response.incomplete`` when
incomplete, as OpenAI's) with the whole response. An item is done when the next one starts (the
parsers give reasoning, then content and calls, each call's arguments before the next call's), and
the stream ends there: no ``data: [DONE]``, as OpenAI's and vLLM's.
"""

from __future__ import annotations

import time
import uuid
from bisect import bisect_left, bisect_right
from typing import Any, Callable, Dict, List, Optional

from cluster.streaming import ChoiceEvent

CONTENT_PART = {"reasoning": "reasoning_text", "message": "output_text"}  # an item kind's text part
DELTA_EVENT = {"reasoning": "response.reasoning_text", "message": "response.output_text",
               "function_call": "response.function_call_arguments"}
ITEM_ID_PREFIX = {"reasoning": "rs", "message": "msg", "function_call": "fc", "function_call_output": "fco"}
LogprobEntry = Dict[str, Any]  # a token's: {"token", "logprob", "bytes", "top_logprobs"}, as chat's


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def new_item_id(kind: str) -> str:
    """A new id for an item of type ``kind`` (an output item's, or an input item sent without one)."""
    return _new_id(ITEM_ID_PREFIX[kind])


def _event_logprobs(entries: List[LogprobEntry]) -> List[Dict[str, Any]]:
    """Logprobs as a text event carries them: no ``bytes``."""
    return [{"token": e["token"], "logprob": e["logprob"],
             "top_logprobs": [{"token": t["token"], "logprob": t["logprob"]} for t in e["top_logprobs"]]}
            for e in entries]


class OutputItem:
    """One output item as it grows: ``text`` is a reasoning or message item's text, a call's arguments;
    ``logprobs`` a message's output_text's."""

    def __init__(self, kind: str, text: str = "", call_id: Optional[str] = None, name: Optional[str] = None,
                 logprobs: Optional[List[LogprobEntry]] = None):
        self.kind, self.text, self.call_id, self.name = kind, text, call_id, name
        self.logprobs: List[LogprobEntry] = logprobs or []
        self.id = new_item_id(kind)

    def part(self, whole: bool = True) -> Dict[str, Any]:
        """The item's content part (``whole`` false: as it opens, empty)."""
        part = {"type": CONTENT_PART[self.kind], "text": self.text if whole else ""}
        if self.kind != "message":
            return part
        return dict(part, annotations=[], logprobs=self.logprobs if whole else [])

    def shape(self, status: str, whole: bool = True) -> Dict[str, Any]:
        """The item as a response holds it (``whole`` false: as it opens, nothing in it yet)."""
        item = {"id": self.id, "type": self.kind, "status": status}
        if self.kind == "function_call":
            return dict(item, call_id=self.call_id, name=self.name, arguments=self.text if whole else "")
        content = [self.part()] if whole else []
        if self.kind == "reasoning":
            return dict(item, summary=[], content=content)
        return dict(item, role="assistant", content=content)


class OutputTokens:
    """The output's tokens (their logprob entries) and those each item's text came from: the tokens'
    texts laid end to end are the output as the model wrote it, in which each item's text is found
    after the one before (the parsers drop the tags and whitespace between texts, never change a
    text), and a text's tokens are those it overlaps. A text not found there (a token whose text is
    not its share of the output: a piece of a character) has every token not given out yet."""

    def __init__(self):
        self.entries: List[LogprobEntry] = []
        self.ends: List[int] = []  # each token's end in the output
        self.cursor = 0  # where the last text found ends
        self.rest = ""  # the output from there on, where the next text is looked for
        self.given = 0  # the tokens before it are a text's or none's

    def add(self, entries: List[LogprobEntry]) -> None:
        for entry in entries:
            self.ends.append((self.ends[-1] if self.ends else 0) + len(entry["token"]))
            self.rest += entry["token"]
            self.entries.append(entry)

    def take(self, text: str) -> List[LogprobEntry]:
        """The tokens of ``text``, the next text the output holds (an item's, or a piece of it)."""
        found = self.rest.find(text)
        start = self.cursor + max(found, 0)
        end = start + len(text) if found >= 0 else self.cursor + len(self.rest)
        first = max(bisect_right(self.ends, start), self.given)  # (the first token ending after the start)
        last = min(bisect_left(self.ends, end), len(self.ends) - 1)  # (the first ending at its end or after)
        self.rest, self.cursor = self.rest[end - self.cursor:], end
        taken = self.entries[first:last + 1]
        self.given = max(self.given, last + 1)
        return taken


class ResponsesFormatter:
    """``chat``: the chat request's formatter; ``echo``: the request's settings as the response carries
    them; ``on_done``: called with the whole response once it is (to store it)."""

    stream_end = None  # the stream ends with its last event

    def __init__(self, chat, echo: Dict[str, Any], tokenizer, on_done: Callable[[Dict[str, Any]], None]):
        self.chat, self.echo, self.tokenizer, self.on_done = chat, echo, tokenizer, on_done
        self.id = _new_id("resp")
        self.created = int(time.time())
        self.items: List[OutputItem] = []  # streamed: the items so far, the last one open
        self.finish: Optional[str] = None
        self.sequence = 0
        self.tokens = OutputTokens()  # streamed: the output's tokens so far

    # ---- the whole response ---------------------------------------------------------------
    def response(self, events: List[ChoiceEvent]) -> Dict[str, Any]:
        body = self.chat.response(events)
        choice = body["choices"][0]
        message = choice["message"]
        tokens = OutputTokens()
        tokens.add((choice["logprobs"] or {}).get("content") or [])
        items = [OutputItem("reasoning", message["reasoning_content"])] if message.get("reasoning_content") else []
        for item in items:  # (the thinking's tokens are no text's)
            tokens.take(item.text)
        if message.get("content"):
            items.append(OutputItem("message", message["content"], logprobs=tokens.take(message["content"])))
        items += [OutputItem("function_call", call["function"]["arguments"], call["id"], call["function"]["name"])
                  for call in message.get("tool_calls") or ()]
        return self._done(items, choice["finish_reason"], body["usage"])

    def _done(self, items: List[OutputItem], finish: str, usage: Dict[str, Any]) -> Dict[str, Any]:
        incomplete = finish == "length"
        output = [item.shape("completed") for item in items]
        if incomplete and output:  # (the item the limit cut)
            output[-1]["status"] = "incomplete"
        reasoning = "".join(item.text for item in items if item.kind == "reasoning")
        response = self._response("incomplete" if incomplete else "completed", output, {
            "input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
            "total_tokens": usage["total_tokens"], "input_tokens_details": usage["prompt_tokens_details"],
            "output_tokens_details": {"reasoning_tokens": self._num_tokens(reasoning)}})
        if incomplete:
            response["incomplete_details"] = {"reason": "max_output_tokens"}
        self.on_done(response)
        return response

    def _num_tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False)) if text else 0

    def _response(self, status: str, output: List[Dict[str, Any]], usage: Optional[Dict[str, Any]]):
        return dict(self.echo, id=self.id, object="response", created_at=self.created, model=self.chat.req.model,
                    status=status, output=output, usage=usage, error=None, incomplete_details=None)

    # ---- the stream ----------------------------------------------------------------------------
    def chunks(self, event: Optional[ChoiceEvent]) -> List[Dict[str, Any]]:
        out = []
        if self.sequence == 0:
            out += [self._event(kind, response=self._response("in_progress", [], None))
                    for kind in ("response.created", "response.in_progress")]
        if event is None:
            return out + self._close()
        for chunk in self.chat.chunks(event):
            choice = chunk["choices"][0]
            delta = choice["delta"]
            self.finish = choice["finish_reason"] or self.finish
            self.tokens.add((choice["logprobs"] or {}).get("content") or [])
            calls = delta.get("tool_calls") or ()
            # the open call's growth first: the step wrote it before any text of its after the call
            # (a step of several tokens: "7}}</tool_call>Done."), which would close the call's item
            for call in calls:
                if "id" not in call:
                    out += self._grow("function_call", call["function"]["arguments"])
            if delta.get("reasoning_content"):
                out += self._grow("reasoning", delta["reasoning_content"])
            if delta.get("content"):
                out += self._grow("message", delta["content"])
            for call in calls:
                if "id" in call:  # a new call (its first delta)
                    out += self._open(OutputItem("function_call", "", call["id"], call["function"]["name"]))
                    out += self._grow("function_call", call["function"]["arguments"])
        return out

    def _event(self, kind: str, **fields) -> Dict[str, Any]:
        event = dict(type=kind, sequence_number=self.sequence, **fields)
        self.sequence += 1
        return event

    def _where(self) -> Dict[str, Any]:
        """The open item's place in the events."""
        where = {"item_id": self.items[-1].id, "output_index": len(self.items) - 1}
        return where if self.items[-1].kind == "function_call" else dict(where, content_index=0)

    def _grow(self, kind: str, text: str) -> List[Dict[str, Any]]:
        """``text`` added to the open item of ``kind`` (a new one if the open one is of another)."""
        out = [] if self.items and self.items[-1].kind == kind else self._open(OutputItem(kind))
        if not text:
            return out
        self.items[-1].text += text
        extra = {}
        if kind != "function_call":  # (a call's arguments are its parser's JSON, not the output's text)
            taken = self.tokens.take(text)
            if kind == "message":
                self.items[-1].logprobs += taken
                extra = {"logprobs": _event_logprobs(taken)}
        return out + [self._event(DELTA_EVENT[kind] + ".delta", delta=text, **self._where(), **extra)]

    def _open(self, item: OutputItem) -> List[Dict[str, Any]]:
        out = self._finish_item("completed")
        self.items.append(item)
        out.append(self._event("response.output_item.added", output_index=len(self.items) - 1,
                               item=item.shape("in_progress", whole=False)))
        if item.kind != "function_call":
            out.append(self._event("response.content_part.added", **self._where(), part=item.part(whole=False)))
        return out

    def _finish_item(self, status: str) -> List[Dict[str, Any]]:
        """The last item's done events (the last item is open until the next opens, or the stream ends)."""
        if not self.items:
            return []
        item, where = self.items[-1], self._where()
        if item.kind == "function_call":
            out = [self._event(DELTA_EVENT[item.kind] + ".done", **where, name=item.name, arguments=item.text)]
        else:
            extra = {"logprobs": _event_logprobs(item.logprobs)} if item.kind == "message" else {}
            out = [self._event(DELTA_EVENT[item.kind] + ".done", **where, text=item.text, **extra),
                   self._event("response.content_part.done", **where, part=item.part())]
        return out + [self._event("response.output_item.done", output_index=where["output_index"],
                                  item=item.shape(status))]

    def _close(self) -> List[Dict[str, Any]]:
        """The last item's done events, then the whole response's."""
        out = self._finish_item("incomplete" if self.finish == "length" else "completed")
        response = self._done(self.items, self.finish, self.chat.usage())
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        return out + [self._event(kind, response=response)]
