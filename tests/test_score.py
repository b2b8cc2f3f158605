"""Scores (``actors.engine.pooling``'s classifier from two tokens) and the /score and /rerank endpoints
(``cluster.openai_score``): a score equals HF's sigmoid(logit_true - logit_false) at the prompt's last
position, batched beside an embedding and a generation and chunked, with only the generation's row
through the ``lm_head``; on TP 2 with the two tokens in different ranks' vocabulary shards; on a PD
prefill worker alone. Over HTTP (vLLM's bodies): embedding similarity equal to the cosine of HF's
hidden states, 1→N and N→N, its usage vLLM's count per pair; the classifier over a template's prompt or
the tokenizer's pair encoding; rerank order, top_n, return_documents and Cohere's document objects;
the 400s, the 404 and the config's checks."""

import asyncio

import httpx
import pytest

from actors.engine import Engine
from cluster.config import ServerConfig
from cluster.http_server import BackgroundServer
from cluster.server import build_app
from tests.parity import assert_greedy_parity, hf_classifier_score, hf_cosine
from tests.test_embeddings import CONTEXT, GREEDY, embed, engine, path, prompt  # noqa: F401 (fixtures)
from tests.test_openai_compat import EngineBackend

TOKENS = [20, 30]  # a classifier's "false" and "true" token ids
TEMPLATE = "<q>{query}</q><d>{document}</d>"


def score(token_ids=TOKENS):
    return {"max_new_tokens": 0, "pooling": {"classifier_token_ids": token_ids}}


def test_scores_equal_hf_batched_with_generation_and_chunked_with_two_lm_head_rows(engine, path):
    """A score, a generation, an embedding and a chunked score in one call: each score equals HF's
    from the whole logits row, yet the ``lm_head`` computes the generation's row only (the scores
    take two of its rows each); the embedding and the tokens are what they are alone."""
    short, gen, emb, long = prompt(11, 21), prompt(8, 22), prompt(6, 23), prompt(40, 24)
    lm_head_rows, classifier_ids = [], []
    forward = engine.runner.forward

    def spy(forward_batch):
        ids = forward_batch.classifier_token_ids
        classifier_ids.append(None if ids is None else ids.tolist())
        return forward(forward_batch)

    hook = engine.runner.model.lm_head.register_forward_hook(lambda m, args, out: lm_head_rows.append(len(args[0])))
    engine.runner.forward = spy
    try:
        outs = engine.generate(input_ids=[short, gen, emb, long],
                               sampling_params=[score(), GREEDY, embed(), score([7, 200])])
    finally:
        del engine.runner.forward
        hook.remove()
    # the first forward pools the first score and the embedding (its row: zeros), a later one the chunked score
    assert classifier_ids[0] == [TOKENS, [0, 0]] and [ids for ids in classifier_ids if ids] == [
        [TOKENS, [0, 0]], [[7, 200]]]
    assert lm_head_rows == [1] * GREEDY["max_new_tokens"]
    assert outs[0]["embedding"] == [pytest.approx(hf_classifier_score(path, short, TOKENS), abs=1e-5)]
    assert outs[3]["embedding"] == [pytest.approx(hf_classifier_score(path, long, [7, 200]), abs=1e-5)]
    assert outs[2]["embedding"] == pytest.approx(engine.encode(input_ids=emb)["embedding"], abs=1e-6)
    assert_greedy_parity(path, [gen], [outs[1]["output_ids"]], GREEDY["max_new_tokens"])
    engine.check_integrity()


def test_the_engine_refuses_a_bad_classifier(engine):
    vocab = engine.runner.model_config.vocab_size
    with pytest.raises(ValueError, match=f"classifier_token_ids: token id {vocab} is out of the vocabulary"):
        engine.encode(input_ids=[5, 6], pooling_params={"classifier_token_ids": [3, vocab]})
    with pytest.raises(ValueError, match="a score .classifier_token_ids. has no dimensions"):
        engine.encode(input_ids=[5, 6], pooling_params={"classifier_token_ids": TOKENS, "dimensions": 4})
    engine.check_integrity()


