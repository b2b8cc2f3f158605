"""OpenAI response shapes: completion / chat, whole responses and SSE chunks.

A formatter follows one HTTP request (all its choices): ``chunks(event)`` gives
the SSE chunks of one step (``chunks(None)`` the closing ones: the usage chunk
when ``stream_options.include_usage``), ``response(events)`` the whole
non-streaming body. ``prompts`` are the request's prompts (one for chat; a
/v1/completions batch may have several): choice ``index`` samples prompt
``index // n``. Usage counts each prompt once, completion tokens over every
choice, and ``prompt_tokens_details.cached_tokens`` per prompt as the most
tokens any of its choices found in a prefix cache. A choice that carries a
``finish_reason`` carries vLLM's ``stop_reason`` beside it. A chat choice's thinking
goes apart, to ``reasoning_content``, with a reasoning parser (:mod:`cluster.reasoning`).
vLLM's ``prompt_logprobs``, when asked, are on each choice of a completion (its prompt's)
and on a chat response itself.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Optional, Union

from cluster.reasoning import ReasoningSplitter
from cluster.streaming import DONE, ChoiceEvent, finish_reason
from cluster.tool_calls import ToolCalls


class _Formatter:
    object_name = chunk_object = ""
    stream_end = DONE  # what ends an SSE stream

    def __init__(self, req, prompts: List[List[int]], tokenizer, response_id: str):
        self.req, self.prompts, self.tokenizer, self.id = req, prompts, tokenizer, response_id
        self.created = int(time.time())
        self.meta: Dict[int, Dict[str, Any]] = {}
        self.num_logprobs: Dict[int, int] = {}

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else str(token_id)

    def _new_logprobs(self, event: ChoiceEvent, final: bool = False):
        """``[(token_id, logprob, [(id, logprob), ...]), ...]`` not yet sent for this choice (the
        request's ``top_logprobs_num`` alternatives: the engine's may be more, for ``prompt_logprobs``)."""
        meta, k = event.result["meta_info"], self.req.top_logprobs_num
        pairs = meta.get("output_token_logprobs")
        if pairs is None or k is None:
            return None
        tops = meta.get("output_top_logprobs") or []
        start = 0 if final else self.num_logprobs.get(event.index, 0)
        self.num_logprobs[event.index] = len(pairs)
        return [(tid, lp, tops[i][:k] if i < len(tops) else []) for i, (lp, tid) in enumerate(pairs) if i >= start]

    def _vllm_prompt_logprobs(self, index: int) -> Optional[List[Optional[Dict[str, Dict[str, Any]]]]]:
        """vLLM's ``prompt_logprobs`` of choice ``index``'s prompt (None unless asked): None for its
        first token, then at each position ``{token id: {"logprob", "rank", "decoded_token"}}`` of the
        prompt's token (its rank in the whole vocabulary) and the ``prompt_logprobs`` most likely."""
        k = self.req.prompt_logprobs
        if k is None:
            return None
        meta = self.meta[index]
        pairs, ranks, tops = meta["input_token_logprobs"], meta["input_token_ranks"], meta["input_top_logprobs"]
        out: List[Optional[Dict[str, Dict[str, Any]]]] = []
        for i, (lp, tid) in enumerate(pairs):
            if lp is None:
                out.append(None)
                continue
            best = tops[i][:k] if i < len(tops) else []
            ranked = [(tid, lp, ranks[i])] + [(t, v, r) for r, (t, v) in enumerate(best, 1)]
            position: Dict[str, Dict[str, Any]] = {}
            for t, v, r in ranked:  # (the prompt's token first, with its own rank, when it is among the best too)
                position.setdefault(str(t), {"logprob": v, "rank": r, "decoded_token": self._token_text(t)})
            out.append(position)
        return out

    def _stop_reason(self, result: Dict[str, Any]) -> Optional[Union[int, str]]:
        """vLLM's ``stop_reason``: the stop string or ``stop_token_ids`` id that ended the choice;
        None for EOS (vLLM tells it from a stop token so), ``length``, or a choice not done."""
        matched = (result["meta_info"].get("finish_reason") or {}).get("matched")
        return matched if isinstance(matched, str) or matched in self.req.stop_token_ids else None

    def usage(self) -> Dict[str, Any]:
        n = self.req.n
        completion = sum(m.get("completion_tokens", 0) for m in self.meta.values())
        prompt = sum(len(ids) for ids in self.prompts)
        cached = sum(min(len(ids), max((self.meta[i].get("cached_tokens", 0) for i in range(p * n, (p + 1) * n)
                                        if i in self.meta), default=0))
                     for p, ids in enumerate(self.prompts))
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def _head(self, obj: str) -> Dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.req.model}

    def _chunk(self, choice: Dict[str, Any], opening: bool = False) -> Dict[str, Any]:
        """An SSE chunk of one choice. With include_usage it has ``"usage": null`` (the usage comes
        in a last chunk of its own), or with ``continuous_usage_stats`` its choice's usage so far
        (as vLLM: the prompt's tokens and the choice's; none yet in an opening chunk)."""
        chunk = dict(self._head(self.chunk_object), choices=[choice])
        if self.req.include_usage:
            chunk["usage"] = self._choice_usage(choice["index"], opening) if self.req.continuous_usage else None
        return chunk

    def _choice_usage(self, index: int, opening: bool) -> Dict[str, int]:
        prompt = len(self.prompts[index // self.req.n])
        completion = 0 if opening else self.meta[index].get("completion_tokens", 0)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def chunks(self, event: Optional[ChoiceEvent]) -> List[Dict[str, Any]]:
        if event is None:
            if self.req.include_usage:
                return [dict(self._head(self.chunk_object), choices=[], usage=self.usage())]
            return []
        self.meta[event.index] = event.result["meta_info"]
        out = []
        if event.first:
            out += self._opening(event.index)
        reason = self._finish_reason(event) if event.finished else None
        logprobs = self._new_logprobs(event)
        delta = self._delta(event)
        if delta or reason or logprobs:
            out.append(self._chunk(dict(self._choice_delta(delta, logprobs, event.index), finish_reason=reason,
                                        stop_reason=self._stop_reason(event.result))))
        return out

    def response(self, events: List[ChoiceEvent]) -> Dict[str, Any]:
        texts: Dict[int, str] = {}
        last: Dict[int, ChoiceEvent] = {}
        for event in events:
            texts[event.index] = texts.get(event.index, "") + event.delta
            last[event.index] = event
            self.meta[event.index] = event.result["meta_info"]
        choices = []
        for index in sorted(last):
            event = last[index]
            logprobs = self._new_logprobs(event, final=True)
            choice = self._choice_whole(texts[index], logprobs, index)
            choices.append(dict(choice, finish_reason=self._finish_reason(event),
                                stop_reason=self._stop_reason(event.result)))
        return dict(self._head(self.object_name), choices=choices, usage=self.usage())

    # per shape
    def _finish_reason(self, event: ChoiceEvent) -> Optional[str]:
        return finish_reason(event.result)

    def _opening(self, index: int) -> List[Dict[str, Any]]:
        return []

    def _delta(self, event: ChoiceEvent):
        """What choice ``event.index`` adds in this step (falsy: nothing): its new text (chat: the
        delta's fields)."""
        return event.delta

    def _choice_delta(self, text, logprobs, index) -> Dict[str, Any]:
        raise NotImplementedError

    def _choice_whole(self, text, logprobs, index) -> Dict[str, Any]:
        raise NotImplementedError


class CompletionFormatter(_Formatter):
    object_name = chunk_object = "text_completion"

    def __init__(self, req, prompts, tokenizer, response_id):
        super().__init__(req, prompts, tokenizer, response_id)
        self.offsets: Dict[int, int] = {}
        self.echoes = [""] * len(prompts)  # per prompt
        if req.echo:
            self.echoes = [p if isinstance(p, str) else tokenizer.decode(ids) for p, ids in zip(req.prompts, prompts)]

    def _echo(self, index: int) -> str:
        return self.echoes[index // self.req.n]

    def _legacy_logprobs(self, entries, index: int):
        """``entries``: ``(token_id, logprob, top)``; a logprob of None (the prompt's first token,
        echoed) has None for its top logprobs too, as vLLM's. Text offsets run on from the last
        entry sent (the first from 0 with echoed logprobs, else from the echoed text's end)."""
        if entries is None:
            return None
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        offset = self.offsets.get(index, 0 if self._echo_logprobs else len(self._echo(index)))
        for tid, lp, top in entries:
            token = self._token_text(tid)
            out["tokens"].append(token)
            out["token_logprobs"].append(lp)
            out["top_logprobs"].append(None if lp is None else self._top_dict([(tid, lp)] + list(top or [])))
            out["text_offset"].append(offset)
            offset += len(token)
        self.offsets[index] = offset
        return out

    def _prompt_logprobs(self, index: int):
        """The echoed prompt's legacy logprobs (with echo and logprobs), from the choice's first result."""
        if not self._echo_logprobs:
            return None
        meta, k = self.meta[index], self.req.logprobs
        pairs, tops = meta["input_token_logprobs"], meta.get("input_top_logprobs") or []
        return self._legacy_logprobs(
            [(tid, lp, tops[i][:k] if i < len(tops) and tops[i] is not None else None)
             for i, (lp, tid) in enumerate(pairs)], index)

    @property
    def _echo_logprobs(self) -> bool:
        return self.req.echo and self.req.logprobs is not None

    @staticmethod
    def _joined(first, then):
        """Two legacy logprobs objects as one (either may be None)."""
        if first is None or then is None:
            return first or then
        return {key: first[key] + then[key] for key in first}

    def _top_dict(self, top) -> Dict[str, float]:
        """``{text: logprob}`` of the sampled token and the top ``logprobs`` alternatives (OpenAI's
        legacy format: up to ``logprobs + 1`` entries, the sampled token always among them; a
        dict, never null, for ``logprobs`` 0 too). Tokens whose texts collide (byte pieces all
        decode to U+FFFD) keep the best value, so a greedy token's logprob stays the max."""
        out: Dict[str, float] = {}
        for token_id, value in top:
            text = self._token_text(token_id)
            out[text] = max(value, out.get(text, value))
        return out

    def _opening(self, index):
        echo = self._echo(index)
        if not echo:
            return []
        return [self._chunk({"index": index, "text": echo, "logprobs": self._prompt_logprobs(index),
                             "finish_reason": None}, opening=True)]

    def _choice_delta(self, text, logprobs, index):
        return {"index": index, "text": text, "logprobs": self._legacy_logprobs(logprobs, index)}

    def _choice_whole(self, text, logprobs, index):
        prompt = self._prompt_logprobs(index)  # (first: the output's offsets run on from it)
        choice = {"index": index, "text": self._echo(index) + text,
                  "logprobs": self._joined(prompt, self._legacy_logprobs(logprobs, index))}
        if self.req.prompt_logprobs is not None:
            choice["prompt_logprobs"] = self._vllm_prompt_logprobs(index)
        return choice


class ChatFormatter(_Formatter):
    """``new_reasoning``: a new splitter per choice (a reasoning format's: a
    :class:`~cluster.reasoning.ReasoningSplitter`, or Harmony's), whose thinking goes to
    ``reasoning_content`` apart from the ``content``; ``tool_calls``: the request's
    :class:`~cluster.tool_calls.ToolCalls`, through which the content goes, its calls apart from the
    content left (as vLLM: the reasoning parser first, the tool parser on the answer; a parser that
    reads the whole output, Harmony's, is fed all of it and its content is the choice's). None: all
    of it is content."""

    object_name, chunk_object = "chat.completion", "chat.completion.chunk"

    def __init__(self, req, prompts, tokenizer, response_id,
                 new_reasoning: Optional[Callable[[], ReasoningSplitter]] = None,
                 tool_calls: Optional[ToolCalls] = None):
        super().__init__(req, prompts, tokenizer, response_id)
        self.new_reasoning, self.tool_calls = new_reasoning, tool_calls
        self.reasoning: Dict[int, ReasoningSplitter] = {}  # per choice, streamed
        self._parsed: Dict[int, Dict[str, Any]] = {}  # a step's delta fields

    def chunks(self, event):
        if event is not None:  # (first: the calls decide the finish reason)
            self._parsed[event.index] = self._split(event)
        return super().chunks(event)

    def _finish_reason(self, event):
        reason = super()._finish_reason(event)
        return reason if self.tool_calls is None else self.tool_calls.finish_reason(event.index, reason)

    def _entry(self, tid: int, lp: float) -> Dict[str, Any]:
        token = self._token_text(tid)
        return {"token": token, "logprob": lp, "bytes": list(token.encode("utf-8"))}

    def _chat_logprobs(self, entries):
        if entries is None:
            return None
        return {"content": [dict(self._entry(tid, lp), top_logprobs=[self._entry(t, v) for t, v in top])
                            for tid, lp, top in entries], "refusal": None}

    def _opening(self, index):
        return [self._chunk({"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}, opening=True)]

    def _split(self, event) -> Dict[str, Any]:
        """A step's delta fields: ``content``, or the choice's reasoning splitter's (none while it
        holds what may be a tag); the content then through the tool-call parser."""
        if self.new_reasoning is None:
            fields = {"content": event.delta} if event.delta else {}
        else:
            splitter = self.reasoning.setdefault(event.index, self.new_reasoning())
            fields = splitter.step(event.delta, event.finished).delta()
        if self.tool_calls is not None:
            answer = fields.pop("content", "")
            text = event.delta if self.tool_calls.whole_output else answer
            content, calls = self.tool_calls.delta(event.index, text, event.finished)
            fields.update({"content": content} if content else {}, **({"tool_calls": calls} if calls else {}))
        return fields

    def _delta(self, event):
        return self._parsed.pop(event.index)

    def _choice_delta(self, delta, logprobs, index):
        return {"index": index, "delta": delta, "logprobs": self._chat_logprobs(logprobs)}

    def _choice_whole(self, text, logprobs, index):
        fields = {"content": text} if self.new_reasoning is None else self.new_reasoning().step(text, True).message()
        if self.tool_calls is not None:
            whole_output = self.tool_calls.whole_output
            content, calls = self.tool_calls.message(index, text if whole_output else fields["content"] or "")
            if calls or whole_output:
                fields.update(content=content or None, **({"tool_calls": calls} if calls else {}))
            elif fields["content"] is not None:
                fields["content"] = content
        return {"index": index, "message": dict(role="assistant", **fields), "logprobs": self._chat_logprobs(logprobs)}

    def response(self, events: List[ChoiceEvent]) -> Dict[str, Any]:
        """vLLM's: a chat response's ``prompt_logprobs`` are its own (every choice ran the one prompt)."""
        body = super().response(events)
        if self.req.prompt_logprobs is not None:
            body["prompt_logprobs"] = self._vllm_prompt_logprobs(min(self.meta))
        return body
