"""The host tier's memory: one arena of pages, allocated and pinned once, so the host budget is exact.

`torch.empty(pin_memory=True)` goes through torch's caching host allocator, which rounds every request up
to a power of two (an 84 MB adapter pins 128 MB) and keeps freed blocks cached: pinned memory could
exceed `host_cache_bytes` by about 1.5×. Instead the arena is plain memory of exactly
`num_pages × page bytes`, page-locked with `cudaHostRegister` (CUDA) and sub-allocated in pages of the
adapter layout (prefetch/layout.py), so an adapter's host pages copy straight into its device pages.
Written by hand: torch offers no fixed-size pinned pool.
"""

from __future__ import annotations

import torch

from prefetch.slot_pool import PageAllocator


def _cuda_register(buffer: torch.Tensor) -> None:
    cudart = torch.cuda.cudart()
    err = cudart.cudaHostRegister(buffer.data_ptr(), buffer.numel() * buffer.element_size(), 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of {buffer.numel() * buffer.element_size()} bytes failed: {err}")


def _cuda_unregister(buffer: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr())


class HostArena:
    """num_pages pages of page_numel elements. Bookkeeping is plain Python; the engine thread owns it.

    pin: page-lock the arena (CUDA); on CPU the same arena is plain memory, and `pinned_bytes` stays 0.
    """

    def __init__(self, num_pages: int, page_numel: int, dtype: torch.dtype, pin: bool):
        if num_pages < 1:
            raise ValueError(f"the host arena needs at least 1 page, got {num_pages}")
        self.buffer = torch.empty(num_pages, page_numel, dtype=dtype)  # [num_pages, page_numel]
        self.page_nbytes = page_numel * self.buffer.element_size()
        self.pages = PageAllocator(num_pages)
        self.pinned_bytes = 0
        if pin:
            _cuda_register(self.buffer)
            self.pinned_bytes = self.nbytes

    @classmethod
    def for_budget(cls, budget_bytes: int, page_numel: int, dtype: torch.dtype, pin: bool,
                   min_pages: int = 1) -> HostArena:
        """The largest arena within budget_bytes; at least min_pages (one adapter at max_rank) must fit."""
        page_nbytes = page_numel * torch.empty((), dtype=dtype).element_size()
        num_pages = budget_bytes // page_nbytes
        if num_pages < min_pages:
            raise ValueError(f"host_cache_bytes ({budget_bytes}) holds {num_pages} pages of {page_nbytes} bytes; "
                             f"one adapter at max_rank needs {min_pages} ({min_pages * page_nbytes} bytes)")
        return cls(num_pages, page_numel, dtype, pin)

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    @property
    def num_pages(self) -> int:
        return self.pages.num_pages

    def free_count(self) -> int:
        return self.pages.free_count()

    def can_alloc(self, n: int) -> bool:
        return self.pages.can_alloc(n)

    def alloc(self, n: int) -> tuple[int, ...]:
        return self.pages.alloc(n)

    def free(self, pages) -> None:
        self.pages.free(pages)

    def views(self, pages) -> list[torch.Tensor]:
        """1-D [page_numel] views of the given pages."""
        return [self.buffer[p] for p in pages]

    def used_bytes(self) -> int:
        return (self.num_pages - self.free_count()) * self.page_nbytes

    def close(self) -> None:
        if self.pinned_bytes:
            _cuda_unregister(self.buffer)
            self.pinned_bytes = 0
