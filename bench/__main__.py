"""Run every benchmark and write the report: `python -m bench` (or `make bench`).

Each `bench_*` module measures agenticstate and its baselines in the same run and publishes a
markdown table (bench/results/NAME.md) and a chart of its ratios (docs/benchmarks/NAME.png);
this runner then writes docs/benchmarks/index.md from them.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
import time
from pathlib import Path

from bench._util import CHARTS, RESULTS, machine

INTRO = """# Benchmark results

Written by `make bench` (`python -m bench`) on {when}, on: {machine}.

agenticstate and its baselines are measured in the same run: raw redis-py (asyncio, hiredis)
doing the nearest equivalent, an fsync-per-write loop, and the peer package `agenticaiframework`.
Ratios above 1 mean agenticstate is faster. Each benchmark runs in interleaved rounds and takes
every ratio within a round (the machine's speed drifts between rounds); tables show the median
and the range. What the figures mean, and which targets they miss, is on
[Reading the figures](reading.md).

"""


def main() -> int:
    here = Path(__file__).parent
    names = sorted(
        info.name for info in pkgutil.iter_modules([str(here)]) if info.name.startswith("bench_")
    )
    arguments = sys.argv[1:]
    report_only = "--report-only" in arguments  # rebuild the report from the last results
    wanted = {argument for argument in arguments if not argument.startswith("--")}
    sections: list[str] = []
    for name in names:
        if wanted and name not in wanted:
            continue
        if not report_only:
            sys.stdout.write(f"\n## {name}\n\n")
            importlib.import_module(f"bench.{name}").main()
        short = name.removeprefix("bench_")
        text = (RESULTS / f"{short}.md").read_text(encoding="utf-8")
        section = "## " + text.removeprefix("### ")  # a section of the report
        if (CHARTS / f"{short}.png").exists():
            section += f"\n![{short} ratios]({short}.png)\n"
        sections.append(section)
    CHARTS.mkdir(parents=True, exist_ok=True)
    report = INTRO.format(when=time.strftime("%Y-%m-%d"), machine=machine()) + "\n".join(sections)
    (CHARTS / "index.md").write_text(report, encoding="utf-8")
    sys.stdout.write(f"\nreport written to {CHARTS / 'index.md'}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
