"""KV block manager: which cache blocks each request owns. Pure Python; the device tensors live in the
model runner (app/model_runner.py), which indexes them with the block tables kept here.

A request's token j lives in block `tables[request_id][j // block_size]` at offset `j % block_size`.
Block 0 is never handed out: padded rows of a captured decode graph write their K/V there.
"""

from __future__ import annotations


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 2:
            raise ValueError(f"the KV cache needs at least 2 blocks (one is scratch), got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free: list[int] = list(range(num_blocks - 1, 0, -1))  # pop() hands out low ids first
        self.tables: dict[str, list[int]] = {}  # request_id -> its blocks, in token order

    @property
    def capacity_tokens(self) -> int:
        """Tokens one request could hold if it had the whole cache."""
        return (self.num_blocks - 1) * self.block_size

    def free_count(self) -> int:
        return len(self.free)

    def needed(self, request_id: str, tokens: int) -> int:
        """Blocks that must be added so `request_id` can hold `tokens` tokens."""
        have = len(self.tables.get(request_id, ()))
        return max(0, blocks_for(tokens, self.block_size) - have)

    def can_allocate(self, request_id: str, tokens: int, reserve: int = 0) -> bool:
        return self.needed(request_id, tokens) + reserve <= len(self.free)

    def allocate(self, request_id: str, tokens: int) -> list[int]:
        """Grow (or create) `request_id`'s table to hold `tokens` tokens; returns the whole table."""
        need = self.needed(request_id, tokens)
        assert need <= len(self.free), f"allocate {need} blocks with {len(self.free)} free"
        table = self.tables.setdefault(request_id, [])
        table.extend(self.free.pop() for _ in range(need))
        return table

    def release(self, request_id: str) -> None:
        self.free.extend(reversed(self.tables.pop(request_id, [])))

    def check_invariants(self) -> None:
        owned = [b for table in self.tables.values() for b in table]
        assert len(owned) == len(set(owned)), "a block is owned twice"
        assert not set(owned) & set(self.free), "a block is both owned and free"
        assert 0 not in owned and 0 not in self.free, "the scratch block was handed out"
        assert len(owned) + len(self.free) == self.num_blocks - 1, "blocks leaked"
