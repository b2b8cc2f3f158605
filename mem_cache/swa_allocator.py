"""SWATokenToKVPoolAllocator: full-attention and sliding-window slots in step.

Hybrid sliding-window models (Gemma3, GPT-OSS) keep every token's KV in the
full-attention layers but only the last window in the SWA layers, whose pool
(``size_swa``) is smaller. Each allocation takes the same number of slots
from both sub-allocators and records ``full_to_swa_index_mapping[full] = swa``;
the *full* slot numbers are what requests and the tree cache hold.

* ``free(full)`` releases both halves; ``free_swa(full)`` releases only the
  SWA half (tokens that slid out of the window) and zeroes the mapping, the
  full KV staying cached.
* With ``page_size > 1`` both halves are paged and lay a position out at the
  same page offset, so a full page corresponds to exactly one SWA page;
  ``free_swa`` therefore works on whole pages.
* ``available_size()`` is ambiguous here and raises: use
  ``full_available_size()`` / ``swa_available_size()``.
"""

from __future__ import annotations

from typing import List, Optional

import torch

from mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from mem_cache.integrity import ensure


def _make_sub_allocator(size: int, page_size: int, device, need_sort: bool, backend: str, debug):
    if page_size == 1:
        return TokenToKVPoolAllocator(size, device=device, need_sort=need_sort, debug=debug)
    return PagedTokenToKVPoolAllocator(size, page_size, device=device, need_sort=need_sort, backend=backend, debug=debug)


