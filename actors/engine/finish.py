"""When a request stops, and the text it has produced so far."""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

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


class IncrementalText:
    """A request's output text (:func:`decode_after` of its output), decoded a few tokens per step
    (SGLang's surr / read offsets), never the whole output: ``[surr, read)`` are the tokens before
    the last confirmed text (context for the next ones), ``[read, end)`` the new ones. Confirmed
    text never changes; new tokens that end in half a UTF-8 character stay pending."""

    def __init__(self, tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool):
        self.skip = skip_special_tokens
        context = list(prompt_ids[-DETOKENIZE_CONTEXT:])
        if context and tokenizer.decode(context, skip_special_tokens=self.skip).endswith("\ufffd"):
            context = []  # the prompt ends inside a character: the output is decoded on its own
        self.context = context
        self.surr, self.read = 0, len(context)  # positions in context + output
        self.text = ""  # confirmed

    def _ids(self, output_ids: List[int], start: int, end: int) -> List[int]:
        c = len(self.context)
        return self.context[start:end] + output_ids[max(start - c, 0):max(end - c, 0)]

    def update(self, tokenizer, output_ids: List[int], num_tokens: int) -> str:
        """The text of ``output_ids[:num_tokens]`` (``num_tokens`` never below the last call's)."""
        end = len(self.context) + num_tokens
        surr_text = tokenizer.decode(self._ids(output_ids, self.surr, self.read), skip_special_tokens=self.skip)
        new_text = tokenizer.decode(self._ids(output_ids, self.surr, end), skip_special_tokens=self.skip)
        pending = new_text[len(surr_text):]
        if pending and not new_text.endswith("\ufffd"):
            self.text += pending
            self.surr, self.read = self.read, end
            return self.text
        return self.text + pending


def _ends_on_stop_token(req: Req) -> bool:
    """The last token is a stop token, EOS (unless ``ignore_eos``), or the EOS that ended the
    request's grammar (``ignore_eos`` or not: past its end the grammar allows nothing)."""
    last, params = req.output_ids[-1], req.sampling_params
    if req.grammar is not None and req.grammar.is_terminated():
        return True
    return last in params.stop_token_ids or (not params.ignore_eos and last in req.eos_token_ids)


def stream_text(req: Req, tokenizer) -> None:
    """Refresh ``req.output_text`` (nothing without a tokenizer): the output after the prompt, a
    last token that stops the request left out (SGLang and vLLM trim it from the text; vLLM's
    ``include_stop_str_in_output`` keeps it)."""
    if tokenizer is None or not req.output_ids:
        return
    if req.detokenizer is None:
        req.detokenizer = IncrementalText(tokenizer, req.origin_input_ids_unpadded,
                                          req.sampling_params.skip_special_tokens)
    trim = _ends_on_stop_token(req) and not req.sampling_params.include_stop_str_in_output
    num_tokens = len(req.output_ids) - (1 if trim else 0)
    req.output_text = req.detokenizer.update(tokenizer, req.output_ids, num_tokens)
    if len(req.output_ids) <= req.sampling_params.min_new_tokens:
        req.min_tokens_text_len = len(req.output_text)


def _first_stop_string(req: Req) -> Optional[Tuple[int, str]]:
    """``(position, stop string)`` of the first stop string in the output text that ends past the
    text of its first ``min_new_tokens`` tokens (vLLM: a stop string is looked for only in the
    text of later tokens, or one that begins before and ends there); None if there is none."""
    hits = []
    for stop in req.sampling_params.stop:
        pos = req.output_text.find(stop, max(req.min_tokens_text_len - len(stop) + 1, 0))
        if pos >= 0:
            hits.append((pos, stop))
    return min(hits) if hits else None


def check_finished(req: Req, tokenizer, context_len: int) -> None:
    """Stop token or EOS (or the grammar's end) → "stop" (matched id; kept in ``output_ids``, not
    in the text, as SGLang and vLLM trim it); a stop string → "stop" (text cut before it, or after
    it with ``include_stop_str_in_output``), none before ``min_new_tokens``
    tokens (the sampler masks EOS and stop tokens until then); ``max_new_tokens`` or the context
    length → "length". A request finished already (its grammar rejected the token) stays so."""
    if req.finished:
        return
    params = req.sampling_params
    if _ends_on_stop_token(req):  # (stream_text left it out of the text)
        req.finish({"type": "stop", "matched": req.output_ids[-1]})
        return
    if params.stop and tokenizer is not None:
        hit = _first_stop_string(req)
        if hit is not None:
            pos, matched = hit
            req.output_text = req.output_text[:pos + (len(matched) if params.include_stop_str_in_output else 0)]
            req.finish({"type": "stop", "matched": matched})
            return
    if len(req.output_ids) >= params.max_new_tokens or req.seqlen >= context_len:
        req.finish({"type": "length", "length": len(req.output_ids)})
