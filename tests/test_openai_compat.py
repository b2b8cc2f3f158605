"""What a vLLM / SGLang user's client sends and expects, against the HTTP app over an
in-process engine (the tiny llama, no Ray): explicit nulls, seeded choices, top
logprobs, echo with logprobs (the prompt scored), vLLM's prompt_logprobs, /tokenize and
/detokenize, vLLM's chat-template fields, logit_bias and
min_tokens, OpenAI fields the server does not implement, the ``developer`` role
and template errors, ``GET /v1/models/{id}``, a request that names no model, and
a prompt token outside the vocabulary; a reasoning parser's ``reasoning_content``."""

import asyncio
import json
import re
import threading
import time
from contextlib import contextmanager

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from actors.engine import Engine
from actors.engine.memory_occupation import parse_tags
from actors.engine.tiny import build_tiny_checkpoint
from cluster.config import ServerConfig
from cluster.http_server import BackgroundServer
from cluster.server import build_app
from tests.backend_stubs import StubBackend
from tests.forced_output import forced_tokens

MODEL = "tiny"
# a template as strict as many real ones: an unknown role raises; a chat_template_kwargs flag reaches it
STRICT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unexpected role ' + message['role']) }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and not enable_thinking %}{{ '<think></think>' }}{% endif %}{% endif %}"
)


class EngineBackend(StubBackend):
    """The ServingBackend contract over one in-process Engine (what the PD cluster yields, minus Ray)."""

    model_name = MODEL

    def __init__(self, engine: Engine, context_len: int):
        self.engine, self.context_len, self.max_prompt_len = engine, context_len, context_len - 1
        self.lora_modules = dict(engine.config.lora_paths or {})
        self.priority_scheduling = engine.config.enable_priority_scheduling
        self.model_path = engine.config.model_path
        self.limit_mm_per_prompt = engine.config.limit_mm_per_prompt

    async def pause_generation(self, mode):
        self.engine.pause_generation(mode)

    async def continue_generation(self):
        self.engine.continue_generation()

    async def flush_cache(self):
        self.engine.flush_cache()

    async def load_lora_adapter(self, lora_name, lora_path):
        await asyncio.to_thread(self.engine.load_lora_adapter, lora_name, lora_path)
        self.lora_modules[lora_name] = lora_path

    async def unload_lora_adapter(self, lora_name):
        del self.lora_modules[lora_name]
        await asyncio.to_thread(self.engine.unload_lora_adapter, lora_name)

    async def update_weights_from_disk(self, model_path, weight_version=None, abort_all_requests=False,
                                       flush_cache=True, torch_empty_cache=False):
        result = await asyncio.to_thread(self.engine.update_weights_from_disk, model_path, weight_version,
                                         abort_all_requests, flush_cache, torch_empty_cache)
        self.weight_version = self.engine.get_weight_version()
        return result._asdict()

    @property
    def is_sleeping(self):
        return self.engine.is_sleeping()

    async def release_memory_occupation(self, tags=None, keep_weights=False):
        await asyncio.to_thread(self.engine.memory.release, parse_tags(tags), keep_weights)

    async def resume_memory_occupation(self, tags=None):
        await asyncio.to_thread(self.engine.resume_memory_occupation, tags)

    async def generate_stream(self, input_ids, sampling_params, rid, priority=0, lora_path=None, mm_inputs=None):
        finished = False
        try:
            async for result in await self.engine.async_generate(input_ids=input_ids, sampling_params=sampling_params,
                                                                 rid=rid, stream=True, priority=priority,
                                                                 lora_path=lora_path, image_data=mm_inputs):
                finished = result["meta_info"]["finish_reason"] is not None
                yield result
        finally:
            if not finished:  # closed early (a client gone, an abort): stopped on the engine, as the PD client does
                self.engine.abort(rid)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = build_tiny_checkpoint("llama", tmp_path_factory.mktemp("tiny-llama"), seed=0)
    engine = Engine(model_path=str(path), page_size=4, max_total_tokens=2048, attention_backend="torch",
                    context_length=256)
    yield engine
    engine.shutdown()


@contextmanager
def serving(engine, config: ServerConfig, backend_cls=EngineBackend):
    tokenizer = AutoTokenizer.from_pretrained(engine.config.model_path, local_files_only=True)
    tokenizer.chat_template = STRICT_TEMPLATE
    with BackgroundServer(build_app(backend_cls(engine, 256), tokenizer, config), "127.0.0.1", 0) as server:
        yield server


@pytest.fixture(scope="module")
def served(engine):
    with serving(engine, ServerConfig()) as server:
        yield server


def openai_client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def client(served):
    return openai_client(served)


def post(served, path, body):
    return httpx.post(served.url + path, json=body, timeout=60)


def chat_body(**fields):
    return dict({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                 "temperature": 0}, **fields)


def bad_request(call) -> dict:
    with pytest.raises(openai.BadRequestError) as info:
        call()
    return info.value.body


