"""Engine on the tiny Qwen2.5-VL: image prompts' greedy tokens (and logprobs) equal HF's
``Qwen2_5_VLForConditionalGeneration`` through one and two images, a batch mixed with text
requests, chunked prefill cutting an image, prefix hits on the same image (ending after it
and inside it) and misses on another, retraction, TP 2 and PD workers; bad image input is refused."""

import asyncio
import base64
import collections
import http.server
import io
import logging
import os
import pickle
import shutil
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from actors.engine import Engine
from actors.engine.models.qwen2_5_vl import VisionTransformer
from actors.engine.multimodal import MM_PAD_BASE, MultimodalProcessor
from actors.engine.pipeline import PPMissingLayer
from actors.engine.tiny import build_tiny_checkpoint, make_adapter
from actors.engine.tokenizer import IMAGE_PAD_ID, VL_TOKENIZER_VOCAB_SIZE, load_tokenizer
from tests.lora_helpers import merged_checkpoint
from tests.parity import assert_greedy_parity, hf_image_inputs, hf_model
from tests.pd_helpers import close_workers, make_pair, run_pd
from tests.tp_helpers import pickled_broadcasts, thread_ranks

MAX_NEW = 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_tiny_checkpoint("qwen2_5_vl", tmp_path_factory.mktemp("qwen2_5_vl")))


@pytest.fixture(scope="module")
def text_draft(tmp_path_factory):
    """A draft model for the tiny Qwen2.5-VL: a one-layer text model of its vocabulary (another seed)."""
    return str(build_tiny_checkpoint("qwen3", tmp_path_factory.mktemp("draft"), seed=1,
                                     vocab_size=VL_TOKENIZER_VOCAB_SIZE, num_hidden_layers=1))


@pytest.fixture(scope="module")
def vl_draft(tmp_path_factory):
    """A vision-language draft for the tiny Qwen2.5-VL: another seed's."""
    return str(build_tiny_checkpoint("qwen2_5_vl", tmp_path_factory.mktemp("vl_draft"), seed=1))


def image(height: int, width: int, seed: int) -> Image.Image:
    return Image.fromarray(np.random.RandomState(seed).randint(0, 256, (height, width, 3), dtype=np.uint8))


def chat(tokenizer, text: str, num_images: int = 1) -> str:
    parts = [{"type": "image"}] * num_images + [{"type": "text", "text": text}]
    return tokenizer.apply_chat_template([{"role": "user", "content": parts}], tokenize=False,
                                         add_generation_prompt=True)


def generate(engine: Engine, prompts, images, max_new_tokens: int = MAX_NEW, oracle: Optional[str] = None):
    """Greedy results of ``prompts`` (text) with their ``images`` (a list per prompt, or None), checked
    against HF's tokens and logprobs (``oracle``: the checkpoint HF reads; the engine's by default)."""
    outs = engine.generate(prompt=prompts, image_data=images, sampling_params=dict(
        max_new_tokens=max_new_tokens, temperature=0, return_logprob=True))
    ids = [engine.tokenizer.encode(p) for p in prompts]
    assert_greedy_parity(oracle or engine.config.model_path, ids, [o["output_ids"] for o in outs], max_new_tokens,
                         engine.eos_token_ids, logprobs=[[lp for lp, _ in o["meta_info"]["output_token_logprobs"]]
                                                         for o in outs], images=images)
    return outs


@pytest.fixture
def engine(model_dir):
    engine = Engine(model_dir, max_total_tokens=2048, max_running_requests=8)
    yield engine
    engine.check_integrity()
    engine.shutdown()


def check_one_image(engine: Engine, image_tokens: int) -> None:
    """An image of 100 x 150 pixels is ``image_tokens`` tokens of the prompt; tokens and logprobs are HF's, and
    another image changes the logprobs."""
    a, b = generate(engine, [chat(engine.tokenizer, "what is it?")] * 2, [[image(100, 150, 0)], [image(100, 150, 1)]])
    text_len = len(engine.tokenizer.encode(chat(engine.tokenizer, "what is it?")))
    assert a["meta_info"]["prompt_tokens"] == text_len - 1 + image_tokens
    assert a["meta_info"]["output_token_logprobs"] != b["meta_info"]["output_token_logprobs"]


def test_one_image_equals_hf_and_the_image_matters(engine):
    check_one_image(engine, 20)  # (112 x 140 pixels: 8 x 10 patches of 14, 20 tokens)


def test_two_images_of_different_sizes_in_one_prompt(engine):
    generate(engine, [chat(engine.tokenizer, "compare", num_images=2)], [[image(60, 200, 2), image(150, 90, 3)]])


def test_a_batch_mixing_text_and_image_requests(engine):
    prompts = [chat(engine.tokenizer, "plain text"), chat(engine.tokenizer, "one"), chat(engine.tokenizer, "two", 2),
               chat(engine.tokenizer, "text again")]
    generate(engine, prompts, [None, [image(90, 90, 4)], [image(56, 56, 5), image(120, 80, 6)], None])


def test_chunked_prefill_cuts_an_image_which_is_encoded_once(model_dir, monkeypatch):
    engine = Engine(model_dir, max_total_tokens=2048, chunked_prefill_size=8)
    encoded = []
    visual = engine.runner.model.visual
    monkeypatch.setattr(visual, "forward", lambda pixels, grid: encoded.append(grid) or type(visual).forward(
        visual, pixels, grid))
    generate(engine, [chat(engine.tokenizer, "chunks", 2)], [[image(100, 150, 7), image(90, 90, 8)]])
    assert encoded == [(1, 8, 10), (1, 6, 6)]  # (20 and 9 tokens over 8-token chunks: once each)
    engine.check_integrity()
    engine.shutdown()


@pytest.mark.parametrize("past_start", [0, 20])
def test_a_chunk_ending_at_an_images_first_or_past_its_last_token(model_dir, past_start):
    """Chunks of the image's start (the next chunk starts at its first token) or of its end (the image
    whole in the first chunk, the text after it alone in the next): the image is embedded where its
    tokens are, and only there."""
    tokenizer = load_tokenizer(model_dir)
    prompt = chat(tokenizer, "a boundary")
    engine = Engine(model_dir, max_total_tokens=2048,
                    chunked_prefill_size=tokenizer.encode(prompt).index(IMAGE_PAD_ID) + past_start)
    generate(engine, [prompt], [[image(100, 150, 42)]])  # (20 tokens)
    engine.check_integrity()
    engine.shutdown()


