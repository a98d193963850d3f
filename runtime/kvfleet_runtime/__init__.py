"""kvfleet runtime: tenant table, gateway, KV policy core, engine integration, simulator and planner.

The runtime never imports the operator (kvfleet_operator).
"""
