"""When a request stops, and the text it has produced so far."""

from __future__ import annotations

from typing import Optional, Sequence

from actors.engine.req import Req

# prompt tokens decoded ahead of the output (SGLang's INIT_INCREMENTAL_DETOKENIZATION_OFFSET): a
# SentencePiece-style decoder drops the leading space of the first token it sees, which the
# output's first token must keep when it follows the prompt
DETOKENIZE_CONTEXT = 5


def decode_after(tokenizer, prompt_ids: Sequence[int], ids: Sequence[int], skip_special_tokens: bool) -> str:
    """The text of output ``ids`` as it reads after the prompt: ``decode(tail + ids) - decode(tail)``
    for the prompt's last few tokens (``ids`` decoded on their own where the tail's text is not a
    prefix of that, e.g. a split UTF-8 character)."""
    context = list(prompt_ids[-DETOKENIZE_CONTEXT:])
    if context and ids:
        head = tokenizer.decode(context, skip_special_tokens=skip_special_tokens)
        full = tokenizer.decode(context + list(ids), skip_special_tokens=skip_special_tokens)
        if full.startswith(head) and not head.endswith("\ufffd"):
            return full[len(head):]
    return tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)


def output_text(req: Req, tokenizer, num_tokens: Optional[int] = None) -> str:
    """The text of the first ``num_tokens`` output tokens (all by default), after the prompt."""
    ids = req.output_ids if num_tokens is None else req.output_ids[:num_tokens]
    return decode_after(tokenizer, req.origin_input_ids, ids, req.sampling_params.skip_special_tokens)


def stream_text(req: Req, tokenizer) -> None:
    """Refresh ``req.output_text`` (nothing without a tokenizer)."""
    if tokenizer is not None:
        req.output_text = output_text(req, tokenizer)


def check_finished(req: Req, tokenizer, context_len: int) -> None:
    """Stop token or EOS → "stop" (matched id; kept in ``output_ids``, not in the text, as SGLang
    and vLLM trim it); a stop string → "stop" (text cut before it); ``max_new_tokens`` or the
    context length → "length"."""
    params = req.sampling_params
    last = req.output_ids[-1]
    if last in params.stop_token_ids or (not params.ignore_eos and last in req.eos_token_ids):
        if tokenizer is not None:
            req.output_text = output_text(req, tokenizer, len(req.output_ids) - 1)
        req.finish({"type": "stop", "matched": last})
        return
    if params.stop and tokenizer is not None:
        hits = [(req.output_text.find(s), s) for s in params.stop if s in req.output_text]
        if hits:
            pos, matched = min(hits)
            req.output_text = req.output_text[:pos]
            req.finish({"type": "stop", "matched": matched})
            return
    if len(req.output_ids) >= params.max_new_tokens or req.seqlen >= context_len:
        req.finish({"type": "length", "length": len(req.output_ids)})