def test_the_vision_tower_equals_hfs_in_one_attention_call_a_block(engine, monkeypatch):
    """Windows cut at the image's edge (a grid of 5 merged columns in windows of 2), two frames (full attention
    over each), a taller grid: the tower's tokens are HF's, each block attending all its windows (or frames) in
    one SDPA call."""
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *args, **kwargs: calls.append(args[0].shape[0]) or sdpa(*args, **kwargs))
    visual, hf_visual = engine.runner.model.visual, hf_model(engine.config.model_path).model.visual
    # (segments a call: windows of 2 x 2 merged tokens, 2 x 3 of them in 4 x 5 or in each frame of 3 x 5, 4 x 2 in
    # 7 x 3; frames)
    for grid, segments in [((1, 8, 10), [6, 1, 6]), ((2, 6, 10), [12, 2, 12]), ((1, 14, 6), [8, 1, 8])]:
        pixels = torch.randn(grid[0] * grid[1] * grid[2], 3 * 2 * 14 * 14, generator=torch.Generator().manual_seed(0))
        calls.clear()
        with torch.no_grad():
            got = visual(pixels, grid)
        assert calls == segments
        want = hf_visual(pixels, grid_thw=torch.tensor([grid])).pooler_output
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("ids, sizes", [
    ([IMAGE_PAD_ID, 5, 6], [(200, 60)]),  # an image first, taller than wide
    ([5, IMAGE_PAD_ID], [(60, 200)]),  # an image last: no text after it
    ([IMAGE_PAD_ID, 7, IMAGE_PAD_ID, 8, 9], [(60, 200), (150, 150)]),
])
def test_mrope_positions_equal_hfs_get_rope_index(engine, ids, sizes):
    images = [image(h, w, i) for i, (h, w) in enumerate(sizes)]
    _, mm_inputs = engine.mm_processor.process(ids, images)
    inputs = hf_image_inputs(engine.config.model_path, ids, images)
    positions, delta = hf_model(engine.config.model_path).model.get_rope_index(
        inputs["input_ids"], inputs["mm_token_type_ids"], inputs["image_grid_thw"])
    assert torch.equal(mm_inputs.mrope_positions, positions[:, 0])
    assert mm_inputs.mrope_position_delta == int(delta)


@pytest.mark.parametrize("page_size", [1, 16])
def test_the_same_image_hits_the_prefix_cache_and_another_does_not(model_dir, page_size):
    engine = Engine(model_dir, max_total_tokens=2048, page_size=page_size)
    prompt = chat(engine.tokenizer, "same question")
    image_start = engine.tokenizer.encode(prompt).index(IMAGE_PAD_ID)
    first, = generate(engine, [prompt], [[image(100, 150, 9)]])
    again, = generate(engine, [prompt], [[image(100, 150, 9)]])
    other, = generate(engine, [prompt], [[image(100, 150, 10)]])
    prompt_len = first["meta_info"]["prompt_tokens"]
    assert again["output_ids"] == first["output_ids"]
    assert again["meta_info"]["cached_tokens"] == (prompt_len - 1) // page_size * page_size  # past the image
    assert other["meta_info"]["cached_tokens"] == image_start // page_size * page_size  # the text before it
    engine.check_integrity()
    engine.shutdown()


def test_a_prefix_hit_ending_inside_an_image_computes_the_rest_of_it(model_dir):
    """Another question about the same image: the hit is whole 16-token pages, the last one ending
    inside the image's 20 tokens; the rest of the image is embedded from its encoding."""
    engine = Engine(model_dir, max_total_tokens=2048, page_size=16)
    photo = image(100, 150, 11)
    generate(engine, [chat(engine.tokenizer, "first question")], [[photo]])
    out, = generate(engine, [chat(engine.tokenizer, "a second one")], [[photo]])
    start = engine.tokenizer.encode(chat(engine.tokenizer, "a second one")).index(IMAGE_PAD_ID)
    assert start < out["meta_info"]["cached_tokens"] < start + 20
    engine.check_integrity()
    engine.shutdown()


def test_retracted_image_requests_are_encoded_again(model_dir):
    engine = Engine(model_dir, max_total_tokens=160, max_running_requests=6, chunked_prefill_size=-1)
    prompts = [chat(engine.tokenizer, f"q{i}") for i in range(6)]
    generate(engine, prompts, [[image(56, 56, 20 + i)] for i in range(6)], max_new_tokens=40)
    assert engine.scheduler.num_retractions > 0
    engine.check_integrity()
    engine.shutdown()


@pytest.mark.parametrize("algorithm, draft", [("ngram", None), ("draft_model", "text_draft"),
                                              ("draft_model", "vl_draft")])
def test_speculative_decoding_of_image_requests_keeps_hfs_tokens(model_dir, request, algorithm, draft):
    """n-gram and draft-model speculation on image requests (with a text one, chunks cutting the images): a
    verify step's M-RoPE positions are its tokens' past the prompt, at the request's delta; the drafts read an
    image's tokens as the image token (the n-gram index and a text-only draft: never a pad value, out of every
    vocabulary), and only the target sees the images, the draft at its own positions. A vision-language draft
    (a smaller Qwen2.5-VL: its vocabulary in its text config) drafts as a text one. Tokens and logprobs are
    HF's, drafts proposed (n-gram's accepted too: the tiny model repeats itself)."""
    args = dict(speculative_algorithm=algorithm, speculative_num_draft_tokens=3)
    if draft is not None:
        args["speculative_draft_model_path"] = request.getfixturevalue(draft)
    engine = Engine(model_dir, max_total_tokens=2048, chunked_prefill_size=16, **args)
    prompts = [chat(engine.tokenizer, "spec"), chat(engine.tokenizer, "two", 2), chat(engine.tokenizer, "text")]
    generate(engine, prompts, [[image(100, 150, 50)], [image(60, 60, 51), image(90, 90, 52)], None], max_new_tokens=24)
    stats = engine.scheduler.spec_stats
    assert stats.num_drafts > 0 and (algorithm == "draft_model" or stats.num_accepted_tokens > 0)
    if algorithm == "ngram":  # (an output ending as the text before the image: the image's tokens follow it)
        req = engine._make_req({}, prompts[0], None, None, image_data=[image(100, 150, 50)])
        start = req.origin_input_ids_unpadded.index(IMAGE_PAD_ID)
        req.output_ids = req.origin_input_ids[start - 2:start]
        assert engine.scheduler._ngram_draft(req, 3) == [IMAGE_PAD_ID] * 3
    engine.check_integrity()
    engine.shutdown()


