"""Sandbox hosts (`isolation: host` on Kubernetes): long-lived host Pods run the local
backend's supervisor and take a batch's episodes from Redis one after another, each in a fresh
bubblewrap sandbox. queue.py is the Redis protocol; backend.py the Celery side (HostBackend)."""
