"""Videos (``video_data``, chat's ``video_url`` parts) on the tiny Qwen2.5-VL and Qwen3-VL: greedy tokens and
logprobs equal HF's for a video prompt, a mixed image + video one and Qwen3-VL's timestamped frames; M-RoPE's
temporal ids are HF's ``get_rope_index``'s; the same video hits the prefix cache; TP 2 and PD workers take videos
as images; ``limit_mm_per_prompt`` and bad input are refused; the server takes a video as its frames' image URLs
and answers a video file without its decoder with a 400 naming it."""

import asyncio
import base64
import importlib.machinery
import importlib.util
import io
import json
import math
import shutil
import sys
import types

import numpy as np
import pytest
import torch
from PIL import Image

from actors.engine import Engine
from actors.engine.models.qwen2_5_vl import VisionTransformer
from actors.engine.multimodal import MultimodalProcessor
from actors.engine.tiny import build_tiny_checkpoint
from actors.engine.tokenizer import VIDEO_PAD_ID, load_tokenizer
from actors.engine.video import VideoProcessor
from tests.parity import assert_greedy_parity, hf_image_inputs, hf_model
from tests.pd_helpers import close_workers, make_pair, run_pd
from tests.test_engine_vl import engine  # noqa: F401 (a fixture)
from tests.test_engine_vl import MAX_NEW, encodings_per_rank, image

PARAMS = dict(max_new_tokens=MAX_NEW, temperature=0, return_logprob=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_tiny_checkpoint("qwen2_5_vl", tmp_path_factory.mktemp("qwen2_5_vl")))


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    return str(build_tiny_checkpoint("qwen3_vl", tmp_path_factory.mktemp("qwen3_vl")))


def frames(num_frames: int, height: int, width: int, seed: int) -> np.ndarray:
    return np.random.RandomState(seed).randint(0, 256, (num_frames, height, width, 3), dtype=np.uint8)


def chat(tokenizer, text: str, media=("video",)) -> str:
    parts = [{"type": kind} for kind in media] + [{"type": "text", "text": text}]
    return tokenizer.apply_chat_template([{"role": "user", "content": parts}], tokenize=False,
                                         add_generation_prompt=True)


def generate(engine: Engine, prompts, videos, images=None):
    """Greedy results of ``prompts`` with their ``videos`` (and ``images``), checked against HF's tokens and
    logprobs."""
    outs = engine.generate(prompt=prompts, image_data=images, video_data=videos, sampling_params=PARAMS)
    assert_greedy_parity(engine.config.model_path, [engine.tokenizer.encode(p) for p in prompts],
                         [o["output_ids"] for o in outs], MAX_NEW, engine.eos_token_ids,
                         logprobs=[[lp for lp, _ in o["meta_info"]["output_token_logprobs"]] for o in outs],
                         images=images, videos=videos)
    return outs


def test_videos_and_a_mixed_image_and_video_prompt_equal_hf_and_the_video_matters(engine):
    """14 frames of 60 x 90 (a uint8 array): 7 temporal patches of 4 x 6 (56 x 84 pixels), 42 tokens, HF's
    temporal ids 0, 0, 0, 1, 1, 1, 2 (tokens_per_second · 2 / 24 fps a patch, truncated); 5 frames as PIL images
    (padded to 6 with the last); a batch with a video, another video, a video + image + video prompt and text."""
    tokenizer = engine.tokenizer
    pil = [Image.fromarray(f) for f in frames(5, 80, 50, 2)]
    prompts = [chat(tokenizer, "what?"), chat(tokenizer, "what?"),
               chat(tokenizer, "mixed", ("video", "image", "video")), chat(tokenizer, "text", ())]
    a, b, _, _ = generate(engine, prompts, [[frames(14, 60, 90, 0)], [frames(14, 60, 90, 1)],
                                            [frames(14, 60, 90, 0), pil], None],
                          images=[None, None, [image(70, 70, 3)], None])
    assert a["meta_info"]["prompt_tokens"] == len(tokenizer.encode(prompts[0])) - 1 + 42
    assert a["meta_info"]["output_token_logprobs"] != b["meta_info"]["output_token_logprobs"]


