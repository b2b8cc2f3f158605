"""KV budget sizing (mem_cache/memory_budget.py) against numbers worked out by hand."""

import pytest
import torch

from actors.engine.config import EngineConfig
from actors.engine.cuda_graph_runner import cuda_graph_max_bs
from actors.engine.engine import check_engine_integrity, engine_server_info
from actors.engine.model_runner import default_mem_fraction_static
from actors.engine.scheduler import Scheduler

from mem_cache.memory_budget import (
    KVCacheShape,
    MemoryBudget,
    ServerMemoryDefaults,
    cell_size_bytes,
    default_memory_args,
    dtype_size,
    get_device_memory,
    max_mamba_rows,
    profile_max_num_tokens,
)

GiB = 1 << 30
BF16 = torch.bfloat16

LLAMA3_8B = KVCacheShape(num_attention_layers=32, num_kv_heads=8, head_dim=128)
DEEPSEEK_V3 = KVCacheShape(num_attention_layers=61, kv_lora_rank=512, qk_rope_head_dim=64)
# Qwen3-Next-80B-A3B: 48 layers, 12 full attention (2 KV heads x 256), 36 GDN layers.
# Per GDN layer and slot: temporal 32 v-heads x 128 x 128 fp32 = 2_097_152 B,
# conv (2*16*128 + 32*128 = 8192 channels) x (kernel 4 - 1) bf16 = 49_152 B;
# 36 x (2_097_152 + 49_152) = 36 x 2_146_304 = 77_266_944 B per slot.
MAMBA_SLOT = 77_266_944
QWEN3_NEXT = KVCacheShape(
    num_attention_layers=12, num_kv_heads=2, head_dim=256, mamba_state_bytes_per_slot=MAMBA_SLOT
)

# An 80 GiB device with Llama-3-8B's 8_030_261_248 bf16 params (16_060_522_496 B) loaded.
TOTAL_80 = 80 * GiB  # 85_899_345_920
AVAIL_LLAMA = TOTAL_80 - 16_060_522_496  # 69_838_823_424
# mem_fraction_static 0.9 keeps 10% = 8_589_934_592 B free; rest = 61_248_888_832 B.
REST_LLAMA = 61_248_888_832


def llama_budget(**kw) -> MemoryBudget:
    return profile_max_num_tokens(LLAMA3_8B, BF16, AVAIL_LLAMA, TOTAL_80, 0.9, **kw)


# ---- dtype / cell size -----------------------------------------------------


def test_dtype_size():
    assert dtype_size(torch.bfloat16) == 2
    assert dtype_size(torch.float16) == 2
    assert dtype_size(torch.float32) == 4
    assert dtype_size(torch.float8_e4m3fn) == 1
    assert dtype_size(torch.float8_e5m2) == 1
    with pytest.raises(TypeError):
        dtype_size("bfloat16")


def test_llama_cell_size_and_tp_sharding():
    # 8 heads x (128 + 128) x 32 layers x 2 B = 131_072 B
    assert cell_size_bytes(LLAMA3_8B, BF16) == 131_072
    assert cell_size_bytes(LLAMA3_8B, BF16, tp_size=2) == 65_536  # 4 heads per rank
    assert cell_size_bytes(LLAMA3_8B, BF16, tp_size=8) == 16_384  # 1 head per rank
    # TP16 with 8 KV heads: each rank keeps a replica of 1 head -> same as TP8.
    assert cell_size_bytes(LLAMA3_8B, BF16, tp_size=16) == 16_384


def test_v_head_dim_defaults_and_differs():
    assert LLAMA3_8B.v_head_dim == 128
    shape = KVCacheShape(num_attention_layers=2, num_kv_heads=4, head_dim=192, v_head_dim=128)
    # 4 x (192 + 128) x 2 layers x 2 B = 5_120 B
    assert cell_size_bytes(shape, BF16) == 5_120


def test_deepseek_mla_cell_size_ignores_tp():
    # (512 + 64) x 61 layers x 2 B = 70_272 B
    assert DEEPSEEK_V3.is_mla
    assert cell_size_bytes(DEEPSEEK_V3, BF16) == 70_272
    assert cell_size_bytes(DEEPSEEK_V3, BF16, tp_size=8) == 70_272


