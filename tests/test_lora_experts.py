"""LoRA on a MoE's routed experts (actors.engine.lora_experts): an adapter of every expert's gate/up/down in PEFT's
per-expert names (Qwen3-MoE's ``mlp.experts.{e}.gate_proj``, Mixtral's ``block_sparse_moe.experts.{e}.w1``) and one
PEFT ``target_parameters`` writes over transformers 5's fused 3-D experts serve in one batch with base requests,
each request's tokens HF's on its checkpoint with the adapter merged into the experts' weights: with the eager
experts and the fused Triton ones (interpreted), at TP 2 (Qwen3-MoE, DeepSeek-V3, Qwen3-Next: each slot cut as its
expert) and EP 2 (Mixtral fused, DeepSeek-V2: each rank its experts' slots), after a runtime load and in a slot
another adapter filled (an adapter of some experts: the others add nothing). GPT-OSS's 3-D experts (gate and up
interleaved, biases, clamped SwiGLU) take PEFT's target_parameters adapters alike: eager and fused, at TP 2 and EP 2,
loaded at runtime. The eager experts read the host once a layer; the experts' slots come out of the KV pool's budget.
Adapters the experts cannot take are refused, naming the module."""

import gc
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from actors.engine import Engine
from actors.engine.config import EngineConfig
from actors.engine.models import moe
from actors.engine.tiny import build_tiny_checkpoint, make_adapter
from tests.lora_helpers import fused_expert_adapter, merged_checkpoint
from tests.test_lora import GREEDY, assert_parity, prompts
from tests.tp_helpers import thread_ranks

EXPERTS = {"qwen3_moe": ("gate_proj", "up_proj", "down_proj"), "mixtral": ("w1", "w3", "w2")}


def served(root, family):
    """(base checkpoint, adapter dirs, merged checkpoints): ``moe`` (r=4: q_proj and every expert's three
    projections, per expert) and ``fused`` (r=2 over transformers 5's fused gate_up_proj and down_proj)."""
    base = str(build_tiny_checkpoint(family, root / "base", seed=0))
    adapters = {"moe": make_adapter(base, root / "moe", rank=4, alpha=8, targets=("q_proj",),
                                    experts=EXPERTS.get(family, EXPERTS["qwen3_moe"]), seed=1),
                "fused": fused_expert_adapter(base, root / "fused", rank=2, alpha=4, seed=2)}
    oracles = {name: merged_checkpoint(base, path, root / f"{name}-merged") for name, path in adapters.items()}
    return base, {name: str(path) for name, path in adapters.items()}, oracles


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return served(tmp_path_factory.mktemp("qwen3_moe"), "qwen3_moe")


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    """A tiny GPT-OSS (4 layers of 4 experts, intermediate 32, swiglu_limit 1 that the activations reach) and two
    r=2 adapters in PEFT's target_parameters form over its gate_up_proj [experts, hidden, 2·inter] and down_proj:
    ``experts`` (those alone) and ``both`` (others, with q_proj and o_proj beside), and their merged checkpoints."""
    root = tmp_path_factory.mktemp("gpt_oss")
    base = str(build_tiny_checkpoint("gpt_oss", root / "base", seed=0))
    adapters = {"experts": fused_expert_adapter(base, root / "experts", rank=2, alpha=4, seed=2),
                "both": fused_expert_adapter(base, root / "both", rank=2, alpha=4, seed=3)}
    attention = make_adapter(base, root / "attention", rank=2, alpha=4, targets=("q_proj", "o_proj"), seed=4)
    both = str(adapters["both"] / "adapter_model.safetensors")
    save_file(load_file(both) | load_file(str(attention / "adapter_model.safetensors")), both)
    oracles = {name: merged_checkpoint(base, path, root / f"{name}-merged") for name, path in adapters.items()}
    return base, {name: str(path) for name, path in adapters.items()}, oracles


