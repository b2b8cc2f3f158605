"""Engine on the tiny Qwen3-VL: its DeepStack features (added after the first decoder layers at the image
tokens), interleaved M-RoPE, Qwen3's q/k norms and 16-pixel patches give HF's
``Qwen3VLForConditionalGeneration`` tokens and logprobs through one and two images, chunked prefill cutting
an image (its DeepStack rows cut with it), a prefix hit past an image, n-gram speculation, TP 2 and PP 2 (the
features sent to the stage whose layers add them)."""

from typing import List

import pytest

from actors.engine import Engine
from actors.engine.models.qwen3_vl import VisionTransformer
from actors.engine.pipeline import PPGroup
from actors.engine.tiny import build_tiny_checkpoint
from actors.engine.tokenizer import IMAGE_PAD_ID
from tests.test_engine_vl import engine  # noqa: F401 (a fixture)
from tests.test_engine_vl import check_one_image, chat, generate, image, tp2_two_images
from tests.tp_helpers import thread_ranks


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_tiny_checkpoint("qwen3_vl", tmp_path_factory.mktemp("qwen3_vl")))


def test_one_image_equals_hf_and_the_image_matters(engine):
    check_one_image(engine, 15)  # (96 x 160 pixels: 6 x 10 patches of 16, 15 tokens)


def test_two_images_and_a_text_request_in_one_batch(engine):
    generate(engine, [chat(engine.tokenizer, "compare", num_images=2), chat(engine.tokenizer, "text")],
             [[image(60, 200, 2), image(150, 90, 3)], None])


def test_chunked_prefill_cuts_an_image_and_its_deepstack_rows_and_a_prefix_hit_past_it(model_dir):
    engine = Engine(model_dir, max_total_tokens=2048, chunked_prefill_size=8)
    prompt, images = chat(engine.tokenizer, "chunks"), [image(100, 150, 7)]
    first = generate(engine, [prompt], [images])[0]
    again = generate(engine, [prompt], [images])[0]
    assert again["output_ids"] == first["output_ids"]
    assert again["meta_info"]["cached_tokens"] > engine.tokenizer.encode(prompt).index(IMAGE_PAD_ID) + 15  # (past it)
    engine.check_integrity()
    engine.shutdown()


def test_ngram_speculation_keeps_hfs_tokens_at_the_interleaved_mrope_delta(model_dir):
    """A verify step of an image request (chunks cutting its image and DeepStack rows) takes its tokens' M-RoPE
    positions past the prompt at the request's delta, under interleaved M-RoPE too: HF's tokens and logprobs,
    drafts accepted."""
    engine = Engine(model_dir, max_total_tokens=2048, chunked_prefill_size=8, speculative_algorithm="ngram",
                    speculative_num_draft_tokens=3)
    generate(engine, [chat(engine.tokenizer, "spec"), chat(engine.tokenizer, "text")], [[image(100, 150, 8)], None],
             max_new_tokens=24)
    assert engine.scheduler.spec_stats.num_accepted_tokens > 0
    engine.check_integrity()
    engine.shutdown()


def test_tp2_equals_hf_each_rank_encoding_an_image_once(model_dir, monkeypatch):
    engine, encoded, _ = tp2_two_images(model_dir, monkeypatch, VisionTransformer)
    assert len(encoded) == 2 and all(grids == [(1, 6, 10), (1, 4, 4)] for grids in encoded.values())
    engine.check_integrity()
    engine.shutdown()


def test_pp2_sends_the_deepstack_features_to_the_stage_that_adds_them(model_dir, monkeypatch):
    """Layer 1 (stage 1) adds the image tokens' second DeepStack features, which stage 0's vision tower computed:
    they cross with the hidden states (chunks of 8 cutting the image: each chunk its rows), and a batch without
    image tokens sends none; HF's tokens and logprobs."""
    received = deepstack_received(monkeypatch)
    thread_ranks(monkeypatch)
    engine = Engine(model_dir, max_total_tokens=2048, pp_size=2, chunked_prefill_size=8)
    try:
        generate(engine, [chat(engine.tokenizer, "pp"), chat(engine.tokenizer, "text")], [[image(100, 150, 7)], None])
        engine.check_integrity()
    finally:
        engine.shutdown()
    assert sum(received) == 15 and 0 in received  # (the image's 15 tokens over its chunks; decode batches none)


def deepstack_received(monkeypatch) -> List[int]:
    """The image rows each :meth:`PPGroup.recv_deepstack` of the test received (0: none)."""
    received, recv = [], PPGroup.recv_deepstack

    def recording(self, *args):
        deepstack = recv(self, *args)
        received.append(0 if deepstack is None else deepstack[0].numel())
        return deepstack

    monkeypatch.setattr(PPGroup, "recv_deepstack", recording)
    return received
