"""Per-request sampling parameters (SGLang's names), validated at the edge."""

from __future__ import annotations

import json
import math
import re
from typing import Dict, List, Optional, Sequence, Tuple, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from actors.engine.pooling import PoolingParams

SAMPLING_EPS = 1e-6  # a temperature below this is greedy (SGLang's): dividing by it overflows the logits
TOP_K_DISABLED = -1  # top_k of every token (the API's 0, as vLLM reads it, becomes this)
MAX_LOGIT_BIAS = 100.0  # a logit_bias value is in [-100, 100] (OpenAI's range)
# structured output: at most one per request (SGLang's names)
GRAMMAR_FIELDS = ("json_schema", "regex", "ebnf", "structural_tag")
ANY_JSON = "$$ANY$$"  # SGLang's json_schema for any JSON value (xgrammar's built-in JSON grammar): OpenAI's json_object


def check_top_k(top_k: int) -> int:
    """``top_k`` as the engine takes it: >= 1, or :data:`TOP_K_DISABLED`. -1 and 0 both disable
    it (all tokens), as in vLLM; any other value below 1 is an error."""
    if top_k == 0:
        return TOP_K_DISABLED
    if top_k < -1:
        raise ValueError(f"must be >= 1, or -1 or 0 to disable top-k (all tokens), not {top_k}")
    return top_k


def check_structural_tag(tag) -> None:
    """A structural tag's shape, as vLLM takes it (ValueError otherwise; what it says is checked
    where it compiles): xgrammar's ``{"type": "structural_tag", "format": {...}}``, or the older
    ``{"structures": [{"begin", "schema", "end"}], "triggers": [...]}``: outside the structures
    the output is free; from a trigger on, one of the structures whose ``begin`` starts with it is
    written, its content JSON its ``schema`` accepts, then its ``end``."""
    if not isinstance(tag, dict):
        raise ValueError(f"a structural tag is an object, not {type(tag).__name__}")
    if "structures" not in tag:
        if tag.get("type") != "structural_tag" or "format" not in tag:
            raise ValueError('a structural tag is {"type": "structural_tag", "format": ...} or has '
                             '"structures" and "triggers"')
        return
    structures, triggers = tag["structures"], tag.get("triggers")
    if not (isinstance(triggers, list) and all(isinstance(t, str) for t in triggers)):
        raise ValueError("triggers: a list of the texts that start a structure")
    if not isinstance(structures, list):
        raise ValueError("structures: a list of {begin, schema, end}")
    for i, item in enumerate(structures):
        if not (isinstance(item, dict) and isinstance(item.get("begin"), str) and isinstance(item.get("end"), str)
                and isinstance(item.get("schema"), (dict, bool))):
            raise ValueError(f"structures[{i}]: needs begin and end (texts) and schema (a JSON schema)")


def _token_id(token) -> int:
    """A ``logit_bias`` key as a token id: an int, or a string of one (not a float, not a bool)."""
    if isinstance(token, int) and not isinstance(token, bool):
        return token
    if isinstance(token, str) and re.fullmatch(r"\s*[+-]?[0-9]+\s*", token):
        return int(token)
    raise ValueError(f"token id {token!r} is not an integer")


