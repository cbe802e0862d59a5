"""Property: PageCopier equals a page-by-page copy for any pages, runs and batch sizes."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from kvfsm.backends._pagecopy import PageCopier, word_view

PAGES = 24


@st.composite
def copies(draw: st.DrawFn) -> tuple[list[int], list[int], int, int, int]:
    count = draw(st.integers(0, PAGES))
    src_pages = draw(st.lists(st.integers(0, PAGES - 1), min_size=count, max_size=count))
    dst_pages = draw(st.permutations(range(PAGES)))[:count]  # distinct destinations
    row_bytes = draw(st.sampled_from([2, 8, 24, 64]))
    direct_bytes = draw(st.integers(1, 8 * 64))
    batch_bytes = draw(st.integers(1, 8 * 64))
    return src_pages, list(dst_pages), row_bytes, direct_bytes, batch_bytes


@given(copies())
def test_copy_equals_page_by_page(case: tuple[list[int], list[int], int, int, int]) -> None:
    src_pages, dst_pages, row_bytes, direct_bytes, batch_bytes = case
    generator = torch.Generator().manual_seed(len(src_pages))
    src = torch.randint(0, 256, (PAGES, row_bytes), dtype=torch.uint8, generator=generator)
    dst = torch.zeros_like(src)
    expected = dst.clone()
    for s, d in zip(src_pages, dst_pages, strict=True):
        expected[d] = src[s]
    copier = PageCopier(
        [(word_view(src, PAGES), word_view(dst, PAGES))], direct_bytes=direct_bytes, batch_bytes=batch_bytes
    )
    assert copier.copy(src_pages, dst_pages) == row_bytes * len(src_pages)
    assert torch.equal(dst, expected)