def assert_mixed_batch(model, eng, names):
    """A batch of two prompts under the base model and each adapter of ``names``, interleaved: each request's
    tokens are its merged checkpoint's, and each adapter changes them."""
    batch = prompts(2, seed=5) * (1 + len(names))
    loras = [lora for lora in [None, *names] for _ in range(2)]
    order = list(range(0, len(batch), 2)) + list(range(1, len(batch), 2))
    outs = eng.generate(input_ids=[batch[i] for i in order], sampling_params=GREEDY,
                        lora_path=[loras[i] for i in order])
    outs = [outs[order.index(i)] for i in range(len(batch))]
    assert_parity(model, batch, loras, outs, eng.eos_token_ids)
    for k in range(1, 1 + len(names)):
        assert all(outs[i]["output_ids"] != outs[2 * k + i]["output_ids"] for i in (0, 1))
    eng.check_integrity()


@pytest.mark.parametrize("moe_backend", ["torch", "triton"])
def test_expert_adapters_equal_merged_models(qwen, moe_backend):
    """Both formats in one batch with the base model: every expert of both MoE layers has its slots (stacked per
    layer: [slots, experts, r, in]), and each request's tokens are its merged model's — the eager experts and
    the fused kernels (the deltas by the grouped GEMM over the pairs sorted by (slot, expert)) alike."""
    eng = Engine(model_path=qwen[0], skip_tokenizer_init=True, max_total_tokens=1024, lora_paths=qwen[1],
                 moe_backend=moe_backend, max_loras_per_batch=2)  # (the fused path's groups: slots · experts)
    try:
        lora = eng.runner.lora
        assert set(lora.experts) == {f"model.layers.{i}.mlp.experts" for i in (0, 1)}
        assert sum(".experts." in m for m in lora.layers) == 2 * 4 * 3
        assert tuple(lora.experts["model.layers.0.mlp.experts"].lora_a[0].shape) == (2, 4, 4, 64)
        assert_mixed_batch(qwen, eng, ["moe", "fused"])
    finally:
        eng.shutdown()


def test_peft_0_19_expert_adapters_equal_merged_models(qwen, tmp_path):
    """PEFT 0.19 on reads a 3-D parameter of experts not marked ``is_transposed`` (transformers 5's Qwen3-MoE,
    Mixtral: ``[experts, out, in]``) as such: huggingface/peft#3165, ``ParamWrapper.update_layer`` (v0.19.1
    src/peft/tuners/lora/layer.py L2201-2205, ``is_transposed = getattr(self.get_base_layer(), "is_transposed",
    False)``, ``swap_in_out_features = param.ndim == 3 and not is_transposed``) swaps ``in_features`` and
    ``out_features`` before ``lora_A = nn.Linear(in_features, r·experts)``, ``lora_B = nn.Linear(r·experts,
    out_features)``, and ``get_delta_factors`` then adds ``B_e @ A_e`` (B reshaped ``[out, r, experts]``, A
    ``[experts, r, in]``) to the slice, not its transpose as 0.18's ``einsum("o r e, e r i -> e i o")``. So gate_up's
    lora_A is ``[experts·r, hidden]`` and lora_B ``[2·inter, experts·r]``, down's ``[experts·r, inter]`` and
    ``[hidden, experts·r]`` (as NVIDIA-NeMo/Automodel#3592 lists them for a tiny Qwen3MoeExperts under 0.18.1 and
    0.20.0); GPT-OSS's experts, ``is_transposed``, keep 0.18's. Such an adapter serves beside a 0.18 one and the base
    model, each request's tokens its merged model's (fails before: refused, its down wrapper fitting neither
    parameter). The tiny model's hidden is 2·inter, so gate_up's shapes are the same in both layouts: the down
    wrapper tells which; an adapter of gate_up alone is refused rather than guessed."""
    new = fused_expert_adapter(qwen[0], tmp_path / "new", rank=2, alpha=4, seed=6, peft_version="0.19.1")
    tensors = load_file(str(new / "adapter_model.safetensors"))
    assert tuple(tensors["base_model.model.model.layers.0.mlp.experts.lora_A.weight"].shape) == (4 * 2, 32)
    model = (qwen[0], {"fused": qwen[1]["fused"], "new": str(new)},
             {"fused": qwen[2]["fused"], "new": merged_checkpoint(qwen[0], new, tmp_path / "new-merged")})
    eng = Engine(model_path=qwen[0], skip_tokenizer_init=True, max_total_tokens=1024, lora_paths=model[1],
                 max_loras_per_batch=2)
    try:
        assert_mixed_batch(model, eng, ["fused", "new"])
        gate_up = tmp_path / "gate_up"
        gate_up.mkdir()
        save_file({key.replace(".base_layer", ""): tensor for key, tensor in tensors.items() if ".base_layer." in key},
                  str(gate_up / "adapter_model.safetensors"))
        (gate_up / "adapter_config.json").write_text((new / "adapter_config.json").read_text())
        with pytest.raises(ValueError, match=r"'gate_up': model\.layers\.0\.mlp\.experts: .* before 0\.19 and since"):
            eng.load_lora_adapter("gate_up", str(gate_up))
        eng.check_integrity()
    finally:
        eng.shutdown()


