"""Run the benchmarks and write the report: `python -m bench [NAME ...]` (or `make bench`).

`python -m bench --help` lists the options: which benchmarks (`file`, `redis`, `managers`,
`cluster`), `--rounds`, `--output`, `--report-only`.

Each `bench_*` module measures agenticstate and its baselines in the same run and publishes a
markdown table (bench/results/NAME.md) and a chart of its ratios (docs/benchmarks/NAME.png);
this runner then writes docs/benchmarks/index.md from them.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
import time
from pathlib import Path

from bench import _util

INTRO = """# Benchmark results

Written by `make bench` (`python -m bench`) on {when}, on: {machine}.

agenticstate and its baselines are measured in the same run: raw redis-py (asyncio, hiredis)
doing the nearest equivalent, an fsync-per-write loop, and the peer package `agenticaiframework`.
Ratios above 1 mean agenticstate is faster. Each benchmark runs in interleaved rounds and takes
every ratio within a round (the machine's speed drifts between rounds); tables show the median
and the range. What the figures mean, and which targets they miss, is on
[Reading the figures](reading.md).

"""


def available() -> list[str]:
    """The benchmarks, by short name: `file` for bench/bench_file.py."""
    here = Path(__file__).parent
    return sorted(
        info.name.removeprefix("bench_")
        for info in pkgutil.iter_modules([str(here)])
        if info.name.startswith("bench_")
    )


def parser() -> argparse.ArgumentParser:
    names = available()
    command = argparse.ArgumentParser(
        prog="python -m bench",
        description=(
            "Run the benchmarks (agenticstate against its baselines, in the same run) and write "
            "the report. With no names, every benchmark runs."
        ),
        epilog=(
            "Each benchmark writes its table to OUTPUT/results/NAME.md and its chart to "
            "OUTPUT/NAME.png (default: bench/results/ and docs/benchmarks/); the report "
            "(index.md beside the charts) gathers every benchmark that has results, so running "
            "one part keeps the others' last figures. The soak test is separate: "
            "python -m bench.soak --help."
        ),
    )
    command.add_argument(
        "benchmarks",
        nargs="*",
        metavar="NAME",
        help=f"which benchmarks to run: {', '.join(names)} (default: all)",
    )
    command.add_argument(
        "--rounds",
        type=positive,
        default=None,
        help="interleaved rounds per benchmark instead of each one's default "
        "(fewer: quicker and rougher; the managers benchmark runs one round)",
    )
    command.add_argument(
        "--output",
        type=Path,
        default=None,
        help="write results, charts and report under this directory instead of the repository",
    )
    command.add_argument(
        "--report-only",
        action="store_true",
        help="run nothing: rebuild the report from the last results",
    )
    command.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    return command


def positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, not {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, not {text}")
    return value


def main(argv: list[str] | None = None) -> int:
    command = parser()
    args = command.parse_args(argv)
    names = available()
    if args.list:
        sys.stdout.write("\n".join(names) + "\n")
        return 0
    wanted = [name.removeprefix("bench_") for name in args.benchmarks]
    unknown = [name for name in wanted if name not in names]
    if unknown:
        command.error(f"unknown benchmark {', '.join(unknown)}; choose from {', '.join(names)}")
    if args.output is not None:
        _util.RESULTS = args.output / "results"
        _util.CHARTS = args.output
        _util.RESULTS.mkdir(parents=True, exist_ok=True)
    sections: list[str] = []
    for short in names:
        if not args.report_only and (not wanted or short in wanted):
            sys.stdout.write(f"\n## bench_{short}\n\n")
            module = importlib.import_module(f"bench.bench_{short}")
            if args.rounds is not None and hasattr(module, "ROUNDS"):
                setattr(module, "ROUNDS", args.rounds)  # noqa: B010  # any bench module
            # A bench run alone reads its own arguments (`python bench/bench_x.py 3`); run from
            # here it must not read the runner's (`python -m bench postgres`).
            runner_argv, sys.argv = sys.argv, [f"bench_{short}"]
            try:
                module.main()
            finally:
                sys.argv = runner_argv
        result = _util.RESULTS / f"{short}.md"
        if not result.exists():
            continue  # never run here: the report leaves it out
        text = result.read_text(encoding="utf-8")
        section = "## " + text.removeprefix("### ")  # a section of the report
        if (_util.CHARTS / f"{short}.png").exists():
            section += f"\n![{short} ratios]({short}.png)\n"
        sections.append(section)
    _util.CHARTS.mkdir(parents=True, exist_ok=True)
    report = INTRO.format(when=time.strftime("%Y-%m-%d"), machine=_util.machine())
    (_util.CHARTS / "index.md").write_text(report + "\n".join(sections), encoding="utf-8")
    sys.stdout.write(f"\nreport written to {_util.CHARTS / 'index.md'}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
