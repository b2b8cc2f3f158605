"""Mamba state slots, hybrid request rows (1 or 3 slots each), hybrid KV layer mapping."""

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from mem_cache.integrity import IntegrityError
from mem_cache.mamba_pool import HybridLinearKVPool, HybridReqToTokenPool, MambaPool


def t(*xs):
    return torch.tensor(xs, dtype=torch.int64)


def mamba(size=4, layers=2):
    return MambaPool(size, [(2, 3)], (2, 2), layers, torch.float32, torch.float32)


def fill(pool, slot, value):
    for state in pool.states():
        state[:, slot] = value


def hybrid(rows=4, slots=6, extra=False):
    return HybridReqToTokenPool(rows, 16, "cpu", mamba(slots), mamba_layer_ids=[1, 3], enable_mamba_extra_buffer=extra)


# ---- MambaPool -------------------------------------------------------------
def test_mamba_pool_shapes_and_front_first_alloc_free():
    pool = mamba()
    assert tuple(pool.conv[0].shape) == (2, 5, 2, 3) and tuple(pool.temporal.shape) == (2, 5, 2, 2)
    assert pool.alloc(3).tolist() == [0, 1, 2]
    assert pool.alloc(2) is None and pool.available_size() == 1  # short: nothing taken
    pool.free(t(1))
    assert pool.free_slots.tolist() == [3, 1]
    assert pool.alloc(2).tolist() == [3, 1]
    assert pool.alloc(0).tolist() == []
    pool.check_integrity(in_use=t(0, 1, 2, 3))
    pool.clear()
    assert pool.available_size() == 4


def test_a_freed_slot_comes_back_zeroed():
    pool = mamba(size=1)
    slot = pool.alloc(1)
    fill(pool, slot, 7.0)
    pool.free(slot)
    again = pool.alloc(1)
    assert again.tolist() == slot.tolist()
    assert all(not state[:, again].any() for state in pool.states())


def verify_pools(n=2, size=4):
    """``n`` pools (a leader and its TP peers) of ``size`` slots with the same random verify scratch."""
    pools = [MambaPool(size, [(2, 3)], (2, 2), 2, torch.float32, torch.float32, verify_shape=(2, 3)) for _ in range(n)]
    for scratch in zip(*(p.verify_states for p in pools)):
        value = torch.randn(scratch[0].shape)
        for s in scratch:
            s.copy_(value)
    return pools


def test_a_verify_state_commit_copies_one_scratch_entry_and_a_tp_peer_replays_it():
    """``commit_verify_states`` copies every layer's state of one (row, position) of the verify
    scratch into a slot, nothing else; a pool of another rank replays it from the log."""
    leader, follower = verify_pools()
    assert [tuple(s.shape) for s in leader.verify_states] == [(2, 2, 3, 2, 3), (2, 2, 3, 2, 2)]
    slot = int(leader.alloc(1))
    follower.alloc(1)
    leader.op_log = []
    leader.commit_verify_states([1], [2], [slot])
    follower.replay(leader.op_log)
    for state, verify_state, peer in zip(leader.states(), leader.verify_states, follower.states()):
        assert torch.equal(state[:, slot], verify_state[:, 1, 2]) and torch.equal(peer, state)
        assert not state[:, slot + 1:].any()
    leader.check_integrity(in_use=t(slot))
    assert leader.mem_usage_bytes() == sum(s.nbytes for s in leader.states() + leader.verify_states)


def test_a_batched_verify_commit_equals_one_commit_each_in_one_copy_per_state_and_one_op(monkeypatch):
    """Several (row, position, slot) commits in one call leave the states one call each would,
    with one indexed copy per state tensor and one logged op, which a TP peer replays."""
    batched, single, follower = verify_pools(3)
    triples = [(1, 2, 3), (0, 0, 1), (1, 0, 0)]
    for pool in (batched, single, follower):
        pool.alloc(4)
    for row, position, slot in triples:
        single.commit_verify_states([row], [position], [slot])
    writes = []
    monkeypatch.setattr(torch.Tensor, "__setitem__", lambda self, i, v, orig=torch.Tensor.__setitem__: (
        writes.append(i), orig(self, i, v))[1])
    batched.op_log = []
    batched.commit_verify_states(*zip(*triples))
    assert len(writes) == len(batched.states()) and len(batched.op_log) == 1
    monkeypatch.undo()
    follower.replay(batched.op_log)
    for mine, theirs, peer in zip(batched.states(), single.states(), follower.states()):
        assert torch.equal(mine, theirs) and torch.equal(peer, mine)
        assert mine[:, [0, 1, 3]].any() and not mine[:, 2].any()  # (slot 2: no commit, still zeroed)
    batched.check_integrity(in_use=t(0, 1, 2, 3))