def test_fp8_halves_the_cell():
    assert cell_size_bytes(LLAMA3_8B, torch.float8_e4m3fn) == 65_536
    assert cell_size_bytes(DEEPSEEK_V3, torch.float8_e4m3fn) == 35_136


def test_hybrid_cell_counts_attention_layers_only():
    # 2 heads x (256 + 256) x 12 layers x 2 B = 24_576 B
    assert QWEN3_NEXT.is_hybrid
    assert cell_size_bytes(QWEN3_NEXT, BF16) == 24_576


# ---- token budget ----------------------------------------------------------


def test_llama_tokens_page_1():
    b = llama_budget()
    # 61_248_888_832 // 131_072 = 467_291 (467_291.9375)
    assert b.rest_bytes == REST_LLAMA
    assert b.cell_size == 131_072
    assert b.max_total_num_tokens == 467_291
    assert b.kv_bytes == 467_291 * 131_072
    assert (b.max_mamba_cache_size, b.mamba_bytes) == (0, 0)


def test_llama_tokens_page_16_rounds_down():
    # 467_291 // 16 = 29_205 pages -> 467_280 tokens
    assert llama_budget(page_size=16).max_total_num_tokens == 467_280


def test_llama_tokens_tp():
    # 61_248_888_832 // 65_536 = 934_583 ; // 16_384 = 3_738_335
    assert llama_budget(tp_size=2).max_total_num_tokens == 934_583
    assert llama_budget(tp_size=8).max_total_num_tokens == 3_738_335
    assert llama_budget(tp_size=16).max_total_num_tokens == 3_738_335


def test_max_total_tokens_caps_then_pages():
    # min(467_291, 1_000) = 1_000 -> // 16 * 16 = 992
    b = llama_budget(max_total_tokens=1_000, page_size=16)
    assert b.max_total_num_tokens == 992
    assert b.kv_bytes == 992 * 131_072


def test_deepseek_tokens():
    # 140 GiB device = 150_323_855_360 B, 60 GiB = 64_424_509_440 B free after weights.
    # 10% kept = 15_032_385_536 B; rest = 49_392_123_904 B; // 70_272 = 702_870
    for tp in (1, 8):
        b = profile_max_num_tokens(DEEPSEEK_V3, BF16, 60 * GiB, 140 * GiB, 0.9, tp_size=tp)
        assert b.rest_bytes == 49_392_123_904
        assert b.max_total_num_tokens == 702_870


def test_fp8_tokens():
    # 61_248_888_832 // 65_536 = 934_583
    b = profile_max_num_tokens(LLAMA3_8B, torch.float8_e5m2, AVAIL_LLAMA, TOTAL_80, 0.9)
    assert b.max_total_num_tokens == 934_583


def test_hybrid_ratio_split():
    # 80 GiB device, 40 GiB free: rest = 40 GiB - 8 GiB = 34_359_738_368 B.
    # Mamba share = rest x 0.9 / 1.9 = 16_275_665_542 B -> // 77_266_944 = 210 slots
    # mamba = 210 x 77_266_944 = 16_226_058_240 B; KV = 18_133_680_128 B // 24_576 = 737_861
    b = profile_max_num_tokens(QWEN3_NEXT, BF16, 40 * GiB, TOTAL_80, 0.9)
    assert b.rest_bytes == 34_359_738_368
    assert b.max_mamba_cache_size == 210
    assert b.mamba_bytes == 16_226_058_240
    assert b.max_total_num_tokens == 737_861
    assert "210 slots" in b.describe()