def test_video_mrope_positions_equal_hfs_get_rope_index(engine):
    """Qwen2.5-VL's temporal ids tokens_per_second · second_per_grid_t apart (truncated as HF's fp32 products),
    between images and text; the delta is HF's."""
    ids = [5, VIDEO_PAD_ID, 6, engine.mm_processor.image_token_id, VIDEO_PAD_ID, 7]
    videos, images = [frames(14, 60, 90, 0), frames(3, 100, 40, 1)], [image(60, 200, 2)]
    _, mm_inputs = engine.mm_processor.process(ids, images, videos)
    inputs = hf_image_inputs(engine.config.model_path, ids, images, videos)
    positions, delta = hf_model(engine.config.model_path).model.get_rope_index(
        inputs["input_ids"], inputs["mm_token_type_ids"], inputs["image_grid_thw"], inputs["video_grid_thw"],
        inputs["second_per_grid_ts"])
    assert torch.equal(mm_inputs.mrope_positions, positions[:, 0])
    assert mm_inputs.mrope_position_delta == int(delta)
    assert mm_inputs.mrope_positions[0, 1:43].unique().numel() == 3  # (the 7 patches' temporal ids: 0, 1, 2)


def test_the_same_video_hits_the_prefix_cache_and_another_does_not(engine):
    prompt = chat(engine.tokenizer, "same")
    start = engine.tokenizer.encode(prompt).index(VIDEO_PAD_ID)
    video = frames(6, 60, 60, 5)
    other = video.copy()
    other[-1, 0, 0] ^= 255  # (one pixel of the last frame)
    first, again, changed = (engine.generate(prompt=prompt, video_data=[v], sampling_params=PARAMS)
                             for v in (video, video, other))
    assert again["output_ids"] == first["output_ids"]
    assert again["meta_info"]["cached_tokens"] == first["meta_info"]["prompt_tokens"] - 1
    assert changed["meta_info"]["cached_tokens"] == start


def test_limit_mm_per_prompt_and_bad_videos_are_refused(model_dir):
    engine = Engine(model_dir, max_total_tokens=512, limit_mm_per_prompt={"video": 1})
    two = chat(engine.tokenizer, "two", ("video", "video"))
    with pytest.raises(ValueError, match=r"At most 1 video\(s\) may be provided in one prompt, not 2"):
        engine.generate(prompt=two, video_data=[frames(2, 56, 56, 0), "not a video"])
    with pytest.raises(ValueError, match=r"1 video\(s\) in video_data but 2 video pad token"):
        engine.generate(prompt=two, video_data=[frames(2, 56, 56, 0)])
    with pytest.raises(ValueError, match="frames are of one size"):
        engine.generate(prompt=chat(engine.tokenizer, "one"), video_data=[[image(56, 56, 0), image(60, 56, 1)]])
    with pytest.raises(ValueError, match="a video is its frames"):
        engine.generate(prompt=chat(engine.tokenizer, "one"), video_data=[frames(2, 56, 56, 0).astype(np.float32)])
    engine.check_integrity()
    engine.shutdown()


def test_tp2_encodes_a_video_once_per_rank_and_equals_hf(model_dir, monkeypatch):
    encoded, _ = encodings_per_rank(monkeypatch, VisionTransformer, lambda pixels, grid: grid)
    engine = Engine(model_dir, max_total_tokens=2048, tp_size=2, chunked_prefill_size=8)
    generate(engine, [chat(engine.tokenizer, "tp"), chat(engine.tokenizer, "text", ())], [[frames(8, 60, 90, 6)], None])
    assert len(encoded) == 2 and all(grids == [(4, 4, 6)] for grids in encoded.values())
    engine.check_integrity()
    engine.shutdown()


