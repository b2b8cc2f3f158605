"""compressed-tensors checkpoints (FP8, int8, packed int4 / int8 weights) and per-tensor FP8 ones served
weight-only: tiny checkpoints quantized here into the saved layouts (tests.compressed_helpers), against HF over
their brute-force dequantization."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from actors.engine import Engine, compressed_tensors
from actors.engine.config import EngineConfig
from actors.engine.model_loader import TensorFile, copy_tensor, load_model
from actors.engine.parallel import ColumnParallelLinear, LinearBase, RowParallelLinear, TPGroup
from actors.engine.tp_worker import check_tp_shardable
from tests.compressed_helpers import brute_force_dequantize, compressed_checkpoint, quantize_layer, scheme
from tests.parity import assert_greedy_parity
from tests.tp_helpers import thread_ranks
from tests.test_wna16_weights import GREEDY, PROMPTS, assert_fused_experts_equal_eager, generate, weight_bytes

ATTENTION, MLP = r"re:.*self_attn\..*", r"re:.*mlp\..*"
FP8_TENSOR = scheme(8, "float", "tensor", format="float-quantized")
# llm-compressor's activations of -FP8-dynamic (FP8 a token, dynamic) and -quantized.w8a8 (int8, a static scale)
FP8_TOKENS = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True, "symmetric": True}
INT8_STATIC = {"num_bits": 8, "type": "int", "strategy": "tensor", "dynamic": False, "symmetric": True}
FP8_CHANNEL = scheme(8, "float", "channel", format="float-quantized", input_activations=FP8_TOKENS)
# family, checkpoint: RedHatAI's -FP8 (quant_method fp8, a scalar scale a layer, static input scales unread;
# AutoFP8's KV-cache kv_scale unread), -FP8-dynamic (a scale an output channel; DeepSeek-V3's MLA projections,
# replicated q_a_proj too, experts and shared experts), -quantized.w8a8 (int8 channels, static input scales; a
# kv_cache_scheme's k_scale / v_scale unread), -quantized.w4a16 (int4 groups for Linear, its group first, but
# attention's regex group, more specific, in 8 bits per channel, asymmetric; o_proj ignored); Phi-3's fused
# qkv_proj and gate_up_proj in asymmetric groups (packed zeros); Qwen3-MoE's experts (torch MoE backend, then
# the fused one), packed int4 groups or -FP8-dynamic's FP8 channels (the experts' down_proj per-tensor, a regex
# group's)
CASES = {
    "llama-fp8-per-tensor-static": ("llama", dict(groups={"g": FP8_TENSOR}, per_tensor_fp8=True, static=True,
                                                  kv_scales=True)),
    "deepseek_v3-fp8-dynamic-channel": ("deepseek_v3", dict(groups={"g": FP8_CHANNEL}, q_lora_rank=32)),
    "llama-w8a8-int8": ("llama", dict(groups={"g": scheme(8, "int", "channel", format="int-quantized",
                                                          input_activations=INT8_STATIC)}, static=True,
                                      kv_scales=True)),
    "llama-w4a16-mixed": ("llama", dict(groups={"default": scheme(4, "int", "group", 32),
                                                "attention": scheme(8, "int", "channel", symmetric=False,
                                                                    targets=[ATTENTION])},
                                        ignore=("lm_head", "re:.*o_proj"))),
    "phi3-w4a16-asym": ("phi3", dict(groups={"g": scheme(4, "int", "group", 16, symmetric=False)})),
    "qwen3_moe-w4a16": ("qwen3_moe", dict(groups={"g": scheme(4, "int", "group", 16)},
                                          ignore=("lm_head", r"re:.*mlp\.gate$"))),
    "qwen3_moe-fp8-dynamic": ("qwen3_moe", dict(groups={"g": FP8_CHANNEL,
                                                        "down": dict(FP8_TENSOR, targets=[r"re:.*experts.*down_proj"],
                                                                     input_activations=FP8_TOKENS)},
                                                ignore=("lm_head", r"re:.*mlp\.gate$"))),
}


def compressed_layers(model) -> dict:
    """Names → schemes of the model's compressed layers; each holds its stored weight (FP8, int8 or int32
    words) and fp32 scales."""
    layers = {}
    for name, module in model.named_modules():
        if isinstance(module, LinearBase) and module.scheme is not None:
            stored = module.weight_packed if module.scheme.packed else module.weight
            assert stored.dtype == {True: torch.int32, False: torch.float8_e4m3fn if module.scheme.type == "float"
                                    else torch.int8}[module.scheme.packed], name
            assert module.weight_scale.dtype == torch.float32, name
            layers[name] = module.scheme
    return layers


def serve(model_path: str):
    """(outputs, logprobs, prefix hits (:func:`generate`), compressed layers) of an engine on ``model_path``."""
    engine = Engine(model_path=model_path, skip_tokenizer_init=True, max_total_tokens=512)
    try:
        return (*generate(engine), compressed_layers(engine.runner.model))
    finally:
        engine.shutdown()


@pytest.mark.parametrize("case", CASES)
def test_compressed_checkpoint_gives_hf_tokens_over_its_dequantization(case, tmp_path, caplog):
    family, spec = CASES[case]
    quantized, dequantized = compressed_checkpoint(family, tmp_path, **spec)
    outputs, logprobs, cached, layers = serve(quantized)
    assert ("KV-cache scales" in caplog.text) == ("kv_scales" in spec)  # (unread, logged)
    # (activations a W8A8 checkpoint quantizes stay in the model's dtype, logged naming the fields)
    activations = ["activation_scheme='static'"] if spec.get("per_tensor_fp8") else [
        f"config_groups[{name!r}].input_activations" for name, group in spec["groups"].items()
        if group["input_activations"]]
    assert ("quantizes the activations too" in caplog.text) == bool(activations)
    assert all(field in caplog.text for field in activations)
    assert_greedy_parity(dequantized, PROMPTS, outputs, GREEDY["max_new_tokens"], logprobs=logprobs)
    assert all(c >= len(p) for c, p in zip(cached, PROMPTS))
    unquantized = "o_proj" if "mixed" in case else None
    projections = {n for n, m in load_model(dequantized, "auto", "cpu")[0].named_modules()
                   if isinstance(m, LinearBase) and not (unquantized and unquantized in n)}
    assert set(layers) == projections  # (never lm_head; Phi-3's fused layers, the experts', whatever is stored)
    if case == "llama-w4a16-mixed":  # (the regex's scheme for attention, Linear's for the MLP)
        assert {(s.num_bits, s.strategy, s.symmetric) for n, s in layers.items()
                if "self_attn" in n} == {(8, "channel", False)}
        assert {(s.num_bits, s.strategy) for n, s in layers.items() if "mlp" in n} == {(4, "group")}
    if family == "deepseek_v3":
        assert {"model.layers.0.self_attn.q_a_proj", "model.layers.0.self_attn.kv_b_proj",
                "model.layers.1.mlp.experts.3.down_proj", "model.layers.1.mlp.shared_experts.up_proj"} <= set(layers)
    if family == "qwen3_moe":
        assert "model.layers.0.mlp.experts.3.down_proj" in layers
        if "fp8" in case:
            assert layers["model.layers.0.mlp.experts.3.down_proj"].strategy == "tensor"
        assert_fused_experts_equal_eager(quantized, outputs, logprobs)


def test_compressed_weights_take_their_stored_bytes(tmp_path):
    """A bf16 model keeps an int8 channel checkpoint's projections in a byte a weight plus an fp32 scale a row,
    a packed int4 group one's in half a byte a weight plus an fp32 scale a group of 32: the cast leaves them."""
    for fmt, group, saved in [("int8", scheme(8, "int", "channel", format="int-quantized"),
                               lambda weights, rows: weights - rows * 4),
                              ("int4", scheme(4, "int", "group", 32),
                               lambda weights, rows: weights * 2 - weights // 2 - weights // 32 * 4)]:
        quantized, dequantized = compressed_checkpoint("llama", tmp_path / fmt, groups={"g": group})
        compressed, plain = load_model(quantized, "bfloat16", "cpu")[0], load_model(dequantized, "bfloat16", "cpu")[0]
        linears = [m for m in plain.modules() if isinstance(m, LinearBase)]
        weights, rows = sum(m.weight.numel() for m in linears), sum(m.out_features for m in linears)
        assert weight_bytes(plain) - weight_bytes(compressed) == saved(weights, rows), fmt
        assert len(compressed_layers(compressed)) == len(linears) == 14


def test_tp2_equals_hf_and_updates_to_another_compressed_checkpoint(tmp_path, monkeypatch):
    """TP 2 on Phi-3, attention in per-tensor FP8 (qkv_proj's one scale, o_proj's, whole on every rank) and the
    MLP in packed int4 asymmetric groups (gate_up_proj's rows and zero words cut per part, down_proj's words and
    groups of its input features): HF's tokens over the dequantization, a prefix hit; then a weight update to
    another checkpoint of that quantization serves HF's tokens over its, a dense qkv_proj weight is refused, and
    an update from the first checkpoint's tensors (SGLang's update_weights_from_tensor: FP8 weights too) serves
    the first tokens again. Both checkpoints hold KV-cache scales, unread."""
    thread_ranks(monkeypatch)
    groups = {"attention": {**FP8_TENSOR, "targets": [ATTENTION]},
              "mlp": scheme(4, "int", "group", 16, symmetric=False, targets=[MLP])}
    quantized, dequantized = compressed_checkpoint("phi3", tmp_path / "a", groups=groups, kv_scales=True)
    other, other_dequantized = compressed_checkpoint("phi3", tmp_path / "b", groups=groups, seed=1, kv_scales=True)
    engine = Engine(model_path=quantized, skip_tokenizer_init=True, max_total_tokens=512, tp_size=2)
    try:
        outputs, logprobs, cached = generate(engine)
        layer = engine.runner.model.model.layers[0]
        qkv, gate_up, down = layer.self_attn.qkv_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj
        assert (qkv.weight.dtype, tuple(qkv.weight_scale.shape)) == (torch.float8_e4m3fn, (1,))
        # rank 0: 64 of gate's and up's 128 rows each; 64 of down_proj's 128 input features
        assert [tuple(t.shape) for t in (gate_up.weight_packed, gate_up.weight_scale, gate_up.weight_zero_point)] \
            == [(128, 8), (128, 4), (16, 4)]
        assert [tuple(t.shape) for t in (down.weight_packed, down.weight_scale, down.weight_zero_point)] \
            == [(64, 8), (64, 4), (8, 4)]
        engine.update_weights_from_disk(other, weight_version="b")
        updated, updated_logprobs, _ = generate(engine)
        qkv_name = "model.layers.0.self_attn.qkv_proj.weight"  # (a trainer's dense weight: never cast unscaled)
        with pytest.raises(ValueError, match=rf"{qkv_name} is torch.float32 but its layer stores torch.float8_e4m3fn"):
            engine.update_weights_from_tensor([(qkv_name, load_file(f"{dequantized}/model.safetensors")[qkv_name])])
        assert generate(engine)[0] == updated
        with pytest.raises(ValueError, match="quantization_config"):  # the float checkpoint: another model
            engine.update_weights_from_disk(other_dequantized)
        engine.update_weights_from_tensor(list(load_file(f"{quantized}/model.safetensors").items()))
        assert generate(engine)[0] == outputs  # (a trainer's FP8 and packed tensors, every rank its shard)
    finally:
        engine.shutdown()
    assert_greedy_parity(dequantized, PROMPTS, outputs, GREEDY["max_new_tokens"], logprobs=logprobs)
    assert all(c >= len(p) for c, p in zip(cached, PROMPTS))
    assert_greedy_parity(other_dequantized, PROMPTS, updated, GREEDY["max_new_tokens"], logprobs=updated_logprobs)


# (format, type, bits) served
FORMATS = [("float-quantized", "float", 8), ("int-quantized", "int", 8), ("pack-quantized", "int", 4),
           ("pack-quantized", "int", 8)]


@settings(max_examples=40, deadline=None)
@given(fmt=st.sampled_from(FORMATS), strategy=st.sampled_from(["tensor", "channel", "group"]),
       group_size=st.sampled_from([8, 16]), groups=st.integers(1, 3), out_words=st.integers(1, 3),
       symmetric=st.booleans(), tp_size=st.sampled_from([1, 2]), row=st.booleans(), seed=st.integers(0, 2**16))
def test_loaded_shards_dequantize_as_the_brute_force_dequantizer(fmt, strategy, group_size, groups, out_words,
                                                                 symmetric, tp_size, row, seed):
    """Any compressed layer (FP8, int8, packed int4 / int8; per tensor, channel or group; zeros or not), loaded
    through the checkpoint reads into every rank's column- or row-parallel shard, dequantizes to that rank's
    slice of the brute-force dequantizer's weight, exactly."""
    fmt, kind, bits = fmt
    group = scheme(bits, kind, strategy, group_size, symmetric or kind == "float", fmt)
    in_features, out_features = tp_size * group_size * groups, tp_size * 8 * out_words
    gen = torch.Generator().manual_seed(seed)
    tensors = quantize_layer(torch.randn(out_features, in_features, generator=gen), group)
    want = brute_force_dequantize(tensors, group["weights"], (out_features, in_features))
    quant = compressed_tensors.resolve(SimpleNamespace(quantization_config={
        "quant_method": "compressed-tensors", "config_groups": {"g": group}}), None)
    for rank in range(tp_size):
        tp = TPGroup(rank=rank, size=tp_size)
        if row:
            layer = RowParallelLinear(in_features, out_features, tp, "in_features")
        else:
            layer = ColumnParallelLinear.split(in_features, out_features, tp, "out_features")
        compressed_tensors.quantize_linear(layer, "layer", quant.schemes["Linear"], (out_features, in_features),
                                           tensors["weight_scale"].shape)
        file = TensorFile(tensors)
        for name, param in layer.named_parameters():
            copy_tensor(file, name, param, layer.param_shards.get(name))
        part = want.chunk(tp_size, dim=1 if row else 0)[rank]
        assert torch.equal(layer.dense_weight(torch.float32), part), rank


def test_layer_scheme_is_the_most_specific_targets():
    """A layer several config groups target takes the scheme compressed-tensors gave it (``match_targets``): its
    name's, then a regex's, then Linear's, whatever the groups' order; ignore before any."""
    int4, int8, fp8 = scheme(4, "int", "group", 16), scheme(8, "int", "channel"), scheme(8, "float", "channel",
                                                                                          format="float-quantized")
    quant = compressed_tensors.resolve(SimpleNamespace(quantization_config={
        "quant_method": "compressed-tensors", "ignore": ["lm_head", r"re:.*layers\.1\.mlp\.up_proj$"],
        "config_groups": {"default": int4, "down": {**int8, "targets": [r"re:.*down_proj$"]},
                          "first_down": {**fp8, "targets": ["model.layers.0.mlp.down_proj"]}}}), None)
    bits = {name: (s.num_bits, s.type) if (s := compressed_tensors.layer_scheme(quant, name)) else None
            for name in ("model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj", "model.layers.1.mlp.up_proj",
                         "model.layers.0.mlp.up_proj", "lm_head")}
    assert bits == {"model.layers.0.mlp.down_proj": (8, "float"), "model.layers.1.mlp.down_proj": (8, "int"),
                    "model.layers.1.mlp.up_proj": None, "model.layers.0.mlp.up_proj": (4, "int"), "lm_head": None}


def test_compressed_config_errors(tmp_path):
    """Formats and schemes not served are refused naming the field; a TP split that cuts a group or a word of
    packed zeros, a quantized lm_head and a quantized layer the config ignores, naming the layer."""
    def config(groups=None, **qc):
        return SimpleNamespace(quantization_config={"quant_method": "compressed-tensors",
                                                    "config_groups": groups or {"g": scheme()}, **qc})

    def weights(**fields):
        group = scheme()
        return {"g": {**group, "weights": {**group["weights"], **fields}}}

    refused = {
        "format='marlin-24'": config({"g": {**scheme(), "format": "marlin-24"}}),
        "format='nvfp4-pack-quantized'": config({"g": {**scheme(), "format": "nvfp4-pack-quantized"}}),
        "sparsity_config.format='sparse-24-bitmask'": config(sparsity_config={"format": "sparse-24-bitmask"}),
        "strategy='block' is not served": config(weights(strategy="block")),
        "num_bits=3: pack-quantized int weights are served with 4 or 8 bits": config(weights(num_bits=3)),
        "type='float' is not served in format 'pack-quantized'": config(weights(type="float", num_bits=8)),
        "actorder='group' is not served": config(weights(actorder="group")),
        "actorder='dynamic' is not served": config(weights(actorder="dynamic")),  # (compressed-tensors: group)
        "actorder=True is not served": config(weights(actorder=True)),
        "dynamic=True": config(weights(dynamic=True)),
        "group_size=None": config(weights(group_size=None)),
        "quantizes no weights": config({"g": {**scheme(), "weights": None}}),
        "config_groups is empty": SimpleNamespace(quantization_config={"quant_method": "compressed-tensors"}),
        "fmt='e5m2'": SimpleNamespace(quantization_config={"quant_method": "fp8", "fmt": "e5m2"}),
    }
    for why, hf_config in refused.items():
        with pytest.raises(ValueError, match=why):
            compressed_tensors.resolve(hf_config, None)
    with pytest.raises(ValueError, match="quantization='fp8' but the checkpoint's quantization_config.quant_method"):
        compressed_tensors.resolve(config(), "fp8")
    assert compressed_tensors.resolve(SimpleNamespace(quantization_config={"quant_method": "fp8",
                                                                           "weight_block_size": [128, 128]}),
                                      None) is None
    # served: groups in input order, as no actorder ('static': compressed-tensors' alias of 'weight'); a KV-cache
    # scheme (its scales unread)
    for served in (config(weights(actorder="static")), config(weights(actorder="weight")),
                   config(kv_cache_scheme={"num_bits": 8, "type": "float", "strategy": "tensor"})):
        assert compressed_tensors.resolve(served, None).schemes["Linear"] == compressed_tensors.Scheme(
            4, "int", "group", 16, True, True)

    # llama's o_proj (64 input features) at TP 4: 16 each, cutting a group of 32
    quantized, _ = compressed_checkpoint("llama", tmp_path / "group", groups={"g": scheme(4, "int", "group", 32)})
    check_tp_shardable(EngineConfig(model_path=quantized, tp_size=2))
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn.o_proj: this rank's slice \[0, 16\) of its 64 "
                                         r"input features cuts 32 \(group_size 32 input features share a scale\)"):
        check_tp_shardable(EngineConfig(model_path=quantized, tp_size=4))
    # an intermediate size of 72 at TP 2: 36 output features of gate_proj each, not whole words of packed zeros
    quantized, _ = compressed_checkpoint("llama", tmp_path / "word", intermediate_size=72,
                                         groups={"g": scheme(4, "int", "channel", symmetric=False)})
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.gate_proj: this rank's slice \[0, 36\) of its 72 "
                                         r"output features cuts 8 \(weight_zero_point packs 8 output features"):
        check_tp_shardable(EngineConfig(model_path=quantized, tp_size=2))
    # lm_head stored quantized (an ignore list without it)
    quantized, _ = compressed_checkpoint("llama", tmp_path / "lm_head", groups={"g": FP8_TENSOR}, ignore=())
    tensors = load_file(f"{quantized}/model.safetensors")
    tensors.update({"lm_head.weight": tensors["lm_head.weight"].to(torch.float8_e4m3fn),
                    "lm_head.weight_scale": torch.ones(1)})
    save_file(tensors, f"{quantized}/model.safetensors")
    with pytest.raises(ValueError, match="lm_head: the checkpoint stores it quantized"):
        load_model(quantized, "auto", "cpu")
    # a layer stored quantized that the config ignores
    quantized, _ = compressed_checkpoint("llama", tmp_path / "ignored", groups={"g": scheme()})
    config_path = tmp_path / "ignored" / "compressed" / "config.json"
    config_path.write_text(config_path.read_text().replace('"ignore": ["lm_head"]', '"ignore": ["re:.*down_proj"]'))
    with pytest.raises(ValueError, match="model.layers.0.mlp.down_proj: the checkpoint holds its weight_scale but "
                                         "quantization_config ignores it"):
        load_model(quantized, "auto", "cpu")