def test_a_hybrid_verify_scratch_is_taken_with_the_mamba_pool():
    # 100 slots + 20 scratch states = 120 x 77_266_944 = 9_272_033_280 B;
    # KV = 34_359_738_368 - 9_272_033_280 = 25_087_705_088 B // 24_576 = 1_020_821
    b = profile_max_num_tokens(QWEN3_NEXT, BF16, 40 * GiB, TOTAL_80, 0.9, max_mamba_cache_size=100,
                               mamba_verify_states=20)
    assert (b.max_mamba_cache_size, b.mamba_verify_states, b.mamba_bytes) == (100, 20, 9_272_033_280)
    assert b.max_total_num_tokens == 1_020_821
    assert "100 slots + 20 verify states" in b.describe()
    with pytest.raises(ValueError, match="not one page of KV fits.* the 400 Mamba states of the verify scratch"):
        profile_max_num_tokens(QWEN3_NEXT, BF16, 40 * GiB, TOTAL_80, 0.9, max_mamba_cache_size=100,
                               mamba_verify_states=400)


def test_default_rows_of_a_hybrid_fit_the_mamba_share_with_their_verify_scratch():
    # The fixed default, 256 rows x 5 verify states, asked 1280 x 77_266_944 B = 92 GiB for the scratch alone.
    # rest 34_359_738_368 B, Mamba share x 0.9 / 1.9 = 16_275_665_542 B = 210 slot states (above).
    # A row's states as the model runner counts them (from 16 rows on): its working slot (+ 2 ping-pong
    # with extra_buffer), a spare for the tree, and under speculation 4 + 1 verify states.
    rest = 34_359_738_368
    assert max_mamba_rows(QWEN3_NEXT, rest, lambda n: n + max(16, n), 256) == 105  # 2 x 105 = 210
    assert max_mamba_rows(QWEN3_NEXT, rest, lambda n: n + max(16, n) + 5 * n, 256) == 30  # 7 x 30 = 210
    assert max_mamba_rows(QWEN3_NEXT, rest, lambda n: 3 * n + max(16, n) + 5 * n, 256) == 23  # 9 x 23 = 207
    assert max_mamba_rows(QWEN3_NEXT, rest, lambda n: n + max(16, n) + 5 * n, 20) == 20  # capped by most
    assert max_mamba_rows(QWEN3_NEXT, rest, lambda n: 6 * n + 200, 256) == 1  # below 16 rows: the spare 16
    assert max_mamba_rows(QWEN3_NEXT, rest, lambda n: 211 * n, 256) == 0
    b = profile_max_num_tokens(QWEN3_NEXT, BF16, 40 * GiB, TOTAL_80, 0.9, max_mamba_cache_size=60,
                               mamba_verify_states=150)
    assert b.max_total_num_tokens * b.cell_size >= rest / 1.9  # the KV pool keeps its share
    with pytest.raises(ValueError, match="hybrid"):
        max_mamba_rows(LLAMA3_8B, rest, lambda n: n, 256)


def test_hybrid_explicit_slots():
    # 100 slots = 7_726_694_400 B; KV = 34_359_738_368 - 7_726_694_400 = 26_633_043_968 B
    # // 24_576 = 1_083_701 ; page 64: 16_932 pages -> 1_083_648
    b = profile_max_num_tokens(QWEN3_NEXT, BF16, 40 * GiB, TOTAL_80, 0.9, max_mamba_cache_size=100)
    assert (b.max_mamba_cache_size, b.mamba_bytes) == (100, 7_726_694_400)
    assert b.max_total_num_tokens == 1_083_701
    b64 = profile_max_num_tokens(
        QWEN3_NEXT, BF16, 40 * GiB, TOTAL_80, 0.9, page_size=64, max_mamba_cache_size=100
    )
    assert b64.max_total_num_tokens == 1_083_648


def test_a_draft_models_kv_joins_every_slot_unsharded():
    # Llama-3.2-1B as the draft: 16 layers x 8 heads x (64 + 64) x 2 B = 32_768 B a token, on rank 0
    # whole; 61_248_888_832 // (131_072 + 32_768) = 373_833; TP 2: // (65_536 + 32_768) = 623_055
    draft = KVCacheShape(num_attention_layers=16, num_kv_heads=8, head_dim=64)
    b = llama_budget(draft_shape=draft)
    assert (b.max_total_num_tokens, b.cell_size, b.draft_cell_size) == (373_833, 163_840, 32_768)
    assert "32768 B/token of it the draft model's" in b.describe()
    assert llama_budget(draft_shape=draft, tp_size=2).max_total_num_tokens == 623_055