def test_explicit_nulls_mean_unset(served):
    """OpenAI marks its optional parameters nullable and vLLM accepts ``null`` as "the default"."""
    nulls = {"n": None, "top_p": None, "presence_penalty": None, "frequency_penalty": None, "stream": None,
             "seed": None, "stop": None, "user": None}
    want = post(served, "/v1/chat/completions", chat_body()).json()["choices"][0]["message"]["content"]
    r = post(served, "/v1/chat/completions", chat_body(logprobs=None, top_logprobs=None, **nulls))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == want
    r = post(served, "/v1/completions", dict({"model": MODEL, "prompt": "hi", "max_tokens": 3, "echo": None,
                                              "logprobs": None, "best_of": None, "suffix": None,
                                              "temperature": None}, **nulls))
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3
    r = post(served, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2, "stream": True,
                                         "stream_options": {"include_usage": None}})
    assert r.status_code == 200, r.text
    assert all("usage" not in e for e in sse_events(r))  # null: the default (no usage)


def sse_events(response) -> list:
    return [json.loads(line[len("data: "):]) for line in response.text.splitlines() if line.startswith("data: {")]


def test_with_include_usage_every_chunk_but_the_last_has_usage_null(served):
    """OpenAI's stream_options.include_usage: each chunk carries ``"usage": null``, the echo's
    opening one too, and a last chunk with no choices carries the usage."""
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 3, "stream": True, "echo": True, "temperature": 0,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    events = sse_events(post(served, "/v1/completions", body))
    assert events[0]["choices"][0]["text"] == "hi"  # the echo opens the stream
    assert all("usage" in e and e["usage"] is None for e in events[:-1]), events
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 3


def test_seeded_choices_differ_from_each_other_and_repeat(client):
    """vLLM seeds choice i with ``seed + i``: n seeded choices are n samples, and the request repeats.
    A choice is told apart by its logprobs (the tiny model's texts are mostly U+FFFD), equal up to
    the float noise of another batch composition."""
    def samples(n):
        out = client.completions.create(model=MODEL, prompt="seeded", max_tokens=8, temperature=1.0, seed=11, n=n,
                                        logprobs=0, extra_body={"ignore_eos": True})
        return [(c.text, c.logprobs.token_logprobs) for c in out.choices]

    def same(a, b):
        return a[0] == b[0] and a[1] == pytest.approx(b[1], abs=1e-3)

    first = samples(3)
    assert not any(same(first[i], first[j]) for i, j in ((0, 1), (0, 2), (1, 2))), first
    assert all(same(a, b) for a, b in zip(samples(3), first))
    assert same(samples(1)[0], first[0])  # choice 0 is the n == 1 request


def test_greedy_tokens_hold_the_best_of_their_top_logprobs(client):
    """Tokens whose texts collide (byte pieces decode to U+FFFD) keep their best value, so a greedy
    token's logprob is the max of its position's top_logprobs."""
    out = client.completions.create(model=MODEL, prompt="The cat", max_tokens=24, temperature=0, logprobs=5,
                                    extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == 24
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert top[token] == pytest.approx(value) and max(top.values()) == pytest.approx(value), (token, top)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "The cat"}],
                                          max_tokens=8, temperature=0, logprobs=True, top_logprobs=5)
    for entry in chat.choices[0].logprobs.content:
        assert max(t.logprob for t in entry.top_logprobs) == pytest.approx(entry.logprob)


def test_completion_top_logprobs_always_hold_the_sampled_token(served):
    """OpenAI's legacy logprobs: up to ``logprobs + 1`` entries a position, the sampled token always
    among them, so ``logprobs: 0`` gives ``{token: logprob}`` (not null, which the openai client's
    ``Logprobs`` type refuses) and a sampled token outside the top N is still listed."""
    from openai.types import Completion

    for num in (0, 1):
        r = post(served, "/v1/completions", {"prompt": "The cat", "max_tokens": 6, "temperature": 1.0, "seed": 3,
                                             "logprobs": num, "ignore_eos": True})
        lp = Completion.model_validate(r.json()).choices[0].logprobs
        assert len(lp.top_logprobs) == 6
        for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
            assert token in top and top[token] >= value and len(top) <= num + 1, (num, token, value, top)
            if num == 0:
                assert top == {token: value}


