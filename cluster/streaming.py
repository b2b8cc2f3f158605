"""Turning the cluster's cumulative results into what a client receives.

* :class:`TextDelta` — the new text of each step. A step's text is the whole
  output so far; what was already sent is never taken back, so a trailing
  ``\\ufffd`` (half a UTF-8 character) and a tail that may still grow into a
  stop string are held until the next step or the end (:func:`partial_suffix_len`).
* :func:`run_choices` — n requests (one per choice, rid ``{rid}-{i}``) merged
  into one stream of :class:`ChoiceEvent`; the first failure ends it, an abort
  (:data:`ABORTED`) ends each choice as aborted.
* :func:`sse` — ``data: {json}\\n\\n`` lines, ``data: [DONE]`` last.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Dict, List, Optional, Sequence

from actors.engine.finish import decode_after
from actors.pd_scheduler import PDRequestError


class TextDelta:
    def __init__(self, tokenizer, stop: Sequence[str] = (), skip_special_tokens: bool = True,
                 prompt_ids: Sequence[int] = (), include_stop: bool = False):
        self.tokenizer, self.stop, self.skip = tokenizer, list(stop), skip_special_tokens
        self.include_stop = include_stop  # vLLM's include_stop_str_in_output
        self.prompt_ids = prompt_ids  # the text is decoded after them (workers without a tokenizer)
        self.sent = ""

    def text_of(self, result: Dict[str, Any]) -> str:
        """The worker's text, or (workers that skip the tokenizer) the output decoded here as the
        engine does: after the prompt's tail, a matched stop token left out (unless ``include_stop``:
        vLLM's ``include_stop_str_in_output``)."""
        if "text" in result:
            return result["text"]
        if self.tokenizer is None:
            return ""
        ids = result["output_ids"]
        matched = (result.get("meta_info", {}).get("finish_reason") or {}).get("matched")
        if isinstance(matched, int) and ids and ids[-1] == matched and not self.include_stop:
            ids = ids[:-1]
        return decode_after(self.tokenizer, self.prompt_ids, ids, self.skip)

    def update(self, result: Dict[str, Any], finished: bool) -> str:
        text = self.text_of(result)
        if not text.startswith(self.sent):  # a stop string was cut off after we held it back: nothing new
            return ""
        ready = len(text) if finished else len(text) - self._held(text)
        delta = text[len(self.sent):ready] if ready > len(self.sent) else ""
        self.sent += delta
        return delta

    def _held(self, text: str) -> int:
        held = len(text) - len(text.rstrip("\ufffd"))
        return max([held] + [partial_suffix_len(text, stop) for stop in self.stop])


def partial_suffix_len(text: str, word: str) -> int:
    """The length of ``text``'s longest tail that is a proper prefix of ``word`` (0: none): what may
    still grow into ``word`` with the next text."""
    for k in range(min(len(word) - 1, len(text)), 0, -1):
        if text.endswith(word[:k]):
            return k
    return 0


@dataclass
class ChoiceEvent:
    """One step of choice ``index``: its cumulative result and the step's new text / token count."""

    index: int
    result: Dict[str, Any]
    delta: str
    new_tokens: int
    finished: bool
    first: bool


# SGLang's abort finish reason of a request a client aborted (/abort_request, /pause_generation's
# abort mode): an answer like any other, finish_reason "abort"; the workers' own aborts are failures
ABORTED = {"type": "abort", "message": "Abort by request"}


def finish_reason(result: Dict[str, Any]) -> Optional[str]:
    reason = result["meta_info"].get("finish_reason")
    if reason is None:
        return None
    if reason.get("type") == "abort" and reason != ABORTED:
        raise PDRequestError(reason.get("message") or "the request was aborted")
    return reason.get("type")


def aborted_result(last: Optional[Dict[str, Any]], prompt_len: int) -> Dict[str, Any]:
    """A choice's answer once aborted: its last result (none yet: no output, SGLang's "abort before
    prefill") finished with :data:`ABORTED`."""
    if last is None:
        last = {"output_ids": [], "text": "", "meta_info": {"prompt_tokens": prompt_len, "completion_tokens": 0,
                                                            "cached_tokens": 0}}
    return dict(last, meta_info=dict(last["meta_info"], finish_reason=ABORTED))


