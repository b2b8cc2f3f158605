"""GPT-OSS (attention sinks, alternating sliding-window and full layers on the SWA pools, YaRN,
clamped-SwiGLU experts) through the engine: greedy tokens equal HF's for a batch past the window
with chunked prefill and a radix-cache hit whose shared prefix the full layers attend in cascade;
TP 2 (threads) equals TP 1; experts stored in MXFP4 load as HF dequantizes them, whole and
sharded. (The PD path: tests/test_pd_workers.py's family matrix.)

The tiny checkpoint's window is 8 tokens, so every prompt here runs past it.
"""

import random

import pytest
import torch

from actors.engine import Engine
from actors.engine.attention.torch_backend import TorchAttnBackend
from actors.engine.model_loader import build_model, load_config, load_weights
from actors.engine.mxfp4 import FP4_VALUES, SCALE_BIAS
from actors.engine.parallel import TPGroup
from actors.engine.tiny import build_tiny_checkpoint
from mem_cache.swa_memory_pool import SWAKVPool
from tests.parity import assert_greedy_parity
from tests.tp_helpers import thread_ranks

GREEDY = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
EXPERTS = ("gate_up_proj", "down_proj")  # the experts' matrices, MXFP4 in released checkpoints


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_tiny_checkpoint("gpt_oss", tmp_path_factory.mktemp("gpt_oss") / "m", seed=0))


def prompts():
    """A 70-token system prompt (past the window; long enough for the cascade) with two suffixes,
    and two prompts of their own."""
    rng = random.Random(0)
    system = [rng.randrange(5, 261) for _ in range(70)]
    return system, [system + [rng.randrange(5, 261) for _ in range(n)] for n in (3, 9)] + [[7, 8, 9], [11] * 20]


def generate(engine, model_dir, batch):
    """Greedy outputs of ``batch``, held against HF's; the idle engine checked."""
    outs = engine.generate(input_ids=batch, sampling_params=GREEDY)
    assert_greedy_parity(model_dir, batch, [o["output_ids"] for o in outs], GREEDY["max_new_tokens"])
    engine.check_integrity()
    return outs


def test_gpt_oss_parity_past_the_window_with_a_cache_hit_in_cascade(model_dir, monkeypatch):
    """(The Triton kernel's sinks: tests/test_attention_backends.py.)"""
    cascades = []
    attend_families = TorchAttnBackend.attend_families
    monkeypatch.setattr(TorchAttnBackend, "attend_families",
                        lambda self, q, layer: cascades.append(layer.layer_id) or attend_families(self, q, layer))
    engine = Engine(model_path=model_dir, skip_tokenizer_init=True, max_total_tokens=1024, chunked_prefill_size=16,
                    swa_full_tokens_ratio=0.5)
    try:
        pool = engine.runner.token_to_kv_pool
        assert isinstance(pool, SWAKVPool) and (pool.swa_layer_nums, pool.full_layer_nums) == (2, 2)
        system, batch = prompts()
        generate(engine, model_dir, [system + [4]])
        outs = generate(engine, model_dir, batch)
        assert [o["meta_info"]["cached_tokens"] for o in outs] == [70, 70, 0, 0]
    finally:
        engine.shutdown()
    assert set(cascades) == {1, 3}  # the two requests over the cached system prompt: a family, on the full layers


def run_tp(model_dir, tp_size):
    """Outputs of a batch in 16-token chunks then a prefix hit; the check of the idle engine; every
    rank's (sinks, gate_up_proj, down_proj) shapes of layer 0."""
    system, batch = prompts()
    engine = Engine(model_path=model_dir, skip_tokenizer_init=True, max_total_tokens=1024, tp_size=tp_size,
                    chunked_prefill_size=16)
    try:
        first = engine.generate(input_ids=batch, sampling_params=GREEDY)
        second = engine.generate(input_ids=[batch[1] + [5, 6]], sampling_params=GREEDY)
        assert second[0]["meta_info"]["cached_tokens"] >= 70
        engine.check_integrity()
        layer = engine.runner.model.model.layers[0]
        shapes = [(layer.self_attn.sinks.shape, layer.mlp.experts.gate_up_proj.shape,
                   layer.mlp.experts.down_proj.shape)]
        return [o["output_ids"] for o in first + second], shapes
    finally:
        engine.shutdown()


def test_gpt_oss_tp2_equals_tp1_and_hf(model_dir, monkeypatch):
    """Heads and their sinks split by head, every expert's intermediate dim split (the interleaved
    gate/up columns with it), the down bias added once. The ranks are threads."""
    thread_ranks(monkeypatch)
    ref, ref_shapes = run_tp(model_dir, 1)
    outputs, shapes = run_tp(model_dir, 2)
    assert outputs == ref
    system, batch = prompts()
    assert_greedy_parity(model_dir, batch + [batch[1] + [5, 6]], outputs, GREEDY["max_new_tokens"])
    assert ref_shapes == [((4,), (4, 64, 64), (4, 32, 64))] and shapes == [((2,), (4, 64, 32), (4, 16, 64))]


