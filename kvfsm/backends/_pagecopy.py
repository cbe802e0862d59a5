"""Copy selected pages between paged torch buffers, batched, never one op per small page.

`PageCopier` moves page `src[i]` of every source region to page `dst[i]`
of the matching destination region. Pages are rows of a word-typed view
(`word_view`: the widest integer type that divides the page size), so the
copy is bit-exact for any dtype and every kernel moves whole words.

How a list of pages is split, and why:

* Runs where both source and destination pages are consecutive are
  copied as one slice each (`copy_`, a single pass that torch parallelises),
  once a run holds at least `direct_bytes`; decode allocators hand out
  consecutive pages often, and big pages are each such a run.
* The remaining pages go through batched index kernels: if one side is
  consecutive, a single `index_select(out=...)` or `index_copy_` does it in
  one pass; otherwise pages are gathered with `index_select` into a
  cache-sized scratch buffer and scattered with `index_copy_`, batch by
  batch, so the second pass reads from cache.

The number of torch calls grows with the number of runs and batches, not
with the number of pages. The run detection itself is vectorised.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

__all__ = ["PageCopier", "word_view"]

_WORDS = (torch.int64, torch.int32, torch.int16, torch.uint8)


def word_view(tensor: torch.Tensor, num_pages: int) -> torch.Tensor:
    """`tensor`'s bytes as [num_pages, words] of the widest integer type that fits.

    `tensor` must be contiguous; its bytes split evenly into `num_pages`.
    """
    if not tensor.is_contiguous():
        raise ValueError(f"a paged buffer must be contiguous; got strides {tuple(tensor.stride())}")
    flat = tensor.reshape(-1).view(torch.uint8)
    page_nbytes = flat.numel() // num_pages
    for word in _WORDS:
        size = torch.tensor([], dtype=word).element_size()
        if page_nbytes % size == 0 and flat.data_ptr() % size == 0:
            return flat.view(word).view(num_pages, page_nbytes // size)
    raise AssertionError("uint8 always fits")  # pragma: no cover


class PageCopier:
    """Copies pages between matched region pairs: `copy(src_pages, dst_pages) -> bytes`.

    `pairs` holds (source view, destination view) per region, each from
    `word_view`, with equal row sizes and dtypes. One copier may be used
    from several threads at once: scratch buffers are per thread.
    """

    def __init__(
        self,
        pairs: Sequence[tuple[torch.Tensor, torch.Tensor]],
        *,
        direct_bytes: int = 256 << 10,
        batch_bytes: int = 2 << 20,
    ) -> None:
        for index, (src, dst) in enumerate(pairs):
            if src.dim() != 2 or dst.dim() != 2 or src.shape[1] != dst.shape[1] or src.dtype != dst.dtype:
                raise ValueError(
                    f"region {index}: source {tuple(src.shape)} {src.dtype} and destination "
                    f"{tuple(dst.shape)} {dst.dtype} do not have the same page layout"
                )
        self.pairs = list(pairs)
        self.direct_bytes = direct_bytes
        self.batch_bytes = batch_bytes
        self.page_nbytes = sum(src.shape[1] * src.element_size() for src, _ in self.pairs)
        self._local = threading.local()

    def copy(self, src_pages: Sequence[int], dst_pages: Sequence[int]) -> int:
        """Copy `src_pages[i]` to `dst_pages[i]` in every region; returns bytes moved.

        Indices must already be validated (in range, same length). Device
        work may still be queued when this returns (synchronise CUDA streams
        before reporting the chunk done).
        """
        count = len(src_pages)
        if count != len(dst_pages):
            raise ValueError(f"{count} source pages but {len(dst_pages)} destination pages")
        if count == 0:
            return 0
        starts, lengths = _runs(src_pages, dst_pages)
        plans: dict[int, _Plan] = {}
        for src_view, dst_view in self.pairs:
            row_bytes = src_view.shape[1] * src_view.element_size()
            plan = plans.get(row_bytes)
            if plan is None:
                plan = plans[row_bytes] = _Plan(src_pages, dst_pages, starts, lengths, row_bytes, self.direct_bytes)
            for s0, d0, length in plan.direct:
                dst_view[d0 : d0 + length].copy_(src_view[s0 : s0 + length])
            if plan.src is not None and plan.dst is not None:
                self._indexed(src_view, dst_view, plan)
        return count * self.page_nbytes

    def _indexed(self, src_view: torch.Tensor, dst_view: torch.Tensor, plan: _Plan) -> None:
        assert plan.src is not None
        assert plan.dst is not None
        count = plan.src.numel()
        same_device = src_view.device == dst_view.device
        if same_device and plan.dst_start is not None:
            d0 = plan.dst_start
            torch.index_select(src_view, 0, plan.src.to(src_view.device), out=dst_view[d0 : d0 + count])
            return
        if same_device and plan.src_start is not None:
            s0 = plan.src_start
            dst_view.index_copy_(0, plan.dst.to(dst_view.device), src_view[s0 : s0 + count])
            return
        row_bytes = src_view.shape[1] * src_view.element_size()
        batch = max(1, self.batch_bytes // row_bytes)
        scratch = self._scratch(src_view, min(batch, count))
        src_dev = plan.src.to(src_view.device)
        dst_dev = plan.dst.to(dst_view.device)
        for lo in range(0, count, batch):
            hi = min(count, lo + batch)
            rows = scratch[: hi - lo]
            torch.index_select(src_view, 0, src_dev[lo:hi], out=rows)
            moved = rows if same_device else rows.to(dst_view.device)
            dst_view.index_copy_(0, dst_dev[lo:hi], moved)

    def _scratch(self, like: torch.Tensor, rows: int) -> torch.Tensor:
        cache: dict[tuple[torch.device, torch.dtype, int], torch.Tensor] | None = getattr(self._local, "cache", None)
        if cache is None:
            cache = self._local.cache = {}
        key = (like.device, like.dtype, like.shape[1])
        buffer = cache.get(key)
        if buffer is None or buffer.shape[0] < rows:
            buffer = cache[key] = torch.empty((rows, like.shape[1]), dtype=like.dtype, device=like.device)
        return buffer


_VECTOR_RUNS = 256


def _runs(src: Sequence[int], dst: Sequence[int]) -> tuple[list[int], list[int]]:
    """Starts and lengths of the runs where src and dst both go up by one."""
    count = len(src)
    if count < _VECTOR_RUNS:
        starts, lengths = [0], []
        for i in range(1, count):
            if src[i] != src[i - 1] + 1 or dst[i] != dst[i - 1] + 1:
                lengths.append(i - starts[-1])
                starts.append(i)
        lengths.append(count - starts[-1])
        return starts, lengths
    s = torch.tensor(src, dtype=torch.int64)
    d = torch.tensor(dst, dtype=torch.int64)
    breaks = ((s[1:] - s[:-1]) != 1) | ((d[1:] - d[:-1]) != 1)
    start_t = torch.cat((torch.zeros(1, dtype=torch.int64), breaks.nonzero().flatten() + 1))
    length_t = torch.diff(start_t, append=torch.tensor([count]))
    return start_t.tolist(), length_t.tolist()


class _Plan:
    """How one chunk splits for one page size: direct slice runs, then indexed pages."""

    __slots__ = ("direct", "dst", "dst_start", "src", "src_start")

    def __init__(
        self,
        src_pages: Sequence[int],
        dst_pages: Sequence[int],
        starts: list[int],
        lengths: list[int],
        row_bytes: int,
        direct_bytes: int,
    ) -> None:
        min_run = max(1, -(-direct_bytes // row_bytes))
        self.direct: list[tuple[int, int, int]] = []
        rest_src: list[int] = []
        rest_dst: list[int] = []
        for start, length in zip(starts, lengths, strict=True):
            if length >= min_run:
                self.direct.append((int(src_pages[start]), int(dst_pages[start]), length))
            else:
                rest_src.extend(src_pages[start : start + length])
                rest_dst.extend(dst_pages[start : start + length])
        self.src: torch.Tensor | None = None
        self.dst: torch.Tensor | None = None
        self.src_start: int | None = None
        self.dst_start: int | None = None
        if rest_src:
            self.src = torch.tensor(rest_src, dtype=torch.int64)
            self.dst = torch.tensor(rest_dst, dtype=torch.int64)
            self.src_start = _consecutive_start(rest_src)
            self.dst_start = _consecutive_start(rest_dst)


def _consecutive_start(pages: list[int]) -> int | None:
    """pages[0] if pages are consecutive ascending, else None."""
    first = pages[0]
    if pages[-1] - first != len(pages) - 1:
        return None
    return first if pages == list(range(first, first + len(pages))) else None