async def _one_choice(index: int, stream: AsyncIterator[Dict[str, Any]], text: TextDelta,
                      queue: asyncio.Queue, on_done: Callable, aborted: asyncio.Event) -> None:
    """Feed one choice's events into ``queue``; then ``None`` (done) or the exception that ended it.
    Cancelled once ``aborted`` is set, its stream's clean-up stops its workers (as when the client
    leaves) and the choice ends with :func:`aborted_result`; aborted already (before its admission),
    its stream is never started."""
    last, first_time, num_tokens = None, None, 0

    def put(result):
        nonlocal last, first_time, num_tokens
        finished = finish_reason(result) is not None
        new_tokens, num_tokens = len(result["output_ids"]) - num_tokens, len(result["output_ids"])
        queue.put_nowait(ChoiceEvent(index, result, text.update(result, finished), new_tokens, finished,
                                     first=last is None))
        first_time, last = first_time or time.perf_counter(), result

    if aborted.is_set():
        put(aborted_result(None, len(text.prompt_ids)))
        queue.put_nowait(None)
        return
    try:
        async for result in stream:
            put(result)
        if last is None or finish_reason(last) is None:
            raise PDRequestError("the stream ended before the request finished")
        on_done(last, first_time)
        queue.put_nowait(None)
    except BaseException as exc:  # noqa: BLE001 — handed to the consumer, which re-raises
        if not aborted.is_set():
            queue.put_nowait(exc)
            return
        if last is not None and finish_reason(last) is not None:  # it ended first; its stream was closing
            on_done(last, first_time)
        else:  # (however its stream took the cancel)
            put(aborted_result(last, len(text.prompt_ids)))
        queue.put_nowait(None)


async def run_choices(streams: List[AsyncIterator[Dict[str, Any]]], texts: List[TextDelta],
                      on_done: Callable, aborted: Optional[asyncio.Event] = None) -> AsyncIterator[ChoiceEvent]:
    """Merge the choices' streams; raises the first choice error after cancelling the rest. Once
    ``aborted`` is set, every choice still running is cancelled and ends aborted.

    A choice is cancelled once, and its clean-up (stopping its workers: the PD client's prefill
    stop, then a safe abort of the decode reservation) is waited for but never cancelled again
    from here: a consumer cancelled again while it waits (starlette's streamed response, in an
    anyio scope that cancels at every await) stops waiting, and the choices' clean-up goes on
    (``gather`` would have passed the cancel on: the decode slots then stayed quarantined for
    the hand-off's deadline)."""
    queue: asyncio.Queue = asyncio.Queue()
    aborted = aborted if aborted is not None else asyncio.Event()
    tasks = [asyncio.ensure_future(_one_choice(i, stream, text, queue, on_done, aborted))
             for i, (stream, text) in enumerate(zip(streams, texts))]
    watcher = asyncio.ensure_future(aborted.wait())

    def cancel_choices(done: asyncio.Future) -> None:
        if not done.cancelled():
            for task in tasks:
                task.cancel()

    watcher.add_done_callback(cancel_choices)
    remaining = len(tasks)
    try:
        while remaining:
            item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        watcher.cancel()
        for task in tasks:
            task.cancel()
        await asyncio.wait(tasks)


def sse(payload: Any) -> str:
    """One SSE message. A typed event (a dict with a top-level ``type``: the Responses API's) is
    sent with its ``event:`` line too, as OpenAI and vLLM send them, for clients that dispatch on
    it; chat and completion chunks carry no ``type`` and go as ``data:`` only."""
    if isinstance(payload, str):
        return f"data: {payload}\n\n"
    data = f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
    kind = payload.get("type") if isinstance(payload, dict) else None
    return f"event: {kind}\n{data}" if isinstance(kind, str) else data


DONE = sse("[DONE]")