def test_a_video_through_pd_workers_equals_hf(model_dir):
    prefill, decode = make_pair(model_dir, prefill_args=dict(chunked_prefill_size=8))
    tokenizer, video = load_tokenizer(model_dir), frames(8, 60, 90, 7)
    prompt = tokenizer.encode(chat(tokenizer, "pd"))
    processor = MultimodalProcessor.for_model(model_dir, prefill.runner.model_config, prefill.runner.model)
    ids, mm_inputs = processor.process(prompt, [], [video])
    final, _, _ = asyncio.run(run_pd(prefill, decode, ids, PARAMS, mm_inputs=mm_inputs))
    assert_greedy_parity(model_dir, [prompt], [final["output_ids"]], MAX_NEW, decode.eos_token_ids,
                         logprobs=[[lp for lp, _ in final["meta_info"]["output_token_logprobs"]]], videos=[[video]])
    close_workers(prefill, decode)


def test_qwen3_vl_timestamped_frames_equal_hf(qwen3_dir):
    """Qwen3-VL's processor samples 2 frames a second of given frames (taken at HF's 24 fps: 4 of 14, its
    min_frames) and writes each temporal patch after its timestamp (HF's _calculate_timestamps of them), between
    vision start and end tokens; tokens and logprobs are HF's."""
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    engine = Engine(qwen3_dir, max_total_tokens=2048)
    video = frames(14, 60, 90, 8)
    out, = generate(engine, [chat(engine.tokenizer, "when?")], [[video]])
    req = engine._make_req({}, chat(engine.tokenizer, "when?"), None, None, video_data=[video])
    text = engine.tokenizer.decode(req.origin_input_ids_unpadded)
    indices = np.linspace(0, 13, 4).round().astype(int)
    times = Qwen3VLProcessor._calculate_timestamps(None, indices, 24, 2)
    assert [f"<{t:.1f} seconds>" in text for t in times] == [True, True] and text.count("<|vision_start|>") == 3
    assert len(req.mm_inputs.images) == 2 and all(item.grid_thw[0] == 1 for item in req.mm_inputs.images)
    engine.check_integrity()
    engine.shutdown()


