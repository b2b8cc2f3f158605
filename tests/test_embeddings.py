"""Embeddings by last-token pooling (``actors.engine.pooling``): equal to HF's final-norm hidden state
of the prompt's last token, normalised (or cut to ``dimensions`` first, or left raw), batched beside a
generating request, over chunked prefill, from a cached prompt, on TP 2, on a PD prefill worker
alone, and through POST /v1/embeddings with the openai client (float and base64, batches of strings
and of token ids, truncation and the 400s)."""

import asyncio
import base64
import random
import time

import numpy as np
import openai
import pytest

from actors.engine import Engine
from actors.engine.tiny import build_tiny_checkpoint
from cluster.config import ServerConfig
from cluster.http_server import BackgroundServer
from cluster.server import build_app
from tests.parity import assert_embedding_close, assert_greedy_parity
from tests.test_openai_compat import EngineBackend

CHUNK = 32  # chunked_prefill_size: a 40-token prompt after 22 other tokens runs in two chunks (8 + 32)
CONTEXT = 128
GREEDY = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 6}


def embed(**pooling):
    return {"max_new_tokens": 0, "pooling": pooling}


def prompt(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(5, 250) for _ in range(n)]


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return str(build_tiny_checkpoint("llama", tmp_path_factory.mktemp("tiny-llama"), seed=0))


@pytest.fixture(scope="module")
def engine(path):
    engine = Engine(model_path=path, page_size=4, max_total_tokens=1024, attention_backend="torch",
                    chunked_prefill_size=CHUNK, context_length=CONTEXT)
    yield engine
    engine.shutdown()


def test_embeddings_equal_hf_batched_with_generation_and_chunked(engine, path):
    """A generating request and three embedding requests in one call: the first forward holds a
    whole prompt, the generation, another whole prompt and the first chunk of the third; every vector
    equals HF's and the generation its greedy tokens (its logits row the first, though it is the
    batch's second request): only its last token goes through the ``lm_head``; the second forward,
    the embedding's last chunk alone, calls none."""
    gen, short, tiny, long = prompt(8, 1), prompt(9, 2), prompt(5, 3), prompt(40, 4)
    batches, lm_head_rows = [], []
    forward = engine.runner.forward

    def spy(forward_batch):
        batches.append((forward_batch.batch_size, forward_batch.embed_indices))
        lm_head_rows.append([])
        return forward(forward_batch)

    hook = engine.runner.model.lm_head.register_forward_hook(lambda m, args, out: lm_head_rows[-1].append(len(args[0])))
    engine.runner.forward = spy
    try:
        outs = engine.generate(input_ids=[short, gen, tiny, long],
                               sampling_params=[embed(), GREEDY, embed(dimensions=16), embed(normalize=False)])
    finally:
        del engine.runner.forward
        hook.remove()
    assert batches[0][0] == 4 and batches[0][1].tolist() == [9 - 1, 9 + 8 + 5 - 1]  # (not the chunked one's)
    assert batches[1][1].tolist() == [40 - 8 - 1]  # its last chunk (the first: the 8 tokens, whole pages, left)
    assert lm_head_rows[:2] == [[1], []] and lm_head_rows[2:] == [[1]] * (GREEDY["max_new_tokens"] - 1)
    assert_greedy_parity(path, [gen], [outs[1]["output_ids"]], GREEDY["max_new_tokens"])
    assert "embedding" not in outs[1]
    assert_embedding_close(path, short, outs[0]["embedding"])
    assert_embedding_close(path, tiny, outs[2]["embedding"], dimensions=16)
    assert_embedding_close(path, long, outs[3]["embedding"], normalize=False)
    assert outs[0]["output_ids"] == [] and outs[0]["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    engine.check_integrity()


def test_encode_hits_the_cache_on_a_repeat_and_refuses_bad_pooling(engine, path):
    ids = prompt(30, 5)
    first = engine.encode(input_ids=ids)
    again, text = engine.encode(input_ids=[ids, engine.tokenizer.encode("hello world")])
    assert first["meta_info"]["cached_tokens"] == 0 and again["meta_info"]["cached_tokens"] == 28
    assert again["embedding"] == pytest.approx(first["embedding"], abs=1e-6)
    assert_embedding_close(path, ids, first["embedding"])
    by_text = engine.encode(prompt="hello world")
    assert by_text["embedding"] == pytest.approx(text["embedding"], abs=1e-6) and by_text["meta_info"]["cached_tokens"]
    hidden = engine.runner.model_config.hidden_size
    with pytest.raises(ValueError, match=f"dimensions: {hidden + 1} is more than the model's hidden size"):
        engine.encode(input_ids=ids, pooling_params={"dimensions": hidden + 1})
    with pytest.raises(ValueError, match="max_new_tokens: an embedding request"):
        engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 2, "pooling": {}})
    assert asyncio.run(engine.async_encode(input_ids=ids))["embedding"] == pytest.approx(first["embedding"], abs=1e-6)
    engine.check_integrity()


def test_tp2_rank_0_answers_what_hf_gives(path, monkeypatch):
    """Under TP 2 (ranks as threads) the hidden states are whole after the all-reduce: rank 0's vectors
    equal HF's, and the follower's tables stay in step."""
    from tests.tp_helpers import thread_ranks

    thread_ranks(monkeypatch)
    engine = Engine(model_path=path, skip_tokenizer_init=True, page_size=4, max_total_tokens=512, tp_size=2,
                    attention_backend="torch", chunked_prefill_size=16)
    try:
        ids = [prompt(23, 6), prompt(7, 7)]
        for p, out in zip(ids, engine.encode(input_ids=ids, pooling_params={"dimensions": 20})):
            assert_embedding_close(path, p, out["embedding"], dimensions=20)
        engine.check_integrity()
    finally:
        engine.shutdown()


