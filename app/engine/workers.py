"""The other workers of a tensor-parallel engine (`tensor_parallel_size` > 1): one process per further device, each
holding its shard of the model (app/model/tensor_parallel.py), of every resident adapter and of the KV cache, and
running every forward the engine runs, in step with it.

The engine's own process is rank 0. It alone schedules, samples, and owns the adapter registry and residency. Before
each forward, `Workers.run` broadcasts a `Step` over a gloo group: the step's inputs (app/engine/step_inputs.py),
how the forward runs, and the adapter loads rank 0 began since the last step (slot, pages, the adapter's spec). Each
worker starts reading its shard of those adapters from their files on a thread (`ShardLoads`), writes each into the
same slot and pages of its own pool once read and at the latest before a step that uses the slot, and runs the
same forward; the all-reduces inside it make every rank's hidden states the whole ones. With overlapped steps, rank
0 broadcasts each sampling step's tokens on the device, and a worker takes the next step's pending inputs from them.
Warm-up steps and CUDA graph captures run in the same order on every rank (each rank's ModelRunner makes them at
start-up), so their collectives pair up.

Each worker reads adapters through a registry of its own over the same roots and node cache as rank 0's: a local
adapter from its folder, a remote one from the node's disk cache, which the node's processes share, so that rank 0's
download serves every rank (a worker fetches it again only if the cache evicted it meanwhile).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoConfig

from app.adapters.node_cache import NodeCache, default_directory
from app.adapters.registry import AdapterRegistry
from app.adapters.spec import AdapterSpec, StoredAdapter, read_adapter
from app.engine.config import EngineConfig
from app.engine.kv_blocks import BlockManager
from app.engine.model_runner import ModelRunner
from app.engine.step_inputs import StepInputs
from app.adapters.uris import is_remote
from app.model.architectures import check_supported
from app.model.attention import PagedKVCache
from app.adapters.targets import pool_shapes, target_shapes
from app.model.lora import LoRASlots
from app.model.fp8 import quantize_linears
from app.model.fp8_checkpoint import fp8_scheme
from app.model.tensor_parallel import ShardPlan, TensorParallel, check_tensor_parallel, load_shard
from prefetch.layout import PageLayout
from prefetch.threads import one_cpu_thread

# A collective inside a step that waits this long for a rank fails instead of hanging (a worker that died
# mid-step); the workers' wait for the next step has no such limit.
COLLECTIVE_TIMEOUT = timedelta(seconds=60)
IDLE_TIMEOUT = timedelta(days=365)


class WorkerLost(RuntimeError):
    """A tensor-parallel worker process ended: the engine cannot run another step."""


@dataclass(frozen=True)
class Load:
    """An adapter rank 0 began to load into `slot`, `pages` of its pool: the workers write their shards of it there."""

    slot: int
    pages: tuple[int, ...]
    spec: AdapterSpec


@dataclass(frozen=True)
class Step:
    """What rank 0 sends before each forward; inputs None with stop: the engine shuts down."""

    inputs: StepInputs | None
    logits_all: bool = False
    extra_rows: tuple[int, ...] = ()
    loads: tuple[Load, ...] = ()
    stop: bool = False


@dataclass(frozen=True)
class Sizes:
    """The pools rank 0 sized after its weights loaded; every rank allocates the same."""

    num_pages: int
    num_slots: int
    num_blocks: int
    max_step_tokens: int


def check_tensor_parallel_config(config: EngineConfig, model_config) -> None:
    """Refuses, by name, a tensor_parallel_size this model cannot be served with."""
    if config.tensor_parallel_size > 1:
        check_tensor_parallel(model_config, config.tensor_parallel_size)


def adapter_registry(config: EngineConfig, model_config) -> AdapterRegistry:
    """The registry an engine's process reads adapters through: rank 0's, which also validates registrations, and
    each worker's, for its shard reads. Adapters are checked against the whole model's shapes, not a shard's."""
    remote = any(is_remote(root) for root in config.adapter_roots)
    cache = NodeCache(config.adapter_cache_dir or default_directory(), config.adapter_cache_bytes) if remote else None
    return AdapterRegistry(config.adapter_roots, model_config, config.max_rank, config.max_adapter_bytes,
                           config.target_modules, cache=cache, fetch_workers=config.adapter_fetch_workers,
                           fetch_timeout_s=config.adapter_fetch_timeout_s)


