"""Config fields that change the math: each case builds a tiny random checkpoint of a
family with the field set (HF transformers writes it) and holds our greedy tokens
*and* their log-probabilities against HF's. A field we cannot serve must be refused
naming it, never served silently wrong."""

import random

import pytest
import torch

from actors.engine import Engine
from actors.engine.model_loader import get_context_length
from actors.engine.tiny import build_tiny_checkpoint, tiny_config
from cluster.backend import model_context_len
from tests.parity import assert_greedy_parity
from tests.test_engine_families import LONGROPE

MAX_NEW = 6

YARN_DEEPSEEK = dict(rope_type="yarn", rope_theta=100.0, factor=40.0, original_max_position_embeddings=32,
                    beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=0.8)

# case id -> (family, config overrides)
CASES = {
    # Qwen2/Qwen3 with use_sliding_window: layers from max_window_layers on attend a window
    "qwen3_sliding_window": ("qwen3", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1)),
    # Qwen3-MoE, Mixtral: without layer_types, the window is every layer's
    "qwen3_moe_sliding_window": ("qwen3_moe", dict(use_sliding_window=True, sliding_window=8)),
    "mixtral_sliding_window": ("mixtral", dict(sliding_window=8)),
    # Qwen3-MoE: a dense MLP on mlp_only_layers (layer 0) and on layers off decoder_sparse_step (layer 2);
    # the top-k probabilities not renormalised (Qwen3-MoE's default)
    "qwen3_moe_dense_layers_unnormalised_top_k": ("qwen3_moe", dict(
        num_hidden_layers=4, mlp_only_layers=[0], decoder_sparse_step=2, norm_topk_prob=False)),
    # biases on q/k/v/o and on gate/up/down (random in tiny checkpoints)
    "llama_attention_and_mlp_bias": ("llama", dict(attention_bias=True, mlp_bias=True)),
    "qwen3_attention_bias": ("qwen3", dict(attention_bias=True)),
    # RoPE scaling: Llama 3.x's frequency-band rescaling (all three bands at head_dim 16), linear interpolation
    "llama_rope_llama3": ("llama", dict(rope_parameters=dict(
        rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=64))),
    "qwen3_rope_linear": ("qwen3", dict(rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=4.0))),
    "gemma3_rope_linear_on_full_layers": ("gemma3", dict(rope_parameters={  # Gemma 3 4B+
        "sliding_attention": dict(rope_type="default", rope_theta=10000.0),
        "full_attention": dict(rope_type="linear", rope_theta=1000000.0, factor=8.0)})),
    # YaRN. At head_dim 16, base 100 and original_max_position_embeddings 32 (prompts run past it)
    # the bands are: kept, two blended, five interpolated; cos/sin scaled by attention_factor.
    "qwen3_rope_yarn": ("qwen3", dict(max_position_embeddings=128, rope_parameters=dict(
        rope_type="yarn", rope_theta=100.0, factor=4.0, original_max_position_embeddings=32))),
    # the legacy rope_scaling spelling, every optional field: a wider, untruncated ramp, attention_factor given
    "llama_rope_yarn_untruncated": ("llama", dict(max_position_embeddings=128, rope_theta=100.0, rope_scaling=dict(
        rope_type="yarn", factor=4.0, original_max_position_embeddings=32, beta_fast=8, beta_slow=0.5,
        truncate=False, attention_factor=1.25))),
    # DeepSeek: cos/sin scaled by mscale(mscale) / mscale(mscale_all_dim), the softmax by mscale(mscale_all_dim)²
    "deepseek_v3_rope_yarn_mscale": ("deepseek_v3", dict(max_position_embeddings=1280, rope_parameters=YARN_DEEPSEEK)),
    "deepseek_v3_rope_yarn_mscale_not_interleaved": ("deepseek_v3", dict(
        max_position_embeddings=1280, rope_parameters=YARN_DEEPSEEK, rope_interleave=False)),
    # partial rotary: the ramp is over the rotary dims (4 of 16) only
    "qwen3_next_rope_yarn_partial_rotary": ("qwen3_next", dict(max_position_embeddings=128, rope_parameters=dict(
        rope_type="yarn", rope_theta=100.0, factor=4.0, original_max_position_embeddings=32,
        partial_rotary_factor=0.25))),
    # Gemma 3's legacy fields: rope_scaling applies to the full layers, sliding ones keep rope_local_base_freq
    # unscaled; HF ignores a per-layer truncate (it reads the top level of rope_parameters)
    "gemma3_rope_yarn_on_full_layers": ("gemma3", dict(
        max_position_embeddings=128, rope_theta=100.0, rope_local_base_freq=10000.0, rope_scaling=dict(
            rope_type="yarn", factor=4.0, original_max_position_embeddings=32, truncate=False))),
}


