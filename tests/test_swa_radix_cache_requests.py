"""SWARadixCache under running requests, against the brute-force oracle of
``test_swa_radix_cache``.

Besides that machine's inserts, matches, locks, evictions and whole requests, up to
two requests run at once, each step a rule: admitted (match, lock, a row), prefilled
chunk by chunk (the progress cached between chunks), decoded (the SWA KV of tokens
that slid out of the window freed first, as the scheduler does before every decode)
and finished (inserting or not), in any interleaving and with full and SWA evictions
in between. After every step the matches, the tree's slots and both pools' accounting
agree with the oracle, running requests' own slots counted; a running request's own
slots and the last window it attends to are never freed under it.
"""

import hypothesis.strategies as st
import torch
from hypothesis.stateful import precondition, rule

from tests.cache_helpers import FakeReq, machine_case
from tests.test_swa_radix_cache import SWAMachine, extend, row


class SWARequestMachine(SWAMachine):
    num_rows = 4  # two for running requests, two for the base machine's whole requests

    def __init__(self):
        super().__init__()
        self.running = []

    def _running(self):
        return self.running

    def _live_locks(self):
        own = []
        for r in self.running:
            protected = r.cache_protected_len
            tokens = (r.origin_input_ids + r.output_ids)[:protected]
            own.append((r.last_node, r.swa_uuid_for_lock, tokens, row(self.pool, r, 0, protected).tolist()))
        return self.locks + own

    def _evict(self, full_num, swa_num, live_locks):
        """The base machine's eviction check, and running requests keep their own slots and SWA."""
        own = {id(r): self._own(r) for r in self.running}
        super()._evict(full_num, swa_num, live_locks)
        mapping = self.alloc.full_to_swa_index_mapping
        free = self._free_slots()
        for r in self.running:
            full, with_swa = own[id(r)]
            assert not full & free and all(int(mapping[s]) > 0 for s in with_swa), "a running request's slots freed"

    def _own(self, req):
        """A running request's private full slots, and those of them that still have SWA KV."""
        start, end = req.cache_protected_len, req.kv_committed_len
        full = row(self.pool, req, start, end).tolist()
        return set(full), full[max(req.swa_evicted_seqlen - start, 0):]

    @precondition(lambda self: len(self.running) < 2)
    @rule(data=st.data())
    def admit(self, data):
        prompt = self._tokens(data)
        req = FakeReq(list(prompt), fill_ids=list(prompt))
        m = self._check_match(prompt[: len(prompt) - 1])  # one token is always computed
        req.prefix_indices, req.last_node = m.device_indices, m.last_device_node
        req.cache_protected_len = req.kv_committed_len = len(m.device_indices)
        req.swa_uuid_for_lock = self.cache.inc_lock_ref(req.last_node)
        req.req_pool_idx = self.pool.alloc(1)[0]
        self.pool.req_to_token[req.req_pool_idx, : len(m.device_indices)] = m.device_indices.to(torch.int32)
        self.running.append(req)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), token=st.integers(0, 2), slide=st.booleans())
    def advance(self, data, token, slide):
        """One forward: a prefill chunk (the progress cached if the prompt is not done) or a
        decode step; with ``slide`` (always before a decode) out-of-window SWA is freed first."""
        req = data.draw(st.sampled_from(self.running))
        prompt, done = req.origin_input_ids, req.kv_committed_len
        if slide or done >= len(prompt):
            self.cache.free_swa_out_of_window(req)
        end = data.draw(st.integers(done + 1, len(prompt))) if done < len(prompt) else done + 1
        if end > 30 * self.page_size or extend(self.alloc, self.pool, req, end) is None:
            return
        if done >= len(prompt):
            req.output_ids.append(token)
        elif end == len(prompt):
            req.output_ids = [token]
        else:
            req.fill_ids = prompt[:end]
            self._mirror_insert(req, end)
            self.cache.cache_unfinished_req(req)
            aligned = end - end % self.page_size  # the tail page stays the request's
            assert row(self.pool, req, 0, aligned).tolist() == self.oracle.full_match(prompt[:end], None)
            req.fill_ids = list(prompt)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), is_insert=st.booleans())
    def finish(self, data, is_insert):
        self._finish(self.running.pop(data.draw(st.integers(0, len(self.running) - 1))), is_insert)

    def _finish(self, req, is_insert):
        if is_insert:
            self._mirror_insert(req, req.kv_committed_len)
        self.cache.cache_finished_req(req, is_insert)

    def teardown(self):
        while self.running:
            self._finish(self.running.pop(), is_insert=True)
        super().teardown()


TestSWARequestsWindow3 = machine_case(SWARequestMachine, "w3", 12, 30, window=3)
TestSWARequestsPaged = machine_case(SWARequestMachine, "p4w6", 12, 30, window=6, page_size=4, pool_pages=(24, 12))
