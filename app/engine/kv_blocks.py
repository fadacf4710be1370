"""KV block manager: which cache blocks each request owns. Pure Python; the device tensors live in the
model runner (app/engine/model_runner.py), which indexes them with the block tables kept here.

A request's token j lives in block `tables[request_id][j // block_size]` at offset `j % block_size`.
Block 0 is never handed out: padded rows of a captured decode graph write their K/V there.

Requests may share the full blocks of a prompt prefix (`share`: the n choices of one prompt prefill it
once). A shared block is never written again (each request writes only past the blocks it shares), and it
is counted once per table that holds it; it goes back to the free list when the last one releases it.
"""

from __future__ import annotations

from collections import Counter


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
        self.refs: dict[int, int] = {}  # block -> how many tables hold it

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
        for _ in range(need):
            block = self.free.pop()
            self.refs[block] = 1
            table.append(block)
        return table

    def share(self, request_id: str, source_id: str, num_blocks: int) -> list[int]:
        """Start `request_id`'s table (it has none) with the first num_blocks blocks of `source_id`'s, which
        hold the same tokens; returns the new table."""
        assert request_id not in self.tables, f"{request_id} already holds blocks"
        blocks = self.tables[source_id][:num_blocks]
        assert len(blocks) == num_blocks, f"{source_id} holds {len(blocks)} blocks, not {num_blocks}"
        for block in blocks:
            self.refs[block] += 1
        self.tables[request_id] = list(blocks)
        return self.tables[request_id]

    def release(self, request_id: str) -> None:
        for block in reversed(self.tables.pop(request_id, [])):
            self.refs[block] -= 1
            if not self.refs[block]:
                del self.refs[block]
                self.free.append(block)

    def check_invariants(self) -> None:
        owned = Counter(b for table in self.tables.values() for b in table)
        assert owned == Counter(self.refs), "a block's reference count is not the tables that hold it"
        assert all(len(table) == len(set(table)) for table in self.tables.values()), "a table holds a block twice"
        assert not set(owned) & set(self.free), "a block is both owned and free"
        assert 0 not in owned and 0 not in self.free, "the scratch block was handed out"
        assert len(owned) + len(self.free) == self.num_blocks - 1, "blocks leaked"
