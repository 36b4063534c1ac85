"""Kubernetes backend: `objects.py` builds every object (pure), `read.py` reads Pods and Jobs
(pure), `backend.py`, `watch.py`, `pools.py` and `namespaces.py` talk to the API server;
`permissions.py` is the RBAC the calls need."""
