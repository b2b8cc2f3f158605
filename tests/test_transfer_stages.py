"""The transfer layer between pipeline stages: each rank's layout holds its stage's layers,
named by global layer id, so a prefill rank pairs with the decode ranks whose layers (and
heads) overlap its own, whatever the two sides' PP and TP sizes; the ranks' shares together
must write every decode buffer once (``transfer.plan.unwritten``), and a message backend's
landing completes only when every layer's rows arrived."""

import numpy as np
import pytest
import torch

from actors.engine.pipeline import stage_layers
from actors.kv_push import serves
from mem_cache.mamba_pool import HybridLinearKVPool, MambaPool
from mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
from mem_cache.swa_memory_pool import SWAKVPool
from tests.transfer_helpers import HEAD_DIM, HEADS, SIZE, STATE_SLOTS, SWA_SIZE, request
from transfer import KVHandoff, LayoutMismatchError, check_compatible, create_agent, pool_layout
from transfer.backends.landing import Landing, pack_rows
from transfer.plan import copied_heads, expected_heads, plan_copies, unwritten

NUM_LAYERS = 4


SWA_LAYERS = (0, 2)  # ("swa": the others full-attention)
MAMBA_LAYERS = (0, 1, 2)  # ("hybrid", Qwen3-Next's pattern: layer 3 full-attention)


def stage_rank(pp_rank, pp_size, tp_rank=0, tp_size=1, kind="mha", num_layers=NUM_LAYERS, seed=0):
    """``(agent, tensors)`` of TP rank ``tp_rank`` of stage ``pp_rank``: a pool of that
    stage's layers (``stage_layers``' split; "swa" and "hybrid": its cut of the layer-id lists)
    and its heads, every byte seeded-random."""
    layers = stage_layers(num_layers, pp_rank, pp_size)
    heads = HEADS // tp_size
    if kind == "mha":
        pool = MHATokenToKVPool(SIZE, 1, torch.float16, heads, HEAD_DIM, len(layers), start_layer=layers.start)
        layout, tensors = pool_layout(pool, tp_rank * heads, HEADS, num_layers)
    elif kind == "swa":
        swa = [i for i in layers if i in SWA_LAYERS]
        pool = SWAKVPool(SIZE, SWA_SIZE, 1, torch.float16, heads, HEAD_DIM, swa, [i for i in layers if i not in swa])
        layout, tensors = pool_layout(pool, tp_rank * heads, HEADS, num_layers)
    elif kind == "hybrid":
        mamba = [i for i in layers if i in MAMBA_LAYERS]
        states = MambaPool(STATE_SLOTS, [(3, 4)], (2, 3, 4), len(mamba), torch.float16, torch.float32,
                           layer_ids=mamba)
        pool = HybridLinearKVPool(SIZE, 1, torch.float16, heads, HEAD_DIM, [i for i in layers if i not in mamba],
                                  states)
        layout, tensors = pool_layout(pool, tp_rank * heads, HEADS, num_layers)
    else:
        pool = MLATokenToKVPool(SIZE, 1, torch.float16, 12, 4, len(layers), start_layer=layers.start)
        layout, tensors = pool_layout(pool, num_layers=num_layers)
    gen = torch.Generator().manual_seed(seed * 100 + pp_rank * 10 + tp_rank)
    for t in tensors.values():
        t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, generator=gen, dtype=torch.uint8))
    return create_agent("fake", layout, tensors, tp_rank, tp_size), tensors


def side(pp_size, tp_size, kind="mha", seed=0):
    """Every rank of a worker, in global rank order (stage · tp_size + tp_rank)."""
    return [stage_rank(s, pp_size, t, tp_size, kind, seed=seed)[0] for s in range(pp_size) for t in range(tp_size)]


def handoff(agent, slots=(1, 2, 3)) -> KVHandoff:
    return KVHandoff.from_bytes(KVHandoff("r", 1, agent.tp_rank, agent.tp_size, agent.layout, list(slots)).to_bytes())


def test_a_stage_layout_names_its_layers_by_global_id():
    agent = side(2, 1)[1]
    assert sorted(agent.layout.layers()) == [2, 3] and agent.layout.num_layers == NUM_LAYERS
    assert sorted(agent.layout.by_name()) == ["k.2", "k.3", "v.2", "v.3"]
    assert {b.layer for b in agent.layout.buffers if b.name.endswith(".3")} == {3}
    assert sorted(side(2, 1, "mla")[0].layout.by_name()) == ["kv.0", "kv.1"]


@pytest.mark.parametrize("kind", ["mha", "mla"])
@pytest.mark.parametrize("prefill_pp, prefill_tp, decode_pp, decode_tp", [
    (2, 1, 1, 1), (1, 1, 2, 1), (2, 2, 1, 1), (1, 2, 2, 1), (2, 1, 2, 2), (3, 1, 2, 1), (2, 2, 4, 2)])
