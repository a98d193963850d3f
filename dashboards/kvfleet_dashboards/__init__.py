"""kvfleet's Grafana dashboards and Prometheus alert rules, as code.

Dashboards are built with grafana-foundation-sdk (pinned in the ``dev`` extra); every metric name comes
from the code that defines it (:mod:`kvfleet_dashboards.catalog`). :mod:`kvfleet_dashboards.outputs`
renders ``dashboards/json`` and ``dashboards/rules/kvfleet-alerts.yaml``; ``make generate``
(hack/generate.py) writes them and the chart's copies, and tests fail when any of them is stale.
"""