class SWATokenToKVPoolAllocator:
    def __init__(
        self,
        size: int,
        size_swa: int,
        page_size: int = 1,
        device="cpu",
        kvcache=None,
        need_sort: bool = False,
        backend: str = "auto",
        debug=None,
    ):
        self.size = size
        self.size_swa = size_swa
        self.page_size = page_size
        self.device = torch.device(device)
        self.full_attn_allocator = _make_sub_allocator(size, page_size, device, need_sort, backend, debug)
        self.swa_attn_allocator = _make_sub_allocator(size_swa, page_size, device, need_sort, backend, debug)
        # indexed by full slot; the trailing entry (index -1) maps last_loc == -1 to -1
        self.full_to_swa_index_mapping = torch.zeros(size + page_size + 1, dtype=torch.int64, device=self.device)
        self.full_to_swa_index_mapping[-1] = -1
        self.kvcache = kvcache
        if kvcache is not None:
            kvcache.register_mapping(self.full_to_swa_index_mapping)

    # ---- sizes -------------------------------------------------------------
    def available_size(self) -> int:
        raise NotImplementedError("SWA allocator: use full_available_size() or swa_available_size()")

    def full_available_size(self) -> int:
        return self.full_attn_allocator.available_size()

    def swa_available_size(self) -> int:
        return self.swa_attn_allocator.available_size()

    # ---- allocation --------------------------------------------------------
    def _pair(self, alloc_full, alloc_swa) -> Optional[torch.Tensor]:
        """Run both allocations or neither; record the mapping."""
        state = self.full_attn_allocator.backup_state()
        full = alloc_full()
        if full is None:
            return None
        swa = alloc_swa()
        if swa is None:
            self.full_attn_allocator.restore_state(state)
            return None
        self.full_to_swa_index_mapping[full] = swa
        return full

    def alloc(self, need_size: int) -> Optional[torch.Tensor]:
        return self._pair(
            lambda: self.full_attn_allocator.alloc(need_size),
            lambda: self.swa_attn_allocator.alloc(need_size),
        )

    def alloc_without_swa(self, need_size: int) -> Optional[torch.Tensor]:
        """Full slots with no SWA half: for tokens already outside every window when their
        KV arrives (a PD decode reservation's prompt before its last window). They map to
        no SWA slot, as tokens whose SWA half was freed do."""
        return self.full_attn_allocator.alloc(need_size)

    def alloc_swa(self, full_index: torch.Tensor) -> bool:
        """SWA slots for full slots that have none (``alloc_without_swa``'s): the last window
        of a prefix loaded back from the host tier. Paged, ``full_index`` is whole pages in
        order, as ``alloc`` hands them out, so each maps to an SWA page at the same offsets.
        False, nothing taken, when the SWA pool is short."""
        ensure(bool((self.full_to_swa_index_mapping[full_index] == 0).all()), "alloc_swa: slots already have SWA")
        swa = self.swa_attn_allocator.alloc(len(full_index))
        if swa is None:
            return False
        self.full_to_swa_index_mapping[full_index] = swa
        return True

    def alloc_extend(self, prefix_lens, seq_lens, last_loc, extend_num_tokens: int, **cpu_lens):
        swa_last_loc = self._swa_last_loc(last_loc)
        return self._pair(
            lambda: self.full_attn_allocator.alloc_extend(prefix_lens, seq_lens, last_loc, extend_num_tokens, **cpu_lens),
            lambda: self.swa_attn_allocator.alloc_extend(prefix_lens, seq_lens, swa_last_loc, extend_num_tokens, **cpu_lens),
        )

    def alloc_decode(self, seq_lens, last_loc, **cpu_lens):
        swa_last_loc = self._swa_last_loc(last_loc)
        return self._pair(
            lambda: self.full_attn_allocator.alloc_decode(seq_lens, last_loc, **cpu_lens),
            lambda: self.swa_attn_allocator.alloc_decode(seq_lens, swa_last_loc, **cpu_lens),
        )

    def _swa_last_loc(self, last_loc: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """The SWA pool's ``last_loc`` (None with one-slot pages: neither pool needs it)."""
        return None if last_loc is None else self.translate_loc_from_full_to_swa(last_loc).to(torch.int64)

    def translate_loc_from_full_to_swa(self, full_loc: torch.Tensor) -> torch.Tensor:
        return self.full_to_swa_index_mapping[full_loc].to(torch.int32)

    # ---- freeing -----------------------------------------------------------
    def _expand_to_pages(self, full_index: torch.Tensor) -> torch.Tensor:
        if self.page_size == 1:
            return full_index
        pages = torch.unique(full_index.to(torch.int64) // self.page_size)
        offsets = torch.arange(self.page_size, device=full_index.device)
        return (pages[:, None] * self.page_size + offsets).reshape(-1)

    def free_swa(self, full_index: torch.Tensor) -> None:
        """Release the SWA slots of ``full_index`` (tokens out of every window), keeping their
        full KV. Paged, ``full_index`` must be whole pages, each slot once: an SWA page is
        freed whole, so a partial one would free the SWA KV of its other, live tokens
        (ValueError, nothing freed)."""
        if full_index.numel() == 0:
            return
        if self.page_size > 1:
            pages, counts = torch.unique(full_index.to(torch.int64) // self.page_size, return_counts=True)
            partial = pages[counts != self.page_size]
            if partial.numel():
                raise ValueError(f"free_swa takes whole pages (page_size={self.page_size}); "
                                 f"given in part: page(s) {partial[:4].tolist()}")
        self._release_swa(full_index)

    def _release_swa(self, full_index: torch.Tensor) -> None:
        """Free the SWA pages of the slots ``full_index`` names and clear their mapping."""
        full_index = self._expand_to_pages(full_index)
        swa = self.full_to_swa_index_mapping[full_index]
        self.swa_attn_allocator.free(swa[swa > 0])
        self.full_to_swa_index_mapping[full_index] = 0

    def free(self, full_index: torch.Tensor) -> None:
        """Release both halves of the pages ``full_index`` names (part of a page, e.g. a
        request's unaligned tail, frees the page: a full page is freed whole too)."""
        if full_index.numel() == 0:
            return
        self._release_swa(full_index)
        self.full_attn_allocator.free(full_index)

    def free_group_begin(self) -> None:
        self.full_attn_allocator.free_group_begin()
        self.swa_attn_allocator.free_group_begin()

    def free_group_end(self) -> None:
        self.full_attn_allocator.free_group_end()
        self.swa_attn_allocator.free_group_end()

    # ---- state -------------------------------------------------------------
    def backup_state(self) -> List:
        """Both sub-allocators' lists and a copy of the mapping (O(size): the mapping is
        written in place, so a reference would not keep the old entries)."""
        return [self.full_attn_allocator.backup_state(), self.swa_attn_allocator.backup_state(),
                self.full_to_swa_index_mapping.clone()]

    def restore_state(self, state: List) -> None:
        """Undo every change since the backup: allocations (their mapping entries with
        them), and ``free`` / ``free_swa`` calls (their slots in use again, mapped as
        before). The mapping is restored in place: the KV pool shares it."""
        self.full_attn_allocator.restore_state(state[0])
        self.swa_attn_allocator.restore_state(state[1])
        self.full_to_swa_index_mapping.copy_(state[2])

    def clear(self) -> None:
        self.full_attn_allocator.clear()
        self.swa_attn_allocator.clear()
        self.full_to_swa_index_mapping.zero_()
        self.full_to_swa_index_mapping[-1] = -1

    def _free_full_slots(self) -> torch.Tensor:
        pages = self.full_attn_allocator.free_page_ids()
        offsets = torch.arange(self.page_size)
        return (pages[:, None] * self.page_size + offsets).reshape(-1)

    def check_integrity(self, in_use: Optional[torch.Tensor] = None) -> None:
        """Both sub-allocators are sound; every SWA slot recorded in the mapping
        is in use in the SWA pool (the mapping is the SWA pool's complete list
        of used slots, so it must partition the SWA slots with the free list);
        no free full slot still maps to an SWA slot."""
        self.full_attn_allocator.check_integrity(in_use)
        mapping = self.full_to_swa_index_mapping[:-1].cpu()
        swa_in_use = mapping[mapping > 0]
        self.swa_attn_allocator.check_integrity(swa_in_use)
        stale = int((mapping[self._free_full_slots()] != 0).sum())
        ensure(stale == 0, f"SWA allocator: {stale} free full slots still map to SWA slots")
