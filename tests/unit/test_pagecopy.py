"""PageCopier: bit-exact page copies whatever the split into runs and batches."""

from __future__ import annotations

import pytest
import torch

from kvfsm.backends._pagecopy import PageCopier, word_view


def reference(src: torch.Tensor, dst: torch.Tensor, src_pages: list[int], dst_pages: list[int]) -> torch.Tensor:
    out = dst.clone()
    for s, d in zip(src_pages, dst_pages, strict=True):
        out[d] = src[s]
    return out


def pools(pages: int, row_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    src = torch.randint(0, 256, (pages, row_bytes), dtype=torch.uint8, generator=generator)
    return src, torch.zeros_like(src)


@pytest.mark.parametrize(
    ("src_pages", "dst_pages"),
    [
        ([1, 2, 3, 4], [10, 11, 12, 13]),  # one run
        ([5, 1, 9, 2], [0, 7, 3, 14]),  # scattered both sides
        ([5, 1, 9, 2], [4, 5, 6, 7]),  # destination consecutive
        ([3, 4, 5, 6], [9, 1, 15, 0]),  # source consecutive
        ([0, 1, 2, 8, 3, 4, 5, 6], [8, 9, 10, 0, 1, 2, 3, 15]),  # runs and singles
        ([7], [7]),
    ],
)
@pytest.mark.parametrize("direct_bytes", [1, 96, 1 << 20])
def test_copy_matches_a_page_by_page_reference(src_pages: list[int], dst_pages: list[int], direct_bytes: int) -> None:
    src, dst = pools(16, 32)
    expected = reference(src, dst, src_pages, dst_pages)
    copier = PageCopier([(word_view(src, 16), word_view(dst, 16))], direct_bytes=direct_bytes, batch_bytes=64)
    assert copier.copy(src_pages, dst_pages) == 32 * len(src_pages)
    assert torch.equal(dst, expected)


def test_long_lists_use_the_vectorised_run_split() -> None:
    src, dst = pools(1024, 16)
    generator = torch.Generator().manual_seed(3)
    src_pages = torch.randperm(1024, generator=generator)[:600].tolist()
    dst_pages = [*range(100, 400), *torch.randperm(100, generator=generator).tolist()]
    dst_pages += range(700, 700 + 600 - len(dst_pages))
    expected = reference(src, dst, src_pages, dst_pages)
    copier = PageCopier([(word_view(src, 1024), word_view(dst, 1024))], direct_bytes=64, batch_bytes=256)
    copier.copy(src_pages, dst_pages)
    assert torch.equal(dst, expected)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int8, torch.float64, torch.bool])
def test_word_view_is_bit_exact_for_any_dtype(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(1)
    raw = torch.randint(0, 256, (4, 3, 8), dtype=torch.uint8, generator=generator)
    if dtype == torch.bool:
        raw = raw % 2
    src = raw.view(dtype)
    dst = torch.zeros_like(src)
    PageCopier([(word_view(src, 4), word_view(dst, 4))]).copy([3, 0], [1, 2])
    assert torch.equal(dst[1].view(torch.uint8), src[3].view(torch.uint8))
    assert torch.equal(dst[2].view(torch.uint8), src[0].view(torch.uint8))
    assert not dst[0].view(torch.uint8).any()
    assert word_view(torch.zeros(4, 8, dtype=torch.float64), 4).dtype == torch.int64
    assert word_view(torch.zeros(4, 3, dtype=torch.uint8), 4).dtype == torch.uint8


def test_mismatched_layouts_and_lengths_are_refused() -> None:
    a, b = pools(4, 16)
    with pytest.raises(ValueError, match="do not have the same page layout"):
        PageCopier([(word_view(a, 4), word_view(b[:, :8].contiguous(), 4))])
    copier = PageCopier([(word_view(a, 4), word_view(b, 4))])
    with pytest.raises(ValueError, match="2 source pages but 1 destination pages"):
        copier.copy([0, 1], [0])
    assert copier.copy([], []) == 0
    with pytest.raises(ValueError, match="must be contiguous"):
        word_view(a.t(), 4)