def encodings_per_rank(monkeypatch, vision_cls, key) -> Tuple[Dict[str, list], List[Any]]:
    """Ranks as threads, the followers getting rank 0's broadcasts pickled: each rank's vision tower calls
    (``key(pixels, grid)`` of each), by the rank's thread (rank 0's the engine loop's), and the broadcasts."""
    thread_ranks(monkeypatch)
    sent = pickled_broadcasts(monkeypatch)
    encoded = collections.defaultdict(list)
    forward = vision_cls.forward
    monkeypatch.setattr(vision_cls, "forward", lambda self, pixels, grid: encoded[
        threading.current_thread().name].append(key(pixels, grid)) or forward(self, pixels, grid))
    return encoded, sent


def tp2_two_images(model_dir: str, monkeypatch, vision_cls) -> Tuple[Engine, Dict[str, list], List[Any]]:
    """A TP 2 engine (chunks of 8) that served two images and a text request in one batch (HF's tokens and
    logprobs), each rank's encoded grids and the broadcasts."""
    encoded, sent = encodings_per_rank(monkeypatch, vision_cls, lambda pixels, grid: grid)
    engine = Engine(model_dir, max_total_tokens=2048, tp_size=2, chunked_prefill_size=8)
    generate(engine, [chat(engine.tokenizer, "tp", 2), chat(engine.tokenizer, "text")],
             [[image(100, 150, 12), image(60, 60, 13)], None])
    return engine, encoded, sent


def test_tp2_equals_hf_and_each_rank_encodes_an_image_once_per_prefill(model_dir, monkeypatch):
    """The follower gets each chunk's batch pickled (its images without rank 0's embedding): it keeps the
    embeddings it encoded across chunks, is sent an image's pixels once, and drops the embeddings when the
    prefill ends."""
    engine, encoded, sent = tp2_two_images(model_dir, monkeypatch, VisionTransformer)
    once = [(1, 8, 10), (1, 4, 4)]  # (20 and 4 tokens over 8-token chunks)
    assert len(encoded) == 2 and all(grids == once for grids in encoded.values())
    pixels = [item.grid_thw for msg in sent if getattr(msg, "fields", None) and msg.fields["mm_items"]
              for items in msg.fields["mm_items"] for item in items if item.pixel_values is not None]
    assert pixels == once
    engine.check_integrity()
    assert engine.tp_group.followers[0]._images.embeddings == {} and engine.tp_group.worker._images.held == {}
    engine.shutdown()


def test_tp2_retracted_image_requests_are_encoded_again_on_every_rank(model_dir, monkeypatch):
    """A retraction drops rank 0's embeddings and, at the next batch, the follower's: both encode again."""
    encoded, _ = encodings_per_rank(monkeypatch, VisionTransformer, lambda pixels, grid: pixels.sum().item())
    engine = Engine(model_dir, max_total_tokens=160, max_running_requests=6, chunked_prefill_size=-1, tp_size=2,
                    disable_radix_cache=True, schedule_policy="fcfs")  # (a retracted request encodes its image again)
    prompts = [chat(engine.tokenizer, f"q{i}") for i in range(6)]
    generate(engine, prompts, [[image(56, 56, 20 + i)] for i in range(6)], max_new_tokens=40)
    assert engine.scheduler.num_retractions > 0
    rank0, rank1 = encoded.values()
    assert rank0 == rank1 and len(rank0) > 6
    engine.check_integrity()
    engine.shutdown()


def test_pp2_equals_hf_with_the_vision_tower_on_the_first_stage_only(model_dir, monkeypatch):
    """The decoder's layers are the text config's; the first stage (the input embeddings' reader)
    encodes the images, the last holds no vision tower."""
    thread_ranks(monkeypatch)
    engine = Engine(model_dir, max_total_tokens=2048, pp_size=2, chunked_prefill_size=16)
    try:
        generate(engine, [chat(engine.tokenizer, "pp"), chat(engine.tokenizer, "text")], [[image(90, 90, 4)], None])
        engine.check_integrity()
        assert isinstance(engine.tp_group.followers[0].runner.model.visual, PPMissingLayer)
    finally:
        engine.shutdown()


def first_chunk_at_tp2(model_dir: str, monkeypatch, rid: str):
    """A TP 2 engine (chunks of 8, the loop paused) that ran an image request's first chunk, which encoded its
    image on both ranks: the engine, the request's output (a join) and its image's item on rank 0."""
    from tests.test_weight_updates import run_in_thread, wait_for

    encoded, _ = encodings_per_rank(monkeypatch, VisionTransformer, lambda pixels, grid: grid)
    engine = Engine(model_dir, max_total_tokens=2048, tp_size=2, chunked_prefill_size=8)
    engine.pause_generation("in_place")  # (the loop steps no more: the test takes the first chunk itself)
    out = run_in_thread(engine.generate, prompt=chat(engine.tokenizer, rid), image_data=[image(100, 150, 15)],
                        rid=rid, sampling_params={"max_new_tokens": 4})
    wait_for(lambda: engine.loop.held_rids() == [rid])
    engine.loop.run_exclusive(engine.scheduler.step)
    item = engine.scheduler.chunked_req.mm_inputs.images[0]
    assert len(encoded) == 2 and item.embedding is not None
    return engine, out, item


def test_tp2_an_image_request_aborted_between_chunks_leaves_no_embedding_on_any_rank(model_dir, monkeypatch):
    """Its first chunk encodes the image on both ranks; aborted before the next, its embeddings go on rank 0
    (released with the request) and on the follower (dropped at the next exchange)."""
    engine, out, item = first_chunk_at_tp2(model_dir, monkeypatch, "abort")
    assert engine.abort("abort")
    engine.continue_generation()
    assert out()["meta_info"]["finish_reason"]["type"] == "abort"
    engine.check_integrity()
    assert item.embedding is None and engine.tp_group.followers[0]._images.embeddings == {}
    engine.shutdown()


