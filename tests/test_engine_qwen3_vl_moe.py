"""Engine on the tiny Qwen3-VL-MoE (Qwen3-VL's vision tower and DeepStack, a dense first layer, then the sparse
block with its experts in 3-D tensors): greedy tokens and logprobs of an image and a text request equal HF's
``Qwen3VLMoeForConditionalGeneration`` from the checkpoint transformers 5 saves ([experts, out, in]), and from
one in the released layout ([experts, in, out], read transposed) at TP 2 on the fused MoE backend and at EP 2
on the eager one, and at PP 2 (a DeepStack layer on the second stage); a weight update takes the experts in
either layout, a square matrix by who saved the checkpoint. LoRA adapters over the stacked experts (PEFT's
target_parameters wrappers, both layouts, and per-expert names) serve an image request beside the base model's,
each HF's on its merged checkpoint: eager and fused, at TP 2 and EP 2. A checkpoint storing its experts per expert
(the quantized releases' layout) is served with per-expert layers, as Qwen3-MoE's: unquantized (adapters on them
too), block FP8, GPTQ eager and fused, each HF's on the same weights stacked, and a GPTQ or compressed-tensors
config naming layers by the checkpoint's names gives them their scheme; at EP 2, an act-order expert of rank
1's sent under the checkpoint's names is refused by rank 1's check. A quantized checkpoint storing its experts
stacked (FP8, GPTQ) or quantization='fp8' on one is refused, naming the format."""

import json
import re
import shutil
from typing import Callable, Dict, Optional

import pytest
import torch
from safetensors.torch import load_file, save_file

from actors.engine import Engine, fp8
from actors.engine.model_loader import build_served_model, load_config
from actors.engine.models.moe import ExpertList
from actors.engine.tiny import MLP, build_tiny_checkpoint, make_adapter
from tests.compressed_helpers import compressed_checkpoint, scheme
from tests.lora_helpers import fused_expert_adapter, merged_checkpoint
from tests.parity import assert_greedy_parity
from tests.test_engine_qwen3_vl import deepstack_received
from tests.test_engine_vl import MAX_NEW, chat, generate, image
from tests.test_fp8_weights import fp8_checkpoint
from tests.tp_helpers import thread_ranks
from tests.wna16_helpers import packed_checkpoint

STACKED = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
EXPERT_WEIGHT = re.compile(r"^(.+\.experts)\.(\d+)\.(\w+)\.weight$")  # (an expert's layer's weight, per expert)


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


def image_and_text(engine: Engine, oracle: Optional[str] = None) -> None:
    """An image request and a text one in a batch, chunks of 8 cutting the image: HF's tokens and logprobs
    (``oracle``: the checkpoint HF reads; the engine's by default)."""
    generate(engine, [chat(engine.tokenizer, "what is it?"), chat(engine.tokenizer, "text")],
             [[image(100, 150, 0)], None], oracle=oracle)
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


def test_pp2_with_a_deepstack_layer_on_the_second_stage_equals_hf(model_dir, monkeypatch):
    """Layers 1 and 2 (the sparse ones) on stage 1: layer 1's DeepStack features cross from stage 0."""
    received = deepstack_received(monkeypatch)
    thread_ranks(monkeypatch)
    image_and_text(Engine(model_dir, max_total_tokens=2048, chunked_prefill_size=8, pp_size=2,
                          pp_layer_partition=[1, 2]))
    assert sum(received) == 15  # (the image's tokens, over its chunks)


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


@pytest.fixture(scope="module")
def adapters(model_dir, tmp_path_factory):
    """Adapters of the stacked experts, each with its merged checkpoint (HF's oracle): PEFT's target_parameters
    wrappers over gate_up_proj and down_proj as PEFT 0.18 (``old``) and 0.19 (``new``: [experts, out, in]) write
    them, r=2, and Qwen3-MoE's per-expert names (``experts``: q_proj and every expert's gate/up/down, r=4)."""
    root = tmp_path_factory.mktemp("adapters")
    paths = {name: fused_expert_adapter(model_dir, root / name, rank=2, alpha=4, seed=seed, peft_version=version)
             for name, version, seed in (("old", "0.18.1", 2), ("new", "0.19.1", 3))}
    paths["experts"] = make_adapter(model_dir, root / "experts", rank=4, alpha=8, targets=("q_proj",),
                                    experts=("gate_proj", "up_proj", "down_proj"), seed=1)
    return {name: (str(path), merged_checkpoint(model_dir, path, root / f"{name}-merged"))
            for name, path in paths.items()}


