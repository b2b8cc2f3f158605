"""Tiny random-weight checkpoints of every served family, built locally, and random PEFT
LoRA adapters for them.

    python -m actors.engine.tiny --family llama --out DIR --seed 0

The same seed gives byte-identical weights. Each checkpoint is a regular HF
directory (config.json, model.safetensors, generation_config.json) plus the
byte-level tokenizer and ChatML template of ``actors.engine.tokenizer``, so
HF transformers loads it too — it is the parity oracle's input. The adapters
are what the LoRA tests and scripts/soak.py serve.

A vision-language family (:data:`VL_FAMILIES`: Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE) adds the vision tokens to the
tokenizer and an image processor config (``preprocessor_config.json``, small ``min_pixels`` /
``max_pixels``: an image is a few dozen patches), so ``AutoImageProcessor`` loads it offline, and a video processor
config (``video_preprocessor_config.json``, as small).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Union

import torch

from actors.engine.tokenizer import (BOS_ID, EOS_ID, IMAGE_PAD_ID, PAD_ID, TOKENIZER_VOCAB_SIZE, VIDEO_PAD_ID,
                                     VISION_END_ID, VISION_START_ID, VL_TOKENIZER_VOCAB_SIZE, save_tokenizer)

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")  # the projections a LoRA adapter may target
MLP = ("gate_proj", "up_proj", "down_proj")
FAMILIES = ("llama", "qwen3", "qwen3_next", "deepseek_v3", "gemma3", "gpt_oss", "qwen3_moe", "mixtral", "mistral",
            "phi3", "granite", "olmo2", "deepseek_v2")
VL_FAMILIES = ("qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")  # vision-language: HF's ...ForConditionalGeneration, not AutoModelForCausalLM
STACKED_EXPERTS = ("experts.gate_up_proj", "experts.down_proj")  # (Qwen3-VL-MoE's 3-D experts, transformers 5's)
VOCAB_SIZE = TOKENIZER_VOCAB_SIZE  # every id the model can emit decodes to text
COMMON = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_attention_heads=4,
              max_position_embeddings=4096, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
              tie_word_embeddings=False, dtype="float32")


def tiny_config(family: str, **overrides):
    """The HF config of ``family``'s tiny model; ``overrides`` replace or add config fields
    (a test's variant of the family: rope scaling, biases, sliding windows...)."""
    import transformers as tf

    if family == "llama":
        return tf.LlamaConfig(**{**COMMON, "num_hidden_layers": 2, "num_key_value_heads": 2, **overrides})
    if family == "qwen3":
        return tf.Qwen3Config(**{**COMMON, "num_hidden_layers": 2, "num_key_value_heads": 2, "head_dim": 16,
                                 **overrides})
    if family == "deepseek_v3":  # HF DeepseekV3 needs as many KV heads as attention heads
        return tf.DeepseekV3Config(**{
            **COMMON, "num_hidden_layers": 3, "num_key_value_heads": 4, "moe_intermediate_size": 32,
            "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1,
            "first_k_dense_replace": 1, "q_lora_rank": None, "kv_lora_rank": 32, "qk_rope_head_dim": 16,
            "qk_nope_head_dim": 16, "v_head_dim": 16, **overrides,
        })
    if family == "deepseek_v2":  # V2's group-limited softmax routing (V2-Lite's: topk_method="greedy")
        return tf.DeepseekV2Config(**{
            **COMMON, "num_hidden_layers": 3, "num_key_value_heads": 4, "moe_intermediate_size": 32,
            "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1,
            "topk_method": "group_limited_greedy", "first_k_dense_replace": 1, "q_lora_rank": None,
            "kv_lora_rank": 32, "qk_rope_head_dim": 16, "qk_nope_head_dim": 16, "v_head_dim": 16, **overrides,
        })
    if family == "gemma3":
        return tf.Gemma3TextConfig(**{
            **COMMON, "num_hidden_layers": 4, "num_key_value_heads": 2, "head_dim": 16, "sliding_window": 16,
            "layer_types": ["sliding_attention"] * 3 + ["full_attention"], **overrides,
        })
    if family == "qwen3_next":
        return tf.Qwen3NextConfig(**{
            **COMMON, "num_hidden_layers": 4, "num_key_value_heads": 2, "head_dim": 16, "linear_num_key_heads": 2,
            "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
            "linear_conv_kernel_dim": 4, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 32, "layer_types": ["linear_attention"] * 3 + ["full_attention"],
            **overrides,
        })
    if family == "gpt_oss":  # HF's YaRN (factor 32, not truncated) over 128 positions: the context, 128 x 32 by
        # vLLM's rule, is max_position_embeddings as the checkpoint's 4096 x 32 (HF's default 4096 would give 131072)
        rope = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": False, "original_max_position_embeddings": 128}
        return tf.GptOssConfig(**{
            **COMMON, "num_hidden_layers": 4, "num_key_value_heads": 2, "head_dim": 16, "sliding_window": 8,
            "rope_parameters": rope,
            "intermediate_size": 32, "num_local_experts": 4, "num_experts_per_tok": 2,
            "layer_types": ["sliding_attention", "full_attention"] * 2,
            "swiglu_limit": 1.0, **overrides,  # (low enough that the random activations reach the clamp)
        })
    if family == "qwen3_moe":  # top-k renormalised, as Qwen3-30B-A3B's config
        return tf.Qwen3MoeConfig(**{
            **COMMON, "num_hidden_layers": 2, "num_key_value_heads": 2, "head_dim": 16, "num_experts": 4,
            "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True, **overrides,
        })
    if family == "mixtral":
        return tf.MixtralConfig(**{**COMMON, "num_hidden_layers": 2, "num_key_value_heads": 2, "intermediate_size": 32,
                                   "num_local_experts": 4, "num_experts_per_tok": 2, **overrides})
    if family == "mistral":  # a window the tests' prompts run past (Mistral 7B v0.1's is 4096)
        return tf.MistralConfig(**{**COMMON, "num_hidden_layers": 2, "num_key_value_heads": 2, "sliding_window": 16,
                                   **overrides})
    if family == "phi3":  # fused qkv_proj / gate_up_proj; Phi-4-mini's partial rotary dim
        return tf.Phi3Config(**{**COMMON, "num_hidden_layers": 2, "num_key_value_heads": 2,
                                "partial_rotary_factor": 0.75, **overrides})
    if family == "granite":  # every multiplier away from its default, 1
        return tf.GraniteConfig(**{**COMMON, "num_hidden_layers": 2, "num_key_value_heads": 2,
                                   "embedding_multiplier": 12.0, "attention_multiplier": 0.5,
                                   "residual_multiplier": 0.22, "logits_scaling": 8.0, **overrides})
    if family == "olmo2":
        return tf.Olmo2Config(**{**COMMON, "num_hidden_layers": 2, "num_key_value_heads": 2, **overrides})
    if family == "qwen2_5_vl":
        return qwen2_5_vl_config(**overrides)
    if family == "qwen3_vl":
        return qwen3_vl_config(**overrides)
    if family == "qwen3_vl_moe":
        return qwen3_vl_config(moe=True, **overrides)
    raise ValueError(f"unknown family {family!r}; known: {', '.join(FAMILIES + VL_FAMILIES)}")


def qwen2_5_vl_config(**overrides):
    """Qwen2.5-VL's: a 2-layer text model (M-RoPE over the head's 8 frequencies: 2 temporal, 3 height, 3
    width) and a vision tower of depth 3, block 1 attending over the whole image, blocks 0 and 2 within
    windows of 2 x 2 merged tokens (window_size 56 = 2 x 2 x 14 pixels). ``overrides``: text config fields."""
    import transformers as tf

    text = {**COMMON, "vocab_size": VL_TOKENIZER_VOCAB_SIZE, "num_hidden_layers": 2, "num_key_value_heads": 2,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}}
    text.pop("tie_word_embeddings")
    vision = dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=COMMON["hidden_size"],
                  patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1])
    return tf.Qwen2_5_VLConfig(text_config={**text, **overrides}, vision_config=vision, image_token_id=IMAGE_PAD_ID,
                               video_token_id=VIDEO_PAD_ID, vision_start_token_id=VISION_START_ID,
                               vision_end_token_id=VISION_END_ID, tie_word_embeddings=False)