def test_tp2_sums_the_two_logits_over_the_vocabulary_shards(path, monkeypatch):
    """Under TP 2 (ranks as threads) rank 0 holds ids [0, 192) of ``lm_head``, rank 1 the rest: a
    pair of tokens split between them, or both on rank 1, scores as HF's."""
    from tests.tp_helpers import thread_ranks

    thread_ranks(monkeypatch)
    engine = Engine(model_path=path, skip_tokenizer_init=True, page_size=4, max_total_tokens=512, tp_size=2,
                    attention_backend="torch", chunked_prefill_size=16)
    try:
        assert engine.runner.model.lm_head.shard == range(0, 192)
        ids = [prompt(23, 25), prompt(7, 26)]
        for tokens in ([20, 230], [250, 200]):
            for p, out in zip(ids, engine.encode(input_ids=ids, pooling_params={"classifier_token_ids": tokens})):
                assert out["embedding"] == [pytest.approx(hf_classifier_score(path, p, tokens), abs=1e-5)]
        engine.check_integrity()
    finally:
        engine.shutdown()


def test_a_pd_prefill_worker_alone_returns_the_score(path):
    from actors.workers import PrefillWorker
    from tests.pd_helpers import close_workers

    prefill = PrefillWorker(path, dict(max_total_tokens=512, page_size=4, chunked_prefill_size=16,
                                       skip_tokenizer_init=True))
    try:
        ids = prompt(29, 27)
        out = asyncio.run(prefill.prefill_only("s", ids, score()))
        assert prefill.scheduler.bytes_pushed == 0 and not prefill.scheduler.inflight
        assert out["embedding"] == [pytest.approx(hf_classifier_score(path, ids, TOKENS), abs=1e-5)]
    finally:
        close_workers(prefill)


# ---- POST /score, /rerank ------------------------------------------------------------------------
def _serve(engine, **server):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(engine.config.model_path, local_files_only=True)
    return BackgroundServer(build_app(EngineBackend(engine, CONTEXT), tokenizer, ServerConfig(**server)),
                            "127.0.0.1", 0)


@pytest.fixture(scope="module")
def post(engine):
    """POST to a server scoring by embedding similarity."""
    with _serve(engine) as server:
        yield lambda route, body: httpx.post(server.url + route, json=body, timeout=60)


@pytest.fixture(scope="module")
def post_classifier(engine):
    """POST to a server scoring by the classifier from the tokens "n" (false) and "y" (true)."""
    with _serve(engine, classifier_from_token=["n", "y"], score_template=TEMPLATE) as server:
        yield lambda route, body: httpx.post(server.url + route, json=body, timeout=60)


def pair_tokens(enc, pairs) -> int:
    """vLLM's usage of scores by embeddings: per pair, its two prompts and a pad token between them."""
    return sum(len(enc(a)) + 1 + len(enc(b)) for a, b in pairs)


def test_score_by_embeddings_is_hf_s_cosine_one_to_n_and_n_to_n(engine, path, post):
    enc = engine.tokenizer.encode
    assert engine.tokenizer.pad_token_id is not None  # (vLLM counts it in each pair)
    one_to_n = post("/v1/score", {"model": "tiny", "text_1": "the cat", "text_2": ["a cat", "stocks fell", "the cat"]})
    assert one_to_n.status_code == 200, one_to_n.text
    body = one_to_n.json()
    assert body["object"] == "list" and body["model"] == "tiny" and body["id"].startswith("score-")
    assert [(d["index"], d["object"]) for d in body["data"]] == [(0, "score"), (1, "score"), (2, "score")]
    for d, doc in zip(body["data"], ["a cat", "stocks fell", "the cat"]):
        assert d["score"] == pytest.approx(hf_cosine(path, enc("the cat"), enc(doc)), abs=1e-5)
    assert body["data"][2]["score"] == pytest.approx(1.0, abs=1e-6)
    tokens = pair_tokens(enc, [("the cat", doc) for doc in ["a cat", "stocks fell", "the cat"]])  # (text_1: 3 times)
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    n_to_n = post("/score", {"text_1": ["a", "bc"], "text_2": ["de", "f"]}).json()
    assert [d["score"] for d in n_to_n["data"]] == [
        pytest.approx(hf_cosine(path, enc(a), enc(b)), abs=1e-5) for a, b in [("a", "de"), ("bc", "f")]]
    assert n_to_n["usage"]["prompt_tokens"] == pair_tokens(enc, [("a", "de"), ("bc", "f")])
    engine.check_integrity()