def test_echo_with_logprobs_scores_the_prompt_as_lm_eval_asks(engine, client, served):
    """lm-evaluation-harness's loglikelihood request (``local-completions``): echo, logprobs and
    ``max_tokens`` 0 (or 1) — the choice's legacy logprobs cover the prompt's tokens (the first
    one's None) then the output's, with the engine's input logprobs, text offsets running over
    the echoed text; without echo, ``max_tokens`` 0 is refused (vLLM's)."""
    prompt = "The cat sat on the"
    ids = engine.tokenizer.encode(prompt)
    ref = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 2, "temperature": 0, "return_logprob": True,
                                                          "logprob_start_len": 0, "top_logprobs_num": 1})["meta_info"]
    texts = [engine.tokenizer.decode([t]) for t in ids]
    for max_tokens in (0, 2):
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, echo=True, logprobs=1,
                                        temperature=0, extra_body={"ignore_eos": True})
        choice, lp = out.choices[0], out.choices[0].logprobs
        assert choice.finish_reason == "length" and out.usage.completion_tokens == max_tokens
        assert choice.text.startswith(prompt) and len(lp.tokens) == len(ids) + max_tokens
        assert lp.tokens[:len(ids)] == texts and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        want = [v for v, _ in ref["input_token_logprobs"][1:]] + [v for v, _ in ref["output_token_logprobs"]]
        assert lp.token_logprobs[1:] == pytest.approx(want[:len(ids) - 1 + max_tokens], abs=1e-5)
        assert all(token in top and len(top) <= 2 for token, top in zip(lp.tokens[1:], lp.top_logprobs[1:]))
        offsets = [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
        assert lp.text_offset == offsets
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=1,
                                            stream=True))
    assert chunks[0].choices[0].text == prompt and chunks[0].choices[0].logprobs.tokens == texts
    assert chunks[-1].choices[0].finish_reason == "length"
    body = bad_request(lambda: client.completions.create(model=MODEL, prompt="abc", max_tokens=0))
    assert body["param"] == "max_tokens" and "echo" in body["message"]
    engine.check_integrity()


def assert_vllm_prompt_logprobs(entries, meta, k, tokenizer):
    """vLLM's ``prompt_logprobs`` against the engine's input logprobs (``meta``: scored from position 0,
    with at least ``k`` alternatives): None first, then at each position the prompt's token with the
    engine's logprob and rank, and the ``k`` most likely ranked 1..k (the prompt's token among them
    when its rank is at most k), each with its text."""
    pairs, ranks, tops = meta["input_token_logprobs"], meta["input_token_ranks"], meta["input_top_logprobs"]
    assert len(entries) == len(pairs) and entries[0] is None
    for entry, (logprob, token), rank, top in zip(entries[1:], pairs[1:], ranks[1:], tops[1:]):
        assert entry[str(token)]["logprob"] == pytest.approx(logprob, abs=1e-5) and entry[str(token)]["rank"] == rank
        best = sorted((e["rank"], e["logprob"]) for t, e in entry.items() if t != str(token) or rank <= k)
        assert [r for r, _ in best] == list(range(1, k + 1)) and len(entry) == k + (rank > k)
        assert [v for _, v in best] == pytest.approx([v for _, v in top[:k]], abs=1e-5)
        assert all(e["decoded_token"] == tokenizer.decode([int(t)]) for t, e in entry.items())


def test_prompt_logprobs_as_vllm_gives_them(engine, client, served):
    """vLLM's ``prompt_logprobs`` (the openai client's ``extra_body``): on each choice of a completion
    (n of them, with echo and ``max_tokens`` 0 too, the legacy logprobs keeping their own count), on a
    chat response itself, over the very prompt /tokenize gives; output logprobs only when asked. The
    prompt ends with the model's greedy tokens: ranked 1, among the best as well."""
    greedy = {"temperature": 0, "ignore_eos": True}
    ids = engine.tokenizer.encode("The cat sat on the")
    ids += engine.generate(input_ids=ids, sampling_params=dict(greedy, max_new_tokens=3))["output_ids"]
    ref = engine.generate(input_ids=ids, sampling_params=dict(greedy, max_new_tokens=1, return_logprob=True,
                                                              logprob_start_len=0, top_logprobs_num=3))["meta_info"]
    assert ref["input_token_ranks"][-3:] == [1, 1, 1] and max(ref["input_token_ranks"][1:]) > 3
    out = client.completions.create(model=MODEL, prompt=ids, max_tokens=2, temperature=0, n=2,
                                    extra_body={"prompt_logprobs": 3})
    for choice in out.choices:
        assert choice.logprobs is None
        assert_vllm_prompt_logprobs(choice.model_extra["prompt_logprobs"], ref, 3, engine.tokenizer)
    for max_tokens in (0, 2):
        echoed = client.completions.create(model=MODEL, prompt=ids, max_tokens=max_tokens, echo=True, logprobs=1,
                                           extra_body={"prompt_logprobs": 3}).choices[0]
        assert_vllm_prompt_logprobs(echoed.model_extra["prompt_logprobs"], ref, 3, engine.tokenizer)
        legacy = echoed.logprobs
        assert len(legacy.tokens) == len(ids) + max_tokens and all(len(top) <= 2 for top in legacy.top_logprobs[1:])
    messages = [{"role": "user", "content": "Name a radix tree."}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0,
                                          extra_body={"prompt_logprobs": 0})
    tokens = post(served, "/tokenize", {"messages": messages}).json()["tokens"]
    entries = chat.model_extra["prompt_logprobs"]
    assert chat.choices[0].logprobs is None and "prompt_logprobs" not in chat.choices[0].model_extra
    assert entries[0] is None and [list(e) for e in entries[1:]] == [[str(t)] for t in tokens[1:]]
    engine.check_integrity()


