"""Run every benchmark module in this package: `python -m bench` (or `make bench`)."""

from __future__ import annotations

import importlib
import pkgutil
import sys
from pathlib import Path


def main() -> int:
    here = Path(__file__).parent
    names = sorted(
        info.name for info in pkgutil.iter_modules([str(here)]) if info.name.startswith("bench_")
    )
    wanted = set(sys.argv[1:])
    for name in names:
        if wanted and name not in wanted:
            continue
        sys.stdout.write(f"\n## {name}\n\n")
        module = importlib.import_module(f"bench.{name}")
        module.main()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
