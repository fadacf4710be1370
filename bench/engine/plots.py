"""PNGs for an engine-benchmark result, written beside its JSON:
<stem>-ttft-cdf.png (TTFT CDF per arm, one panel per N), <stem>-ttft-vs-n.png (TTFT p50 and p99
against N per arm) and <stem>-hint-lead.png (arm A's hint lead time per N, against its loads' time).

    python -m bench.engine.plots bench/results/cpu-claim-*.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter  # noqa: E402

SECONDS = FuncFormatter(lambda v, _: f"{v * 1e3:g} ms" if v < 1 else f"{v:g} s")


def _log_seconds(axis) -> None:
    axis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(SECONDS)
    axis.set_minor_formatter(NullFormatter())

ARM_COLORS = {"A": "tab:blue", "A0": "tab:purple", "B": "tab:orange", "D": "tab:green"}


def _label(result: dict, arm: str) -> str:
    return f"{arm}: {result['arms'][arm]['label']}"


def _title(result: dict) -> str:
    host = "warm" if result["variant"] == "warm-host" else f"{result['host_cache_bytes'] / 2**20:.3g} MiB, cold"
    return (f"{result['workload']} on {result['device']} ({result['size']}), M = "
            f"{result['adapter_memory_bytes'] / 2**20:.3g} MiB (holds {result['adapters_m_holds']}), "
            f"host cache {host}, rate {result['rate']:.2f}/s")


def plot_ttft_cdf(result: dict, path: Path) -> None:
    by_n = result["results"]
    fig, axes = plt.subplots(1, len(by_n), figsize=(4.5 * len(by_n), 3.6), squeeze=False, sharey=True)
    for ax, (n, arms) in zip(axes[0], sorted(by_n.items(), key=lambda kv: int(kv[0]))):
        for arm, summary in sorted(arms.items()):
            samples = summary["ttft_samples_s"]
            if samples:
                ys = [(i + 1) / len(samples) for i in range(len(samples))]
                ax.step(samples, ys, where="post", color=ARM_COLORS.get(arm), label=_label(result, arm))
        ax.set_xscale("log")
        _log_seconds(ax.xaxis)
        ax.set_title(f"N = {n}")
        ax.set_xlabel("TTFT")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("fraction of requests")
    labeled = {}  # every arm once, though D appears only in panels where N fits in M
    for ax in axes[0]:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            labeled.setdefault(label, handle)
    axes[0][-1].legend(labeled.values(), labeled.keys(), fontsize=7, loc="lower right")
    fig.suptitle(_title(result), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_ttft_vs_n(result: dict, path: Path) -> None:
    by_n = result["results"]
    ns = sorted(int(n) for n in by_n)
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6), sharey=True)
    for ax, q in zip(axes, ("p50", "p99")):
        for arm in result["arms"]:
            points = [(n, by_n[str(n)][arm]["ttft_s"][q]) for n in ns if arm in by_n[str(n)]]
            points = [(n, v) for n, v in points if v is not None]
            if points:
                ax.plot(*zip(*points), marker="o", color=ARM_COLORS.get(arm), label=_label(result, arm))
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        _log_seconds(ax.yaxis)
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.set_xlabel("adapters N")
        ax.set_title(f"TTFT {q}")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("TTFT")
    axes[1].legend(fontsize=7)
    fig.suptitle(_title(result), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_hint_lead(result: dict, path: Path) -> None:
    """CDF of arm A's hint lead (hint sent to arrival) per N, with the median load time of that run dashed:
    a hint hides a load only when its lead exceeds the load."""
    by_n = result["results"]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    colors = plt.get_cmap("viridis")
    ns = sorted(int(n) for n in by_n if "A" in by_n[n])
    for i, n in enumerate(ns):
        summary = by_n[str(n)]["A"]
        samples, color = summary["hint_lead_samples_s"], colors(i / max(1, len(ns) - 1))
        if samples:
            ys = [(j + 1) / len(samples) for j in range(len(samples))]
            ax.step([max(s, 1e-4) for s in samples], ys, where="post", color=color, label=f"N = {n}")
        if summary["load_s"]["p50"]:
            ax.axvline(summary["load_s"]["p50"], color=color, linestyle="--", linewidth=1)
    ax.set_xscale("log")
    ax.xaxis.set_major_locator(LogLocator())
    ax.xaxis.set_major_formatter(SECONDS)
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("hint lead (solid) / median load, start to ready (dashed)")
    ax.set_ylabel("fraction of arrivals")
    ax.grid(alpha=0.3)
    if ns:
        ax.legend(fontsize=7)
    ax.set_title(_title(result), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_result(json_path: Path) -> list[Path]:
    json_path = Path(json_path)
    result = json.loads(json_path.read_text())
    stem = json_path.with_suffix("")
    paths = [Path(f"{stem}-ttft-cdf.png"), Path(f"{stem}-ttft-vs-n.png"), Path(f"{stem}-hint-lead.png")]
    for plot, path in zip((plot_ttft_cdf, plot_ttft_vs_n, plot_hint_lead), paths):
        plot(result, path)
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", type=Path, help="engine-benchmark JSON files")
    for path in parser.parse_args().results:
        print(*plot_result(path), sep="\n")


if __name__ == "__main__":
    main()