# the tensor methods that wait for the device (on CUDA) to hand a value to the host
SYNCS = ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "nonzero", "unique")


def test_the_eager_experts_read_the_host_once_a_layer(qwen, monkeypatch):
    """The eager experts (moe_backend='torch') serving a mixed batch of two adapters and the base model read the
    host once per MoE layer and forward, whatever the experts and slots: the counts of the pairs sorted by (expert,
    slot). They used to read it per expert (its rows), and under adapters per expert and slot (the slots of its
    rows, each slot's rows)."""
    reads, counting = [], [False]
    for name in SYNCS:
        def read(self, *args, _method=getattr(torch.Tensor, name), **kwargs):
            if counting[0]:
                reads[-1] += 1
            return _method(self, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, name, read)

    def counted(*args, _run=moe.run_experts):
        reads.append(0)
        counting[0] = True
        try:
            return _run(*args)
        finally:
            counting[0] = False
    monkeypatch.setattr(moe, "run_experts", counted)
    eng = Engine(model_path=qwen[0], skip_tokenizer_init=True, max_total_tokens=1024, lora_paths=qwen[1],
                 moe_backend="torch", max_loras_per_batch=2)
    try:
        assert_mixed_batch(qwen, eng, ["moe", "fused"])
    finally:
        eng.shutdown()
    assert len(reads) >= 2 * 8 and set(reads) == {1}  # (2 layers, a prefill and 7 decode steps at least)


@pytest.mark.parametrize("family, ep, moe_backend", [("qwen3_moe", False, "torch"), ("deepseek_v3", False, "torch"),
                                                     ("mixtral", True, "triton"), ("qwen3_next", False, "torch"),
                                                     ("deepseek_v2", True, "torch")])
def test_tp_and_ep_shard_the_expert_slots(tmp_path, monkeypatch, family, ep, moe_backend):
    """TP 2 (Qwen3-MoE; DeepSeek-V3, its grouped gate, routed_scaling_factor and shared experts beside; Qwen3-Next,
    its gated shared expert beside): each rank's slots hold its rows of gate/up's B and its columns of down's A (the
    block's all-reduce sums the down deltas); EP 2 (Mixtral's w1/w3/w2, fused; DeepSeek-V2's group-limited gate):
    each rank the slots of its two experts whole, the adapter's other experts dropped there and the pairs routed
    to them left out. The mixed batch's tokens are still the merged models'."""
    thread_ranks(monkeypatch)
    model = served(tmp_path, family)
    eng = Engine(model_path=model[0], skip_tokenizer_init=True, max_total_tokens=1024, lora_paths=model[1],
                 tp_size=2, enable_expert_parallel=ep, moe_backend=moe_backend, max_loras_per_batch=2)
    try:
        lora = eng.runner.lora
        layer = next(iter(lora.experts.values()))
        gate, down = layer.lora_b[0], layer.lora_a[2]
        held, inter = (2, 32) if ep else (4, 16)  # (rank 0's experts, and its part of their intermediate dim)
        assert (tuple(gate.shape), tuple(down.shape)) == ((2, held, inter, 4), (2, held, 4, inter))
        assert {m.split(".")[-2] for m in lora.host["moe"].shards if ".experts." in m} == {str(e) for e in range(held)}
        assert_mixed_batch(model, eng, list(model[1]))
    finally:
        eng.shutdown()


