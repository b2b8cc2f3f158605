"""GPTQ and AWQ checkpoints (int4 / int8 weights in packed int32 words) served weight-only: tiny checkpoints
quantized here into the released layouts (tests.wna16_helpers), against HF over their brute-force
dequantization."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.engine import Engine, wna16
from actors.engine.attention.triton_backend import TritonAttnBackend
from actors.engine.config import EngineConfig
from actors.engine.cuda_graph_runner import graphs_off_reason
from actors.engine.fused_moe import FusableExperts
from actors.engine.model_loader import TensorFile, copy_tensor, load_model
from actors.engine.parallel import ColumnParallelLinear, LinearBase, RowParallelLinear, TPGroup
from actors.engine.tp_worker import check_tp_shardable
from tests.parity import assert_greedy_parity
from tests.tp_helpers import thread_ranks
from tests.wna16_helpers import brute_force_dequantize, packed_checkpoint, quantize_layer

GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
SCORED = dict(GREEDY, return_logprob=True)
PROMPTS = [[5, 9, 33, 47, 12, 90, 7, 61, 18, 3, 44, 21, 8, 70, 2, 19], [11] * 20, [3, 200, 150]]
# family, checkpoint: GPTQ int4 with and without act-order, int8 over one group, asymmetric; AWQ (biases kept
# beside the packed tensors, as Qwen2's q/k/v); Phi-3's fused qkv_proj and gate_up_proj; Qwen3-MoE's experts
# with act-order (torch MoE backend, then the fused one: the same tokens); DeepSeek-V3's MLA; a layer left
# unquantized; Qwen3-VL's decoder under transformers' model.language_model.* names (its vision tower unquantized)
CASES = {
    "llama-gptq4": ("llama", dict(bits=4, group_size=32, sym=True)),
    "qwen3-gptq4-act-order": ("qwen3", dict(bits=4, group_size=16, sym=False, act_order=True)),
    "llama-gptq8-one-group": ("llama", dict(bits=8, group_size=-1, sym=False, skip="down_proj")),
    # GPTQModel's dynamic: o_proj left unquantized, the MLP's down_proj in 8 bits over act-ordered groups of 16
    "llama-gptq4-dynamic": ("llama", dict(bits=4, group_size=32, dynamic={
        "-:.*o_proj": {}, r"+:.*\.down_proj": {"bits": 8, "group_size": 16, "desc_act": True}})),
    "llama-awq-biases": ("llama", dict(method="awq", group_size=32, attention_bias=True, mlp_bias=True)),
    "phi3-gptq4-act-order": ("phi3", dict(bits=4, group_size=32, act_order=True)),
    "qwen3_moe-gptq4-act-order": ("qwen3_moe", dict(bits=4, group_size=16, act_order=True)),
    "deepseek_v3-awq": ("deepseek_v3", dict(method="awq", group_size=16)),  # MLA's absorbed kv_b_proj
    "qwen3_vl-gptq4": ("qwen3_vl", dict(bits=4, group_size=16, skip="visual")),
}


def generate(engine, prompts=PROMPTS):
    """Greedy outputs with their logprobs, then a prefix hit on every prompt: (outputs, logprobs, cached)."""
    outs = engine.generate(input_ids=prompts, sampling_params=SCORED)
    again = engine.generate(input_ids=[p + o["output_ids"] for p, o in zip(prompts, outs)],
                            sampling_params=GREEDY)
    engine.check_integrity()
    logprobs = [[lp for lp, _ in o["meta_info"]["output_token_logprobs"]] for o in outs]
    return [o["output_ids"] for o in outs], logprobs, [o["meta_info"]["cached_tokens"] for o in again]


def packed_layers(model) -> dict:
    """Names → configs of the model's packed layers; each holds int32 words and fp32 scales, no weight."""
    layers = {}
    for name, module in model.named_modules():
        if isinstance(module, LinearBase) and module.packed is not None:
            assert module.weight is None and module.qweight.dtype == module.qzeros.dtype == torch.int32, name
            assert module.scales.dtype == torch.float32, name
            layers[name] = module.packed
    return layers