@pytest.mark.parametrize("fields,words", [
    ({"prompt_logprobs": -2}, "-1: the whole vocabulary"), ({"prompt_logprobs": 21}, "at most 20"),
    ({"prompt_logprobs": -1}, "got the whole vocabulary"), ({"prompt_logprobs": 1, "stream": True}, "stream"),
])
def test_prompt_logprobs_out_of_range_or_streamed_are_400s(served, fields, words):
    for path, body in (("/v1/completions", {"prompt": "hi", "max_tokens": 1}), ("/v1/chat/completions", chat_body())):
        r = post(served, path, dict(body, **fields))
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == "prompt_logprobs" and words in error["message"], r.text


def test_tokenize_and_detokenize_as_vllm(engine, served):
    """vLLM's /tokenize (a prompt as /v1/completions encodes it; messages as /v1/chat/completions
    runs them, its ``prompt_tokens``) and /detokenize (the round trip; ids outside the vocabulary 400)."""
    text = "The cat sat"
    ids = engine.tokenizer.encode(text)
    r = post(served, "/tokenize", {"model": MODEL, "prompt": text, "return_token_strs": True})
    assert r.status_code == 200 and r.json() == {"count": len(ids), "max_model_len": 256, "tokens": ids,
                                                 "token_strs": engine.tokenizer.convert_ids_to_tokens(ids)}
    bare = post(served, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()
    assert bare["tokens"] == engine.tokenizer.encode(text, add_special_tokens=False) and "token_strs" not in bare
    assert post(served, "/detokenize", {"tokens": bare["tokens"]}).json() == {"prompt": text}
    usage = post(served, "/v1/completions", {"prompt": text, "max_tokens": 1}).json()["usage"]
    assert usage["prompt_tokens"] == len(ids)
    partial = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Once upon"}]
    for fields in ({}, {"add_generation_prompt": False}, {"chat_template_kwargs": {"enable_thinking": False}},
                   {"messages": partial, "continue_final_message": True}):
        tokens = post(served, "/tokenize", dict({"messages": chat_body()["messages"]}, **fields)).json()
        run = post(served, "/v1/chat/completions", chat_body(max_tokens=1, **fields)).json()
        assert tokens["count"] == len(tokens["tokens"]) == run["usage"]["prompt_tokens"], (fields, tokens, run)
    for bad in ([5, 10 ** 6], [-1]):
        r = post(served, "/detokenize", {"tokens": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tokens", r.text
        assert "out of the vocabulary" in r.json()["error"]["message"]
    r = post(served, "/tokenize", {"messages": chat_body()["messages"], "continue_final_message": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message", r.text
    r = post(served, "/detokenize", {"model": "gpt-5", "tokens": [5]})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_detokenize_refuses_an_id_past_the_tokenizer_inside_the_padded_vocabulary(engine, served, monkeypatch):
    """The model's vocabulary padded past the tokenizer's (as a TP-padded one): an id between the two
    is no token of the tokenizer's, so /detokenize refuses it, a 400 naming ``tokens`` (vLLM checks
    the tokenizer's ``max_token_id``), while the tokenizer's last id still decodes."""
    size = len(engine.tokenizer)
    monkeypatch.setattr(EngineBackend, "vocab_size", size + 64, raising=False)
    assert post(served, "/detokenize", {"tokens": [size - 1]}).json() == {"prompt": engine.tokenizer.decode([size - 1])}
    r = post(served, "/detokenize", {"tokens": [5, size]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens", r.text
    assert f"token id {size} is out of the vocabulary (ids are 0..{size - 1})" in r.json()["error"]["message"]


def test_vllm_chat_template_fields(served, client):
    """``add_generation_prompt``, ``chat_template_kwargs`` and ``continue_final_message`` as vLLM takes them."""
    def prompt_tokens(**fields):
        r = post(served, "/v1/chat/completions", chat_body(max_tokens=1, **fields))
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens"]

    default = prompt_tokens()
    assert prompt_tokens(add_generation_prompt=True) == default
    assert prompt_tokens(add_generation_prompt=False) < default
    assert prompt_tokens(chat_template_kwargs={"enable_thinking": False}) > default
    assert prompt_tokens(chat_template_kwargs={"enable_thinking": True}) == default
    partial = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Once upon"}]
    vllm_style = prompt_tokens(messages=partial, continue_final_message=True, add_generation_prompt=False)
    assert prompt_tokens(messages=partial, continue_final_message=True) == vllm_style
    r = post(served, "/v1/chat/completions", chat_body(messages=partial, continue_final_message=True,
                                                       add_generation_prompt=True))
    assert r.status_code == 400 and r.json()["error"]["param"] == "add_generation_prompt", r.text
    r = post(served, "/v1/chat/completions", chat_body(continue_final_message=True))
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message", r.text


def test_content_parts_read_as_lines(served):
    """A message's text parts reach a string-content template one per line, as vLLM joins them
    (SGLang with a space): never run together into one word."""
    def answer(content):
        r = post(served, "/v1/chat/completions", chat_body(messages=[{"role": "user", "content": content}]))
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens"], r.json()["choices"][0]["message"]["content"]

    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]
    assert answer(parts) == answer("Hello\nworld")


def test_allowed_token_ids_and_bad_words_through_the_openai_client(client, served, monkeypatch):
    """vLLM's fields in ``extra_body`` (completions, chat) and /generate's sampling params: allowed
    ids restrict every token (to the bytes 'a' and 'b'); a bad word is never written, a +100 bias on
    its token notwithstanding; an id outside the vocabulary and a blank word are 400s naming them."""
    ab = [5 + ord("a"), 5 + ord("b")]
    text = client.completions.create(model=MODEL, prompt="hi", max_tokens=6, temperature=0,
                                     extra_body={"allowed_token_ids": ab}).choices[0].text
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                          seed=3, extra_body={"allowed_token_ids": ab}).choices[0].message.content
    r = post(served, "/generate", {"text": "hi", "sampling_params": {"allowed_token_ids": ab, "max_new_tokens": 6}})
    assert r.status_code == 200, r.text
    for out in (text, chat, r.json()["text"]):
        assert len(out) == 6 and set(out) <= {"a", "b"}, out
    z = {str(5 + ord("z")): 100}
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=4, temperature=0,
                                     logit_bias=z).choices[0].text == "zzzz"
    banned = client.completions.create(model=MODEL, prompt="hi", max_tokens=4, temperature=0, logit_bias=z,
                                       extra_body={"bad_words": ["z"]}).choices[0].text
    assert len(banned) and "z" not in banned, banned
    monkeypatch.setattr(EngineBackend, "vocab_size", 261, raising=False)
    body = bad_request(lambda: client.completions.create(model=MODEL, prompt="hi",
                                                         extra_body={"allowed_token_ids": [5, 261]}))
    assert body["param"] == "allowed_token_ids" and "token id 261 is out of the vocabulary" in body["message"], body
    r = post(served, "/generate", {"text": "hi", "sampling_params": {"allowed_token_ids": [-1]}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "sampling_params.allowed_token_ids", r.text
    body = bad_request(lambda: client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], extra_body={"bad_words": ["ok", " "]}))
    assert body["param"] == "bad_words" and "empty or blank" in body["message"], body


def test_a_structural_tag_response_format_constrains_what_its_trigger_starts(client, engine):
    """vLLM's ``response_format`` of type ``structural_tag`` (its ``structures`` and ``triggers``,
    and xgrammar's ``format``): the answer forced to its trigger goes on with a structure its schema
    accepts; a bad one is a 400 naming ``response_format``, whether refused here or where it compiles."""
    schema = {"enum": [17, 28, 39]}
    shapes = [{"type": "structural_tag", "structures": [{"begin": "<f>", "schema": schema, "end": "</f>"}],
               "triggers": ["<f"]},
              {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<f"], "tags": [
                  {"type": "tag", "begin": "<f>", "content": {"type": "json_schema", "json_schema": schema},
                   "end": "</f>"}]}}]
    forced = engine.tokenizer.encode("ab <f", add_special_tokens=False)
    for tag in shapes:
        with forced_tokens(engine.scheduler, lambda req: forced):
            content = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                     max_tokens=16, temperature=0,
                                                     response_format=tag).choices[0].message.content
        match = re.match(r"ab <f>(.*?)</f>", content, re.S)
        assert match and json.loads(match.group(1)) in schema["enum"], content
    for bad, reason in (({"type": "structural_tag", "structures": [{"begin": "<f>"}], "triggers": ["<f"]},
                         "structures[0]: needs begin and end"),
                        ({"type": "structural_tag", "structures": [{"begin": "<f>", "schema": schema, "end": "</f>"}],
                          "triggers": ["<g"]}, "does not compile")):
        body = bad_request(lambda: client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, response_format=bad))
        assert body["param"] == "response_format" and reason in body["message"], body


