"""The paged KV cache's block bookkeeping (laminar/engines/kv_cache.py): rows take blocks as they
grow, a refused reservation takes nothing, leaving rows give every block back, a moved row keeps
its blocks, and a step's write rows and decode block table follow the tables.

    .venv/bin/python -m pytest tests/test_kv_cache.py -q
"""

from __future__ import annotations

import pytest
import torch

from laminar.engines.kv_cache import PagedKVCache


def _cache(blocks: int = 6, rows: int = 3, max_len: int = 64) -> PagedKVCache:
    return PagedKVCache(
        2,
        blocks=blocks,
        rows=rows,
        max_len=max_len,
        kv_heads=2,
        head_dim=4,
        dtype=torch.float32,
        device="cpu",
        block_tokens=4,
    )


def _blocks(c: PagedKVCache, row: int) -> list[int]:
    return c.table[row, : c.held[row]].tolist()


def test_rows_take_blocks_as_they_grow_and_give_them_all_back():
    c = _cache()
    assert c.capacity == 24 and c.free_blocks == 6
    assert c.nbytes == 2 * 2 * 7 * 4 * 2 * 4 * 4  # layers x (K, V) x (6 + null) blocks x 4 x 2 x 4
    assert c.reserve(0, 5) and _blocks(c, 0) == [1, 2]
    assert c.reserve(1, 4) and _blocks(c, 1) == [3]
    assert c.reserve(0, 8) and _blocks(c, 0) == [1, 2]  # still inside its second block
    assert c.reserve(0, 9) and _blocks(c, 0) == [1, 2, 4]
    assert c.free_blocks == 2
    assert not c.reserve(2, 12)  # needs 3, 2 free: refused, nothing taken
    assert c.free_blocks == 2 and c.held[2] == 0
    assert c.reserve(2, 8) and c.free_blocks == 0
    taken = _blocks(c, 0) + _blocks(c, 1) + _blocks(c, 2)
    assert sorted(taken) == [1, 2, 3, 4, 5, 6]  # every block once, the null block 0 never
    c.release(1)
    assert c.free_blocks == 1 and c.table[1].sum() == 0
    c.move(2, 1)  # row 2's sequence takes row 1 (the engine keeps rows 0..R-1)
    assert _blocks(c, 1) == [5, 6] and c.held[2] == 0 and c.table[2].sum() == 0
    c.release(0)
    c.release(1)
    assert c.free_blocks == 6


def test_a_row_never_holds_more_than_max_len():
    c = _cache(blocks=40, max_len=10)  # at most 3 blocks of 4 a row
    assert c.reserve(0, 12) and not c.reserve(0, 13) and c.free_blocks == 37


def test_step_layout_follows_the_block_tables():
    c = _cache()
    assert c.reserve(0, 3) and c.reserve(1, 9) and c.reserve(0, 6)
    assert _blocks(c, 0) == [1, 5] and _blocks(c, 1) == [2, 3, 4]
    lay = c.step_layout([5, 8], [])
    assert lay.n_decode == 2
    # position 5 of row 0 is block 5 offset 1; position 8 of row 1 is block 4 offset 0
    assert lay.write_rows.tolist() == [5 * 4 + 1, 4 * 4]
    # both rows padded to the longest (3 blocks), with the null block
    assert lay.decode_blocks.tolist() == [1, 5, 0, 2, 3, 4]
    assert not c.reserve(2, 6) and c.reserve(2, 4)  # 1 block free: room for 4 positions
    lay = c.step_layout([], [(2, 1, 3)])  # a segment continuing a 1-position prefix
    assert lay.write_rows.tolist() == [6 * 4 + 1, 6 * 4 + 2, 6 * 4 + 3]
    assert lay.segments[0].blocks.tolist() == [6] and lay.decode_blocks.numel() == 0


def test_contiguous_rows_own_fixed_ranges_and_a_move_copies_the_positions():
    c = PagedKVCache(
        1,
        blocks=9,
        rows=3,
        max_len=10,
        kv_heads=2,
        head_dim=4,
        dtype=torch.float32,
        device="cpu",
        block_tokens=4,
        contiguous=True,
    )
    assert c.blocks == 9 and c.table.tolist() == [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert c.reserve(0, 5) and c.reserve(2, 6) and not c.reserve(2, 13)
    assert c.free_blocks == 5 and _blocks(c, 2) == [7, 8]
    lay = c.step_layout([4, 1, 5], [])
    assert lay.write_rows.tolist() == [2 * 4, 4 * 4 + 1, 8 * 4 + 1] and lay.decode_cols == 6
    with torch.inference_mode():
        c.k[0][7:9] = torch.arange(2 * 4 * 2 * 4, dtype=torch.float32).view(2, 4, 2, 4)
    c.release(1)
    c.move(2, 1)  # row 2's positions are copied into row 1's range
    assert torch.equal(c.k[0][4:6], c.k[0][7:9]) and c.held[1] == 2 and c.held[2] == 0
    assert c.free_blocks == 5  # the same 4 blocks held, now by rows 0 and 1
    with pytest.raises(ValueError, match="contiguous"):
        PagedKVCache(
            1,
            blocks=8,
            rows=3,
            max_len=10,
            kv_heads=2,
            head_dim=4,
            dtype=torch.float32,
            device="cpu",
            contiguous=True,
            block_tokens=4,
        )
