"""kvfleet's Grafana dashboards and Prometheus alert rules, as code.

Dashboards are built with grafana-foundation-sdk (pinned in the ``dev`` extra); every metric name comes
from the code that defines it (:mod:`kvfleet_dashboards.catalog`). ``python -m kvfleet_dashboards``
(with ``dashboards`` on ``PYTHONPATH``) regenerates every committed artefact: ``dashboards/json``,
``dashboards/rules``, and the chart's copies and generated files; tests fail when any of them is stale.
"""
