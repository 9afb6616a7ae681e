"""CPU memory on transparent huge pages, for what every decode step streams: the weights and the KV cache.

Batch-1 decode reads every weight once per token, a few hundred separate tensors of 0.3-2 MB each. On 4 KB
pages that is a TLB miss every 4 KB and a fresh hardware-prefetch stream at every tensor. Gathered into one
buffer in the order a step reads them, on 2 MB pages (Linux `madvise(MADV_HUGEPAGE)`; THP in `madvise`
mode is the common default and PyTorch's allocator does not ask for it), the layers' linears ran 5-7%
faster here (benchmarks/README.md). Elsewhere the buffer is plain memory: same layout, no huge pages.
"""

from __future__ import annotations

import contextlib
import math
import mmap
from pathlib import Path

import torch
from torch import nn

HUGE_PAGE = 2 << 20
MADV_POPULATE_WRITE = 23  # Linux >= 5.14; Python's mmap module does not name it before 3.13


def huge_page_bytes(nbytes: int, populate: bool = False) -> torch.Tensor:
    """A zeroed uint8 CPU tensor of `nbytes`, 2 MB-aligned, on huge pages where the OS offers them.

    `populate`: fault every page in now rather than on first write (2 GB took ~0.2 s on one host, 13.7 s in a
    VM whose fresh 2 MB pages are slow to touch: benchmarks/README.md). A
    KV pool is handed out least recently freed first, so a fresh server writes new pages for its first
    few hundred thousand tokens, and each fault zeroes 2 MB inside a step while the other threads wait
    (`clear_page_erms` was 6.6% of 32 concurrent requests in-process)."""
    # Private: a shared anonymous mapping is shmem, whose huge pages are off by default.
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # zero-filled
    whole = torch.frombuffer(region, dtype=torch.uint8)  # keeps `region` alive as long as any view
    start = -whole.data_ptr() % HUGE_PAGE
    advise = getattr(mmap, "MADV_HUGEPAGE", None)
    if advise is not None and nbytes >= HUGE_PAGE:
        with contextlib.suppress(OSError):  # a kernel built without THP: plain pages
            region.madvise(advise, start, nbytes - nbytes % HUGE_PAGE)
    if populate and nbytes:
        with contextlib.suppress(OSError):  # an older kernel: pages come on first write, as without
            region.madvise(MADV_POPULATE_WRITE, start, nbytes)  # start: page-aligned
    return whole[start : start + nbytes]


def huge_page_zeros(shape: tuple[int, ...], dtype: torch.dtype, populate: bool = False) -> torch.Tensor:
    return huge_page_bytes(math.prod(shape) * dtype.itemsize, populate).view(dtype).view(shape)


def move_weights_to_huge_pages(modules: list[nn.Module]) -> None:
    """Replace each module's `weight` (contiguous, on the CPU) by a copy in one huge-page buffer, back to back
    in the given order; one at a time, so each original is freed as soon as it is copied."""
    if not modules:
        return
    offsets, total = [], 0
    for m in modules:
        total = -(-total // 64) * 64  # each weight starts a cache line
        offsets.append(total)
        total += m.weight.nbytes
    buffer = huge_page_bytes(total)
    for m, offset in zip(modules, offsets, strict=True):
        w = m.weight
        m.weight = buffer[offset : offset + w.nbytes].view(w.dtype).view(w.shape).copy_(w)


def smaps_fields(address: int) -> dict[str, str] | None:
    """The /proc/self/smaps fields (Rss, AnonHugePages, VmFlags, ...) of the mapping that holds `address`;
    None where the file does not exist (not Linux) or no mapping holds it."""
    smaps = Path("/proc/self/smaps")
    if not smaps.exists():
        return None
    fields: dict[str, str] | None = None
    for line in smaps.read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            if fields is not None:
                return fields
            start, end = (int(x, 16) for x in head.split("-"))
            fields = {} if start <= address < end else None
        elif fields is not None:
            name, _, value = line.partition(":")
            fields[name] = value.strip()
    return fields


def huge_page_share(tensor: torch.Tensor) -> float | None:
    """The share of the resident memory of `tensor`'s mapping that the OS backs with 2 MB pages (None where
    it cannot tell). Asking is not getting: with memory fragmented (after large files were written, say) the
    weights land on 4 KB pages and batch-1 decode slows down; the engine logs this at start."""
    fields = smaps_fields(tensor.data_ptr())
    if fields is None or "AnonHugePages" not in fields:
        return None
    resident = int(fields["Rss"].split()[0])
    return int(fields["AnonHugePages"].split()[0]) / resident if resident else 0.0
