"""Several choices of one API request (n, batch prompts) as engine requests, merged into one stream.

Choice `index = prompt * n + j` is its own engine request. The engine prefills the prompt once: the later
choices start from the first one's cached prompt blocks (app/engine/scheduler.py). With a seed, choice j samples
with seed + j, as vLLM does, so the n choices differ and each is reproducible.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from app.api.wire import ChoiceChunk
from app.engine.request import RequestOutput
from app.sampling.params import SamplingParams

if TYPE_CHECKING:  # the engine's modules are the replica's: the ingress merges chunks without them
    from app.engine.async_engine import AsyncEngine


def choice_params(params: SamplingParams, j: int) -> SamplingParams:
    return params if params.seed is None or j == 0 else replace(params, seed=params.seed + j)


async def generate_choices(engine: AsyncEngine, prompts: Sequence, adapter_id: str | None, params: SamplingParams,
                           n: int, request_id: str | None = None,
                           hint_id: str | None = None) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(choice index, output) as each choice streams. Every choice's first output (or error) comes before
    anything is yielded, so a request that one prompt makes invalid fails whole, before streaming. hint_id: the id
    of the router's hint for this request, if any (one hint per request: the first choice consumes it)."""
    request_id = request_id or uuid.uuid4().hex
    streams = [engine.generate(prompt, adapter_id, choice_params(params, j), f"{request_id}-{i * n + j}",
                               hint_id if i == j == 0 else None)
               for i, prompt in enumerate(prompts) for j in range(n)]
    if len(streams) == 1:  # the common case: no task, no merge queue between the engine and the caller
        async with contextlib.aclosing(streams[0]) as stream:
            async for output in stream:
                yield 0, output
        return
    pumps: list[asyncio.Task] = []
    try:
        firsts = await asyncio.gather(*(s.__anext__() for s in streams), return_exceptions=True)
        errors = [f for f in firsts if isinstance(f, BaseException)]
        if errors:
            raise errors[0]
        merged: asyncio.Queue = asyncio.Queue()
        for index, (stream, first) in enumerate(zip(streams, firsts)):
            yield index, first
            if not first.finished:
                pumps.append(asyncio.create_task(_pump(index, stream, merged)))
        for _ in range(len(pumps)):
            while True:
                item = await merged.get()
                if isinstance(item, BaseException):
                    raise item
                index, output = item
                yield index, output
                if output.finished:
                    break
    finally:
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
        for stream in streams:
            await stream.aclose()  # aborts a choice that has not finished


async def _pump(index: int, stream: AsyncIterator[RequestOutput], merged: asyncio.Queue) -> None:
    try:
        async for output in stream:
            merged.put_nowait((index, output))
    except Exception as e:  # noqa: BLE001 - handed to the consumer, which raises it
        merged.put_nowait(e)


def output_chunk(index: int, output: RequestOutput, replica: str = "") -> ChoiceChunk:
    """A choice's output as a replica sends it to the ingress (app/api/responses.py reads it)."""
    return ChoiceChunk(index=index, text=output.text, token_ids=tuple(output.token_ids),
                       finish_reason=output.finish_reason, prompt_tokens=output.prompt_tokens,
                       completion_tokens=output.completion_tokens, logprobs=tuple(output.logprobs or ()),
                       prompt_logprobs=output.prompt_logprobs, replica=replica)


def merge_chunks(chunks: Sequence[ChoiceChunk]) -> list[ChoiceChunk]:
    """One chunk per choice, in index order, from a whole stream of them."""
    by_index: dict[int, list[ChoiceChunk]] = {}
    for c in chunks:
        by_index.setdefault(c.index, []).append(c)
    return [_merged(by_index[i]) for i in sorted(by_index)]


def _merged(parts: list[ChoiceChunk]) -> ChoiceChunk:
    first, last = parts[0], parts[-1]
    return replace(first, text="".join(p.text for p in parts),
                   token_ids=tuple(t for p in parts for t in p.token_ids),
                   logprobs=tuple(e for p in parts for e in p.logprobs),
                   prompt_logprobs=next((p.prompt_logprobs for p in parts if p.prompt_logprobs), None),
                   finish_reason=last.finish_reason, completion_tokens=last.completion_tokens)