@pytest.mark.parametrize("moe_backend", ["torch", "triton"])
def test_gpt_oss_expert_adapters_equal_merged_models(gpt_oss, moe_backend):
    """GPT-OSS's experts take two projections each, gate_up_proj (B over the interleaved gate/up columns, its delta
    before the clamped SwiGLU) and down_proj, stacked [slots, experts, r, in] on every layer; an adapter of the
    experts and one of the experts and the attention serve in one batch with the base model, each request's tokens
    its merged model's: the eager experts and the fused ones (one gate_up delta over the whole row) alike."""
    eng = Engine(model_path=gpt_oss[0], skip_tokenizer_init=True, max_total_tokens=1024, lora_paths=gpt_oss[1],
                 moe_backend=moe_backend, max_loras_per_batch=2)
    try:
        lora = eng.runner.lora
        assert set(lora.experts) == {f"model.layers.{i}.mlp.experts" for i in range(4)}
        layer = lora.experts["model.layers.0.mlp.experts"]
        assert (tuple(layer.lora_b[0].shape), tuple(layer.lora_a[1].shape)) == ((2, 4, 64, 2), (2, 4, 2, 32))
        assert_mixed_batch(gpt_oss, eng, ["experts", "both"])
    finally:
        eng.shutdown()


@pytest.mark.parametrize("ep", [False, True], ids=["tp", "ep"])
def test_gpt_oss_tp_and_ep_shard_the_expert_slots(gpt_oss, monkeypatch, ep):
    """TP 2: each rank's gate_up slots hold B's rows of its interleaved (gate, up) columns, its down slots A's
    columns of its intermediate slice (summed by the experts' all-reduce, the down bias rank 0's); EP 2: each rank
    its two experts' slots whole, the adapters' other experts dropped there. The mixed batch's tokens are still the
    merged models' (the eager experts: the fused ones read the same slots)."""
    thread_ranks(monkeypatch)
    eng = Engine(model_path=gpt_oss[0], skip_tokenizer_init=True, max_total_tokens=1024, lora_paths=gpt_oss[1],
                 tp_size=2, enable_expert_parallel=ep, moe_backend="torch", max_loras_per_batch=2)
    try:
        lora = eng.runner.lora
        layer = lora.experts["model.layers.0.mlp.experts"]
        held, inter = (2, 32) if ep else (4, 16)  # (rank 0's experts, and its part of their intermediate dim)
        assert (tuple(layer.lora_b[0].shape), tuple(layer.lora_a[1].shape)) == ((2, held, 2 * inter, 2),
                                                                                (2, held, 2, inter))
        experts = {m.split(".")[-2] for m in lora.host["experts"].shards if ".experts." in m}
        assert experts == {str(e) for e in range(held)}
        assert_mixed_batch(gpt_oss, eng, ["experts", "both"])
    finally:
        eng.shutdown()


def test_an_adapter_of_some_experts_takes_a_slot_another_filled(qwen, tmp_path):
    """One slot, taken in turn by the adapter of every expert and one of experts 1 and 2 alone (another adapter's
    values): each request's tokens are its merged model's, the experts the second adapter leaves out adding no delta
    (their slots zeroed as it is copied in, not the first adapter's left there)."""
    some = tmp_path / "some"
    some.mkdir()
    tensors = load_file(str(Path(qwen[1]["moe"]) / "adapter_model.safetensors"))
    save_file({key: 1.5 * tensor.flip(0) for key, tensor in tensors.items() if re.search(r"\.experts\.[12]\.", key)},
              str(some / "adapter_model.safetensors"))
    (some / "adapter_config.json").write_text((Path(qwen[1]["moe"]) / "adapter_config.json").read_text())
    model = (qwen[0], {"moe": qwen[1]["moe"], "some": str(some)},
             {"moe": qwen[2]["moe"], "some": merged_checkpoint(qwen[0], some, tmp_path / "some-merged")})
    eng = Engine(model_path=qwen[0], skip_tokenizer_init=True, max_total_tokens=1024, lora_paths=model[1],
                 max_loras_per_batch=1)
    try:
        batch = prompts(2, seed=5)
        for name in ("moe", "some", "moe"):
            outs = eng.generate(input_ids=batch, sampling_params=GREEDY, lora_path=[name] * 2)
            assert_parity(model, batch, [name] * 2, outs, eng.eos_token_ids)
        eng.check_integrity()
    finally:
        eng.shutdown()