def adapters_beside_the_base_model(engine: Engine, adapters, base: Optional[str] = None) -> None:
    """An image request under each adapter and one without, in one batch: each HF's tokens and logprobs on its
    checkpoint (the adapter merged in; ``base``: the base model's, the engine's by default), and each adapter
    changes the base model's tokens."""
    prompt, images, names = chat(engine.tokenizer, "what is it?"), [image(100, 150, 0)], [None, *adapters]
    outs = engine.generate(prompt=[prompt] * len(names), image_data=[images] * len(names), lora_path=names,
                           sampling_params=dict(max_new_tokens=MAX_NEW, temperature=0, return_logprob=True))
    for name, out in zip(names, outs):
        assert_greedy_parity(adapters[name][1] if name else base or engine.config.model_path,
                             [engine.tokenizer.encode(prompt)], [out["output_ids"]], MAX_NEW, engine.eos_token_ids,
                             images=[images], logprobs=[[lp for lp, _ in out["meta_info"]["output_token_logprobs"]]])
    assert all(out["output_ids"] != outs[0]["output_ids"] for out in outs[1:])
    engine.check_integrity()
    engine.shutdown()


@pytest.mark.parametrize("moe_backend", ["torch", "triton"])
def test_adapters_on_the_stacked_experts_equal_hf_on_the_merged_checkpoints(model_dir, adapters, moe_backend):
    """Every expert of both MoE layers takes the adapters as Qwen3-MoE's: its gate and up rows of gate_up_proj and
    its down_proj, slots stacked [slots, experts, r, in] a projection (fails before: the wrappers and the per-expert
    names refused). The eager experts add each expert's deltas between its matmuls; the fused ones by the grouped
    GEMM over the pairs sorted by (slot, expert)."""
    engine = Engine(model_dir, max_total_tokens=2048, lora_paths={name: path for name, (path, _) in adapters.items()},
                    moe_backend=moe_backend, max_loras_per_batch=3)
    lora = engine.runner.lora
    assert set(lora.experts) == {"model.layers.1.mlp.experts", "model.layers.2.mlp.experts"}
    assert sum(".experts." in m for m in lora.layers) == 2 * 4 * 3
    layer = lora.experts["model.layers.1.mlp.experts"]
    assert (tuple(layer.lora_b[1].shape), tuple(layer.lora_a[2].shape)) == ((3, 4, 48, 4), (3, 4, 4, 48))
    adapters_beside_the_base_model(engine, adapters)


@pytest.mark.parametrize("ep", [False, True], ids=["tp", "ep"])
def test_tp2_and_ep2_shard_the_stacked_experts_slots(model_dir, adapters, monkeypatch, ep):
    """TP 2: each rank's gate and up slots hold B's rows of its intermediate slice (as its rows of gate_up_proj, gate's
    and up's), its down slots A's columns (summed by the block's all-reduce); EP 2: each rank its two experts' slots
    whole, the adapters' other experts dropped there. The tokens are still the merged checkpoints'."""
    thread_ranks(monkeypatch)
    engine = Engine(model_dir, max_total_tokens=2048, lora_paths={name: path for name, (path, _) in adapters.items()},
                    tp_size=2, enable_expert_parallel=ep, max_loras_per_batch=3)
    lora = engine.runner.lora
    layer = lora.experts["model.layers.1.mlp.experts"]
    held, inter = (2, 48) if ep else (4, 24)  # (rank 0's experts, and its part of their intermediate dim)
    assert (tuple(layer.lora_b[0].shape), tuple(layer.lora_a[2].shape)) == ((3, held, inter, 4), (3, held, 4, inter))
    assert {m.split(".")[-2] for m in lora.host["new"].shards if ".experts." in m} == {str(e) for e in range(held)}
    adapters_beside_the_base_model(engine, adapters)


FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True}