def assert_fused_experts_equal_eager(model_path: str, outputs, logprobs) -> None:
    """moe_backend='triton' (the quantized experts dequantized in the fused MoE kernels, interpreted here) gives
    the eager experts' ``outputs`` and ``logprobs``; every layer's experts are fused, so no eager ones keep
    CUDA graphs off (the CPU aside: the reason asked of this runner on CUDA with Triton attention)."""
    engine = Engine(model_path=model_path, skip_tokenizer_init=True, max_total_tokens=512, moe_backend="triton")
    try:
        outs = engine.generate(input_ids=PROMPTS, sampling_params=SCORED)
        engine.check_integrity()
        runner = engine.runner
        experts = [m for m in runner.model.modules() if isinstance(m, FusableExperts)]
        on_cuda = SimpleNamespace(config=runner.config, device=torch.device("cuda"), attn_backend=TritonAttnBackend(),
                                  spec=runner.spec, model=runner.model)
    finally:
        engine.shutdown()
    assert experts and all(m.fused is not None and (m.fused.w13.packed or m.fused.w13.scale) is not None
                           for m in experts)
    assert graphs_off_reason(on_cuda) is None
    assert [o["output_ids"] for o in outs] == outputs
    for out, eager in zip(outs, logprobs):
        assert [lp for lp, _ in out["meta_info"]["output_token_logprobs"]] == pytest.approx(eager, abs=1e-4)


def weight_bytes(model) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


@pytest.mark.parametrize("case", CASES)
def test_packed_checkpoint_gives_hf_tokens_over_its_dequantization(case, tmp_path):
    family, scheme = CASES[case]
    quantized, dequantized = packed_checkpoint(family, tmp_path, **scheme)
    engine = Engine(model_path=quantized, skip_tokenizer_init=True, max_total_tokens=512)
    try:
        outputs, logprobs, cached = generate(engine)
        layers = packed_layers(engine.runner.model)
    finally:
        engine.shutdown()
    assert_greedy_parity(dequantized, PROMPTS, outputs, GREEDY["max_new_tokens"], logprobs=logprobs)
    assert all(c >= len(p) for c, p in zip(cached, PROMPTS))
    unquantized = scheme.get("skip") or ("o_proj" if "dynamic" in scheme else None)
    projections = {n for n, m in load_model(dequantized, "auto", "cpu")[0].named_modules()
                   if isinstance(m, LinearBase) and not (unquantized and unquantized in n)}
    assert set(layers) == projections  # (never lm_head; Phi-3's fused layers, the experts', whatever is stored)
    if "dynamic" in scheme:
        assert {(q.bits, q.group_size, q.desc_act) for n, q in layers.items() if "down_proj" in n} == {(8, 16, True)}
        assert {(q.bits, q.group_size) for n, q in layers.items() if "down_proj" not in n} == {(4, 32)}
    if family == "qwen3_moe":
        assert "model.layers.0.mlp.experts.3.down_proj" in layers
        assert_fused_experts_equal_eager(quantized, outputs, logprobs)


def test_lora_adapter_over_a_gptq_model(tmp_path):
    """A LoRA adapter on every projection of a GPTQ act-order model: HF's tokens over the adapter merged into
    the dequantized weights; the layers stay packed, the adapter cut as their weights would be."""
    from tests.lora_helpers import merged_checkpoint
    from actors.engine.tiny import make_adapter

    quantized, dequantized = packed_checkpoint("llama", tmp_path, bits=4, group_size=16, act_order=True)
    adapter = make_adapter(dequantized, tmp_path / "adapter", rank=8, alpha=16)
    merged = merged_checkpoint(dequantized, adapter, tmp_path / "merged")
    engine = Engine(model_path=quantized, skip_tokenizer_init=True, max_total_tokens=512,
                    lora_paths={"a": str(adapter)})
    try:
        outs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY, lora_path="a")
        engine.check_integrity()
        assert len(packed_layers(engine.runner.model)) == 14
    finally:
        engine.shutdown()
    assert_greedy_parity(merged, PROMPTS, [o["output_ids"] for o in outs], GREEDY["max_new_tokens"])