def test_describe_is_one_line():
    line = llama_budget().describe()
    assert "\n" not in line
    assert "467291 tokens" in line and "131072 B" in line
    assert "mamba" not in line


# ---- errors ----------------------------------------------------------------


def test_rest_not_positive_names_mem_fraction_static():
    # 30 GiB free but 0.5 keeps 40 GiB of 80 GiB free -> rest < 0
    with pytest.raises(ValueError, match="mem_fraction_static") as exc:
        profile_max_num_tokens(LLAMA3_8B, BF16, 30 * GiB, TOTAL_80, 0.5)
    assert "30.00 GiB" in str(exc.value) and "40.00 GiB" in str(exc.value)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(num_attention_layers=0, num_kv_heads=8, head_dim=128), "num_attention_layers"),
        (dict(num_attention_layers=32, num_kv_heads=-1, head_dim=128), "num_kv_heads"),
        (dict(num_attention_layers=32, num_kv_heads=8), "head_dim"),
        (dict(num_attention_layers=32, num_kv_heads=8, head_dim=128, v_head_dim=0), "v_head_dim"),
        (dict(num_attention_layers=61, kv_lora_rank=512), "qk_rope_head_dim"),
        (dict(num_attention_layers=61, kv_lora_rank=0, qk_rope_head_dim=64), "kv_lora_rank"),
        (dict(num_attention_layers=4, num_kv_heads=1, head_dim=8, qk_rope_head_dim=64), "qk_rope_head_dim"),
        (
            dict(num_attention_layers=4, num_kv_heads=1, head_dim=8, mamba_state_bytes_per_slot=-1),
            "mamba_state_bytes_per_slot",
        ),
        (  # (a hybrid stage of no layer at all)
            dict(num_attention_layers=0, num_kv_heads=1, head_dim=8, mamba_state_bytes_per_slot=0),
            "mamba_state_bytes_per_slot",
        ),
        (dict(num_attention_layers=2.5, num_kv_heads=1, head_dim=8), "num_attention_layers"),
    ],
)
def test_bad_shape_names_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        KVCacheShape(**kwargs)


def test_zero_tokens():
    # rest = 8 GiB + 100_000 B free - 8 GiB kept = 100_000 B < 131_072 B per token
    with pytest.raises(ValueError, match="not one page"):
        profile_max_num_tokens(LLAMA3_8B, BF16, 8 * GiB + 100_000, TOTAL_80, 0.9)
    # 3 tokens fit (393_216 B) but page_size 4 rounds to 0
    with pytest.raises(ValueError, match="not one page"):
        profile_max_num_tokens(LLAMA3_8B, BF16, 8 * GiB + 400_000, TOTAL_80, 0.9, page_size=4)


def test_bad_arguments():
    with pytest.raises(ValueError, match="mem_fraction_static"):
        profile_max_num_tokens(LLAMA3_8B, BF16, AVAIL_LLAMA, TOTAL_80, 1.5)
    with pytest.raises(ValueError, match="page_size"):
        llama_budget(page_size=0)
    with pytest.raises(ValueError, match="tp_size"):
        llama_budget(tp_size=0)
    with pytest.raises(ValueError, match="hybrid"):
        llama_budget(max_mamba_cache_size=4)
    with pytest.raises(ValueError, match="max_mamba_cache_size"):
        # 1_000 slots = 77 GB > 32 GiB budget
        profile_max_num_tokens(QWEN3_NEXT, BF16, 40 * GiB, TOTAL_80, 0.9, max_mamba_cache_size=1_000)


# ---- server defaults -------------------------------------------------------


def test_defaults_h100_tp1():
    # 80 GB = 81_920 MB; chunked 8192, graphs 256
    # reserved = 512 + 8192 x 1.5 + 256 x 2 + 1 x 1 / 8 x 1024 = 512 + 12_288 + 512 + 128 = 13_440
    # (81_920 - 13_440) / 81_920 = 0.8359375 -> 0.836
    assert default_memory_args(80) == ServerMemoryDefaults(8192, 256, 13_440, 0.836)