def test_a_pd_prefill_worker_alone_returns_the_engine_s_embedding(engine, path):
    """An embedding request is a prompt scored only: ``prefill_only`` runs it on the prefill worker, which
    pushes nothing and returns the embedding the engine gives."""
    from actors.workers import PrefillWorker
    from tests.pd_helpers import close_workers

    prefill = PrefillWorker(path, dict(max_total_tokens=512, page_size=4, chunked_prefill_size=16,
                                       skip_tokenizer_init=True))
    try:
        ids = prompt(37, 8)
        out = asyncio.run(prefill.prefill_only("e", ids, embed(dimensions=24)))
        assert prefill.scheduler.bytes_pushed == 0 and not prefill.scheduler.inflight
        want = engine.encode(input_ids=ids, pooling_params={"dimensions": 24})["embedding"]
        assert out["embedding"] == pytest.approx(want, abs=1e-5)
        assert_embedding_close(path, ids, out["embedding"], dimensions=24)
    finally:
        close_workers(prefill)


# ---- POST /v1/embeddings ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def client(engine):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(engine.config.model_path, local_files_only=True)
    app = build_app(EngineBackend(engine, CONTEXT), tokenizer, ServerConfig())
    with BackgroundServer(app, "127.0.0.1", 0) as server:
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


def test_the_openai_client_reads_float_and_base64_embeddings(engine, path, client):
    texts = ["the quick brown fox", "jumps"]
    b64 = client.embeddings.create(model="tiny", input=texts)  # (the client asks for base64 by default)
    floats = client.embeddings.create(model="tiny", input=texts, encoding_format="float")
    assert [d.index for d in b64.data] == [0, 1] and b64.model == "tiny" and b64.object == "list"
    ids = [engine.tokenizer.encode(t) for t in texts]
    assert b64.usage.prompt_tokens == b64.usage.total_tokens == sum(map(len, ids))
    for p, a, b in zip(ids, b64.data, floats.data):
        assert a.embedding == pytest.approx(b.embedding, abs=1e-6)
        assert_embedding_close(path, p, b.embedding)
    raw = client.embeddings.with_raw_response.create(model="tiny", input=texts[1], encoding_format="base64")
    vector = np.frombuffer(base64.b64decode(raw.http_response.json()["data"][0]["embedding"]), dtype="<f4")
    assert vector.tolist() == pytest.approx(floats.data[1].embedding, abs=1e-6)


def test_token_id_batches_dimensions_and_vllm_truncation(path, client):
    ids = [prompt(12, 9), prompt(50, 10)]
    out = client.embeddings.create(model="tiny", input=ids, dimensions=8, encoding_format="float")
    for p, d in zip(ids, out.data):
        assert_embedding_close(path, p, d.embedding, dimensions=8)
    cut = client.embeddings.create(model="tiny", input=ids[1], encoding_format="float",
                                   extra_body={"truncate_prompt_tokens": 10, "normalize": False})
    assert_embedding_close(path, ids[1][-10:], cut.data[0].embedding, normalize=False)
    assert cut.usage.prompt_tokens == 10


@pytest.mark.parametrize("fields, param, words", [
    (dict(input=[[7] * CONTEXT]), "input", "maximum context length"),
    (dict(input="x", dimensions=10 ** 4), "dimensions", "more than the model's hidden size"),
    (dict(input=[]), "input", "the input is empty"),
    (dict(input=["a", ""]), "input", "input 1 is empty"),
    (dict(input="x", extra_body={"truncate_prompt_tokens": 0}), "truncate_prompt_tokens", "at least 1"),
    (dict(input="x", extra_body={"truncate_prompt_tokens": CONTEXT}), "truncate_prompt_tokens", "longest prompt"),
    (dict(input="x", encoding_format="bytes"), "encoding_format", ""),
    (dict(input="x", extra_body={"priority": 3}), "priority", "priority scheduling is not enabled"),
])
def test_bad_requests_are_400s_naming_the_field(engine, client, fields, param, words):
    with pytest.raises(openai.BadRequestError) as err:
        client.embeddings.create(model="tiny", **fields)
    error = err.value.body
    assert error["param"] == param and words in error["message"], error
    engine.check_integrity()


def test_another_model_is_404(client):
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="other", input="x")


def test_priority_reaches_each_inputs_request(path):
    """vLLM's ``priority`` on /v1/embeddings: with the engine's priority scheduling, each input of a
    batch queues under it (and without, it is a 400: the parametrised bad requests)."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx
    from transformers import AutoTokenizer

    eng = Engine(model_path=path, page_size=4, max_total_tokens=1024, attention_backend="torch",
                 context_length=CONTEXT, enable_priority_scheduling=True)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    body = {"input": [prompt(6, 11), prompt(9, 12)], "priority": 5, "encoding_format": "float"}
    try:
        with BackgroundServer(build_app(EngineBackend(eng, CONTEXT), tokenizer, ServerConfig()), "127.0.0.1", 0) \
                as server, ThreadPoolExecutor(1) as pool:
            eng.loop.pause()  # (the requests stay queued)
            posted = pool.submit(httpx.post, server.url + "/v1/embeddings", json=body, timeout=60)
            deadline = time.monotonic() + 30
            while len(eng.loop.held_reqs()) < 2 and time.monotonic() < deadline and not posted.done():
                time.sleep(0.005)
            assert sorted(r.priority for r in eng.loop.held_reqs()) == [5, 5]
            eng.loop.resume()
            r = posted.result()
        assert r.status_code == 200 and [d["index"] for d in r.json()["data"]] == [0, 1], r.text
        eng.check_integrity()
    finally:
        eng.shutdown()
