"""Draw a simulated schedule: a timeline PNG (matplotlib, Agg) and a chrome-trace JSON.

Both read a `SimulationReport`, so what is drawn is exactly what was simulated; a measured
iteration (`simulate.measured_report`) is drawn the same way, beside its prediction
(`benchmark.py --plot`) or alone with its actions as JSON (`pretrain_gpt.py --timeline-path`).
"""
from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)
from matplotlib.colors import to_rgb  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from seq1f1b.plan.actions import Schedule  # noqa: E402
from seq1f1b.plan.simulate import (MeasuredActions, SimulationReport,  # noqa: E402
                                   measured_report, span_timings)

OP_COLOURS = {"F": "#4C72B0", "B": "#DD8452", "W": "#55A868", "O": "#8172B3"}
OP_NAMES = {"F": "F forward", "B": "B backward", "W": "W weight grad",
            "O": "O output layer and loss"}
_LABEL_FONT_PT = 6.5
_CHAR_WIDTH = 0.62        # of the font size, for the label fitting test
_MAX_WIDTH_IN = 24.0


def _colour(op: str, chunk: int, chunks: int) -> tuple[float, float, float]:
    """The op's colour; later chunks are lighter so chunks stay apart without new hues."""
    lighten = 0.45 * chunk / (chunks - 1) if chunks > 1 else 0.0
    return tuple(c + (1 - c) * lighten for c in to_rgb(OP_COLOURS[op]))


def _text_colour(background: tuple[float, float, float]) -> str:
    """White on dark boxes, near-black on light ones (Rec. 601 luma)."""
    red, green, blue = background
    return "#222222" if 0.299 * red + 0.587 * green + 0.114 * blue > 0.6 else "white"


def title(report: SimulationReport) -> str:
    return (f"{report.schedule}   P={report.pp} m={report.microbatches} k={report.splits} "
            f"V={report.chunks}   makespan {report.makespan:.4g}   "
            f"bubble {report.bubble_ratio:.1%}")


def _figure_width(reports: list[SimulationReport], makespan: float) -> float:
    """Wide enough for the shortest box to carry its label, within sane bounds."""
    show_chunk = any(r.chunks > 1 for r in reports)
    shortest = min((t.end - t.start for report in reports for r in report.ranks
                    for t in r.timeline if t.end > t.start), default=makespan)
    label_pt = len("00.0@0" if show_chunk else "00.0") * _LABEL_FONT_PT * _CHAR_WIDTH + 2
    return min(max(8.0, label_pt * makespan / shortest / 72 / 0.85 + 1.2), _MAX_WIDTH_IN)


def _draw_timeline(ax, report: SimulationReport, makespan: float, width_in: float,
                   heading: str, time_unit: str) -> None:
    """One row per rank of `report` on `ax`, rank 0 on top, the x axis running to `makespan`."""
    show_chunk = report.chunks > 1
    axes_width_pt = width_in * 72 * ax.get_position().width
    for rank in report.ranks:
        for timed in rank.timeline:
            a = timed.action
            duration = timed.end - timed.start
            colour = _colour(a.op, a.chunk, report.chunks)
            ax.barh(rank.rank, duration, left=timed.start, height=0.8, color=colour,
                    edgecolor="white", linewidth=0.4)
            label = f"{a.microbatch}.{a.span}" + (f"@{a.chunk}" if show_chunk else "")
            box_pt = duration / makespan * axes_width_pt
            if box_pt >= len(label) * _LABEL_FONT_PT * _CHAR_WIDTH + 2:
                ax.text(timed.start + duration / 2, rank.rank, label, ha="center", va="center",
                        fontsize=_LABEL_FONT_PT, color=_text_colour(colour))
    ax.set_yticks(range(report.pp), [f"rank {r}" for r in range(report.pp)])
    ax.set_ylim(report.pp - 0.5, -0.5)          # rank 0 on top
    ax.set_xlim(0, makespan)
    ax.set_xlabel(f"time ({time_unit})" if time_unit else "time")
    ax.set_title(heading, fontsize=10, loc="left")
    ops = [op for op in OP_COLOURS if any(t.action.op == op for r in report.ranks
                                          for t in r.timeline)]
    handles = [Patch(color=_colour(op, chunk, report.chunks),
                     label=OP_NAMES[op] + (f" @{chunk}" if show_chunk else ""))
               for op in ops for chunk in range(report.chunks)]
    ax.legend(handles=handles, loc="lower right", bbox_to_anchor=(1.0, 1.0), ncol=len(handles),
              fontsize=8, frameon=False, borderaxespad=0.2)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)