def test_chat_video_frames_and_generate_video_data_equal_the_engines_answer(engine):
    """A video_url part of chat (and of /v1/responses, /generate's video_data) of its frames' data URLs answers
    as the engine does to the frames; a video file without PyAV, more videos than limit_mm_per_prompt, and a
    video_url of another shape are 400s naming why."""
    import httpx

    from cluster.config import ServerConfig
    from cluster.http_server import BackgroundServer
    from cluster.server import build_app
    from tests import test_openai_compat as compat

    pil = [Image.fromarray(f) for f in frames(4, 60, 90, 9)]
    urls = []
    for frame in pil:
        png = io.BytesIO()
        frame.save(png, format="PNG")
        urls.append("data:image/png;base64," + base64.b64encode(png.getvalue()).decode())
    want = engine.generate(prompt=chat(engine.tokenizer, "what?"), video_data=[pil], sampling_params=PARAMS)

    def body(*videos):
        parts = [{"type": "video_url", "video_url": {"url": video}} for video in videos]
        return {"model": compat.MODEL, "max_tokens": MAX_NEW, "temperature": 0, "logprobs": True,
                "messages": [{"role": "user", "content": parts + [{"type": "text", "text": "what?"}]}]}

    backend = compat.EngineBackend(engine, 2048)
    backend.limit_mm_per_prompt = {"video": 1}
    with BackgroundServer(build_app(backend, engine.tokenizer, ServerConfig()), "127.0.0.1", 0) as server:
        def post(path, json):
            return httpx.post(server.url + path, json=json, timeout=60)

        chat_answer = post("/v1/chat/completions", body(urls))
        native = post("/generate", {"text": chat(engine.tokenizer, "what?"), "video_data": [urls],
                                    "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0}})
        response = post("/v1/responses", {"model": compat.MODEL, "max_output_tokens": MAX_NEW, "temperature": 0,
                                          "input": [{"role": "user", "content": [
                                              {"type": "video_url", "video_url": {"url": urls}},
                                              {"type": "input_text", "text": "what?"}]}]})
        video_file = post("/v1/chat/completions", body("data:video/mp4;base64,AAAA"))
        two = post("/v1/chat/completions", body(urls, urls))
        shape = post("/v1/chat/completions", body(5))
    assert chat_answer.status_code == 200, chat_answer.text
    assert chat_answer.json()["choices"][0]["message"]["content"] == want["text"]
    got = [t["logprob"] for t in chat_answer.json()["choices"][0]["logprobs"]["content"]]
    assert got == pytest.approx([lp for lp, _ in want["meta_info"]["output_token_logprobs"]], abs=1e-5)
    assert native.status_code == 200 and native.json()["output_ids"] == want["output_ids"]
    assert response.status_code == 200, response.text  # (vLLM's Responses API takes chat's video_url parts)
    assert response.json()["output"][-1]["content"][0]["text"] == want["text"]
    if importlib.util.find_spec("av") is None:
        assert video_file.status_code == 400
        assert "needs PyAV (the 'av' package)" in video_file.json()["error"]["message"]
    assert two.status_code == 400 and "At most 1 video(s)" in two.json()["error"]["message"]
    assert shape.status_code == 400 and "a video's URL or a list of its frames' image URLs" in \
        shape.json()["error"]["message"]


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_a_video_of_one_frame_twice_is_hfs_image_processors_image(model_dir, qwen3_dir, family):
    """HF's image processor tiles an image temporal_patch_size times: the same frame twice, at a rate (no
    sampling), is that image's grid and pixels (normalization, patch layout), the video budget taking it whole.
    (A frame of a grid's size: the image processor here is HF's PIL backend, whose resize is not torchvision's.)"""
    from transformers import AutoImageProcessor

    path = model_dir if family == "qwen2_5_vl" else qwen3_dir
    frame = frames(1, 56, 84, 11)[0] if family == "qwen2_5_vl" else frames(1, 64, 96, 11)[0]
    hf = AutoImageProcessor.from_pretrained(path, local_files_only=True)(images=[Image.fromarray(frame)],
                                                                       return_tensors="pt")
    ours = VideoProcessor.from_pretrained(path, qwen3=family == "qwen3_vl")({"frames": np.stack([frame] * 2),
                                                                             "fps": 2})
    assert [list(ours.grid_thw)] == hf["image_grid_thw"].tolist()
    torch.testing.assert_close(ours.pixel_values, hf["pixel_values"], atol=1e-6, rtol=0)


def test_a_checkpoint_without_a_video_config_takes_its_image_processors_pixels(model_dir, tmp_path):
    """Qwen2.5-VL's checkpoints ship no video_preprocessor_config.json: HF's video processor loads
    preprocessor_config.json, whose min_pixels / max_pixels are a frame's pixel range (not the class's 128 · 28²
    to 768 · 28²): 120 x 180 frames are 112 x 168 within 112 · 168 pixels, not 280 x 392 over 128 · 28²."""
    from transformers.video_processing_utils import BaseVideoProcessor

    shutil.copytree(model_dir, tmp_path, dirs_exist_ok=True)
    (tmp_path / "video_preprocessor_config.json").unlink()
    config = json.loads((tmp_path / "preprocessor_config.json").read_text())
    del config["size"]
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(dict(config, min_pixels=56 * 56,
                                                                       max_pixels=112 * 168)))
    hf, _ = BaseVideoProcessor.get_video_processor_dict(str(tmp_path), local_files_only=True)
    ours = VideoProcessor.from_pretrained(str(tmp_path), qwen3=False)
    assert ours.size == {"shortest_edge": hf["min_pixels"], "longest_edge": hf["max_pixels"]}
    assert ours(frames(2, 120, 180, 0)).grid_thw == (1, 8, 12)


def test_a_qwen3_vl_video_is_hfs_video_processors(qwen3_dir):
    """30 bare frames of 50 x 130 through HF's Qwen3VLVideoProcessor's own sample_frames (4 at HF's 24 fps),
    smart_resize (64 x 128), patchify and Qwen3VLProcessor's timestamps, torchvision's part (not installed) stood
    in: its resize of a uint8 tensor on the CPU (resize_image: torch's antialiased bicubic on the uint8 tensor;
    PIL's bicubic is levels apart, a frame enlarged here in height) and normalize ((x - mean) / std)."""
    from types import SimpleNamespace

    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor, smart_resize
    from transformers.video_processing_utils import BaseVideoProcessor
    from transformers.video_utils import VideoMetadata

    saved, _ = BaseVideoProcessor.get_video_processor_dict(qwen3_dir, local_files_only=True)
    names = ("fps", "min_frames", "max_frames", "size", "image_mean", "image_std", "patch_size", "merge_size",
             "temporal_patch_size")
    hf = SimpleNamespace(**{name: saved.get(name, getattr(Qwen3VLVideoProcessor, name)) for name in names})
    video, metadata = frames(30, 50, 130, 12), VideoMetadata(total_num_frames=30)
    indices = Qwen3VLVideoProcessor.sample_frames(hf, metadata)
    h, w = smart_resize(len(indices), 50, 130, hf.temporal_patch_size, hf.patch_size * hf.merge_size,
                        hf.size["shortest_edge"], hf.size["longest_edge"])
    x = torch.nn.functional.interpolate(torch.from_numpy(video[indices]).permute(0, 3, 1, 2).contiguous(), (h, w),
                                        mode="bicubic", antialias=True, align_corners=False)
    mean, std = (torch.tensor(v)[:, None, None] * 255 for v in (hf.image_mean, hf.image_std))
    pixels, *grid = Qwen3VLVideoProcessor.patchify(hf, ((x.float() - mean) / std)[None], hf.patch_size,
                                                   hf.merge_size, hf.temporal_patch_size)
    ours = VideoProcessor.from_pretrained(qwen3_dir, qwen3=True)(video)
    assert (len(indices), h, w) == (4, 64, 128) and list(ours.grid_thw) == grid
    assert ours.timestamps == Qwen3VLProcessor._calculate_timestamps(None, indices, metadata.fps, 2)
    torch.testing.assert_close(ours.pixel_values, pixels[0], atol=1e-6, rtol=0)


def test_cap_pixels_per_frame_bounds_a_frame_as_hfs_qwen3_vl_video_processor(qwen3_dir, tmp_path):
    """A checkpoint's cap_pixels_per_frame (with max_video_tokens 6): 4 frames of 128 x 192 are 64 x 96, HF's
    Qwen3VLVideoProcessor's count of patches (48), not the uncapped 128 x 192 (192)."""
    from types import SimpleNamespace

    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    shutil.copytree(qwen3_dir, tmp_path, dirs_exist_ok=True)
    config = json.loads((tmp_path / "video_preprocessor_config.json").read_text())
    config.update(cap_pixels_per_frame=True, max_video_tokens=6)
    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps(config))
    hf = SimpleNamespace(**config)
    ours = VideoProcessor.from_pretrained(str(tmp_path), qwen3=True)(frames(4, 128, 192, 13))
    assert ours.grid_thw == (2, 4, 6)
    assert math.prod(ours.grid_thw) == Qwen3VLVideoProcessor.get_num_of_video_patches(hf, 4, 128, 192, {})


