"""The embedding and ``lm_head`` split by vocabulary under TP (``parallel``'s
VocabParallelEmbedding / ParallelLMHead): the vocabulary is padded to a multiple of
64 × tp_size, each rank loads only its rows (the padding zero-filled; a rank may hold
nothing but padding), and the logits — cut back to the real vocabulary — and the
logprobs equal TP 1's and HF's for every family, tied embeddings and Gemma 3's scaled
embedding and final soft cap included. The tiny vocabulary (261) divides by no tp_size.
The ranks are threads of this process (tests.tp_helpers)."""

import random
import threading

import pytest
import torch
from torch.nn import functional as F

from actors.engine import Engine
from actors.engine.model_loader import load_model
from actors.engine.parallel import SINGLE, ParallelLMHead, TPGroup, VocabParallelEmbedding, padded_vocab_size
from actors.engine.tiny import VOCAB_SIZE, build_tiny_checkpoint
from tests.parity import assert_greedy_parity
from tests.tp_helpers import Hub, ThreadGroup, thread_ranks

MAX_NEW = 6


def on_ranks(size, fn):
    """``fn(tp)`` on each rank of a ``size``-rank group of threads; their results in rank order."""
    hub, results, errors = Hub(size), [None] * size, []

    def body(rank):
        try:
            results[rank] = fn(ThreadGroup(rank, size, hub=hub))
        except BaseException as e:  # the other ranks' collectives fail now instead of waiting
            errors.append(e)
            hub.barrier.abort()

    threads = [threading.Thread(target=body, args=(rank,)) for rank in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def test_padded_vocab_is_a_multiple_of_64_per_rank():
    assert [padded_vocab_size(261, tp) for tp in (1, 2, 4)] == [261, 384, 512]
    assert padded_vocab_size(152064, 8) == 152064  # Qwen2.5: already a multiple of 512
    assert padded_vocab_size(129280, 8) == 129536  # DeepSeek-V3
    assert [TPGroup(rank, 4).vocab_shard(261) for rank in range(4)] == [range(0, 128), range(128, 256),
                                                                       range(256, 384), range(384, 512)]


def test_all_gather_concatenates_the_ranks_in_order(monkeypatch):
    """TPGroup's own collective (the threads' group replaces it; the spawned TP 2 engines
    of test_engine_tp run it on gloo)."""
    shards = [torch.full((2, 3), float(rank)) for rank in range(3)]

    def all_gather(parts, x, group):
        assert group == "device group" and torch.equal(x, shards[1])
        for part, shard in zip(parts, shards):
            part.copy_(shard)

    monkeypatch.setattr(torch.distributed, "all_gather", all_gather)
    assert torch.equal(TPGroup(1, 3, group="device group").all_gather(shards[1]), torch.cat(shards, dim=-1))
    assert SINGLE.all_gather(shards[0]) is shards[0]


@pytest.mark.parametrize("vocab, tp_size", [(257, 2), (250, 4), (261, 4)])
def test_sharded_lookup_and_logits_equal_the_whole_vocab(vocab, tp_size):
    """bf16: each token's embedding row is rank 0's bit for bit (the all-reduce adds zeros);
    the gathered logits are the whole matrix product, padding cut off."""
    gen = torch.Generator().manual_seed(vocab)
    weight = torch.randn(vocab, 32, generator=gen).to(torch.bfloat16)
    ids = torch.tensor([0, vocab - 1, 128, 127, 5, 255 % vocab, 200])
    hidden = torch.randn(3, 32, generator=gen).to(torch.bfloat16)

    def rank(tp):
        embed = VocabParallelEmbedding(vocab, 32, tp).to(torch.bfloat16)
        head = ParallelLMHead(32, vocab, tp)
        real = weight[embed.shard.start : embed.shard.stop]  # (empty where the rank holds only padding)
        with torch.no_grad():
            embed.weight.zero_()[: len(real)] = real
            head.weight = embed.weight  # tied
            return embed(ids), head(hidden)

    for x, logits in on_ranks(tp_size, rank):
        assert torch.equal(x, F.embedding(ids, weight))
        assert logits.shape == (3, vocab)
        torch.testing.assert_close(logits, F.linear(hidden, weight), rtol=0, atol=0.05)


@pytest.mark.parametrize("vocab, tp_size", [(261, 1), (261, 2), (250, 4)])
def test_token_logits_are_the_whole_logits_at_those_ids_on_every_rank(vocab, tp_size):
    """A score's logits of two ids per row: each rank dots the rows it holds, the all-reduce gives
    every rank the columns of the whole product, ids on one rank or on two alike."""
    gen = torch.Generator().manual_seed(vocab)
    weight = torch.randn(vocab, 32, generator=gen)
    hidden = torch.randn(3, 32, generator=gen)
    ids = torch.tensor([[0, vocab - 1], [130, 5], [200, 201]])

    def rank(tp):
        head = ParallelLMHead(32, vocab, tp)
        real = weight[head.shard.start : head.shard.stop]
        with torch.no_grad():
            head.weight.zero_()[: len(real)] = real
            return head.token_logits(hidden, ids)

    want = F.linear(hidden, weight).gather(1, ids)
    for logits in on_ranks(tp_size, rank):
        torch.testing.assert_close(logits, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("tie", [False, True])
def test_each_rank_loads_only_its_rows_and_zeros_for_the_padding(tmp_path, tie):
    """TP 4 over 261 tokens: 128 rows a rank; rank 2 holds 5 real rows, rank 3 only padding."""
    from safetensors.torch import load_file

    path = build_tiny_checkpoint("llama", tmp_path / "llama", seed=0, tie_word_embeddings=tie)
    tensors = load_file(path / "model.safetensors")
    real = {"embed": tensors["model.embed_tokens.weight"]}
    real["head"] = real["embed"] if tie else tensors["lm_head.weight"]
    for rank, n_real in enumerate((128, 128, 5, 0)):
        model, _, _ = load_model(str(path), "auto", "cpu", TPGroup(rank, 4))
        start = 128 * rank
        for key, weight in (("embed", model.model.embed_tokens.weight), ("head", model.lm_head.weight)):
            assert weight.shape == (128, 64)
            assert torch.equal(weight[:n_real], real[key][start : start + n_real])
            assert not weight[n_real:].any()
        assert (model.lm_head.weight is model.model.embed_tokens.weight) == tie


FAMILIES = {  # (family, config overrides): Gemma 3 as released, tied, with a soft cap that bends the logits
    "llama": ("llama", {}),
    "deepseek_v3": ("deepseek_v3", {}),
    "qwen3_next": ("qwen3_next", {}),
    "gemma3_tied_softcap": ("gemma3", {"tie_word_embeddings": True, "final_logit_softcapping": 2.0}),
}


def generate(model_dir, tp_size):
    rng = random.Random(0)
    batch = [[rng.randrange(5, VOCAB_SIZE) for _ in range(n)] for n in (3, 14)]
    engine = Engine(model_path=model_dir, skip_tokenizer_init=True, max_total_tokens=512, tp_size=tp_size)
    try:
        params = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True, "return_logprob": True}
        outs = engine.generate(input_ids=batch, sampling_params=params)
    finally:
        engine.shutdown()
    logprobs = [[lp for lp, _ in o["meta_info"]["output_token_logprobs"]] for o in outs]
    return batch, [o["output_ids"] for o in outs], logprobs


@pytest.mark.parametrize("case", list(FAMILIES))
def test_tp2_tokens_and_logprobs_equal_tp1_and_hf(monkeypatch, tmp_path, case):
    thread_ranks(monkeypatch)
    family, overrides = FAMILIES[case]
    model_dir = str(build_tiny_checkpoint(family, tmp_path / case, seed=0, **overrides))
    batch, ref_tokens, ref_logprobs = generate(model_dir, 1)
    _, tokens, logprobs = generate(model_dir, 2)
    assert tokens == ref_tokens
    for ours, ref in zip(logprobs, ref_logprobs):
        assert ours == pytest.approx(ref, abs=1e-4)
    assert_greedy_parity(model_dir, batch, tokens, MAX_NEW, logprobs=logprobs)
