"""The end-to-end tier: the whole system as a user runs it.

What starts: kvfleet's container images (built by ``make images``), the machine's one real node (kubelet,
containerd, the CNI bridge; tests/e2e/test_real_node.py and test_demo.py share it and never run side by
side), the demo from start to report, and the dashboards against a live Prometheus under load. The most
expensive tests of the suite: minutes each.
"""