def test_ranks_pair_by_overlapping_layers_and_write_every_buffer_once(kind, prefill_pp, prefill_tp, decode_pp,
                                                                      decode_tp):
    """Prefill PP × TP → decode PP × TP: a prefill rank serves exactly the decode ranks one of
    whose layers (and, head-sharded, heads) it holds, copies only the layers both hold, and the
    prefill ranks together write every head of every decode buffer once."""
    prefill, decode = side(prefill_pp, prefill_tp, kind), side(decode_pp, decode_tp, kind)
    for d in decode:
        h = handoff(d)
        written = {}
        for p in prefill:
            check_compatible(p.layout, h.layout)  # (layers of another stage are not compared)
            copies = plan_copies(p.layout, h.layout, p.tp_rank, p.tp_size, h.tp_rank, False)
            assert {c.name for c in copies} <= set(p.layout.by_name()) & set(h.layout.by_name())
            assert serves(h, p) == bool(copies)
            for name, heads in copied_heads(copies).items():
                written[name] = written.get(name, 0) + heads
        assert unwritten(expected_heads(h), written) == []
    # one stage's ranks alone leave the other stages' layers unwritten
    d = handoff(decode[0])
    first_stage = [p for p in prefill if p.layout.layers() == prefill[0].layout.layers()]
    alone = {}
    for p in first_stage:
        for name, heads in copied_heads(plan_copies(p.layout, d.layout, p.tp_rank, p.tp_size, d.tp_rank, False)).items():
            alone[name] = alone.get(name, 0) + heads
    missing = unwritten(expected_heads(d), alone)
    assert {d.layout.by_name()[n].layer for n in missing} == d.layout.layers() - prefill[0].layout.layers()


@pytest.mark.parametrize("kind", ["swa", "hybrid"])
@pytest.mark.parametrize("prefill_pp, decode_pp", [(2, 1), (1, 2), (3, 2)])
def test_sliding_window_kv_and_mamba_states_pair_by_global_layer(kind, prefill_pp, decode_pp):
    """Sliding-window KV (``swa_k.{layer}``) and Mamba states (``state.{s}.{layer}``) are named by global
    layer as full-attention KV is, so stages of either side pair by the layers both hold and together write
    every decode buffer once, the window's rows and the state slot included."""
    prefill, decode = side(prefill_pp, 1, kind), side(decode_pp, 1, kind)
    for d in decode:
        h = KVHandoff("r", 1, 0, 1, d.layout, [1, 2, 3], dst_state_slot=2 if kind == "hybrid" else None,
                      dst_swa_slots=[4, 5] if kind == "swa" else [])
        written = {}
        for p in prefill:
            check_compatible(p.layout, h.layout)
            copies = plan_copies(p.layout, h.layout, 0, 1, 0, True)
            assert {p.layout.by_name()[c.name].layer for c in copies} == p.layout.layers() & h.layout.layers()
            for name, heads in copied_heads(copies).items():
                written[name] = written.get(name, 0) + heads
        assert unwritten(expected_heads(h), written) == []
    (last,) = [p for p in side(2, 1, kind)[1:]]  # layers 2 and 3
    assert sorted(last.layout.by_name()) == (["k.3", "swa_k.2", "swa_v.2", "v.3"] if kind == "swa" else
                                             ["k.3", "state.0.2", "state.1.2", "v.3"])


def test_prefill_pp2_to_decode_pp1_pairs_each_stage_with_its_own_layers():
    (p0, p1), (d,) = side(2, 1), side(1, 1)
    h = handoff(d)
    assert [c.name for c in plan_copies(p0.layout, h.layout, 0, 1, 0, False)] == ["k.0", "v.0", "k.1", "v.1"]
    assert [c.name for c in plan_copies(p1.layout, h.layout, 0, 1, 0, False)] == ["k.2", "v.2", "k.3", "v.3"]
    # decode PP2: prefill stage 1 serves decode stage 1 only
    d0, d1 = side(2, 1)
    assert not serves(handoff(d0), p1) and serves(handoff(d1), p1)


def test_heads_written_twice_or_a_state_never_sent_are_unwritten():
    (p,), (d,) = side(1, 1), side(1, 1)
    h = handoff(d)
    heads = copied_heads(plan_copies(p.layout, h.layout, 0, 1, 0, False))
    assert unwritten(expected_heads(h), heads) == []
    assert unwritten(expected_heads(h), {**heads, "k.0": 2 * HEADS}) == ["k.0"]
    assert unwritten(expected_heads(handoff(d, slots=())), {}) == []  # a decode rank holding the whole prompt takes no rows


def test_models_of_different_depths_are_rejected_with_a_clear_error():
    mine = stage_rank(0, 1)[0].layout
    deeper = stage_rank(0, 2, num_layers=8)[0].layout  # its stage 0: layers 0..3, as mine
    with pytest.raises(LayoutMismatchError, match="num_layers differs: prefill 4, decode 8"):
        check_compatible(mine, deeper)


def test_a_landing_completes_only_once_every_stage_sent_its_layers():
    """torch_dist's decode side counts the cells of every buffer (layers × heads × rows): the first
    stage's message leaves the second stage's layers missing; with both, the scatter writes every
    layer's rows from the stage that holds it."""
    rng = np.random.default_rng(0)
    src_slots, dst_slots = request(rng, 1, 12)
    prefill = [stage_rank(s, 2, seed=1) for s in range(2)]
    (decode, dst), = [stage_rank(0, 1, seed=2)]
    h = handoff(decode, dst_slots.tolist())
    landing = Landing(decode.layout, h)
    for i, (agent, tensors) in enumerate(prefill):
        copies = plan_copies(agent.layout, h.layout, 0, 1, 0, False)
        header, payload = pack_rows(agent.layout, tensors, copies, src_slots.tolist(), None)
        landing.add(header, payload)
        assert landing.complete() == (i == 1), landing.missing()
        if i == 0:
            assert landing.missing() == "4 buffers (k.2, v.2, k.3, v.3)"
    landing.scatter(dst)
    for agent, tensors in prefill:
        for name, t in tensors.items():
            assert torch.equal(dst[name][dst_slots].view(torch.uint8), t[src_slots].view(torch.uint8)), name
