"""Runs the Triton decode kernel in Triton's CPU interpreter against `paged_decode_reference`, with sliding windows
and soft-capping, at head sizes 64 and 256 (launched by test_attention_windows.py in a process with
TRITON_INTERPRET=1). float16: the interpreter computes bfloat16 wrong."""

import torch

import lora_interpret  # noqa: F401  (patches the interpreter for NumPy >= 2.4)
from app.model.kernels.attention import decode_workspace, paged_decode_attention, paged_decode_reference
from test_attention_kernels import make_paged

TOLERANCE = 2e-3
CASES = [
    # (lengths, heads, kv heads, head_dim, block_size, window, softcap, num_splits)
    ([5, 40, 0, 100, 300], 8, 2, 64, 16, None, None, 1),  # neither: the kernel as before
    ([5, 40, 0, 100, 300], 8, 2, 64, 16, 1, None, 1),
    ([5, 40, 0, 100, 300], 8, 2, 64, 16, 7, None, 3),  # windows that start mid-block and mid-tile
    ([5, 40, 0, 100, 300], 8, 2, 64, 16, 70, None, 4),
    ([64, 65, 129, 1], 4, 4, 64, 32, 64, None, 2),
    ([5, 40, 0, 100, 300], 8, 2, 64, 16, None, 2.0, 3),
    ([5, 40, 0, 100, 300], 8, 2, 64, 16, 19, 1.5, 2),
    # head_dim 256 (Gemma 2's groups of 2): 32-token tiles; the split merge over 256 columns
    ([5, 40, 0, 100, 300], 4, 2, 256, 16, None, None, 1),
    ([5, 40, 0, 100, 300], 4, 2, 256, 16, 19, 1.5, 3),
    ([64, 65, 129, 1], 4, 4, 256, 32, 37, None, 2),
    ([1100, 3, 0], 4, 2, 256, 16, 1000, 2.0, 1),  # one long split: 64-token tiles
]


def main() -> None:
    for i, (lengths, heads, kv_heads, head_dim, block_size, window, softcap, splits) in enumerate(CASES):
        q, k, v, tables, lens = make_paged(lengths, heads, kv_heads, head_dim, block_size, torch.float16, seed=i)
        workspace = decode_workspace(q, kv_heads, tables, block_size, num_splits=splits)
        scale = head_dim ** -0.5
        got = paged_decode_attention(q, k, v, tables, lens, scale, workspace=workspace, window=window,
                                     softcap=softcap)
        expected = paged_decode_reference(q.float(), k.float(), v.float(), tables, lens, scale, window, softcap)
        error = (got.float() - expected).abs().max().item()
        assert error <= TOLERANCE, f"case {i}: max error {error}"
        print(f"case {i} ok ({error:.1e})")
    print("all interpreter cases match")


if __name__ == "__main__":
    main()
