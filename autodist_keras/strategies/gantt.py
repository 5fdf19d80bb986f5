"""Gantt charts of simulated step timelines (matplotlib PNG).

Charts are drawn on a `matplotlib.figure.Figure` with the Agg canvas, never
through pyplot or `matplotlib.use`, so plotting leaves the backend and the
figures of a notebook or script as they were.
"""

import os
import pathlib
import re

from autodist_keras.errors import OutputError
from autodist_keras.errors import StrategyError

KIND_COLORS = {
    "forward": "#4c72b0",
    "backward": "#dd8452",
    "update": "#55a868",
    "transfer": "#8172b3",
    "allreduce": "#c44e52",
    "ps_push": "#937860",
    "ps_pull": "#da8bc3",
    "ps_update": "#8c8c8c",
}


def plot_timeline(result, path, title="Simulated step (predicted)"):
    """Draws a `SimResult` timeline as a Gantt chart, one row per device and stream.

    Rows follow the devices in natural order (`node0/gpu2` before
    `node0/gpu10`); the legend sits to the right of the chart, outside it,
    so it hides no lane.

    Args:
        result: The simulator's `SimResult`.
        path: Image file to write: PNG, or another format matplotlib writes,
            chosen by the extension (`.svg`, `.pdf`, ...); without an
            extension, `.png` is added.
        title: Chart title; keep the word "predicted" in it.

    Returns:
        The path written.

    Raises:
        StrategyError: If matplotlib is not installed.
        OutputError: If the extension is not an image format matplotlib
            writes, or the file cannot be written (nothing is left behind).
    """
    try:
        # The Agg canvas, not pyplot: the user's backend and pyplot's figures stay as they were.
        from matplotlib.backends.backend_agg import FigureCanvasAgg
    except ImportError:
        raise StrategyError(
            "plot() needs matplotlib: pip install 'autodist-keras[plot]'. Received: no matplotlib"
        ) from None

    from autodist_keras.strategies.plan import output_target
    from autodist_keras.strategies.plan import refuse_directory
    from autodist_keras.strategies.plan import write_atomic

    given = path
    refuse_directory(path, "timeline.png")  # before ".png" is added to a bare name
    path = os.fspath(path)
    ext = os.path.splitext(path)[1].lower().lstrip(".")
    if not ext:
        ext, path = "png", path + ".png"
    formats = FigureCanvasAgg.get_supported_filetypes()
    if ext not in formats:
        raise OutputError(f"plot() writes an image; {ext!r} is not a format matplotlib writes. "
                          f"Use .png (or one of {', '.join(sorted(formats))}). Received: {path!r}")
    output_target(path, "timeline.png")  # a path that cannot be written fails before drawing
    fig = timeline_figure(result, title)
    # "tight" grows the image to take in the legend outside the axes.
    write_atomic(path, lambda f: fig.savefig(f, dpi=100, format=ext, bbox_inches="tight"),
                 suffix="." + ext)
    return path if isinstance(given, str) else pathlib.Path(path)


def natural_key(text):
    """Sort key comparing the digit runs of `text` as numbers: `gpu2` before `gpu10`."""
    return [int(part) if i % 2 else part for i, part in enumerate(re.split(r"(\d+)", text))]


def lanes(result):
    """The chart's rows, top to bottom: `(device, stream)` pairs of the timeline,
    devices in natural order (`node0/gpu2` before `node0/gpu10`)."""
    rows = {(event.device, event.stream) for event in result.timeline}
    return sorted(rows, key=lambda row: (natural_key(row[0]), row[1]))


def timeline_figure(result, title="Simulated step (predicted)"):
    """Draws a `SimResult` timeline on a new matplotlib figure (see `plot_timeline`).

    The legend sits outside the axes, to their right, so it never hides
    the end of a lane (the critical lanes end at the right edge).

    Args:
        result: The simulator's `SimResult`.
        title: Chart title; keep the word "predicted" in it.

    Returns:
        A `matplotlib.figure.Figure` on an Agg canvas. It is made without
        pyplot, so it neither changes matplotlib's backend nor joins
        pyplot's open figures; it is freed like any object once unused.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    rows = lanes(result)
    index = {key: i for i, key in enumerate(rows)}
    fig = Figure(figsize=(12, 0.45 * len(rows) + 1.5))
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    for event in result.timeline:
        y = index[(event.device, event.stream)]
        ax.barh(y, (event.end - event.start) * 1e3, left=event.start * 1e3, height=0.8,
                color=KIND_COLORS.get(event.kind, "#999999"), linewidth=0)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"{d} {s}" for d, s in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("time in step (ms, predicted)")
    ax.set_title(f"{title}: {result.step_time_s * 1e3:.2f} ms")
    kinds = sorted({e.kind for e in result.timeline})
    ax.legend(handles=[Patch(color=KIND_COLORS.get(k, "#999999"), label=k) for k in kinds],
              loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, fontsize=7)
    fig.tight_layout()
    return fig
