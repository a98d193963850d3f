"""``kvfleet usage``: the per-tenant, per-day bill from Prometheus (a thin shell over ``gateway.usage``).

    kvfleet usage --prometheus http://prometheus:9090 --days 7
    kvfleet usage --prometheus URL --days 31 --end 2026-11-30 --namespace llm --format csv > november.csv

One instant query per column and day (``usage.build_day_query``) through Prometheus's HTTP API
(``/api/v1/query``); the rows are computed by ``usage.add_column``. Exit codes: 0 success, 1 Prometheus
unreachable or answered an error, 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping
from datetime import UTC, date, datetime
from typing import Any

from kvfleet_runtime.gateway import usage

#: (query, evaluation time) -> Prometheus's ``data.result``.
QueryFn = Callable[[str, float], list[dict[str, Any]]]


class PrometheusError(RuntimeError):
    """Prometheus could not be reached or refused a query; the message says which."""


def prometheus_query(base_url: str, timeout_s: float = 60.0) -> QueryFn:
    """A ``QueryFn`` for the Prometheus at ``base_url`` (instant queries, ``/api/v1/query``)."""

    if urllib.parse.urlsplit(base_url).scheme not in ("http", "https"):
        raise PrometheusError(f"--prometheus must be an http(s) URL, not {base_url!r}")
    endpoint = base_url.rstrip("/") + "/api/v1/query"

    def run(query: str, at: float) -> list[dict[str, Any]]:
        data = urllib.parse.urlencode({"query": query, "time": f"{at:.3f}"}).encode()
        request = urllib.request.Request(endpoint, data=data, method="POST")  # noqa: S310 - http(s) only
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as resp:  # noqa: S310 - http(s) only
                body = json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            try:
                body = json.loads(exc.read())
            except ValueError:
                raise PrometheusError(f"Prometheus answered HTTP {exc.code}") from None
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise PrometheusError(f"cannot query Prometheus at {base_url}: {exc}") from None
        if body.get("status") != "success":
            raise PrometheusError(f"Prometheus refused {query!r}: {body.get('error', body)}")
        result = body.get("data", {}).get("result", [])
        return list(result) if isinstance(result, list) else []

    return run


def collect_usage(
    query: QueryFn, windows: list[usage.DayWindow], filters: Mapping[str, str]
) -> list[usage.UsageRow]:
    """Every column of every day, queried with ``query`` and folded into sorted rows."""
    rows: dict[tuple[date, str, str, str], usage.UsageRow] = {}
    for window in windows:
        for column in usage.COLUMNS:
            result = query(usage.build_day_query(column, window, filters), window.end)
            usage.add_column(rows, column.name, window, usage.parse_matrix(result))
    return usage.sorted_rows(rows)


def _day(text: str) -> date:
    try:
        return date.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a date (YYYY-MM-DD)") from None


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive whole number")
    return value


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "usage",
        help="per-tenant, per-day usage (requests, tokens in, cached, out) from Prometheus",
        description="Print what each tenant used per UTC day, from the gateways' metering counters in "
        "Prometheus: requests (all, 2xx, throttled), prompt tokens, cached prompt tokens and completion "
        "tokens, per namespace, ModelDeployment and tenant. The counts are exact (see docs/operations.md, "
        "'Metering and usage').",
    )
    parser.add_argument("--prometheus", required=True, metavar="URL", help="Prometheus base URL")
    parser.add_argument("--days", type=_positive, default=7, help="how many days, ending with --end (7)")
    parser.add_argument("--end", type=_day, default=None, metavar="YYYY-MM-DD", help="last day (today, UTC)")
    parser.add_argument("--namespace", help="only this namespace")
    parser.add_argument("--model-deployment", help="only this ModelDeployment")
    parser.add_argument("--tenant", help="only this tenant")
    parser.add_argument("--format", choices=("table", "csv"), default="table", help="output format (table)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace, out: Any = None, now: float | None = None) -> int:
    out = out or sys.stdout
    now = time.time() if now is None else now
    last_day = args.end or datetime.fromtimestamp(now, UTC).date()
    windows = usage.day_windows(last_day, args.days, now)
    wanted = (args.namespace, args.model_deployment, args.tenant)
    filters = {label: value for label, value in zip(usage.GROUP_LABELS, wanted, strict=True) if value}
    try:
        rows = collect_usage(prometheus_query(args.prometheus), windows, filters)
    except PrometheusError as exc:
        print(f"kvfleet usage: error: {exc}", file=sys.stderr)
        return 1
    out.write(usage.render_csv(rows) if args.format == "csv" else usage.render_table(rows))
    return 0