def test_openai_fields_with_no_effect_are_accepted(served):
    no_ops = {"tools": [], "tool_choice": "none", "response_format": {"type": "text"}, "logit_bias": {},
              "parallel_tool_calls": False, "metadata": {"team": "a"}, "store": False, "service_tier": "auto"}
    r = post(served, "/v1/chat/completions", chat_body(**no_ops))
    assert r.status_code == 200, r.text
    r = post(served, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2, "logit_bias": {}})
    assert r.status_code == 200, r.text
    r = post(served, "/v1/chat/completions", chat_body(max_tokenz=3))  # a typo still fails
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokenz"


def test_logit_bias_forces_a_token_and_min_tokens_holds_off_a_stop_string(client):
    """vLLM's ``logit_bias`` (+100 on the byte 'z') makes every token a 'z'; with ``min_tokens``
    the stop string "z" ends nothing in the first 3 tokens' text, then the 4th ends it (vLLM)."""
    z = {str(5 + ord("z")): 100}

    def complete(**fields):
        choice = client.completions.create(model=MODEL, prompt="hi", max_tokens=6, temperature=0,
                                           **{"logit_bias": z, **fields}).choices[0]
        return choice.text, choice.finish_reason

    assert complete() == ("zzzzzz", "length")
    assert complete(stop="z") == ("", "stop")
    assert complete(stop="z", extra_body={"min_tokens": 3}) == ("zzz", "stop")
    body = bad_request(lambda: complete(logit_bias={"100000": 1}))  # the worker refuses it (no vocab_size here)
    assert "logit_bias: token id 100000 is out of the vocabulary" in body["message"]