def test_tp2_an_image_request_failed_between_chunks_leaves_no_embedding_on_any_rank(model_dir, monkeypatch):
    """A step failing after its first chunk (past the ranks' forward: the group stays whole) fails the request:
    its embeddings go as an abort's, on rank 0 and on the follower."""
    engine, out, item = first_chunk_at_tp2(model_dir, monkeypatch, "fail")

    def fail_once(reqs, logits):
        del engine.scheduler._process_prefill
        raise RuntimeError("the step failed")

    engine.scheduler._process_prefill = fail_once
    engine.continue_generation()
    with pytest.raises(RuntimeError, match="the step failed"):
        out()
    engine.check_integrity()
    assert item.embedding is None and engine.tp_group.followers[0]._images.embeddings == {}
    engine.shutdown()


def test_every_image_form_is_the_same_image(engine, tmp_path):
    photo = image(80, 120, 14)
    png = io.BytesIO()
    photo.save(png, format="PNG")
    path = tmp_path / "photo.png"
    path.write_bytes(png.getvalue())
    url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    prompt = chat(engine.tokenizer, "forms")
    outs = [engine.generate(prompt=prompt, image_data=[form], sampling_params={"max_new_tokens": MAX_NEW,
                                                                                "temperature": 0})
            for form in (photo, png.getvalue(), str(path), url)]
    assert all(o["output_ids"] == outs[0]["output_ids"] for o in outs)
    assert [o["meta_info"]["cached_tokens"] for o in outs[1:]] == [outs[0]["meta_info"]["prompt_tokens"] - 1] * 3


def test_bad_image_input_is_a_value_error_and_loses_nothing(engine, tmp_path):
    prompt = chat(engine.tokenizer, "bad")
    with pytest.raises(ValueError, match="cannot be decoded"):
        engine.generate(prompt=prompt, image_data=[b"not an image"])
    with pytest.raises(ValueError, match="2 image\\(s\\) in image_data but 1 image pad token"):
        engine.generate(prompt=prompt, image_data=[image(50, 50, 15), image(50, 50, 16)])
    with pytest.raises(ValueError, match="neither a data URL nor a file"):
        engine.generate(prompt=prompt, image_data=["ftp://example.com/cat.png"])
    with pytest.raises(ValueError, match="base64 does not decode"):
        engine.generate(prompt=prompt, image_data=["data:image/png;base64,%%%"])
    engine.check_integrity()
    text = build_tiny_checkpoint("qwen3", tmp_path / "qwen3")
    plain = Engine(str(text), max_total_tokens=512)
    with pytest.raises(ValueError, match="not a vision-language model"):
        plain.generate(prompt="hi", image_data=[image(50, 50, 17)])
    plain.check_integrity()
    plain.shutdown()


def test_more_images_than_limit_mm_per_prompt_are_refused_before_any_is_decoded(model_dir):
    """vLLM's limit_mm_per_prompt: a prompt of more images is a ValueError naming it, before any image is
    decoded (the second is no image), processed inputs (a PD worker's, the server's) held to it too."""
    engine = Engine(model_dir, max_total_tokens=512, limit_mm_per_prompt={"image": 1})
    prompt = chat(engine.tokenizer, "two", num_images=2)
    with pytest.raises(ValueError, match=r"At most 1 image\(s\) may be provided in one prompt, not 2"):
        engine.generate(prompt=prompt, image_data=[image(50, 50, 0), b"not an image"])
    unlimited = MultimodalProcessor.for_model(model_dir, engine.runner.model_config, engine.runner.model)
    ids, mm_inputs = unlimited.process(engine.tokenizer.encode(prompt), [image(50, 50, 0), image(60, 60, 1)])
    with pytest.raises(ValueError, match=r"At most 1 image\(s\)"):
        engine.generate(input_ids=ids, image_data=mm_inputs)
    one = engine.generate(prompt=chat(engine.tokenizer, "one"), image_data=[image(50, 50, 0)],
                          sampling_params={"max_new_tokens": 2})
    assert len(one["output_ids"]) == 2
    engine.check_integrity()
    engine.shutdown()


def test_weights_under_transformers_names_load_and_update_the_decoder_and_the_vision_tower(engine, tmp_path):
    """transformers (4.52 on) names the tensors model.language_model.* and model.visual.* (a trainer's
    named_parameters, a checkpoint it saved), the released checkpoints (and the served model) model.* and
    visual.*: an update from tensors or from disk, and a start, take both (they were unexpected tensors)."""
    named = {name: p.detach() * 0.5 for name, p in hf_model(engine.config.model_path).named_parameters()}
    assert {name.split(".")[1] for name in named if name.startswith("model.")} == {"language_model", "visual"}
    assert engine.update_weights_from_tensor(list(named.items())).success
    served = engine.runner.model.state_dict()
    assert torch.equal(served["visual.blocks.0.attn.qkv.weight"], named["model.visual.blocks.0.attn.qkv.weight"])
    assert torch.equal(served["model.layers.1.mlp.down_proj.weight"],
                       named["model.language_model.layers.1.mlp.down_proj.weight"])
    with pytest.raises(ValueError, match="named twice"):
        engine.update_weights_from_tensor({"model.norm.weight": served["model.norm.weight"],
                                           "model.language_model.norm.weight": served["model.norm.weight"]})
    saved = tmp_path / "saved"
    shutil.copytree(engine.config.model_path, saved, ignore=shutil.ignore_patterns("*.safetensors"))
    save_file({name: t.contiguous() for name, t in named.items()}, str(saved / "model.safetensors"))
    params = {"max_new_tokens": MAX_NEW, "temperature": 0, "return_logprob": True}
    want = engine.generate(prompt=chat(engine.tokenizer, "updated"), image_data=[image(60, 60, 41)],
                           sampling_params=params)
    started = Engine(str(saved), max_total_tokens=512)
    assert started.update_weights_from_disk(str(saved)).success
    got = started.generate(prompt=chat(engine.tokenizer, "updated"), image_data=[image(60, 60, 41)],
                           sampling_params=params)
    assert got["meta_info"]["output_token_logprobs"] == want["meta_info"]["output_token_logprobs"]
    started.check_integrity()
    started.shutdown()