def per_expert(tensors: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """``tensors`` with each layer's stacked experts (transformers 5's: ``gate_up_proj [experts, 2·inter, hidden]``,
    gate's rows then up's, ``down_proj [experts, hidden, inter]``) stored per expert, as the quantized releases store
    them: ``mlp.experts.{e}.gate_proj.weight``, ``up_proj``, ``down_proj``."""
    split = {}
    for name, tensor in tensors.items():
        if not name.endswith(STACKED):
            split[name] = tensor
            continue
        prefix, _, param = name.rpartition(".")
        for e, matrix in enumerate(tensor):
            parts = zip(MLP[:2], matrix.chunk(2)) if param == "gate_up_proj" else [("down_proj", matrix)]
            split.update((f"{prefix}.{e}.{proj}.weight", part.contiguous()) for proj, part in parts)
    return split


def stacked(tensors: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """:func:`per_expert`'s inverse: the checkpoint HF reads (transformers holds Qwen3-VL-MoE's experts stacked and
    converts no per-expert names into them)."""
    experts, whole = {}, {}
    for name, tensor in tensors.items():
        match = EXPERT_WEIGHT.match(name)
        if match:
            experts.setdefault(match[1], {})[int(match[2]), match[3]] = tensor
        else:
            whole[name] = tensor
    for prefix, matrices in experts.items():
        held = range(len(matrices) // len(MLP))
        whole[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([matrices[e, p] for p in MLP[:2]]) for e in held])
        whole[f"{prefix}.down_proj"] = torch.stack([matrices[e, "down_proj"] for e in held])
    return whole


def rewrite(path, layout: Callable[[Dict[str, torch.Tensor]], Dict[str, torch.Tensor]]) -> str:
    """The checkpoint in ``path`` with its tensors stored in ``layout`` (:func:`per_expert`, :func:`stacked`)."""
    file = f"{path}/model.safetensors"
    save_file(layout(load_file(file)), file)
    return str(path)


def build_per_expert(family: str, out, **kwargs) -> str:
    """:func:`build_tiny_checkpoint`'s checkpoint, its experts stored per expert (the quantizing helpers' ``build``)."""
    return rewrite(build_tiny_checkpoint(family, out, **kwargs), per_expert)


@pytest.fixture(scope="module")
def per_expert_dir(model_dir, tmp_path_factory):
    return build_per_expert("qwen3_vl_moe", tmp_path_factory.mktemp("per_expert"))


def test_a_checkpoint_storing_its_experts_per_expert_equals_hf_with_adapters_on_them(per_expert_dir, model_dir,
                                                                                      adapters):
    """The experts stored per expert (mlp.experts.{e}.gate_proj.weight ...) are held so, as Qwen3-MoE's (fails
    before: missing and unexpected tensors): HF's tokens and logprobs of the same weights stacked, and the adapters
    (PEFT's wrappers over the 3-D parameters, per-expert names) on them equal HF's on their merged checkpoints."""
    engine = Engine(per_expert_dir, max_total_tokens=2048, max_loras_per_batch=3,
                    lora_paths={name: path for name, (path, _) in adapters.items()})
    experts = engine.runner.model.model.layers[1].mlp.experts
    assert isinstance(experts, ExpertList) and list(experts.held) == [0, 1, 2, 3]
    assert set(engine.runner.lora.experts) == {"model.layers.1.mlp.experts", "model.layers.2.mlp.experts"}
    adapters_beside_the_base_model(engine, adapters, base=model_dir)


@pytest.fixture(scope="module")
def fp8_dirs(tmp_path_factory):
    """(a block-FP8 checkpoint, 16 x 16 blocks, storing its experts per expert as Qwen3-VL-30B-A3B-Instruct-FP8 does,
    its vision tower unquantized; its dequantization stacked: HF's input)."""
    quantized, dequantized = fp8_checkpoint("qwen3_vl_moe", tmp_path_factory.mktemp("fp8"), skip="visual",
                                            build=build_per_expert)
    return quantized, rewrite(dequantized, stacked)


@pytest.fixture(scope="module")
def gptq_dirs(tmp_path_factory):
    """(a GPTQ int4 act-order checkpoint storing its experts per expert, its vision tower unquantized
    (modules_to_not_convert); its brute-force dequantization stacked: HF's input)."""
    quantized, dequantized = packed_checkpoint("qwen3_vl_moe", tmp_path_factory.mktemp("gptq"), bits=4, group_size=16,
                                               act_order=True, skip="visual", build=build_per_expert)
    return quantized, rewrite(dequantized, stacked)


@pytest.mark.parametrize("quantization, moe_backend", [("fp8", "torch"), ("gptq", "torch"), ("gptq", "triton")])
def test_a_quantized_checkpoint_storing_its_experts_per_expert_equals_hf_over_its_dequantization(
        request, quantization, moe_backend):
    """Each expert's layers are held as stored, block FP8 or packed GPTQ (fails before: the checkpoint refused),
    eager or fused (the packed experts dequantized in the fused MoE kernels): HF's tokens and logprobs of the
    dequantized weights, after a weight update from the checkpoint (checked against a model built as the served one,
    its experts per expert)."""
    quantized, dequantized = request.getfixturevalue(f"{quantization}_dirs")
    engine = Engine(quantized, max_total_tokens=2048, moe_backend=moe_backend)
    experts = engine.runner.model.model.layers[2].mlp.experts
    down = experts[3].down_proj
    if quantization == "fp8":
        assert down.weight.dtype == fp8.FP8 and tuple(down.weight_scale_inv.shape) == (4, 3)
    else:
        assert down.weight is None and down.packed.desc_act
    assert (experts.fused is not None) == (moe_backend == "triton")
    assert engine.update_weights_from_disk(quantized).success
    image_and_text(engine, oracle=dequantized)


# layer 1's experts, by the checkpoint's name (model.language_model.*; the served model's: model.layers.*)
CHECKPOINT_EXPERTS = r"model\.language_model\.layers\.1\.mlp\.experts\..*"


@pytest.mark.parametrize("method", ["gptq", "compressed-tensors"])
def test_a_layer_configured_by_its_checkpoint_name_takes_its_own_scheme(tmp_path, method):
    """A quantization_config naming layers as the checkpoint does (GPTQModel's dynamic, a compressed-tensors config
    group's target: model.language_model.layers.1.mlp.experts.*) gives layer 1's experts their scheme, int8 GPTQ or
    FP8 channel, beside the default int4 groups of the others, as vLLM maps a config's names (fails before: matched
    against the served names only, they took the default's and failed the load): HF's tokens and logprobs over its
    dequantization."""
    if method == "gptq":
        quantized, dequantized = packed_checkpoint("qwen3_vl_moe", tmp_path, bits=4, group_size=16, skip="visual",
                                                   dynamic={f"+:{CHECKPOINT_EXPERTS}": {"bits": 8}},
                                                   build=build_per_expert)
    else:
        groups = {"group_0": scheme(4, "int", "group", 16),
                  "group_1": scheme(8, "float", "channel", format="float-quantized",
                                    targets=(f"re:{CHECKPOINT_EXPERTS}",))}
        quantized, dequantized = compressed_checkpoint("qwen3_vl_moe", tmp_path, groups, build=build_per_expert,
                                                       ignore=("lm_head", "re:model.visual.*", "re:.*mlp.gate$"))
    engine = Engine(quantized, max_total_tokens=2048)
    layers = engine.runner.model.model.layers
    if method == "gptq":
        assert [layers[i].mlp.experts[0].down_proj.packed.bits for i in (1, 2)] == [8, 4]
    else:
        assert [layers[i].mlp.experts[0].down_proj.scheme.type for i in (1, 2)] == ["float", "int"]
    image_and_text(engine, oracle=rewrite(dequantized, stacked))


@pytest.mark.parametrize("quant, forced, named", [(FP8, None, "quantization_config.quant_method='fp8'"),
                                                  (GPTQ, None, "quantization_config.quant_method='gptq'"),
                                                  (None, "fp8", "quantization='fp8'")])
def test_a_quantized_checkpoint_is_refused_naming_its_format(model_dir, tmp_path, quant, forced, named):
    """The stacked experts are served in the model's dtype only: a quantized checkpoint storing them stacked is
    refused as the model is built, naming the format, not left to fail (or load unquantized experts) as tensors
    are read."""
    path = shutil.copytree(model_dir, tmp_path / "quantized")
    if quant is not None:
        config = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**config, "quantization_config": quant}))
    with pytest.raises(ValueError, match=rf"{re.escape(named)} is not served for Qwen3VLMoeForConditionalGeneration: "
                                         r"its experts \(model\.layers\.1\.mlp\.experts, \.\.\.\) are stacked"):
        build_served_model(str(path), load_config(str(path)), forced)