def test_structured_output_through_the_openai_client(client, served):
    """OpenAI's ``response_format`` (json_object, json_schema) on chat and completions, SGLang's and
    vLLM's grammar fields in ``extra_body``, SGLang's in /generate's sampling params: what ends
    with "stop" follows its grammar; a grammar that does not compile, or two, is a 400 naming the
    request's own field."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=48,
                                          temperature=0, response_format={"type": "json_object"}).choices[0]
    assert chat.finish_reason == "stop" and json.loads(chat.message.content, strict=False) is not None, chat
    for seed in range(3):  # (sampled: a random model's whitespace ends)
        choice = client.completions.create(
            model=MODEL, prompt="hi", max_tokens=64, seed=seed,
            extra_body={"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}},
        ).choices[0]
        assert choice.finish_reason == "length" or isinstance(json.loads(choice.text, strict=False)["ok"], bool)
    choices = ["a.b (c)", "no|yes", "[x]"]
    for extra in ({"guided_choice": choices}, {"regex": "(a.b \\(c\\)|no\\|yes|\\[x\\])"},
                  {"guided_grammar": 'root ::= "a.b (c)" | "no|yes" | "[x]"'}):
        choice = client.completions.create(model=MODEL, prompt="hi", max_tokens=16, seed=1, extra_body=extra).choices[0]
        assert choice.finish_reason == "stop" and choice.text in choices, (extra, choice)
    r = post(served, "/generate", {"text": "hi", "sampling_params": {"regex": "[0-9]{3}", "max_new_tokens": 8}})
    assert r.status_code == 200 and re.fullmatch("[0-9]{3}", r.json()["text"]), r.text
    bad = {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "nope"}}}
    body = bad_request(lambda: client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, response_format=bad))
    assert body["param"] == "response_format" and "does not compile: Unsupported type" in body["message"], body
    body = bad_request(lambda: client.completions.create(model=MODEL, prompt="hi", extra_body={"guided_regex": "(a"}))
    assert body["param"] == "guided_regex" and "regex does not compile" in body["message"], body
    body = bad_request(lambda: client.completions.create(model=MODEL, prompt="hi", extra_body={"guided_json": "{"}))
    assert body["param"] == "guided_json" and "not valid JSON" in body["message"], body
    body = bad_request(lambda: client.completions.create(model=MODEL, prompt="hi",
                                                         extra_body={"regex": "a", "guided_choice": ["a"]}))
    assert body["param"] == "guided_choice" and "one structured output per request" in body["message"], body


def test_stop_reason_names_the_stop_string_or_token_id_that_ended_a_choice(client):
    """vLLM's ``stop_reason`` beside ``finish_reason``: the matched stop string or ``stop_token_ids``
    id; None for EOS (a "stop" too) and for "length"; streamed, on the chunk that finishes."""
    from actors.engine.tokenizer import EOS_ID

    z = 5 + ord("z")

    def ends(bias=z, **fields):
        kwargs = dict(max_tokens=4, temperature=0, logit_bias={str(bias): 100}, **fields)
        whole = client.completions.create(model=MODEL, prompt="hi", **kwargs).choices[0]
        chat = [c.choices[0] for c in client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True, **kwargs) if c.choices]
        assert chat[-1].finish_reason == whole.finish_reason
        return whole.finish_reason, whole.stop_reason, chat[-1].stop_reason

    assert ends(stop="z") == ("stop", "z", "z")
    assert ends(extra_body={"stop_token_ids": [z]}) == ("stop", z, z)
    assert ends(bias=EOS_ID) == ("stop", None, None)
    assert ends() == ("length", None, None)


def test_include_stop_str_in_output_keeps_the_stop_string_or_token_in_the_text(client):
    """vLLM's ``include_stop_str_in_output``: the stop string (or stop token) that ended a choice
    ends its text, whole and streamed; without it, it is cut."""
    z = 5 + ord("z")

    def texts(**fields):
        kwargs = dict(model=MODEL, prompt="hi", max_tokens=4, temperature=0, logit_bias={str(z): 100}, **fields)
        streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs) if c.choices)
        return client.completions.create(**kwargs).choices[0].text, streamed

    assert texts(stop="zz") == ("", "")
    assert texts(stop="zz", extra_body={"include_stop_str_in_output": True}) == ("zz", "zz")
    assert texts(extra_body={"stop_token_ids": [z], "include_stop_str_in_output": True}) == ("z", "z")


def test_developer_role_is_a_system_message_and_template_errors_and_images_to_a_text_model_are_400(client):
    def reply(role):
        return client.chat.completions.create(
            model=MODEL, max_tokens=6, temperature=0,
            messages=[{"role": role, "content": "be brief"}, {"role": "user", "content": "hi"}]).choices[0]

    assert reply("developer").message.content == reply("system").message.content
    body = bad_request(lambda: reply("tool"))
    assert body["param"] == "messages" and "unexpected role tool" in body["message"]
    # (an image part to a text model's template was a 500: a TypeError where it joins the content as text)
    body = bad_request(lambda: client.chat.completions.create(model=MODEL, max_tokens=2, messages=[{
        "role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                                    {"type": "text", "text": "hi"}]}]))
    assert body["param"] == "messages" and "not a vision-language model" in body["message"]


def test_models_retrieve(client):
    """The card as OpenAI's and vLLM's: ``created`` a Unix time (not 0, 1970), vLLM's ``max_model_len``."""
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.object == "model" and card.max_model_len == 256
    assert time.time() - 3600 < card.created <= time.time()
    assert client.models.list().data == [card]
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-5")