def test_expert_adapter_over_fused_gptq_experts(tmp_path):
    """A LoRA adapter on every routed expert (and q_proj) of a GPTQ act-order Qwen3-MoE, the packed experts fused
    (moe_backend='triton'): its requests get HF's tokens over the adapter merged into the dequantized weights,
    the base requests beside them the dequantized model's; each expert layer keeps its slots on the fused path."""
    from tests.lora_helpers import merged_checkpoint
    from actors.engine.tiny import make_adapter

    quantized, dequantized = packed_checkpoint("qwen3_moe", tmp_path, bits=4, group_size=16, act_order=True)
    adapter = make_adapter(dequantized, tmp_path / "adapter", rank=4, alpha=8, targets=("q_proj",),
                           experts=("gate_proj", "up_proj", "down_proj"), seed=1)
    merged = merged_checkpoint(dequantized, adapter, tmp_path / "merged")
    engine = Engine(model_path=quantized, skip_tokenizer_init=True, max_total_tokens=512, moe_backend="triton",
                    lora_paths={"a": str(adapter)})
    try:
        outs = engine.generate(input_ids=PROMPTS * 2, sampling_params=GREEDY, lora_path=["a"] * 3 + [None] * 3)
        engine.check_integrity()
        experts = [m for m in engine.runner.model.modules() if isinstance(m, FusableExperts)]
    finally:
        engine.shutdown()
    assert experts and all(m.fused.w13.packed is not None and m.lora is not None for m in experts)
    outputs = [o["output_ids"] for o in outs]
    assert outputs[:3] != outputs[3:]
    assert_greedy_parity(merged, PROMPTS, outputs[:3], GREEDY["max_new_tokens"])
    assert_greedy_parity(dequantized, PROMPTS, outputs[3:], GREEDY["max_new_tokens"])


def test_packed_weights_take_their_packed_bytes(tmp_path):
    """A GPTQ int4 model (bf16) holds its projections in a quarter of bf16's bytes plus their fp32 scales and
    zeros: 4 bits a weight, the scales of group 32 one word per 32; the cast leaves them packed."""
    quantized, dequantized = packed_checkpoint("llama", tmp_path, bits=4, group_size=32)
    packed, _, _ = load_model(quantized, "bfloat16", "cpu")
    plain, _, _ = load_model(dequantized, "bfloat16", "cpu")
    projections = sum(m.weight.numel() for m in plain.modules() if isinstance(m, LinearBase))
    # (int4 words + fp32 scales + int4 zeros, a scale and a zero per 32 weights) in place of bf16
    saved = projections * 2 - projections // 2 - projections // 32 * 4 - projections // 32 // 2
    assert weight_bytes(plain) - weight_bytes(packed) == saved
    assert all(m.qweight.dtype == torch.int32 for m in packed.modules() if getattr(m, "packed", None))


def test_the_zero_biases_gptq_for_llama_stored_for_layers_without_one_are_skipped(tmp_path):
    """GPTQ-for-LLaMa's QuantLinear saved a zero fp16 ``bias`` for every layer, Llama's too (which has none):
    such a checkpoint loads (vLLM and SGLang skip them), its layers packed, without a bias, as the unpacker's."""
    from safetensors.torch import load_file, save_file

    quantized, dequantized = packed_checkpoint("llama", tmp_path, bits=4, group_size=16)
    tensors = load_file(f"{quantized}/model.safetensors")
    for name in [n for n in tensors if n.endswith(".scales")]:
        tensors[name.removesuffix("scales") + "bias"] = torch.zeros(tensors[name].shape[1], dtype=torch.float16)
    save_file(tensors, f"{quantized}/model.safetensors")
    model, _, _ = load_model(quantized, "float32", "cpu")
    want = load_file(f"{dequantized}/model.safetensors")
    assert len(model.packed_linears) == 14
    for name, module in model.packed_linears.items():
        assert module.bias is None and torch.equal(module.dense_weight(torch.float32), want[f"{name}.weight"]), name