def test_ep2_refuses_another_ranks_act_order_experts_named_as_the_checkpoint_stores_them(gptq_dirs, tmp_path,
                                                                                        monkeypatch):
    """A g_idx's values are checked by the rank holding its expert, sent them by rank 0 (which does not): named
    model.language_model.* (the checkpoint's names), an act-order expert of rank 1's is refused by its check, nothing
    copied, as one named model.layers.* (fails before: rank 0 sent it on meta, its name not renamed, so no check read
    it: rank 1 failed the copy instead, after rank 0's copies, and every rank reloaded the checkpoint)."""
    thread_ranks(monkeypatch)
    served, _ = packed_checkpoint("qwen3_vl_moe", tmp_path, bits=4, group_size=16, skip="visual",
                                  build=build_per_expert)
    engine = Engine(served, max_total_tokens=512, tp_size=2, enable_expert_parallel=True)
    expert = "model.language_model.layers.1.mlp.experts.3.down_proj."
    act_order = [(name, t) for name, t in load_file(f"{gptq_dirs[0]}/model.safetensors").items()
                 if name.startswith(expert)]
    assert {name.removeprefix(expert) for name, _ in act_order} >= {"qweight", "g_idx"}
    with pytest.raises(ValueError, match=r"rank 1: .*model\.layers\.1\.mlp\.experts\.3\.down_proj\.g_idx is not in "
                                         "group order"):
        engine.update_weights_from_tensor(act_order)
    engine.check_integrity()
    engine.shutdown()