def test_rerank_sorts_cuts_and_returns_documents(engine, path, post):
    enc = engine.tokenizer.encode
    docs = ["paris is in france", "the cat", "cats purr", "stocks fell"]
    want = [hf_cosine(path, enc("cat"), enc(d)) for d in docs]
    order = sorted(range(len(docs)), key=lambda i: -want[i])
    for route in ("/rerank", "/v1/rerank", "/v2/rerank"):
        body = post(route, {"query": "cat", "documents": docs}).json()
        assert body["id"].startswith("rerank-") and body["model"] == "tiny"
        assert [r["index"] for r in body["results"]] == order
        assert [r["document"]["text"] for r in body["results"]] == [docs[i] for i in order]
        assert [r["relevance_score"] for r in body["results"]] == [pytest.approx(want[i], abs=1e-5) for i in order]
    top = post("/v1/rerank", {"query": "cat", "documents": docs, "top_n": 2, "return_documents": False}).json()
    assert top["results"] == [{"index": i, "relevance_score": pytest.approx(want[i], abs=1e-5)} for i in order[:2]]
    assert top["usage"]["total_tokens"] == pair_tokens(enc, [("cat", d) for d in docs])
    engine.check_integrity()


def test_rerank_takes_cohere_s_document_objects(engine, path, post):
    """Cohere's documents may be objects with a ``text`` (strings and objects mixed too): ranked by it,
    each returned as sent, its other fields with it; a document with no ``text`` is a 400."""
    enc = engine.tokenizer.encode
    docs = [{"text": "cats purr", "id": "a"}, "stocks fell", {"text": "the cat"}]
    texts = ["cats purr", "stocks fell", "the cat"]
    want = [hf_cosine(path, enc("cat"), enc(t)) for t in texts]
    order = sorted(range(len(docs)), key=lambda i: -want[i])
    for route in ("/v1/rerank", "/v2/rerank"):
        body = post(route, {"query": "cat", "documents": docs})
        assert body.status_code == 200, body.text
        results = body.json()["results"]
        assert [r["index"] for r in results] == order
        assert [r["document"] for r in results] == [{"text": docs[i]} if isinstance(docs[i], str) else docs[i] for i in order]
        assert [r["relevance_score"] for r in results] == [pytest.approx(want[i], abs=1e-5) for i in order]
    r = post("/v1/rerank", {"query": "cat", "documents": [{"title": "no text"}]})
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("documents"), r.text
    engine.check_integrity()


