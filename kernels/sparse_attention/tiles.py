"""The program -> tile mapping the attention kernels share."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def program_tile(order, blk_start, blk_end, BLOCK: tl.constexpr, TILE: tl.constexpr, HEAD_OUTER: tl.constexpr):
    """This program's (head, block, block start, block end, tile start): the grid is (heads, rows) or, with
    HEAD_OUTER, (rows, heads); row i is tile i % (BLOCK // TILE) of block order[i // (BLOCK // TILE)]."""
    if HEAD_OUTER:
        h = tl.program_id(1)
        pid = tl.program_id(0)
    else:
        h = tl.program_id(0)
        pid = tl.program_id(1)
    NSUB: tl.constexpr = BLOCK // TILE
    b = tl.load(order + pid // NSUB)
    start = tl.load(blk_start + b)
    return h, b, start, tl.load(blk_end + b), start + (pid % NSUB) * TILE