def test_defaults_h100_tp8():
    # graphs 512; reserved = 512 + 12_288 + 1_024 + 8 / 8 x 1024 = 14_848
    # (81_920 - 14_848) / 81_920 = 0.81875 -> 0.819
    assert default_memory_args(80, tp_size=8) == ServerMemoryDefaults(8192, 512, 14_848, 0.819)


def test_defaults_24gb_card():
    # 24 GB = 24_576 MB; chunked 2048, graphs 24
    # reserved = 512 + 3_072 + 48 + 128 = 3_760 ; 20_816 / 24_576 = 0.84700.. -> 0.847
    assert default_memory_args(24) == ServerMemoryDefaults(2048, 24, 3_760, 0.847)


@pytest.mark.parametrize(
    "gb, tp, chunked, graphs",
    [(16, 8, 2048, 8), (24, 4, 2048, 80), (40, 1, 4096, 32), (40, 4, 4096, 160),
     (141, 1, 8192, 256), (141, 8, 8192, 512), (192, 1, 16384, 512)],
)
def test_defaults_table_rows(gb, tp, chunked, graphs):
    d = default_memory_args(gb, tp_size=tp)
    assert (d.chunked_prefill_size, d.cuda_graph_max_bs) == (chunked, graphs)


def test_defaults_cpu_has_no_graphs():
    # 64 GB host: the 60-90 GB row gives chunked 8192; no CUDA graphs
    # reserved = 512 + 12_288 + 0 + 128 = 12_928 ; (65_536 - 12_928) / 65_536 = 0.80273.. -> 0.803
    assert default_memory_args(64, is_cuda=False) == ServerMemoryDefaults(8192, 0, 12_928, 0.803)


def test_defaults_overrides():
    # chunked 2048 overrides 8192: reserved = 512 + 3_072 + 512 + 128 = 4_224
    # (81_920 - 4_224) / 81_920 = 0.948437.. -> 0.948
    assert default_memory_args(80, chunked_prefill_size=2048) == ServerMemoryDefaults(2048, 256, 4_224, 0.948)
    # graphs 0: reserved = 512 + 12_288 + 0 + 128 = 12_928 ; 68_992 / 81_920 = 0.8421.. -> 0.842
    assert default_memory_args(80, cuda_graph_max_bs=0).mem_fraction_static == 0.842
    # an explicit fraction is kept as given
    d = default_memory_args(80, mem_fraction_static=0.7)
    assert (d.reserved_mem_mb, d.mem_fraction_static) == (13_440, 0.7)
    # explicit reserved: (81_920 - 8_192) / 81_920 = 0.9
    assert default_memory_args(80, reserved_mem_mb=8192).mem_fraction_static == 0.9
    with pytest.raises(TypeError):
        default_memory_args(80, page_size=16)


def test_defaults_tiny_device_rejected():
    # 2 GB = 2_048 MB < 512 + 3_072 + 16 + 128 reserved
    with pytest.raises(ValueError, match="reserved"):
        default_memory_args(2)


def engine_memory_defaults(gib, mem_fraction_static=None, device_type="cuda", **config):
    """The engine's (cuda_graph_max_bs, mem_fraction_static) for a device of ``gib`` GiB and ``config``."""
    cfg = EngineConfig(model_path="m", mem_fraction_static=mem_fraction_static, **config)
    max_bs = cuda_graph_max_bs(cfg, gib * GiB)
    return max_bs, default_mem_fraction_static(cfg, device_type, gib * GiB, max_bs)


