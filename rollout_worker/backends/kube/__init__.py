"""Kubernetes backend: `objects.py` and `pod_spec.py` build every object, `read.py` and
`verdicts.py` read Pods and Jobs (all four pure); `api.py` is the edge every call goes through,
`backend.py` (the Backend protocol), `watch.py`, `pools.py`, `feed.py` and `namespaces.py`
talk to the API server; `permissions.py` is the RBAC the calls need."""
