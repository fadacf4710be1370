"""PNGs for an engine-benchmark result, written beside its JSON:
<stem>-ttft-cdf.png (TTFT CDF per arm, one panel per N), <stem>-ttft-vs-n.png (TTFT p50 and p99
against N per arm) and <stem>-h2d.png (achieved host->device GB/s per arm and N).

    python -m bench.plots bench/results/cpu-engine-*.json
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

ARM_COLORS = {"A": "tab:blue", "B": "tab:orange", "C": "tab:red", "D": "tab:green", "E": "tab:gray"}


def _title(result: dict) -> str:
    return (f"{result['workload']} on {result['device']} ({result['size']}), S={result['slots']}, "
            f"rate={result['rate']:.2f}/s")


def plot_ttft_cdf(result: dict, path: Path) -> None:
    by_n = result["results"]
    fig, axes = plt.subplots(1, len(by_n), figsize=(4.5 * len(by_n), 3.6), squeeze=False, sharey=True)
    for ax, (n, arms) in zip(axes[0], sorted(by_n.items(), key=lambda kv: int(kv[0]))):
        for arm, summary in sorted(arms.items()):
            samples = summary["ttft_samples_s"]
            if samples:
                ys = [(i + 1) / len(samples) for i in range(len(samples))]
                ax.step(samples, ys, where="post", color=ARM_COLORS.get(arm), label=f"{arm}: {result['arms'][arm]}")
        ax.set_xscale("log")
        _log_seconds(ax.xaxis)
        ax.set_title(f"N = {n}")
        ax.set_xlabel("TTFT")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("fraction of requests")
    labeled = {}  # every arm once, though D appears only in panels with N <= S
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
                ax.plot(*zip(*points), marker="o", color=ARM_COLORS.get(arm), label=f"{arm}: {result['arms'][arm]}")
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


def plot_h2d(result: dict, path: Path) -> None:
    by_n = result["results"]
    ns = sorted(int(n) for n in by_n)
    arms = [a for a in result["arms"] if any(by_n[str(n)].get(a, {}).get("h2d_gb_per_s") for n in ns)]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    width = 0.8 / max(1, len(arms))
    for i, arm in enumerate(arms):
        values = [by_n[str(n)].get(arm, {}).get("h2d_gb_per_s") or 0.0 for n in ns]
        ax.bar([x + i * width for x in range(len(ns))], values, width, color=ARM_COLORS.get(arm),
               label=f"{arm}: {result['arms'][arm]}")
    ax.set_xticks([x + width * (len(arms) - 1) / 2 for x in range(len(ns))], [f"N={n}" for n in ns])
    ax.set_ylabel("host -> device GB/s")
    ax.grid(alpha=0.3, axis="y")
    if arms:
        ax.legend(fontsize=7)
    ax.set_title(_title(result), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_result(json_path: Path) -> list[Path]:
    json_path = Path(json_path)
    result = json.loads(json_path.read_text())
    stem = json_path.with_suffix("")
    paths = [Path(f"{stem}-ttft-cdf.png"), Path(f"{stem}-ttft-vs-n.png"), Path(f"{stem}-h2d.png")]
    for plot, path in zip((plot_ttft_cdf, plot_ttft_vs_n, plot_h2d), paths):
        plot(result, path)
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", type=Path, help="engine-benchmark JSON files")
    for path in parser.parse_args().results:
        print(*plot_result(path), sep="\n")


if __name__ == "__main__":
    main()
