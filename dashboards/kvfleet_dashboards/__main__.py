"""``python -m kvfleet_dashboards``: regenerate dashboards/json, dashboards/rules and the chart's files."""

from __future__ import annotations

import sys

from kvfleet_dashboards.chart import REPO
from kvfleet_dashboards.outputs import build_outputs


def main() -> int:
    for path, text in build_outputs().items():
        if path.is_file() and path.read_text() == text:
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {path.relative_to(REPO)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
