"""Multi-LoRA beyond Llama: Mistral, Gemma 3, GPT-OSS, Mixtral, Qwen3-MoE, Granite, OLMo 2, Phi-3, DeepSeek-V3 /
V2 and Qwen3-Next serve an adapter on their layers' attention and dense-MLP projections (each model's
``supported_lora_modules``; Phi-3's fused qkv_proj and gate_up_proj, from an adapter of them or of their parts;
DeepSeek's MLA projections and shared experts; Qwen3-Next's linear-attention projections and shared expert; the
MoE families' routed experts take slots too, tests/test_lora_experts.py) — a base request and an adapter
request in one batch each get HF's tokens on their checkpoint (the adapter merged in), Qwen3-MoE, Phi-3,
DeepSeek-V3 / V2 and Qwen3-Next also at TP 2 — and an adapter on GPT-OSS's experts in neither form they take is
refused, naming the module. MLA's kv_b_proj, absorbed into the query and the output, takes its adapter there:
through chunked prefill and a prefix hit too."""

import re

import pytest
import torch
from safetensors.torch import save_file

from actors.engine import Engine
from actors.engine.lora_experts import layer_module
from actors.engine.lora_packed import stack_packed
from actors.engine.parallel import ColumnParallelLinear
from actors.engine.tiny import ATTENTION, MLP, build_tiny_checkpoint, make_adapter
from tests.lora_helpers import merged_checkpoint, packed_parts_adapter
from tests.test_lora import GREEDY, assert_batch_parity, assert_parity, prompts
from tests.tp_helpers import thread_ranks

# family -> (tiny checkpoint overrides, the decoder layers whose dense MLP takes the adapter)
FAMILIES = {
    "mistral": ({}, {0, 1}),
    "gemma3": ({}, {0, 1, 2, 3}),
    "gpt_oss": ({}, set()),  # (experts on every layer)
    "mixtral": ({}, set()),
    "qwen3_moe": ({"mlp_only_layers": [0]}, {0}),  # layer 1's MLP is the experts
    "granite": ({}, {0, 1}),
    "olmo2": ({}, {0, 1}),  # (its q/k norms after the adapted q_proj / k_proj)
    "phi3": ({}, {0, 1}),
    "deepseek_v3": ({"q_lora_rank": 16}, {0, 1, 2}),  # (q_a_proj / q_b_proj; layers 1, 2: the shared experts)
    "deepseek_v2": ({}, {0, 1, 2}),  # (V2-Lite's q_proj)
    "qwen3_next": ({}, {0, 1, 2, 3}),  # (every layer's shared expert)
}
MLA = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj") + MLP
TARGETS = {"phi3": ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"),  # (its fused projections)
           "deepseek_v3": MLA, "deepseek_v2": MLA,
           "qwen3_next": ATTENTION + ("in_proj_qkvz", "in_proj_ba", "out_proj") + MLP}
# the modules of supported_lora_modules the tiny checkpoint has not (V3's q_lora_rank given, V2's not; Qwen3-Next's
# layers all MoE)
ABSENT = {"deepseek_v3": {"self_attn.q_proj"}, "deepseek_v2": {"self_attn.q_a_proj", "self_attn.q_b_proj"},
          "qwen3_next": {"mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"}}


def served(root, family):
    """(base checkpoint, {"sql": adapter dir}, {"sql": merged checkpoint}) of ``family``: the
    adapter targets every projection (those the family has)."""
    base = str(build_tiny_checkpoint(family, root / "base", seed=0, **FAMILIES[family][0]))
    targets = TARGETS.get(family, ATTENTION + MLP)
    path = make_adapter(base, root / "sql", rank=4, alpha=8, targets=targets, seed=1)
    return base, {"sql": str(path)}, {"sql": merged_checkpoint(base, path, root / "merged")}


@pytest.mark.parametrize("family, tp_size", [("mistral", 1), ("gemma3", 1), ("gpt_oss", 1), ("mixtral", 1),
                                             ("qwen3_moe", 1), ("qwen3_moe", 2), ("granite", 1), ("olmo2", 1),
                                             ("phi3", 1), ("phi3", 2), ("deepseek_v3", 1), ("deepseek_v3", 2),
                                             ("deepseek_v2", 2), ("qwen3_next", 1), ("qwen3_next", 2)])