def test_older_autoawq_configs_name_bits_and_group_size_w_bit_and_q_group_size(tmp_path):
    """AutoAWQ's older quantization_config says ``w_bit`` and ``q_group_size`` (vLLM reads either name): such
    a checkpoint loads packed with its group size (16 here, not the default 128) and dequantizes to the
    brute-force unpacker's weights."""
    from safetensors.torch import load_file

    quantized, dequantized = packed_checkpoint("llama", tmp_path, method="awq", group_size=16)
    config_path = Path(quantized) / "config.json"
    config = json.loads(config_path.read_text())
    qc = config["quantization_config"]
    qc["w_bit"], qc["q_group_size"], qc["version"] = qc.pop("bits"), qc.pop("group_size"), "GEMM"
    config_path.write_text(json.dumps(config))
    model, _, _ = load_model(quantized, "float32", "cpu")
    assert set(packed_layers(model).values()) == {wna16.PackedConfig("awq", 4, 16)}
    want = load_file(f"{dequantized}/model.safetensors")
    for name, module in model.packed_linears.items():
        assert torch.equal(module.dense_weight(torch.float32), want[f"{name}.weight"]), name


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_tp2_equals_hf_and_updates_to_another_packed_checkpoint(method, tmp_path, monkeypatch):
    """TP 2: column-parallel layers cut along their output features (whole words of qzeros, AWQ's qweight),
    row-parallel ones along their input features (GPTQ's qweight words, a group's scales, or with act-order
    g_idx's rows beside whole scales); Phi-3's fused parts cut each. HF's tokens over the dequantization, a
    prefix hit; then a weight update to another checkpoint of that quantization serves HF's tokens over its, and
    one from the first checkpoint's packed tensors (SGLang's update_weights_from_tensor) the first tokens again;
    a dense weight for a packed layer is refused."""
    from safetensors.torch import load_file

    thread_ranks(monkeypatch)
    scheme = dict(method=method, bits=4, group_size=16, act_order=method == "gptq")
    quantized, dequantized = packed_checkpoint("phi3", tmp_path / "a", **scheme)
    other, other_dequantized = packed_checkpoint("phi3", tmp_path / "b", seed=1, **scheme)
    engine = Engine(model_path=quantized, skip_tokenizer_init=True, max_total_tokens=512, tp_size=2)
    try:
        outputs, logprobs, cached = generate(engine)
        layer = engine.runner.model.model.layers[0]
        qkv, down = layer.self_attn.qkv_proj, layer.mlp.down_proj  # (rank 0: 2 of 4 heads, 64 of 128 features)
        if method == "gptq":  # [in / 8, out], g_idx's rows and every group of down_proj
            assert (tuple(qkv.qweight.shape), tuple(qkv.qzeros.shape)) == ((8, 64), (4, 8))
            assert [tuple(t.shape) for t in (down.qweight, down.g_idx, down.scales)] == [(8, 64), (64,), (8, 64)]
        else:  # [in, out / 8], down_proj's groups of its half
            assert (tuple(qkv.qweight.shape), tuple(qkv.scales.shape)) == ((64, 8), (4, 64))
            assert (tuple(down.qweight.shape), tuple(down.scales.shape)) == ((64, 8), (4, 64))
        engine.update_weights_from_disk(other, weight_version="b")
        updated, updated_logprobs, _ = generate(engine)
        with pytest.raises(ValueError, match="quantization_config"):  # the float checkpoint: another model
            engine.update_weights_from_disk(other_dequantized)
        with pytest.raises(ValueError, match=r"unexpected tensors \['model.layers.0.mlp.down_proj.weight'\]"):
            engine.update_weights_from_tensor([("model.layers.0.mlp.down_proj.weight", torch.zeros(64, 128))])
        engine.update_weights_from_tensor(list(load_file(f"{quantized}/model.safetensors").items()))
        assert generate(engine)[0] == outputs  # (a trainer's packed tensors, every rank its shard)
    finally:
        engine.shutdown()
    assert_greedy_parity(dequantized, PROMPTS, outputs, GREEDY["max_new_tokens"], logprobs=logprobs)
    assert all(c >= len(p) for c, p in zip(cached, PROMPTS))
    assert_greedy_parity(other_dequantized, PROMPTS, updated, GREEDY["max_new_tokens"], logprobs=updated_logprobs)


