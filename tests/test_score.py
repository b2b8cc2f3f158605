"""Scores (``actors.engine.pooling``'s classifier from two tokens): a score equals HF's
sigmoid(logit_true - logit_false) at the prompt's last position, batched beside an embedding and a
generation and chunked, with only the generation's row through the ``lm_head``; on TP 2 with the two
tokens in different ranks' vocabulary shards; on a PD prefill worker alone."""

import asyncio

import pytest

from actors.engine import Engine
from tests.parity import assert_greedy_parity, hf_classifier_score
from tests.test_embeddings import GREEDY, embed, engine, path, prompt  # noqa: F401 (fixtures)

TOKENS = [20, 30]  # a classifier's "false" and "true" token ids


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
