"""Kubernetes backend: one Indexed Job per batch (objects.py builds, the rest talks to the API)."""
