"""DeepSeek-V3 (MLA + routed MoE) through the engine: greedy parity with HF
on both attention backends, with prefix reuse, chunked prefill and paging."""

import random

import pytest
import torch

from actors.engine import Engine
from tests.parity import assert_greedy_parity


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config(
        vocab_size=384, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_group=2,
        topk_group=1, first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=32, qk_rope_head_dim=16,
        qk_nope_head_dim=16, v_head_dim=16, max_position_embeddings=512, dtype="float32",
    )
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(cfg)
    with torch.no_grad():  # a non-zero correction bias exercises the routing path
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.1)
    path = tmp_path_factory.mktemp("deepseek_v3")
    model.save_pretrained(path)
    return str(path)


def prompts(n, lo, hi, seed=0, shared=()):
    rng = random.Random(seed)
    return [list(shared) + [rng.randrange(3, 384) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


@pytest.mark.parametrize("backend, page_size", [("torch", 1), ("torch", 16), ("triton", 1)])
def test_mla_parity_with_prefix_reuse_and_chunks(model_dir, backend, page_size):
    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    engine = Engine(model_path=model_dir, skip_tokenizer_init=True, attention_backend=backend, device=device,
                    page_size=page_size, max_total_tokens=2048, chunked_prefill_size=16)
    system = prompts(1, 72, 72, seed=3)[0]  # a family of 2 attends it in cascade on the torch backend
    batches = [prompts(2, 3, 9, seed=1, shared=system), prompts(2, 2, 6, seed=2, shared=system)]
    for i, batch in enumerate(batches):
        outs = engine.generate(input_ids=batch, sampling_params={"max_new_tokens": 8, "temperature": 0})
        assert_greedy_parity(model_dir, batch, [o["output_ids"] for o in outs], 8, engine.eos_token_ids)
        if i == 1:
            assert all(o["meta_info"]["cached_tokens"] >= 72 // page_size * page_size for o in outs)
    engine.check_integrity()
    engine.shutdown()
