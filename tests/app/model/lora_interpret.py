"""Runs the Triton LoRA kernels in Triton's CPU interpreter against `lora_reference` (launched by
test_lora_kernels.py in a process with TRITON_INTERPRET=1, so no GPU is needed to check kernel changes)."""

import numpy as np
import torch
import triton.runtime.interpreter as interpreter

from app.model.kernels.lora import DECODE, PREFILL, KernelConfig
from test_lora_kernels import run_group_kernels, run_kernels

_patch_lang_tensor = interpreter._patch_lang_tensor


def _patch_index(tensor, scope):
    """The interpreter holds scalars as 1-element arrays; NumPy >= 2.4 refuses int() of those (loop bounds)."""
    _patch_lang_tensor(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))


interpreter._patch_lang_tensor = _patch_index

CASES = [
    # (max_rank, page_rows, ranks, segments, t_cap, s_cap, config)
    (16, 4, (4, 7, 16), [(1, 3), (1, -1), (1, 60), (1, 9)], 8, 6, DECODE),  # decode rows, odd rank 7
    (64, 8, (8, 33, 64), [(1, 5), (1, 6), (1, 7)], 4, 4, DECODE),  # rank 33 spans 5 pages of 8 rows
    (16, 4, (8, 16), [(40, 2), (7, -1), (70, 11), (0, 4), (3, 2)], 128, 8, PREFILL),  # M tiles over 4 programs
    (16, 16, (4, 16), [(20, 1), (5, 2)], 32, 4, KernelConfig(4, 16, 16, 4, m_programs=2)),  # one page per adapter
]

GROUP_CASES = [
    # (member widths, columns no member owns after the first, segments, t_cap, s_cap, config)
    ((24, 8, 8), 0, [(1, 0), (1, -1), (1, 60), (1, 9)], 8, 6, DECODE),  # q, k, v in decode; slot 0 skips v
    ((24, 8), 8, [(40, 2), (7, -1), (70, 0), (3, 2)], 128, 8, PREFILL),  # q and v around k, prefill tiles
    ((300, 300), 0, [(2, 5), (3, 0)], 8, 4, KernelConfig(4, 16, 64, 4)),  # gate and up: 5 tiles each
]


def main() -> None:
    for i, (max_rank, page_rows, ranks, segments, t_cap, s_cap, config) in enumerate(CASES):
        run_kernels(torch.float32, 40, 24, max_rank, segments, t_cap, s_cap, seed=i, config=config, device="cpu",
                    page_rows=page_rows, ranks=ranks)
        print(f"case {i} ok")
    for i, (widths, gap, segments, t_cap, s_cap, config) in enumerate(GROUP_CASES):
        run_group_kernels(torch.float32, 40, widths, gap, 16, segments, t_cap, s_cap, seed=i, config=config,
                          device="cpu", ranks=(4, 7, 16))
        print(f"group case {i} ok")
    print("all interpreter cases match")


if __name__ == "__main__":
    main()
