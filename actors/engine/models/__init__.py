"""Model definitions, looked up by the checkpoint's ``architectures`` name.

Each model takes the HF config and exposes ``forward(forward_batch) ->
LogitsOutput`` (logits of each request's last token, [bs, vocab] fp32, and
the input logprobs the batch asks for: ``models.base``) plus
``kv_cache_spec()``, which tells the model runner which KV pools to build.
Parameter names follow HF so checkpoints load with ``load_state_dict``.
"""

from __future__ import annotations

import importlib

# architectures[0] -> (module, class)
MODEL_REGISTRY = {
    "LlamaForCausalLM": ("actors.engine.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("actors.engine.models.llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("actors.engine.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("actors.engine.models.llama", "LlamaForCausalLM"),
    "GraniteForCausalLM": ("actors.engine.models.llama", "GraniteForCausalLM"),
    "Olmo2ForCausalLM": ("actors.engine.models.olmo2", "Olmo2ForCausalLM"),
    "Phi3ForCausalLM": ("actors.engine.models.phi3", "Phi3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("actors.engine.models.qwen3_moe", "Qwen3MoeForCausalLM"),
    "MixtralForCausalLM": ("actors.engine.models.mixtral", "MixtralForCausalLM"),
    "DeepseekV2ForCausalLM": ("actors.engine.models.deepseek_v3", "DeepseekV3ForCausalLM"),
    "DeepseekV3ForCausalLM": ("actors.engine.models.deepseek_v3", "DeepseekV3ForCausalLM"),
    "Gemma3ForCausalLM": ("actors.engine.models.gemma3", "Gemma3ForCausalLM"),
    "Qwen3NextForCausalLM": ("actors.engine.models.qwen3_next", "Qwen3NextForCausalLM"),
    "GptOssForCausalLM": ("actors.engine.models.gpt_oss", "GptOssForCausalLM"),
    "Qwen2_5_VLForConditionalGeneration": ("actors.engine.models.qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration"),
    "Qwen3VLForConditionalGeneration": ("actors.engine.models.qwen3_vl", "Qwen3VLForConditionalGeneration"),
    "Qwen3VLMoeForConditionalGeneration": ("actors.engine.models.qwen3_vl_moe", "Qwen3VLMoeForConditionalGeneration"),
}


def get_model_class(architecture: str):
    try:
        module, name = MODEL_REGISTRY[architecture]
    except KeyError:
        known = ", ".join(sorted(MODEL_REGISTRY))
        raise ValueError(f"unsupported architecture {architecture!r}; supported: {known}") from None
    return getattr(importlib.import_module(module), name)