def qwen3_vl_config(moe: bool = False, **overrides):
    """Qwen3-VL's: a 2-layer Qwen3 text model (interleaved M-RoPE over the head's 8 frequencies: 2 temporal, 3
    height, 3 width) and a vision tower of depth 3 (patches of 16 pixels, a 4 x 4 learned position grid), blocks
    0 and 1 feeding DeepStack mergers (their features added after decoder layers 0 and 1). ``moe``: Qwen3-VL-MoE's,
    3 layers, the first dense (``mlp_only_layers``), 4 experts of 48 (no stacked matrix square: which way a
    checkpoint stores them shows). ``overrides``: text config fields."""
    import transformers as tf

    text = {**COMMON, "vocab_size": VL_TOKENIZER_VOCAB_SIZE, "num_hidden_layers": 2, "num_key_value_heads": 2,
            "head_dim": 16, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                "mrope_section": [2, 3, 3], "mrope_interleaved": True}}
    text.pop("tie_word_embeddings")
    if moe:
        text.update(num_hidden_layers=3, mlp_only_layers=[0], num_experts=4, num_experts_per_tok=2,
                    moe_intermediate_size=48)
    vision = dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=COMMON["hidden_size"],
                  patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16,
                  deepstack_visual_indexes=[0, 1])
    return (tf.Qwen3VLMoeConfig if moe else tf.Qwen3VLConfig)(
        text_config={**text, **overrides}, vision_config=vision, image_token_id=IMAGE_PAD_ID,
        video_token_id=VIDEO_PAD_ID, vision_start_token_id=VISION_START_ID, vision_end_token_id=VISION_END_ID,
        tie_word_embeddings=False)


