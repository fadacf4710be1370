"""An engine whose adapters come from a remote store (a local HTTP file server) through its node cache."""

import shutil
import threading
import time
from pathlib import Path

import store_helpers
from app.engine.engine import LLMEngine
from engine_helpers import engine_config, greedy, run_all

file_server = store_helpers.file_server  # the fixture, under its name


def test_a_queued_adapter_still_downloading_holds_no_read_worker(file_server, tmp_path, demo_dir, manifest,
                                                                 adapter_names):
    """One host read worker. A request whose adapter is still downloading waits for the download without a read
    of it under way, so a request whose adapter is already on the node is read, loaded and served meanwhile."""
    shutil.copytree(Path(demo_dir) / "adapters", tmp_path / "www" / "adapters")
    root = f"{file_server.url}/adapters"
    engine = LLMEngine(engine_config(demo_dir, adapter_roots=(root,), adapter_cache_dir=str(tmp_path / "cache"),
                                     disk_workers=1))
    try:
        slow, ready = adapter_names[:2]
        for name in (slow, ready):
            engine.register_adapter(name, f"{root}/{name}")
        engine.registry.fetch_ahead([ready])
        deadline = time.monotonic() + 30
        while not engine.registry.on_node(ready):
            assert time.monotonic() < deadline, "the fetch ahead did not finish"
            time.sleep(0.01)
        arrived, download_all = threading.Event(), engine.registry.store.download_all

        def held_back(files, **kwargs):  # the slow adapter's bytes take until `arrived` is set
            if any(f"/{slow}/" in obj.uri for obj, _ in files):
                assert arrived.wait(60)
            return download_all(files, **kwargs)

        engine.registry.store.download_all = held_back
        waiting = engine.add_request(manifest["prompts"][0], slow, greedy(3))
        served = engine.add_request(manifest["prompts"][1], ready, greedy(3))
        tokens: dict[str, list[int]] = {}
        deadline = time.monotonic() + 30
        while served.finish_reason is None:
            assert time.monotonic() < deadline, "the adapter on the node waited behind the download"
            for output in engine.step():
                tokens.setdefault(output.request_id, []).extend(output.token_ids)
        assert engine.registry.is_fetching(slow) and not engine.residency.host_cache.has(slow)
        assert waiting.request_id not in tokens and len(tokens[served.request_id]) == 3
        arrived.set()
        assert len(run_all(engine, check=True)[waiting.request_id]) == 3
        assert not engine.registry.is_fetching(slow)
    finally:
        arrived.set()
        engine.shutdown()
