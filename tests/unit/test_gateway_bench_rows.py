"""The gateway benchmark's Envoy rows besides kvfleet's own (``benchmarks/gateway/bench.py``): the GIE
lightweight EPP's (``--gie-epp``) and the one without usage metering (``--envoy-without-usage``) run kvfleet's
Envoy configuration with only the ext_proc exchange changed, and the lwepp release is the one
``setup-bench-lwepp.sh`` builds."""

from __future__ import annotations

import copy
import re
import sys
from pathlib import Path

from kvfleet_runtime.gateway.envoy import EnvoyPorts, bootstrap, http_filters
from kvfleet_runtime.gateway.settings import GatewaySettings

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "gateway"))

import bench  # a script, imported from its own folder


def test_lwepp_envoy_differs_from_kvfleets_only_in_the_ext_proc_exchange() -> None:
    ports = EnvoyPorts("127.0.0.1", 8080, 9901, "127.0.0.1", 9002)
    kvfleet = bootstrap(GatewaySettings(Path("tenants.json"), Path("keys.json")), ports)
    adapted = bench.lwepp_envoy_config(copy.deepcopy(kvfleet))

    names = [f["name"] for f in http_filters(adapted)]
    assert names == ["envoy.filters.http.buffer", "envoy.filters.http.ext_proc", "envoy.filters.http.router"]
    buffer, ext_proc = (f["typed_config"] for f in http_filters(adapted)[:2])
    assert buffer["max_request_bytes"] == bench.LWEPP_MAX_BODY_BYTES
    assert ext_proc["processing_mode"] == {
        "request_header_mode": "SEND",
        "response_header_mode": "SEND",
        "request_body_mode": "STREAMED",
        "response_body_mode": "NONE",
        "request_trailer_mode": "SKIP",
        "response_trailer_mode": "SKIP",
    }
    assert ext_proc["send_body_without_waiting_for_header_response"] is True

    # Undo those changes: what is left is kvfleet's configuration as rendered.
    del http_filters(adapted)[0]
    ext_proc.pop("send_body_without_waiting_for_header_response")
    ext_proc["processing_mode"] = http_filters(kvfleet)[0]["typed_config"]["processing_mode"]
    assert adapted == kvfleet


def test_the_row_without_usage_differs_from_kvfleets_only_in_the_answer_body_not_sent() -> None:
    ports = EnvoyPorts("127.0.0.1", 8080, 9901, "127.0.0.1", 9002)
    kvfleet = bootstrap(GatewaySettings(Path("tenants.json"), Path("keys.json")), ports)
    changed = bench.without_response_body(copy.deepcopy(kvfleet))
    modes = http_filters(changed)[0]["typed_config"]["processing_mode"]
    assert modes["response_body_mode"] == "NONE"
    assert http_filters(kvfleet)[0]["typed_config"]["processing_mode"]["response_body_mode"] != "NONE"
    modes["response_body_mode"] = http_filters(kvfleet)[0]["typed_config"]["processing_mode"][
        "response_body_mode"
    ]
    assert changed == kvfleet


def test_the_lwepp_release_is_the_one_the_setup_script_builds() -> None:
    script = bench.LWEPP_SETUP.read_text()
    version = bench.lwepp_version()
    assert re.fullmatch(r"v\d+\.\d+\.\d+", version), version
    assert f"GIE_LWEPP_VERSION={version}\n" in script
    assert bench.lwepp_dir(version).name == f"gie-{version}"
    assert bench.POOL_CRD in script


def test_the_front_door_table_names_the_lwepp_row_by_release_and_modes() -> None:
    import report  # noqa: PLC0415 - benchmarks/ is on sys.path once bench is imported

    run = {"p50_ms": 1.0, "p99_ms": 2.0, "errors": 0}
    proxy_run = {**run, "added_p50_ms": 0.5, "added_p99_ms": 1.5, "cpu_ms_per_request": 2.5}

    def one(value: float) -> dict[str, float]:  # a summary of one repeat
        return {"median": value, "min": value, "max": value}

    settings = {"rate": 50.0, "repeats": 1, "max_p99_overhead_ms": 5.0, "sweep_rates": [50.0]}
    result = {
        "machine": {"cpus": 2, "loadavg_1m_at_start": 0.1, "loadavg_1m_at_end": 0.1},
        "settings": {**settings, "gie_epp": True, "gie_epp_modes": "adapted"},
        "notes": {bench.GIE_TARGET: bench.GIE_NOTES["adapted"]},
        "versions": {bench.GIE_TARGET: "v1.6.0"},
        "fixed_rate": {
            "direct": {"runs": [run], "p50_ms": one(1.0), "p99_ms": one(2.0)},
            bench.GIE_TARGET: {
                "runs": [proxy_run],
                "added_p50_ms": one(0.5),
                "added_p99_ms": one(1.5),
                "cpu_ms_per_request": one(2.5),
                "errors": 0,
            },
        },
        "sweep": {bench.GIE_TARGET: {"max_rate_rps": 50.0, "steps": []}},
    }
    results = bench.to_results(result, "gateway_front_doors", ".venv/bin/python benchmarks/gateway/bench.py")
    table = report.render_gateway({"gateway_front_doors": results}, "gateway_front_doors", "front door")
    row = "| Envoy 1.40 + GIE lwepp v1.6.0 (ext_proc modes adapted to it) | 0.50 | 1.50 | 2.50 | 50 |"
    assert row in table, table
