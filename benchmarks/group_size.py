"""DeDLOC Appendix C's Figure 8 (optimal all-reduce group size under peer failures), as one JSON line.

    python benchmarks/group_size.py

The model and why it reads the appendix this way are :mod:`research.dedloc_group_size`'s;
``tests/test_group_size.py`` compares its grid with the paper's cell by cell.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from research.dedloc_group_size import FAILURE_RATES, SIZES, optimal_group_size  # noqa: E402


def main() -> None:
    grid = [[optimal_group_size(n, p) for p in FAILURE_RATES] for n in SIZES]
    print(json.dumps({"n": SIZES, "p": [round(p, 5) for p in FAILURE_RATES], "optimal_group_size": grid}))


if __name__ == "__main__":
    main()
