"""The host arena: one allocation, sub-allocated in pages, so the host budget is exact."""

import pytest
import torch

from prefetch import arena as arena_module
from prefetch.arena import HostArena


def test_for_budget_takes_whole_pages_within_the_budget():
    arena = HostArena.for_budget(1000, page_numel=30, dtype=torch.float32, pin=False)  # 120-byte pages
    assert arena.num_pages == 8 and arena.nbytes == 960 and arena.pinned_bytes == 0
    with pytest.raises(ValueError, match=r"holds 8 pages of 120 bytes; one adapter at max_rank needs 9"):
        HostArena.for_budget(1000, page_numel=30, dtype=torch.float32, pin=False, min_pages=9)


def test_pinned_bytes_are_the_accounted_bytes(monkeypatch):
    """On CUDA the arena is registered once, whole: what is pinned is exactly what the cache accounts.
    Here registration is recorded instead of performed, since CPU builds cannot pin."""
    registered = []
    monkeypatch.setattr(arena_module, "_cuda_register", lambda t: registered.append(t.numel() * t.element_size()))
    monkeypatch.setattr(arena_module, "_cuda_unregister", lambda t: registered.append(-t.numel() * t.element_size()))
    budget = 84_000_000 + 12_345  # an 8B rank-16 adapter's size is nowhere near a power of two
    arena = HostArena.for_budget(budget, page_numel=5_250_000, dtype=torch.bfloat16, pin=True)
    assert registered == [arena.nbytes] == [arena.pinned_bytes] == [8 * 10_500_000]
    assert arena.nbytes <= budget < arena.nbytes + 10_500_000
    pages = arena.alloc(3)
    assert arena.used_bytes() == 3 * 10_500_000
    assert all(v.data_ptr() == arena.buffer.data_ptr() + p * 10_500_000 for p, v in zip(pages, arena.views(pages)))
    arena.free(pages)
    arena.close()
    assert registered == [arena.nbytes, -arena.nbytes] and arena.pinned_bytes == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_arena_is_pinned_outside_the_caching_allocator():
    def host_bytes():
        # The caching host allocator's non-zero current byte counts: their names vary across torch versions, and a
        # process that has not used the allocator yet reports none of them until its first call, then zeros.
        stats = torch.cuda.host_memory_stats() if hasattr(torch.cuda, "host_memory_stats") else {}
        return {k: v for k, v in stats.items() if "bytes" in k and k.endswith(".current") and v}

    before = host_bytes()
    arena = HostArena(3, 1_000_000, torch.bfloat16, pin=True)  # 6 MB: the caching allocator would take 8 MB
    assert arena.buffer.is_pinned() and arena.pinned_bytes == 6_000_000
    assert host_bytes() == before, "the arena went through the caching host allocator"
    device = torch.empty(1_000_000, dtype=torch.bfloat16, device="cuda")
    device.copy_(arena.views([1])[0].fill_(3), non_blocking=True)
    torch.cuda.synchronize()
    assert torch.all(device == 3)
    arena.close()
