"""Block-wise FP8 checkpoints (DeepSeek-V3's, Qwen3-FP8's layout) served weight-only: tiny checkpoints whose
linear layers are quantized here, in 16 x 16 blocks, against HF over their dequantization (HF's own)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import pytest
import torch

from actors.engine import Engine, fp8
from actors.engine.config import EngineConfig
from actors.engine.model_loader import load_model
from actors.engine.parallel import LinearBase
from actors.engine.tiny import build_tiny_checkpoint
from actors.engine.tp_worker import check_tp_shardable
from tests.parity import assert_greedy_parity
from tests.tp_helpers import thread_ranks

BLOCK = (16, 16)
GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
PROMPTS = [[5, 9, 33, 47, 12, 90, 7], [11] * 20, [3, 200, 150]]
# block size, config overrides: Qwen3's blocks not square (a scale's rows and columns not swapped); DeepSeek-V3
# with its query's low-rank projections too (q_a_proj: replicated, as kv_a_proj_with_mqa)
FAMILIES = {"llama": (BLOCK, {}), "qwen3": ((32, 16), {}), "deepseek_v3": (BLOCK, {"q_lora_rank": 32})}


def is_quantized(name: str) -> bool:
    """The linear layers released FP8 checkpoints quantize (not embeddings, lm_head, norms, routers)."""
    return name.endswith(("proj.weight", "proj_with_mqa.weight"))


def fp8_checkpoint(family: str, root: Path, seed: int = 0, block=BLOCK, skip: Optional[str] = None,
                   build=build_tiny_checkpoint, **overrides):
    """(the checkpoint with its linear weights in block FP8, the same dequantized by HF's function, unquantized).
    ``skip``: a layer-name substring whose layers stay unquantized; ``build``: writes the float checkpoint
    (:func:`build_tiny_checkpoint`'s arguments; a variant's layout)."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    quantized, dequantized = root / "fp8", root / "dequantized"
    for path in (quantized, dequantized):
        build(family, path, seed=seed, **overrides)
    tensors = load_file(str(quantized / "model.safetensors"))
    plain = dict(tensors)
    for name in [n for n in tensors if is_quantized(n) and not (skip and skip in n)]:
        weight, scale = fp8.quantize(tensors[name], block)
        tensors[name], tensors[name.removesuffix("weight") + fp8.SCALE] = weight, scale
        plain[name] = _dequantize_fp8_weight(weight, scale, list(block), torch.float32)
    save_file(tensors, str(quantized / "model.safetensors"))
    save_file(plain, str(dequantized / "model.safetensors"))
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(block)}
    (quantized / "config.json").write_text(json.dumps(config))
    return str(quantized), str(dequantized)


def generate(engine, batch=PROMPTS):
    outs = engine.generate(input_ids=batch, sampling_params=GREEDY)
    engine.check_integrity()
    return [o["output_ids"] for o in outs]