def test_an_adapter_on_the_language_model_equals_hf_on_the_merged_checkpoint(model_dir, tmp_path, caplog):
    """A PEFT adapter of every decoder layer's projections (transformers' model.language_model.* names) serves beside
    the base model: an image request under it and one without, in one batch, each get HF's tokens and logprobs on
    their checkpoint (the adapter merged in), which differ; the same adapter under the released names (model.*),
    loaded at runtime, is the same adapter. Its vision tower's modules, as vLLM's, are ignored with a warning
    naming them: the adapter with them serves as the one without."""
    path = make_adapter(model_dir, tmp_path / "sql", rank=4, alpha=8, seed=1)
    tensors = load_file(str(path / "adapter_model.safetensors"))
    assert all(".model.language_model.layers." in key for key in tensors)
    merged = merged_checkpoint(model_dir, path, tmp_path / "merged")
    old = shutil.copytree(path, tmp_path / "old")
    save_file({key.replace(".language_model.", "."): t for key, t in tensors.items()},
              str(old / "adapter_model.safetensors"))
    engine = Engine(model_dir, max_total_tokens=2048, lora_paths={"sql": str(path)})
    engine.load_lora_adapter("old", str(old))
    prompt, images = chat(engine.tokenizer, "what is it?"), [image(100, 150, 0)]
    outs = engine.generate(prompt=[prompt] * 3, image_data=[images] * 3, lora_path=[None, "sql", "old"],
                           sampling_params=dict(max_new_tokens=MAX_NEW, temperature=0, return_logprob=True))
    for checkpoint, out in zip([model_dir, merged], outs):
        assert_greedy_parity(checkpoint, [engine.tokenizer.encode(prompt)], [out["output_ids"]], MAX_NEW,
                             engine.eos_token_ids, images=[images],
                             logprobs=[[lp for lp, _ in out["meta_info"]["output_token_logprobs"]]])
    assert outs[0]["output_ids"] != outs[1]["output_ids"] and outs[2]["output_ids"] == outs[1]["output_ids"]
    vision = shutil.copytree(path, tmp_path / "vision")
    save_file({**tensors, "base_model.model.model.visual.blocks.0.attn.qkv.lora_A.weight": torch.ones(4, 32),
               "base_model.model.model.visual.blocks.0.attn.qkv.lora_B.weight": torch.ones(96, 4)},
              str(vision / "adapter_model.safetensors"))
    with caplog.at_level(logging.WARNING, logger="actors.engine.lora"):
        engine.load_lora_adapter("vision", str(vision))
    assert "'vision': its vision tower's modules (model.visual.blocks.0.attn.qkv) are ignored" in caplog.text
    out = engine.generate(prompt=prompt, image_data=images, lora_path="vision",
                          sampling_params=dict(max_new_tokens=MAX_NEW, temperature=0))
    assert out["output_ids"] == outs[1]["output_ids"]
    engine.check_integrity()
    engine.shutdown()


def test_image_tokens_hold_pad_values_out_of_the_vocabulary(engine):
    """The prefix cache's keys: the image's tokens hold its pad value, the same for the same pixels."""
    req = engine._make_req({}, chat(engine.tokenizer, "key"), None, None, image_data=[image(100, 150, 18)])
    pads = [t for t in req.origin_input_ids if t >= MM_PAD_BASE]
    assert len(pads) == 20 and len(set(pads)) == 1
    assert req.origin_input_ids_unpadded.count(IMAGE_PAD_ID) == 20 and max(req.origin_input_ids_unpadded) < MM_PAD_BASE
    same = engine._make_req({}, chat(engine.tokenizer, "key"), None, None, image_data=[image(100, 150, 18)])
    assert same.origin_input_ids == req.origin_input_ids


def test_async_generate_takes_images_and_a_follower_gets_them_without_rank_0s_embedding(engine):
    prompt, images = chat(engine.tokenizer, "async"), [image(100, 150, 19)]
    params = {"max_new_tokens": MAX_NEW, "temperature": 0}
    want = engine.generate(prompt=prompt, image_data=images, sampling_params=params)
    got = asyncio.run(engine.async_generate(prompt=prompt, image_data=images, sampling_params=params))
    assert got["output_ids"] == want["output_ids"]
    req = engine._make_req({}, prompt, None, None, image_data=images)
    item = req.mm_inputs.images[0]
    item.embedding = engine.runner.model.encode_image(item)
    sent = pickle.loads(pickle.dumps(item))  # (what a TP follower's batch holds)
    assert sent.embedding is None and item.embedding is not None
    assert torch.equal(sent.pixel_values, item.pixel_values) and sent.grid_thw == item.grid_thw


def test_image_requests_through_pd_workers_equal_hf(model_dir, text_draft):
    """The tokenizer side's padded prompt and mm_inputs go to both workers: the prefill worker encodes the
    images over its chunks, the decode worker decodes at the M-RoPE delta, speculating with a text draft (its
    KV of a transferred prompt computed on arrival, the images' tokens read as the image token); a second
    request on the same image hits the prefill side's cache past it."""
    prefill, decode = make_pair(model_dir, prefill_args=dict(chunked_prefill_size=8), decode_args=dict(
        speculative_algorithm="draft_model", speculative_draft_model_path=text_draft))
    processor = MultimodalProcessor.for_model(model_dir, prefill.runner.model_config, prefill.runner.model)
    tokenizer, params = load_tokenizer(model_dir), dict(max_new_tokens=MAX_NEW, temperature=0, return_logprob=True)
    for text, images in (("pd", [image(100, 150, 30), image(90, 90, 31)]), ("again", [image(100, 150, 30)])):
        prompt = tokenizer.encode(chat(tokenizer, text, len(images)))
        ids, mm_inputs = processor.process(prompt, images)
        final, notice, _ = asyncio.run(run_pd(prefill, decode, ids, params, mm_inputs=mm_inputs))
        assert_greedy_parity(model_dir, [prompt], [final["output_ids"]], MAX_NEW, decode.eos_token_ids,
                             logprobs=[[lp for lp, _ in final["meta_info"]["output_token_logprobs"]]], images=[images])
    assert notice["cached_tokens"] > prompt.index(IMAGE_PAD_ID) + 20  # (the second: past its image)
    assert decode.scheduler.spec_stats.num_drafts > 0
    sides = [w._make_req(params, "own", ids, mm_inputs=mm_inputs).mm_inputs.images[0] for w in (prefill, decode)]
    assert len({id(item) for item in sides + mm_inputs.images}) == 3  # (each side's request its own item)
    close_workers(prefill, decode)