@pytest.mark.parametrize("gib, tp, chunked, defaults", [
    # SGLang's server defaults (its chunk): see test_defaults_h100_tp1 and test_defaults_24gb_card;
    # TP 2 adds 128 MB: 80 GiB (81_920 - 13_568) / 81_920 = 0.834375 ; 24 GiB 20_688 / 24_576 = 0.8417.. -> 0.842
    (80, 1, 8192, (256, 0.836)), (80, 2, 8192, (256, 0.834)), (24, 1, 2048, (24, 0.847)), (24, 2, 2048, (24, 0.842)),
    # the engine's own chunk when unset, 2048: test_defaults_overrides' 0.948; TP 2: 77_568 / 81_920 = 0.9468.. -> 0.947
    (80, 1, None, (256, 0.948)), (80, 2, None, (256, 0.947)),
    # chunking off: max_prefill_tokens 16384: 512 + 24_576 + 512 + 128 = 25_728 ; 56_192 / 81_920 = 0.6859.. -> 0.686
    (80, 1, -1, (256, 0.686)),
])
def test_the_engines_default_mem_fraction_static_is_sglangs_on_cuda(gib, tp, chunked, defaults):
    """mem_fraction_static unset on CUDA: SGLang's from the device's memory, the engine's tp_size and its
    chunk, and the largest graph the engine captures (it used to be 0.5 whatever the GPU)."""
    assert engine_memory_defaults(gib, tp_size=tp, chunked_prefill_size=chunked) == defaults


def test_the_engines_memory_defaults_honour_overrides():
    """A set mem_fraction_static is kept (on CUDA and the CPU); cuda_graph_max_bs and cuda_graph_bs set the
    graphs' reserve; graphs off reserve none; the CPU's default is 0.5 (its memory is the host's)."""
    assert engine_memory_defaults(80, 0.7, chunked_prefill_size=8192) == (256, 0.7)
    assert engine_memory_defaults(80, 0.7, "cpu") == (256, 0.7)
    assert engine_memory_defaults(80, device_type="cpu") == (256, 0.5)
    # 8 graphs: 512 + 12_288 + 16 + 128 = 12_944 ; 68_976 / 81_920 = 0.84199.. -> 0.842
    assert engine_memory_defaults(80, chunked_prefill_size=8192, cuda_graph_max_bs=8) == (8, 0.842)
    # the largest of cuda_graph_bs, 24 GiB: 512 + 3_072 + 96 + 128 = 3_808 ; 20_768 / 24_576 = 0.8450.. -> 0.845
    assert engine_memory_defaults(24, cuda_graph_bs=[4, 48, 16]) == (48, 0.845)
    # graphs off (the runner passes 0): test_defaults_overrides' 0.842 at SGLang's chunk
    config = EngineConfig(model_path="m", chunked_prefill_size=8192)
    assert default_mem_fraction_static(config, "cuda", 80 * GiB, 0) == 0.842


def test_the_runner_sizes_its_pools_by_the_default_fraction(tmp_path, monkeypatch):
    """A runner with mem_fraction_static unset sizes its KV pool by the default the device gives (on CUDA:
    here a 24 GiB one, graphs off as on the CPU: 512 + 3_072 + 128 = 3_712 MB kept,
    20_864 / 24_576 = 0.84895.. -> 0.849), and /get_server_info shows it. It used to take 0.5, which keeps
    more than this device has free (no memory left for the KV cache)."""
    from actors.engine.model_runner import ModelRunner
    from actors.engine.tiny import build_tiny_checkpoint
    import actors.engine.model_runner as model_runner

    total = 24 * GiB
    available = round(total * (1 - 0.849)) + 16 * 2**20  # 16 MiB for the pools at 0.849
    monkeypatch.setattr(model_runner, "get_device_memory", lambda device: (available, total))
    monkeypatch.setattr(model_runner, "default_mem_fraction_static",  # (a CUDA device's)
                        lambda config, device_type, *args: default_mem_fraction_static(config, "cuda", *args))
    path = build_tiny_checkpoint("llama", tmp_path / "llama")
    runner = ModelRunner(EngineConfig(model_path=str(path), max_running_requests=64))
    assert runner.cuda_graph_max_bs == 0 and runner.mem_fraction_static == 0.849
    cell = runner.token_to_kv_pool.mem_usage_bytes() // (runner.max_total_num_tokens + 1)  # (+ the dummy slot)
    assert 16 * 2**20 * 0.9 < runner.max_total_num_tokens * cell <= 16 * 2**20
    scheduler = Scheduler(runner)
    assert engine_server_info(scheduler)["mem_fraction_static"] == 0.849
    check_engine_integrity(scheduler, runner)


