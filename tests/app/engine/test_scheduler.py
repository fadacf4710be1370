"""The KV block manager and the step scheduler as state machines (pure Python, no model)."""

from dataclasses import dataclass, field

import pytest

from app.engine.kv_blocks import BlockManager
from app.engine.scheduler import Scheduler


@dataclass(eq=False)
class Seq:
    request_id: str
    prompt: int
    output: list = field(default_factory=list)
    num_cached: int = 0
    slot: int | None = None
    has_all_tokens: bool = False

    @property
    def num_tokens(self) -> int:
        return self.prompt + len(self.output)


def make(num_blocks=9, block_size=4, batch=4, budget=64, acquire=lambda r: True):
    released = []
    sched = Scheduler(BlockManager(num_blocks, block_size), batch, budget, acquire, released.append)
    return sched, released


def run(sched, plan):
    """What the engine does after a step: cache the chunks, append a token to each finished chunk."""
    for chunk in plan.chunks:
        chunk.request.num_cached = chunk.end
        if chunk.samples:
            chunk.request.output.append(0)


def test_block_manager_allocates_grows_and_releases():
    blocks = BlockManager(5, 4)
    assert blocks.capacity_tokens == 16 and blocks.free_count() == 4
    assert blocks.allocate("a", 5) == [1, 2] and blocks.needed("a", 8) == 0 and blocks.needed("a", 9) == 1
    assert not blocks.can_allocate("b", 9) and blocks.can_allocate("b", 8)
    blocks.allocate("a", 9)
    blocks.check_invariants()
    blocks.release("a")
    assert blocks.free_count() == 4 and not blocks.tables
    blocks.check_invariants()
    with pytest.raises(ValueError, match="at least 2"):
        BlockManager(1, 4)


def test_prefill_then_decode_steps():
    sched, _ = make()
    a, b = Seq("a", 6), Seq("b", 3)
    sched.add(a), sched.add(b)
    plan = sched.schedule()
    assert [(c.request.request_id, c.start, c.length, c.samples) for c in plan.prefill] == [("a", 0, 6, True),
                                                                                             ("b", 0, 3, True)]
    assert not plan.decode and sched.blocks.tables == {"a": [1, 2], "b": [3]}
    run(sched, plan)
    plan = sched.schedule()
    assert plan.is_decode_only and [(c.request.request_id, c.start) for c in plan.decode] == [("a", 6), ("b", 3)]
    assert sched.blocks.tables == {"a": [1, 2], "b": [3]}  # a's 7 and b's 4 tokens fit the blocks they have
    sched.check_invariants()


def test_long_prompt_is_chunked_and_decode_rows_keep_running():
    sched, _ = make(num_blocks=17, budget=8)
    short = Seq("short", 3)
    sched.add(short)
    run(sched, sched.schedule())
    long = Seq("long", 20)
    sched.add(long)
    fed = []
    for _ in range(3):
        plan = sched.schedule()
        assert [c.request for c in plan.decode] == [short], "the decode row froze during the long prefill"
        fed += [(c.start, c.length, c.samples) for c in plan.prefill]
        run(sched, plan)
        sched.check_invariants()
    assert fed == [(0, 8, False), (8, 8, False), (16, 4, True)]
    assert long.output == [0]


def test_admission_waits_for_kv_and_keeps_order():
    sched, _ = make(num_blocks=5, block_size=4)  # 16 tokens
    big, small = Seq("big", 12), Seq("small", 2)
    sched.add(big)
    run(sched, sched.schedule())
    other = Seq("other", 8)
    sched.add(other), sched.add(small)
    plan = sched.schedule()
    assert [c.request for c in plan.prefill] == [], "admitted past the KV reserve, or small overtook other"
    assert sched.waiting == [other, small]
    sched.remove(big)
    plan = sched.schedule()
    assert [c.request for c in plan.prefill] == [other, small]
    sched.check_invariants()


def test_decode_out_of_blocks_preempts_the_youngest():
    sched, released = make(num_blocks=4, block_size=4, budget=64)  # 3 usable blocks, 12 tokens
    old, young = Seq("old", 3), Seq("young", 3)
    sched.add(old), sched.add(young)
    run(sched, sched.schedule())  # both prefill: a block each, 4 tokens each after sampling
    run(sched, sched.schedule())  # both decode within their blocks: 5 tokens each
    assert sched.running == [old, young] and sched.blocks.free_count() == 1
    plan = sched.schedule()  # both need a 2nd block for their 5th token; one is free: young gives way
    assert [c.request for c in plan.decode] == [old] and plan.preempted == [young]
    assert young.num_cached == 0 and sched.waiting == [young] and released == [young]
    assert sched.preemptions == 1
    sched.check_invariants()


def test_a_request_alone_preempts_itself_only_when_nothing_else_can_go():
    sched, _ = make(num_blocks=3, block_size=4, budget=64)  # 8 tokens
    a = Seq("a", 8)
    sched.add(a)
    run(sched, sched.schedule())
    plan = sched.schedule()  # a needs a 3rd block for token 9: none exists
    assert plan.preempted == [a] and plan.is_empty


def test_deferred_adapter_lets_later_requests_run():
    ready = {"b"}
    sched, _ = make(acquire=lambda r: r.request_id in ready)
    a, b = Seq("a", 3), Seq("b", 3)
    sched.add(a), sched.add(b)
    plan = sched.schedule()
    assert [c.request for c in plan.prefill] == [b] and sched.waiting == [a]


def test_requests_stuck_mid_prefill_with_a_full_cache_do_not_wait_on_each_other():
    sched, _ = make(num_blocks=5, block_size=4, budget=4)  # 4 usable blocks, 16 tokens
    old, young = Seq("old", 12), Seq("young", 12)
    sched.running = [old, young]  # both mid-prefill, holding every block between them
    sched.blocks.allocate("old", 8), sched.blocks.allocate("young", 8)
    old.num_cached = young.num_cached = 8
    plan = sched.schedule()
    assert plan.preempted == [young] and [(c.request, c.start, c.length) for c in plan.prefill] == [(old, 8, 4)]
    sched.check_invariants()
    for _ in range(20):  # both finish
        run(sched, sched.schedule())
        for r in list(sched.running):
            if len(r.output) >= 2:
                sched.remove(r)
        sched.check_invariants()
    assert not sched.has_work() and old.output and young.output
