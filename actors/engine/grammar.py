"""Structured outputs (constrained decoding) with xgrammar, SGLang's and vLLM's default backend.

A request names at most one grammar, in SGLang's sampling params: ``json_schema`` (a JSON
schema, or :data:`~actors.engine.sampling_params.ANY_JSON` for any JSON value), ``regex``,
``ebnf`` or ``structural_tag`` (xgrammar's structural tag: free text but for the structures its
triggers start; the older ``structures`` and ``triggers`` shape compiled as vLLM does, through
xgrammar's ``StructuralTagItem``s). :class:`GrammarBackend` compiles it for the model's
tokenizer and vocabulary when the request is made — on the caller's thread, never the engine
loop's (xgrammar compiles without the GIL), an asyncio caller's in a worker thread
(:func:`make_req_off_loop`) — with an LRU cache of compiled grammars keyed by ``(field, spec)``, held to a count and to
their bytes (xgrammar's ``memory_size_bytes``). A request is admitted
with its grammar ready, as in SGLang, whose scheduler parks a request in its grammar queue
until the compile is done; compiling before the request is queued also makes a spec that
does not compile a ValueError naming its field, as any other bad parameter (a 400), not an
abort after the fact.

The request holds its own ``GrammarMatcher`` (``req.grammar``; its stop tokens the model's
EOS ids). Where a row is sampled — a decode step, a prefill's last chunk; never a chunk
before it — :func:`apply_grammar_masks` fills its row of the batch's token bitmask (every
row in one call: :func:`fill_next_token_bitmask`) and sets every token the grammar does not
allow next to ``-inf``: after the bias, the min-tokens masks and the penalties, before the
temperature and the filters (SGLang's order), so greedy and sampled rows both draw from the
allowed tokens, and logprobs stay the raw model's. The token drawn advances the matcher
(:meth:`~actors.engine.req.Req.append_token`); once it accepted EOS at the grammar's end it
is terminated, and the request ends with ``stop`` (:func:`~actors.engine.finish.check_finished`),
with ``ignore_eos`` too: past its end the grammar allows nothing else.

A request with ``grammar_after`` (the chat endpoint's, for a reasoning model that thinks first:
the thinking end tag, ``</think>``) holds a :class:`ReasonerGrammar` instead, SGLang's reasoner
grammar: its thinking is free — no mask, no accepts — and the grammar constrains the answer, the
tokens after the one that completes the tag.

The matcher's state is always the one after ``output_ids`` (a reasoner grammar's: after the
answer's tokens in them): a retracted request keeps its output (it is recomputed, not redrawn),
so it keeps its matcher as it is. Only the scheduler that samples holds matchers: TP rank 0;
under PD, the prefill worker's masks the first token and the decode worker's accepts it from the
completion notice before its first decode step (both gated alike: the first token may be thinking).
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
from collections import OrderedDict
from typing import Any, Callable, Dict, Hashable, List, Optional, Sequence, Tuple

import torch
import xgrammar as xgr

from actors.engine.sampling_params import ANY_JSON, GRAMMAR_FIELDS, SamplingParams

GRAMMAR_CACHE_SIZE = 256  # compiled grammars kept, at most ...
GRAMMAR_CACHE_BYTES = 512 << 20  # ... and their bytes (a JSON schema's over a large vocabulary: a few MB each)
PARALLEL_FILL_ROWS = 128  # rows a bitmask fill takes on one thread, at most (fill_next_token_bitmask)
_WHAT = {"json_schema": "JSON schema", "regex": "regex", "ebnf": "EBNF grammar", "structural_tag": "structural tag"}
_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")  # xgrammar's C++ log prefix


def _compile(compiler: xgr.GrammarCompiler, field: str, spec: str, any_whitespace: bool) -> xgr.CompiledGrammar:
    if field == "json_schema":
        if spec == ANY_JSON:
            return compiler.compile_builtin_json_grammar()
        return compiler.compile_json_schema(spec, any_whitespace=any_whitespace)
    if field == "regex":
        return compiler.compile_regex(spec)
    if field == "structural_tag":
        tag = json.loads(spec)
        if "structures" in tag:
            items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
                     for s in tag["structures"]]
            return compiler.compile_structural_tag(items, tag["triggers"])
        return compiler.compile_structural_tag(spec)
    return compiler.compile_grammar(spec)


class GrammarBackend:
    """Grammars for one tokenizer and vocabulary (``vocab_size`` ids, the model's: the bitmask's
    width). ``tokenizer``: the HF tokenizer; None loads it from ``tokenizer_path`` at the first
    grammar (an engine without its tokenizer, ``skip_tokenizer_init``, still serves grammars).
    ``any_whitespace``: a JSON schema's output may hold whitespace between its tokens (xgrammar's
    and SGLang's default). Thread-safe: requests are made on their callers' threads."""

    def __init__(self, tokenizer: Any, tokenizer_path: str, vocab_size: int, any_whitespace: bool = True,
                 cache_size: int = GRAMMAR_CACHE_SIZE, cache_bytes: int = GRAMMAR_CACHE_BYTES):
        self.tokenizer, self.tokenizer_path, self.vocab_size = tokenizer, tokenizer_path, vocab_size
        self.any_whitespace, self.cache_size, self.cache_bytes = any_whitespace, cache_size, cache_bytes
        self.cached_bytes = 0
        self._compiler: Optional[xgr.GrammarCompiler] = None
        self._token_bytes: List[bytes] = []  # each id's text as the grammar reads it (the compiler's)
        self._cache: "OrderedDict[Tuple[str, str], xgr.CompiledGrammar]" = OrderedDict()
        self._lock = threading.Lock()

    def _get_compiler(self, field: str) -> xgr.GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                tokenizer = self.tokenizer
                if tokenizer is None:
                    from transformers import AutoTokenizer

                    try:
                        tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_path, local_files_only=True)
                    except (OSError, ValueError) as exc:
                        raise ValueError(f"{field}: structured output needs the model's tokenizer, which did not "
                                         f"load from {self.tokenizer_path}: {exc}") from None
                info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size)
                self._token_bytes = info.decoded_vocab  # (read once: xgrammar builds the list at each read)
                self._compiler = xgr.GrammarCompiler(info, cache_enabled=False)  # (the LRU below is the cache)
            return self._compiler

    def compile(self, field: str, spec: str) -> xgr.CompiledGrammar:
        """``spec`` compiled as ``field`` says (one of ``GRAMMAR_FIELDS``), from the cache when it
        is there; ValueError naming ``field`` when it does not compile."""
        key = (field, spec)
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                return compiled
        try:  # (unlocked: compiles of different grammars run side by side)
            compiled = _compile(self._get_compiler(field), field, spec, self.any_whitespace)
        except RuntimeError as exc:
            reason = _LOG_PREFIX.sub("", str(exc).strip().splitlines()[0])
            raise ValueError(f"{field}: the {_WHAT[field]} does not compile: {reason}") from None
        with self._lock:
            if key not in self._cache:  # (another thread may have compiled it meanwhile)
                self._cache[key] = compiled
                self.cached_bytes += compiled.memory_size_bytes
            # (the newest stays, however big: its requests hold it anyway)
            while len(self._cache) > 1 and (len(self._cache) > self.cache_size or self.cached_bytes > self.cache_bytes):
                self.cached_bytes -= self._cache.popitem(last=False)[1].memory_size_bytes
        return compiled

    def matcher(self, params: SamplingParams, eos_token_ids: Sequence[int]):
        """A new matcher of the request's grammar (None without one), ending on ``eos_token_ids``
        (none given: the stop tokens xgrammar finds in the tokenizer); held back until the output
        has written ``grammar_after`` (a :class:`ReasonerGrammar`) when the request names one."""
        grammar = params.grammar
        if grammar is None:
            return None
        matcher = xgr.GrammarMatcher(self.compile(*grammar), override_stop_tokens=list(eos_token_ids) or None)
        if params.grammar_after is None:
            return matcher
        return ReasonerGrammar(matcher, params.grammar_after.encode(), self._token_bytes)


class ReasonerGrammar:
    """A request's grammar held back while it thinks (SGLang's reasoner grammar object, vLLM's
    structured outputs with a reasoning parser): until the output's text holds ``end`` its tokens
    are free and its matcher takes none; from the token after the one that completes ``end`` on,
    the matcher masks and takes every token. The text is each token's bytes as xgrammar reads them
    (``decoded_vocab``: special tokens as written, whatever ``skip_special_tokens`` says), so a tag
    split over tokens (a byte-level tokenizer's) is found too; what the completing token holds past
    the tag is not the grammar's (SGLang's grammar also starts at the token after the tag's; a
    reasoning model's tag is a token of its own, which holds nothing more). Duck-types the matcher
    for :meth:`~actors.engine.req.Req.append_token` and the finish check; its mask's matcher is
    :attr:`active`."""

    def __init__(self, matcher: xgr.GrammarMatcher, end: bytes, token_bytes: Sequence[bytes]):
        self.matcher, self.end, self.token_bytes = matcher, end, token_bytes
        self.thinking: Optional[bytes] = b""  # the thinking's last bytes (a tag's start); None once it closed

    @property
    def active(self) -> Optional[xgr.GrammarMatcher]:
        """The matcher that masks the next token; None while the output thinks."""
        return self.matcher if self.thinking is None else None

    def accept_token(self, token: int) -> bool:
        if self.thinking is None:
            return self.matcher.accept_token(token)
        text = self.thinking + self.token_bytes[token]
        keep = len(self.end) - 1  # (enough to hold the tag's start, to be completed by the next tokens)
        self.thinking = None if self.end in text else text[max(len(text) - keep, 0):]
        return True

    def is_terminated(self) -> bool:
        return self.thinking is None and self.matcher.is_terminated()


def active_matcher(grammar) -> Optional[xgr.GrammarMatcher]:
    """The matcher whose mask a request's next token takes: its grammar's (``req.grammar``, a
    matcher or a :class:`ReasonerGrammar`), None while that is held back (or without one)."""
    return grammar.active if isinstance(grammar, ReasonerGrammar) else grammar


async def make_req_off_loop(make_req: Callable[..., Any], sampling_params: Optional[Dict[str, Any]], *args):
    """``make_req(sampling_params, *args)``: in a worker thread when ``sampling_params`` (as sent)
    name a grammar, whose compile (milliseconds; seconds for a big schema over a large vocabulary)
    must not hold up the caller's event loop and every stream it serves; on the loop otherwise."""
    if sampling_params and any(sampling_params.get(name) is not None for name in GRAMMAR_FIELDS):
        return await asyncio.to_thread(make_req, sampling_params, *args)
    return make_req(sampling_params, *args)


class MakingReqs:
    """Requests being made by :func:`make_req_off_loop` (their grammar compiling), not yet
    submitted, by key: an abort that comes meanwhile cannot reach them in the loop, so it marks
    them here, and their maker ends them when the make returns instead of submitting them.
    Thread-safe: an abort may come from any thread."""

    def __init__(self):
        self._aborted: Dict[Hashable, bool] = {}
        self._lock = threading.Lock()

    def begin(self, key: Hashable) -> None:
        with self._lock:
            self._aborted[key] = False

    def mark(self, match: Callable[[Hashable], bool]) -> bool:
        """Mark aborted every request being made whose key ``match`` takes; whether there was one."""
        with self._lock:
            keys = [key for key in self._aborted if match(key)]
            for key in keys:
                self._aborted[key] = True
        return bool(keys)

    def end(self, key: Hashable) -> bool:
        """``key``'s make returned (or failed): whether it was aborted meanwhile."""
        with self._lock:
            return self._aborted.pop(key, False)


def fill_next_token_bitmask(matchers: Sequence[Optional[xgr.GrammarMatcher]], vocab_size: int) -> torch.Tensor:
    """The token bitmask ``[len(matchers), ceil(vocab_size / 32)]`` whose row ``i`` holds what
    ``matchers[i]`` allows next (None: no grammar, every token allowed), every row filled in one
    call of xgrammar's ``BatchGrammarMatcher`` (C++, without the GIL; one Python call for the batch,
    not one a row). One thread up to :data:`PARALLEL_FILL_ROWS` rows: xgrammar starts its threads
    at every call (tens of microseconds each), more than a small batch's fill takes; above it,
    half the cores (xgrammar's ``auto``; vLLM fills in parallel past 128 rows too). Filled after
    the forward, on the engine thread: on a worker thread while the forward runs (SGLang's
    overlap), the hand-off and the GIL it contends for cost more than the fill saved on a CPU
    (docs/benchmarks.md)."""
    bitmask = xgr.allocate_token_bitmask(len(matchers), vocab_size)
    rows = [i for i, matcher in enumerate(matchers) if matcher is not None]
    if rows:
        threads = 1 if len(rows) <= PARALLEL_FILL_ROWS else "auto"
        xgr.BatchGrammarMatcher(max_threads=threads).batch_fill_next_token_bitmask(
            [matchers[i] for i in rows], bitmask, rows)
    return bitmask


def apply_grammar_masks(logits: torch.Tensor, matchers: Sequence[Optional[xgr.GrammarMatcher]]) -> None:
    """Set to ``-inf``, in place, the logits ``[bs, vocab]`` of every token row ``i``'s matcher
    (``matchers[i]``; None: no grammar, left alone) does not allow next."""
    rows = [i for i, matcher in enumerate(matchers) if matcher is not None]
    if not rows:
        return
    bitmask = fill_next_token_bitmask(matchers, logits.shape[-1])
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True), indices=rows)