@pytest.mark.parametrize("family, rank, targets, name, num_slot_views", [
    ("qwen", 4, ["q_proj", "gate_proj", "up_proj", "down_proj"], "moe", 2 * 4 * 3),
    ("gpt_oss", 2, ["q_proj", "o_proj", "gate_up_proj", "down_proj"], "both", 4 * 4 * 2),
], ids=["qwen3_moe", "gpt_oss"])
def test_an_expert_adapter_loads_at_runtime(request, family, rank, targets, name, num_slot_views):
    """An engine started without adapters, its slots those of lora_target_modules (the experts' projections
    included: GPT-OSS's gate_up_proj and down_proj, no modules of their own, name every expert's), loads an expert
    adapter (Qwen3-MoE's per expert; GPT-OSS's on the 3-D experts and the attention) and serves it beside the base
    model; unloaded, it is refused."""
    model = request.getfixturevalue(family)
    eng = Engine(model_path=model[0], skip_tokenizer_init=True, max_total_tokens=1024, max_lora_rank=rank,
                 lora_target_modules=targets)
    try:
        assert sum(".experts." in m for m in eng.runner.lora.layers) == num_slot_views
        eng.load_lora_adapter(name, model[1][name])
        assert_mixed_batch(model, eng, [name])
        eng.unload_lora_adapter(name)
        with pytest.raises(ValueError, match=f"unknown LoRA adapter '{name}'"):
            eng.generate(input_ids=prompts(1), sampling_params=GREEDY, lora_path=name)
        eng.check_integrity()
    finally:
        eng.shutdown()


def test_expert_adapters_the_slots_cannot_take_are_refused(qwen, tmp_path):
    """Refused at a runtime load, naming the module: an expert adapter where the slots target q_proj alone, and
    a fused wrapper whose shapes fit neither fused expert parameter."""
    eng = Engine(model_path=qwen[0], skip_tokenizer_init=True, max_total_tokens=256, max_lora_rank=4,
                 lora_target_modules=["q_proj"])
    try:
        with pytest.raises(ValueError, match=r"'moe' targets model\.layers\.0\.mlp\.experts\.0\.down_proj.*outside"):
            eng.load_lora_adapter("moe", qwen[1]["moe"])
        bad = fused_expert_adapter(qwen[0], tmp_path / "bad", rank=2, alpha=4)
        tensors = load_file(str(bad / "adapter_model.safetensors"))
        key = "base_model.model.model.layers.1.mlp.experts.lora_B.weight"
        tensors[key] = torch.ones(16, tensors[key].shape[1])
        save_file(tensors, str(bad / "adapter_model.safetensors"))
        with pytest.raises(ValueError, match=rf"'bad': {re.escape('model.layers.1.mlp.experts')}: .* fit neither"):
            eng.load_lora_adapter("bad", str(bad))
        eng.check_integrity()
    finally:
        eng.shutdown()


def _adapter_like(path: Path, tensors, like: str) -> str:
    """An adapter directory at ``path`` of ``tensors``, its adapter_config.json that of the adapter in ``like``."""
    path.mkdir()
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text((Path(like) / "adapter_config.json").read_text())
    return str(path)


