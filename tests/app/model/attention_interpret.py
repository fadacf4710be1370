"""Runs the Triton decode kernel in Triton's CPU interpreter against `paged_decode_reference`, with sliding windows
and soft-capping (launched by test_attention_windows.py in a process with TRITON_INTERPRET=1). float16: the
interpreter computes bfloat16 wrong."""

import torch

import lora_interpret  # noqa: F401  (patches the interpreter for NumPy >= 2.4)
from app.model.kernels.attention import decode_workspace, paged_decode_attention, paged_decode_reference
from test_attention_kernels import make_paged

TOLERANCE = 2e-3
CASES = [
    # (lengths, heads, kv heads, block_size, window, softcap, num_splits)
    ([5, 40, 0, 100, 300], 8, 2, 16, None, None, 1),  # neither: the kernel as before
    ([5, 40, 0, 100, 300], 8, 2, 16, 1, None, 1),
    ([5, 40, 0, 100, 300], 8, 2, 16, 7, None, 3),  # windows that start mid-block and mid-tile
    ([5, 40, 0, 100, 300], 8, 2, 16, 70, None, 4),
    ([64, 65, 129, 1], 4, 4, 32, 64, None, 2),
    ([5, 40, 0, 100, 300], 8, 2, 16, None, 2.0, 3),
    ([5, 40, 0, 100, 300], 8, 2, 16, 19, 1.5, 2),
]


def main() -> None:
    for i, (lengths, heads, kv_heads, block_size, window, softcap, splits) in enumerate(CASES):
        q, k, v, tables, lens = make_paged(lengths, heads, kv_heads, 64, block_size, torch.float16, seed=i)
        workspace = decode_workspace(q, kv_heads, tables, block_size, num_splits=splits)
        got = paged_decode_attention(q, k, v, tables, lens, 0.125, workspace=workspace, window=window,
                                     softcap=softcap)
        expected = paged_decode_reference(q.float(), k.float(), v.float(), tables, lens, 0.125, window, softcap)
        error = (got.float() - expected).abs().max().item()
        assert error <= TOLERANCE, f"case {i}: max error {error}"
        print(f"case {i} ok ({error:.1e})")
    print("all interpreter cases match")


if __name__ == "__main__":
    main()
