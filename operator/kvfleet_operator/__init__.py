"""kvfleet operator: CRD models, pure builders, reconcile planning, Kubernetes I/O and kopf handlers."""