def prompts():
    rng = random.Random(0)
    return [[rng.randrange(5, 261) for _ in range(n)] for n in (3, 20, 37)]


def generate(model_dir, batch, **engine_args):
    """Our greedy outputs and their logprobs."""
    engine = Engine(model_path=model_dir, skip_tokenizer_init=True, max_total_tokens=1024, **engine_args)
    try:
        params = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True, "return_logprob": True}
        outs = engine.generate(input_ids=batch, sampling_params=params)
        engine.check_integrity()
    finally:
        engine.shutdown()
    return [o["output_ids"] for o in outs], [[lp for lp, _ in o["meta_info"]["output_token_logprobs"]] for o in outs]


@pytest.mark.parametrize("case", list(CASES))
def test_config_variant_matches_hf(case, tmp_path):
    family, overrides = CASES[case]
    model_dir = str(build_tiny_checkpoint(family, tmp_path / case, seed=0, **overrides))
    batch = prompts()
    outputs, logprobs = generate(model_dir, batch)
    assert_greedy_parity(model_dir, batch, outputs, MAX_NEW, logprobs=logprobs)


QWEN3_YARN = dict(rope_type="yarn", rope_theta=1000000.0, factor=4.0, original_max_position_embeddings=32768)


@pytest.mark.parametrize("family, overrides, context_len", [
    ("llama", {}, 4096),
    # Qwen3's YaRN: the factor scales original_max_position_embeddings, not max_position_embeddings (40960)
    ("qwen3", dict(max_position_embeddings=40960, rope_parameters=QWEN3_YARN), 131072),
    ("qwen3", dict(max_position_embeddings=40960, rope_scaling=QWEN3_YARN), 131072),  # (the legacy spelling)
    ("qwen3", dict(rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=4.0)), 16384),
    # lengths that are the scaled ones already: Llama 3.1's, LongRoPE's, Gemma 3's
    ("llama", dict(max_position_embeddings=131072, rope_parameters=dict(
        rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=8192)), 131072),
    ("phi3", LONGROPE, 4096),
    ("gemma3", dict(rope_parameters={"sliding_attention": dict(rope_type="default", rope_theta=10000.0),
                                     "full_attention": dict(rope_type="linear", rope_theta=1000000.0, factor=8.0)}),
     4096),
])
def test_context_length_is_vllms_max_model_len_under_rope_scaling(family, overrides, context_len):
    """vLLM's ``_get_and_verify_max_len``; the length used to be max_position_embeddings alone."""
    assert get_context_length(tiny_config(family, **overrides)) == context_len


def test_a_yarn_checkpoint_serves_past_its_unscaled_length(tmp_path):
    """Qwen3's shape, shrunk: max_position_embeddings 40 under YaRN, factor 4 over 32. The engine and
    the server both take 128 as the context (vLLM's max_model_len), and a prompt past 40 is served
    as HF computes it (it was refused: longer than the model's context, 40)."""
    model_dir = str(build_tiny_checkpoint("qwen3", tmp_path / "yarn", seed=0, max_position_embeddings=40,
                                          rope_parameters=dict(QWEN3_YARN, original_max_position_embeddings=32)))
    assert model_context_len(model_dir) == 128 and model_context_len(model_dir, configured=64) == 64
    batch = [[random.Random(1).randrange(5, 261) for _ in range(100)]]
    outputs, logprobs = generate(model_dir, batch)
    assert_greedy_parity(model_dir, batch, outputs, MAX_NEW, logprobs=logprobs)


