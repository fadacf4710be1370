"""one_cpu_thread: a helper thread's large torch CPU ops run on the helper alone, with no OpenMP team of its own
whose threads would outlive them (prefetch/threads.py says what such teams cost the engine's steps)."""

import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from prefetch.copier import ThreadCopier
from prefetch.host_cache import HostAdapter
from prefetch.threads import one_cpu_thread

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in Linux's /proc")


@pytest.fixture(autouse=True)
def two_threads():
    """torch on 2 threads (the suite runs on 1, tests/conftest.py), as an engine on a multi-core host runs."""
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(saved)


def threads() -> set[str]:
    return set(os.listdir("/proc/self/task"))


def threads_born_in_a_helper(initializer) -> set[str]:
    """The threads that start while a helper thread copies 32 MB (a copy that torch splits over its threads)."""
    src = torch.arange(1 << 23, dtype=torch.float32)
    dst = torch.empty_like(src)
    before = threads()
    with ThreadPoolExecutor(1, initializer=initializer) as helper:
        helper.submit(dst.copy_, src).result()
        born = threads() - before
    assert torch.equal(dst, src)
    return born


def test_a_helper_thread_copies_without_a_team_of_its_own():
    assert len(threads_born_in_a_helper(None)) == 2  # the helper and its team's other thread
    assert len(threads_born_in_a_helper(one_cpu_thread)) == 1  # the helper alone


def test_the_engine_thread_keeps_its_thread_count():
    with ThreadPoolExecutor(1, initializer=one_cpu_thread) as helper:
        assert helper.submit(torch.get_num_threads).result() == 1
    assert torch.get_num_threads() == 2


def test_the_cpu_copier_writes_slots_on_one_torch_thread():
    threads_seen = []
    copier = ThreadCopier(lambda *args: threads_seen.append(torch.get_num_threads()))
    host = HostAdapter("a", (), (), torch.ones(1), 0.0, 8, 0)
    copier.start(0, [], host).wait()
    copier.shutdown()
    assert threads_seen == [1]
