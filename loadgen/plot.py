"""A PNG of latency CDFs (TTFT, TPOT, E2E) and each run's request timeline."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)
import numpy as np  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from loadgen.runner import BenchmarkResult  # noqa: E402

CDFS = (("TTFT", lambda r: r.ttft), ("TPOT", lambda r: r.tpot), ("E2E latency", lambda r: r.e2el))


def write_plot(path: Path, result: BenchmarkResult, compare: BenchmarkResult | None = None) -> None:
    fig = figure(result, compare)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def figure(result: BenchmarkResult, compare: BenchmarkResult | None = None) -> plt.Figure:
    """The CDFs of both runs (one curve per run, named by its label) and one timeline per run."""
    runs = [result] if compare is None else [result, compare]
    fig = plt.figure(figsize=(15, 4 + 4 * len(runs)), layout="constrained")
    grid = fig.add_gridspec(1 + len(runs), len(CDFS))
    for column, (name, value) in enumerate(CDFS):
        ax = fig.add_subplot(grid[0, column])
        for run in runs:
            ms = np.sort([value(r) * 1000.0 for r in run.requests if r.ok and value(r) is not None])
            if ms.size:
                ax.step(ms, np.arange(1, ms.size + 1) / ms.size, where="post", label=run.config.name)
        ax.set(title=f"{name} CDF", xlabel="ms", ylabel="fraction of requests", ylim=(0, 1.02))
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize="small")
        else:
            ax.text(0.5, 0.5, "no successful requests", ha="center", va="center", transform=ax.transAxes)
    for row, run in enumerate(runs, 1):
        _timeline(fig.add_subplot(grid[row, :]), run)
    return fig


def _timeline(ax, run: BenchmarkResult) -> None:
    """One line per request: arrival -> first token (waiting), first token -> finish (decoding)."""
    ok = [r for r in run.requests if r.ok and r.first_token is not None]
    failed = [r for r in run.requests if not r.ok]
    if ok:
        ax.hlines([r.index for r in ok], [r.arrival for r in ok], [r.first_token for r in ok],
                  colors="tab:orange", linewidth=2, label="arrival → first token")
        ax.hlines([r.index for r in ok], [r.first_token for r in ok], [r.end for r in ok],
                  colors="tab:blue", linewidth=2, label="first token → finish")
    if failed:
        ax.hlines([r.index for r in failed], [r.arrival for r in failed], [r.end for r in failed],
                  colors="tab:red", linewidth=2, label="failed")
        ax.plot([r.end for r in failed], [r.index for r in failed], "x", color="tab:red")
    title = run.config.name if not run.config.label else f"{run.config.label} ({run.config.target})"
    ax.set(title=f"Timeline: {title}", xlabel="seconds since start", ylabel="request")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small", loc="upper left")
