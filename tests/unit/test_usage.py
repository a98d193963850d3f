"""The bill's pure core (kvfleet_runtime.gateway.usage) and the ``kvfleet usage`` command's input handling.

The command against a real Prometheus scraping a gateway in front of real vLLM-CPU is
tests/engine/test_usage_bill.py.
"""

from __future__ import annotations

from datetime import UTC, date, datetime

import pytest

from kvfleet_runtime.cli import main
from kvfleet_runtime.gateway import metrics as m
from kvfleet_runtime.gateway import usage
from kvfleet_runtime.gateway.usage_cli import PrometheusError, prometheus_query

DAY = date(2026, 11, 29)
START = datetime(2026, 11, 29, tzinfo=UTC).timestamp()


def test_a_counter_born_in_the_day_counts_from_zero() -> None:
    assert usage.series_increase([(START + 10, 40.0), (START + 20, 100.0)], START) == 100.0


def test_the_last_sample_before_the_day_is_the_baseline() -> None:
    samples = [(START - 30, 500.0), (START, 510.0), (START + 15, 530.0), (START + 30, 600.0)]
    # The sample at exactly the day's start belongs to the day before (Prometheus's range ends there).
    assert usage.series_increase(samples, START) == 90.0


def test_a_drop_is_a_restart_and_the_value_after_it_is_all_new() -> None:
    samples = [(START - 15, 1000.0), (START + 15, 1200.0), (START + 30, 50.0), (START + 45, 80.0)]
    assert usage.series_increase(samples, START) == 200.0 + 50.0 + 30.0


def test_days_are_utc_and_today_ends_now() -> None:
    now = START + 86_400 + 3_600  # 01:00 on the 30th
    windows = usage.day_windows(date(2026, 11, 30), 2, now)
    assert [(w.day, w.start, w.end) for w in windows] == [
        (DAY, START, START + 86_400),
        (date(2026, 11, 30), START + 86_400, now),
    ]
    assert usage.day_windows(date(2026, 12, 1), 1, now) == []  # a day that has not begun
    with pytest.raises(ValueError, match="at least 1"):
        usage.day_windows(DAY, 0, now)


def test_the_day_query_reads_raw_samples_of_the_window_plus_the_lookback() -> None:
    window = usage.DayWindow(DAY, START, START + 86_400)
    ok = next(c for c in usage.COLUMNS if c.name == "ok")
    query = usage.build_day_query(ok, window, {"tenant": 'a"b', "namespace": "llm"})
    assert query == f'{m.RESPONSES_TOTAL}{{code=~"2..", namespace="llm", tenant="a\\"b"}}[86700s]'
    prompt = next(c for c in usage.COLUMNS if c.name == "prompt_tokens")
    assert usage.build_day_query(prompt, window, {}) == f"{m.PROMPT_TOKENS_TOTAL}[86700s]"


def _series(tenant: str, pod: str, *values: float, ns: str = "llm") -> dict[str, object]:
    labels = {"__name__": m.PROMPT_TOKENS_TOTAL, "namespace": ns, "pod": pod, "tenant": tenant}
    labels[m.MODEL_DEPLOYMENT_LABEL] = "chat"
    return {"metric": labels, "values": [[START + 15 * (i + 1), str(v)] for i, v in enumerate(values)]}


def test_rows_sum_every_gateway_replica_of_a_tenant_and_leave_out_what_did_not_move() -> None:
    window = usage.DayWindow(DAY, START, START + 86_400)
    result = [
        _series("acme", "gw-0", 10, 30),
        _series("acme", "gw-1", 5),
        _series("beta", "gw-0", 0, 0),
        _series("acme", "gw-0", 7, ns="other"),
    ]
    rows: dict[tuple[date, str, str, str], usage.UsageRow] = {}
    usage.add_column(rows, "prompt_tokens", window, usage.parse_matrix(result))
    out = usage.sorted_rows(rows)
    assert [(r.namespace, r.model_deployment, r.tenant, r.counts["prompt_tokens"]) for r in out] == [
        ("llm", "chat", "acme", 35),
        ("other", "chat", "acme", 7),
    ]
    csv_text = usage.render_csv(out)
    assert csv_text.splitlines() == [
        "day,namespace,model_deployment,tenant,requests,ok,throttled,prompt_tokens,cached_tokens,"
        "completion_tokens",
        "2026-11-29,llm,chat,acme,0,0,0,35,0,0",
        "2026-11-29,other,chat,acme,0,0,0,7,0,0",
    ]
    table = usage.render_table(out).splitlines()
    assert table[0].split() == list(usage.HEADER)
    assert table[-1].split() == ["2026-11-29", "(total)", "0", "0", "0", "42", "0", "0"]
    assert usage.render_table([]) == "no usage recorded in these days\n"


def test_the_command_refuses_bad_input_and_reports_an_unreachable_prometheus(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["usage", "--prometheus", "http://x", "--end", "30/11/2026"])
    assert exc.value.code == 2
    with pytest.raises(SystemExit) as exc:
        main(["usage", "--prometheus", "http://x", "--days", "0"])
    assert exc.value.code == 2
    with pytest.raises(PrometheusError, match="http"):
        prometheus_query("file:///etc/passwd")
    # A closed port on loopback: refused at once.
    assert main(["usage", "--prometheus", "http://127.0.0.1:9", "--days", "1"]) == 1
    assert "cannot query Prometheus" in capsys.readouterr().err