def test_requests_made_of_one_processed_input_each_have_their_own_items(engine):
    """One processed input made into several requests in a process (n samples through an in-process
    backend) gives each its own image items, the pixels shared: items shared, their embeddings were too,
    one request's release dropping another's while it prefills (across engines: a PD pair's two sides).
    Both answer HF's tokens."""
    images = [image(100, 150, 21)]
    prompt = engine.tokenizer.encode(chat(engine.tokenizer, "twice"))
    ids, mm_inputs = engine.mm_processor.process(prompt, images)
    items = [engine._make_req({}, None, ids, None, image_data=mm_inputs).mm_inputs.images[0] for _ in range(2)]
    assert len({id(item) for item in items + mm_inputs.images}) == 3
    assert all(item.pixel_values is mm_inputs.images[0].pixel_values for item in items)  # (shells, not pixels)
    outs = engine.generate(input_ids=[ids, ids], image_data=[mm_inputs, mm_inputs], sampling_params=dict(
        max_new_tokens=MAX_NEW, temperature=0, return_logprob=True))
    assert_greedy_parity(engine.config.model_path, [prompt] * 2, [o["output_ids"] for o in outs], MAX_NEW,
                         engine.eos_token_ids, logprobs=[[lp for lp, _ in o["meta_info"]["output_token_logprobs"]]
                                                         for o in outs], images=[images, images])


