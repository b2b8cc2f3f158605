"""MambaRadixCache under running requests, against the brute-force oracle of
``test_mamba_radix_cache_properties``.

Besides that file's inserts, matches, locks and evictions, up to two requests run
at once, each step a rule, as the scheduler drives them: admitted (match with
copy-on-write and a lock, or a decode-side reservation's KV-only match and lock),
prefilled chunk by chunk (the progress cached between chunks), decoded (extra_buffer:
checkpoints tracked at chunk boundaries and every ``chunk`` computed tokens) and
finished (inserting or not), in any interleaving and with evictions in between.

A request's states hold ``state_code`` of the tokens they cover, so every cached
checkpoint is checked to be the state after exactly its prefix. After every step the
oracle's matches and the slot accounting hold with the running requests' own KV
counted; at the end, every request finished, unlocked and evicted, all is free.
"""

import hypothesis.strategies as st
import torch
from hypothesis.stateful import precondition, rule

from mem_cache.mamba_tracking import decode_should_track, prefill_track_seqlen
from mem_cache.radix_key import RadixKey
from tests.cache_helpers import FakeReq, machine_case
from tests.test_mamba_radix_cache_properties import MambaMachine


class MambaRequestMachine(MambaMachine):
    num_states, context_len = 8, 48

    def __init__(self):
        super().__init__()
        self.running = []  # FakeReq, each holding a row and a lock

    # ---- the base machine's view of what running requests hold ----------------------------
    def _state_locks(self):
        own = [(r.last_node, r.origin_input_ids[: r.cache_protected_len]) for r in self.running
               if not r.kv_only_lock and r.cache_protected_len]
        return self.locks + own

    def _kv_only_locks(self):
        own = [(r.last_node, r.origin_input_ids[: r.cache_protected_len]) for r in self.running
               if r.kv_only_lock and r.cache_protected_len]
        return self.kv_locks + own

    def _private_kv(self):
        rows = [self._row(r, r.cache_protected_len, r.kv_committed_len) for r in self.running]
        return torch.cat(rows) if rows else super()._private_kv()

    def _row(self, req, start, end):
        return self.pool.req_to_token[req.req_pool_idx, start:end].to(torch.int64)

    # ---- a request's life ---------------------------------------------------------------
    @precondition(lambda self: self.pool.available_size() > 0)
    @rule(data=st.data(), kv_only=st.booleans(), same_prompt=st.booleans())
    def admit(self, data, kv_only, same_prompt):
        """``same_prompt``: a running request's prompt again, so that two requests cache one prefix."""
        prompts = [r.origin_input_ids for r in self.running]
        prompt = data.draw(st.sampled_from(prompts)) if prompts and same_prompt else self._tokens(data)
        req = self._reserve(prompt) if kv_only else self._admit(prompt)
        if req is not None:
            self.running.append(req)

    def _admit(self, prompt):
        """Match (copy-on-write), lock and take a row; the request, or None without room."""
        req = FakeReq(list(prompt), fill_ids=list(prompt))
        m = self._cow_match(req)
        if m is None:
            return None
        req.mamba_branching_seqlen = m.mamba_branching_seqlen
        return self._take_row(req, m, kv_only=False)

    def _reserve(self, prompt):
        """A decode-side reservation: the cached KV prefix, KV-only locked, and a fresh state slot."""
        req = FakeReq(list(prompt), fill_ids=list(prompt), kv_only_lock=True)
        m = self.cache.match_kv_prefix(RadixKey(prompt), req=req)
        assert m.device_indices.tolist() == self.oracle.kv_match(prompt[: len(prompt) - 1], None)
        return self._take_row(req, m, kv_only=True)

    def _take_row(self, req, m, kv_only):
        req.prefix_indices, req.last_node = m.device_indices, m.last_device_node
        req.cache_protected_len = req.kv_committed_len = len(m.device_indices)
        self.cache.inc_lock_ref(req.last_node, kv_only=kv_only)
        rows = self.pool.alloc(1, [req.mamba_pool_idx])
        if rows is None:
            kv_before, states_before = self._free_kv(), self._free_states()
            self.cache.dec_lock_ref(req.last_node, kv_only=kv_only)
            self._forget_freed(kv_before, states_before)  # a tombstone left a leaf goes with its lock
            if req.mamba_pool_idx is not None:
                self.mamba.free(torch.tensor([req.mamba_pool_idx]))
            return None
        req.req_pool_idx = rows[0]
        req.mamba_pool_idx = int(self.pool.get_mamba_indices(req.req_pool_idx)[0])
        self.pool.req_to_token[req.req_pool_idx, : len(m.device_indices)] = m.device_indices.to(torch.int32)
        return req

    @precondition(lambda self: self.running)
    @rule(data=st.data(), token=st.integers(0, 2))
    def advance(self, data, token):
        """One forward: a prefill chunk (the progress cached if the prompt is not done; a
        reservation receives the whole prompt's KV and final state at once) or a decode step."""
        req = data.draw(st.sampled_from(self.running))
        prompt, done = req.origin_input_ids, req.kv_committed_len
        if done < len(prompt):
            cut = len(prompt) if req.kv_only_lock else data.draw(st.integers(done + 1, len(prompt)))
            if not self._extend(req, done, cut):
                return
            if req.kv_only_lock:
                self._write_state(req.mamba_pool_idx, None, prompt)
                req.kv_committed_len = cut
            else:
                self._forward(req, prompt, done, cut)
            if cut < len(prompt):
                req.fill_ids = prompt[:cut]
                self._cache_unfinished(req, prompt)
                req.fill_ids = list(prompt)
            else:
                req.output_ids = [token]
        elif done + 1 < self.context_len and self._extend(req, done, done + 1):
            self._forward(req, prompt + req.output_ids, done, done + 1, decode=True)
            req.output_ids.append(token)

    def _extend(self, req, start, end):
        """KV for positions [start, end) of the request's row; False when the pool is out of slots."""
        row = self.pool.req_to_token[req.req_pool_idx]
        last = torch.tensor([int(row[start - 1]) if start else -1])
        new = self.alloc.alloc_extend(torch.tensor([start]), torch.tensor([end]), last, end - start)
        if new is None:
            return False
        row[start:end] = new.to(torch.int32)
        return True

    def _forward(self, req, tokens, start, end, decode=False):
        """The states a forward over [start, end) leaves: the working slot's, and a tracked checkpoint."""
        self._write_state(req.mamba_pool_idx, None, tokens[:end])
        req.kv_committed_len = end
        if self.strategy != "extra_buffer":
            return
        if decode:
            track = end if decode_should_track(end, self.chunk) else None
        else:
            track = prefill_track_seqlen(start, end - start, req.mamba_branching_seqlen, self.chunk)
        if track is not None:
            slot = self.pool.get_mamba_ping_pong_track_buffer(req.req_pool_idx)[0, req.mamba_next_track_idx]
            self._write_state(slot, None, tokens[:track])
            req.mamba_next_track_idx, req.mamba_last_track_seqlen = 1 - req.mamba_next_track_idx, track

    def _cache_unfinished(self, req, prompt):
        protected, row = req.cache_protected_len, self._row(req, 0, len(req.fill_ids)).tolist()
        kv_before, states_before = self._free_kv(), self._free_states()
        self.cache.cache_unfinished_req(req)
        self._forget_freed(kv_before, states_before)
        cached = req.cache_protected_len
        if cached == protected:
            return
        key = prompt[:cached]
        slot = int(req.last_node.mamba_value)  # a checkpoint evicted for room may have handed over its slot
        self.oracle.states = {k: s for k, s in self.oracle.states.items() if s != slot}
        self.oracle.states[(None, tuple(key))] = slot
        self.oracle.insert(key, None, row[:cached])
        assert self._row(req, 0, cached).tolist() == self.oracle.kv_match(key, None)  # the row reads the tree's

    @precondition(lambda self: self.running)
    @rule(data=st.data(), is_insert=st.booleans())
    def finish(self, data, is_insert):
        self._finish(self.running.pop(data.draw(st.integers(0, len(self.running) - 1))), is_insert)

    def _finish(self, req, is_insert):
        committed = req.kv_committed_len
        if self.strategy == "extra_buffer":
            cache_len = req.mamba_last_track_seqlen or 0
            slot = int(self.pool.get_mamba_ping_pong_track_buffer(req.req_pool_idx)[0, 1 - req.mamba_next_track_idx])
        else:
            cache_len, slot = committed, req.mamba_pool_idx
        cache_len = 0 if cache_len % self.page_size else cache_len
        key = (req.origin_input_ids + req.output_ids)[:cache_len]
        row = self._row(req, 0, cache_len).tolist()
        tree_kv = {s for slots in self.oracle.pages.values() for s in slots}
        tree_states = set(self.oracle.states.values())
        kv_before, states_before = self._free_kv(), self._free_states()
        self.cache.cache_finished_req(req, is_insert)
        freed_kv, freed_states = self._forget_freed(kv_before, states_before)
        assert not freed_states & tree_states, "finishing freed a checkpoint"
        # the tree's KV goes only with a tombstone a KV-only lock left a leaf, never what another lock holds
        assert not freed_kv & tree_kv or req.kv_only_lock and not freed_kv & self._locked_kv()
        if is_insert and cache_len > req.cache_protected_len:
            self.oracle.states.setdefault((None, tuple(key)), slot)
            self.oracle.insert(key, None, row)

    def teardown(self):
        while self.running:
            self._finish(self.running.pop(), is_insert=True)
        super().teardown()


TestMambaRequestsNoBuffer = machine_case(MambaRequestMachine, "ps1", 10, 30, page_size=1, strategy="no_buffer", chunk=2)
TestMambaRequestsPaged = machine_case(MambaRequestMachine, "ps4", 10, 30, page_size=4, strategy="extra_buffer", chunk=4)