# ---- device memory ---------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_get_device_memory_counts_the_caching_allocators_free_blocks_as_available():
    """A freed 512 MiB block stays reserved by torch's caching allocator; the budget counts it free."""
    before, _ = get_device_memory("cuda")
    block = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
    del block
    assert torch.cuda.memory_reserved() >= 512 << 20  # the block is still held by the cache
    after, _ = get_device_memory("cuda")
    assert after >= before - (64 << 20)


def test_get_device_memory_cpu():
    available, total = get_device_memory("cpu")
    assert 0 < available <= total
    assert get_device_memory(torch.device("cpu"))[1] == total
    with pytest.raises(ValueError, match="meta"):
        get_device_memory("meta")


@pytest.mark.parametrize("family,strategy,spec", [("llama", "no_buffer", {}), ("qwen3_next", "no_buffer", {}),
                                                  ("qwen3_next", "extra_buffer", {}),
                                                  ("qwen3_next", "no_buffer", {"speculative_algorithm": "ngram"})])
def test_pools_sized_from_device_memory_fit_the_budget(tmp_path, monkeypatch, family, strategy, spec):
    """With no ``max_total_tokens`` the runner sizes its pools from device memory: every pool
    it allocates (a hybrid model's Mamba slots included, and under speculation its verify
    scratch: a state per request row and verify token) fits ``mem_fraction_static``'s share.
    The Mamba pool used to come on top of a KV pool that had taken the whole budget (a real
    Qwen3-Next would ask tens of GiB beyond it)."""
    from actors.engine.config import EngineConfig
    from actors.engine.model_runner import ModelRunner
    from actors.engine.tiny import build_tiny_checkpoint
    import actors.engine.model_runner as model_runner

    available, total, fraction = 48 * 2**20, 64 * 2**20, 0.5  # 16 MiB for the pools
    monkeypatch.setattr(model_runner, "get_device_memory", lambda device: (available, total))
    path = build_tiny_checkpoint(family, tmp_path / family)
    extra = {"mamba_scheduler_strategy": strategy} if family == "qwen3_next" else {}
    runner = ModelRunner(EngineConfig(model_path=str(path), mem_fraction_static=fraction, max_running_requests=64,
                                      **extra, **spec))
    pool, page = runner.token_to_kv_pool, runner.config.page_size
    cell = pool.mem_usage_bytes() // (runner.max_total_num_tokens + page)  # (+ the padding page of dummy slots)
    used = runner.max_total_num_tokens * cell
    if family == "qwen3_next":
        mamba = runner.mamba_pool
        assert mamba.size == runner._num_mamba_slots(64)
        assert [s.shape[1:3] for s in mamba.verify_states] == [(64, 5)] * 2 * bool(spec)
        used += mamba.mem_usage_bytes() - sum(s[:, 0].nbytes for s in mamba.states())  # (less its dummy slot)
    budget = available - round(total * (1 - fraction))
    assert budget * 0.9 < used <= budget


