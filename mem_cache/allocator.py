"""KV slot allocators (seed 000 §4, reference §1): they hand out slot *numbers*.

Memory is never allocated here: the KV pools own their buffers from start-up
and an allocator only decides which slot (``page_size == 1``) or page
(``page_size > 1``) numbers are free. Running short is a *logical* OOM:
every ``alloc*`` returns ``None`` and consumes nothing, so the scheduler can
evict from the tree cache, retract a request, or wait. Nothing here raises
into a request for lack of space.

Free-list semantics (shared by both allocators):

* The free list (int64) holds slot ids for ``page_size == 1`` and page ids
  otherwise; allocation takes from the front.
* Slot 0 / page 0 is the dummy that padded tokens write to: never handed out.
* ``free_group_begin()`` … ``free_group_end()`` turns every ``free`` in
  between into one ``free`` of the concatenation (one call per decode step);
  groups nest, and the outermost end frees.
* ``need_sort`` (PD disaggregation): frees go to a release list and only
  rejoin the free list, merged and sorted ascending, when an allocation finds
  it too short — so allocations stay contiguous for transfers.
* ``backup_state()`` / ``restore_state()`` snapshot the lists by reference
  (tensors are never mutated in place) and undo all allocations since.
"""

from __future__ import annotations

from typing import List, Optional, Tuple, Union

import torch

from mem_cache.alloc_ops import alloc_decode_torch, alloc_extend_torch, get_num_new_pages
from mem_cache.integrity import check_unique_in_range, debug_enabled, ensure

AllocatorState = Tuple
ALLOC_BACKENDS = ("auto", "torch", "triton")


