"""Engine on the tiny Qwen3-VL-MoE (Qwen3-VL's vision tower and DeepStack, a dense first layer, then the sparse
block with its experts in 3-D tensors): greedy tokens and logprobs of an image and a text request equal HF's
``Qwen3VLMoeForConditionalGeneration`` from the checkpoint transformers 5 saves ([experts, out, in]), and from
one in the released layout ([experts, in, out], read transposed) at TP 2 on the fused MoE backend and at EP 2
on the eager one; a weight update takes the experts in either layout, a square matrix by who saved the
checkpoint. A LoRA adapter over the stacked experts is refused, naming them, as is a quantized checkpoint (FP8,
GPTQ) or quantization='fp8', naming the format."""

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from actors.engine import Engine
from actors.engine.model_loader import build_served_model, load_config
from actors.engine.tiny import build_tiny_checkpoint, make_adapter
from tests.test_engine_vl import chat, generate, image
from tests.tp_helpers import thread_ranks

STACKED = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_tiny_checkpoint("qwen3_vl_moe", tmp_path_factory.mktemp("qwen3_vl_moe")))


@pytest.fixture(scope="module")
def released_dir(model_dir, tmp_path_factory):
    return released(model_dir, tmp_path_factory.mktemp("released"))


def released(model_dir, out) -> str:
    """The checkpoint of ``model_dir`` in ``out`` with its experts' matrices stored as released ([experts, in, out])
    and its config.json saying transformers 4 saved it, as a released one's does."""
    shutil.copytree(model_dir, out, dirs_exist_ok=True, ignore=shutil.ignore_patterns("*.safetensors"))
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "transformers_version": "4.57.0.dev0"}))
    tensors = load_file(f"{model_dir}/model.safetensors")
    assert sum(name.endswith(STACKED) for name in tensors) == 4  # (layers 1 and 2)
    save_file({name: t.transpose(1, 2).contiguous() if name.endswith(STACKED) else t for name, t in tensors.items()},
              str(out / "model.safetensors"))
    return str(out)


def image_and_text(engine: Engine) -> None:
    """An image request and a text one in a batch, chunks of 8 cutting the image: HF's tokens and logprobs."""
    generate(engine, [chat(engine.tokenizer, "what is it?"), chat(engine.tokenizer, "text")],
             [[image(100, 150, 0)], None])
    engine.check_integrity()
    engine.shutdown()


def test_image_and_text_equal_hf(model_dir):
    image_and_text(Engine(model_dir, max_total_tokens=2048, chunked_prefill_size=8))


@pytest.mark.parametrize("args", [dict(moe_backend="triton"), dict(enable_expert_parallel=True)])
def test_a_released_checkpoint_at_tp2_fused_and_ep2_equals_hf(released_dir, monkeypatch, args):
    """Each rank reads its share of the transposed tensors: every expert's intermediate slice (TP, the fused
    experts), or its experts whole (EP, the eager ones)."""
    thread_ranks(monkeypatch)
    image_and_text(Engine(released_dir, max_total_tokens=2048, chunked_prefill_size=8, tp_size=2, **args))


def test_a_weight_update_takes_the_experts_in_either_layout(model_dir, released_dir):
    engine = Engine(model_dir, max_total_tokens=512)
    experts = engine.runner.model.model.layers[1].mlp.experts
    scaled = {name: t * 0.5 for name, t in load_file(f"{released_dir}/model.safetensors").items()
              if name.endswith(STACKED) and ".layers.1." in name}
    assert engine.update_weights_from_tensor(list(scaled.items())).success
    assert torch.equal(experts.gate_up_proj, scaled["model.language_model.layers.1.mlp.experts.gate_up_proj"].mT)
    assert engine.update_weights_from_disk(released_dir).success
    assert torch.equal(experts.down_proj * 0.5, scaled["model.language_model.layers.1.mlp.experts.down_proj"].mT)
    engine.check_integrity()
    engine.shutdown()


def test_a_square_matrix_is_read_as_the_transformers_that_saved_the_checkpoint_stored_it(tmp_path):
    """moe_intermediate_size 32: gate_up_proj [experts, 64, 64] fits either layout, its shape tells nothing. A
    checkpoint transformers 4 saved (config.json's transformers_version, a released one's) holds it [experts, in,
    out]: read transposed, at load and in an update from disk; one transformers 5 saved, and named tensors, hold
    it [experts, out, in]: read as they are."""
    new = build_tiny_checkpoint("qwen3_vl_moe", tmp_path / "new", moe_intermediate_size=32)
    old = released(new, tmp_path / "old")
    name = "model.language_model.layers.1.mlp.experts.gate_up_proj"
    stored = load_file(str(new / "model.safetensors"))[name]
    assert stored.shape == (4, 64, 64)
    engine = Engine(old, max_total_tokens=512)
    experts = engine.runner.model.model.layers[1].mlp.experts
    assert torch.equal(experts.gate_up_proj, stored)
    for source in (str(new), old):
        assert engine.update_weights_from_tensor([(name, stored * 0.5)]).success
        assert torch.equal(experts.gate_up_proj, stored * 0.5)
        assert engine.update_weights_from_disk(source).success
        assert torch.equal(experts.gate_up_proj, stored)
    engine.check_integrity()
    engine.shutdown()


def test_an_adapter_on_the_stacked_experts_is_refused(model_dir, tmp_path):
    """PEFT's ``target_parameters`` wrapper over a layer's stacked experts: they take no adapter (the attention and
    the dense layer's MLP do)."""
    path = make_adapter(model_dir, tmp_path / "moe", rank=4, alpha=8, targets=("q_proj",))
    experts = "base_model.model.model.language_model.layers.1.mlp.experts"
    save_file({**load_file(str(path / "adapter_model.safetensors")),
               f"{experts}.lora_A.weight": torch.ones(16, 64), f"{experts}.lora_B.weight": torch.ones(48, 16)},
              str(path / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match=r"'moe': model\.layers\.1\.mlp\.experts wraps no MoE experts"):
        Engine(model_dir, max_total_tokens=512, lora_paths={"moe": str(path)})


FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True}


@pytest.mark.parametrize("quant, forced, named", [(FP8, None, "quantization_config.quant_method='fp8'"),
                                                  (GPTQ, None, "quantization_config.quant_method='gptq'"),
                                                  (None, "fp8", "quantization='fp8'")])
def test_a_quantized_checkpoint_is_refused_naming_its_format(model_dir, tmp_path, quant, forced, named):
    """The stacked experts are served in the model's dtype only: a quantized checkpoint's (its experts stored
    otherwise) is refused as the model is built, naming the format, not left to fail (or load unquantized
    experts) as tensors are read."""
    path = shutil.copytree(model_dir, tmp_path / "quantized")
    if quant is not None:
        config = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**config, "quantization_config": quant}))
    with pytest.raises(ValueError, match=rf"{re.escape(named)} is not served for Qwen3VLMoeForConditionalGeneration: "
                                         r"its experts \(model\.layers\.1\.mlp\.experts, \.\.\.\) are stacked"):
        build_served_model(str(path), load_config(str(path)), forced)
