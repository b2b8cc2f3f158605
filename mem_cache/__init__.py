"""raydix's memory system, after SGLang's design.

Three layers and the caches above them:

* request → token: :class:`ReqToTokenPool` (and :class:`HybridReqToTokenPool`
  for models with Mamba state);
* token → slot number: the allocators (:class:`TokenToKVPoolAllocator`,
  :class:`PagedTokenToKVPoolAllocator`, :class:`SWATokenToKVPoolAllocator`),
  which hand out numbers, never memory;
* slot → bytes: the KV pools (:class:`MHATokenToKVPool`, :class:`MLATokenToKVPool`,
  :class:`SWAKVPool`, :class:`HybridLinearKVPool`, :class:`MambaPool`), whose
  buffers are allocated once, through a :mod:`buffer_allocator` a peer process
  can map;
* prefix caches: :class:`RadixCache`, :class:`MambaRadixCache`,
  :class:`SWARadixCache` (sliding-window models), and
  :class:`HiRadixCache` with its host tier (:class:`HostKVCache`) and file tier
  (:class:`SWAHiRadixCache`: the host and file tiers of sliding-window models, both pools).

Nothing here knows Ray, HTTP or models.
"""

from mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from mem_cache.base_prefix_cache import BasePrefixCache, MatchResult
from mem_cache.buffer_allocator import (
    BufferHandle,
    LocalBufferAllocator,
    SharedMemoryBufferAllocator,
    attach_buffers,
    create_buffer_allocator,
)
from mem_cache.hicache_storage import HiCacheFile
from mem_cache.hiradix_cache import HiRadixCache
from mem_cache.integrity import IntegrityError
from mem_cache.mamba_pool import HybridLinearKVPool, HybridReqToTokenPool, MambaPool
from mem_cache.mamba_radix_cache import MambaRadixCache
from mem_cache.memory_budget import KVCacheShape, MemoryBudget, default_memory_args, profile_max_num_tokens
from mem_cache.memory_pool import KVCache, MHATokenToKVPool, MLATokenToKVPool
from mem_cache.memory_pool_host import HostKVCache, MHATokenToKVPoolHost, MLATokenToKVPoolHost
from mem_cache.radix_cache import RadixCache
from mem_cache.radix_key import RadixKey, hash_pages
from mem_cache.req_to_token_pool import ReqToTokenPool
from mem_cache.swa_allocator import SWATokenToKVPoolAllocator
from mem_cache.swa_hiradix_cache import SWAHiRadixCache
from mem_cache.swa_memory_pool import SWAKVPool
from mem_cache.swa_radix_cache import SWARadixCache

__all__ = [
    "BasePrefixCache", "BufferHandle", "HiCacheFile", "HiRadixCache", "HostKVCache", "MHATokenToKVPoolHost",
    "MLATokenToKVPoolHost", "HybridLinearKVPool", "HybridReqToTokenPool", "IntegrityError",
    "KVCache", "KVCacheShape", "LocalBufferAllocator", "MHATokenToKVPool", "MLATokenToKVPool",
    "MambaPool", "MambaRadixCache", "MatchResult", "MemoryBudget", "PagedTokenToKVPoolAllocator",
    "RadixCache", "RadixKey", "ReqToTokenPool", "SWAHiRadixCache", "SWAKVPool", "SWARadixCache", "SWATokenToKVPoolAllocator",
    "SharedMemoryBufferAllocator", "TokenToKVPoolAllocator", "attach_buffers", "create_buffer_allocator",
    "default_memory_args", "hash_pages", "profile_max_num_tokens",
]