class SamplingParams(BaseModel):
    """A bad value fails naming the field; unknown fields are rejected."""

    model_config = ConfigDict(extra="forbid")

    max_new_tokens: int = Field(128, ge=0, description="tokens to generate at most")
    min_new_tokens: int = Field(0, ge=0, description="tokens to generate at least (vLLM's min_tokens): until "
                                "then EOS and stop_token_ids are masked and no stop string ends the output")
    temperature: float = Field(1.0, ge=0.0, description="0 means greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(TOP_K_DISABLED, description="-1 disables top-k (0 is taken as -1)")
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    seed: Optional[int] = Field(None, ge=-2 ** 63, le=2 ** 64 - 1, description="per-request seed, what a torch "
                                "generator takes (the API's int64 seed plus a choice's index fits): same seed, same samples")
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=2.0)
    stop: List[str] = Field(default_factory=list, description="stop strings (not included in the text)")
    stop_token_ids: List[int] = Field(default_factory=list)
    include_stop_str_in_output: bool = Field(False, description="vLLM's: the stop string or stop token that ended "
                                             "the output stays in its text")
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    return_logprob: bool = False
    top_logprobs_num: int = Field(0, ge=0, le=20, description="the most likely tokens' logprobs returned at each "
                                  "output position (and prompt position, with logprob_start_len)")
    logprob_start_len: int = Field(-1, ge=-1, description="with return_logprob: the prompt position from which "
                                   "input (prompt) logprobs are returned (-1: none; position 0 has none, it has no "
                                   "context); the prefix cache is not reused past it, those positions are computed")
    logit_bias: Optional[Dict[int, float]] = Field(None, description="{token id: bias in [-100, 100]} added to "
                                                   "the logits before sampling (ids are checked against the "
                                                   "vocabulary where the request is admitted)")
    allowed_token_ids: Optional[List[int]] = Field(None, min_length=1, description="vLLM's: only these ids may be "
                                                   "sampled, every other one masked (ids are checked against the "
                                                   "vocabulary where the request is admitted)")
    bad_words: List[str] = Field(default_factory=list, description="vLLM's: words never generated, each tokenized "
                                 "with and without a leading space (bad_words_token_ids): a one-token word is "
                                 "never sampled, a longer one's last token not after the output's others")
    json_schema: Optional[str] = Field(None, description="structured output: the output is JSON this schema "
                                       f"accepts ({ANY_JSON!r}: any JSON value)")
    regex: Optional[str] = Field(None, description="structured output: the whole output matches this regex")
    ebnf: Optional[str] = Field(None, description="structured output: the output is a sentence of this EBNF "
                                "(GBNF) grammar, from its root rule")
    structural_tag: Optional[str] = Field(None, description="structured output: the output is free but for "
                                          "the structures its triggers start (JSON, check_structural_tag)")
    grammar_after: Optional[str] = Field(None, min_length=1, description="with a grammar: it constrains only "
                                         "the output after the first occurrence of this text (a reasoning model's "
                                         "thinking end tag, which the chat endpoint sets: the thinking is free)")
    pooling: Optional[PoolingParams] = Field(None, description="an embedding request (actors.engine.pooling): "
                                             "the prompt's last-token hidden state is returned (or a score from two "
                                             "tokens' logits there); max_new_tokens 0")

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int) -> int:
        return check_top_k(v)

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, v: Union[None, str, List[str]]) -> List[str]:
        if v is None:
            return []
        stops = [v] if isinstance(v, str) else list(v)
        if any(isinstance(s, str) and not s for s in stops):  # every text contains "": it would end at once
            raise ValueError("stop strings must not be empty")
        return stops

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _logit_bias_ids(cls, v):
        """Token ids as ints: JSON's keys are strings ("42"), as OpenAI's ``logit_bias`` sends them."""
        if not isinstance(v, dict):
            return v
        return {_token_id(token): bias for token, bias in v.items()}

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v: Optional[Dict[int, float]]) -> Optional[Dict[int, float]]:
        for token, bias in (v or {}).items():
            if token < 0:
                raise ValueError(f"token id {token} is negative")
            if not (math.isfinite(bias) and abs(bias) <= MAX_LOGIT_BIAS):
                raise ValueError(f"the bias of token {token} is {bias}: it must be in [-100, 100]")
        return v or None

    @field_validator("allowed_token_ids")
    @classmethod
    def _allowed_token_ids(cls, v: Optional[List[int]]) -> Optional[List[int]]:
        bad = next((t for t in v or () if t < 0), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is negative")
        return v

    @field_validator("bad_words")
    @classmethod
    def _bad_words(cls, v: List[str]) -> List[str]:
        if any(not word.strip() for word in v):  # (no token to ban: vLLM fails on it)
            raise ValueError("bad words must not be empty or blank")
        return v

    @field_validator("json_schema")
    @classmethod
    def _json_schema(cls, v: Optional[str]) -> Optional[str]:
        """A schema that is not even JSON fails here, at the edge; what xgrammar cannot compile fails
        where the request is made (:mod:`actors.engine.grammar`)."""
        if v is None or v == ANY_JSON:
            return v
        try:
            schema = json.loads(v)
        except ValueError as exc:
            raise ValueError(f"not valid JSON: {exc}") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError(f"a JSON schema is an object or a boolean, not {type(schema).__name__}")
        return v

    @field_validator("structural_tag")
    @classmethod
    def _structural_tag(cls, v: Optional[str]) -> Optional[str]:
        if v is not None:
            try:
                tag = json.loads(v)
            except ValueError as exc:
                raise ValueError(f"not valid JSON: {exc}") from None
            check_structural_tag(tag)
        return v

    @model_validator(mode="after")
    def _one_grammar(self):
        """The grammar decides where the output ends: its end forces EOS, so ``min_new_tokens``
        (which masks EOS) could leave no token to draw; the two are refused together. A
        ``grammar_after`` without a grammar is refused too: it would hold nothing back."""
        named = [name for name in GRAMMAR_FIELDS if getattr(self, name) is not None]
        if len(named) > 1:
            raise ValueError(f"{named[1]}: structured output takes one of {', '.join(GRAMMAR_FIELDS)}; "
                             f"got {' and '.join(named)}")
        if self.grammar_after is not None and not named:
            raise ValueError(f"grammar_after: needs a grammar ({', '.join(GRAMMAR_FIELDS)}) to hold back")
        if named and self.min_new_tokens:
            raise ValueError(f"min_new_tokens: not supported with a grammar ({named[0]}), whose end ends the output")
        return self

    @model_validator(mode="after")
    def _pooling(self):
        if self.pooling is not None and self.max_new_tokens:
            raise ValueError(f"max_new_tokens: an embedding request (pooling) generates nothing; got "
                             f"{self.max_new_tokens}, not 0")
        return self

    @model_validator(mode="after")
    def _min_new_tokens(self):
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError(f"min_new_tokens: {self.min_new_tokens} is more than max_new_tokens "
                             f"({self.max_new_tokens})")
        return self

    @property
    def is_greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS or self.top_k == 1

    @property
    def grammar(self) -> Optional[Tuple[str, str]]:
        """``(field, spec)`` of the request's grammar (:data:`GRAMMAR_FIELDS`); None without one."""
        return next(((name, getattr(self, name)) for name in GRAMMAR_FIELDS if getattr(self, name) is not None), None)

    @property
    def has_penalties(self) -> bool:
        return self.frequency_penalty != 0.0 or self.presence_penalty != 0.0 or self.repetition_penalty != 1.0

    def masked_token_ids(self, num_generated: int, eos_token_ids: Sequence[int]) -> List[int]:
        """The ids the next token may not be: EOS and ``stop_token_ids`` while fewer than
        ``min_new_tokens`` are generated (``num_generated``), as vLLM's and SGLang's min-tokens
        masks (EOS even with ``ignore_eos``); none after."""
        if num_generated >= self.min_new_tokens:
            return []
        return sorted(set(eos_token_ids) | set(self.stop_token_ids))


def bad_words_token_ids(bad_words: Sequence[str], tokenizer) -> List[List[int]]:
    """The token ids of ``bad_words`` as vLLM's ``SamplingParams.update_from_tokenizer`` makes them:
    each word (leading whitespace stripped) tokenized without special tokens, then with a leading
    space — kept too when that gives as many tokens and another first token (the word in the middle
    of a text: a tokenizer that merges the space into the word's first token)."""
    token_ids: List[List[int]] = []
    for word in bad_words:
        word = word.lstrip()
        alone = tokenizer.encode(word, add_special_tokens=False)
        if not alone:  # (nothing to ban: vLLM fails on it)
            raise ValueError(f"bad_words: {word!r} has no tokens")
        token_ids.append(alone)
        spaced = tokenizer.encode(" " + word, add_special_tokens=False)
        if len(spaced) == len(alone) and spaced[0] != alone[0]:
            token_ids.append(spaced)
    return token_ids


def bad_word_bans(bad_words_ids: Sequence[Sequence[int]], output_ids: Sequence[int]) -> List[int]:
    """The ids the next token may not be after ``output_ids`` (vLLM's ``apply_bad_words``): each
    one-token word's token, and each longer word's last token when the output ends with the
    word's other tokens (in the output: a prompt's tokens never start a bad word)."""
    banned = []
    for word in bad_words_ids:
        prefix = len(word) - 1
        if prefix <= len(output_ids) and list(output_ids[len(output_ids) - prefix:]) == list(word[:-1]):
            banned.append(word[-1])
    return banned