def test_frames_at_a_known_rate_are_taken_as_they_are(engine):
    """``{"frames": ..., "fps": rate}`` (a decoded file's frames): the same patches as the bare frames, a temporal
    patch the rate's seconds (Qwen2.5-VL's second_per_grid_t) where bare frames are taken at HF's 24 fps."""
    video = frames(8, 56, 56, 10)
    given = engine.mm_processor.video_processor({"frames": video, "fps": 4})
    bare = engine.mm_processor.video_processor(video)
    assert given.grid_thw == bare.grid_thw and torch.equal(given.pixel_values, bare.pixel_values)
    assert (given.seconds_per_grid_t, bare.seconds_per_grid_t) == (2 / 4, 2 / 24)


FAKE_AV = '''
import numpy as np

converted = []  # (the indices of the frames made arrays)
stated_frames = 48  # (the stream's frame count; 0: the file does not state it)

class Frame:
    def __init__(self, index):
        self.index = index

    def to_ndarray(self, format):
        converted.append(self.index)
        return np.full((56, 84, 3), self.index * 5, dtype=np.uint8)

class Packet:
    size = 100

class Stream:
    average_rate = 24

    @property
    def frames(self):
        return stated_frames

class Container:
    streams = type("Streams", (), {"video": [Stream()]})

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def demux(self, stream):
        return (Packet() for _ in range(48))

    def decode(self, stream):
        return (Frame(i) for i in range(48))

def open(file):
    return Container()
'''


