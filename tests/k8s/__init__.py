"""Tests against a real Kubernetes API server (see hack/localkube/README.md)."""
