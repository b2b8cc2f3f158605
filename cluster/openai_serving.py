"""The generation endpoints: /v1/completions, /v1/chat/completions (OpenAI) and
/generate (SGLang), streaming (SSE) or not, over a :class:`ServingBackend`.

A request is admitted (a slot, or 429 / 408), tokenized (chat: the tokenizer's
chat template), checked against the context length, then run as ``n``
requests, one per choice. A streaming response is returned only once the
first token is out, so an early failure still gets its own status code; a
failure after that ends the stream with an OpenAI-style error event and
``data: [DONE]``.

Request ids, as vLLM's: the request's id (the client's ``X-Request-Id``, or a
new one: see ``cluster.server``) is the base of the response ``id``
(``cmpl-{id}``, ``chatcmpl-{id}``), and the request the router and workers see
is the response id (/generate: the request's id) and a short random suffix
(:func:`internal_rid`), choice ``i``'s then ``-{i}``. A body ``rid`` (SGLang's)
is taken as it is instead; no two requests in flight have one alike (a 400).
From its arrival a request is found by its ``X-Request-Id`` and its rid in
:attr:`GenerationService.requests` (SGLang's /abort_request ends it: each
choice as when its client leaves, then answered finish_reason "abort"; one
still waiting for admission ends so at once, never sent). While generation is
paused (:attr:`GenerationService.resumed` clear: SGLang's /pause_generation)
new requests wait before admission.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from contextlib import contextmanager
from functools import partial
from typing import Any, Dict, List, Optional, Tuple, Union

from fastapi.responses import JSONResponse, StreamingResponse
from jinja2 import TemplateError
from pydantic import ValidationError

from actors.engine.multimodal import MultimodalInputs, MultimodalProcessor
from actors.engine.sampling_params import SamplingParams
from cluster.aio import unless_set
from cluster.api_errors import APIError, own_message
from cluster.chat_protocol import ChatCompletionRequest, ChatTemplateFields
from cluster.completion_protocol import CompletionRequest, GenerateRequest
from cluster.media_fetch import ServerMediaFetcher, check_video_decoder, decode_video, decoded, server_mm_limits
from cluster.openai_format import ChatFormatter, CompletionFormatter
from cluster.openai_protocol import describe_validation_error
from cluster.reasoning import REASONING_FORMATS, HarmonyFormat, prompt_tail
from cluster.request_table import RequestTable
from cluster.streaming import DONE, ChoiceEvent, TextDelta, run_choices, sse
from cluster.tool_calls import template_message, tool_calls_for


def validated(params: Dict[str, Any], prefix: str = "") -> Dict[str, Any]:
    """The engine's sampling params, checked here: a bad one is a 400 naming it (``prefix`` + field)."""
    try:
        return SamplingParams(**params).model_dump()
    except ValidationError as exc:
        message, param = describe_validation_error(exc)
        raise APIError(400, prefix + message, param=prefix + param if param else None) from None


def internal_rid(base: str) -> str:
    """``base`` and 8 random hex digits: unique per HTTP request even when a client sends an id again
    while the first request is in flight (the router refuses an id already routed), and found by
    grepping the workers' logs or the router's state for the client's id (vLLM's internal request ids)."""
    return f"{base}-{uuid.uuid4().hex[:8]}"


@contextmanager
def grammar_errors(req):
    """A grammar refused under the engine's name for it (``json_schema``, ``regex``, ``ebnf``: here,
    or by the workers, which compile it) is a 400 naming the field the request asked with
    (``response_format``, ``guided_json``, ...)."""
    try:
        yield
    except (APIError, ValueError) as exc:
        grammar = req.grammar
        message = exc.message if isinstance(exc, APIError) else own_message(exc)
        if grammar is None or (isinstance(exc, APIError) and exc.status != 400):
            raise
        field, engine_field, _ = grammar
        if not message.startswith(f"{engine_field}: "):
            raise
        raise APIError(400, field + message[len(engine_field):], param=field) from None


def check_token_ids(ids: List[int], param: str, vocab: Optional[int]) -> List[int]:
    """Token ids as sent; 400 naming ``param`` for one outside ``0..vocab - 1`` (None: for a
    negative one)."""
    bad = next((t for t in ids if t < 0 or (vocab is not None and t >= vocab)), None)
    if bad is not None:
        bound = f"0..{vocab - 1}" if vocab is not None else "non-negative"
        raise APIError(400, f"{param}: token id {bad} is out of the vocabulary (ids are {bound})", param=param)
    return list(ids)