def test_copy_from_and_fork_from_copy_every_layer():
    pool = mamba(size=3)
    src, other = pool.alloc(2).tolist()
    for state in pool.states():
        state[:, src] = torch.arange(state[:, src].numel(), dtype=torch.float32).reshape(state[:, src].shape)
    fill(pool, other, 5.0)
    forked = pool.fork_from(src)
    assert forked.tolist() == [2]
    for state in pool.states():
        assert torch.equal(state[:, 2], state[:, src])
        assert bool((state[:, other] == 5.0).all())
    assert pool.fork_from(src) is None  # pool is empty
    pool.copy_from(t(other), t(src))
    assert all(bool((state[:, src] == 5.0).all()) for state in pool.states())


def test_mamba_buf_infos_per_state_per_layer():
    pool = mamba()
    ptrs, lens, items = pool.get_contiguous_buf_infos()
    c, s = pool.conv[0], pool.temporal
    assert ptrs == [c[0].data_ptr(), c[1].data_ptr(), s[0].data_ptr(), s[1].data_ptr()]
    assert lens == [120, 120, 80, 80]  # 5 slots × 24 B and × 16 B
    assert items == [24, 24, 16, 16]
    assert pool.mem_usage_bytes() == 400


def test_mamba_integrity_catches_duplicates_dummy_and_leaks():
    pool = mamba()
    pool.free_slots = t(0, 1, 1)
    with pytest.raises(IntegrityError, match="1 duplicate ids among 3"):
        pool.check_integrity()
    pool.free_slots = t(0, 4)
    with pytest.raises(IntegrityError, match="reserved id 4"):
        pool.check_integrity()
    pool.clear()
    held = pool.alloc(2)
    with pytest.raises(IntegrityError, match="MambaPool leak: 2 free \\+ 1 in use != 4 slots"):
        pool.check_integrity(in_use=held[:1])
    with pytest.raises(IntegrityError, match="1 slots are also free"):
        pool.check_integrity(in_use=t(0, 1, 2))


# ---- HybridReqToTokenPool --------------------------------------------------
def test_one_mamba_slot_per_request_without_extra_buffer():
    pool = hybrid()
    assert pool.mamba_map == {1: 0, 3: 1}
    rows = pool.alloc(2)
    assert rows == [0, 1]
    assert pool.get_mamba_indices(rows).tolist() == [0, 1]
    assert pool.mamba_pool.available_size() == 4
    pool.free(0)
    assert (pool.available_size(), pool.mamba_pool.available_size()) == (3, 5)
    pool.check_integrity(tree_mamba_slots=t())
    with pytest.raises(ValueError, match="enable_mamba_extra_buffer is off"):
        pool.get_mamba_ping_pong_track_buffer([1])
    pool.clear()
    assert (pool.available_size(), pool.mamba_pool.available_size()) == (4, 6)
    pool.check_integrity(tree_mamba_slots=t())


def test_three_slots_per_request_with_ping_pong_and_keep_one():
    pool = hybrid(rows=4, slots=7, extra=True)
    rows = pool.alloc(2)
    assert rows == [0, 1]
    assert pool.get_mamba_indices(rows).tolist() == [0, 1]
    assert pool.get_mamba_ping_pong_track_buffer(rows).tolist() == [[2, 3], [4, 5]]
    assert pool.mamba_pool.available_size() == 1
    assert pool.alloc(1) is None  # needs 3 slots, 1 free: nothing taken
    assert (pool.available_size(), pool.mamba_pool.available_size()) == (2, 1)
    pool.free([1], mamba_ping_pong_track_buffer_to_keep=1)  # slot 5 now belongs to the tree
    assert pool.mamba_pool.free_slots.tolist() == [6, 1, 4]
    pool.check_integrity()
    pool.check_integrity(tree_mamba_slots=t(5))
    with pytest.raises(IntegrityError, match="leak: 3 free \\+ 3 in use != 7"):
        pool.check_integrity(tree_mamba_slots=t())
    pool.free([0])
    pool.check_integrity(tree_mamba_slots=t(5))
    assert pool.mamba_pool.available_size() == 6


