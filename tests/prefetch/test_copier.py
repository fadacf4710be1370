"""The CUDA copier: a slot copy on the copy stream overlaps a forward pass on the compute stream (marker `gpu`)."""

import time

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from app.adapters.targets import target_shapes
from app.model.lora import LoRASlots
from prefetch.arena import HostArena
from prefetch.copier import CudaCopier
from prefetch.host_cache import HostAdapter
from prefetch.layout import PageLayout

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_prefetch_copy_overlaps_forward():
    """A slot copy on the copy stream runs while a forward pass runs on the compute stream."""
    config = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=8,
                         num_attention_heads=16, num_key_value_heads=8)
    model = LlamaForCausalLM(config).to(torch.bfloat16).cuda().eval()
    layout = PageLayout(target_shapes(config), max_rank=64)
    lora = LoRASlots(model, layout, num_pages=2 * layout.max_pages, num_slots=2, t_cap=8 * 512)
    copier = CudaCopier(torch.device("cuda"), lora.write_slot)
    arena = HostArena(layout.max_pages, layout.page_numel, torch.bfloat16, pin=True)
    pages = tuple(range(layout.max_pages))
    for view in arena.views(pages):
        view.copy_(torch.randn(layout.page_numel).mul_(0.01))
    host = HostAdapter("big", pages, tuple(arena.views(pages)), torch.ones(len(layout.modules)), 0.0, 64,
                       arena.page_nbytes)
    ids = torch.randint(32000, (8, 512), device="cuda")
    with torch.inference_mode():
        model(input_ids=ids)  # warm up kernels
        torch.cuda.synchronize()
        origin = torch.cuda.Event(enable_timing=True)
        fwd_start, fwd_end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        origin.record()
        fwd_start.record()
        model(input_ids=ids)  # queued on the compute stream
        fwd_end.record()
        t0 = time.perf_counter()
        transfer = copier.start(1, [layout.max_pages + p for p in pages], host)  # while the forward runs
        issue_ms = (time.perf_counter() - t0) * 1e3
        torch.cuda.synchronize()
    forward = (origin.elapsed_time(fwd_start), origin.elapsed_time(fwd_end))
    copy = (origin.elapsed_time(transfer._start), origin.elapsed_time(transfer.done_event))
    print(f"\nforward {forward[0]:.2f}-{forward[1]:.2f} ms, copy {copy[0]:.2f}-{copy[1]:.2f} ms "
          f"({host.nbytes / 1e6:.0f} MB, host issue {issue_ms:.2f} ms)")
    assert copy[0] < forward[1] and copy[1] > forward[0], "copy did not overlap the forward"
    assert torch.equal(lora.ctx.scales[:, 1].cpu(), torch.ones(len(layout.modules)))
    assert torch.equal(lora.pool[layout.max_pages:].cpu(), arena.buffer)
    arena.close()