def test_a_request_without_model_is_for_the_served_model(served):
    """vLLM and SGLang serve a request that names no model with the one they serve."""
    for path, body in (("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
                       ("/v1/chat/completions", chat_body(model=None))):
        r = post(served, path, {k: v for k, v in body.items() if k != "model"})
        assert r.status_code == 200 and r.json()["model"] == MODEL, r.text


def test_a_batch_of_prompts_answers_each_as_vllm_numbers_them(client):
    """``prompt`` as a list of strings or of token-id lists (lm-eval and other batch clients send
    those): choice ``p × n + i`` is prompt p's sample i; each equals the prompt sent alone; usage
    counts every prompt once; streamed chunks carry the same indices; echo is per prompt."""
    prompts = ["The cat sat", "A radix tree is", "Hello"]
    alone = [client.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0,
                                       extra_body={"ignore_eos": True}) for p in prompts]
    out = client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, temperature=0, n=2, echo=True,
                                    extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == list(range(6))
    for c in out.choices:
        p = c.index // 2
        assert c.text == prompts[p] + alone[p].choices[0].text
    assert out.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert out.usage.completion_tokens == 6 * 6
    ids = [[11, 12, 13, 14], [40, 41, 42]]
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert by_ids.usage.prompt_tokens == 7 and len(by_ids.choices) == 2
    streamed: dict = {}
    for chunk in client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True}):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert streamed == {c.index: c.text for c in by_ids.choices}
    body = bad_request(lambda: client.completions.create(model=MODEL, prompt=["x"] * 65, max_tokens=1))
    assert body["param"] == "prompt" and "at most 64 prompts" in body["message"]
    body = bad_request(lambda: client.completions.create(model=MODEL, prompt=["x"] * 3, max_tokens=1, n=64))
    assert body["param"] == "n" and "at most 128" in body["message"]
    body = bad_request(lambda: client.completions.create(model=MODEL, prompt=["ok", ""], max_tokens=1))
    assert "prompt 1 is empty" in body["message"]


def test_a_token_id_outside_the_vocabulary_fails_its_own_request_not_its_batch(engine, served):
    """The workers refuse such a prompt when it arrives (the HTTP layer does too where it knows the
    vocabulary; this backend does not say): it never joins a batch, whose forward it would fail
    with every request in it."""
    results = {}

    def send(name, prompt):
        results[name] = post(served, "/v1/completions", {"prompt": prompt, "max_tokens": 4, "temperature": 0})

    engine.loop.pause()  # the good request waits in the queue while the bad one arrives
    try:
        threads = [threading.Thread(target=send, args=(name, prompt))
                   for name, prompt in (("good", [10, 11, 12]), ("too big", [10, 10 ** 6]), ("negative", [-1]))]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while (len(results) < 2 or not engine.scheduler.waiting) and time.monotonic() < deadline:
            time.sleep(0.02)  # the two bad ones answer at once, paused or not
        assert len(results) == 2 and len(engine.scheduler.waiting) == 1
    finally:
        engine.loop.resume()
    for t in threads:
        t.join(60)
    for name in ("too big", "negative"):
        assert results[name].status_code == 400, results[name].text
        assert "out of the vocabulary" in results[name].json()["error"]["message"]
    assert results["good"].status_code == 200, results["good"].text
    engine.check_integrity()