def check_fp8_layers(model, block=BLOCK, dtype=torch.float32):
    """Every linear layer holds 1 byte a weight element and fp32 scales of its blocks; every other
    tensor (embeddings, lm_head, norms, routers) is in the model's ``dtype``. The layers' names."""
    names = []
    for name, module in model.named_modules():
        if isinstance(module, LinearBase):
            rows, cols = module.weight.shape
            assert module.weight.dtype == fp8.FP8 and module.weight.element_size() == 1, name
            assert module.weight_block_size == block
            assert module.weight_scale_inv.dtype == torch.float32
            assert list(module.weight_scale_inv.shape) == [-(-rows // block[0]), -(-cols // block[1])], name
            names.append(name)
    quantized = {id(p) for n in names for p in (model.get_submodule(n).weight, model.get_submodule(n).weight_scale_inv)}
    assert {p.dtype for p in model.parameters() if id(p) not in quantized} == {dtype}
    return names


def ref_outputs(model_path):
    """A TP 1 engine's outputs."""
    engine = Engine(model_path=model_path, skip_tokenizer_init=True, max_total_tokens=512)
    try:
        return generate(engine)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("family", FAMILIES)
def test_fp8_checkpoint_gives_hf_tokens_over_its_dequantization(family, tmp_path):
    block, overrides = FAMILIES[family]
    quantized, dequantized = fp8_checkpoint(family, tmp_path, block=block, **overrides)
    engine = Engine(model_path=quantized, skip_tokenizer_init=True, max_total_tokens=512)
    try:
        outputs = generate(engine)
        names = check_fp8_layers(engine.runner.model, block)
    finally:
        engine.shutdown()
    assert_greedy_parity(dequantized, PROMPTS, outputs, GREEDY["max_new_tokens"])
    if family == "llama":  # a bf16 model: its cast leaves the FP8 weights and their scales alone
        model, _, _ = load_model(quantized, "bfloat16", "cpu")
        assert check_fp8_layers(model, dtype=torch.bfloat16) == names
    if family == "deepseek_v3":  # MLA's projections, dense and expert MLPs, the shared experts; not the gates
        assert {"model.layers.0.self_attn.q_a_proj", "model.layers.0.self_attn.kv_a_proj_with_mqa",
                "model.layers.0.self_attn.kv_b_proj", "model.layers.1.mlp.experts.3.down_proj",
                "model.layers.1.mlp.shared_experts.up_proj"} <= set(names)


@pytest.mark.parametrize("moe_backend", ["torch", "triton"])
def test_fp8_tp2_equals_tp1_and_updates_to_another_fp8_checkpoint(tmp_path, monkeypatch, moe_backend):
    """DeepSeek-V3 (MLA, experts) at TP 2: the scales sharded with their weights' rows / columns; then a
    weight update to another FP8 checkpoint serves HF's tokens over that one's dequantization. The fused
    experts (triton) dequantize in their kernels and take the update through their stacked weights."""
    thread_ranks(monkeypatch)
    quantized, dequantized = fp8_checkpoint("deepseek_v3", tmp_path / "a")
    other, other_dequantized = fp8_checkpoint("deepseek_v3", tmp_path / "b", seed=1)
    engine = Engine(model_path=quantized, skip_tokenizer_init=True, max_total_tokens=512, tp_size=2,
                    moe_backend=moe_backend)
    try:
        assert generate(engine) == ref_outputs(quantized)
        layer = engine.runner.model.model.layers[1]
        attn, down = layer.self_attn, layer.mlp.experts[0].down_proj
        # rank 0's half of the heads (kv_b_proj rows, o_proj columns) and of each expert's intermediate dim
        assert tuple(attn.kv_b_proj.weight_scale_inv.shape) == (4, 2) == tuple(attn.o_proj.weight_scale_inv.shape)
        assert (tuple(down.weight.shape), tuple(down.weight_scale_inv.shape)) == ((64, 16), (4, 1))
        assert (layer.mlp.experts.fused is not None) == (moe_backend == "triton")
        engine.update_weights_from_disk(other, weight_version="fp8-b")
        outs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        assert {o["meta_info"]["weight_version"] for o in outs} == {"fp8-b"}
        engine.check_integrity()
        with pytest.raises(ValueError, match="quantization_config"):  # an unquantized checkpoint: another model
            engine.update_weights_from_disk(other_dequantized)
    finally:
        engine.shutdown()
    assert_greedy_parity(other_dequantized, PROMPTS, [o["output_ids"] for o in outs], GREEDY["max_new_tokens"])


def test_quantization_fp8_quantizes_an_unquantized_checkpoint_as_it_loads(tmp_path):
    """vLLM's --quantization fp8: 128 x 128 blocks (one partial block per tiny matrix), HF's tokens over
    the weights it dequantizes to; an update to another unquantized checkpoint is quantized alike."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    def dequantized(path):
        tensors = load_file(str(Path(path) / "model.safetensors"))
        for name in [n for n in tensors if is_quantized(n)]:
            weight, scale = fp8.quantize(tensors[name], fp8.DYNAMIC_BLOCK)
            tensors[name] = _dequantize_fp8_weight(weight, scale, list(fp8.DYNAMIC_BLOCK), torch.float32)
        save_file(tensors, str(Path(path) / "model.safetensors"))
        return str(path)

    plain, other = (str(build_tiny_checkpoint("qwen3", tmp_path / f"plain{seed}", seed=seed)) for seed in (0, 1))
    refs = [dequantized(build_tiny_checkpoint("qwen3", tmp_path / f"ref{seed}", seed=seed)) for seed in (0, 1)]
    engine = Engine(model_path=plain, skip_tokenizer_init=True, max_total_tokens=512, quantization="fp8")
    try:
        outputs = generate(engine)
        check_fp8_layers(engine.runner.model, fp8.DYNAMIC_BLOCK)
        engine.update_weights_from_disk(other)
        updated = generate(engine)
    finally:
        engine.shutdown()
    assert_greedy_parity(refs[0], PROMPTS, outputs, GREEDY["max_new_tokens"])
    assert_greedy_parity(refs[1], PROMPTS, updated, GREEDY["max_new_tokens"])


def test_quantization_fp8_finds_a_decoder_under_transformers_names(tmp_path):
    """quantization='fp8' on a Qwen3-VL checkpoint naming its decoder model.language_model.* (transformers 4.52 on;
    the served model's model.*): every decoder projection is quantized as it loads (none was, and the model was
    served unquantized: the checkpoint's names were looked up as the served model's)."""
    model, _, _ = load_model(str(build_tiny_checkpoint("qwen3_vl", tmp_path, seed=0)), "float32", "cpu",
                             quantization="fp8")
    decoder = {f"{name}.weight" for name, m in model.named_modules()
               if isinstance(m, LinearBase) and name.startswith("model.layers.")}
    assert decoder and decoder <= set(model.quantized_weights)


def test_fp8_config_errors(tmp_path):
    """Unsupported methods and FP8 variants, a forced quantization the checkpoint contradicts, and a TP
    split that cuts a block, refused by name."""
    def config(**qc):
        return SimpleNamespace(quantization_config=qc)

    with pytest.raises(ValueError, match="quant_method='bitsandbytes' is not supported"):
        fp8.resolve(config(quant_method="bitsandbytes"), None)
    with pytest.raises(ValueError, match="quantization='fp8' but the checkpoint's quantization_config.quant_method"):
        fp8.resolve(config(quant_method="gptq"), "fp8")
    assert fp8.resolve(config(quant_method="fp8"), None) is None  # (per-tensor: compressed_tensors serves it)
    with pytest.raises(ValueError, match="activation_scheme='static'"):
        fp8.resolve(config(quant_method="fp8", activation_scheme="static", weight_block_size=[128, 128]), None)
    assert fp8.resolve(SimpleNamespace(), None) is None

    # llama's k_proj: 2 KV heads of 16 rows; at TP 2 each rank's 16 rows cut a 32-row block
    quantized, _ = fp8_checkpoint("llama", tmp_path, block=(32, 32))
    check_tp_shardable(EngineConfig(model_path=quantized, tp_size=1))
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn.k_proj: this rank's slice \[0, 16\) of dim 0 "
                                         r"of its weight \[32, 64\] cuts a block of weight_block_size \[32, 32\]"):
        check_tp_shardable(EngineConfig(model_path=quantized, tp_size=2))
    config_path = Path(quantized) / "config.json"
    config_json = json.loads(config_path.read_text())
    config_json["quantization_config"] = {"quant_method": "bitsandbytes"}
    config_path.write_text(json.dumps(config_json))
    with pytest.raises(ValueError, match="quant_method='bitsandbytes' is not supported"):
        load_model(quantized, "auto", "cpu")


def test_fp8_layers_updated_from_tensors(tmp_path):
    """SGLang's update_weights_from_tensor on an FP8 checkpoint: a quantized layer's weight comes in FP8 with
    its scales (another FP8 checkpoint's: HF's tokens over its dequantization), or unquantized alone, quantized
    in the served blocks as it loads (HF's tokens over the dequantization of those blocks); an FP8 weight
    without its scales, scales without their FP8 weight, or either on a layer not served in FP8, are refused."""
    from safetensors.torch import load_file

    quantized, dequantized = fp8_checkpoint("llama", tmp_path / "a")
    other, other_dequantized = fp8_checkpoint("llama", tmp_path / "b", seed=1)
    new = load_file(f"{other}/model.safetensors")
    q, scale = "model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.up_proj.weight_scale_inv"
    engine = Engine(model_path=quantized, skip_tokenizer_init=True, max_total_tokens=512)
    try:
        for named, why in (([(q, new[q])], f"{q} is FP8 without its {scale}"),
                           ([(scale, new[scale])], f"{scale} without its FP8 {q}"),
                           ([(scale, new[scale]), (q, new[q].float())], f"{scale} without its FP8 {q}"),
                           ([("model.norm.weight", new["model.norm.weight"].to(fp8.FP8))],
                            "model.norm.weight is FP8 but its layer is not served in FP8")):
            with pytest.raises(ValueError, match=why):
                engine.update_weights_from_tensor(named)
        assert generate(engine) == ref_outputs(quantized)
        engine.update_weights_from_tensor(list(new.items()))
        from_fp8 = generate(engine)
        check_fp8_layers(engine.runner.model)
        engine.update_weights_from_tensor(list(load_file(f"{dequantized}/model.safetensors").items()))
        requantized = generate(engine)
        check_fp8_layers(engine.runner.model)
    finally:
        engine.shutdown()
    assert_greedy_parity(other_dequantized, PROMPTS, from_fp8, GREEDY["max_new_tokens"])
    assert_greedy_parity(dequantized, PROMPTS, requantized, GREEDY["max_new_tokens"])


def test_phi3_fused_tensors_quantize_whole_at_tp1(tmp_path):
    """Phi-3's fused qkv_proj (q 64 rows | k 32 | v 32) and gate_up_proj at TP 1 are one range of rows, however
    the layer lists its parts: its 128 x 128 blocks are the whole tensor's, for a checkpoint in that block
    FP8 and for ``quantization="fp8"`` on the unquantized one (the same blocks), HF's tokens over their
    dequantization either way (a part's boundary inside a block is no cut: nothing is split)."""
    quantized, dequantized = fp8_checkpoint("phi3", tmp_path / "a", block=fp8.DYNAMIC_BLOCK)
    plain = str(build_tiny_checkpoint("phi3", tmp_path / "plain", seed=0))
    for path, quantization in ((quantized, None), (plain, "fp8")):
        engine = Engine(model_path=path, skip_tokenizer_init=True, max_total_tokens=512, quantization=quantization)
        try:
            outputs = generate(engine)
            assert "model.layers.0.self_attn.qkv_proj" in check_fp8_layers(engine.runner.model, fp8.DYNAMIC_BLOCK)
        finally:
            engine.shutdown()
        assert_greedy_parity(dequantized, PROMPTS, outputs, GREEDY["max_new_tokens"])