def plot_timeline(report: SimulationReport, path: str | Path, time_unit: str = "",
                  heading: str | None = None) -> Path:
    """Write the timeline of `report` to `path` (PNG): one row per rank, rank 0 on top; the
    heading defaults to `title(report)`."""
    makespan = report.makespan or 1.0
    width = _figure_width([report], makespan)
    fig, ax = plt.subplots(figsize=(width, 0.55 * report.pp + 1.6), dpi=120)
    _draw_timeline(ax, report, makespan, width, heading or title(report), time_unit)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_measured_vs_simulated(pairs: list[tuple[SimulationReport, SimulationReport]],
                               path: str | Path, time_unit: str = "s") -> Path:
    """Measured and simulated timelines of each run, one above the other on a shared time axis
    (the longer of the two sets it), so where the prediction drifts is visible at a glance."""
    if not pairs:
        raise ValueError("nothing to plot: no traced runs")
    reports = [report for pair in pairs for report in pair]
    width = max(_figure_width(list(pair), max(r.makespan for r in pair) or 1.0)
                for pair in pairs)
    heights = [0.55 * report.pp + 1.0 for report in reports]
    fig, axes = plt.subplots(len(reports), 1, figsize=(width, sum(heights) + 0.6), dpi=120,
                             gridspec_kw={"height_ratios": heights}, squeeze=False)
    for n, (measured, simulated) in enumerate(pairs):
        makespan = max(measured.makespan, simulated.makespan) or 1.0
        for row, (kind, report) in enumerate((("measured", measured),
                                              ("simulated", simulated))):
            _draw_timeline(axes[2 * n + row][0], report, makespan, width,
                           f"{kind}: {title(report)}", time_unit)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path


def write_measured_timeline(schedule: Schedule, ranks: list[MeasuredActions],
                            bounds: list[tuple[int, int]], iteration: int,
                            path: str | Path) -> tuple[Path, Path]:
    """One measured iteration: its timeline to `path` (PNG, in seconds) and beside it, with the
    suffix .json, what the picture shows: each pipeline rank's actions with start and end in
    seconds from the iteration's start, makespan, busy, idle and bubble (`measured_report`:
    waiting for a neighbour inside an action counts as idle, so an action starts when its inputs
    were there), the span boundaries, and each span's F and B summed over the stages (`spans`:
    a calibration file for `plan.py partition --method fit --calibration`)."""
    report = measured_report(schedule, ranks)
    png = plot_timeline(report, path, time_unit="s",
                        heading=f"measured, iteration {iteration}: {title(report)}")
    record = {"iteration": iteration, "span_bounds": [list(b) for b in bounds],
              "spans": [vars(t) for t in span_timings(schedule, [report], bounds)],
              **report.to_dict()}
    actions = png.with_suffix(".json")
    actions.write_text(json.dumps(record, indent=1))
    return png, actions


def chrome_trace(report: SimulationReport, microseconds_per_unit: float = 1.0) -> dict:
    """The timeline as chrome://tracing / Perfetto JSON: one process, one thread per rank."""
    show_chunk = report.chunks > 1
    events: list[dict] = [{"name": "process_name", "ph": "M", "pid": 0,
                           "args": {"name": title(report)}}]
    for rank in report.ranks:
        events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": rank.rank,
                       "args": {"name": f"rank {rank.rank}"}})
        for timed in rank.timeline:
            a = timed.action
            events.append({"name": a.format(show_chunk), "cat": a.op, "ph": "X", "pid": 0,
                           "tid": rank.rank, "ts": timed.start * microseconds_per_unit,
                           "dur": (timed.end - timed.start) * microseconds_per_unit,
                           "args": {"microbatch": a.microbatch, "span": a.span,
                                    "chunk": a.chunk}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(report: SimulationReport, path: str | Path,
                       microseconds_per_unit: float = 1.0) -> Path:
    path = Path(path)
    path.write_text(json.dumps(chrome_trace(report, microseconds_per_unit)))
    return path