def test_an_update_refuses_unread_tensors_that_say_something(tmp_path):
    """A layer served without desc_act never reads g_idx: a trainer's tensors of an act-order quantization (same
    shapes) are refused naming their g_idx, nothing written (they were taken, and read with other groups' scales
    and zeros); tensors whose g_idx is in group order (as GPTQ writes it without desc_act) are taken. A bias for
    a packed layer without one is taken when zeros (GPTQ-for-LLaMa's), refused otherwise."""
    from safetensors.torch import load_file

    quantized, _ = packed_checkpoint("llama", tmp_path / "a", bits=4, group_size=16)
    act_order, _ = packed_checkpoint("llama", tmp_path / "b", bits=4, group_size=16, act_order=True, seed=1)
    engine = Engine(model_path=quantized, skip_tokenizer_init=True, max_total_tokens=512)
    try:
        outputs = generate(engine)[0]
        with pytest.raises(ValueError, match=r"model.layers.0.self_attn.q_proj.g_idx is not in group order"):
            engine.update_weights_from_tensor(list(load_file(f"{act_order}/model.safetensors").items()))
        assert generate(engine)[0] == outputs
        engine.update_weights_from_tensor(list(load_file(f"{quantized}/model.safetensors").items()))
        with pytest.raises(ValueError, match=r"model.layers.0.self_attn.q_proj.bias is not zero"):
            engine.update_weights_from_tensor([("model.layers.0.self_attn.q_proj.bias", torch.ones(64))])
        engine.update_weights_from_tensor([("model.layers.0.self_attn.q_proj.bias", torch.zeros(64))])
        assert generate(engine)[0] == outputs
    finally:
        engine.shutdown()


@settings(max_examples=40, deadline=None)
@given(method=st.sampled_from(["gptq", "awq"]), bits=st.sampled_from([4, 8]), groups=st.integers(1, 3),
       group_size=st.sampled_from([8, 16, -1]), out_words=st.integers(1, 3), sym=st.booleans(),
       act_order=st.booleans(), tp_size=st.sampled_from([1, 2]), row=st.booleans(), seed=st.integers(0, 2**16))
def test_loaded_shards_dequantize_as_the_brute_force_unpacker(method, bits, groups, group_size, out_words, sym,
                                                              act_order, tp_size, row, seed):
    """Any packed layer (GPTQ 4 / 8 bits, AWQ; groups, one group, act-order; symmetric or not), loaded through
    the checkpoint reads into every rank's column- or row-parallel shard, dequantizes to that rank's slice of
    the brute-force unpacker's weight, exactly."""
    bits, act_order = (4, False) if method == "awq" else (bits, act_order)
    pack = 32 // bits
    in_features = tp_size * (group_size if group_size > 0 else 8) * groups
    out_features = tp_size * 8 * out_words
    gen = torch.Generator().manual_seed(seed)
    tensors = quantize_layer(torch.randn(out_features, in_features, generator=gen), method, bits, group_size, sym,
                             act_order, gen)
    want = brute_force_dequantize(tensors, method, bits, group_size, act_order)
    quant = wna16.PackedConfig(method, bits, group_size, act_order)
    for rank in range(tp_size):
        layer = loaded_layer(tensors, quant, TPGroup(rank=rank, size=tp_size), row)
        part = want.chunk(tp_size, dim=1 if row else 0)[rank]
        assert torch.equal(layer.dense_weight(torch.float32), part), (rank, pack)