# the tiny VL checkpoints' image processor: 2 x 2 to 6 x 6 merged tokens (16 to 144 patches of 14 pixels)
MIN_PIXELS, MAX_PIXELS = 28 * 28 * 4, 28 * 28 * 36


def _init_weights(model: torch.nn.Module, seed: int) -> None:
    """Deterministic init: matrices ~ N(0, 1/fan_in) (a convolution's fan-in: its input channels
    times its kernel) (outputs vary token to token,
    unlike HF's tiny-std default), biases ~ N(0, 0.1²) (HF's zeros would hide them; GPT-OSS's
    experts' ``*_proj_bias`` too), attention sinks ~ N(0, 1) (as much weight as a key's),
    other vectors (norms) keep their defaults."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if param.dim() >= 2:
                fan_in = math.prod(param.shape[1:]) if param.dim() > 3 else param.shape[-1]
                param.copy_(torch.randn(param.shape, generator=gen) / math.sqrt(fan_in))
            elif name.endswith((".bias", "_proj_bias")):
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
            elif name.endswith(".sinks"):
                param.copy_(torch.randn(param.shape, generator=gen))
        for name, buf in sorted(model.named_buffers()):
            if name.endswith("e_score_correction_bias"):  # exercise DeepSeek's routing correction
                buf.copy_(torch.randn(buf.shape, generator=gen) * 0.1)


def build_tiny_checkpoint(family: str, out_dir: Union[str, Path], seed: int = 0, **overrides) -> Path:
    """``overrides``: config fields of a variant (see :func:`tiny_config`)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, GenerationConfig

    config = tiny_config(family, **overrides)
    torch.manual_seed(seed)
    vision = family in VL_FAMILIES
    model = (AutoModelForImageTextToText if vision else AutoModelForCausalLM).from_config(config)
    _init_weights(model, seed)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID, do_sample=False
    )
    model.save_pretrained(out, safe_serialization=True)
    save_tokenizer(out, vision=vision)
    if vision:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        # (saved as Qwen2VLImageProcessor: AutoImageProcessor picks its PIL or torchvision backend); Qwen3-VL's
        # patches are 16 pixels, normalized to [-1, 1]
        patch = config.vision_config.patch_size
        scale = (patch * config.vision_config.spatial_merge_size / 28) ** 2
        extra = {} if family == "qwen2_5_vl" else dict(patch_size=patch, image_mean=[0.5] * 3, image_std=[0.5] * 3)
        Qwen2VLImageProcessorPil(min_pixels=round(MIN_PIXELS * scale), max_pixels=round(MAX_PIXELS * scale),
                                 **extra).save_pretrained(out)
        _save_video_processor(out, family, scale, extra)
    return out


def _save_video_processor(out: Path, family: str, scale: float, extra: dict) -> None:
    """video_preprocessor_config.json (HF's video processors need torchvision: written as one saves it): a frame
    of the tiny Qwen2.5-VL's 4 to 36 merged tokens; the tiny Qwen3-VL's budget is the whole video's, 8 frames of
    its most."""
    qwen3 = family != "qwen2_5_vl"
    settings = dict(video_processor_type="Qwen3VLVideoProcessor" if qwen3 else "Qwen2VLVideoProcessor",
                    size={"shortest_edge": round(MIN_PIXELS * scale), "longest_edge": round(MAX_PIXELS * scale)
                          * (8 if qwen3 else 1)}, temporal_patch_size=2, merge_size=2, **extra)
    (out / "video_preprocessor_config.json").write_text(json.dumps(settings, indent=2))