def test_chat_completions_and_generate_with_images_equal_the_engines_answer(engine):
    """The server's tokenizer side processes the data URLs of a chat's image_url parts, a response's
    input_image parts and /generate's image_data (the backend gets the padded prompt and the images): the
    answer is the engine's own to the same image; a bad image (named), one not in a URL (a path: the server reads
    no file but a file:// URL's under allowed_local_media_path, unset here) or in another scheme's (ftp), an
    image_url part of another shape than OpenAI's, or more images than the workers' limit_mm_per_prompt is a 400."""
    import httpx

    from cluster.config import ServerConfig
    from cluster.http_server import BackgroundServer
    from cluster.server import build_app
    from tests import test_openai_compat as compat

    photo, png = image(100, 150, 40), io.BytesIO()
    photo.save(png, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    want = engine.generate(prompt=chat(engine.tokenizer, "what?"), image_data=[photo],
                           sampling_params={"max_new_tokens": MAX_NEW, "temperature": 0, "return_logprob": True})

    def body(url, image_url=None):
        return {"model": compat.MODEL, "max_tokens": MAX_NEW, "temperature": 0, "logprobs": True, "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": image_url or {"url": url}},
                                         {"type": "text", "text": "what?"}]}]}

    def responses_body(url):
        return {"model": compat.MODEL, "max_output_tokens": MAX_NEW, "temperature": 0, "input": [
            {"role": "user", "content": [{"type": "input_image", "image_url": url, "detail": "auto"},
                                         {"type": "input_text", "text": "what?"}]}]}

    backend = compat.EngineBackend(engine, 2048)
    backend.limit_mm_per_prompt = {"image": 1}  # (the workers' limit_mm_per_prompt: the server refuses more)
    app = build_app(backend, engine.tokenizer, ServerConfig())
    with BackgroundServer(app, "127.0.0.1", 0) as server:
        r = httpx.post(server.url + "/v1/chat/completions", json=body(url), timeout=60)
        assert r.status_code == 200, r.text
        bad = httpx.post(server.url + "/v1/chat/completions", json=body("data:image/png;base64,AAAA"), timeout=60)
        path = httpx.post(server.url + "/v1/chat/completions", json=body("/etc/hostname"), timeout=60)
        # (OpenAI's image_url is an object: a bare string, or a url not a string, was a 500, an AttributeError)
        shapes = [httpx.post(server.url + "/v1/chat/completions", json=body(None, image_url), timeout=60)
                  for image_url in (url, {"url": 5})]
        two = httpx.post(server.url + "/generate", json={"text": chat(engine.tokenizer, "two?", 2),
                                                         "image_data": [url, url]}, timeout=60)
        response = httpx.post(server.url + "/v1/responses", json=responses_body(url), timeout=60)
        not_data = httpx.post(server.url + "/v1/responses", json=responses_body("ftp://example.com/a.png"),
                              timeout=60)
        native = httpx.post(server.url + "/generate", json={
            "text": chat(engine.tokenizer, "what?"), "image_data": [url],
            "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0}}, timeout=60)
    assert r.json()["choices"][0]["message"]["content"] == want["text"]
    got = [t["logprob"] for t in r.json()["choices"][0]["logprobs"]["content"]]
    assert got == pytest.approx([lp for lp, _ in want["meta_info"]["output_token_logprobs"]], abs=1e-5)
    assert r.json()["usage"]["prompt_tokens"] == want["meta_info"]["prompt_tokens"]
    # (the Responses API's input_image parts are chat's image_url parts)
    assert response.status_code == 200 and response.json()["output"][0]["content"][0]["text"] == want["text"]
    assert response.json()["usage"]["input_tokens"] == want["meta_info"]["prompt_tokens"]
    assert not_data.status_code == 400 and not_data.json()["error"]["param"] == "input"
    assert "'ftp://example.com/a.png': an image is a data URL" in not_data.json()["error"]["message"]
    assert bad.status_code == 400 and "'data:image/png;base64,AAAA': image_data: the image cannot be decoded" in \
        bad.json()["error"]["message"]
    assert path.status_code == 400 and "'/etc/hostname': an image is a data URL" in path.json()["error"]["message"]
    assert [r.status_code for r in shapes] == [400, 400]
    assert all("image_url is an object with a url string" in r.json()["error"]["message"] for r in shapes)
    assert two.status_code == 400 and "At most 1 image(s)" in two.json()["error"]["message"]
    assert two.json()["error"]["param"] == "image_data"
    assert native.status_code == 200, native.text
    assert native.json()["output_ids"] == want["output_ids"]


class ImageHandler(http.server.BaseHTTPRequestHandler):
    """A local image host: /cat.png the PNG, /gate.png the PNG once two requests wait for it at once (a request's
    images fetched one after another never pass), /slow.png past any fetch timeout, /big.png too large,
    /away.png a redirect to localhost (another host name), /made.png the PNG with a 201, anything else a 404."""

    png, gate, release = b"", None, None

    def do_GET(self):
        try:
            self.serve()
        except (BrokenPipeError, ConnectionResetError):  # (the server dropped the fetch: another one failed)
            pass

    def serve(self):
        if self.path == "/gate.png":
            try:
                self.gate.wait()
            except threading.BrokenBarrierError:
                return self.send_error(500)
        if self.path == "/slow.png":
            self.release.wait(30)
        if self.path == "/away.png":
            self.send_response(302)
            self.send_header("Location", f"http://localhost:{self.server.server_port}/cat.png")
            return self.end_headers()
        body = {"/cat.png": self.png, "/gate.png": self.png, "/big.png": self.png + b"0" * 2048,
                "/made.png": self.png}.get(self.path)
        if body is None:
            return self.send_error(404)
        self.send_response(201 if self.path == "/made.png" else 200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def image_host(handler) -> http.server.ThreadingHTTPServer:
    """``handler``'s host on a free local port, serving on a daemon thread (shutdown and server_close it)."""
    host = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    host.daemon_threads = True
    threading.Thread(target=host.serve_forever, daemon=True).start()
    return host


def media_dir(tmp_path, png: bytes):
    """``tmp_path``/media holding cat.png (``png``), and the same image outside it, ``tmp_path``/outside.png."""
    media = tmp_path / "media"
    media.mkdir()
    (media / "cat.png").write_bytes(png)
    (tmp_path / "outside.png").write_bytes(png)
    return media


def test_http_and_file_image_urls_are_fetched_by_the_server_and_failures_are_400s_naming_them(engine, tmp_path):
    """vLLM's media fetching: an http URL's image (two of a request fetched at once) and a file:// one under
    allowed_local_media_path answer as the engine does to the image itself; a 404, a domain (or a redirect to
    one) not in allowed_media_domains, a download past image_fetch_timeout_s or max_image_fetch_bytes, a file://
    URL outside the allowed path (or through ..), a path and a URL that does not parse are each a 400 naming the
    URL, at once; limit_mm_per_prompt unset, more than vLLM's 999 images are a 400 before any is fetched."""
    import httpx

    from cluster.config import ServerConfig
    from cluster.http_server import BackgroundServer
    from cluster.server import build_app
    from tests import test_openai_compat as compat

    photo, png = image(100, 150, 40), io.BytesIO()
    photo.save(png, format="PNG")
    media = media_dir(tmp_path, png.getvalue())
    want = engine.generate(prompt=chat(engine.tokenizer, "what?"), image_data=[photo],
                           sampling_params={"max_new_tokens": MAX_NEW, "temperature": 0})

    def body(*urls):
        parts = [{"type": "image_url", "image_url": {"url": url}} for url in urls]
        return {"model": compat.MODEL, "max_tokens": MAX_NEW, "temperature": 0,
                "messages": [{"role": "user", "content": parts + [{"type": "text", "text": "what?"}]}]}

    handler = type("Handler", (ImageHandler,), dict(png=png.getvalue(), gate=threading.Barrier(2, timeout=10),
                                                    release=threading.Event()))
    images = image_host(handler)
    host = f"http://127.0.0.1:{images.server_port}"
    config = ServerConfig(image_fetch_timeout_s=0.5, allowed_media_domains=["127.0.0.1"],
                          allowed_local_media_path=str(media), max_image_fetch_bytes=1024 + len(png.getvalue()))
    app = build_app(compat.EngineBackend(engine, 2048), engine.tokenizer, config)
    try:
        with BackgroundServer(app, "127.0.0.1", 0) as server:
            def post(*urls):
                return httpx.post(server.url + "/v1/chat/completions", json=body(*urls), timeout=60)

            answers = [post(url) for url in (f"{host}/cat.png", f"file://{media}/cat.png")]
            two = post(f"{host}/gate.png", f"{host}/gate.png")
            many = post(*[f"{host}/missing.png"] * 1000)  # (limit_mm_per_prompt unset: vLLM's 999)
            started = time.monotonic()
            refused = {url: post(f"{host}/cat.png", url) for url in (
                f"{host}/missing.png", f"http://localhost:{images.server_port}/cat.png", f"{host}/away.png",
                f"{host}/slow.png", f"{host}/big.png", f"file://{tmp_path}/outside.png",
                f"file://{media}/../outside.png", str(media / "cat.png"), "http://[::1/cat.png")}
            elapsed = time.monotonic() - started
    finally:
        handler.release.set()
        images.shutdown()
        images.server_close()
    for r in answers:
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == want["text"]
    assert two.status_code == 200, two.text
    # (the second image's tokens and its <|vision_start|>, <|vision_end|>)
    assert two.json()["usage"]["prompt_tokens"] == want["meta_info"]["prompt_tokens"] + 20 + 2
    assert many.status_code == 400 and "At most 999 image(s)" in many.json()["error"]["message"], many.text
    reasons = ["HTTP 404", "not in the server's allowed_media_domains", "not in the server's allowed_media_domains",
               "server.image_fetch_timeout_s", "server.max_image_fetch_bytes", "allowed_local_media_path",
               "allowed_local_media_path", "a data URL", "InvalidURL"]
    for (url, r), reason in zip(refused.items(), reasons):
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages", (url, r.text)
        assert repr(url) in r.json()["error"]["message"] and reason in r.json()["error"]["message"], (url, r.text)
    assert elapsed < 10  # (the slow image's 30 s: cut at 0.5)
    with pytest.raises(ValueError, match="is not an existing directory"):  # (vLLM's check at start)
        ServerConfig(allowed_local_media_path=str(media / "cat.png"))


def test_image_downloads_share_one_client_whose_connection_stays_open_across_requests():
    """One HTTP client serves every request's downloads (vLLM's global connection): three requests' images from
    a keep-alive host take one connection (a client a request was 25 ms and more of the event loop's and a
    connection each), and it keeps no cookie (one request's would go with another client's); aclose (the
    server's shutdown) closes it, and a later download opens another."""
    from actors.engine.media_connector import MediaFetcher

    png = io.BytesIO()
    image(20, 20, 0).save(png, format="PNG")
    connections, cookies = [], []

    class Handler(ImageHandler):
        protocol_version = "HTTP/1.1"

        def setup(self):
            connections.append(self.client_address)
            super().setup()

        def end_headers(self):  # (every answer sets a cookie; each request's Cookie header noted)
            cookies.append(self.headers.get("Cookie"))
            self.send_header("Set-Cookie", "session=one-client")
            super().end_headers()

    Handler.png = png.getvalue()
    images = image_host(Handler)
    url = f"http://127.0.0.1:{images.server_port}/cat.png"

    async def requests(fetcher: MediaFetcher) -> List[list]:
        got = [await fetcher.fetch_all([url], "messages") for _ in range(3)]
        await fetcher.aclose()
        got.append(await fetcher.fetch_all([url], "messages"))
        await fetcher.aclose()
        return got

    fetcher = MediaFetcher()
    try:
        got = asyncio.run(requests(fetcher))
    finally:
        images.shutdown()
        images.server_close()
    assert got == [[png.getvalue()]] * 4
    assert len(connections) == 2  # (the three requests' one, then the one after aclose)
    assert cookies == [None] * 4


def test_engine_generate_fetches_http_and_file_image_urls_by_the_servers_rules(model_dir, tmp_path):
    """vLLM's LLM.generate and SGLang's Engine fetch an image URL themselves (were refused): an http URL and a
    file:// one under allowed_local_media_path answer as the image itself, in generate (a batch's URLs) and
    async_generate; the engine's rules are the server's, its own fields named: a domain not in
    allowed_media_domains, a download past max_image_fetch_bytes, a file outside the allowed path are ValueErrors
    naming the URL, nothing queued."""
    photo, png = image(60, 90, 42), io.BytesIO()
    photo.save(png, format="PNG")
    media = media_dir(tmp_path, png.getvalue())
    handler = type("Handler", (ImageHandler,), dict(png=png.getvalue()))
    images = image_host(handler)
    host = f"http://127.0.0.1:{images.server_port}"
    engine = Engine(model_dir, max_total_tokens=512, allowed_media_domains=["127.0.0.1"],
                    allowed_local_media_path=str(media), max_image_fetch_bytes=1024 + len(png.getvalue()))
    prompt, params = chat(engine.tokenizer, "what?"), {"max_new_tokens": MAX_NEW, "temperature": 0}
    try:
        want = engine.generate(prompt=prompt, image_data=[photo], sampling_params=params)["output_ids"]
        batch = engine.generate(prompt=[prompt, prompt], image_data=[[f"{host}/cat.png"], [f"file://{media}/cat.png"]],
                                sampling_params=params)
        awaited = asyncio.run(engine.async_generate(prompt=prompt, image_data=[f"{host}/cat.png"],
                                                    sampling_params=params))
        for url, reason in ((f"http://localhost:{images.server_port}/cat.png", "engine's allowed_media_domains"),
                            (f"{host}/big.png", "engine.max_image_fetch_bytes"),
                            (f"file://{tmp_path}/outside.png", "engine's allowed_local_media_path")):
            with pytest.raises(ValueError, match=reason) as refused:
                engine.generate(prompt=prompt, image_data=[url], sampling_params=params)
            assert f"image_data: cannot fetch the image {url!r}" in str(refused.value)
    finally:
        images.shutdown()
        images.server_close()
    assert [o["output_ids"] for o in batch] == [want, want] and awaited["output_ids"] == want
    engine.check_integrity()
    engine.shutdown()


def test_schemes_in_any_case_and_any_2xx_answer_give_the_image():
    """URL schemes are case-insensitive (RFC 3986): DATA: and HTTP:// URLs are images as data: and http:// ones;
    a download answered with any 2xx (a 201 here) is its body's image, as vLLM's (were 400s)."""
    from actors.engine.media_connector import MediaFetcher
    from cluster.media_fetch import decoded

    photo, png = image(30, 40, 41), io.BytesIO()
    photo.save(png, format="PNG")
    handler = type("Handler", (ImageHandler,), dict(png=png.getvalue()))
    images = image_host(handler)
    urls = [f"HTTP://127.0.0.1:{images.server_port}/cat.png", f"http://127.0.0.1:{images.server_port}/made.png",
            "DATA:image/png;base64," + base64.b64encode(png.getvalue()).decode()]

    async def fetch(fetcher: MediaFetcher) -> list:
        try:
            return await fetcher.fetch_all(urls, "image_data")
        finally:
            await fetcher.aclose()

    try:
        got = decoded(urls, asyncio.run(fetch(MediaFetcher())))
    finally:
        images.shutdown()
        images.server_close()
    assert [np.asarray(pil).tolist() for pil in got] == [np.asarray(photo).tolist()] * 3


def test_a_file_url_of_a_device_a_fifo_or_a_link_loop_is_a_400_naming_it(tmp_path):
    """file:// under allowed_local_media_path reads regular files only, the limit's bytes at most: /dev/zero (its
    size 0) was read until the server's memory ran out, a FIFO's open blocked a thread for good. A link loop
    (a 500) and a NUL byte (a 400 naming neither URL nor param) are refused as any other. Each a ValueError naming
    the URL (the server's 400); a file past max_image_fetch_bytes too."""
    from actors.engine.media_connector import MediaFetcher

    os.mkfifo(tmp_path / "fifo.png")
    (tmp_path / "big.png").write_bytes(b"0" * 2048)
    (tmp_path / "loop.png").symlink_to(tmp_path / "loop.png")
    for allowed, url, reason in (("/dev", "file:///dev/zero", "not a regular file"),
                                 (tmp_path, f"file://{tmp_path}/fifo.png", "not a regular file"),
                                 (tmp_path, f"file://{tmp_path}/big.png", "more than 1024 bytes"),
                                 (tmp_path, f"file://{tmp_path}/loop.png", "Symlink loop|Too many levels"),
                                 (tmp_path, f"file://{tmp_path}/a%00.png", "null byte")):
        with pytest.raises(ValueError, match=reason) as refused:
            asyncio.run(MediaFetcher(allowed_local_media_path=str(allowed), max_bytes=1024).fetch_all([url], "image_data"))
        assert str(refused.value).startswith(f"image_data: cannot fetch the image {url!r}")