def loaded_layer(tensors, quant: wna16.PackedConfig, tp: TPGroup, row: bool) -> LinearBase:
    """A packed column- or row-parallel layer (``tp``'s rank's shard) of a layer's checkpoint ``tensors``,
    read through the loader's copy."""
    qweight = tensors["qweight"].shape
    out_features, in_features = ((qweight[1], qweight[0] * quant.pack) if quant.method == "gptq"
                                 else (qweight[1] * quant.pack, qweight[0]))
    if row:
        layer = RowParallelLinear(in_features, out_features, tp, "in_features")
    else:
        layer = ColumnParallelLinear.split(in_features, out_features, tp, "out_features")
    wna16.quantize_linear(layer, "layer", quant, (out_features, in_features))
    file = TensorFile(tensors)
    for name, param in layer.named_parameters():
        copy_tensor(file, name, param, layer.param_shards.get(name))
    return layer


# method, bits, group size, act-order, TP 2 row-parallel (rank 1: its g_idx rows, every group)
KERNEL_CASES = [("gptq", 4, 16, False, False), ("gptq", 8, 32, True, False), ("awq", 4, 32, False, False),
                ("gptq", 4, -1, True, True), ("gptq", 4, 16, False, True), ("awq", 4, 16, False, True)]


@pytest.mark.parametrize("method,bits,group_size,act_order,row", KERNEL_CASES)
@pytest.mark.parametrize("rows", [3, 20])
def test_fused_dequant_gemm_equals_dequantize_then_matmul(method, bits, group_size, act_order, row, rows):
    """The CUDA path's Triton kernel (interpreted here): each weight tile unpacked, its zeros and scales read
    by group (act-order: through g_idx), times the rows, plus the bias, as the weight dequantized whole (the
    CPU's path) then multiplied; the output features past the last whole tile of 64 masked."""
    from actors.engine.wna16_kernels import packed_linear

    gen = torch.Generator().manual_seed(rows)
    tensors = quantize_layer(torch.randn(72, 128, generator=gen), method, bits, group_size, True, act_order, gen)
    layer = loaded_layer(tensors, wna16.PackedConfig(method, bits, group_size, act_order),
                         TPGroup(rank=1, size=2) if row else TPGroup(), row)
    x, bias = torch.randn(rows, layer.in_features, generator=gen), torch.randn(72, generator=gen)
    want = torch.nn.functional.linear(x, layer.dense_weight(torch.float32), bias)
    torch.testing.assert_close(packed_linear(x, layer, method == "awq", bias), want, rtol=1e-5, atol=1e-5)


