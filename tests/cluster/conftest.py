"""The cluster tier: tests against a real local Kubernetes control plane (hack/devcluster, from
``hack/build-cluster.sh``).

What starts: etcd and kube-apiserver once per session (``api_cluster``; about 8 s on this 2-core machine,
benchmarks/results/control_plane_start_api.json), extended on demand with the controller manager, the
scheduler and kwok's fake GPU nodes (``full_cluster``); Prometheus servers per test (``prometheus``);
the operator in process or as real processes, and helm/kubectl against the API server. The fixtures are in
tests/cluster_fixtures.py. Single tests take seconds to minutes (a node's grace period, a control-plane
restart); the tier is one of the suite's long ones. Without the binaries a test fails naming the command
that provisions them (``KVFLEET_ALLOW_MISSING=1`` skips instead).
"""
