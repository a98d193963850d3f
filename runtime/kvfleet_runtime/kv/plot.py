"""PNG charts of simulator results (matplotlib, Agg backend: no display needed).

Per policy: ``<policy>-hit-rate.png`` (each tenant's prefix hit rate per sample interval) and
``<policy>-occupancy.png`` (each tier's occupancy by tenant, stacked, as a fraction of the tier).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # before pyplot is imported: no display on servers and in CI

import matplotlib.pyplot as plt

from kvfleet_runtime.kv.simulator import SimulationResult

_TIER_LABEL = {"hbm": "HBM", "cpu": "CPU", "nvme": "NVMe"}


def write_charts(results: Sequence[SimulationResult], directory: Path) -> list[Path]:
    """Write the charts of every result into ``directory`` (created); returns the paths written."""
    directory.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for result in results:
        written.append(_hit_rate_chart(result, directory / f"{result.policy}-hit-rate.png"))
        written.append(_occupancy_chart(result, directory / f"{result.policy}-occupancy.png"))
    return written


def _hit_rate_chart(result: SimulationResult, path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(9, 4.5), dpi=110)
    step = result.times[1] - result.times[0] if len(result.times) > 1 else 60.0
    for tenant, series in result.hit_rate_timeline.items():
        xs = [(i + 0.5) * step / 60 for i, v in enumerate(series) if v is not None]
        ys = [100 * v for v in series if v is not None]
        if xs:
            ax.plot(xs, ys, marker=".", linewidth=1.5, label=tenant)
    if result.warmup_seconds:
        ax.axvspan(0, result.warmup_seconds / 60, color="0.9", label="warm-up (not measured)")
    ax.set_ylim(0, 100)
    ax.set_xlabel("time (min)")
    ax.set_ylabel("prefix hit rate (% of prompt tokens)")
    ax.set_title(f"{result.policy}: prefix hit rate per tenant")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize="small")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _occupancy_chart(result: SimulationResult, path: Path) -> Path:
    tiers = [t for t, cap in result.capacity.items() if cap > 0]
    fig, axes = plt.subplots(
        len(tiers), 1, figsize=(9, 2.6 * len(tiers) + 0.6), dpi=110, sharex=True, squeeze=False
    )
    minutes = [t / 60 for t in result.times]
    for ax, tier in zip(axes[:, 0], tiers, strict=True):
        capacity = result.capacity[tier]
        series = result.occupancy[tier]
        names = list(series)
        ys = [[100 * v / capacity for v in series[n]] for n in names]
        ax.stackplot(minutes, ys, labels=names, alpha=0.85)
        ax.set_ylim(0, 100)
        ax.set_ylabel(f"{_TIER_LABEL.get(tier, tier)} (% full)")
        ax.grid(alpha=0.3)
    axes[0, 0].set_title(f"{result.policy}: tier occupancy by tenant")
    axes[0, 0].legend(loc="upper left", fontsize="small", ncol=max(1, len(result.occupancy[tiers[0]])))
    axes[-1, 0].set_xlabel("time (min)")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