def test_family_serves_an_adapter_beside_the_base_model(tmp_path, monkeypatch, family, tp_size):
    """The layers of every projection (``lora_target_modules="all"``) are the family's attention
    projections, on every layer, its dense MLPs' and its routed experts' (GPT-OSS's 3-D ones too); base and adapter
    requests interleave in one batch and each gets its checkpoint's tokens, which the adapter changes."""
    thread_ranks(monkeypatch)
    model = served(tmp_path, family)
    eng = Engine(model_path=model[0], skip_tokenizer_init=True, max_total_tokens=1024, lora_paths=model[1],
                 lora_target_modules="all", tp_size=tp_size)
    try:
        layers = eng.runner.lora.layers
        assert {int(m.split(".")[2]) for m in layers if ".mlp." in m and ".experts." not in m} == FAMILIES[family][1]
        supported = set(type(eng.runner.model).supported_lora_modules) - ABSENT.get(family, set())
        assert {layer_module(m.split(".", 3)[3]) for m in layers} == supported
        num_layers = eng.runner.model.config.num_hidden_layers
        assert {int(m.split(".")[2]) for m in layers if "attn." in m} == set(range(num_layers))
        outs = assert_batch_parity(model, eng, [p for p in prompts(2, seed=5) for _ in range(2)], [None, "sql"] * 2)
        assert any(outs[i]["output_ids"] != outs[i + 1]["output_ids"] for i in (0, 2))
    finally:
        eng.shutdown()