def test_packed_config_errors(tmp_path):
    """Variants not served are refused naming the field; a TP split that cuts a group or an int32 word is
    refused naming the layer."""
    def config(**qc):
        return SimpleNamespace(quantization_config=qc)

    refused = {
        "checkpoint_format='marlin'": dict(quant_method="gptq", bits=4, checkpoint_format="marlin"),
        "checkpoint_format='gptq_v2'": dict(quant_method="gptq", bits=4, checkpoint_format="gptq_v2"),
        r"bits=3: GPTQ is served with 4 or 8 bits": dict(quant_method="gptq", bits=3),
        r"bits=2: GPTQ": dict(quant_method="gptq", bits=2),
        "version='gemv' is not served": dict(quant_method="awq", bits=4, version="gemv"),
        r"bits=8: AWQ is served with 4 bits": dict(quant_method="awq", bits=8),
        "zero_point=False": dict(quant_method="awq", bits=4, zero_point=False),
        "group_size=0": dict(quant_method="gptq", bits=4, group_size=0),
        "lm_head=True": dict(quant_method="gptq", bits=4, lm_head=True),
        "pack_dtype='int16' is not served": dict(quant_method="gptq", bits=4, pack_dtype="int16"),
        r"dynamic\['\+:.\*mlp'\].bits=2": dict(quant_method="gptq", bits=4, dynamic={"+:.*mlp": {"bits": 2}}),
    }
    for why, qc in refused.items():
        with pytest.raises(ValueError, match=why):
            wna16.resolve(config(**qc), None)
    with pytest.raises(ValueError, match="quantization='fp8' but the checkpoint's quantization_config.quant_method"):
        wna16.resolve(config(quant_method="awq", bits=4), "fp8")
    assert wna16.resolve(config(quant_method="fp8"), None) is None and wna16.resolve(SimpleNamespace(), None) is None
    overrides = {"-:.*self_attn.*": {}, r"+:.*\.mlp\..*": {"bits": 8, "group_size": 32}}
    dynamic = wna16.resolve(config(quant_method="gptq", bits=4, group_size=128, desc_act=True, dynamic=overrides),
                            None)
    assert wna16.layer_config(dynamic, "model.layers.0.self_attn.q_proj") is None
    assert wna16.layer_config(dynamic, "model.layers.0.mlp.up_proj") == dynamic._replace(bits=8, group_size=32)
    assert wna16.layer_config(dynamic, "model.layers.0.other") == dynamic

    # llama's o_proj (64 input features) at TP 4: 16 each, cutting a group of 32
    quantized, _ = packed_checkpoint("llama", tmp_path / "group", group_size=32)
    check_tp_shardable(EngineConfig(model_path=quantized, tp_size=2))
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn.o_proj: this rank's slice \[0, 16\) of its 64 "
                                         r"input features cuts 32 \(group_size 32 input features share a scale\)"):
        check_tp_shardable(EngineConfig(model_path=quantized, tp_size=4))
    # an intermediate size of 72 at TP 2: 36 output features of gate_proj each, not whole words of 8
    quantized, _ = packed_checkpoint("llama", tmp_path / "word", group_size=4, intermediate_size=72)
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.gate_proj: this rank's slice \[0, 36\) of its 72 "
                                         r"output features cuts 8 \(qzeros packs 8 output features an int32\)"):
        check_tp_shardable(EngineConfig(model_path=quantized, tp_size=2))
    config_path = Path(quantized) / "config.json"
    config_json = json.loads(config_path.read_text())
    config_json["quantization_config"]["checkpoint_format"] = "gptq_v2"
    config_path.write_text(json.dumps(config_json))
    with pytest.raises(ValueError, match="checkpoint_format='gptq_v2'"):
        load_model(quantized, "auto", "cpu")


@pytest.mark.gpu
def test_cuda_serves_packed_layers_through_the_fused_kernel(tmp_path, monkeypatch):
    """On CUDA every packed layer's forward is the fused dequant-GEMM (no dense weight): HF's tokens and
    logprobs over the dequantization, GPTQ act-order and AWQ."""
    from actors.engine import wna16_kernels

    calls = []
    monkeypatch.setattr(wna16_kernels, "packed_linear",
                        lambda *args, launch=wna16_kernels.packed_linear: calls.append(1) or launch(*args))
    for method in ("gptq", "awq"):
        quantized, dequantized = packed_checkpoint("qwen3", tmp_path / method, method=method, group_size=16,
                                                   act_order=method == "gptq")
        engine = Engine(model_path=quantized, skip_tokenizer_init=True, max_total_tokens=512, device="cuda")
        try:
            outputs, logprobs, cached = generate(engine)
        finally:
            engine.shutdown()
        assert_greedy_parity(dequantized, PROMPTS, outputs, GREEDY["max_new_tokens"], logprobs=logprobs)
        assert calls and all(c >= len(p) for c, p in zip(cached, PROMPTS))