def test_classifier_scores_the_template_s_prompt_as_hf(engine, path, post_classifier):
    enc = engine.tokenizer.encode
    tokens = engine.tokenizer.convert_tokens_to_ids(["n", "y"])
    docs = ["yes it is", "no", "maybe so"]
    prompts = [enc(TEMPLATE.replace("{query}", "is it?").replace("{document}", d)) for d in docs]
    want = [hf_classifier_score(path, p, tokens) for p in prompts]
    body = post_classifier("/v1/score", {"text_1": "is it?", "text_2": docs}).json()
    assert [d["score"] for d in body["data"]] == [pytest.approx(w, abs=1e-5) for w in want]
    assert body["usage"]["prompt_tokens"] == sum(map(len, prompts))
    ranked = post_classifier("/rerank", {"query": "is it?", "documents": docs, "top_n": 1}).json()["results"]
    best = max(range(len(docs)), key=lambda i: want[i])
    assert ranked == [{"index": best, "document": {"text": docs[best]}, "relevance_score": pytest.approx(want[best],
                                                                                                        abs=1e-5)}]
    cut = post_classifier("/score", {"text_1": ["{document}"], "text_2": ["{query}"], "truncate_prompt_tokens": 9})
    braces = enc("<q>{document}</q><d>{query}</d>")[-9:]  # (placeholders in the texts are left as they are)
    assert cut.json()["data"][0]["score"] == pytest.approx(hf_classifier_score(path, braces, tokens), abs=1e-5)
    engine.check_integrity()


def test_classifier_without_a_template_scores_the_pair_encoding(engine, path):
    tokenizer = engine.tokenizer
    tokens = tokenizer.convert_tokens_to_ids(["n", "y"])
    with _serve(engine, classifier_from_token=["n", "y"]) as server:
        body = httpx.post(server.url + "/v1/score", json={"text_1": ["ab", "cd"], "text_2": ["ef", "g"]},
                          timeout=60).json()
    want = [hf_classifier_score(path, tokenizer(text=a, text_pair=b)["input_ids"], tokens)
            for a, b in [("ab", "ef"), ("cd", "g")]]
    assert [d["score"] for d in body["data"]] == [pytest.approx(w, abs=1e-5) for w in want]
    engine.check_integrity()


@pytest.mark.parametrize("route, body, param, words", [
    ("/v1/rerank", {"query": "q", "documents": []}, "documents", "at least one text"),
    ("/v1/score", {"text_1": [], "text_2": "x"}, "text_1", "at least one text"),
    ("/v1/score", {"text_1": ["a", "b"], "text_2": ["x", "y", "z"]}, "text_2", "pair 1:1, 1:N or N:N; got 2 and 3"),
    ("/v1/score", {"text_1": "a", "text_2": ["x", "y" * CONTEXT]}, "text_2", "maximum context length"),
    ("/v1/rerank", {"query": "q" * CONTEXT, "documents": ["x"]}, "query", "maximum context length"),
    ("/v1/score", {"text_1": "a", "text_2": ["x", ""]}, "text_2", "text_2 1: a text with no tokens"),
    ("/v1/score", {"text_1": "a", "text_2": "x", "truncate_prompt_tokens": CONTEXT}, "truncate_prompt_tokens",
     "longest prompt"),
    ("/v1/rerank", {"query": "q", "documents": ["x"], "top_n": -1}, "top_n", ""),
    ("/v1/score", {"text_1": "a", "text_2": "x", "priority": 2}, "priority", "priority scheduling is not enabled"),
    ("/v1/rerank", {"query": "q", "documents": ["x"], "priority": 2}, "priority", "priority scheduling is not enabled"),
])
def test_bad_requests_are_400s_naming_the_field(engine, post, route, body, param, words):
    r = post(route, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error
    engine.check_integrity()


def test_the_classifier_s_too_long_pair_is_a_400_and_another_model_a_404(post, post_classifier):
    r = post_classifier("/v1/rerank", {"query": "q", "documents": ["x", "y" * CONTEXT]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "documents", r.text
    assert post("/v1/score", {"model": "other", "text_1": "a", "text_2": "b"}).status_code == 404


def test_the_config_checks_the_classifier_and_its_template(engine):
    with pytest.raises(ValueError, match="set classifier_from_token too"):
        ServerConfig(score_template=TEMPLATE)
    with pytest.raises(ValueError, match="score_template: {document} missing"):
        ServerConfig(classifier_from_token=["n", "y"], score_template="{query}")
    with pytest.raises(ValueError, match="'yes' is not a token of the model's tokenizer"):
        _serve(engine, classifier_from_token=["n", "yes"])
