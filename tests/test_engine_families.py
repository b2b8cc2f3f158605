"""The families beyond Llama's layer, each against HF through the engine (test_engine_moe's batch,
chunked prefill and prefix hit, greedy tokens and their logprobs) and at TP 2 (ranks as threads)
against TP 1. Phi-3: fused qkv_proj / gate_up_proj cut per part under TP, a partial rotary dim, LongRoPE.
Granite: its embedding, attention, residual multipliers and logits scaling, each away from 1. OLMo 2: q/k
norms over the whole projection, whose statistic TP all-reduces (its one KV head replicated: olmo2_mqa).
DeepSeek-V2 / V2-Lite: V3's MLA with V2's softmax routing (group-limited, greedy)."""

import pytest
import torch

from actors.engine.layers import RotaryEmbedding
from actors.engine.model_loader import build_model
from actors.engine.models.phi3 import phi3_rope
from actors.engine.parallel import TPGroup
from actors.engine.tiny import build_tiny_checkpoint, tiny_config
from tests.parity import assert_greedy_parity
from tests.test_engine_moe import GREEDY, assert_tp2_equals_tp1, generate, prompts
from tests.tp_helpers import thread_ranks

# LongRoPE as Phi-3-mini-128k's (per-band short and long factors; the attention factor from the
# max_position_embeddings / original_max_position_embeddings ratio, 16 here), its original length past the tests'
# (HF's Phi3Config reads it from the top level)
LONGROPE = {"original_max_position_embeddings": 256, "rope_parameters": {
    "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
    "original_max_position_embeddings": 256,
    "short_factor": [1.0, 1.3, 2.0, 3.5, 6.0, 9.0], "long_factor": [1.5, 2.5, 4.0, 8.0, 16.0, 30.0]}}
YARN_MSCALE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 32,
               "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1}
CASES = {"phi3": ("phi3", {}), "phi3_longrope": ("phi3", LONGROPE),
         "phi3_window": ("phi3", {"sliding_window": 16}),  # (Phi-3-mini-4k's 2047: every layer's, Mistral's way)
         "granite": ("granite", {}), "olmo2": ("olmo2", {}),
         "olmo2_mqa": ("olmo2", {"num_key_value_heads": 1}),
         # V2: group-limited routing, a q_lora; V2-Lite: greedy routing, no q_lora, YaRN with its mscale
         "deepseek_v2": ("deepseek_v2", {"q_lora_rank": 32}),
         "deepseek_v2_lite": ("deepseek_v2", {"topk_method": "greedy", "routed_scaling_factor": 2.5,
                                              "rope_parameters": YARN_MSCALE})}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {case: str(build_tiny_checkpoint(family, root / case, seed=0, **overrides))
            for case, (family, overrides) in CASES.items()}


@pytest.mark.parametrize("case", CASES)
def test_tokens_equal_hf_through_chunks_and_a_prefix_hit(checkpoints, case):
    outputs, logprobs, cached, spec, _ = generate(checkpoints[case])
    family, overrides = CASES[case]
    assert cached >= 40 and spec.kind == ("mla" if family == "deepseek_v2" else "swa" if "sliding_window" in overrides
                                          else "mha")
    batch, follow = prompts()
    assert_greedy_parity(checkpoints[case], batch + follow, outputs, GREEDY["max_new_tokens"], logprobs=logprobs)


@pytest.mark.parametrize("case", ["phi3", "granite", "olmo2", "olmo2_mqa", "deepseek_v2"])
def test_tp2_equals_tp1(checkpoints, case, monkeypatch):
    thread_ranks(monkeypatch)
    assert_tp2_equals_tp1(checkpoints[case])


def test_phi3_fused_tensors_cut_per_part():
    """A rank's rows of the fused tensors: its query heads' of q, its KV heads' of k and of v; its
    half of gate and of up (4 heads of 16 dims, 2 KV heads, intermediate 128)."""
    config = tiny_config("phi3")
    config.architectures = ["Phi3ForCausalLM"]
    for rank in range(2):
        layer = build_model(config, TPGroup(rank=rank, size=2)).model.layers[0]
        qkv, gate_up = layer.self_attn.qkv_proj.param_shards["weight"], layer.mlp.gate_up_proj.param_shards["weight"]
        q, kv = 32 * rank, 16 * rank
        assert qkv.ranges == [range(q, q + 32), range(64 + kv, 64 + kv + 16), range(96 + kv, 96 + kv + 16)]
        assert gate_up.ranges == [range(64 * rank, 64 * rank + 64), range(128 + 64 * rank, 128 + 64 * rank + 64)]


def test_longrope_past_the_original_length_equals_hf():
    """Positions at or past original_max_position_embeddings rotate by the long factors (HF's whole
    forward does once its sequence passes it); below it, by the short ones; cos and sin scaled alike."""
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    config = tiny_config("phi3", **LONGROPE)
    hf = Phi3RotaryEmbedding(config)
    ours = RotaryEmbedding(*phi3_rope(config, 16))
    for positions in (torch.arange(200, 256), torch.arange(256, 300)):
        ref_cos, ref_sin = hf(torch.zeros(1), positions[None])
        cos, sin = ours.cos_sin(positions, torch.float32)
        torch.testing.assert_close(cos, ref_cos[0], rtol=0, atol=1e-6)
        torch.testing.assert_close(sin, ref_sin[0], rtol=0, atol=1e-6)