def test_an_expert_adapter_of_another_number_of_experts_is_refused(qwen, tmp_path):
    """An expert adapter trained on a model with other experts (the wrong base model) is refused, naming the module
    and the layer's count, at start and at a runtime load: a PEFT target_parameters wrapper of 2 experts where the
    layer has 4 (fails before: served, experts 2 and 3 silently without an adapter), and one of 6; an adapter in
    per-expert names of an expert past the layer's last."""
    fused = load_file(str(Path(qwen[1]["fused"]) / "adapter_model.safetensors"))
    wrapper, rank = "base_model.model.model.layers.0.mlp.experts.lora_", 2  # (down_proj's, r=2)
    adapters = {name: _adapter_like(tmp_path / name, fused | {
        wrapper + "A.weight": fused[wrapper + "A.weight"][:rank].repeat(num_experts, 1),
        wrapper + "B.weight": fused[wrapper + "B.weight"][:, :rank].repeat(1, num_experts)}, qwen[1]["fused"])
        for name, num_experts in (("few", 2), ("many", 6))}
    moe = load_file(str(Path(qwen[1]["moe"]) / "adapter_model.safetensors"))
    adapters["past"] = _adapter_like(tmp_path / "past", moe | {
        key.replace(".experts.3.", ".experts.4."): tensor.clone() for key, tensor in moe.items()
        if ".layers.0.mlp.experts.3.down_proj." in key}, qwen[1]["moe"])
    errors = {"few": r"'few': model\.layers\.0\.mlp\.experts: lora_A \(4, 64\) and lora_B \(32, 4\) are 2 experts "
                     r"of r=2, and the layer has 4 \(an adapter of another base model\?\)",
              "many": r"'many': model\.layers\.0\.mlp\.experts: .* are 6 experts of r=2, and the layer has 4",
              "past": r"targets model\.layers\.0\.mlp\.experts\.4\.down_proj, which the model has no expert "
                      r"projection at \(model\.layers\.0\.mlp\.experts has 4 experts"}
    with pytest.raises(ValueError, match=errors["few"]):
        Engine(model_path=qwen[0], skip_tokenizer_init=True, max_total_tokens=256, lora_paths={"few": adapters["few"]})
    eng = Engine(model_path=qwen[0], skip_tokenizer_init=True, max_total_tokens=256, max_lora_rank=4,
                 lora_target_modules=["q_proj", "gate_proj", "up_proj", "down_proj"])
    try:
        for name, error in errors.items():
            with pytest.raises(ValueError, match=error):
                eng.load_lora_adapter(name, adapters[name])
        eng.check_integrity()
    finally:
        eng.shutdown()


def _live_bytes() -> int:
    """The bytes of every CPU tensor alive now, each storage once: what a device would have in use."""
    gc.collect()
    storages = {}
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.Tensor) and obj.device.type == "cpu":
            storages[obj.untyped_storage().data_ptr()] = obj.untyped_storage().nbytes()
    return sum(storages.values())


def test_the_expert_slots_come_out_of_the_kv_budget(qwen, monkeypatch):
    """Sized from device memory (a device whose free memory is what the live tensors leave), the KV pool of an
    engine whose slots take the experts too is smaller by the experts' slots' bytes: they are allocated before
    the pool is sized, as the dense layers' are, so the pool and all the slots fit mem_fraction_static's share."""
    import actors.engine.model_runner as model_runner

    available, total = 48 * 2**20, 64 * 2**20  # (16 MiB for the pools at mem_fraction_static 0.5)
    tokens, slot_bytes = [], 0
    for targets in (["q_proj"], ["q_proj", "gate_proj", "up_proj", "down_proj"]):
        start = _live_bytes()
        monkeypatch.setattr(model_runner, "get_device_memory",
                            lambda device: (available - (_live_bytes() - start), total))
        runner = model_runner.ModelRunner(EngineConfig(model_path=qwen[0], skip_tokenizer_init=True,
                                                       mem_fraction_static=0.5, max_running_requests=8,
                                                       max_lora_rank=16, lora_target_modules=targets))
        tokens.append(runner.max_total_num_tokens)
        slot_bytes = sum(t.nbytes for layer in runner.lora.experts.values()
                         for t in [*layer.lora_a.values(), *layer.lora_b.values()])
        cell = runner.token_to_kv_pool.mem_usage_bytes() // (runner.max_total_num_tokens + runner.config.page_size)
        del runner
    assert slot_bytes == 2 * 3 * 8 * 4 * 16 * (64 + 32) * 4  # (layers, projections, slots, experts, r, in + out)
    assert tokens[0] - tokens[1] in range(slot_bytes // cell - 1, slot_bytes // cell + 2)
