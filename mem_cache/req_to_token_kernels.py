"""Triton kernel for ``ReqToTokenPool.write_extend`` (SGLang's ``write_req_to_token_pool_triton``).

One program per request copies its prefix (when its row needs it) and then its new
slots into its row of ``req_to_token``, ``BLOCK`` at a time: a batch's table writes
are one launch, not a copy kernel per request. On the CPU it runs under
``TRITON_INTERPRET=1`` (set before this module is imported, as for ``alloc_kernels``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

WRITE_BLOCK = 512


@triton.jit
def _write_req_to_token_kernel(table_ptr, reqs_ptr, prefixes_ptr, out_ptr, bs, row_stride, BLOCK: tl.constexpr):
    """``reqs`` is ``[6, bs]``: row, prefix slots to write, their offset in ``prefixes``,
    prefix length, new slots, their offset in ``out``."""
    pid = tl.program_id(0).to(tl.int64)
    row_ptr = table_ptr + tl.load(reqs_ptr + pid) * row_stride
    write_len = tl.load(reqs_ptr + bs + pid)
    prefix_src = tl.load(reqs_ptr + 2 * bs + pid)
    prefix_len = tl.load(reqs_ptr + 3 * bs + pid)
    extend_len = tl.load(reqs_ptr + 4 * bs + pid)
    out_src = tl.load(reqs_ptr + 5 * bs + pid)
    for block_start in range(0, write_len, BLOCK):
        j = block_start + tl.arange(0, BLOCK).to(tl.int64)
        mask = j < write_len
        slots = tl.load(prefixes_ptr + prefix_src + j, mask=mask)
        tl.store(row_ptr + j, slots.to(table_ptr.dtype.element_ty), mask=mask)
    for block_start in range(0, extend_len, BLOCK):
        j = block_start + tl.arange(0, BLOCK).to(tl.int64)
        mask = j < extend_len
        slots = tl.load(out_ptr + out_src + j, mask=mask)
        tl.store(row_ptr + prefix_len + j, slots.to(table_ptr.dtype.element_ty), mask=mask)


def write_req_to_token_triton(table: torch.Tensor, reqs: torch.Tensor, prefixes: torch.Tensor, out: torch.Tensor) -> None:
    bs = reqs.shape[1]
    if bs == 0:
        return
    _write_req_to_token_kernel[(bs,)](
        table, reqs.to(table.device), prefixes.to(table.device, torch.int64), out.to(table.device, torch.int64),
        bs, table.stride(0), BLOCK=WRITE_BLOCK,
    )