def fake_av(monkeypatch) -> types.ModuleType:
    """A stand-in ``av`` module (FAKE_AV: 48 frames at 24 fps), importable until the test ends."""
    av = types.ModuleType("av")
    av.__spec__ = importlib.machinery.ModuleSpec("av", None)
    exec(FAKE_AV, av.__dict__)
    monkeypatch.setitem(sys.modules, "av", av)
    return av


def test_a_video_file_is_decoded_by_pyav_and_sampled_as_vllms_loader(engine, monkeypatch):
    """With ``av`` importable (a stand-in here: 48 frames at 24 fps), a video file's URL answers as the engine does
    to the frames vLLM's loader keeps: video_fps 2 a second of its 2 s, at most video_num_frames, at their rate."""
    import httpx

    from cluster.config import ServerConfig
    from cluster.http_server import BackgroundServer
    from cluster.media_fetch import decode_video
    from cluster.server import build_app
    from tests import test_openai_compat as compat

    fake_av(monkeypatch)
    kept = np.stack([np.full((56, 84, 3), i * 5, dtype=np.uint8) for i in np.linspace(0, 47, 3).round().astype(int)])
    capped, by_fps = decode_video("a.mp4", b"", 3, 2.0), decode_video("a.mp4", b"", 32, 2.0)
    assert np.array_equal(capped["frames"], kept)
    assert (capped["fps"], capped["frames_indices"], capped["total_num_frames"]) == (24, [0, 24, 47], 48)
    assert by_fps["frames_indices"] == [0, 16, 31, 47]
    want = engine.generate(prompt=chat(engine.tokenizer, "what?"), video_data=[{"frames": kept, "fps": 1.5}],
                           sampling_params=PARAMS)  # (Qwen2.5-VL: 3 frames of 48 at 24 fps, 1.5 a second)
    body = {"model": compat.MODEL, "max_tokens": MAX_NEW, "temperature": 0, "messages": [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}, {"type": "text", "text": "what?"}]}]}
    app = build_app(compat.EngineBackend(engine, 2048), engine.tokenizer, ServerConfig(video_num_frames=3))
    with BackgroundServer(app, "127.0.0.1", 0) as server:
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == want["text"]
    assert r.json()["usage"]["prompt_tokens"] == want["meta_info"]["prompt_tokens"]


@pytest.mark.parametrize("stated_frames", [48, 0])
def test_a_video_file_makes_arrays_of_its_kept_frames_only(monkeypatch, stated_frames):
    """Of 48 frames (stated by the stream, or counted from its packets), the 3 kept become arrays and the decode
    stops at the last: not every frame first (an hour's RGB frames would not fit in memory)."""
    from cluster.media_fetch import decode_video

    av = fake_av(monkeypatch)
    av.stated_frames = stated_frames
    video = decode_video("a.mp4", b"", 3, 2.0)
    assert av.converted == [0, 24, 47] == video["frames_indices"] and len(video["frames"]) == 3


def test_qwen3_vl_timestamps_of_a_video_files_frames_are_their_indices_over_its_rate(qwen3_dir, monkeypatch):
    """A decoded file's frames 0, 24 and 47 of 48 at 24 fps: HF's timestamps of them (Qwen3VLProcessor's, given
    the file's metadata), 0.5 s and 1.96 s, not those of 3 frames evenly at 1.5 fps (0.33 s and 1.33 s)."""
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    from cluster.media_fetch import decode_video

    fake_av(monkeypatch)
    video = VideoProcessor.from_pretrained(qwen3_dir, qwen3=True)(decode_video("a.mp4", b"", 3, 2.0))
    assert video.timestamps == Qwen3VLProcessor._calculate_timestamps(None, [0, 24, 47], 24, 2)