def make_adapter(model_dir: str, out_dir: Path, rank: int, alpha: float, targets: Sequence[str] = ATTENTION + MLP,
                 seed: int = 0, use_rslora: bool = False, experts: Sequence[str] = (), **config) -> Path:
    """A random adapter of every layer's ``targets`` in PEFT's layout (A and B both non-zero, so it
    changes the model's output); ``config``: more adapter_config.json fields. A target is the last
    name of a linear layer of the layer's attention, dense MLP or shared expert, wherever it sits (HF's
    modules: a MoE family's experts are none of them, so ``gate_proj`` targets Qwen3-MoE's dense layers
    only, and no Mixtral layer; DeepSeek's and Qwen3-Next's MoE layers by their shared expert; Phi-3's are
    ``qkv_proj`` and ``gate_up_proj``, DeepSeek's MLA ``kv_a_proj_with_mqa`` ...). ``experts``: the routed
    experts' projections to target too, every expert's, by the checkpoint's names (``gate_proj``; Mixtral's
    ``w1``), as PEFT writes an adapter of a model whose experts are linear layers each (Qwen3-VL-MoE's, stacked in
    ``experts.gate_up_proj`` and ``down_proj``, by Qwen3-MoE's names). A vision-language model's are its decoder
    layers' (``model.language_model.layers.*``: transformers 5's names), never its vision tower's."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    hf_config = AutoConfig.from_pretrained(model_dir)
    vision = hasattr(hf_config, "vision_config")
    with torch.device("meta"):
        hf = (AutoModelForImageTextToText if vision else AutoModelForCausalLM).from_config(hf_config)
    shapes = {n: (m.in_features, m.out_features) for n, m in hf.named_modules() if isinstance(m, torch.nn.Linear)}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                name = key.removesuffix(".weight")
                if ".experts." in name and name.rpartition(".")[2] in experts and key.endswith(".weight"):
                    fan_out, fan_in = f.get_slice(key).get_shape()
                    shapes[name] = (fan_in, fan_out)
                elif key.endswith(STACKED_EXPERTS):  # ([experts, out, in]: gate's rows of gate_up_proj, then up's)
                    num_experts, fan_out, fan_in = f.get_slice(key).get_shape()
                    parts = ("gate_proj", "up_proj") if key.endswith("gate_up_proj") else ("down_proj",)
                    shapes.update({f"{key.rpartition('.')[0]}.{e}.{part}": (fan_in, fan_out // len(parts))
                                   for e in range(num_experts) for part in parts if part in experts})
    gen, tensors = torch.Generator().manual_seed(seed), {}
    for layer in range(hf_config.get_text_config().num_hidden_layers):
        prefix = f"model.{'language_model.' if vision else ''}layers.{layer}."
        for module, expert in [(m, False) for m in targets] + [(m, True) for m in experts]:
            for name in sorted(n for n in shapes if n.startswith(prefix) and n.endswith(f".{module}")
                               and (".experts." in n) == expert):
                fan_in, fan_out = shapes[name]
                key = f"base_model.model.{name}.lora_"
                tensors[key + "A.weight"] = torch.randn(rank, fan_in, generator=gen) / math.sqrt(fan_in)
                tensors[key + "B.weight"] = torch.randn(fan_out, rank, generator=gen) / math.sqrt(rank)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "adapter_model.safetensors"))
    settings = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(targets),
                "use_rslora": use_rslora, "bias": "none", "base_model_name_or_path": model_dir, **config}
    (out_dir / "adapter_config.json").write_text(json.dumps(settings))
    return out_dir


def tiny_adapters(model_dir: str, root: Path) -> Dict[str, Path]:
    """Two adapters of different ranks and targets under ``root``: ``sql`` (r=8 on every projection)
    and ``chat`` (r=4, rsLoRA, q/v/down only: its slots zero-padded to rank 8)."""
    return {"sql": make_adapter(model_dir, root / "sql", rank=8, alpha=16, seed=1),
            "chat": make_adapter(model_dir, root / "chat", rank=4, alpha=8, targets=("q_proj", "v_proj", "down_proj"),
                                 seed=2, use_rslora=True)}


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description="build a tiny random-weight checkpoint")
    parser.add_argument("--family", required=True, choices=FAMILIES + VL_FAMILIES)
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    path = build_tiny_checkpoint(args.family, args.out, args.seed)
    print(f"built tiny {args.family} (seed {args.seed}) at {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
