"""Print pip constraints that pin every dependency of pyproject.toml at its lower bound.

Used by ``make test-oldest`` (tools/lock.sh --oldest): the ranges the package metadata promises
are tested at their low end, so a lower bound is a tested fact, not a guess. torch is left out:
this machine installs only its local CPU build (constraints.txt).
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

EXTRAS = ("hf", "dev", "docs")


def lower_bounds(pyproject: Path) -> list[str]:
    """``name==lower`` for every requirement with a ``>=`` bound (base and EXTRAS)."""
    project = tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]
    reqs = list(project["dependencies"])
    for extra in EXTRAS:
        reqs += project["optional-dependencies"].get(extra, [])
    pins = {}
    for req in reqs:
        m = re.match(r"^([A-Za-z0-9_.\-]+)(\[[^\]]*\])?\s*(.*)$", req)
        name, spec = m.group(1).lower(), m.group(3)
        low = re.search(r">=\s*([0-9][^,;\s]*)", spec)
        if low and name != "torch":
            pins[name] = low.group(1)
    return [f"{n}=={v}" for n, v in sorted(pins.items())]


if __name__ == "__main__":
    root = Path(__file__).resolve().parents[1]
    sys.stdout.write("".join(line + "\n" for line in lower_bounds(root / "pyproject.toml")))
