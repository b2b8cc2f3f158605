"""The fused MoE (:mod:`actors.engine.fused_moe`) against the eager experts (``moe.run_experts``) on one
layer's experts: random routing with experts no token chose, top-k 1 and 2, token counts off the block
size, a TP rank's slice of every expert, an EP rank's half of the experts (the others' tokens adding 0),
block-FP8 weights dequantized in the kernel (blocks cut by the intermediate dim), a weight update
copied into the experts after they are stacked, and GPT-OSS's experts (3-D weights read transposed,
biases, clamped SwiGLU), and packed experts (GPTQ, AWQ, compressed-tensors' pack-quantized: random words,
zeros and scales) and compressed-tensors' unpacked FP8 / int8 ones (per-tensor, per-channel, group scales)
dequantized tile by tile in the kernel, against the eager experts' dequantize-then-matmul.
On the CPU the kernels run interpreted (conftest)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch

from actors.engine import compressed_tensors, fp8, wna16
from actors.engine.config import EngineConfig
from actors.engine.fused_moe import fuse_experts, moe_align_block_size
from actors.engine.models.gpt_oss import GptOssExperts
from actors.engine.model_runner import ModelRunner
from actors.engine.models.moe import ExpertList, MixtralExpert, qwen_expert, run_experts
from actors.engine.parallel import SINGLE, LinearBase, RowParallelLinear, TPGroup
from actors.engine.tiny import tiny_config
from tests.tp_helpers import Hub, ThreadGroup

HIDDEN, INTERMEDIATE, EXPERTS = 64, 32, 4


def make_experts(held=range(EXPERTS), tp=SINGLE, expert=qwen_expert, intermediate=INTERMEDIATE, seed=0):
    """``held`` experts (this rank's ``tp`` slice of each), weights ~ N(0, 1/fan_in)."""
    experts = ExpertList(held, lambda: expert(HIDDEN, intermediate, "silu", tp, "moe_intermediate_size"))
    return randomized(experts, seed)


def randomized(experts, seed=0):
    """``experts`` with matrices ~ N(0, 1/fan_in), biases ~ N(0, 0.1²)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in experts.named_parameters():
            fan_in = p.shape[-2] if p.dim() == 3 else p.shape[-1]  # (GPT-OSS's x @ W [experts, in, out])
            p.copy_(torch.randn(p.shape, generator=generator) * (0.1 if name.endswith("bias") else fan_in ** -0.5))
            p.requires_grad_(False)
    return experts


def packed_experts(fmt, bits, group_size, variant="", tp=SINGLE, seed=0):
    """:func:`make_experts` with every projection packed by ``fmt`` (``gptq``, ``awq``, ``compressed``:
    pack-quantized, ``group_size`` -1 its channel strategy; ``variant`` ``sym``: compressed-tensors' without
    zeros, ``act-order``: GPTQ's ``g_idx``): random words, zeros and groups, scales that keep each weight
    ~ 1/sqrt(fan_in)."""
    experts, generator = make_experts(tp=tp), torch.Generator().manual_seed(seed)
    for name, linear, full in linears(experts, tp):
        if fmt == "compressed":
            scheme = compressed_tensors.Scheme(bits, "int", "channel" if group_size == -1 else "group",
                                               max(group_size, 0), variant == "sym", packed=True)
            compressed_tensors.quantize_linear(linear, name, scheme, full, [1])
        else:
            quant = wna16.PackedConfig(fmt, bits, group_size, desc_act=variant == "act-order")
            wna16.quantize_linear(linear, name, quant, full)
        with torch.no_grad():
            for param_name, p in linear.named_parameters():
                if param_name == "g_idx":  # (a group of scales for each input)
                    p.copy_(torch.randint(0, linear.scales.shape[0], p.shape, generator=generator))
                elif p.dtype == torch.int32:
                    p.copy_(torch.randint(-2**31, 2**31 - 1, p.shape, generator=generator, dtype=torch.int32))
                else:
                    p.copy_((torch.rand(p.shape, generator=generator) + 0.5) / (1 << bits) / full[1] ** 0.5)
    return experts


def unpacked_experts(kind, strategy, group_size=0, scale_shape=(1,), tp=SINGLE, seed=0):
    """:func:`make_experts` with every projection as compressed-tensors stores ``kind`` values unpacked
    (``float``: FP8, ``int``: int8), scaled by ``strategy`` (a per-tensor scale of ``scale_shape``: AutoFP8's
    is a scalar): random values and scales that keep each weight ~ 1/sqrt(fan_in)."""
    experts, generator = make_experts(tp=tp), torch.Generator().manual_seed(seed)
    scheme = compressed_tensors.Scheme(8, kind, strategy, group_size, True, packed=False)
    magnitude = 1 if kind == "float" else 32  # (of a stored value)
    for name, linear, full in linears(experts, tp):
        compressed_tensors.quantize_linear(linear, name, scheme, full, scale_shape)
        values = torch.randn(linear.weight.shape, generator=generator) * magnitude
        scales = (torch.rand(linear.weight_scale.shape, generator=generator) + 0.5) / magnitude / full[1] ** 0.5
        with torch.no_grad():
            linear.weight.copy_(values.round().clamp(-127, 127) if kind == "int" else values)
            linear.weight_scale.copy_(scales)
    return experts


def linears(experts, tp):
    """(name, layer, its whole weight's (out, in) over ``tp``) of every projection of ``experts``."""
    for name, linear in list(experts.named_modules()):
        if isinstance(linear, LinearBase):
            row = isinstance(linear, RowParallelLinear)
            yield name, linear, (linear.out_features * (1 if row else tp.size),
                                 linear.in_features * (tp.size if row else 1))


def routing(num_tokens, top_k, seed=0, unused=(2,)):
    """Tokens, each token's ``top_k`` distinct experts (never those in ``unused``) and their weights."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, HIDDEN, generator=generator)
    logits = torch.randn(num_tokens, EXPERTS, generator=generator)
    logits[:, list(unused)] = float("-inf")
    weights, idx = torch.softmax(logits, -1).topk(top_k, dim=-1)
    return x, idx, weights


def eager_then_fused(experts, x, idx, weights):
    eager = run_experts(experts, x, idx, weights)
    fuse_experts(torch.nn.Sequential(experts))
    assert experts.fused is not None
    return eager, run_experts(experts, x, idx, weights)


def test_align_sorts_pairs_by_expert_in_padded_blocks():
    """Expert 0 has 5 pairs (two blocks of 4), expert 1 none (no block), expert 2 one, expert 3 (not held
    here: id 3 of 3 experts) is left out; padding rows name the pair count."""
    expert_of = torch.tensor([2, 0, 0, 3, 0, 0, 0])
    sorted_ids, block_expert, num_padded = moe_align_block_size(expert_of, 3, 4)
    assert num_padded.tolist() == [12]
    assert sorted_ids.tolist()[:12] == [1, 2, 4, 5, 6, 7, 7, 7, 0, 7, 7, 7]
    assert len(sorted_ids) == 7 + 3 * 3 and set(sorted_ids.tolist()[12:]) == {7}
    assert block_expert.tolist()[:3] == [0, 0, 2]


@pytest.mark.parametrize("num_tokens, top_k", [(0, 2), (1, 1), (13, 1), (37, 2)])
def test_fused_equals_eager(num_tokens, top_k):
    """Expert 2 chosen by no token; 37 · 2 pairs fill no whole number of 16-row blocks; no tokens at all
    (the eager experts' empty [0, hidden]: the fused ones could not view their empty pairs as one)."""
    experts = make_experts()
    eager, fused = eager_then_fused(experts, *routing(num_tokens, top_k))
    torch.testing.assert_close(fused, eager, rtol=1e-5, atol=1e-5)


def test_fused_equals_eager_in_bf16():
    """bf16 tiles upcast in the kernel (the interpreter's bf16 arithmetic is wrong): within bf16's
    rounding of the eager experts' (which round each projection's output too)."""
    experts = make_experts().to(torch.bfloat16)
    x, idx, weights = routing(37, 2)
    eager, fused = eager_then_fused(experts, x.bfloat16(), idx, weights.bfloat16())
    assert (fused - eager).abs().max() <= 0.02 * eager.abs().max()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 37, 300])
def test_fused_equals_eager_compiled_on_cuda(dtype, num_tokens):
    """The compiled kernels (bf16 tiles on the tensor cores, fp32 in IEEE) against the eager experts on
    the same device: the CPU runs only the interpreter."""
    experts = make_experts().to("cuda", dtype)
    x, idx, weights = routing(num_tokens, 2)
    eager, fused = eager_then_fused(experts, x.to("cuda", dtype), idx.cuda(), weights.to("cuda", dtype))
    assert (fused - eager).abs().max() <= (1e-4 if dtype == torch.float32 else 0.02) * eager.abs().max()


@pytest.mark.parametrize("case", ["tp", "ep", "mixtral"])
def test_fused_equals_eager_on_a_rank(case):
    """TP rank 1 of 2 holds its half of every expert's intermediate dim (a partial sum); EP rank 1 of 2
    experts 2 and 3 whole: the pairs routed to 0 and 1 add nothing on it. Mixtral's names (w1, w3, w2)."""
    experts = {"tp": lambda: make_experts(tp=TPGroup(rank=1, size=2)),
               "ep": lambda: make_experts(held=range(2, 4)),
               "mixtral": lambda: make_experts(expert=MixtralExpert)}[case]()
    x, idx, weights = routing(21, 2, unused=())
    eager, fused = eager_then_fused(experts, x, idx, weights)
    torch.testing.assert_close(fused, eager, rtol=1e-5, atol=1e-5)
    if case == "ep":  # only the tokens that chose expert 2 or 3 have an output here
        assert torch.equal(fused.abs().sum(1) > 0, (idx >= 2).any(1))


def test_fp8_weights_dequantized_in_the_kernel():
    """Blocks of 16 x 16 over an intermediate dim of 24: gate's and up's last scale rows each cover a
    partial block, stacked one after the other."""
    experts = make_experts(intermediate=24)
    for name, linear in experts.named_modules():
        if hasattr(linear, "weight_block_size"):
            weight = linear.weight.detach().clone()
            fp8.quantize_linear(linear, name, (16, 16), weight.shape)
            fp8.copy_weight(linear, weight)
    eager, fused = eager_then_fused(experts, *routing(19, 2))
    assert experts.fused.w13.weight.dtype == fp8.FP8 and experts.fused.w13.scale.shape == (EXPERTS, 4, 4)
    torch.testing.assert_close(fused, eager, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("quant", [None, "gptq", "fp8-per-tensor"])
def test_weight_update_after_fusing_reaches_the_kernel(quant):
    """The experts' parameters are views of the stacked weights: copying new weights into them (what a
    weight update does) changes what the fused kernels compute, the memory held once. GPTQ's words,
    zeros and scales are stacked along their last dim: each layer's a strided view; AutoFP8's scalar
    scales each an entry of the stacked scales."""
    make = {None: lambda seed: make_experts(seed=seed), "gptq": lambda seed: packed_experts("gptq", 4, 16, seed=seed),
            "fp8-per-tensor": lambda seed: unpacked_experts("float", "tensor", scale_shape=(), seed=seed)}[quant]
    experts, new = make(0), make(1)
    x, idx, weights = routing(9, 2)
    fuse_experts(torch.nn.Sequential(experts))
    with torch.no_grad():
        for p, q in zip(experts.parameters(), new.parameters()):
            p.copy_(q)
    torch.testing.assert_close(run_experts(experts, x, idx, weights), run_experts(new, x, idx, weights),
                               rtol=1e-5, atol=1e-5)
    stored = next(experts[0].up_proj.parameters())  # (its weight, or its packed words)
    assert stored.untyped_storage().data_ptr() == experts.fused.w13.weight.data_ptr()


@pytest.mark.parametrize("rank, ep", [(0, False), (1, False), (1, True)])
def test_gpt_oss_fused_equals_eager(rank, ep):
    """GPT-OSS's experts on TP rank 0 (which adds the down bias), rank 1 (which does not) and EP rank 1
    (experts 2 and 3, whose holder adds theirs): the fused kernels read the stored tensors, no copy."""
    experts = randomized(GptOssExperts(tiny_config("gpt_oss"), TPGroup(rank=rank, size=2, expert_parallel=ep)))
    experts.tp = SINGLE  # (this rank's partial sums compared as they are, not reduced)
    x, idx, weights = routing(17, 2, unused=())
    eager = experts(x, idx, weights)
    fuse_experts(experts)
    torch.testing.assert_close(experts(x, idx, weights), eager, rtol=1e-5, atol=1e-5)
    assert experts.fused.w13.weight.data_ptr() == experts.gate_up_proj.data_ptr()


# format, bits, group size (-1: one group; compressed-tensors' channel strategy), variant (sym: compressed-tensors'
# without zeros; act-order: GPTQ's g_idx), TP rank 1 of 2 (a slice of each expert: down's input groups and words
# cut; with act-order every group kept, g_idx cut)
PACKED_CASES = [("gptq", 4, 16, "", False), ("gptq", 8, 32, "", False), ("gptq", 4, -1, "", False),
                ("awq", 4, 32, "", False), ("compressed", 4, 16, "sym", False), ("compressed", 8, 32, "", False),
                ("compressed", 4, -1, "", False), ("gptq", 4, 16, "act-order", False), ("gptq", 8, 16, "", True),
                ("compressed", 4, 16, "", True), ("gptq", 8, 16, "act-order", True)]


@pytest.mark.parametrize("fmt, bits, group_size, variant, tp", PACKED_CASES)
def test_packed_experts_dequantized_in_the_kernel(fmt, bits, group_size, variant, tp):
    """Each tile of words unpacked (down K, or along N in AWQ's order), its zeros (GPTQ's stored minus one;
    compressed-tensors' symmetric values offset instead) and scales read by group (act-order: gate's, up's
    or down's own g_idx): the eager experts' whole dequantization then matmul, gate's and up's tensors
    stacked along their output features."""
    experts = packed_experts(fmt, bits, group_size, variant, TPGroup(rank=1, size=2) if tp else SINGLE)
    eager, fused = eager_then_fused(experts, *routing(13, 2))
    assert experts.fused.w13.packed is not None and experts.fused.w13.shape == (2 * experts[0].up_proj.out_features,
                                                                                  HIDDEN)
    torch.testing.assert_close(fused, eager, rtol=1e-5, atol=1e-5)


# kind (float: FP8, int: int8), strategy, group size, a per-tensor scale's shape (AutoFP8's scalar), TP rank 1 of 2
# (down's input groups cut; its per-channel and per-tensor scales whole)
UNPACKED_CASES = [("float", "tensor", 0, (), False), ("float", "channel", 0, (1,), False),
                  ("int", "channel", 0, (1,), False), ("int", "group", 16, (1,), True),
                  ("float", "tensor", 0, (1,), True)]


@pytest.mark.parametrize("kind, strategy, group_size, scale_shape, tp", UNPACKED_CASES)
def test_unpacked_experts_dequantized_in_the_kernel(kind, strategy, group_size, scale_shape, tp):
    """compressed-tensors' FP8 / int8 values (``-FP8-dynamic``, ``-quantized.w8a8``, per-tensor FP8) read as
    stored, each tile times its scales (gate's and up's per-tensor ones each a block of its rows): the eager
    experts' dequantize-then-matmul."""
    experts = unpacked_experts(kind, strategy, group_size, scale_shape, TPGroup(rank=1, size=2) if tp else SINGLE)
    eager, fused = eager_then_fused(experts, *routing(13, 2))
    w13, up = experts.fused.w13, experts[0].up_proj
    assert w13.weight.dtype == up.weight.dtype and w13.packed is None
    groups = HIDDEN // group_size if strategy == "group" else 1
    assert w13.scale.shape == (EXPERTS, 2 if strategy == "tensor" else 2 * up.out_features, groups)
    torch.testing.assert_close(fused, eager, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("make, case", [*((packed_experts, case[:4]) for case in PACKED_CASES[:8]),
                                        *((unpacked_experts, case[:4]) for case in UNPACKED_CASES[:4])])
@pytest.mark.parametrize("num_tokens", [1, 300])
def test_quantized_experts_compiled_on_cuda(make, case, num_tokens):
    """The compiled kernels' bf16 tiles of packed experts and of FP8 / int8 ones (the scales kept fp32, as a loaded
    model keeps them) against the eager experts on the same device (GPTQ / AWQ: the packed linear kernel;
    compressed-tensors: dequantize, matmul)."""
    experts = make(*case).to("cuda")
    x, idx, weights = routing(num_tokens, 2)
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    eager, fused = eager_then_fused(experts, x.to(**bf16), idx.cuda(), weights.to(**bf16))
    assert (fused - eager).abs().max() <= 0.02 * eager.abs().max()


def test_packed_experts_the_kernel_does_not_take_stay_eager():
    """compressed-tensors' unpacked values with zero points and packed ones with per-tensor scales, gate and up
    packed in different bits, and some experts quantized and some not, are refused by name on
    moe_backend='triton' (auto runs them eagerly)."""
    schemes = {"unpacked values with zero points": compressed_tensors.Scheme(8, "int", "channel", 0, False, False),
               "per-tensor scales": compressed_tensors.Scheme(4, "int", "tensor", 0, True, packed=True),
               "some are quantized and some not": None}
    for why in [*schemes, "quantized in different ways"]:
        experts = packed_experts("gptq", 4, 16)
        up = experts[1].up_proj
        if why in schemes:
            up.packed, up.scheme = None, schemes[why]
        else:
            up.packed = up.packed._replace(bits=8)
        assert why in experts.unfused_reason()
        with pytest.raises(ValueError, match=f"moe_backend='triton': .*{why}"):
            experts.fuse()
        assert experts.fused is None


def test_auto_backend_is_every_ranks_choice_under_ep():
    """Under EP each rank holds its own experts: rank 0's packed in different ways (eager), rank 1's alike. On CUDA
    auto runs them all eagerly, so that every rank agrees on CUDA graphs (a rank capturing alone would wait in
    collectives its peers never join); each rank deciding from its own experts fused rank 1's alone."""
    experts = [packed_experts("gptq", 4, 16, seed=rank) for rank in range(2)]
    experts[0][1].up_proj.packed = experts[0][1].up_proj.packed._replace(bits=8)
    hub = Hub(2)
    runners = [SimpleNamespace(config=EngineConfig(model_path="m"), model=torch.nn.Sequential(experts[rank]),
                               device=torch.device("cuda"), tp=ThreadGroup(rank, 2, hub=hub)) for rank in range(2)]
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(ModelRunner._fuse_experts, runners))
    assert [e.fused is None for e in experts] == [True, True]


@pytest.mark.parametrize("kind, capability, fused", [("float", (8, 0), False), ("float", (9, 0), True),
                                                     ("int", (8, 0), True)])
def test_fp8_experts_stay_eager_before_compute_capability_8_9(monkeypatch, kind, capability, fused):
    """Triton has no e4m3 type on CUDA before compute capability 8.9 (an A100's 8.0: the kernel would fail to
    compile at the first forward): auto runs FP8 experts eagerly there and triton refuses them by name; int8 ones
    there, and FP8 ones on a Hopper GPU, are fused."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    runners = [SimpleNamespace(config=EngineConfig(model_path="m", moe_backend=backend), device=torch.device("cuda"),
                               model=torch.nn.Sequential(unpacked_experts(kind, "channel")), tp=SINGLE)
               for backend in ("auto", "triton")]
    ModelRunner._fuse_experts(runners[0])
    assert (runners[0].model[0].fused is not None) == fused
    if fused:
        ModelRunner._fuse_experts(runners[1])
    else:
        with pytest.raises(ValueError, match="moe_backend='triton': FP8 experts are not fused on a GPU of compute "
                                             r"capability 8\.0"):
            ModelRunner._fuse_experts(runners[1])
    assert (runners[1].model[0].fused is not None) == fused


def test_moe_backend_is_validated_by_name():
    with pytest.raises(ValueError, match="moe_backend"):
        EngineConfig(model_path="m", moe_backend="cutlass")