def test_the_cli_chat_prompt_gets_one_bos_not_two(tmp_path, capsys):
    """``raydix generate`` with a Llama-style checkpoint (its tokenizer adds BOS, its template
    writes ``{{ bos_token }}``): the rendered template is the prompt, one BOS, none added on
    top (vLLM's and SGLang's chat paths)."""
    import json as json_

    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast

    from actors.engine.tokenizer import BOS, BOS_ID, EOS, PAD, build_byte_tokenizer
    from cluster.cli import main

    path = build_tiny_checkpoint("llama", tmp_path / "llama", seed=0)
    raw = build_byte_tokenizer()
    raw.post_processor = TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, BOS_ID)])
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token=BOS, eos_token=EOS, pad_token=PAD)
    tok.chat_template = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tok.save_pretrained(str(path))
    messages = [{"role": "user", "content": "Hi"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    want = len(tok.encode(text, add_special_tokens=False))  # BOS, "H", "i": as the template wrote it
    assert main(["generate", "--model-path", str(path), "--prompt", "Hi", "--max-new-tokens", "1",
                 "--max-total-tokens", "512"]) == 0
    meta = json_.loads(next(line for line in capsys.readouterr().out.splitlines() if line.startswith("{")))
    assert meta["prompt_tokens"] == want, f"{meta['prompt_tokens']} prompt tokens, the template wrote {want}"


def forced_reply(client, engine, text: str, **extra):
    """A chat choice forced to write ``text`` and EOS (the byte tokenizer writes any text; no grammar
    would force a thinking, which it leaves free), whole and streamed (one byte a step: a tag comes
    split at every position): its ``(content, reasoning_content)``, the same both ways, vLLM's
    ``reasoning`` beside the latter."""
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=32, temperature=0,
                  logprobs=True, extra_body=extra)
    tokens = engine.tokenizer.encode(text, add_special_tokens=False) + engine.eos_token_ids[:1]
    with forced_tokens(engine.scheduler, lambda req: tokens):
        whole = client.chat.completions.create(**kwargs).choices[0]
        chunks = list(client.chat.completions.create(stream=True, **kwargs))
    message = whole.message.model_extra
    assert whole.finish_reason == "stop" and message.get("reasoning") == message.get("reasoning_content"), whole
    content, reasoning, logprobs = "", "", []
    for chunk in chunks:
        delta = chunk.choices[0].delta
        assert delta.model_extra.get("reasoning") == delta.model_extra.get("reasoning_content"), delta
        content += delta.content or ""
        reasoning += delta.model_extra.get("reasoning_content") or ""
        logprobs += [e.token for e in chunk.choices[0].logprobs.content] if chunk.choices[0].logprobs else []
    # logprobs stay one per token, the tags' too
    assert logprobs == [e.token for e in whole.logprobs.content] and "".join(logprobs).startswith(text)
    assert (content or None, reasoning or None) == (whole.message.content, message.get("reasoning_content"))
    return whole.message.content, message.get("reasoning_content", "absent")


def test_reasoning_parser_puts_the_thinking_in_reasoning_content(engine, client):
    """vLLM's / SGLang's reasoning parsers over HTTP: the thinking in ``reasoning_content`` (and
    ``reasoning``), the answer in ``content`` (None when empty), streamed alike; qwen3's output opens
    in the thinking unless ``enable_thinking`` is off (the template then writes ``<think></think>``),
    deepseek_r1's always; SGLang's ``separate_reasoning: false``, a server without a parser and
    /v1/completions leave the text whole."""
    thought = "<think>a b</think>ok"
    with serving(engine, ServerConfig(reasoning_parser="qwen3")) as server:
        qwen3 = openai_client(server)
        assert forced_reply(qwen3, engine, thought) == ("ok", "a b")
        # never closed (as if cut short): all thinking
        assert forced_reply(qwen3, engine, "plain") == (None, "plain")
        assert forced_reply(qwen3, engine, "plain", chat_template_kwargs={"enable_thinking": False}) == ("plain", None)
        assert forced_reply(qwen3, engine, thought, separate_reasoning=False) == (thought, "absent")
        whole = qwen3.completions.create(model=MODEL, prompt="hi", max_tokens=32,
                                         extra_body={"guided_choice": [thought]})
        assert whole.choices[0].text == thought
    with serving(engine, ServerConfig(reasoning_parser="deepseek_r1")) as server:
        assert forced_reply(openai_client(server), engine, "a b</think>ok") == ("ok", "a b")
    assert forced_reply(client, engine, thought) == (thought, "absent")
    engine.check_integrity()
