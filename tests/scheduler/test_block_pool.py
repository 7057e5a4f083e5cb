"""BlockPool and KVCacheManager: exact block ids, ref counts, slots, and error paths."""

from __future__ import annotations

import pytest

from shoal.scheduler.block_pool import BlockPool, BlockPoolError
from shoal.scheduler.kv_cache_manager import KVCacheManager
from shoal.scheduler.request import Request


def test_pool_allocates_lowest_free_first_with_ref_counts() -> None:
    pool = BlockPool(8)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.allocate(2) == [3, 4]
    assert (pool.num_free, pool.num_used) == (3, 5)
    assert pool.free([1]) == [1]
    assert pool.allocate(2) == [1, 5]  # the hole first, then the next unused id
    pool.incref([3])
    assert pool.ref_count(3) == 2
    assert pool.free([3]) == []  # still shared
    assert pool.ref_count(3) == 1
    assert pool.free([3, 0]) == [3, 0]
    assert pool.allocate(1) == [0]
    pool.check_invariants()
    assert pool.num_free == 8 - 5


def test_pool_errors_leave_state_unchanged() -> None:
    pool = BlockPool(4)
    pool.allocate(3)
    with pytest.raises(BlockPoolError, match="only 1 of 4"):
        pool.allocate(2)
    assert pool.num_free == 1
    pool.free([2])
    with pytest.raises(BlockPoolError, match="double free of block 2"):
        pool.free([2])
    with pytest.raises(BlockPoolError, match="incref of free block 2"):
        pool.incref([2])
    with pytest.raises(BlockPoolError, match="outside"):
        pool.free([4])
    pool.check_invariants()
    assert pool.free([0, 1]) == [0, 1]
    assert pool.num_free == 4
    assert pool.allocate(4) == [0, 1, 2, 3]


def test_free_order_does_not_change_later_ids() -> None:
    first, second = BlockPool(6), BlockPool(6)
    ids = first.allocate(5)
    second.allocate(5)
    first.free([ids[3], ids[0], ids[2]])
    second.free([ids[2], ids[3], ids[0]])
    assert first.allocate(4) == second.allocate(4) == [0, 2, 3, 5]


def test_manager_growth_across_block_boundaries_and_slots() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=4, num_slots=2)
    a = Request("a", list(range(6)))
    assert kv.num_new_blocks(a, 6) == 2
    assert kv.allocate(a, 6) == [0, 1]
    assert (a.slot, a.block_ids) == (0, [0, 1])
    a.num_computed_tokens = 6
    assert kv.allocate(a, 2) == []  # 8 tokens still fit in 2 blocks
    a.num_computed_tokens = 8
    assert kv.allocate(a, 1) == [2]  # token 9 opens block 3
    b = Request("b", list(range(3)))
    assert kv.allocate(b, 3, num_lookahead_tokens=2) == [3, 4]  # 5 positions -> 2 blocks
    assert b.slot == 1
    c = Request("c", [1])
    assert not kv.can_allocate(c, 1)  # no slot left although blocks are free
    usage = kv.usage()
    assert (usage.num_used_blocks, usage.num_free_slots) == (5, 0)
    assert usage.block_usage == pytest.approx(0.5)
    kv.check_invariants()
    assert kv.free(a) == [2, 1, 0]
    assert (a.slot, a.block_ids) == (None, [])
    assert kv.allocate(c, 1) == [0]
    assert c.slot == 0  # lowest free slot
    kv.free(b)
    kv.free(c)
    assert kv.usage().num_free_blocks == 10 and kv.num_free_slots == 2
    kv.check_invariants()


def test_manager_refuses_over_allocation() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=4, num_slots=4)
    a = Request("a", list(range(9)))
    assert kv.can_allocate(a, 9)
    assert not kv.can_allocate(a, 13)
    with pytest.raises(RuntimeError, match="not enough free blocks"):
        kv.allocate(a, 13)
    assert a.slot is None and kv.pool.num_free == 3


def test_scheduler_package_imports_only_stdlib_and_itself() -> None:
    """The scheduler must run on a CPU-only box: no torch, nothing from model/runner/ops."""
    import ast
    import sys
    from pathlib import Path

    import shoal.scheduler

    allowed = set(sys.stdlib_module_names) | {"__future__"}
    for path in Path(shoal.scheduler.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            for name in names:
                assert name.split(".")[0] in allowed or name.startswith("shoal.scheduler"), \
                    f"{path.name} imports {name}"
