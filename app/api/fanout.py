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

from app.engine.async_engine import AsyncEngine
from app.engine.request import RequestOutput
from app.sampling.params import SamplingParams


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


def output_chunk(index: int, output: RequestOutput) -> dict:
    """A choice's output as the replica sends it to the ingress (app/api/responses.py reads it)."""
    return {"index": index, "text": output.text, "token_ids": list(output.token_ids),
            "logprobs": output.logprobs, "prompt_logprobs": output.prompt_logprobs,
            "finish_reason": output.finish_reason, "prompt_tokens": output.prompt_tokens,
            "completion_tokens": output.completion_tokens}


def merge_chunks(chunks: Sequence[dict]) -> list[dict]:
    """One chunk per choice, in index order, from a whole stream of them."""
    by_index: dict[int, dict] = {}
    for c in chunks:
        prev = by_index.get(c["index"])
        if prev is None:
            by_index[c["index"]] = dict(c, logprobs=tuple(c["logprobs"] or ()))
            continue
        prev.update(text=prev["text"] + c["text"], token_ids=prev["token_ids"] + c["token_ids"],
                    logprobs=prev["logprobs"] + tuple(c["logprobs"] or ()),
                    prompt_logprobs=prev["prompt_logprobs"] or c["prompt_logprobs"],
                    finish_reason=c["finish_reason"], completion_tokens=c["completion_tokens"])
    return [by_index[i] for i in sorted(by_index)]
