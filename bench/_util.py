"""Shared helpers for the benchmarks: timing, a redis-server, machine facts, markdown output."""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Iterator

ROOT = Path(__file__).parent.parent
RESULTS = Path(__file__).parent / "results"
CHARTS = Path(__file__).parent.parent / "docs" / "benchmarks"


def machine() -> str:
    """One line describing the machine the figures come from."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return (
        f"{os.cpu_count()} CPUs ({cpu}), Python {platform.python_version()}, "
        f"{platform.system()} {platform.release()}"
    )


async def rate(operation: Callable[[int], Awaitable[object]], count: int) -> float:
    """Run `operation(i)` for i in range(count) one after another; return operations per second."""
    start = time.perf_counter()
    for i in range(count):
        await operation(i)
    return count / (time.perf_counter() - start)


def race_workers(modules_and_args: list[list[str]], timeout: float = 600) -> tuple[int, float]:
    """Run worker processes that start together; return their summed count and the seconds taken.

    Each worker is `python -m <module> <args...>`, run from the repository root. It prints
    `ready` once set up, waits for `go` on stdin, and prints the number of operations it did as
    its last line. The clock runs from the `go` to the last worker's exit, so start-up is not
    counted.
    """
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", *command],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for command in modules_and_args
    ]
    for proc in procs:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
    start = time.perf_counter()
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.write("go\n")
        proc.stdin.flush()
    done = 0
    for proc in procs:
        out, _ = proc.communicate(timeout=timeout)
        done += int(out.strip().splitlines()[-1])
    return done, time.perf_counter() - start


def sync_rate(operation: Callable[[int], object], count: int) -> float:
    """The same for a blocking operation."""
    start = time.perf_counter()
    for i in range(count):
        operation(i)
    return count / (time.perf_counter() - start)


def percentile(values: list[float], share: float) -> float:
    """Nearest-rank percentile."""
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, round(share * len(ordered)) - 1))]


def median(values: list[float]) -> float:
    return statistics.median(values)


class Row(NamedTuple):
    """One operation against its baseline over interleaved rounds (each ratio within its round)."""

    label: str
    rate: float  # median over rounds
    base: float  # the baseline's median over rounds
    base_label: str
    ratio: float  # median over rounds of the round's ratio
    low: float
    high: float

    @classmethod
    def over(
        cls, label: str, ours: str, base: str, base_label: str, rounds: list[dict[str, float]]
    ) -> Row:
        """The row of `ours` against `base` from each round's rates by name."""
        ratios = [figures[ours] / figures[base] for figures in rounds]
        return cls(
            label,
            median([figures[ours] for figures in rounds]),
            median([figures[base] for figures in rounds]),
            base_label,
            median(ratios),
            min(ratios),
            max(ratios),
        )


@contextmanager
def redis_server() -> Iterator[str]:
    """Start a throwaway redis-server on loopback TCP and yield its URL."""
    sys.path.insert(0, str(Path(__file__).parent.parent))
    from tests._redis_server import RedisServer

    with tempfile.TemporaryDirectory() as directory:
        server = RedisServer(Path(directory))
        server.start()
        try:
            yield server.tcp_url
        finally:
            server.stop()


def table(title: str, header: list[str], rows: list[list[str]], notes: list[str]) -> str:
    """Render a markdown section."""
    lines = [f"### {title}", "", f"Machine: {machine()}", ""]
    lines.append("| " + " | ".join(header) + " |")
    lines.append("|" + "|".join(" --- " for _ in header) + "|")
    lines.extend("| " + " | ".join(row) + " |" for row in rows)
    if notes:
        lines.append("")
        lines.extend(f"- {note}" for note in notes)
    return "\n".join(lines) + "\n"


def ratio_of(cell: str) -> float | None:
    """The number before the `x` in a ratio cell ("0.74x raw SET" -> 0.74), if any."""
    head = cell.split("x", 1)[0].strip()
    try:
        return float(head)
    except ValueError:
        return None


def chart(name: str, title: str, bars: list[tuple[str, float]]) -> Path | None:
    """Draw the ratios as a horizontal bar chart in docs/benchmarks/NAME.png (needs matplotlib)."""
    try:
        import matplotlib as mpl

        mpl.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    CHARTS.mkdir(parents=True, exist_ok=True)
    figure = chart_figure(title, bars)
    path = CHARTS / f"{name}.png"
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def chart_figure(title: str, bars: list[tuple[str, float]]) -> Any:
    """The matplotlib figure `chart` saves: bars of ratios, a line at 1.0, the title on top."""
    import matplotlib.pyplot as plt

    # Constrained layout keeps the long bar labels, the title and the value labels inside the
    # figure. The title is the figure's, over its whole width (an axes title is centred over
    # the bars alone, and a long one ran past the right edge), wrapped if it is longer still.
    figure, axes = plt.subplots(figsize=(8, 0.45 * len(bars) + 1.4), layout="constrained")
    labels = [label for label, _ in bars]
    values = [value for _, value in bars]
    colors = ["#3f51b5" if value >= 1 else "#9fa8da" for value in values]
    axes.barh(labels, values, color=colors)
    axes.axvline(1.0, color="black", linewidth=1)
    axes.invert_yaxis()
    axes.set_xlabel("ratio to the baseline (1.0 = as fast)")
    axes.set_xlim(0, max([*values, 1.0]) * 1.15)  # room for the value after the longest bar
    figure.suptitle(textwrap.fill(title, width=70))
    for position, value in enumerate(values):
        axes.text(value, position, f" {value:.2f}x", va="center", fontsize=8)
    return figure


def publish(name: str, text: str, bars: list[tuple[str, float]] | None = None) -> None:
    """Print a result, keep it in bench/results/NAME.md, and chart its ratios."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.md").write_text(text, encoding="utf-8")
    if bars:
        chart(name, text.splitlines()[0].lstrip("# "), bars)
