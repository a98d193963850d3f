"""The tools tier: tests that run a provisioned tool, a script or a program as a subprocess, and start no
server.

What runs: ``helm lint``/``helm template`` on the chart, ``promtool check rules``/``promtool test rules``
on the alert rules and the panel queries, ``lint-imports`` on the tree and on a copy with a forbidden
import, the provisioning lanes of ``hack/provision.sh`` on a tree of fake steps, ``python -c`` to hit an
operator fault point, and a short-lived process whose pid is then dead. Each test costs a process start
(tens of milliseconds to a few seconds: ``helm template`` about 0.2 s, ``lint-imports`` a few seconds);
the tier runs in about a minute. helm and promtool come from ``hack/build-cluster.sh``; without them a test
fails naming the command that provisions them (``KVFLEET_ALLOW_MISSING=1``, as `make unit` sets, skips
instead).
"""
