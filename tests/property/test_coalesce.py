"""Page-run coalescing: runs cover exactly the page pairs, in order, as few as contiguity allows."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

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
