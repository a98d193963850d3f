"""The security tier: attacks on the trust boundary, each against the real component it targets.

What starts: whatever the attacked component needs, as in the tiers below it: the real API server
(admission, key Secrets, drift repair, dedicated GPU groups; ``api_cluster``/``full_cluster``), the
gateway as its own process (tests/gateway_support.py: ``gateway_process``), real engines and the shared
KV tier with the real network policies evaluated (tests/netpol_eval.py). Costs are those of the cluster
and engine tiers: seconds to minutes per test.
"""