class _SSEResponse(StreamingResponse):
    """An SSE response that runs ``on_close`` however it ends: finished, failed, or the client
    gone before the body started (a generator that never started never reaches its ``finally``)."""

    def __init__(self, body, on_close):
        super().__init__(body, media_type="text/event-stream")
        self._on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._on_close()


class GenerationService:
    """``reasoning_parser``: a name in :data:`~cluster.reasoning.REASONING_FORMATS` (chat choices'
    thinking apart from their content), or None; ``tool_call_parser``: ServerConfig's, how
    tool_choice "auto" reads calls; ``media_fetcher``: how image URLs are fetched (ServerConfig's media
    fields; None: the defaults)."""

    def __init__(self, backend, tokenizer, metrics, admission, reasoning_parser: Optional[str] = None,
                 tool_call_parser: Optional[str] = None, media_fetcher: Optional[ServerMediaFetcher] = None):
        self.backend, self.tokenizer, self.metrics, self.admission = backend, tokenizer, metrics, admission
        self.reasoning = REASONING_FORMATS[reasoning_parser] if reasoning_parser is not None else None
        self.tool_call_parser = tool_call_parser
        self.requests = RequestTable()
        self.resumed = asyncio.Event()  # clear while generation is paused
        self.resumed.set()
        self.num_paused = 0  # the requests waiting for it before admission
        # a vision-language model's tokenizer side: a chat's image_url parts (None: a text model's server)
        self.mm_processor = MultimodalProcessor.for_checkpoint(
            getattr(backend, "model_path", None), server_mm_limits(getattr(backend, "limit_mm_per_prompt", None)))
        self.media_fetcher = media_fetcher or ServerMediaFetcher()

    @property
    def _harmony(self) -> bool:
        """The model writes GPT-OSS's Harmony (:mod:`cluster.harmony`): its reasoning or tool parser is ``gpt_oss``."""
        return isinstance(self.reasoning, HarmonyFormat) or self.tool_call_parser == "gpt_oss"

    async def continue_generation(self) -> None:
        """The workers step again, then the requests a pause held are admitted (/continue_generation)."""
        await self.backend.continue_generation()
        self.resumed.set()

    # ---- shared steps -----------------------------------------------------------------
    def check_model(self, model: Optional[str]) -> str:
        """The served model's name, or one of its LoRA adapters' (vLLM's: the model field names
        the adapter); 404 for another one (a request naming none is for the served model)."""
        if model is None or model == self.backend.model_name:
            return self.backend.model_name
        if model in self.backend.lora_modules:
            return model
        served = ", ".join(f"'{name}'" for name in [self.backend.model_name, *self.backend.lora_modules])
        raise APIError(404, f"The model '{model}' does not exist; this server serves {served}", "not_found_error",
                       "model", "model_not_found")

    def lora_path(self, model: str) -> Optional[str]:
        """The adapter a request for ``model`` (checked) runs under: None for the base model."""
        return model if model in self.backend.lora_modules else None

    def encode(self, text: str, param: str, add_special_tokens: bool = True) -> List[int]:
        """A text prompt's token ids, with the tokenizer's special tokens (a Llama prompt starts with
        BOS) as vLLM's completions and SGLang's /generate encode it; a chat template writes its own."""
        if self.tokenizer is None:
            raise APIError(400, f"{param}: text needs a tokenizer; this server has none (send token ids)",
                           param=param)
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def token_ids(self, ids: List[int], param: str) -> List[int]:
        """Token ids as sent; 400 for one outside the model's vocabulary (it would fail the whole
        batch its request ran in, on CUDA with a device-side assert); where the backend does not
        know it, only a negative id is refused here (the workers check the rest)."""
        return check_token_ids(ids, param, getattr(self.backend, "vocab_size", None))

    def chat_prompt(self, req: ChatTemplateFields) -> List[int]:
        """The template's text of ``messages`` (and ``tools``, which a template lists in the prompt), encoded."""
        template = getattr(self.tokenizer, "chat_template", None) if self.tokenizer is not None else None
        if not template:
            raise APIError(400, "messages: the tokenizer has no chat template", param="messages")
        # OpenAI's developer role is its system role; a template that knows no "developer" gets "system"
        developer = "developer" if "developer" in str(template) else "system"
        try:
            if self.mm_processor is None and any(m.image_urls() or m.video_urls() for m in req.messages):  # (a text
                # template would take the parts as text: a TypeError, a 500)
                raise ValueError("images or videos, but the served model is not a vision-language model")
            messages = [template_message(dict(m.model_dump(exclude_none=True), content=m.template_content(),
                                              role=developer if m.role == "developer" else m.role))
                        for m in req.messages]
            tools = [tool.model_dump(exclude_none=True) for tool in req.tools] if req.tools else None
            text = self.tokenizer.apply_chat_template(
                messages, tools=tools, tokenize=False, add_generation_prompt=req.generation_prompt,
                continue_final_message=req.continue_final_message, **req.chat_template_kwargs)
        except (ValueError, TemplateError) as exc:  # a part type we do not take; the template refused
            raise APIError(400, f"messages: {exc}", param="messages") from None
        return self.tokenizer.encode(text, add_special_tokens=req.add_special_tokens)

    def max_new_tokens(self, prompt_len: int, requested: Optional[int], param: str) -> int:
        """``requested`` (None: what the context leaves); 400 ``context_length_exceeded`` in OpenAI's
        words when the prompt or the prompt and the completion do not fit."""
        limit, prompt_limit = self.backend.context_len, self.backend.max_prompt_len
        if prompt_len > prompt_limit or (requested and prompt_len + requested > limit):
            asked = f"{prompt_len + (requested or 0)} tokens ({prompt_len} in the {param}"
            asked += f", {requested} in the completion)" if requested else ")"
            held = f" and a {param} of at most {prompt_limit} tokens" if prompt_limit < limit - 1 else ""
            shorten = f"{param} or completion" if requested else param  # (max_tokens alone may be the cause)
            raise APIError(400, f"This model's maximum context length is {limit} tokens{held}. However, you "
                           f"requested {asked}. Please reduce the length of the {shorten}.", param=param,
                           code="context_length_exceeded")
        return requested if requested is not None else limit - prompt_len

    def openai_params(self, req, prompt_len: int, requested: Optional[int], param: str) -> Dict[str, Any]:
        """The engine's sampling params of an OpenAI request: 400 for a prompt or completion that does
        not fit (:meth:`max_new_tokens`), a ``min_tokens`` above the completion's length, or a
        ``logit_bias`` or ``allowed_token_ids`` id outside the vocabulary."""
        max_new = self.max_new_tokens(prompt_len, requested, param)
        if req.min_tokens > max_new:
            limit = "max_tokens" if requested is not None else "the tokens the context leaves after the prompt"
            raise APIError(400, f"min_tokens: {req.min_tokens} is more than {limit} ({max_new})", param="min_tokens")
        return self.checked_token_ids(validated(req.to_sampling_params(max_new)))

    def checked_token_ids(self, params: Dict[str, Any], prefix: str = "") -> Dict[str, Any]:
        """``params`` (validated); 400 naming a ``logit_bias`` or ``allowed_token_ids`` token id
        outside the vocabulary (``prefix`` + field)."""
        for field in ("logit_bias", "allowed_token_ids"):
            self.token_ids(list(params.get(field) or ()), prefix + field)
        return params

    async def _admit(self, aborted: asyncio.Event) -> bool:
        """A slot, once generation is not paused (SGLang's tokenizer manager holds a request so); False,
        holding none, when the request is aborted first (:attr:`requests`: /abort_request)."""
        if self.backend.draining:
            raise APIError(503, "the server is draining: no new requests", "service_unavailable", code="draining")
        if self.backend.is_sleeping:  # (sleep mode: at once, not after a wait for a slot)
            raise APIError(503, "the model is sleeping (its memory released): POST /wake_up or "
                           "/resume_memory_occupation first", "service_unavailable", code="sleeping")
        if not self.resumed.is_set():
            self.num_paused += 1
            try:
                if not await unless_set(self.resumed.wait(), aborted):
                    return False
            finally:
                self.num_paused -= 1
        return await unless_set(self.admission.acquire(), aborted, on_lost=lambda _: self.admission.release())

    def _streams(self, batch: List[Tuple[List[int], Dict[str, Any]]], n: int, rid: str, arrival: float,
                 priority: int, lora_path: Optional[str], aborted: asyncio.Event,
                 mm_inputs: Optional[MultimodalInputs] = None):
        """One request per choice: prompt ``p``'s sample ``i`` is choice ``p × n + i``, rid
        ``{rid}-{choice}`` (``rid`` itself for a lone choice), seeded ``seed + i`` as in vLLM
        (n samples, not n copies; a prompt's choice 0 equals its n = 1 answer). ``mm_inputs``: a
        lone prompt's images: the backend gets its padded prompt, the text its image tokens."""
        policies = {role: self.backend.routing_policy(role) for role in ("prefill", "decode")}

        def on_done(result, first_time):
            self.metrics.observe_request(result["meta_info"], arrival, first_time or time.perf_counter(),
                                         time.perf_counter(), policies)

        lone = len(batch) * n == 1
        streams, texts = [], []
        for p, (input_ids, params) in enumerate(batch):
            seed = params.get("seed")
            for i in range(n):
                choice_rid = rid if lone else f"{rid}-{p * n + i}"
                choice_params = dict(params, seed=None if seed is None else seed + i)
                prompt = list(input_ids) if mm_inputs is None else mm_inputs.padded_input_ids
                streams.append(self.backend.generate_stream(prompt, choice_params, choice_rid, priority, lora_path,
                                                            mm_inputs=mm_inputs))
                texts.append(TextDelta(self.tokenizer, params["stop"], params["skip_special_tokens"], input_ids,
                                       params["include_stop_str_in_output"]))
        return run_choices(streams, texts, on_done, aborted)

    async def _run(self, batch, n, rid, arrival, stream_fn, final_fn, priority: int = 0,
                   stream_end: Optional[str] = DONE, lora_path: Optional[str] = None, request_id: str = "",
                   own_rid: Optional[str] = None, mm_inputs: Optional[MultimodalInputs] = None):
        """Admit, run the choices of ``batch`` (``[(input_ids, params)]``, one per prompt) under LoRA
        adapter ``lora_path`` (None: the base model), and answer with JSON (``final_fn``) or SSE
        (``stream_fn``, then ``stream_end`` if any). A ``priority`` other than 0 is a 400 unless the
        workers schedule by priority (vLLM's answer). In :attr:`requests` under ``request_id`` and
        ``rid`` (``own_rid``: the client's, which must be unique) from its arrival to its end (SGLang's
        tokenizer manager enters a request before its pause, too): aborted before its admission, its
        choices end aborted with no output, never sent to a worker."""
        if priority and not self.backend.priority_scheduling:
            raise APIError(400, f"priority: got {priority}, but priority scheduling is not enabled "
                           "(engine enable_priority_scheduling)", param="priority")
        aborted = self.requests.add([name for name in (request_id, rid) if name], own_rid)
        events, admitted = None, False
        try:
            admitted = await self._admit(aborted)
            events = self._streams(batch, n, rid, arrival, priority, lora_path, aborted, mm_inputs)
            first = await events.__anext__()
            first_time = time.perf_counter()
        except BaseException:
            await self._close(events, aborted, admitted)
            raise
        if stream_fn is None:
            try:
                collected = [first] + [e async for e in events]
            finally:  # done, failed, or cancelled (the client went away): the other choices stop too
                await self._close(events, aborted, admitted)
            return JSONResponse(final_fn(collected))
        closed = False

        async def close():  # once, however the response ends
            nonlocal closed
            if not closed:
                closed = True
                await self._close(events, aborted, admitted)

        return _SSEResponse(self._sse(first, first_time, events, stream_fn, stream_end), close)

    async def _close(self, events, aborted: Optional[asyncio.Event] = None, admitted: bool = True) -> None:
        """Stop the choices, then give the admission slot back (if ``admitted``) and free the request's
        names, even if the stop is cancelled (a second cancel, at the server's shutdown timeout)."""
        try:
            if events is not None:
                await events.aclose()
        finally:
            if admitted:
                self.admission.release()
            if aborted is not None:
                self.requests.remove(aborted)

    async def _sse(self, first: ChoiceEvent, first_time: float, events, stream_fn, stream_end: Optional[str]):
        last_time = {first.index: first_time}  # per choice: n choices' chunks interleave
        try:
            for chunk in stream_fn(first):
                yield sse(chunk)
            async for event in events:
                now = time.perf_counter()
                if not event.first:  # (a choice's first token is its time to first token)
                    self.metrics.observe_itl(now - last_time[event.index], event.new_tokens)
                last_time[event.index] = now
                for chunk in stream_fn(event):
                    yield sse(chunk)
            for chunk in stream_fn(None):
                yield sse(chunk)
        except Exception as exc:  # a worker failed mid-stream: tell the client, then end the stream
            yield sse(APIError.from_exception(exc).body())
        finally:
            await events.aclose()  # the other choices stop too
        if stream_end:
            yield stream_end

    # ---- endpoints ----------------------------------------------------------------------
    async def completions(self, req: CompletionRequest, arrival: float, request_id: str):
        req = req.model_copy(update={"model": self.check_model(req.model)})
        if req.echo and self.tokenizer is None:  # (a text prompt already needs one)
            raise APIError(400, "echo: the prompt's text needs a tokenizer; this server has none", param="echo")
        with grammar_errors(req):
            batch = []
            for prompt in req.prompts:
                ids = (self.encode(prompt, "prompt", req.add_special_tokens) if isinstance(prompt, str)
                       else self.token_ids(prompt, "prompt"))
                batch.append((ids, self.openai_params(req, len(ids), req.max_tokens, "prompt")))
            fmt = CompletionFormatter(req, [ids for ids, _ in batch], self.tokenizer, f"cmpl-{request_id}")
            return await self._run(batch, req.n, req.rid or internal_rid(fmt.id), arrival,
                                   fmt.chunks if req.stream else None, fmt.response, req.priority,
                                   lora_path=self.lora_path(req.model), request_id=request_id, own_rid=req.rid)

    async def chat(self, req: ChatCompletionRequest, arrival: float, request_id: str, reshape=None):
        """``reshape``: the chat formatter to another API's formatter over it (``cluster.openai_responses``)."""
        req = req.model_copy(update={"model": self.check_model(req.model)})
        if req.tools and req.tool_choice == "auto" and self.tool_call_parser is None:  # (vLLM's answer too)
            raise APIError(400, 'tool_choice: "auto" needs a tool-call parser and this server has none (set '
                           "server.tool_call_parser; vLLM's --enable-auto-tool-choice --tool-call-parser)",
                           param="tool_choice")
        if req.tools and req.tool_choice not in (None, "none", "auto") and self._harmony:
            # (vLLM's Harmony path refuses it too: "Only 'auto' tool_choice is supported ... with Harmony")
            raise APIError(400, 'tool_choice: "required" or a named function is not served for GPT-OSS\'s Harmony '
                           "(gpt_oss): its grammar would hold from the message header the prompt opened, before "
                           'the model names a channel and a recipient; use "auto" (or "none")', param="tool_choice")
        tool_calls = tool_calls_for(req, self.tool_call_parser)
        ids = self.chat_prompt(req)
        mm_inputs = await self.mm_inputs(ids, [url for m in req.messages for url in m.image_urls()],
                                         [video for m in req.messages for video in m.video_urls()], "messages")
        if mm_inputs is not None:  # (the prompt with its images' tokens)
            ids = mm_inputs.unpadded_input_ids
        with grammar_errors(req):
            params = self.openai_params(req, len(ids), req.requested_max_tokens, "messages")
            # a named or required tool choice constrains the whole output to its JSON: no thinking to split
            separate = req.separate_reasoning and req.tool_choice in (None, "none", "auto")
            tags = self.reasoning if separate else None
            # (their tags must reach the parsers; a text left whole keeps them too)
            if any(p is not None and p.special_tokens for p in (tool_calls, self.reasoning)):
                params["skip_special_tokens"] = False
            thinking = tags is not None and tags.thinks_first(prompt_tail(self.tokenizer, ids), req.chat_template_kwargs)
            if thinking and req.grammar is not None:  # the grammar is the answer's: the thinking is free
                params["grammar_after"] = tags.answer_start
            reasoning = partial(tags.splitter, thinking) if tags is not None else None
            fmt = ChatFormatter(req, [ids], self.tokenizer, f"chatcmpl-{request_id}", reasoning, tool_calls)
            if reshape is not None:
                fmt = reshape(fmt)
            return await self._run([(ids, params)], req.n, req.rid or internal_rid(fmt.id), arrival,
                                   fmt.chunks if req.stream else None, fmt.response, req.priority, fmt.stream_end,
                                   lora_path=self.lora_path(req.model), request_id=request_id, own_rid=req.rid,
                                   mm_inputs=mm_inputs)

    async def mm_inputs(self, ids: List[int], image_urls: List[str], videos: List[Union[str, List[str]]],
                        param: str) -> Optional[MultimodalInputs]:
        """A prompt's images (``image_urls``: data, http(s) and file:// URLs, fetched here: :class:`ServerMediaFetcher`)
        and videos (each a video file's URL, decoded here, or a list of its frames' image URLs), processed off
        the event loop as the engine's ``image_data`` (each image's and video's one pad token of ``ids``
        expanded); None without either; 400 for images or videos to a text model, more than
        ``limit_mm_per_prompt`` or a video file without its decoder (before any is fetched), a URL that gives no
        image (video), or media the engine would refuse."""
        if not image_urls and not videos:
            return None
        if self.mm_processor is None:
            raise APIError(400, f"{param}: images or videos, but the served model is not a vision-language model",
                           param=param)
        try:
            self.mm_processor.check_counts(len(image_urls), len(videos))
        except ValueError as exc:
            raise APIError(400, f"{param}: {exc}", param=param) from None
        if any(isinstance(video, str) for video in videos):
            check_video_decoder(param)
        urls = image_urls + [url for video in videos for url in ([video] if isinstance(video, str) else video)]
        try:
            fetched = iter(await self.media_fetcher.fetch_all(urls, param))
        except ValueError as exc:
            raise APIError(400, str(exc), param=param) from None
        images = [next(fetched) for _ in image_urls]
        media = [next(fetched) if isinstance(video, str) else [next(fetched) for _ in video] for video in videos]
        num_frames, fps = self.media_fetcher.video_num_frames, self.media_fetcher.video_fps

        def process():
            frames = [decode_video(video, got, num_frames, fps) if isinstance(video, str) else decoded(video, got)
                      for video, got in zip(videos, media)]
            return self.mm_processor.process(ids, decoded(image_urls, images), frames)

        try:
            return (await asyncio.to_thread(process))[1]
        except ValueError as exc:
            raise APIError(400, f"{param}: {exc}", param=param) from None

    async def generate(self, req: GenerateRequest, arrival: float, request_id: str):
        if req.lora_path is not None and req.lora_path not in self.backend.lora_modules:
            loaded = ", ".join(self.backend.lora_modules) or "none"
            raise APIError(400, f"lora_path: unknown LoRA adapter '{req.lora_path}'; loaded: {loaded}",
                           param="lora_path")
        ids = self.encode(req.text, "text") if req.text is not None else self.token_ids(req.input_ids, "input_ids")
        images = [req.image_data] if isinstance(req.image_data, str) else req.image_data or []
        mm_inputs = await self.mm_inputs(ids, images, req.video_data or [], "image_data" if images else "video_data")
        if mm_inputs is not None:  # (the prompt with its images' tokens)
            ids = mm_inputs.unpadded_input_ids
        params = dict(req.sampling_params)
        if req.return_logprob:
            params.update(return_logprob=True, top_logprobs_num=req.top_logprobs_num,
                          logprob_start_len=req.logprob_start_len)
        params = self.checked_token_ids(validated(params, prefix="sampling_params."), "sampling_params.")
        params["max_new_tokens"] = self.max_new_tokens(len(ids), params["max_new_tokens"], "input")
        rid = req.rid or internal_rid(request_id)

        def native(event: Optional[ChoiceEvent]):
            return [] if event is None else [event.result]

        return await self._run([(ids, params)], 1, rid, arrival, native if req.stream else None,
                               lambda events: events[-1].result, req.priority, lora_path=req.lora_path,
                               request_id=request_id, own_rid=req.rid, mm_inputs=mm_inputs)