@pytest.mark.parametrize("strategy", ["no_buffer", "extra_buffer"])
def test_a_hybrid_under_speculation_without_max_running_requests_fits_its_rows(tmp_path, monkeypatch, strategy):
    """With max_running_requests not set, a hybrid model under speculative decoding starts with the
    most request rows whose Mamba slots and verify scratch fit the budget's Mamba share, the KV pool
    keeping the rest. It used to budget 256 rows x 5 verify states (a real Qwen3-Next-80B: 92 GiB)
    and refuse to start. A max_running_requests set too high is still refused, naming the scratch
    and the rows that fit. /get_server_info's sizes (``engine_server_info``) are the rows chosen."""
    from actors.engine.config import EngineConfig
    from actors.engine.model_runner import ModelRunner
    from actors.engine.tiny import build_tiny_checkpoint
    import actors.engine.model_runner as model_runner

    available, total, fraction = 48 * 2**20, 64 * 2**20, 0.5  # 16 MiB for the pools
    monkeypatch.setattr(model_runner, "get_device_memory", lambda device: (available, total))
    path = build_tiny_checkpoint("qwen3_next", tmp_path / "qwen3_next")
    config = dict(model_path=str(path), mem_fraction_static=fraction, speculative_algorithm="ngram",
                  mamba_scheduler_strategy=strategy)
    runner = ModelRunner(EngineConfig(**config))
    rows, mamba, budget = runner.max_running_requests, runner.mamba_pool, available - round(total * (1 - fraction))
    assert 16 < rows < 256 and mamba.size == runner._num_mamba_slots(rows)
    assert [s.shape[1:3] for s in mamba.verify_states] == [(rows, 5)] * 2
    share, slot = budget * 0.9 / 1.9, runner._mamba_slot_bytes()
    per_row = 5 + (4 if strategy == "extra_buffer" else 2)  # verify states, slots (a spare for the tree's)
    assert rows * per_row * slot <= share < (rows + 1) * per_row * slot  # the most that fit
    kv = runner.max_total_num_tokens * 256  # 1 full-attention layer x 2 KV heads x (16 + 16) x fp32
    used = kv + mamba.mem_usage_bytes() - sum(s[:, 0].nbytes for s in mamba.states())  # (less its dummy slot)
    assert budget - share - 256 < kv and used <= budget  # the KV pool keeps the rest of the budget
    with pytest.raises(ValueError, match=f"max_running_requests=256 asks .* states of the verify scratch; "
                                         f"at most {rows} fit"):
        ModelRunner(EngineConfig(**config, max_running_requests=256))
    info = engine_server_info(Scheduler(runner))  # (/get_server_info's: the rows chosen, not the null configured)
    assert (info["max_running_requests"], info["max_total_num_tokens"], info["max_mamba_cache_size"]) == (
        rows, runner.max_total_num_tokens, mamba.size)
    assert info["speculative_algorithm"] == "ngram" and info["speculative_num_draft_tokens"] == 4


@pytest.mark.parametrize("family", ["gpt_oss", "mistral"])
def test_a_draft_models_pool_fits_the_budget_beside_the_targets(tmp_path, monkeypatch, family):
    """With a draft model the KV pools sized from device memory — the target's and the draft's, as
    many slots as the full pool — fit ``mem_fraction_static``'s share, for sliding-window targets
    too (GPT-OSS: half its layers slide; Mistral: all): the SWA split grew the full pool, and the
    draft's with it, beyond the budget, when it spread the target's layers only. /get_server_info's
    sizes are both pools' as the split left them."""
    from actors.engine.config import EngineConfig
    from actors.engine.model_runner import ModelRunner
    from actors.engine.tiny import build_tiny_checkpoint
    import actors.engine.model_runner as model_runner

    available, total, fraction = 48 * 2**20, 64 * 2**20, 0.5  # 16 MiB for the pools
    monkeypatch.setattr(model_runner, "get_device_memory", lambda device: (available, total))
    draft = build_tiny_checkpoint("llama", tmp_path / "draft", seed=1, num_hidden_layers=1)
    path = build_tiny_checkpoint(family, tmp_path / family)
    runner = ModelRunner(EngineConfig(model_path=str(path), mem_fraction_static=fraction, max_running_requests=64,
                                      speculative_algorithm="draft_model", speculative_draft_model_path=str(draft)))
    assert runner.draft.token_to_kv_pool.size == runner.max_total_num_tokens
    info = engine_server_info(Scheduler(runner))  # (/get_server_info's: both pools as the SWA split sized them)
    assert (info["max_total_num_tokens"], info["swa_max_total_num_tokens"]) == (
        runner.allocator.size, runner.allocator.size_swa)
    assert info["speculative_draft_model_path"] == str(draft) and "max_mamba_cache_size" not in info
    used = runner.token_to_kv_pool.mem_usage_bytes() + runner.draft.token_to_kv_pool.mem_usage_bytes()
    budget = available - round(total * (1 - fraction))
    assert budget * 0.95 < used <= budget * 1.001  # (+ each pool's page of dummy slots, not budgeted)
