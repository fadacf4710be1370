"""Ours beside vLLM on the offline throughput workload: one row per (max concurrent sequences, adapters) from
bench/engine/throughput.py's and bench/peers/vllm.py's results, printed as a table and written to bench/results.

    python -m bench.peers.compare bench/results/h100-x1-throughput-*-c*-a*.json   # as vllm_compare.sh runs it

Where one engine has several results for a row, the latest counts. The summary takes the device prefix its results
share (h100-x1-throughput-vs-vllm.json), and the device, torch and commit they all record, so that a table made here
of a GPU machine's results is named after that machine; results of several machines give a table under this
machine's prefix. This module does not import vLLM.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.common import RESULTS, write_result

OURS, PEER = "ours", "vllm"


@dataclass(frozen=True)
class Row:
    max_concurrent: int
    adapters: int
    ours_tok_s: float | None
    vllm_tok_s: float | None
    ours_file: str | None
    vllm_file: str | None
    is_partial: bool  # either run stopped before every request finished

    @property
    def ratio(self) -> float | None:
        """Ours' output tokens/s over vLLM's: above 1, ours is faster."""
        return None if not (self.ours_tok_s and self.vllm_tok_s) else self.ours_tok_s / self.vllm_tok_s


def rows(paths: list[Path]) -> list[Row]:
    latest: dict[tuple[int, int, str], tuple[dict, Path]] = {}  # (concurrency, adapters, engine) -> newest result
    for path in paths:
        record = json.loads(path.read_text())
        if record.get("benchmark") != "throughput" or record.get("engine") not in (OURS, PEER):
            continue
        key = (record["args"]["max_batch_size"], record["args"]["adapters"], record["engine"])
        if key not in latest or record["timestamp"] >= latest[key][0]["timestamp"]:
            latest[key] = (record, path)
    table = []
    for concurrency, adapters in sorted({(c, a) for c, a, _ in latest}):
        ours, peer = latest.get((concurrency, adapters, OURS)), latest.get((concurrency, adapters, PEER))
        table.append(Row(concurrency, adapters, _tok_s(ours), _tok_s(peer), ours and ours[1].name,
                         peer and peer[1].name, any(e and e[0]["result"]["partial"] for e in (ours, peer))))
    return table


def _shared_provenance(paths: list[Path]) -> dict:
    """The device, torch and commit that every result names alike: a table made on another machine is theirs."""
    records = [json.loads(path.read_text()) for path in paths]
    return {key: values.pop() for key in ("device", "torch", "git_commit")
            if len(values := {r.get(key) for r in records}) == 1 and None not in values}


def _tok_s(entry: tuple[dict, Path] | None) -> float | None:
    return None if entry is None else entry[0]["result"]["output_tokens_per_s"]


def markdown(table: list[Row]) -> str:
    def cell(value: float | None, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    lines = ["| max concurrent sequences | adapters | ours tok/s | vLLM tok/s | ours / vLLM |",
             "| --- | --- | --- | --- | --- |"]
    for r in table:
        lines.append(f"| {r.max_concurrent} | {r.adapters or 'base'} | {cell(r.ours_tok_s, ',.0f')} | "
                     f"{cell(r.vllm_tok_s, ',.0f')} | {cell(r.ratio, '.2f')}{' (partial)' if r.is_partial else ''} |")
    return "\n".join(lines)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", nargs="+", type=Path, help="throughput results of ours and of vLLM")
    p.add_argument("--name", default="throughput-vs-vllm", help="the summary's name after this machine's prefix")
    p.add_argument("--out-dir", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    table = rows(args.results)
    text = markdown(table)
    payload = {"benchmark": "throughput-vs-vllm", "table": text,
               "rows": [{**asdict(r), "ratio": r.ratio} for r in table], **_shared_provenance(args.results)}
    path = write_result(args.name, payload, args.out_dir)
    prefixes = {r.name.split("-throughput-", 1)[0] for r in args.results}
    if len(prefixes) == 1 and (shared := args.out_dir / f"{prefixes.pop()}-{args.name}.json") != path:
        path = path.rename(shared)
    print(f"{text}\nwrote {path}", flush=True)
    return payload


if __name__ == "__main__":
    main()
