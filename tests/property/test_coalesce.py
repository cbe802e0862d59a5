"""Page-run coalescing: runs cover exactly the page pairs, in order, as few as contiguity allows."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from kvfsm.backends._remote_engine import page_writes
from kvfsm.backends.memory import MemoryRegion
from kvfsm.backends.remote import coalesce_runs

pairs = st.integers(0, 64).flatmap(
    lambda n: st.tuples(
        st.lists(st.integers(0, 40), min_size=n, max_size=n), st.lists(st.integers(0, 40), min_size=n, max_size=n)
    )
)


@given(pairs)
def test_runs_expand_back_to_the_page_pairs(pages: tuple[list[int], list[int]]) -> None:
    src, dst = pages
    runs = coalesce_runs(src, dst)
    expanded = [(s + i, d + i) for s, d, n in runs for i in range(n)]
    assert expanded == list(zip(src, dst, strict=True))
    assert all(n >= 1 for _, _, n in runs)


@given(pairs)
def test_neighbouring_runs_never_continue_each_other(pages: tuple[list[int], list[int]]) -> None:
    runs = coalesce_runs(*pages)
    for (s0, d0, n0), (s1, d1, _) in itertools.pairwise(runs):
        assert not (s1 == s0 + n0 and d1 == d0 + n0), "two runs that should have been one"


def test_contiguous_pages_make_one_run() -> None:
    assert coalesce_runs([4, 5, 6], [10, 11, 12]) == [(4, 10, 3)]
    assert coalesce_runs([4, 5, 9], [10, 11, 12]) == [(4, 10, 2), (9, 12, 1)]
    assert coalesce_runs([], []) == []


def _regions(*page_sizes: int, pages: int = 64) -> list[MemoryRegion]:
    """Regions far apart, each with its own page size (K and V of a layer may differ, MLA has one)."""
    return [MemoryRegion(ptr=(n + 1) << 32, nbytes=pages * size, page_nbytes=size) for n, size in enumerate(page_sizes)]


def test_a_run_is_one_write_per_region_only_when_both_sides_are_adjacent() -> None:
    mine, theirs = _regions(16, 32), _regions(16, 32)
    # 4,5 -> 10,11 is one run; 6 -> 13 leaves the destination's order (src adjacent only); 8 -> 14 the source's.
    writes = page_writes(mine, theirs, coalesce_runs([4, 5, 6, 8], [10, 11, 13, 14]))
    k, v = mine[0].ptr, mine[1].ptr
    dk, dv = theirs[0].ptr, theirs[1].ptr
    assert writes == [
        (k + 4 * 16, dk + 10 * 16, 2 * 16),
        (v + 4 * 32, dv + 10 * 32, 2 * 32),
        (k + 6 * 16, dk + 13 * 16, 16),
        (v + 6 * 32, dv + 13 * 32, 32),
        (k + 8 * 16, dk + 14 * 16, 16),
        (v + 8 * 32, dv + 14 * 32, 32),
    ]


@given(pairs, st.lists(st.sampled_from([8, 16, 24]), min_size=1, max_size=4))
def test_writes_cover_every_page_of_every_region_once(pages: tuple[list[int], list[int]], sizes: list[int]) -> None:
    src, dst = pages
    mine, theirs = _regions(*sizes), _regions(*sizes)
    writes = page_writes(mine, theirs, coalesce_runs(src, dst))
    covered = []
    for source, target, nbytes in writes:
        (n,) = [i for i, r in enumerate(mine) if r.ptr <= source < r.ptr + r.nbytes]
        size = mine[n].page_nbytes
        assert nbytes % size == 0 and (target - theirs[n].ptr) % size == 0
        first_src, first_dst = (source - mine[n].ptr) // size, (target - theirs[n].ptr) // size
        covered += [(n, first_src + i, first_dst + i) for i in range(nbytes // size)]
    expected = [(n, s, d) for s, d in zip(src, dst, strict=True) for n in range(len(sizes))]
    assert sorted(covered) == sorted(expected)
    assert len(writes) == len(coalesce_runs(src, dst)) * len(sizes)