class BaseTokenToKVPoolAllocator:
    """Free-list bookkeeping shared by the token and paged allocators.

    The logical free list is ``head chunks ++ free_pages ++ tail chunks``:
    frees are kept as small chunks (prepended to ``_head`` by the paged
    allocator, appended to ``_tail`` by the token allocator) instead of being
    concatenated into ``free_pages`` at once, so a free costs O(freed), not
    O(free list). Allocation materialises only the front it takes. With
    ``need_sort``, frees go to ``_release`` chunks instead.
    """

    def __init__(
        self,
        size: int,
        page_size: int,
        device: Union[str, torch.device] = "cpu",
        kvcache=None,
        need_sort: bool = False,
        debug: Optional[bool] = None,
    ):
        if page_size <= 0:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if size < page_size:
            raise ValueError(f"size ({size}) must hold at least one page of {page_size} slots")
        self.size = size
        self.page_size = page_size
        self.num_pages = size // page_size
        self.device = torch.device(device)
        self.kvcache = kvcache
        self.need_sort = need_sort
        self.debug = debug_enabled(debug)
        self.clear()

    # ---- state -----------------------------------------------------------
    def clear(self) -> None:
        self.free_pages = torch.arange(1, self.num_pages + 1, dtype=torch.int64, device=self.device)
        self._head: List[torch.Tensor] = []
        self._tail: List[torch.Tensor] = []
        self._release: List[torch.Tensor] = []
        self._num_chunked = 0  # pages in _head and _tail
        self._num_released = 0
        self.is_not_in_free_group = True
        self.free_group: list = []
        self._free_group_depth = 0

    def available_size(self) -> int:
        """Free *token slots* (pages × page_size), released ones included."""
        return (len(self.free_pages) + self._num_chunked + self._num_released) * self.page_size

    def free_page_list(self) -> torch.Tensor:
        """The free list in allocation order (not counting released pages)."""
        return torch.cat(self._head + [self.free_pages] + self._tail)

    def release_page_list(self) -> torch.Tensor:
        return torch.cat(self._release) if self._release else self._empty()

    def _empty(self) -> torch.Tensor:
        return torch.empty((0,), dtype=torch.int64, device=self.device)

    def backup_state(self) -> AllocatorState:
        return (self.free_pages, tuple(self._head), tuple(self._tail), tuple(self._release),
                self._num_chunked, self._num_released)

    def restore_state(self, state: AllocatorState) -> None:
        free, head, tail, release, self._num_chunked, self._num_released = state
        self.free_pages, self._head, self._tail, self._release = free, list(head), list(tail), list(release)

    def merge_and_sort_free(self) -> None:
        if self._release:
            merged = torch.cat(self._head + [self.free_pages] + self._tail + self._release)
            self.free_pages, _ = torch.sort(merged)
            self._head, self._tail, self._release = [], [], []
            self._num_chunked = self._num_released = 0

    def free_group_begin(self) -> None:
        """Open a group; one opened while another is open nests in it (its frees stay
        pending until the outermost ``free_group_end``, none is dropped)."""
        self._free_group_depth += 1
        self.is_not_in_free_group = False

    def free_group_end(self) -> None:
        """Close a group; closing the outermost one frees everything pending at once.
        Without an open group this does nothing."""
        if self._free_group_depth == 0:
            return
        self._free_group_depth -= 1
        if self._free_group_depth:
            return
        self.is_not_in_free_group = True
        pending, self.free_group = self.free_group, []
        if pending:
            self.free(torch.cat(pending))

    def _ensure_free_pages(self, num_pages: int) -> bool:
        """Whether ``num_pages`` can be taken from the free list, merging the
        released pages in first when that makes the difference (a request that
        fails anyway leaves every list exactly as it was)."""
        free = len(self.free_pages) + self._num_chunked
        if num_pages <= free:
            return True
        if self.need_sort and num_pages <= free + self._num_released:
            self.merge_and_sort_free()
            return True
        return False

    def _front(self, num_pages: int) -> torch.Tensor:
        """The first ``num_pages`` of the free list, not consumed; the caller has
        checked availability. Costs O(num_pages + number of chunks)."""
        pieces, need = [], num_pages
        for chunk in self._head:
            if need <= 0:
                break
            pieces.append(chunk[:need])
            need -= len(chunk)
        if need > 0:
            if need > len(self.free_pages):
                self._merge_tail()
            pieces.append(self.free_pages[:need])
        if len(pieces) == 1:
            return pieces[0]
        return torch.cat(pieces) if pieces else self.free_pages[:0]

    def _drop_front(self, num_pages: int) -> None:
        """Consume what :meth:`_front` just returned."""
        need = num_pages
        while need > 0 and self._head:
            chunk = self._head[0]
            taken = min(len(chunk), need)
            if taken == len(chunk):
                self._head.pop(0)
            else:
                self._head[0] = chunk[taken:]
            self._num_chunked -= taken
            need -= taken
        if need > 0:
            self.free_pages = self.free_pages[need:]

    def _merge_tail(self) -> None:
        if self._tail:
            self._num_chunked -= sum(len(t) for t in self._tail)
            self.free_pages = torch.cat([self.free_pages] + self._tail)
            self._tail = []

    def _take_pages(self, num_pages: int) -> Optional[torch.Tensor]:
        """Pop ``num_pages`` from the front, merging released pages if short."""
        if not self._ensure_free_pages(num_pages):
            return None
        taken = self._front(num_pages)
        self._drop_front(num_pages)
        return taken

    def _return_pages(self, pages: torch.Tensor, prepend: bool) -> None:
        if self.need_sort:
            _add_chunk(self._release, pages, prepend)
            self._num_released += len(pages)
        else:
            _add_chunk(self._head if prepend else self._tail, pages, prepend)
            self._num_chunked += len(pages)

    # ---- integrity -------------------------------------------------------
    def _pages_of(self, slots: torch.Tensor) -> torch.Tensor:
        return torch.unique(slots.to(torch.int64) // self.page_size)

    def _freed_pages(self, free_index: torch.Tensor) -> torch.Tensor:
        """The page ids ``free(free_index)`` returns to the free list, as it returns them."""
        raise NotImplementedError

    def free_page_ids(self) -> torch.Tensor:
        """Every page id that is free, released or pending in a free group (CPU, int64).

        Pending frees count as ``free_group_end`` will free them: as one ``free`` of their
        concatenation (two pending frees of slots of one page are one free of the page).
        """
        parts = [self.free_page_list().cpu(), self.release_page_list().cpu()]
        if self.free_group:
            parts.append(self._freed_pages(torch.cat([g.to("cpu", torch.int64) for g in self.free_group])))
        return torch.cat(parts)

    def check_integrity(self, in_use: Optional[torch.Tensor] = None) -> None:
        """Free lists hold unique pages in ``[1, num_pages]`` (never the dummy page 0).

        With ``in_use`` (every slot held by the tree cache or a live request)
        the used pages and the free pages must partition ``[1, num_pages]``:
        a page both free and used, or neither, raises ``IntegrityError``.
        """
        name = type(self).__name__
        free = self.free_page_ids()
        check_unique_in_range(f"{name} free pages", free, 1, self.num_pages, forbidden=0)
        if in_use is None:
            return
        # a slot held twice (by the tree and a request, say) would be freed twice later,
        # yet its page counts once either way: check the slots themselves first
        first, last = self.page_size, (self.num_pages + 1) * self.page_size - 1
        check_unique_in_range(f"{name} slots in use", in_use, first, last)
        used = self._pages_of(in_use.cpu())
        check_unique_in_range(f"{name} pages in use", used, 1, self.num_pages, forbidden=0)
        overlap = int(torch.isin(used, free).sum())
        ensure(overlap == 0, f"{name}: {overlap} pages are both free and in use")
        ensure(
            used.numel() + free.numel() == self.num_pages,
            f"{name} leak: {free.numel()} free + {used.numel()} in use != {self.num_pages} pages",
        )


class TokenToKVPoolAllocator(BaseTokenToKVPoolAllocator):
    """``page_size == 1``: slots ``1..size``; frees are appended (FIFO reuse)."""

    def __init__(self, size: int, device="cpu", kvcache=None, need_sort: bool = False, debug=None):
        super().__init__(size, 1, device, kvcache, need_sort, debug)

    def alloc(self, need_size: int) -> Optional[torch.Tensor]:
        return self._take_pages(need_size)

    def alloc_extend(self, prefix_lens, seq_lens, last_loc, extend_num_tokens: int, **_cpu_lens):
        """With one-slot pages an extend is just ``alloc(extend_num_tokens)`` (``last_loc`` may be None)."""
        return self.alloc(extend_num_tokens)

    def alloc_decode(self, seq_lens, last_loc, **_cpu_lens):
        return self.alloc(seq_lens.numel())

    def _freed_pages(self, free_index: torch.Tensor) -> torch.Tensor:
        return free_index.to(torch.int64)  # appended as given: a slot twice is there twice

    def free(self, free_index: torch.Tensor) -> None:
        if free_index.numel() == 0:
            return
        if not self.is_not_in_free_group:
            self.free_group.append(free_index)
            return
        if self.debug:
            check_unique_in_range("freed slots", free_index, 1, self.size)
            already = int(torch.isin(free_index.to(torch.int64).cpu(), self.free_page_ids()).sum())
            ensure(already == 0, f"double free of {already} slots")
        self._return_pages(self._freed_pages(free_index), prepend=False)


class PagedTokenToKVPoolAllocator(BaseTokenToKVPoolAllocator):
    """Pages of ``page_size`` slots; page ``p`` owns slots ``[p*ps, (p+1)*ps)``.

    ``free`` maps token slots to their unique pages and prepends them (LIFO
    reuse, as SGLang does). ``alloc_extend`` / ``alloc_decode`` lay a batch out
    as ``alloc_ops`` describes, with the Triton kernels (``backend="triton"``,
    the default on CUDA) or the vectorised PyTorch reference (``"torch"``).
    """

    def __init__(
        self,
        size: int,
        page_size: int,
        device="cpu",
        kvcache=None,
        need_sort: bool = False,
        backend: str = "auto",
        debug=None,
    ):
        super().__init__(size, page_size, device, kvcache, need_sort, debug)
        self.backend = _resolve_backend(backend, self.device)
        if self.backend == "triton":
            from mem_cache import alloc_kernels

            error = alloc_kernels.triton_device_error(self.device, "the allocator's backend='triton'")
            if error:
                raise ValueError(error)
            self._extend_impl = alloc_kernels.alloc_extend_triton
            self._decode_impl = alloc_kernels.alloc_decode_triton
        else:
            self._extend_impl = alloc_extend_torch
            self._decode_impl = alloc_decode_torch

    def alloc(self, need_size: int) -> Optional[torch.Tensor]:
        if need_size % self.page_size != 0:
            raise ValueError(f"paged alloc needs a multiple of page_size={self.page_size}, got {need_size}")
        pages = self._take_pages(need_size // self.page_size)
        if pages is None:
            return None
        offsets = torch.arange(self.page_size, device=self.device)
        return (pages[:, None] * self.page_size + offsets).reshape(-1)

    def alloc_extend(
        self,
        prefix_lens: torch.Tensor,
        seq_lens: torch.Tensor,
        last_loc: torch.Tensor,
        extend_num_tokens: int,
        prefix_lens_cpu: Optional[torch.Tensor] = None,
        seq_lens_cpu: Optional[torch.Tensor] = None,
    ) -> Optional[torch.Tensor]:
        """Slots for tokens ``[prefix_len, seq_len)`` of every request, in batch order.

        ``last_loc[i]`` is the slot of token ``prefix_len - 1`` (``-1`` for an
        empty prefix). Pass the ``*_cpu`` copies to avoid a device sync.
        """
        prefix_cpu = prefix_lens.cpu() if prefix_lens_cpu is None else prefix_lens_cpu
        seq_cpu = seq_lens.cpu() if seq_lens_cpu is None else seq_lens_cpu
        if self.debug:
            self._check_extend_args(prefix_cpu, seq_cpu, last_loc.cpu(), extend_num_tokens)
        num_new_pages = get_num_new_pages(seq_cpu, self.page_size, prefix_cpu)
        if not self._ensure_free_pages(num_new_pages):
            return None
        pages = self._front(num_new_pages)
        out = self._extend_impl(prefix_lens, seq_lens, last_loc, pages, self.page_size, extend_num_tokens)
        self._drop_front(num_new_pages)
        return out

    def alloc_decode(
        self, seq_lens: torch.Tensor, last_loc: torch.Tensor, seq_lens_cpu: Optional[torch.Tensor] = None
    ) -> Optional[torch.Tensor]:
        """One slot per request for the token at position ``seq_len - 1``."""
        seq_cpu = seq_lens.cpu() if seq_lens_cpu is None else seq_lens_cpu
        num_new_pages = get_num_new_pages(seq_cpu, self.page_size)
        if not self._ensure_free_pages(num_new_pages):
            return None
        pages = self._front(num_new_pages)
        out = self._decode_impl(seq_lens, last_loc, pages, self.page_size)
        self._drop_front(num_new_pages)
        return out

    def free(self, free_index: torch.Tensor) -> None:
        if free_index.numel() == 0:
            return
        if not self.is_not_in_free_group:
            self.free_group.append(free_index)
            return
        pages = self._freed_pages(free_index)
        if self.debug:
            check_unique_in_range("freed pages", pages, 1, self.num_pages, forbidden=0)
            already = int(torch.isin(pages.cpu(), self.free_page_ids()).sum())
            ensure(already == 0, f"double free of {already} pages")
        self._return_pages(pages, prepend=True)

    def _freed_pages(self, free_index: torch.Tensor) -> torch.Tensor:
        return self._pages_of(free_index)  # unique and sorted, prepended

    def _check_extend_args(self, prefix_lens, seq_lens, last_loc, extend_num_tokens: int) -> None:
        ensure(bool((seq_lens > prefix_lens).all()), "alloc_extend: every seq_len must exceed its prefix_len")
        ensure(
            int((seq_lens - prefix_lens).sum()) == extend_num_tokens,
            f"alloc_extend: extend_num_tokens={extend_num_tokens} != sum(seq - prefix)",
        )
        has_prefix = prefix_lens > 0
        consistent = (last_loc[has_prefix] + 1) % self.page_size == prefix_lens[has_prefix] % self.page_size
        ensure(bool(consistent.all()), "alloc_extend: last_loc + 1 and prefix_len disagree on the page offset")
        ensure(bool((last_loc[~has_prefix] == -1).all()), "alloc_extend: last_loc must be -1 for an empty prefix")


def _add_chunk(chunks: List[torch.Tensor], pages: torch.Tensor, prepend: bool) -> None:
    """Add ``pages`` at the front (``prepend``) or back of ``chunks``, merging
    neighbours while the new end is at least as large as the next one, so a
    list of n pages never holds more than O(log n) chunks and each page is
    copied O(log n) times in all."""
    if prepend:
        chunks.insert(0, pages)
        while len(chunks) >= 2 and len(chunks[0]) >= len(chunks[1]):
            chunks[0:2] = [torch.cat(chunks[0:2])]
    else:
        chunks.append(pages)
        while len(chunks) >= 2 and len(chunks[-1]) >= len(chunks[-2]):
            chunks[-2:] = [torch.cat(chunks[-2:])]


def _resolve_backend(backend: str, device: torch.device) -> str:
    if backend not in ALLOC_BACKENDS:
        raise ValueError(f"unknown allocator backend {backend!r}; known: {', '.join(ALLOC_BACKENDS)}")
    if backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    return backend