def rank_device(config: EngineConfig, rank: int) -> torch.device:
    """Rank r's device: cuda:r on a GPU host (the replica's devices, as CUDA_VISIBLE_DEVICES lists them), else the
    CPU."""
    device = config.torch_device()
    return torch.device("cuda", rank) if device.type == "cuda" else device


def backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


@dataclass(frozen=True)
class WorkerProcess:
    rank: int
    popen: subprocess.Popen

    @property
    def name(self) -> str:
        return f"tensor-parallel-worker-{self.rank}"

    def is_alive(self) -> bool:
        return self.popen.poll() is None


@dataclass
class Workers:
    """Rank 0's handle on ranks 1..size-1: started with the engine, stopped with it."""

    config: EngineConfig
    processes: list = field(default_factory=list)
    control: dist.ProcessGroup | None = None
    _loads: list[Load] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def start(cls, config: EngineConfig) -> Workers:
        """Starts the worker processes and joins them in one process group (this process as rank 0). Each is a
        fresh interpreter (`python -m app.engine.workers`), not a multiprocessing child: the engine may itself run
        in a daemonic process (app/engine/process.py), which multiprocessing lets have no children."""
        size, device = config.tensor_parallel_size, rank_device(config, 0)
        if dist.is_initialized():  # torch.distributed has one default process group per process
            raise RuntimeError("this process already runs a tensor-parallel engine (or another process group); "
                               "a process holds one")
        folder = Path(tempfile.mkdtemp(prefix="lora-tp-"))
        (folder / "config.json").write_text(json.dumps(dataclasses.asdict(config)))
        init = f"file://{folder / 'init'}"
        workers = cls(config)
        for rank in range(1, size):
            workers.processes.append(WorkerProcess(rank, subprocess.Popen(
                [sys.executable, "-m", "app.engine.workers", str(rank), init, str(folder / "config.json")])))
        dist.init_process_group(backend(device), init_method=init, rank=0, world_size=size,
                                timeout=COLLECTIVE_TIMEOUT)
        workers.control = _control_group(device)
        return workers

    def send_sizes(self, sizes: Sizes) -> None:
        dist.broadcast_object_list([sizes], src=0, group=self.control)

    def load(self, slot: int, pages, spec: AdapterSpec) -> None:
        """A load into `slot` began on rank 0 (the engine thread): sent with the next step, so that every worker
        reads its shard while rank 0 reads its own."""
        spec = dataclasses.replace(spec, **{name: dict(getattr(spec, name)) for name in  # read-only views: unpicklable
                                            ("module_ranks", "module_scales", "module_shapes")})
        with self._lock:
            self._loads.append(Load(slot, tuple(pages), spec))

    def run(self, inputs: StepInputs, logits_all: bool, extra_rows) -> None:
        for process in self.processes:
            if not process.is_alive():
                raise WorkerLost(f"{process.name} ended (exit code {process.popen.returncode}); the replica's "
                                 "engine stops")
        with self._lock:
            loads, self._loads = tuple(self._loads), []
        dist.broadcast_object_list([Step(inputs, logits_all, tuple(extra_rows), loads)], src=0, group=self.control)

    def share_tokens(self, tokens: torch.Tensor) -> None:
        """A step's sampled tokens [rows], on the device, to every worker (one broadcast on the step's stream): a step
        launched before this one is read back takes its decode rows' inputs from them on every rank."""
        dist.broadcast(tokens, src=0)

    def stop(self) -> None:
        if not self.processes:
            return
        clean = all(process.is_alive() for process in self.processes)
        if clean:
            dist.broadcast_object_list([Step(None, stop=True)], src=0, group=self.control)
            _end_group(clean)  # while the workers end theirs
        for process in self.processes:
            try:
                process.popen.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.popen.kill()
                process.popen.wait()
        self.processes = []
        if not clean:
            _end_group(clean)


