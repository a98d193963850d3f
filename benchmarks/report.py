"""Render docs/benchmarks.md's tables from the results files in ``benchmarks/results/``.

The prose of docs/benchmarks.md is hand-written; every table of figures sits between two marker comments,
``<!-- results:NAME -->`` and ``<!-- /results:NAME -->``, and is generated: ``BLOCKS[NAME]`` names the
results files it reads and the function that lays them out (the same columns and wording the page had
when it was typed by hand), followed by a line saying where the figures come from. A NAME that is not in
``BLOCKS`` but is the name of a results file gets a plain table of that file's figures, so a new benchmark
needs only its markers on the page; it gets a layout of its own when it is added to ``BLOCKS``.

    .venv/bin/python benchmarks/report.py            # rewrite the generated blocks (make bench-docs)
    .venv/bin/python benchmarks/report.py --check    # exit 1 and say why when the page and files disagree

``--check`` fails when a block differs from what its files render, a block names neither a table nor a
results file, a results file is used by no block on the page, or a table of figures on the page lies
outside every block.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from results_format import REPO, RESULTS_DIR, Figure, Results, load_all

DOC = REPO / "docs" / "benchmarks.md"
BLOCK_RE = re.compile(
    r"<!-- results:(?P<name>[a-z0-9_]+) -->\n(?P<body>.*?)\n?<!-- /results:(?P=name) -->", re.DOTALL
)
FENCE_RE = re.compile(r"^```")
MINUS = "\u2212"

Files = Mapping[str, Results]


# --- number formats (one place, so every table writes a figure the same way) ---------------------------


def _signed(text: str) -> str:
    return text.replace("-", MINUS)


def num(x: float, digits: int = 0) -> str:
    """``x`` with thousands separators and ``digits`` decimals; a typographic minus."""
    return _signed(f"{x:,.{digits}f}")


def sig3(x: float) -> str:
    """About three significant digits: 1.23, 12.3, 123, 1,234."""
    return num(x, 2 if abs(x) < 10 else 1 if abs(x) < 100 else 0)


def ms2(x: float) -> str:
    """Milliseconds with two decimals below 100 ms, whole above."""
    return num(x, 2 if abs(x) < 100 else 0)


def short(x: float) -> str:
    """Whole numbers without decimals, others with one: 82, 12.6."""
    return num(x, 0) if x == round(x) else num(x, 1)


def pct(x: float, digits: int = 1) -> str:
    return num(x, digits) + "%"


def median(fig: Figure) -> float:
    if fig.median is None:
        raise ValueError(f"figure has no median: {fig}")
    return fig.median


def spread(fig: Figure, fmt: Callable[[float], str], sep: str = "\u2013") -> str:
    """``median [min<sep>max]``; just the median when the runs did not differ or their range is unknown;
    ``min to max`` when only the range is known."""
    if fig.median is None:
        assert fig.min is not None and fig.max is not None  # enforced by Figure's validator
        return f"{fmt(fig.min)} to {fmt(fig.max)}"
    if fig.min is None or fig.max is None or fig.min == fig.max:
        return fmt(fig.median)
    return f"{fmt(fig.median)} [{fmt(fig.min)}{sep}{fmt(fig.max)}]"


def with_note(text: str, fig: Figure) -> str:
    return f"{text} ({fig.note})" if fig.note else text


def relative(mix: float, alone: float) -> str:
    return pct(100 * (mix - alone) / alone) if alone else "n/a"


def duration(seconds: float) -> str:
    """``2 min 26 s``, or ``48 s`` below a minute."""
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes} min {rest} s" if minutes else f"{rest} s"


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def detail(r: Results, key: str) -> object:
    try:
        return r.details[key]
    except KeyError:
        raise KeyError(f"{r.name}: no detail {key!r}") from None


def detail_int(r: Results, key: str) -> int:
    value = detail(r, key)
    if not isinstance(value, int | float):
        raise TypeError(f"{r.name}: detail {key!r} is not a number: {value!r}")
    return int(value)


def detail_float(r: Results, key: str) -> float:
    value = detail(r, key)
    if not isinstance(value, int | float):
        raise TypeError(f"{r.name}: detail {key!r} is not a number: {value!r}")
    return float(value)


def provenance(results: list[Results]) -> str:
    """The line under every generated table: which files, measured when and on what machine, and whether
    they were measured by their command or migrated from an earlier session; files alike share a clause."""
    groups: dict[tuple[bool, str, int, str], list[str]] = {}
    for r in results:
        key = (r.migrated, r.date.isoformat(), r.machine.cores, r.machine.load)
        groups.setdefault(key, []).append(f"`benchmarks/results/{r.name}.json`")
    clauses = []
    for (migrated, date, cores, load), files in groups.items():
        how = f"measured in an earlier session on {date}, migrated" if migrated else f"measured on {date}"
        clauses.append(f"{', '.join(files)} ({how}; {cores} cores, {load})")
    return "Results: " + "; ".join(clauses) + "."


# --- control plane --------------------------------------------------------------------------------------

BUILD_PARTS = {"etcd": "etcd", "kubernetes": "the four Kubernetes binaries", "kwok": "kwok", "helm": "helm"}


def _runs_suffix(fig: Figure) -> str:
    return f", median of {fig.runs}" if fig.runs > 1 else ""


def _min_max(fig: Figure, fmt: Callable[[float], str]) -> str:
    if fig.median is None or fig.min is None or fig.max is None or fig.runs == 1:
        return spread(fig, fmt)
    return f"{fmt(fig.median)} s (min {fmt(fig.min)}, max {fmt(fig.max)})"


def render_control_plane(f: Files) -> str:
    cold, warm, relink = f["build_cluster_cold"], f["build_cluster_warm"], f["build_cluster_relink"]
    api, full, smoke = f["control_plane_start_api"], f["control_plane_start_full"], f["cluster_smoke"]
    wall = cold.figure("wall")
    cold_text = f"{num(median(wall))} s ({median(wall) / 60:.0f} min)"
    parts = [
        f"{label} {num(median(cold.figures[k]))} s" for k, label in BUILD_PARTS.items() if k in cold.figures
    ]
    if parts:
        cold_text += ": " + ", ".join(parts)
    if "prometheus_apt" in cold.figures:
        cold_text += (
            f"; plus {num(median(cold.figures['prometheus_apt']))} s for `apt-get install prometheus`"
        )
    w = warm.figure("wall")
    warm_text = f"{num(median(w), 1)} s"
    if w.values:
        warm_text += " (" + ", ".join(num(v, 2) for v in w.values) + ")"
    elif w.runs > 1:
        warm_text = _min_max(w, lambda x: num(x, 2))
    api_start = api.figure("start")
    api_text = _min_max(api_start, lambda x: num(x, 2))
    if "earlier_series" in api.figures:
        earlier = api.figures["earlier_series"]
        api_text += f"; {earlier.note or 'an earlier series'}: {num(median(earlier), 2)} s"
    full_start = full.figure("start")
    extend = full.figure("extend_to_full")
    extend_text = _min_max(extend, lambda x: num(x, 1))
    extend_text = with_note(extend_text + (" s" if extend.median is None else ""), extend)
    smoke_what = "cluster smoke tests"
    if "tests" in smoke.details:
        smoke_what += (
            f" ({detail_int(smoke, 'tests')} tests, one api+full plane, one extra api start, one Prometheus)"
        )
    rows = [
        ["cold build, empty Go module and build caches", f"`{cold.command}`", cold_text],
        [f"warm build (nothing to do){_runs_suffix(w)}", f"`{warm.command}`", warm_text],
        [
            "relink after an ldflags change (compile cache warm)",
            f"`{relink.command}`",
            with_note(f"{num(median(relink.figure('wall')))} s", relink.figure("wall")),
        ],
        [f"`api` tier start to `/readyz`{_runs_suffix(api_start)}", f"`{api.command}`", api_text],
        [
            f"`full` tier start (nodes Ready, default service account){_runs_suffix(full_start)}",
            f"`{full.command}`",
            _min_max(full_start, lambda x: num(x, 2)),
        ],
        ["extending a running `api` tier to `full`", f"`{full.command}`", extend_text],
        [smoke_what, f"`{smoke.command}`", f"{num(median(smoke.figure('wall')))} s"],
    ]
    return table(["what", "command", "result"], rows)


# --- simulator ------------------------------------------------------------------------------------------

SIM_CONFIGS = {
    "lru": "lru (prefix caching only)",
    "lmcache": "lmcache (CPU+NVMe per replica, LRU)",
    "distributed": "distributed (shared CPU+NVMe, LRU)",
    "kvfleet-local": "kvfleet-local (policy core, per-replica CPU+NVMe)",
    "kvfleet": "kvfleet (policy core, shared CPU+NVMe)",
}


def _str_list(r: Results, key: str) -> list[str]:
    value = detail(r, key)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise TypeError(f"{r.name}: detail {key!r} is not a list of names: {value!r}")
    return [str(v) for v in value]


def _published(r: Results, config: str) -> str:
    published = r.details.get("published_recompute_pct")
    value = published.get(config) if isinstance(published, dict) else None
    return f"{value:g}%" if isinstance(value, int | float) else "\u2014"


def _sim_spread(fig: Figure, scale: float = 1.0) -> str:
    """``37.7% [37.5-38.7]`` over several seeds (the range even when it is empty), ``37.7%`` over one; a
    figure in ratios takes ``scale=100``."""
    if fig.runs == 1 or fig.min is None or fig.max is None:
        return pct(scale * median(fig))
    return f"{pct(scale * median(fig))} [{num(scale * fig.min, 1)}-{num(scale * fig.max, 1)}]"


def render_simulate_rag(f: Files) -> str:
    r = f["simulate_rag"]
    seeds = detail_int(r, "seeds")
    head = (
        f"{num(detail_int(r, 'sessions'))} sessions, {num(detail_float(r, 'duration_s'))} s of traffic, "
        f"first {num(detail_float(r, 'warmup_s'))} s not measured, seeds 0-{seeds - 1}, median [min-max]:"
    )
    rows = [
        [
            SIM_CONFIGS.get(c, c),
            _sim_spread(r.figure(f"{c}.recompute")),
            _published(r, c),
            _sim_spread(r.figure(f"{c}.hit")),
            f"{num(median(r.figure(f'{c}.ttft_p50')))} / {num(median(r.figure(f'{c}.ttft_p99')))} ms",
        ]
        for c in _str_list(r, "configs")
    ]
    header = ["config", "recompute", "published", "prefix hit rate", "TTFT p50 / p99 (est.)"]
    cpu, wall = median(r.figure("cpu_time")), median(r.figure("wall_time"))
    tail = f"The run took {duration(cpu)} of CPU ({duration(wall)} of wall time on the machine below)."
    return f"{head}\n\n{table(header, rows)}\n\n{tail}"


def _mix_vs_alone(r: Results, config: str, tenant: str) -> str:
    mix, alone = median(r.figure(f"{config}.mix.{tenant}")), median(r.figure(f"{config}.alone.{tenant}"))
    return f"{pct(mix)} vs {pct(alone)} ({relative(mix, alone)})"


def render_simulate_rag_tenants(f: Files) -> str:
    r = f["simulate_rag"]
    tenants = _str_list(r, "tenants")
    alone_seeds = detail_int(r, "alone_seeds")
    seeds = "seed 0" if alone_seeds == 1 else f"seeds 0-{alone_seeds - 1}, median"
    head = (
        "Each tenant's prefix hit rate in the mix vs alone (its own sessions only, same fleet and "
        f"configuration, {seeds}):"
    )
    rows = [[c, *(_mix_vs_alone(r, c, t) for t in tenants)] for c in _str_list(r, "configs")]
    return f"{head}\n\n{table(['config', *tenants], rows)}"


def render_simulate_rag_1800(f: Files) -> str:
    r = f["simulate_rag_1800"]
    tenants = _str_list(r, "tenants")
    rows = [
        [
            c,
            pct(median(r.figure(f"{c}.recompute"))),
            pct(median(r.figure(f"{c}.hit"))),
            *(_mix_vs_alone(r, c, t) for t in tenants),
        ]
        for c in _str_list(r, "configs")
    ]
    header = ["config", "recompute", "prefix hit rate", *(f"{t} mix vs alone" for t in tenants)]
    return table(header, rows)


def render_simulate_noisy_neighbour(f: Files) -> str:
    r = f["simulate_noisy_neighbour"]
    quiet = _str_list(r, "quiet_tenants")
    header = ["config"]
    for t in quiet:
        header += [f"{t} with flood", f"{t} alone"]
    rows = []
    for c in _str_list(r, "configs"):
        row = [c]
        for t in quiet:
            row += [_sim_spread(r.figure(f"{c}.with_flood.{t}")), pct(median(r.figure(f"{c}.alone.{t}")))]
        rows.append(row)
    return table(header, rows)


# --- engine ---------------------------------------------------------------------------------------------


def _range_s(fig: Figure) -> str:
    if fig.min is not None and fig.max is not None and fig.min != fig.max:
        return f"{short(fig.min)}\u2013{short(fig.max)} s"
    return f"{short(median(fig))} s"


def render_engine_startup(f: Files) -> str:
    r = f["engine_startup"]
    vllm = with_note(_range_s(r.figure("vllm_eager")), r.figure("vllm_eager"))
    if "vllm_all_starts" in r.figures:
        every = r.figures["vllm_all_starts"]
        vllm += f"; {_range_s(every)} {every.note}".rstrip()
    rows = [
        ["LMCache server", with_note(_range_s(r.figure("lmcache_server")), r.figure("lmcache_server"))],
        ["vLLM with `--enforce-eager`", vllm],
    ]
    if "compile_cold" in r.figures and "compile_warm" in r.figures:
        rows.append(
            [
                "vLLM without `--enforce-eager`: torch.compile warm-up on top",
                f"about {num(median(r.figures['compile_cold']))} s on a cold compile cache, "
                f"still about {num(median(r.figures['compile_warm']))} s on a warm one",
            ]
        )
    return table(["process", "start-up (process start to the first `200` of its health URL)"], rows)


RESTORE_STATES = {
    "cold": "cold (full prefill)",
    "hbm": "vLLM prefix cache (HBM tier)",
    "cpu": "LMCache L1 (CPU), after vLLM evicted it",
    "nvme": "LMCache L2 (disk), after L1 was cleared",
}


def render_engine_restore(f: Files) -> str:
    r = f["engine_restore"]
    rows = [
        [
            label,
            str(r.figure(f"{s}.ttft_p50").runs),
            num(median(r.figure(f"{s}.ttft_p50"))),
            num(median(r.figure(f"{s}.ttft_mean"))),
            pct(median(r.figure(f"{s}.cached"))),
        ]
        for s, label in RESTORE_STATES.items()
        if f"{s}.ttft_p50" in r.figures
    ]
    return table(["KV source", "n", "TTFT p50 (ms)", "TTFT mean (ms)", "cached tokens"], rows)


# --- gateway --------------------------------------------------------------------------------------------

PROXIES = {
    "kvfleet": "kvfleet gateway",
    "kvfleet-envoy": "Envoy 1.40 + kvfleet EPP",
    # bench.py --envoy-without-usage: the same with the answer's body not sent to the EPP (no metering).
    "kvfleet-envoy-no-usage": "Envoy 1.40 + kvfleet EPP, answer body not sent (no usage metered)",
    # The Gateway API Inference Extension's lightweight EPP (bench.py --gie-epp); its release is added from
    # the run's details.
    "gie-lwepp": "Envoy 1.40 + GIE lwepp",
    "vllm-router": "vllm-router",
    "litellm": "LiteLLM proxy",
}
#: The gateway at an earlier git ref, run in the same benchmark (``bench.py --baseline-ref``).
BASELINE_PREFIX = "kvfleet@"


def _gateway_rows(r: Results) -> dict[str, str]:
    """Figure prefix -> row label: the current gateway, its same-run baseline (if any), then the peers
    (with the release the run recorded for a peer built from source, as GIE's lwepp)."""
    recorded = r.details.get("versions")
    versions = recorded if isinstance(recorded, dict) else {}
    rows = {p: f"{label} {versions[p]}" if p in versions else label for p, label in PROXIES.items()}
    if r.details.get("gie_epp_modes") == "adapted":  # not the kvfleet Envoy row's ext_proc modes
        rows["gie-lwepp"] += " (ext_proc modes adapted to it)"
    ref = r.details.get("baseline_ref")
    if not ref:
        return rows
    what = r.details.get("baseline_label") or "at"
    first, *peers = rows.items()
    return dict([first, (f"{BASELINE_PREFIX}{ref}", f"kvfleet gateway ({what} {ref})"), *peers])


def _max_rate(r: Results, proxy: str) -> str:
    fig = r.figure(f"{proxy}.max_rate")
    if median(fig) > 0:
        return with_note(num(median(fig)), fig)
    rates = detail(r, "sweep_rates")
    lowest = min(rates) if isinstance(rates, list) and rates else None
    below = f"< {lowest:g}" if isinstance(lowest, int | float) else "below every swept rate"
    return f"{below} ({fig.note or 'none of the swept rates'})"


def render_gateway(f: Files, name: str, label: str = "proxy") -> str:
    """Per proxy: added latency at the fixed rate, its own CPU per request where the run measured it
    (``bench.py`` since the second front door), and the highest rate under the added-p99 bound."""
    r = f[name]
    rate, repeats = detail_float(r, "rate"), detail_int(r, "repeats")
    bound = detail_float(r, "max_p99_overhead_ms")
    rows_of = {p: text for p, text in _gateway_rows(r).items() if f"{p}.added_p50" in r.figures}
    cpu = any(f"{p}.cpu_per_request" in r.figures for p in rows_of)
    header = [
        label,
        f"added p50 at {rate:g} req/s (ms), median [min\u2013max] of {repeats}",
        f"added p99 at {rate:g} req/s (ms)",
        *(["CPU per request (ms)"] if cpu else []),
        f"max rate at added p99 \u2264 {bound:g} ms (req/s)",
    ]
    rows = []
    for p, text in rows_of.items():
        cpu_cell = (
            [
                spread(r.figure(f"{p}.cpu_per_request"), ms2)
                if f"{p}.cpu_per_request" in r.figures
                else "not ours"
            ]
            if cpu
            else []
        )
        rows.append(
            [
                text,
                with_note(spread(r.figure(f"{p}.added_p50"), ms2), r.figure(f"{p}.added_p50")),
                with_note(spread(r.figure(f"{p}.added_p99"), sig3), r.figure(f"{p}.added_p99")),
                *cpu_cell,
                _max_rate(r, p),
            ]
        )
    text = table(header, rows)
    if not cpu and "direct.p50" in r.figures and "direct.p99" in r.figures:
        text += (
            f"\n\nDirect to the fake upstream: p50 {num(median(r.figures['direct.p50']), 2)} ms, "
            f"p99 {num(median(r.figures['direct.p99']), 2)} ms."
        )
    return text


FAILED_TRY = " \u2717"


def render_gateway_sweep(f: Files, name: str) -> str:
    """The rate sweep step by step: per rate, each proxy's added p99 in every try it took (a try passes
    under the bound with no error and 95% of the rate achieved; the best try counts, the sweep stops at
    a rate no try passed)."""
    r = f[name]
    sweep = detail(r, "sweep")
    rates = detail(r, "sweep_rates")
    assert isinstance(sweep, dict) and isinstance(rates, list), f"{name}: no sweep in its details"
    rows_of = {p: label for p, label in _gateway_rows(r).items() if p in sweep}
    header = ["rate (req/s)", *(f"{label}: added p99 per try (ms)" for label in rows_of.values())]
    rows = []
    for i, rate in enumerate(rates):
        cells = []
        for proxy in rows_of:
            steps = sweep[proxy]["steps"]
            if i >= len(steps):
                cells.append("(stopped)")
                continue
            tries = [
                ("no answer" if t["added_p99_ms"] is None else num(t["added_p99_ms"], 1))
                + ("" if t["ok"] else FAILED_TRY)
                for t in steps[i]
            ]
            cells.append(", ".join(tries))
        rows.append([num(float(rate)), *cells])
    return (
        table(header, rows)
        + "\n\n\u2717: the try failed (added p99 over the bound, an error, or under 95% of the rate)."
    )


def render_gateway_ttft(f: Files) -> str:
    r = f["gateway_ttft"]
    rows = [
        [label, num(median(r.figure(f"{k}.p50")), 1), num(median(r.figure(f"{k}.p90")), 1)]
        for k, label in (("direct", "direct to vLLM"), ("gateway", "through the gateway"), ("added", "added"))
    ]
    return table(["path", "TTFT p50 (ms)", "TTFT p90 (ms)"], rows)


def render_soak(f: Files) -> str:
    """One row per soak run (benchmarks/soak.py): load, outcome, and the gateway's memory and descriptors."""
    rows = []
    for name, label in (("soak_fake", "fake upstream"), ("soak_vllm", "vLLM-CPU (tiny model)")):
        r = f[name]
        rows.append(
            [
                label,
                num(detail_int(r, "clients")),
                duration(detail_float(r, "duration_s")),
                num(median(r.figure("requests_ok"))),
                num(median(r.figure("errors"))),
                sig3(median(r.figure("requests_per_s"))),
                f"{median(r.figure('stream_p50')):.2f} / {median(r.figure('stream_p99')):.2f}",
                f"{median(r.figure('rss_start')):.1f} \u2192 {median(r.figure('rss_end')):.1f}",
                f"{num(median(r.figure('fds_start')))} \u2192 {num(median(r.figure('fds_end')))} "
                f"({num(detail_int(r, 'fds_before'))} before, {num(median(r.figure('fds_after')))} after)",
                f"{detail_float(r, 'load_1m_mean'):.1f} / {detail_float(r, 'load_1m_max'):.1f}",
            ]
        )
    header = [
        "upstream",
        "clients",
        "duration",
        "streams ok",
        "errors",
        "streams/s",
        "stream p50 / p99 (s)",
        "gateway RSS start \u2192 end (MiB)",
        "gateway fds start \u2192 end",
        "load avg mean / max",
    ]
    return table(header, rows)


# --- engine plugin --------------------------------------------------------------------------------------


def _alone_vs_flood(r: Results, key: str, label: str, show_share: bool) -> list[str]:
    alone, flood = median(r.figure(f"{key}.alone")), median(r.figure(f"{key}.flood"))
    flood_text = pct(flood)
    if show_share and alone:
        flood_text += f" ({100 * flood / alone:.0f}% of alone)"
    return [label, pct(alone), flood_text]


def render_plugin_noisy_neighbour(f: Files) -> str:
    r = f["plugin_noisy_neighbour"]
    rows = [
        _alone_vs_flood(r, "plugin", "vLLM + kvfleet plugin", show_share=True),
        _alone_vs_flood(r, "stock", "stock vLLM (global LRU)", show_share=False),
    ]
    return table(["engine", "victim alone", "victim next to the flood"], rows)


def render_lmcache_l1_noisy_neighbour(f: Files) -> str:
    r = f["lmcache_l1_noisy_neighbour"]
    rows = [
        _alone_vs_flood(r, "governed", "kvfleet governed L1", show_share=True),
        _alone_vs_flood(r, "stock", "LMCache stock LRU", show_share=False),
    ]
    return table(["L1 policy", "victim alone", "victim after the flood"], rows)


def render_plugin_scheduler_cost(f: Files) -> str:
    r = f["plugin_scheduler_cost"]
    rounds = detail_int(r, "rounds")

    def row(label: str, pool: str) -> list[str]:
        spread_of_rounds = r.figures.get(f"{pool}.us_per_request")
        med = "not recorded" if spread_of_rounds is None else num(median(spread_of_rounds))
        return [label, num(median(r.figure(f"{pool}.us_per_request_min"))), med]

    rows = [
        row("vLLM's `BlockPool`", "stock"),
        row("kvfleet's `TenantAwareBlockPool`", "plugin"),
        ["added by kvfleet", "+" + num(median(r.figure("added_us_per_request"))), ""],
    ]
    header = ["block pool", f"\u00b5s per request, min of {rounds} rounds", "median of the rounds"]
    requests, evictions = detail_int(r, "requests"), median(r.figure("policy_evictions_per_pass"))
    head = (
        f"{num(requests)} requests of {detail_int(r, 'tenants')} tenants on "
        f"{num(detail_int(r, 'blocks'))} blocks, {num(evictions)} policy evictions per pass (about "
        f"{evictions / requests:.0f} evicted blocks per request), {rounds} alternating rounds:"
    )
    return f"{head}\n\n{table(header, rows)}"


OVERHEAD_WORKLOADS = {"same": "policy picks vLLM's victims", "mixed": "real quotas"}


def _ratio(r: Results, kind: str) -> str:
    ratio = median(r.figure(f"{kind}.ratio_of_medians"))
    rounds = r.figure(f"{kind}.round_ratio")
    text = f"{ratio:.2f}"
    if rounds.min is not None and rounds.max is not None:
        text += f" ({rounds.min:.2f}..{rounds.max:.2f})"
    if rounds.median is not None and kind == "cpu" and f"{rounds.median:.2f}" != f"{ratio:.2f}":
        text += f"; round ratios median {rounds.median:.2f}"
    return text


def render_plugin_overhead(f: Files) -> str:
    rows = []
    for name in ("plugin_overhead_same", "plugin_overhead_mixed", "plugin_overhead_same_c1"):
        r = f[name]
        workload = str(detail(r, "workload"))
        label = (
            f"`--workload {workload}` ({OVERHEAD_WORKLOADS.get(workload, workload)}), "
            f"{detail_int(r, 'requests')} req \u00d7 {detail_int(r, 'concurrency')} concurrent"
        )
        cached = r.details.get("cached_tokens_per_round")
        if isinstance(cached, int):
            label += f"; identical cached tokens every round: {num(cached)} each"
        rows.append(
            [
                label,
                str(detail_int(r, "rounds")),
                f"{num(median(r.figure('wall.plugin')))} / {num(median(r.figure('wall.stock')))}",
                _ratio(r, "wall"),
                f"{num(median(r.figure('cpu.plugin')))} / {num(median(r.figure('cpu.stock')))}",
                _ratio(r, "cpu"),
            ]
        )
    header = [
        "workload",
        "rounds",
        "wall tok/s median plugin / stock",
        "ratio of medians (round ratios min..max)",
        "tok per CPU-s median plugin / stock",
        "ratio of medians (min..max)",
    ]
    commands = "; ".join(f"`{r.command}`" for r in f.values())
    return f"{table(header, rows)}\n\nCommands: {commands}."


def render_plugin_fidelity(f: Files) -> str:
    r = f["plugin_fidelity"]
    rows = []
    for engine in _str_list(r, "engines"):
        for tenant in _str_list(r, "tenants"):
            diff = median(r.figure(f"{engine}.{tenant}.difference"))
            diff_text = num(0.0, 2) if round(diff, 2) == 0 else ("+" if diff > 0 else "") + num(diff, 2)
            rows.append(
                [
                    engine,
                    tenant,
                    pct(median(r.figure(f"{engine}.{tenant}.real"))),
                    pct(median(r.figure(f"{engine}.{tenant}.simulated"))),
                    f"{diff_text} pts",
                ]
            )
    return table(["engine", "tenant", "real vLLM", "simulator", "difference"], rows)


# --- operator -------------------------------------------------------------------------------------------

#: The operator scale runs (benchmarks/operator_scale.py, one file per size), smallest first.
SCALE_SIZES = ("operator_scale_1k", "operator_scale_5k", "operator_scale_10k")
#: What issue 26 holds the 10,000-Tenant run to.
SCALE_TARGETS = (
    "Targets at 10,000 Tenants / 50 ModelDeployments: every Tenant `Ready` in \u2264 120 s, operator "
    "\u2264 400 MiB, \u2264 3 audited writes per tenant to get there and 0 converged, a single tenant "
    "edit in the tenant table in \u2264 2 s."
)
#: Resources shown apart in the writes-per-tenant column (the rest are summed).
_SCALE_RESOURCES = {"secrets": "key Secrets", "tenants": "Tenant statuses", "events": "Events"}


def _scale_writes(r: Results) -> str:
    per = detail(r, "audited_writes_by_resource_per_tenant")
    assert isinstance(per, dict)
    shown = [f"{label} {num(float(per.get(key) or 0), 2)}" for key, label in _SCALE_RESOURCES.items()]
    rest = sum(float(v) for k, v in per.items() if k not in _SCALE_RESOURCES and isinstance(v, int | float))
    total = median(r.figure("audited_writes_per_tenant"))
    return f"**{num(total, 2)}** ({', '.join(shown)}, the rest {num(rest, 2)})"


def _scale_ready(r: Results) -> str:
    seconds = f"**{num(median(r.figure('seconds_to_all_ready')), 1)} s**"
    ready, tenants = detail_int(r, "ready"), detail_int(r, "tenants")
    if ready < tenants:
        seconds = f"{num(ready)} of {num(tenants)} Ready after {seconds}"
    quarters = detail(r, "seconds_to_ready_percent")
    assert isinstance(quarters, dict)
    marks = ", ".join(f"{k}% {num(float(v), 1)} s" for k, v in quarters.items() if isinstance(v, int | float))
    return f"{seconds} ({marks})" if marks else seconds


def render_operator_scale(f: Files) -> str:
    rows = []
    for r in f.values():
        tenants, mds = detail_int(r, "tenants"), detail_int(r, "model_deployments")
        idle = r.figure("idle_audited_writes")
        edit = "not measured"
        if "edit_seconds" in r.figures:
            edits = r.figure("edit_seconds")
            edit = f"{spread(edits, lambda x: num(x, 2))} s ({edits.runs} edits)"
        rows.append(
            [
                f"{num(tenants)} ({mds} ModelDeployments, {detail_int(r, 'dedicated')} dedicated)",
                _scale_ready(r),
                f"{num(median(r.figure('operator_peak_rss_mib')))} MiB",
                _scale_writes(r),
                f"{num(median(idle))} in {num(detail_float(r, 'idle_seconds'))} s",
                edit,
            ]
        )
    header = [
        "Tenants",
        "operator start to every Tenant `Ready`",
        "operator peak RSS",
        "audited writes per tenant to `Ready`",
        "writes converged",
        "tenant edit to tenant table, median [min\u2013max]",
    ]
    commands = sorted({r.command for r in f.values()})
    return (
        f"{SCALE_TARGETS}\n\n{table(header, rows)}\n\n"
        + "Command: "
        + "; ".join(f"`{c}`" for c in commands)
        + "."
    )


def render_operator(f: Files) -> str:
    drift, second, kill = f["operator_drift"], f["operator_second_reconcile"], f["operator_kill"]
    repair = drift.figure("repair_seconds")
    assert repair.max is not None
    drift_result = (
        f"median {num(median(repair), 2)} s, p99 {num(median(drift.figure('repair_p99_seconds')), 2)} s, "
        f"max {num(repair.max, 2)} s (target p99 \u2264 10 s)"
    )
    kills, converged = median(kill.figure("kills")), median(kill.figure("converged"))
    dup, orphaned = median(kill.figure("duplicate_children")), median(kill.figure("orphaned_children"))
    kill_result = (
        "converges every time" if converged == kills else f"converges {converged:.0f} of {kills:.0f} times"
    )
    kill_result += f"; then {num(median(kill.figure('mutating_calls_after')))} mutating calls, "
    kill_result += (
        "no duplicate or orphaned children"
        if dup == 0 and orphaned == 0
        else f"{num(dup)} duplicate and {num(orphaned)} orphaned children"
    )
    rows = [
        [
            f"drift repair: {repair.runs} random deletions or edits of a child (ConfigMap, keys Secret, "
            "gateway Deployment, engine StatefulSet, Service, NetworkPolicy, PDB) until restored",
            f"`{drift.command}`",
            drift_result,
        ],
        [
            "second reconcile of a converged ModelDeployment",
            f"`{second.command}`",
            f"{num(median(second.figure('mutating_calls')))} mutating calls",
        ],
        [
            f"kill -9 the operator {kills:.0f} times mid-reconcile, restart each time",
            f"`{kill.command}`",
            kill_result,
        ],
    ]
    return table(["what", "command", "result"], rows)


# --- demo -----------------------------------------------------------------------------------------------


def render_demo(f: Files) -> str:
    demo, cold = f["demo"], f["build_cluster_cold"]
    install = demo.figure("engine_install")
    rows = [
        [
            f"warm (binaries, engine and tiny model cached; `{demo.command}`)",
            f"{num(median(demo.figure('wall')))} s from start to report (target < 5 min)",
        ],
        [
            "cold (fresh machine)",
            f"provisioning first: the control-plane build ({num(median(cold.figure('wall')))} s measured on "
            f"a loaded machine, see Control plane), the engine install (about {median(install) / 60:.0f} min"
            f"{': ' + install.note if install.note else ''}), the tiny model (seconds), then the warm run",
        ],
    ]
    return table(["run", "result"], rows)


# --- test suite durations ---------------------------------------------------------------------------------

#: Rows of the slowest tests and fixtures shown on the page.
SLOWEST = 20


FIXTURE_KEYS = ("setups", "seconds", "longest")


def _number(value: object, what: str) -> float:
    if not isinstance(value, int | float):
        raise TypeError(f"test_durations: {what} is not a number: {value!r}")
    return float(value)


def _phases(value: object) -> list[float]:
    if not isinstance(value, list) or len(value) != 3:
        raise TypeError(f"test_durations: a test's phases must be [setup, call, teardown], got {value!r}")
    return [_number(v, "a test phase") for v in value]


def render_test_durations(f: Files) -> str:
    """Time per tier, the slowest tests and the slowest fixtures of one recorded test run."""
    r = f["test_durations"]
    wall, total = median(r.figure("wall_s")), median(r.figure("test_time_s"))
    tier_rows = []
    for key, fig in r.figures.items():
        tier = key.removesuffix("_s")
        if not key.endswith("_s") or key in ("wall_s", "test_time_s"):
            continue
        count = int(median(r.figure(f"{tier}_tests")))
        seconds = median(fig)
        tier_rows.append([tier, num(count), duration(seconds), pct(100 * seconds / total if total else 0.0)])
    tier_rows.append(["all", num(int(median(r.figure("tests")))), duration(total), "100%"])
    tests = detail(r, "tests_s")
    if not isinstance(tests, dict):
        raise TypeError("test_durations: details.tests_s must map test ids to [setup, call, teardown]")
    slow = sorted(((nodeid, _phases(v)) for nodeid, v in tests.items()), key=lambda kv: -sum(kv[1]))
    test_rows = [
        [f"`{nodeid}`", *(f"{x:.1f}" for x in phases), f"{sum(phases):.1f}"]
        for nodeid, phases in slow[:SLOWEST]
    ]
    fixtures = detail(r, "fixtures")
    if not isinstance(fixtures, dict):
        raise TypeError("test_durations: details.fixtures must map fixture names to their setups")
    fixture_rows = []
    for name, entry in list(fixtures.items())[:SLOWEST]:
        if not isinstance(entry, dict):
            raise TypeError(f"test_durations: fixture {name!r} has no setups record")
        setups, seconds, longest = (_number(entry.get(k), f"fixture {name!r}: {k}") for k in FIXTURE_KEYS)
        fixture_rows.append([f"`{name}`", num(int(setups)), f"{seconds:.1f}", f"{longest:.1f}"])
    failed = detail(r, "failed")
    outcome = (
        f" {len(failed)} failed: {', '.join(f'`{n}`' for n in failed)}."
        if isinstance(failed, list) and failed
        else " All passed."
    )
    head = (
        f"`{r.command}`: {num(int(median(r.figure('tests'))))} tests in {duration(wall)} of wall time "
        f"({r.machine.note}); their setups, calls and teardowns add up to {duration(total)}.{outcome}\n\n"
    )
    return (
        head
        + table(["tier", "tests", "time (summed)", "share"], tier_rows)
        + f"\n\nThe {SLOWEST} slowest tests (seconds):\n\n"
        + table(["test", "setup", "call", "teardown", "total"], test_rows)
        + f"\n\nThe {SLOWEST} slowest fixtures (their own setup, without the fixtures they use; seconds):\n\n"
        + table(["fixture (scope)", "setups", "total", "longest"], fixture_rows)
    )


# --- fair queuing -----------------------------------------------------------------------------------------


def _fair_rows(
    r: Results, prefix: str, mode: str, tenants: list[str], jain: str, extra: bool
) -> list[list[str]]:
    rows = []
    for i, tenant in enumerate(tenants):
        key = f"{prefix}{mode}.{tenant}"
        row = [
            mode.upper() if i == 0 else "",
            tenant,
            num(median(r.figure(f"{key}.tokens_per_s"))),
            num(median(r.figure(f"{key}.weighted_tokens_per_s"))),
            num(median(r.figure(f"{key}.ttft_p50"))),
            num(median(r.figure(f"{key}.ttft_p99"))),
        ]
        if extra:
            row.append(num(median(r.figure(f"{key}.refused"))))
        row.append(jain if i == 0 else "")
        rows.append(row)
    return rows


def render_fairness_vllm(f: Files) -> str:
    """FIFO against VTC on vLLM-CPU: per tenant service and TTFT, Jain's index per mode (and, in runs that
    measured the light tenant alone, Jain's index against the max-min fair shares)."""
    (r,) = f.values()
    normalised = "vtc.jain_fair_share" in r.figures
    rows = []
    for mode in ("fifo", "vtc"):
        jain = num(median(r.figure(f"{mode}.jain")), 3)
        if normalised:
            jain += f" ({num(median(r.figure(f'{mode}.jain_fair_share')), 3)})"
        rows += _fair_rows(r, "", mode, ["light", "heavy"], jain, extra=False)
    ratio = median(r.figure("light_ttft_p99_vtc_over_fifo"))
    header = ["order", "tenant", "tokens/s", "weighted tokens/s", "TTFT p50 (ms)", "TTFT p99 (ms)"]
    header.append("Jain (vs fair share)" if normalised else "Jain")
    text = (
        table(header, rows)
        + f"\n\nThe light tenant's TTFT p99 under VTC is {num(ratio, 2)} x its TTFT p99 under FIFO."
    )
    if normalised:
        alone = median(r.figure("alone.light.weighted_tokens_per_s"))
        text += (
            f" Alone on the engine, the light tenant's clients take {num(alone)} weighted tokens/s: its "
            "demand, from which its max-min fair share (in brackets: Jain's index of each tenant's service "
            "over its fair share) is computed."
        )
    return text


FAIR_SCENARIO_LABELS = {
    "two-tenants-5x": "two tenants, one at 5x, both above their half (0.6 and 3.0 x capacity)",
    "light-under-share": "two tenants, one at 5x, the light one under its half (0.2 and 1.0 x capacity)",
    "weighted": "four tenants of weights 1, 1, 2, 4, each at 0.5 x capacity",
    "tiers": "premium at 0.3 x capacity above the two-tenants-5x pair (standard)",
    "gaie-single-saturation": "GAIE #1801 scenario 1: one tenant just past saturation (1.1 x capacity)",
    "gaie-8-tenants": "GAIE #1801 scenario 3: eight tenants of one tier, each at 0.25 x capacity",
    "gaie-8-tenants-skewed": (
        "GAIE #1801 scenario 3 with skewed demand: eight tenants of one tier at "
        "0.05, 0.05, 0.1, 0.1, 0.2, 0.4, 0.8 and 1.6 x capacity"
    ),
}


def render_fairness_simulate(f: Files) -> str:
    """``kvfleet simulate --fair-queuing fifo,vtc`` at 8 replicas x 256 slots: one table per scenario."""
    r = f["fairness_simulate"]
    parts = []
    for scenario, label in FAIR_SCENARIO_LABELS.items():
        if f"{scenario}.vtc.jain" not in r.figures:
            continue
        doc = detail(r, scenario)
        assert isinstance(doc, dict)
        tenants_doc = doc["tenants"]
        assert isinstance(tenants_doc, list)
        tenants = [str(t["name"]) for t in tenants_doc if isinstance(t, dict)]
        rows = []
        for mode in ("fifo", "vtc"):
            jain = (
                f"{num(median(r.figure(f'{scenario}.{mode}.jain')), 3)} "
                f"({num(median(r.figure(f'{scenario}.{mode}.jain_fair_share')), 3)})"
            )
            rows += _fair_rows(r, f"{scenario}.", mode, tenants, jain, extra=True)
        header = ["order", "tenant", "tokens/s", "weighted tokens/s", "TTFT p50 (ms)", "TTFT p99 (ms)"]
        header += ["refused", "Jain (vs fair share)"]
        parts.append(f"**{scenario}**: {label}.\n\n" + table(header, rows))
    return "\n\n".join(parts)


# --- rate limits and fair shares across gateway replicas --------------------------------------------------


def render_shared_limits(f: Files) -> str:
    r = f["shared_limits"]
    rows = []
    for n in sorted({key.split("_", 1)[0] for key in r.figures}, key=int):

        def cell(mode: str, n: str = n) -> str:
            return spread(r.figure(f"{n}_replicas.{mode}.admitted_of_limit"), lambda x: num(x, 3))

        failed = sum(
            median(r.figure(f"{n}_replicas.{m}.failed")) for m in ("static", "shared", "store-killed")
        )
        rows.append(
            [
                n,
                cell("static"),
                cell("shared"),
                cell("store-killed"),
                spread(r.figure(f"{n}_replicas.store-killed.fallback_s"), lambda x: num(x, 2)) + " s",
                num(failed),
            ]
        )
    header = [
        "gateway replicas",
        "admitted / limit, static 1/N",
        "shared store",
        "store killed",
        "fallback after the kill",
        "requests failed",
    ]
    return f"`{r.command}`:\n\n" + table(header, rows)


def render_gateway_reload(f: Files) -> str:
    r = f["gateway_reload"]
    rows = []
    for n in sorted({key.split("_", 1)[0] for key in r.figures}, key=int):

        def ms(phase: str, stat: str, n: str = n) -> str:
            return spread(r.figure(f"{n}_tenants.{phase}.{stat}"), lambda x: num(x, 1))

        errors = sum(median(r.figure(f"{n}_tenants.{p}.errors")) for p in ("steady", "reloading"))
        rows.append(
            [
                f"{int(n):,}",
                ms("steady", "p99_ms"),
                ms("reloading", "p99_ms"),
                spread(r.figure(f"{n}_tenants.p99_ratio"), lambda x: num(x, 2)),
                ms("reloading", "max_ms"),
                num(median(r.figure(f"{n}_tenants.reloads_per_phase"))),
                num(errors),
            ]
        )
    header = [
        "tenants in the table",
        "p99 steady (ms)",
        "p99 reloading (ms)",
        "p99 ratio",
        "slowest, reloading (ms)",
        "reloads per phase",
        "requests failed",
    ]
    return f"`{r.command}`:\n\n" + table(header, rows)


def render_fairness_replicas_vllm(f: Files, name: str) -> str:
    r = f[name]
    scenarios = sorted({key.split(".", 1)[0] for key in r.figures})
    rows = []
    for scenario in scenarios:
        for mode in ("per-replica", "shared"):
            prefix = f"{scenario}.{mode}."
            tenants = [
                k.removeprefix(prefix).split(".")[0]
                for k in r.figures
                if k.startswith(prefix) and k.endswith(".weighted_tokens_per_s")
            ]
            service = ", ".join(
                f"{t} {num(median(r.figure(prefix + t + '.weighted_tokens_per_s')))}" for t in tenants
            )
            rows.append([scenario, mode, service, num(median(r.figure(prefix + "jain")), 3)])
    header = ["weights", "gateway replicas", "weighted tokens/s per tenant", "Jain (service / weight)"]
    return f"`{r.command}`:\n\n" + table(header, rows)


def render_routing_vllm(f: Files) -> str:
    r = f["routing_vllm"]
    scenarios = list(dict.fromkeys(key.split(".", 1)[0] for key in r.figures))
    rows = []
    for scenario in scenarios:
        for mode in ("affinity", "precise"):
            prefix = f"{scenario}.{mode}."
            hit = median(r.figure(prefix + "hit_rate"))
            rows.append(
                [
                    scenario,
                    mode,
                    num(hit, 3),
                    num(1 - hit, 3),
                    num(median(r.figure(prefix + "ttft_p50")) * 1000) + " ms",
                    num(median(r.figure(prefix + "ttft_p99")) * 1000) + " ms",
                ]
            )
    header = ["scenario", "routing", "prefix hit rate", "recomputed", "TTFT p50", "TTFT p99"]
    return f"`{r.command}`:\n\n" + table(header, rows)


def render_simulate_routing_check(f: Files) -> str:
    r = f["simulate_routing"]
    cases = list(dict.fromkeys(k.split(".")[1] for k in r.figures if k.startswith("check.")))
    rows = []
    for scenario in cases:
        for mode in ("affinity", "precise"):
            prefix = f"check.{scenario}.{mode}."
            simulated, real = median(r.figure(prefix + "simulated")), median(r.figure(prefix + "measured"))
            difference = _signed(f"{simulated - real:+.3f}")
            rows.append([scenario, mode, num(simulated, 3), num(real, 3), difference])
    header = ["scenario", "routing", "simulated hit rate", "measured (routing_vllm)", "difference"]
    return table(header, rows)


SIM_ROUTINGS = ("session", "affinity", "precise", "precise+tiers")


def render_simulate_routing(f: Files) -> str:
    r = f["simulate_routing"]
    seeds = detail_int(r, "seeds")
    head = (
        f"`{r.command}`: {num(detail_int(r, 'sessions'))} sessions, {num(detail_float(r, 'duration_s'))} s "
        f"of traffic, first {num(detail_float(r, 'warmup_s'))} s not measured, units of "
        f"{detail_int(r, 'unit_tokens')} tokens, seeds 0-{seeds - 1}; recomputed share of prompt tokens, "
        "median [min-max]:"
    )
    keys = [k.rsplit(".", 1)[0] for k in r.figures if k.endswith(".recompute")]
    pairs = list(dict.fromkeys(k.rsplit(".", 1)[0] for k in keys))
    rows = [
        [*pair.split("."), *(_sim_spread(r.figure(f"{pair}.{how}.recompute"), 100) for how in SIM_ROUTINGS)]
        for pair in pairs
    ]
    header = ["scenario", "config", "session (ideal)", "affinity", "precise", "precise+tiers (not built)"]
    wall, cpu = detail_float(r, "wall_seconds"), detail_float(r, "cpu_seconds")
    tail = f"The run took {duration(cpu)} of CPU ({duration(wall)} of wall time on the machine below)."
    return f"{head}\n\n{table(header, rows)}\n\n{tail}"


# --- autoscaling on the real node ---------------------------------------------------------------------

#: The rows of the real-node autoscaling table: (phase, figure, what it is, target), in the page's order.
AUTOSCALING_REAL_NODE_ROWS = (
    ("scale-out", "scale_out.hpa_s", "load step to `spec.pool.replicas` 2 (KEDA's HPA)", ""),
    ("scale-out", "scale_out.pod_ready_s", "load step to the second engine pod Ready", ""),
    ("scale-out", "scale_out.table_s", "load step to the tenant table listing it", ""),
    ("scale-out", "scale_out.gateway_healthy_s", "load step to the gateway checking it healthy", ""),
    ("scale-out", "scale_out.serving_s", "load step to the first request it answered", ""),
    ("scale-out", "scale_out.queue_peak", "premium requests held at the gateway, most", ""),
    ("scale-out", "scale_out.latency_p99_s", "p99 of the step's requests, queue included", ""),
    ("scale-out", "requests.scale_out", "requests sent during the step", ""),
    ("scale-out", "failed.scale_out", "requests failed", "0"),
    ("scale-in", "scale_in.hpa_s", "load down to `spec.pool.replicas` 1", ""),
    ("scale-in", "scale_in.table_s", "load down to the table dropping the leaving replica", ""),
    ("scale-in", "scale_in.gateway_reloaded_s", "load down to the gateway reloading that table", ""),
    ("scale-in", "scale_in.last_answer_on_leaving_s", "load down to the leaving replica's last answer", ""),
    ("scale-in", "scale_in.pod_gone_s", "load down to its pod gone", ""),
    ("scale-in", "requests.scale_in", "requests sent until then", ""),
    ("scale-in", "failed.scale_in", "requests failed", "0"),
    ("both", "table_refresh_s", "tenant table written to the gateway pod reloading it", "< drain grace"),
    ("steady", "failed.steady", "requests failed at the steady load", "0"),
    ("whole run", "failed.total", "requests failed, of every request sent", "0"),
    ("whole run", "requests.total", "requests sent", ""),
)


def render_autoscaling_real_node(f: Files) -> str:
    r = f["autoscaling_real_node"]
    rows = []
    for phase, key, what, target in AUTOSCALING_REAL_NODE_ROWS:
        if key not in r.figures:
            continue
        fig = r.figure(key)
        rows.append([phase, what, spread(fig, short), fig.unit, str(fig.runs), target])
    header = ["phase", "measured", "median [min\u2013max]", "unit", "runs", "target"]
    return f"`{r.command}`:\n\n" + table(header, rows)


# --- autoscaling on kwok GPU nodes ---------------------------------------------------------------------

#: The rows of the autoscaling table: (phase, figure, what it is, target), in the page's order.
AUTOSCALING_ROWS = (
    ("premium burst", "premium_burst.to_hpa_s", "queue step to the HPA wanting 4", ""),
    ("premium burst", "premium_burst.to_spec_s", "to `spec.pool.replicas` 4", ""),
    ("premium burst", "premium_burst.to_statefulset_s", "to the engine StatefulSet at 4", ""),
    ("premium burst", "premium_burst.to_ready_s", "to 4 engine pods Ready", ""),
    (
        "premium burst",
        "premium_burst.base_tenant_not_ready_s",
        "admitted tenant not `Ready` meanwhile",
        "0 s",
    ),
    ("premium burst", "premium_burst.scale_in_spec_s", "queue empty to `spec.pool.replicas` 1", ""),
    ("premium burst", "premium_burst.scale_in_statefulset_s", "queue empty to the StatefulSet at 1", ""),
    ("best-effort burst", "best_effort_burst.max_hpa_desired", "most replicas the HPA wanted", "\u2264 2"),
    ("best-effort burst", "best_effort_burst.max_spec_replicas", "most `spec.pool.replicas`", "\u2264 2"),
    (
        "best-effort burst",
        "best_effort_burst.max_statefulset_replicas",
        "most StatefulSet replicas",
        "\u2264 2",
    ),
    ("best-effort burst", "best_effort_burst.max_ready_pods", "most engine pods Ready", "\u2264 2"),
    ("best-effort burst", "best_effort_burst.to_cap_s", "queue step to 2 engine pods Ready", ""),
    ("best-effort burst", "best_effort_burst.basic_signal", "basic queue as KEDA reads it (clamped)", "8"),
    ("best-effort burst", "best_effort_burst.window_s", "sampled for", ""),
    ("floor", "floor.min_hpa_desired", "fewest replicas the HPA wanted", "\u2265 2"),
    ("floor", "floor.min_spec_replicas", "fewest `spec.pool.replicas`", "\u2265 2"),
    ("floor", "floor.min_statefulset_replicas", "fewest StatefulSet replicas", "\u2265 2"),
    ("floor", "floor.min_ready_pods", "fewest engine pods Ready", "\u2265 2"),
    ("floor", "floor.to_floor_spec_s", "queue empty to `spec.pool.replicas` at the floor", ""),
    ("floor", "floor.to_floor_statefulset_s", "queue empty to the StatefulSet at the floor", ""),
    ("floor", "floor.window_s", "watched after the queue emptied", ""),
    ("floor, HPA default", "floor_default.min_hpa_desired", "fewest replicas the HPA wanted", "\u2265 2"),
    ("floor, HPA default", "floor_default.min_spec_replicas", "fewest `spec.pool.replicas`", "\u2265 2"),
    (
        "floor, HPA default",
        "floor_default.min_statefulset_replicas",
        "fewest StatefulSet replicas",
        "\u2265 2",
    ),
    ("floor, HPA default", "floor_default.min_ready_pods", "fewest engine pods Ready", "\u2265 2"),
    (
        "floor, HPA default",
        "floor_default.to_floor_spec_s",
        "queue empty to `spec.pool.replicas` at the floor",
        "",
    ),
    ("floor, HPA default", "floor_default.window_s", "watched after the queue emptied", ""),
    ("capacity arrives", "pending.node_ready_s", "node created to node Ready (kwok)", ""),
    ("capacity arrives", "pending.pod_ready_s", "node created to its engine pod Ready", ""),
    ("capacity arrives", "pending.in_table_s.wait-premium", "node to premium tenant in the tenant table", ""),
    (
        "capacity arrives",
        "pending.in_table_s.wait-standard-a",
        "node to older standard tenant in the table",
        "",
    ),
    (
        "capacity arrives",
        "pending.in_table_s.wait-standard-b",
        "node to newer standard tenant in the table",
        "",
    ),
    ("capacity arrives", "pending.admitted_s.wait-premium", "node to premium tenant's `admittedQuota`", ""),
    (
        "capacity arrives",
        "pending.admitted_s.wait-standard-a",
        "node to older standard's `admittedQuota`",
        "",
    ),
    (
        "capacity arrives",
        "pending.admitted_s.wait-standard-b",
        "node to newer standard's `admittedQuota`",
        "",
    ),
    (
        "capacity arrives",
        "pending.ready_after_last_node_s.wait-premium",
        "last node to premium tenant `Ready`",
        "",
    ),
    (
        "capacity arrives",
        "pending.ready_after_last_node_s.wait-standard-b",
        "last node to newer standard tenant `Ready`",
        "",
    ),
    ("capacity arrives", "pending.base_tenant_not_ready_s", "admitted tenant not `Ready` meanwhile", "0 s"),
    (
        "capacity arrives",
        "pending.rounds_in_expected_order",
        "rounds admitting premium, then standard oldest first",
        "all",
    ),
)


def render_autoscaling_kwok(f: Files) -> str:
    r = f["autoscaling_kwok"]
    rows = []
    for phase, key, what, target in AUTOSCALING_ROWS:
        if key not in r.figures:
            continue
        fig = r.figure(key)
        rows.append([phase, what, with_note(spread(fig, short), fig), fig.unit, str(fig.runs), target])
    header = ["phase", "measured", "median [min\u2013max]", "unit", "runs", "target"]
    return f"`{r.command}`:\n\n" + table(header, rows)


# --- the page -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Block:
    """One generated block: the results files it reads and how it lays them out."""

    files: tuple[str, ...]
    render: Callable[[Files], str]


BLOCKS: dict[str, Block] = {
    "control_plane": Block(
        (
            "build_cluster_cold",
            "build_cluster_warm",
            "build_cluster_relink",
            "control_plane_start_api",
            "control_plane_start_full",
            "cluster_smoke",
        ),
        render_control_plane,
    ),
    "simulate_rag": Block(("simulate_rag",), render_simulate_rag),
    "simulate_rag_tenants": Block(("simulate_rag",), render_simulate_rag_tenants),
    "simulate_rag_1800": Block(("simulate_rag_1800",), render_simulate_rag_1800),
    "simulate_noisy_neighbour": Block(("simulate_noisy_neighbour",), render_simulate_noisy_neighbour),
    "engine_startup": Block(("engine_startup",), render_engine_startup),
    "engine_restore": Block(("engine_restore",), render_engine_restore),
    "gateway_loaded": Block(("gateway_loaded",), lambda f: render_gateway(f, "gateway_loaded")),
    "gateway": Block(("gateway",), lambda f: render_gateway(f, "gateway")),
    "gateway_ttft": Block(("gateway_ttft",), render_gateway_ttft),
    "gateway_front_doors": Block(
        ("gateway_front_doors",), lambda f: render_gateway(f, "gateway_front_doors", "front door")
    ),
    "gateway_knee": Block(("gateway_knee",), lambda f: render_gateway(f, "gateway_knee")),
    "gateway_knee_sweep": Block(("gateway_knee",), lambda f: render_gateway_sweep(f, "gateway_knee")),
    "soak": Block(("soak_fake", "soak_vllm"), render_soak),
    "plugin_noisy_neighbour": Block(("plugin_noisy_neighbour",), render_plugin_noisy_neighbour),
    "plugin_scheduler_cost": Block(("plugin_scheduler_cost",), render_plugin_scheduler_cost),
    "plugin_overhead": Block(
        ("plugin_overhead_same", "plugin_overhead_mixed", "plugin_overhead_same_c1"), render_plugin_overhead
    ),
    "lmcache_l1_noisy_neighbour": Block(("lmcache_l1_noisy_neighbour",), render_lmcache_l1_noisy_neighbour),
    "plugin_fidelity": Block(("plugin_fidelity",), render_plugin_fidelity),
    "operator_scale": Block(SCALE_SIZES, render_operator_scale),
    "operator": Block(
        (
            "operator_drift",
            "operator_second_reconcile",
            "operator_kill",
        ),
        render_operator,
    ),
    "demo": Block(("demo", "build_cluster_cold"), render_demo),
    "test_durations": Block(("test_durations",), render_test_durations),
    "fairness_vllm": Block(("fairness_vllm",), render_fairness_vllm),
    "fairness_vllm_light4": Block(("fairness_vllm_light4",), render_fairness_vllm),
    "fairness_simulate": Block(("fairness_simulate",), render_fairness_simulate),
    "shared_limits": Block(("shared_limits",), render_shared_limits),
    "gateway_reload": Block(("gateway_reload",), render_gateway_reload),
    "fairness_replicas_vllm": Block(
        ("fairness_replicas_vllm",), lambda f: render_fairness_replicas_vllm(f, "fairness_replicas_vllm")
    ),
    "routing_vllm": Block(("routing_vllm",), render_routing_vllm),
    "simulate_routing_check": Block(("simulate_routing",), render_simulate_routing_check),
    "simulate_routing": Block(("simulate_routing",), render_simulate_routing),
    "autoscaling_kwok": Block(("autoscaling_kwok",), render_autoscaling_kwok),
    "autoscaling_real_node": Block(("autoscaling_real_node",), render_autoscaling_real_node),
}


def render_figures(f: Files) -> str:
    """The layout of a results file without one of its own: one row per figure."""
    (r,) = f.values()
    rows = [
        [f"`{key}`", with_note(spread(fig, short), fig), fig.unit, str(fig.runs)]
        for key, fig in r.figures.items()
    ]
    return f"`{r.command}`:\n\n" + table(["figure", "median [min\u2013max]", "unit", "runs"], rows)


def block_for(name: str, results: Mapping[str, Results]) -> Block | None:
    """The block ``name`` stands for: a table of ``BLOCKS``, else the plain table of the results file
    ``name``, else none."""
    if name in BLOCKS:
        return BLOCKS[name]
    return Block((name,), render_figures) if name in results else None


def render_block(name: str, results: Mapping[str, Results]) -> str:
    """The body of block ``name`` (without its markers): the table(s), then the provenance line."""
    block = block_for(name, results)
    if block is None:
        raise KeyError(f"no table and no results file named {name!r}")
    files = {n: results[n] for n in block.files}
    return f"{block.render(files)}\n\n{provenance(list(files.values()))}"


def _wrap(name: str, body: str) -> str:
    return f"<!-- results:{name} -->\n{body}\n<!-- /results:{name} -->"


def update(text: str, results: Mapping[str, Results]) -> str:
    """``text`` with every block's body re-rendered from ``results``; a block that names no known table or
    lacks a results file is left as it is (``check`` reports it)."""

    def sub(match: re.Match[str]) -> str:
        name = match["name"]
        block = block_for(name, results)
        if block is None or any(n not in results for n in block.files):
            return match[0]
        return _wrap(name, render_block(name, results))

    return BLOCK_RE.sub(sub, text)


def _tables_outside_blocks(text: str) -> Iterator[int]:
    """1-based line numbers of markdown tables with a digit in a data row, outside blocks and code fences."""
    inside = [False] * (text.count("\n") + 1)
    for m in BLOCK_RE.finditer(text):
        first, last = text.count("\n", 0, m.start()), text.count("\n", 0, m.end())
        for i in range(first, last + 1):
            inside[i] = True
    in_fence = False
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        if FENCE_RE.match(lines[i]):
            in_fence = not in_fence
        elif not in_fence and not inside[i] and lines[i].startswith("|"):
            start = i
            while i < len(lines) and lines[i].startswith("|"):
                i += 1
            if any(re.search(r"\d", row) for row in lines[start + 2 : i]):
                yield start + 1
            continue
        i += 1


def check(text: str, results: Mapping[str, Results]) -> list[str]:
    """Every way ``text`` (docs/benchmarks.md) and ``results`` disagree; empty when they agree."""
    problems = []
    used: set[str] = set()
    seen: set[str] = set()
    for match in BLOCK_RE.finditer(text):
        name = match["name"]
        block = block_for(name, results)
        if block is None:
            problems.append(f"block {name!r}: no table in benchmarks/report.py BLOCKS and no results file")
            continue
        if name in seen:
            problems.append(f"block {name!r} appears twice")
        seen.add(name)
        missing = [n for n in block.files if n not in results]
        if missing:
            problems.append(f"block {name!r}: missing results file(s) {', '.join(missing)}")
            continue
        used.update(block.files)
        if match["body"] != render_block(name, results):
            problems.append(f"block {name!r} differs from its results files (run make bench-docs)")
    problems += [
        f"results file {n}.json is used by no block on the page" for n in sorted(set(results) - used)
    ]
    problems += [
        f"line {n}: a table of figures outside a generated block" for n in _tables_outside_blocks(text)
    ]
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 when anything differs")
    parser.add_argument("--doc", type=Path, default=DOC)
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    text = args.doc.read_text()
    results = load_all(args.results_dir)
    if args.check:
        problems = check(text, results)
        for problem in problems:
            print(f"{args.doc.name}: {problem}", file=sys.stderr)
        return 1 if problems else 0
    new = update(text, results)
    if new != text:
        args.doc.write_text(new)
        print(f"{args.doc}: generated blocks updated")
    problems = check(new, results)
    for problem in problems:
        print(f"{args.doc.name}: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