@pytest.mark.parametrize("expert, error", [
    ("model.layers.0.mlp.experts.gate_up_proj",
     r"'moe' targets model\.layers\.0\.mlp\.experts\.gate_up_proj: GptOssForCausalLM takes adapters on .* named "
     r"by its expert"),
    ("model.layers.0.mlp.experts", r"'moe': model\.layers\.0\.mlp\.experts: .* fit neither gate_up_proj "
     r"\[experts, 64, 64\] nor down_proj \[experts, 32, 64\]"),
])
def test_an_adapter_on_gpt_oss_experts_is_refused(tmp_path, expert, error):
    """An adapter on GPT-OSS's experts that is not PEFT's target_parameters form (tests/test_lora_experts.py) is
    refused at start and at a runtime load, the error naming the module: one on a 3-D parameter's name, which
    names no expert, and a wrapper whose shapes fit neither parameter."""
    family = "gpt_oss"
    base = str(build_tiny_checkpoint(family, tmp_path / "base", seed=0))
    good = make_adapter(base, tmp_path / "sql", rank=4, alpha=8, targets=("q_proj",))
    bad = make_adapter(base, tmp_path / "moe", rank=4, alpha=8, targets=("q_proj",))
    tensors = {f"base_model.model.{expert}.lora_A.weight": torch.ones(4, 64),
               f"base_model.model.{expert}.lora_B.weight": torch.ones(32, 4)}
    save_file(tensors, str(bad / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match=error):
        Engine(model_path=base, skip_tokenizer_init=True, max_total_tokens=256, lora_paths={"moe": str(bad)})
    eng = Engine(model_path=base, skip_tokenizer_init=True, max_total_tokens=256, lora_paths={"sql": str(good)})
    try:
        with pytest.raises(ValueError, match=error):
            eng.load_lora_adapter("moe", str(bad))
        eng.check_integrity()
    finally:
        eng.shutdown()


def test_an_adapter_on_mla_kv_b_proj_alone(tmp_path):
    """An adapter on kv_b_proj alone changes only the absorbed query and output (the cached latent rows are the
    base model's): a base and an adapter request of one prompt, in one batch prefilled in chunks of 8 over pages of
    4 and decoded together, get their checkpoints' tokens, which differ; later requests on the prompts' shared
    prefix hit what each cached (the adapter's pages are its own) and still do."""
    base = str(build_tiny_checkpoint("deepseek_v3", tmp_path / "base", seed=0))
    path = make_adapter(base, tmp_path / "kvb", rank=4, alpha=8, targets=("kv_b_proj",), seed=1)
    model = (base, {"kvb": str(path)}, {"kvb": merged_checkpoint(base, path, tmp_path / "merged")})
    eng = Engine(model_path=base, skip_tokenizer_init=True, max_total_tokens=1024, lora_paths=model[1],
                 chunked_prefill_size=8, page_size=4)
    try:
        num_layers = eng.runner.model.config.num_hidden_layers
        assert set(eng.runner.lora.layers) == {f"model.layers.{i}.self_attn.kv_b_proj" for i in range(num_layers)}
        system = prompts(1, seed=5)[0] * 2
        first, follow = (prompts(1, seed=seed, shared=system)[0] for seed in (6, 7))
        outs = eng.generate(input_ids=[first, first], sampling_params=GREEDY, lora_path=[None, "kvb"])
        assert outs[0]["output_ids"] != outs[1]["output_ids"]
        again = eng.generate(input_ids=[follow, follow], sampling_params=GREEDY, lora_path=["kvb", None])
        assert min(o["meta_info"]["cached_tokens"] for o in again) >= len(system) // 4 * 4
        assert_parity(model, [first, first, follow, follow], [None, "kvb", "kvb", None], outs + again,
                      eng.eos_token_ids)
        eng.check_integrity()
    finally:
        eng.shutdown()


# the (projection, lora_A's rows, lora_B's columns) of a tiny Phi-3's slots of rank 4 sized for adapters of the fused
# projections alone, and for adapters of their parts (4 per part: q | k | v, gate | up)
FUSED_SLOTS = {("qkv_proj", 4, 4), ("o_proj", 4, 4), ("gate_up_proj", 4, 4), ("down_proj", 4, 4)}
PARTS_SLOTS = {("qkv_proj", 12, 12), ("o_proj", 4, 4), ("gate_up_proj", 8, 8), ("down_proj", 4, 4)}
QKV_PARTS_SLOTS = {("qkv_proj", 12, 12), ("o_proj", 4, 4), ("gate_up_proj", 4, 4), ("down_proj", 4, 4)}


def slot_shapes(eng):
    """Each LoRA layer's (projection, its slots' lora_A rows, lora_B columns): their rank."""
    return {(m.rpartition(".")[2], layer.lora_a.shape[1], layer.lora_b.shape[2])
            for m, layer in eng.runner.lora.layers.items()}


@pytest.mark.parametrize("targets", [["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                                     ["q_proj", "o_proj", "up_proj", "down_proj"]])
def test_phi3_target_modules_of_the_unfused_names_take_the_fused_projections(tmp_path, targets):
    """On Phi-3 lora_target_modules' q/k/v and gate/up name the fused qkv_proj and gate_up_proj (SGLang's packed
    modules; any part targets the whole): every layer's four projections take adapters, their fused slots sized
    for adapters of the parts (max_lora_rank per part), and a fused adapter serves as with 'all' (HF's tokens on
    the merged checkpoint)."""
    model = served(tmp_path, "phi3")
    eng = Engine(model_path=model[0], skip_tokenizer_init=True, max_total_tokens=1024, lora_paths=model[1],
                 lora_target_modules=targets)
    try:
        model_cls, layers = type(eng.runner.model), eng.runner.lora.layers
        assert {m.split(".", 3)[3] for m in layers} == set(model_cls.supported_lora_modules)
        assert len(layers) == 4 * eng.runner.model.config.num_hidden_layers and slot_shapes(eng) == PARTS_SLOTS
        batch, loras = prompts(2, seed=5), [None, "sql"]
        assert_parity(model, batch, loras, eng.generate(input_ids=batch, sampling_params=GREEDY, lora_path=loras),
                      eng.eos_token_ids)
        eng.check_integrity()
    finally:
        eng.shutdown()


@pytest.mark.parametrize("parts, tp_size, slots", [
    (("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"), 2, PARTS_SLOTS),
    (("q_proj", "v_proj", "up_proj"), 1, PARTS_SLOTS), (("q_proj", "v_proj"), 1, QKV_PARTS_SLOTS)])
def test_phi3_serves_adapters_of_the_parts_of_its_fused_projections(tmp_path, monkeypatch, parts, tp_size, slots):
    """An adapter PEFT trained on Llama-style q/k/v and gate/up (PEFT's default q_proj and v_proj alone too)
    serves on Phi-3, whose checkpoint fuses them: its parts stacked into qkv_proj's and gate_up_proj's slots (a
    part it has not adds nothing to its rows), beside an adapter of the fused projections and the base model,
    each request with HF's tokens on its merged checkpoint; at TP 2 too (B's rows cut per part). A fused
    projection's slots hold max_lora_rank per part where the adapter has a part of it, else max_lora_rank (q_proj
    and v_proj alone: gate_up_proj's 4, not 8; fails before: every fused projection's per part)."""
    thread_ranks(monkeypatch)
    base = str(build_tiny_checkpoint("phi3", tmp_path / "base", seed=0))
    adapters = {"fused": make_adapter(base, tmp_path / "fused", rank=4, alpha=8, targets=TARGETS["phi3"], seed=1),
                "parts": packed_parts_adapter(base, tmp_path / "parts", rank=4, alpha=8, parts=parts, seed=2)}
    model = (base, {name: str(path) for name, path in adapters.items()},
             {name: merged_checkpoint(base, path, tmp_path / f"{name}-merged") for name, path in adapters.items()})
    eng = Engine(model_path=base, skip_tokenizer_init=True, max_total_tokens=1024, lora_paths=model[1],
                 tp_size=tp_size)
    try:
        assert slot_shapes(eng) == slots
        batch = [p for p in prompts(2, seed=5) for _ in range(3)]
        outs = assert_batch_parity(model, eng, batch, [None, "fused", "parts"] * 2)
        assert any(outs[i]["output_ids"] != outs[i + 2]["output_ids"] for i in (0, 3))
    finally:
        eng.shutdown()


def test_phi3_slots_for_fused_adapters_hold_max_lora_rank(tmp_path):
    """Started with an adapter of Phi-3's fused projections alone, its fused layers' slots hold max_lora_rank, not
    max_lora_rank per part (vLLM's single slice): the fused adapter serves beside the base model. A parts adapter
    loaded at runtime is served where its parts stack within the slots (q_proj alone, up_proj alone: rank 4), and
    refused, naming the fix, where they stack above them (q, k, v: 12)."""
    base = str(build_tiny_checkpoint("phi3", tmp_path / "base", seed=0))
    adapters = {"fused": make_adapter(base, tmp_path / "fused", rank=4, alpha=8, targets=TARGETS["phi3"], seed=1),
                "parts": packed_parts_adapter(base, tmp_path / "parts", rank=4, alpha=8, parts=("q_proj", "up_proj"),
                                              seed=2)}
    wide = packed_parts_adapter(base, tmp_path / "wide", rank=4, alpha=8, parts=("q_proj", "k_proj", "v_proj"))
    model = (base, {name: str(path) for name, path in adapters.items()},
             {name: merged_checkpoint(base, path, tmp_path / f"{name}-merged") for name, path in adapters.items()})
    eng = Engine(model_path=base, skip_tokenizer_init=True, max_total_tokens=1024,
                 lora_paths={"fused": model[1]["fused"]})
    try:
        assert slot_shapes(eng) == FUSED_SLOTS
        with pytest.raises(ValueError, match=r"'wide': its adapters of the parts of model\.layers\.0\.self_attn\."
                                             r"qkv_proj stack to rank 12, above its slots' 4 .* serve it from the "
                                             r"start \(lora_paths\) or name its parts in lora_target_modules"):
            eng.load_lora_adapter("wide", str(wide))
        eng.load_lora_adapter("parts", model[1]["parts"])
        outs = assert_batch_parity(model, eng, [p for p in prompts(2, seed=5) for _ in range(3)],
                                   [None, "fused", "parts"] * 2)
        assert all(outs[i]["output_ids"] != outs[i + 2]["output_ids"] for i in (0, 3))
    finally:
        eng.shutdown()


def test_the_parts_adapters_stack_into_their_rows_of_the_fused_layer():
    """q_proj's and v_proj's adapters over a fused q | k | v layer: B A is each part's B A in its own rows
    (k's zero), exactly; an adapter of the fused layer and of a part of it on one layer is refused."""
    layer = ColumnParallelLinear(6, [range(0, 4), range(4, 6), range(6, 8)])
    gen = torch.Generator().manual_seed(0)
    q, v = [(torch.randn(2, 6, generator=gen), torch.randn(rows, 2, generator=gen)) for rows in (4, 2)]
    packed = {"qkv_proj": ("q_proj", "k_proj", "v_proj")}
    weights = {"l.q_proj": q, "l.v_proj": v, "l.o_proj": q}
    stacked = stack_packed(weights, 2, packed, lambda module: layer)
    a, b = stacked["l.qkv_proj"]
    assert set(stacked) == {"l.qkv_proj", "l.o_proj"} and a.shape == (4, 6) and b.shape == (8, 4)
    delta = b @ a
    assert torch.equal(delta[:4], q[1] @ q[0]) and not delta[4:6].any() and torch.equal(delta[6:], v[1] @ v[0])
    with pytest.raises(ValueError, match=r"l\.qkv_proj has an adapter, and so do its parts q_proj"):
        stack_packed({"l.q_proj": q, "l.qkv_proj": q}, 2, packed, lambda module: layer)
    with pytest.raises(ValueError, match=r"l\.v_proj lora_A \(2, 6\) and lora_B \(4, 2\) do not fit its rows"):
        stack_packed({"l.v_proj": q}, 2, packed, lambda module: layer)


@pytest.mark.parametrize("family, targets, unknown", [("llama", ["q_proj", "q_a_proj"], "q_a_proj"),
                                                      ("mixtral", ["q_proj", "gate_proj"], "gate_proj")])
def test_a_target_module_no_layer_has_is_refused_by_name(tmp_path, family, targets, unknown):
    """A lora_target_modules name that targets no layer of the model (MLA's q_a_proj on Llama; gate_proj on
    Mixtral, whose MLPs are all experts) is refused at start, naming it, not silently left out ('all', every
    name, still takes those the model has: test_family_serves_an_adapter_beside_the_base_model)."""
    base = str(build_tiny_checkpoint(family, tmp_path / "base", seed=0))
    with pytest.raises(ValueError, match=rf"lora_target_modules: {unknown} names no layer of \w+ that takes"):
        Engine(model_path=base, skip_tokenizer_init=True, max_total_tokens=256, lora_target_modules=targets,
               max_lora_rank=4)
