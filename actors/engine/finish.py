"""When a request stops, and the text it has produced so far."""

from __future__ import annotations

from actors.engine.req import Req


def stream_text(req: Req, tokenizer) -> None:
    """Refresh ``req.output_text`` (nothing without a tokenizer)."""
    if tokenizer is not None:
        skip = req.sampling_params.skip_special_tokens
        req.output_text = tokenizer.decode(req.output_ids, skip_special_tokens=skip)


def check_finished(req: Req, tokenizer, context_len: int) -> None:
    """Stop token or EOS → "stop" (matched id); a stop string → "stop" (text cut
    before it); ``max_new_tokens`` or the context length → "length"."""
    params = req.sampling_params
    last = req.output_ids[-1]
    if last in params.stop_token_ids or (not params.ignore_eos and last in req.eos_token_ids):
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