def test_cow_mamba_index_is_adopted_not_reallocated():
    pool = hybrid(rows=4, slots=4)
    cow = pool.mamba_pool.fork_from(3)  # the radix cache's copy for the first request
    assert cow.tolist() == [0]
    rows = pool.alloc(2, mamba_indices=[int(cow), None])
    assert pool.get_mamba_indices(rows).tolist() == [0, 1]
    assert pool.mamba_pool.available_size() == 2
    pool.check_integrity(tree_mamba_slots=t())


def test_short_rows_or_slots_return_none_and_take_nothing():
    pool = hybrid(rows=2, slots=6)
    assert pool.alloc(3) is None
    pool = hybrid(rows=4, slots=2)
    assert pool.alloc(3) is None
    assert pool.alloc(3, mamba_indices=[None, None, None]) is None
    assert (pool.available_size(), pool.mamba_pool.available_size()) == (4, 2)
    assert pool.alloc(1, mamba_indices=[1]) == [0]  # an adopted slot needs no free one
    assert pool.mamba_pool.available_size() == 2


def test_free_without_mamba_cache_leaves_the_working_slot_to_the_tree():
    pool = hybrid(rows=2, slots=3, extra=False)
    rows = pool.alloc(1)
    pool.free(rows, free_mamba_cache=False)
    assert pool.mamba_pool.available_size() == 2
    pool.check_integrity(tree_mamba_slots=t(0))
    with pytest.raises(ValueError, match="needs extra buffers"):
        pool.free(pool.alloc(1), mamba_ping_pong_track_buffer_to_keep=0)


def test_live_slot_also_free_is_an_integrity_error():
    pool = hybrid()
    pool.alloc(1)
    pool.mamba_pool.free(t(0))
    with pytest.raises(IntegrityError, match="mamba slots of live rows: 1 slots are also free"):
        pool.check_integrity()


# ---- HybridLinearKVPool ----------------------------------------------------
def test_hybrid_linear_kv_pool_maps_only_full_attention_layers():
    m = mamba()
    pool = HybridLinearKVPool(8, 1, torch.float32, 1, 2, full_attention_layer_ids=[3, 7, 11], mamba_pool=m)
    assert pool.full_attention_layer_id_mapping == {3: 0, 7: 1, 11: 2}
    assert pool.full_kv_pool.layer_num == 3
    k = torch.ones(1, 1, 2)
    pool.set_kv_buffer(7, t(4), k, 2 * k)
    assert torch.equal(pool.full_kv_pool.k_buffer[1][4], k[0]) and not pool.full_kv_pool.k_buffer[0].any()
    assert torch.equal(pool.get_value_buffer(7)[4], 2 * k[0])
    assert pool.get_key_buffer(11).data_ptr() == pool.full_kv_pool.k_buffer[2].data_ptr()
    for mamba_layer in (0, 4):
        with pytest.raises(ValueError, match=rf"layer_id={mamba_layer} not in full attention layers: \[3, 7, 11\]"):
            pool.get_kv_buffer(mamba_layer)
    assert pool.get_contiguous_buf_infos() == pool.full_kv_pool.get_contiguous_buf_infos()
    assert pool.get_state_buf_infos() == m.get_contiguous_buf_infos()
    pool.check_integrity()


# ---- property: random alloc/free against a plain-Python model --------------
class HybridPoolModel:
    """Free lists as plain lists: alloc takes from the front, free appends."""

    def __init__(self, rows: int, slots: int, extra: bool):
        self.rows, self.slots, self.extra = list(range(rows)), list(range(slots)), extra

    def take_slots(self, n: int) -> list:
        taken, self.slots = self.slots[:n], self.slots[n:]
        return taken

    def alloc(self, given: list):
        n = len(given)
        need = sum(g is None for g in given) + (2 * n if self.extra else 0)
        if n > len(self.rows) or need > len(self.slots):
            return None
        rows, self.rows = self.rows[:n], self.rows[n:]
        fresh = iter(self.take_slots(need))
        working = [next(fresh) if g is None else g for g in given]
        track = [[next(fresh), next(fresh)] for _ in range(n)] if self.extra else []
        return rows, working, track