def _end_group(clean: bool) -> None:
    """Ends this rank's process groups. NCCL's orderly teardown is collective: every rank's destroy waits for the
    others', so the ranks run it together, and where one is gone it would wait forever. Abort is not collective:
    it frees this rank's communicators at once, for a group that lost a rank or a step."""
    if clean:
        dist.destroy_process_group()
    else:
        dist.distributed_c10d._abort_process_group()


def _control_group(device: torch.device) -> dist.ProcessGroup:
    """The group steps travel over: gloo (pickled objects are CPU tensors), and no timeout a replica idle for hours
    could reach; a rank that ends closes its connections, which fails a receive at once. On GPUs one all-reduce
    first sets NCCL's communicator up, which must not happen inside a CUDA graph capture."""
    if device.type == "cuda":
        dist.all_reduce(torch.zeros(1, device=device))
    return dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)


def shard_parts(plan: ShardPlan, parts):
    """An adapter's flat parts (StoredAdapter.flat_parts: A [r * in], B [out * r]) as this rank holds them."""
    sharded = {}
    for module, (a, b, rank, scale) in parts.items():
        n_in, n_out = plan.global_shapes[module]
        a, b = plan.shard_adapter(module, a.view(rank, n_in), b.view(n_out, rank))
        sharded[module] = (a.contiguous().flatten(), b.contiguous().flatten(), rank, scale)
    return sharded


class ShardLoads:
    """A worker's adapter loads. Each one's read (the file, this rank's shard of it, packed into host pages) runs on
    a thread from the step that brings it, as rank 0's own read does; its copy into the slot goes on the step
    stream at a step boundary once the read is done, and at the latest before the first step that uses the slot.
    Steps launched earlier that read the slot's previous adapter come first in stream order. A later load into
    the same slot or pages replaces one not yet written.

    The host pages are pageable, not pinned: pinning memory makes the CUDA driver wait for the device's work and
    its peers', and rank 0 runs ahead of a worker, so that work may include a collective waiting for this worker's
    next launch, which the wait blocks. Copied from pageable memory, a page returns once staged for its copy."""

    def __init__(self, plan: ShardPlan, layout: PageLayout, lora: LoRASlots, device: torch.device,
                 dtype: torch.dtype, read: Callable[[AdapterSpec], StoredAdapter] = read_adapter):
        self.plan, self.layout, self.lora, self.device, self.dtype = plan, layout, lora, device, dtype
        self.read = read  # the worker's registry's: a remote adapter through the node cache
        self.reads = ThreadPoolExecutor(2, thread_name_prefix="shard-read", initializer=one_cpu_thread)
        self.pending: dict[int, tuple[Load, Future]] = {}  # slot -> its newest load not yet written
        self.failed: dict[int, Exception] = {}  # slot -> why its newest load could not be read

    def begin(self, load: Load) -> None:
        """A load rank 0 began. Rank 0 gave its slot and pages to it only after nothing used them: a load not yet
        written into them is void."""
        claimed = set(load.pages)
        for slot, (earlier, _) in list(self.pending.items()):
            if slot == load.slot or claimed & set(earlier.pages):
                del self.pending[slot]
        self.failed.pop(load.slot, None)
        self.pending[load.slot] = (load, self.reads.submit(self._read, load))

    def _read(self, load: Load) -> tuple[list[torch.Tensor], torch.Tensor]:
        pages = [torch.empty(self.layout.page_numel, dtype=self.dtype) for _ in load.pages]
        scales = self.layout.pack(shard_parts(self.plan, self.read(load.spec).flat_parts()), pages)
        return pages, scales

    def write(self, needed: set[int]) -> None:
        """Write every load whose read is done, waiting for those of the `needed` slots (the next step's)."""
        for slot, (load, future) in list(self.pending.items()):
            if slot not in needed and not future.done():
                continue
            del self.pending[slot]
            try:
                pages, scales = future.result()
            except Exception as e:  # rank 0 fails its own load the same way and admits nothing onto the slot
                self.failed[slot] = e
                continue
            self.lora.write_slot(slot, list(load.pages), pages, scales.to(self.device), load.spec.rank)
        for slot in needed & self.failed.keys():
            raise RuntimeError(f"slot {slot}: this worker could not read its shard of the adapter rank 0 loaded "
                               f"there: {self.failed[slot]}")


