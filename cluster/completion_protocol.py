"""The bodies of POST /v1/completions (:class:`CompletionRequest`, OpenAI's: the sampling fields of
:class:`~cluster.openai_protocol.OpenAISampling` over a prompt or a batch of them) and of POST
/generate (:class:`GenerateRequest`, SGLang's native one: the engine's own sampling params)."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Union

from pydantic import BaseModel, Field, field_validator, model_validator

from cluster.openai_protocol import FORBID, OpenAISampling

MAX_PROMPTS = 64  # prompts in one /v1/completions batch
MAX_CHOICES = 128  # prompts × n: the sequences one HTTP request may start


def as_prompt_batch(prompt) -> list:
    """A /v1/completions ``prompt`` (an /v1/embeddings ``input``) as its batch: one string or token-id
    list per prompt."""
    return list(prompt) if isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)) else [prompt]


def check_prompt_batch(v, what: str = "prompt"):
    """``v``, a prompt or a batch of at most ``MAX_PROMPTS`` (``what``: the field's word for one),
    none of them empty and a list prompt all token ids."""
    batch = as_prompt_batch(v)
    if len(batch) > MAX_PROMPTS:
        raise ValueError(f"at most {MAX_PROMPTS} {what}s per request; got {len(batch)}")
    for i, one in enumerate(batch):
        if not one:
            raise ValueError(f"the {what} is empty" if len(batch) == 1 else f"{what} {i} is empty")
        if isinstance(one, list) and not all(isinstance(t, int) for t in one):
            raise ValueError(f"{what} {i}: a list {what} is token ids (ints)")
    return v


class CompletionRequest(OpenAISampling):
    """POST /v1/completions. ``prompt``: a string or a list of token ids, or a batch
    (a list of either) of at most ``MAX_PROMPTS``."""

    prompt: Union[str, List[int], List[str], List[List[int]]]
    max_tokens: Optional[int] = Field(16, ge=0, description="0 (with echo: vLLM's): the prompt only, scored with "
                                      "logprobs (lm-evaluation-harness's loglikelihood requests)")
    logprobs: Optional[int] = Field(None, ge=0, le=20, description="top alternatives per token (legacy format); "
                                    "with echo the prompt's tokens are scored too")
    echo: bool = False
    suffix: Optional[str] = None
    best_of: Optional[int] = None
    add_special_tokens: bool = Field(True, description="vLLM's: text prompts get the tokenizer's BOS (and the like)")

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, v):
        return check_prompt_batch(v)

    @property
    def prompts(self) -> List[Union[str, List[int]]]:
        """The batch: one string or token-id list per prompt. Its choices are numbered
        ``prompt × n + sample``, as in vLLM."""
        return as_prompt_batch(self.prompt)

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v):
        if v:
            raise ValueError("suffix is not supported")
        return v

    @model_validator(mode="after")
    def _best_of(self):
        if self.best_of not in (None, self.n):
            raise ValueError("best_of: only best_of == n is supported")
        return self

    @model_validator(mode="after")
    def _num_choices(self):
        if len(self.prompts) * self.n > MAX_CHOICES:
            raise ValueError(f"n: {len(self.prompts)} prompts × n = {self.n} asks for {len(self.prompts) * self.n} "
                             f"sequences; at most {MAX_CHOICES} per request")
        return self

    @model_validator(mode="after")
    def _no_tokens_without_echo(self):
        if self.max_tokens == 0 and not self.echo:  # (vLLM refuses it too: nothing would come back)
            raise ValueError("max_tokens: 0 returns nothing without echo; it must be at least 1")
        return self

    @property
    def top_logprobs_num(self) -> Optional[int]:
        return self.logprobs

    def to_sampling_params(self, max_new_tokens: int) -> Dict[str, Any]:
        """With echo and logprobs, the prompt's logprobs from its first token (SGLang's
        ``logprob_start_len`` 0, as vLLM's ``prompt_logprobs``)."""
        params = super().to_sampling_params(max_new_tokens)
        if self.echo and self.logprobs is not None:
            params["logprob_start_len"] = 0
        return params


class GenerateRequest(BaseModel):
    """POST /generate (SGLang native): ``text`` or ``input_ids``, engine sampling params."""

    model_config = FORBID

    text: Optional[str] = None
    input_ids: Optional[List[int]] = None
    sampling_params: Dict[str, Any] = Field(default_factory=dict)
    stream: bool = False
    rid: Optional[str] = None
    return_logprob: bool = False
    top_logprobs_num: int = Field(0, ge=0, le=20)
    logprob_start_len: int = Field(-1, ge=-1, description="SGLang's: with return_logprob, the prompt position "
                                   "from which its logprobs are returned (-1: none)")
    priority: int = Field(0, description="SGLang's: scheduling priority (needs enable_priority_scheduling unless 0)")
    lora_path: Optional[str] = Field(None, description="SGLang's: the name of a served LoRA adapter (None: the base "
                                     "model)")
    image_data: Union[None, str, List[str]] = Field(None, description="SGLang's: the prompt's images, one per image "
                                                    "pad token, as URLs (data, http(s), file:// under server.allowed_local_media_path: fetched by "
                                                    "the server) (a vision-language model's)")
    video_data: Optional[List[Union[str, List[str]]]] = Field(
        None, description="SGLang's: the prompt's videos, one per video pad token, each a video file's URL (decoded "
        "by the server: needs PyAV) or a list of its frames' image URLs (as image_data's)")

    @model_validator(mode="after")
    def _one_prompt(self):
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("text / input_ids: set exactly one")
        if self.input_ids is not None and not self.input_ids:
            raise ValueError("input_ids: the prompt is empty")
        return self