class HybridPoolMachine(RuleBasedStateMachine):
    extra = False
    ROWS, SLOTS = 5, 9

    def __init__(self):
        super().__init__()
        self.pool = hybrid(self.ROWS, self.SLOTS, self.extra)
        self.model = HybridPoolModel(self.ROWS, self.SLOTS, self.extra)
        self.live: dict = {}  # row -> (working slot, [track slots])
        self.tree: list = []  # slots whose ownership passed to the "radix tree"

    @rule(n=st.integers(0, 3), cow=st.lists(st.booleans(), min_size=3, max_size=3))
    def alloc(self, n, cow):
        given = []
        for wants_cow in cow[:n]:  # the radix cache forks a checkpoint before alloc
            forked = self.pool.mamba_pool.fork_from(self.tree[0]) if wants_cow and self.tree else None
            if forked is not None:
                assert forked.tolist() == self.model.take_slots(1)
            given.append(None if forked is None else int(forked))
        expected = self.model.alloc(given)
        rows = self.pool.alloc(n, mamba_indices=given)
        if expected is None:
            assert rows is None
            adopted = [g for g in given if g is not None]
            self.pool.mamba_pool.free(t(*adopted))  # the caller returns its forks
            self.model.slots.extend(adopted)
            return
        exp_rows, working, track = expected
        assert rows == exp_rows
        assert self.pool.get_mamba_indices(rows).tolist() == working
        if self.extra:
            assert self.pool.get_mamba_ping_pong_track_buffer(rows).tolist() == track
        for i, row in enumerate(rows):
            self.live[row] = (working[i], track[i] if self.extra else [])

    @rule(data=st.data(), free_mamba=st.booleans(), keep=st.sampled_from([None, 0, 1]))
    def free(self, data, free_mamba, keep):
        if not self.live:
            return
        row = data.draw(st.sampled_from(sorted(self.live)))
        keep = keep if self.extra else None
        working, track = self.live.pop(row)
        self.pool.free([row], free_mamba_cache=free_mamba, mamba_ping_pong_track_buffer_to_keep=keep)
        freed = [working] if free_mamba else []
        if not free_mamba:
            self.tree.append(working)
        if keep is not None:
            self.tree.append(track[keep])
        freed += [s for i, s in enumerate(track) if i != keep]
        self.model.slots.extend(freed)
        self.model.rows.append(row)

    @rule()
    def evict_from_tree(self):
        if self.tree:
            slot = self.tree.pop()
            self.pool.mamba_pool.free(t(slot))
            self.model.slots.append(slot)

    @invariant()
    def conserved(self):
        assert self.pool.free_slots == self.model.rows
        assert self.pool.mamba_pool.free_slots.tolist() == self.model.slots
        self.pool.check_integrity(tree_mamba_slots=torch.tensor(self.tree, dtype=torch.int64))


class HybridPoolExtraBufferMachine(HybridPoolMachine):
    extra = True
    SLOTS = 12


HybridPoolMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)
HybridPoolExtraBufferMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)
TestHybridPool = HybridPoolMachine.TestCase
TestHybridPoolExtraBuffer = HybridPoolExtraBufferMachine.TestCase


def test_debug_mode_rejects_a_mamba_slot_or_a_row_freed_twice():
    """A slot or row freed twice is handed to two owners later; debug mode refuses it."""
    pool = MambaPool(4, [(2, 3)], (2, 2), 2, torch.float32, torch.float32, debug=True)
    x = pool.alloc(2)
    pool.free(x[:1])
    with pytest.raises(IntegrityError, match="double free of 1 Mamba slots"):
        pool.free(x)
    with pytest.raises(IntegrityError, match="allowed"):
        pool.free(t(4))  # the dummy slot
    assert pool.available_size() == 3  # nothing taken back by the refused frees
    rows = HybridReqToTokenPool(2, 8, "cpu", MambaPool(4, [(2, 3)], (2, 2), 2, torch.float32, torch.float32),
                                mamba_layer_ids=[0, 1], debug=True)
    r = rows.alloc(1)
    rows.free(r, free_mamba_cache=False)
    with pytest.raises(IntegrityError, match="double free of 1 rows"):
        rows.free(r, free_mamba_cache=False)
    assert rows.available_size() == 2


def test_op_log_replays_the_copy_made_not_what_its_index_tensors_hold_later():
    """A follower TP rank replays rank 0's ``op_log`` a step later: the logged copy must
    name the slots of the copy that was made, even if the caller reuses its index tensor."""
    leader, follower = mamba(size=3), mamba(size=3)
    leader.op_log = []
    slots = leader.alloc(3)
    for pool in (leader, follower):
        fill(pool, 0, 1.0)
        fill(pool, 1, 2.0)
    src, dst = t(0), t(2)
    leader.copy_from(src, dst)
    src[0] = 1  # the caller's buffer, reused after the call
    follower.replay(leader.op_log[1:])  # (the alloc's zeroing is the first entry)
    assert slots.tolist() == [0, 1, 2]
    for a, b in zip(leader.states(), follower.states()):
        assert torch.equal(a, b)