def worker_main(rank: int, init: str, config: EngineConfig) -> None:
    """A worker process: joins the group, loads its shard, then runs what rank 0 sends until it stops."""
    device = rank_device(config, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    size = config.tensor_parallel_size
    dist.init_process_group(backend(device), init_method=init, rank=rank, world_size=size,
                            timeout=COLLECTIVE_TIMEOUT)
    control = _control_group(device)
    stopped = False  # by rank 0, which ends its groups with this worker's
    registry = None
    try:
        dtype = config.torch_dtype(device)
        model_config = AutoConfig.from_pretrained(config.base_model)
        registry = adapter_registry(config, model_config)
        arch = check_supported(model_config)
        model, plan = load_shard(Path(config.base_model), model_config, arch, TensorParallel(rank, size), dtype, device)
        if config.quantization == "fp8" and fp8_scheme(model_config)[0] is None:  # as rank 0's (app/engine/builder.py)
            quantize_linears(model, arch.target_shapes(model.config))
            if device.type == "cuda":
                torch.cuda.empty_cache()
        sizes = _receive(control)
        layout = PageLayout(pool_shapes(target_shapes(model.config), config.target_modules), config.max_rank,
                            config.adapter_page_rows)
        lora = LoRASlots(model, layout, sizes.num_pages, sizes.num_slots, t_cap=sizes.max_step_tokens)
        cache = PagedKVCache.for_model(model.config, sizes.num_blocks, config.block_size, dtype, device)
        runner = ModelRunner(model, lora, BlockManager(sizes.num_blocks, config.block_size), cache,
                             config.max_batch_size, model.config.max_position_embeddings,
                             use_graphs=config.cuda_graphs, compile_decode=config.compile_decode,
                             max_graph_tokens=config.max_graph_tokens)
        loads = ShardLoads(plan, layout, lora, device, dtype, registry.read)
        previous = None  # the last step's sampled tokens, as rank 0 shares them
        while True:
            step = _receive(control)
            if step.stop:
                stopped = True
                break
            for load in step.loads:
                loads.begin(load)
            loads.write({slot for slot in step.inputs.token_slots if slot >= 0})
            runner.run(step.inputs, step.logits_all, step.extra_rows, previous)
            if config.overlap_steps and not step.logits_all and step.inputs.logits_index:  # Workers.share_tokens
                previous = torch.empty(len(step.inputs.logits_index), dtype=torch.long, device=device)
                dist.broadcast(previous, src=0)
    finally:
        if registry is not None:
            registry.shutdown()
        _end_group(stopped)


def main(argv: list[str]) -> None:
    """python -m app.engine.workers RANK INIT_METHOD CONFIG_JSON (started by Workers.start)."""
    rank, init, config_file = int(argv[0]), argv[1], Path(argv[2])
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s tp-worker-{rank} %(levelname)s %(message)s")
    worker_main(rank, init, EngineConfig(**json.loads(config_file.read_text())))


def _receive(group):
    message = [None]
    dist.broadcast_object_list(message, src=0, group=group)
    return message[0]


if __name__ == "__main__":
    main(sys.argv[1:])