def test_deepseek_routing_bias_stays_fp32_in_a_bf16_model(tmp_path):
    """HF keeps ``e_score_correction_bias`` in fp32 whatever the dtype: the experts a token is
    routed to are chosen on ``sigmoid + bias``, where bf16 rounding of the bias reorders close
    scores. Biases bf16 cannot hold (0.3 + 1e-3·k) make the choice depend on it."""
    from transformers import AutoModelForCausalLM
    from safetensors.torch import load_file, save_file

    from actors.engine.model_loader import load_model

    path = build_tiny_checkpoint("deepseek_v3", tmp_path / "m", seed=0)
    tensors = load_file(path / "model.safetensors")
    gen = torch.Generator().manual_seed(1)
    for name in tensors:
        if name.endswith("e_score_correction_bias"):
            tensors[name] = 0.3 + 1e-3 * torch.randperm(tensors[name].numel(), generator=gen).float()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})

    ours, _, dtype = load_model(str(path), "bfloat16", "cpu")
    hf = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.bfloat16).eval()
    assert dtype == torch.bfloat16
    # small inputs: every sigmoid score near 0.5, so the bias's last digits pick the experts
    x = (torch.randn(64, hf.config.hidden_size, generator=gen) * 0.01).to(torch.bfloat16)
    for layer_id in range(hf.config.first_k_dense_replace, hf.config.num_hidden_layers):
        gate = ours.model.layers[layer_id].mlp.gate
        bias = tensors[f"model.layers.{layer_id}.mlp.gate.e_score_correction_bias"]
        assert gate.e_score_correction_bias.dtype == torch.float32
        assert torch.equal(gate.e_score_correction_bias, bias)
        with torch.no_grad():
            idx, weights = gate(x)
            _, hf_weights, hf_idx = hf.model.layers[layer_id].mlp.gate(x)
        assert torch.equal(idx.sort(-1).values, hf_idx.sort(-1).values)
        torch.testing.assert_close(weights.gather(1, idx.argsort(-1)), hf_weights.gather(1, hf_idx.argsort(-1)))


@pytest.mark.parametrize("family, overrides", [("deepseek_v3", {}), ("qwen3_next", {"num_experts_per_tok": 3}),
                                               ("qwen3_moe", {"num_experts_per_tok": 3}), ("mixtral", {})])
def test_bf16_moe_block_equals_hf_bit_for_bit(family, overrides, tmp_path):
    """In bf16 the MoE output depends on where it rounds: HF weights each expert's output
    (DeepSeek, Mixtral: by fp32 routing weights; Qwen: by weights cast to bf16) and sums the top-k
    in fp32, rounding once."""
    from transformers import AutoModelForCausalLM

    from actors.engine.model_loader import load_model

    path = build_tiny_checkpoint(family, tmp_path / family, seed=0, **overrides)
    ours, config, _ = load_model(str(path), "bfloat16", "cpu")
    hf = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.bfloat16).eval()
    x = torch.randn(64, config.hidden_size, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    blocks = [getattr(layer, getattr(layer, "mlp_name", "mlp")) for layer in ours.model.layers]  # (Mixtral's name)
    moe_layers = [i for i, block in enumerate(blocks) if hasattr(block, "gate")]
    assert moe_layers
    with torch.no_grad():
        for i in moe_layers:
            assert torch.equal(blocks[i](x), hf.model.layers[i].mlp(x[None])[0]), f"layer {i}"


@pytest.mark.parametrize("family, extra", [
    ("deepseek_v3", {"model.layers.3.eh_proj.weight": (64, 128), "model.layers.3.enorm.weight": (64,)}),  # MTP layer
    ("qwen3_next", {"mtp.fc.weight": (64, 128), "mtp.layers.0.input_layernorm.weight": (64,)}),
    ("llama", {"model.layers.0.self_attn.rotary_emb.inv_freq": (8,)}),  # older checkpoints saved the buffer
])
def test_weights_hf_ignores_load_and_a_stray_name_still_fails(family, extra, tmp_path):
    """Real checkpoints carry tensors HF skips when loading — multi-token-prediction layers
    (DeepSeek-V3's layer ``num_hidden_layers``, Qwen3-Next's ``mtp.*``), saved ``inv_freq``
    buffers; they must not stop the load. Any other unknown name still does."""
    from safetensors.torch import load_file, save_file

    from actors.engine.model_loader import load_model

    path = build_tiny_checkpoint(family, tmp_path / family, seed=0)
    tensors = load_file(path / "model.safetensors")
    tensors.update({name: torch.ones(shape) for name, shape in extra.items()})
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    model, _, _ = load_model(str(path), "auto", "cpu")
    assert torch.equal(model.lm_head.weight, tensors["lm_head.weight"])

    tensors["model.layers.0.mystery.weight"] = torch.ones(2)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="mystery"):
        load_model(str(path), "auto", "cpu")


@pytest.mark.parametrize("family, overrides, field", [
    ("llama", dict(rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0)), "rope_type"),
    ("deepseek_v3", dict(rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0)), "rope_type"),
    ("llama", dict(rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=None,  # HF: max_pos / original
                                        original_max_position_embeddings=1024)), "rope_parameters.factor"),
    ("gemma3", dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
])
def test_fields_not_served_are_refused_naming_them(family, overrides, field):
    """Refused while the model is built, before any weight is read."""
    from actors.engine.model_loader import build_model

    config = tiny_config(family, **overrides)
    config.architectures = [type(config).__name__.replace("TextConfig", "ForCausalLM").replace("Config", "ForCausalLM")]
    with pytest.raises(ValueError, match=field):
        build_model(config)