def quantize_mxfp4(w: torch.Tensor):
    """``w`` [experts, in, out] → (blocks, scales) as gpt-oss checkpoints store them: each row of
    ``w``'s transpose in groups of 32 scaled by the power of two that brings the group's largest
    value within ±6, every value rounded to the nearest FP4 one."""
    experts, size_in, size_out = w.shape
    groups = w.transpose(1, 2).reshape(experts, size_out, size_in // 32, 32)
    exponent = torch.ceil(torch.log2(groups.abs().amax(-1) / 6)).clamp(min=-SCALE_BIAS)
    lut = torch.tensor(FP4_VALUES)
    codes = ((groups / torch.exp2(exponent)[..., None])[..., None] - lut).abs().argmin(-1).to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), (exponent + SCALE_BIAS).to(torch.uint8)


def test_gpt_oss_mxfp4_experts_load_as_hf_dequantizes_them(model_dir, tmp_path):
    """The tiny checkpoint's experts quantized to MXFP4 (``*_blocks`` + ``*_scales``, the scales
    in a second file as a sharded checkpoint may put them) load equal to HF's dequantization, on
    one rank and as each of two ranks' shards (TP: a slice of every expert; EP: two whole experts
    each); the engine over them gives HF's tokens over the dequantized weights."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    quantized, dequantized = tmp_path / "mxfp4", tmp_path / "dequantized"
    build_tiny_checkpoint("gpt_oss", quantized, seed=0)
    build_tiny_checkpoint("gpt_oss", dequantized, seed=0)
    tensors, scales, expected = load_file(str(quantized / "model.safetensors")), {}, {}
    for name in [n for n in tensors if n.endswith(EXPERTS)]:
        tensors[name + "_blocks"], scales[name + "_scales"] = quantize_mxfp4(tensors.pop(name))
        expected[name] = convert_moe_packed_tensors(tensors[name + "_blocks"], scales[name + "_scales"],
                                                    dtype=torch.float32)
    assert len(expected) == 2 * 4
    save_file(tensors, str(quantized / "model.safetensors"))
    save_file(scales, str(quantized / "scales.safetensors"))
    plain = load_file(str(dequantized / "model.safetensors"))
    save_file({**plain, **expected}, str(dequantized / "model.safetensors"))  # HF's dequantization, unquantized

    files = [str(quantized / "model.safetensors"), str(quantized / "scales.safetensors")]
    config = load_config(str(quantized))
    half = config.intermediate_size // 2
    for rank, size, ep in ((0, 1, False), (0, 2, False), (1, 2, False), (0, 2, True), (1, 2, True)):
        model = build_model(config, TPGroup(rank=rank, size=size, expert_parallel=ep)).to_empty(device="cpu")
        missing, unexpected = load_weights(model, files)
        assert not missing and not unexpected
        params = dict(model.named_parameters())
        for name, want in expected.items():
            if ep:  # this rank's experts [2·rank, 2·rank + 2), whole
                want = want[2 * rank:2 * rank + 2]
            elif size == 2:  # this rank's intermediate rows: gate/up pairs [2·start, 2·stop), down rows [start, stop)
                start = rank * half
                want = want[..., 2 * start:2 * (start + half)] if "gate_up" in name else want[:, start:start + half]
            assert torch.equal(params[name], want), name

    engine = Engine(model_path=str(quantized), skip_tokenizer_init=True, max_total_tokens=1024)
    try:
        outs = engine.generate(input_ids=prompts()[1], sampling_params=GREEDY)
    finally:
        engine.shutdown()
    assert_greedy_parity(str(dequantized), prompts()[1], [o["output_ids"] for o in outs], GREEDY["max_new_tokens"])

    # a weight update to the MXFP4 checkpoint (an RL step's gpt-oss) checks and loads it as the start does
    other = build_tiny_checkpoint("gpt_oss", tmp_path / "other", seed=1)
    engine = Engine(model_path=str(other), skip_tokenizer_init=True, max_total_tokens=1024)
    try:
        engine.update_weights_from_disk(str(quantized), weight_version="mxfp4")
        outs = generate(engine, str(dequantized), prompts()[1])
        assert {o["meta_info"]["weight_version"] for o in outs} == {"mxfp4"}
        # and from tensors (update_weights_from_tensor): dense experts, then the MXFP4 blocks and scales
        engine.update_weights_from_tensor(list(load_file(f"{other}/model.safetensors").items()))
        generate(engine, str(other), prompts()[1])
        engine.update_weights_from_tensor([*tensors.items(), *scales.items()])
        generate(engine, str(dequantized), prompts()[1])
    finally:
        engine.shutdown()
