"""The edge of the Kubernetes backend: the API client from a kubeconfig (or in-cluster), and
every call through one translator. Every API error becomes one of our errors here (404 ->
ResourceNotFound, 409 -> ResourceConflict, 429/5xx/connection -> TransientBackendError).
Responses are read as JSON dicts (no model deserialisation): faster at 1000 Pods, and exactly
what kubectl would save as records.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any

import orjson
import urllib3
from kubernetes import client, config
from kubernetes.client.rest import ApiException

from rollout_wire.errors import (
    BackendError,
    BackendUnavailable,
    OwnershipError,
    ResourceConflict,
    ResourceNotFound,
    TransientBackendError,
)
from rollout_worker.backends.kube.read import labelled_ours
from rollout_worker.backends.kube.watch import RawWatch
from rollout_worker.settings import Settings

REQUEST_TIMEOUT = 30
SERVICE_ACCOUNT_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"

Objects = dict[str, dict[str, Any]]


def translate(exc: Exception, what: str) -> BackendError:
    if isinstance(exc, ApiException):
        try:
            message = orjson.loads(exc.body or b"{}").get("message") or exc.reason
        except orjson.JSONDecodeError:
            message = exc.reason
        text = f"{what}: {exc.status} {message}"
        if exc.status == 404:
            return ResourceNotFound(text)
        if exc.status == 409:
            return ResourceConflict(text)
        if exc.status in (429, 500, 502, 503, 504):
            return TransientBackendError(text)
        return BackendError(text)
    return TransientBackendError(f"{what}: {type(exc).__name__}: {exc}")


def workers_namespace(settings: Settings) -> str:
    """The workers' own namespace (where the user's task env Secret lives): the kubeconfig
    context's namespace ("default" when it names none), else, in a Pod, its service account's."""
    kubeconfig = settings.kubeconfig or os.path.expanduser("~/.kube/config")
    try:
        if settings.kubeconfig or os.path.exists(kubeconfig):
            contexts, active = config.list_kube_config_contexts(config_file=kubeconfig)
            name = settings.kube_context or active["name"]
            context = next((c for c in contexts if c["name"] == name), active)
            return str((context.get("context") or {}).get("namespace") or "default")
        with open(SERVICE_ACCOUNT_NAMESPACE, encoding="utf-8") as file:
            return file.read().strip() or "default"
    except (config.ConfigException, OSError, KeyError, TypeError) as exc:
        raise BackendUnavailable(f"the workers' namespace is unknown: {exc}") from exc


def api_client(settings: Settings) -> tuple[client.ApiClient, str]:
    """The API client of the settings' kubeconfig and context (else in-cluster), and the
    context's name."""
    cfg = client.Configuration()
    kubeconfig = settings.kubeconfig or os.path.expanduser("~/.kube/config")
    try:
        if settings.kubeconfig or os.path.exists(kubeconfig):
            config.load_kube_config(
                config_file=kubeconfig,
                context=settings.kube_context,
                client_configuration=cfg,
                persist_config=False,
            )
            _contexts, active = config.list_kube_config_contexts(config_file=kubeconfig)
            context = settings.kube_context or active["name"]
        else:
            config.load_incluster_config(client_configuration=cfg)
            context = "in-cluster"
    except (config.ConfigException, OSError, KeyError, TypeError) as exc:
        raise BackendUnavailable(f"no usable Kubernetes configuration: {exc}") from exc
    cfg.connection_pool_maxsize = 128  # collectors run many threads per process
    return client.ApiClient(cfg), context


def call(what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """One API call, its response as JSON (a dict; {} when empty)."""
    kwargs.setdefault("_request_timeout", REQUEST_TIMEOUT)
    try:
        response = fn(*args, _preload_content=False, **kwargs)
    except (ApiException, urllib3.exceptions.HTTPError, OSError) as exc:
        raise translate(exc, what) from exc
    return orjson.loads(response.data) if response.data else {}


def text(what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> str:
    """One API call whose response is text (a log)."""
    try:
        response = fn(*args, _preload_content=False, _request_timeout=REQUEST_TIMEOUT, **kwargs)
    except (ApiException, urllib3.exceptions.HTTPError, OSError) as exc:
        raise translate(exc, what) from exc
    return response.data.decode("utf-8", errors="replace")


def follow(
    what: str,
    list_fn: Callable[..., Any],
    namespace: str,
    done: Callable[[Objects], bool],
    timeout: float,
    **selector: str,
) -> Objects:
    """List objects, then watch them (from the list's resourceVersion) until `done` holds
    or `timeout` passes. Returns the objects by UID as last seen."""
    listing = call(f"list {what}", list_fn, namespace, **selector)
    objects = {o["metadata"]["uid"]: o for o in listing.get("items", [])}
    if done(objects) or timeout <= 0:
        return objects
    stream = RawWatch()
    try:
        for event in stream.stream(
            list_fn,
            namespace,
            resource_version=listing["metadata"]["resourceVersion"],
            timeout_seconds=max(1, math.ceil(timeout)),
            _request_timeout=timeout + 10,
            **selector,
        ):
            obj = event["raw_object"]
            if event["type"] == "DELETED":
                objects.pop(obj["metadata"]["uid"], None)
            elif event["type"] in ("ADDED", "MODIFIED"):
                objects[obj["metadata"]["uid"]] = obj
            if done(objects):
                break
    except ApiException as exc:
        if exc.status != 410:  # 410 Gone: our resourceVersion expired; report what we saw
            raise translate(exc, f"watch {what}") from exc
    except (urllib3.exceptions.HTTPError, OSError) as exc:
        raise translate(exc, f"watch {what}") from exc
    finally:
        stream.stop()
    return objects


def create_or_adopt(
    batch_id: str,
    kind: str,
    manifest: dict[str, Any],
    create: Callable[..., Any],
    read: Callable[..., Any],
    *read_args: str,
) -> dict[str, Any]:
    """Create the object; if it exists, adopt it only when its labels prove it is ours."""
    create_args = (read_args[1],) if len(read_args) > 1 else ()
    try:
        return call(f"create {kind}", create, *create_args, manifest)
    except ResourceConflict:
        existing: dict[str, Any] = call(f"read {kind}", read, *read_args)
    labels = existing["metadata"].get("labels") or {}
    if not labelled_ours(existing, batch_id):
        raise OwnershipError(
            f"{kind} {'/'.join(read_args)} exists but is not ours "
            f"(labels {labels}); refusing to use it"
        )
    return existing
