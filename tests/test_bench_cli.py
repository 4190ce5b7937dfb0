"""`python -m bench` has a command line: help, a choice of benchmarks, rounds and output."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NAMES = sorted(path.stem.removeprefix("bench_") for path in (ROOT / "bench").glob("bench_*.py"))


def bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "bench", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_help_prints_help_and_runs_nothing() -> None:
    """--help names the benchmarks and options and exits at once (it used to start the run)."""
    result = bench("--help")
    assert result.returncode == 0
    assert result.stdout.startswith("usage: python -m bench")
    shown = " ".join(result.stdout.split())  # argparse wraps the lines
    for text in (", ".join(NAMES), "--rounds", "--output", "--report-only"):
        assert text in shown
    assert "## bench_" not in result.stdout


def test_list_and_unknown_names() -> None:
    """--list prints the names; an unknown name or a bad --rounds is a usage error (exit 2)."""
    assert {"cluster", "file", "managers", "redis"} <= set(NAMES)
    assert bench("--list").stdout.split() == NAMES
    unknown = bench("files")
    assert unknown.returncode == 2
    assert f"unknown benchmark files; choose from {', '.join(NAMES)}" in unknown.stderr
    rounds = bench("file", "--rounds", "0")
    assert rounds.returncode == 2
    assert "--rounds: must be 1 or more, not 0" in rounds.stderr


def test_report_only_into_another_directory(tmp_path: Path) -> None:
    """--report-only --output DIR runs nothing and writes the report from DIR's results only."""
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "file.md").write_text("### File backend\n\n| a |\n", encoding="utf-8")
    result = bench("--report-only", "--output", str(tmp_path))
    assert result.returncode == 0, result.stderr
    report = (tmp_path / "index.md").read_text(encoding="utf-8")
    assert report.startswith("# Benchmark results")
    assert "## File backend" in report
    assert "redis" not in report.split("## File backend", 1)[1]  # no results: no section


def test_output_directory_is_made(tmp_path: Path) -> None:
    """--output names a directory that need not exist yet."""
    out = tmp_path / "new" / "dir"
    result = bench("--report-only", "--output", str(out))
    assert result.returncode == 0, result.stderr
    assert (out / "index.md").exists()
    assert (out / "results").is_dir()


def test_a_chart_keeps_its_title_and_labels_inside_the_figure() -> None:
    """A chart with a long title, long bar labels and a long bar draws every text inside the
    figure (the SQLite chart's title ran past the right edge). Needs matplotlib (the bench
    group); skipped without it."""
    pytest.importorskip("matplotlib")
    import matplotlib as mpl

    mpl.use("Agg")
    import matplotlib.pyplot as plt

    from bench import _util

    title = "SQLite backend: scale, durable writes and change notification, " * 2
    bars = [(f"{n:,} keys: batch save vs executemany", 0.4) for n in (10, 10_000, 1_000_000)]
    figure = _util.chart_figure(title, [*bars, ("50 writers, save vs fsync loop", 13.3)])
    try:
        figure.canvas.draw()
        renderer = figure.canvas.get_renderer()
        bounds = figure.bbox
        texts = [figure._suptitle, *figure.axes[0].texts, *figure.axes[0].get_yticklabels()]
        for text in texts:
            box = text.get_window_extent(renderer)
            inside = (
                bounds.x0 <= box.x0,
                box.x1 <= bounds.x1,
                bounds.y0 <= box.y0,
                box.y1 <= bounds.y1,
            )
            assert all(inside), text.get_text()
    finally:
        plt.close(figure)


def test_a_bench_run_by_the_runner_never_reads_the_runners_arguments(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every bench main run by `python -m bench NAME` sees no arguments of the runner's (a main
    reading `sys.argv[1]` as its count took `NAME` and failed with a ValueError)."""
    import types

    import bench.__main__ as runner

    seen: list[list[str]] = []
    probe = types.ModuleType("bench.bench_probe")
    probe.main = lambda: seen.append(list(sys.argv))  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "bench.bench_probe", probe)
    monkeypatch.setattr(runner, "available", lambda: ["probe"])
    monkeypatch.setattr(sys, "argv", ["bench", "probe", "--output", str(tmp_path)])
    assert runner.main(["probe", "--output", str(tmp_path)]) == 0
    assert len(seen) == 1
    assert seen[0][1:] == []  # the bench's own arguments: none
    assert sys.argv == ["bench", "probe", "--output", str(tmp_path)]  # the runner's, restored
