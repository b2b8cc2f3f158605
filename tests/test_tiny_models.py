"""The built-in tiny checkpoints: deterministic, loadable by HF, with a working tokenizer."""

import hashlib
import subprocess
import sys

import pytest
import torch

from actors.engine.tiny import FAMILIES, build_tiny_checkpoint
from actors.engine.tokenizer import load_tokenizer


def digest(path):
    return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()


@pytest.mark.parametrize("family", FAMILIES)
def test_family_builds_and_hf_generates(family, tmp_path):
    from transformers import AutoModelForCausalLM

    path = build_tiny_checkpoint(family, tmp_path / family, seed=0)
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True).eval()
    tok = load_tokenizer(path)
    ids = tok.apply_chat_template([{"role": "user", "content": "hello"}], add_generation_prompt=True)["input_ids"]
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)
        logits = model(torch.tensor([ids])).logits
    assert out.shape[1] > len(ids) and torch.isfinite(logits).all()
    assert logits.shape[-1] == len(tok)  # every id the model emits is a token


def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path):
    a = build_tiny_checkpoint("llama", tmp_path / "a", seed=3)
    b = build_tiny_checkpoint("llama", tmp_path / "b", seed=3)
    c = build_tiny_checkpoint("llama", tmp_path / "c", seed=4)
    assert digest(a) == digest(b) != digest(c)


def test_tokenizer_round_trips_and_renders_chatml(tmp_path):
    path = build_tiny_checkpoint("llama", tmp_path / "m")
    tok = load_tokenizer(path)
    text = "naïve café — 東京 🙂\ttabs\n"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    chat = tok.apply_chat_template(
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}], tokenize=False,
        add_generation_prompt=True,
    )
    assert chat == "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_cli_writes_a_checkpoint(tmp_path):
    out = tmp_path / "cli"
    subprocess.run([sys.executable, "-m", "actors.engine.tiny", "--family", "qwen3", "--out", str(out), "--seed", "1"],
                   check=True, capture_output=True, timeout=120)
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()


def test_the_tiny_qwen2_5_vl_loads_offline_and_hf_generates_from_an_image(tmp_path):
    """Its tokenizer renders an image part as the vision tokens, its image processor (AutoImageProcessor,
    offline) cuts an image into a few dozen patches, and HF's model generates from them."""
    import numpy as np
    from PIL import Image
    from transformers import AutoImageProcessor, Qwen2_5_VLForConditionalGeneration

    from actors.engine.tokenizer import IMAGE_PAD_ID, VISION_END_ID, VISION_START_ID

    path = build_tiny_checkpoint("qwen2_5_vl", tmp_path / "vl", seed=0)
    tok = load_tokenizer(path)
    ids = tok.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}],
                                  add_generation_prompt=True)["input_ids"]
    assert ids.count(IMAGE_PAD_ID) == 1
    assert ids[ids.index(IMAGE_PAD_ID) - 1:ids.index(IMAGE_PAD_ID) + 2] == [VISION_START_ID, IMAGE_PAD_ID, VISION_END_ID]
    image = Image.fromarray(np.random.RandomState(0).randint(0, 256, (100, 150, 3), dtype=np.uint8))
    pixels = AutoImageProcessor.from_pretrained(path, local_files_only=True)(images=[image], return_tensors="pt")
    (t, h, w), = pixels["image_grid_thw"].tolist()
    assert t == 1 and 16 <= h * w <= 144 and pixels["pixel_values"].shape == (h * w, 3 * 2 * 14 * 14)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(path, local_files_only=True).eval()
    assert model.config.vision_config.fullatt_block_indexes == [1] and model.config.vision_config.depth == 3
    pos = ids.index(IMAGE_PAD_ID)
    input_ids = torch.tensor([ids[:pos] + [IMAGE_PAD_ID] * (h * w // 4) + ids[pos + 1:]])
    with torch.no_grad():
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=4, do_sample=False,
                             pixel_values=pixels["pixel_values"], image_grid_thw=pixels["image_grid_thw"],
                             mm_token_type_ids=(input_ids == IMAGE_PAD_ID).int())
    assert out.shape[1] == input_ids.shape[1] + 4 and int(out.max()) < len(tok)
