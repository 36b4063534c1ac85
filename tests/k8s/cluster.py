"""Helpers for tests that need a real Kubernetes API server.

The cluster is either the one ``KUBECONFIG`` points at (kind, a real cluster, or the local one
started earlier) or the local control plane that ``hack/localkube/cluster.sh`` builds from source
and runs with KWOK (simulated) nodes on 127.0.0.1.

Everything here is plain functions plus a small ``Cluster`` record, so fixtures in any conftest
can reuse it; ``tests/k8s/conftest.py`` only wires them into pytest.
"""

from __future__ import annotations

import datetime as _dt
import os
import re
import subprocess
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kubernetes import client, config
from kubernetes.client.rest import ApiException

REPO_ROOT = Path(__file__).resolve().parents[2]
LOCALKUBE_DIR = REPO_ROOT / "hack" / "localkube"
CLUSTER_SH = LOCALKUBE_DIR / "cluster.sh"

#: Label put on every namespace a test creates.
TEST_NAMESPACE_LABEL = "rollout.dev/test"

#: KWOK nodes made by these helpers (and by ``cluster.sh nodes``) carry this label and taint.
KWOK_NODE_LABELS = {"type": "kwok"}
KWOK_TAINT_KEY = "kwok.x-k8s.io/node"
KWOK_NODE_PREFIX = "kwok-node-"

#: API group of KWOK's CRDs (Logs, ClusterLogs, Stage, ...).
KWOK_GROUP = "kwok.x-k8s.io"
KWOK_VERSION = "v1alpha1"

# A cold ``cluster.sh up`` builds Kubernetes from source: tens of minutes on 2 cores.
UP_TIMEOUT_S = int(os.environ.get("ROLLOUT_LOCALKUBE_UP_TIMEOUT", "3600"))


class ClusterUnavailable(RuntimeError):
    """No reachable cluster, and the local one could not be started."""


# --------------------------------------------------------------------------------------------
# Versions and paths


def pinned_versions() -> dict[str, str]:
    """The versions pinned in hack/localkube/versions.env (K8S_VERSION, ETCD_VERSION, ...)."""
    text = (LOCALKUBE_DIR / "versions.env").read_text()
    versions = {}
    for name, default in re.findall(r'^(\w+)="\$\{\w+:-([^}]*)\}"', text, flags=re.M):
        versions[name] = os.environ.get(name, default)
    return versions


def _run_script(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(CLUSTER_SH), *args],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
        check=False,
    )


def local_kubeconfig_path() -> Path:
    """Where ``cluster.sh`` writes the local cluster's kubeconfig (as printed by ``env``)."""
    out = _run_script("env").stdout
    m = re.search(r"^export KUBECONFIG=(.+)$", out, flags=re.M)
    if not m:
        raise ClusterUnavailable(f"cluster.sh env printed no KUBECONFIG:\n{out}")
    return Path(m.group(1).strip())


# --------------------------------------------------------------------------------------------
# Finding or starting a cluster


@dataclass
class Cluster:
    """A reachable cluster and an API client for it."""

    kubeconfig: Path
    #: True when this is the hack/localkube cluster (control plane built from source + KWOK).
    local: bool
    #: True when ensure_cluster() started it (then stop_cluster() should tear it down).
    started_here: bool
    api_client: client.ApiClient = field(repr=False)

    @property
    def core(self) -> client.CoreV1Api:
        return client.CoreV1Api(self.api_client)

    @property
    def batch(self) -> client.BatchV1Api:
        return client.BatchV1Api(self.api_client)

    @property
    def custom(self) -> client.CustomObjectsApi:
        return client.CustomObjectsApi(self.api_client)

    def version(self) -> client.VersionInfo:
        return client.VersionApi(self.api_client).get_code(_request_timeout=10)

    def has_kwok(self) -> bool:
        """Whether KWOK's API group (Logs/ClusterLogs CRDs) is served, i.e. KWOK runs here."""
        try:
            groups = client.ApisApi(self.api_client).get_api_versions(_request_timeout=10)
        except ApiException:
            return False
        return any(g.name == KWOK_GROUP for g in groups.groups)


def _api_client(kubeconfig: Path) -> client.ApiClient:
    # A private client: never touches the kubernetes module's global default configuration.
    return config.new_client_from_config(config_file=str(kubeconfig))


def probe(kubeconfig: Path | str, timeout: float = 5) -> client.ApiClient | None:
    """An API client if the cluster in ``kubeconfig`` answers /version, else None."""
    path = Path(kubeconfig)
    if not path.is_file():
        return None
    try:
        api = _api_client(path)
        client.VersionApi(api).get_code(_request_timeout=timeout)
        return api
    except Exception:  # unreachable, bad credentials, malformed kubeconfig: all "no"
        return None


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve()
    except OSError:
        return False


def ensure_cluster() -> Cluster:
    """Use the cluster ``$KUBECONFIG`` points at if it is reachable; else start the local one.

    Raises ClusterUnavailable (with the script's output) when the local cluster cannot start.
    """
    local_kc = local_kubeconfig_path()
    env_kc = os.environ.get("KUBECONFIG", "").split(os.pathsep)[0]
    if env_kc:
        api = probe(env_kc)
        if api is not None:
            return Cluster(Path(env_kc), _same_file(Path(env_kc), local_kc), False, api)

    api = probe(local_kc)
    if api is not None and _run_script("status").returncode == 0:
        return Cluster(local_kc, True, False, api)

    try:
        proc = _run_script("up", timeout=UP_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        raise ClusterUnavailable(f"cluster.sh up timed out after {UP_TIMEOUT_S}s") from exc
    tail = "\n".join(proc.stdout.splitlines()[-80:])
    if proc.returncode != 0:
        raise ClusterUnavailable(f"cluster.sh up failed (exit {proc.returncode}):\n{tail}")
    api = probe(local_kc, timeout=10)
    if api is None:
        raise ClusterUnavailable(f"cluster.sh up succeeded but {local_kc} is unreachable:\n{tail}")
    return Cluster(local_kc, True, True, api)


def stop_cluster(cluster: Cluster) -> None:
    """Tear the local cluster down if ensure_cluster() started it."""
    cluster.api_client.close()
    if cluster.local and cluster.started_here:
        _run_script("down", timeout=120)


# --------------------------------------------------------------------------------------------
# Namespaces


def unique_namespace_name(hint: str = "t") -> str:
    base = re.sub(r"[^a-z0-9-]+", "-", hint.lower()).strip("-")[:40].strip("-") or "t"
    return f"rt-{base}-{uuid.uuid4().hex[:6]}"


def create_test_namespace(
    cluster: Cluster, hint: str = "t", *, wait_service_account: bool = True, timeout: float = 60
) -> str:
    """Create a uniquely named namespace labelled ``rollout.dev/test=true``.

    With ``wait_service_account`` it also waits for the ``default`` ServiceAccount, which the
    ServiceAccount admission plugin needs before Pods can be created there.
    """
    name = unique_namespace_name(hint)
    cluster.core.create_namespace(
        {"metadata": {"name": name, "labels": {TEST_NAMESPACE_LABEL: "true"}}}
    )
    if wait_service_account:
        wait_for(
            lambda: _exists(lambda: cluster.core.read_namespaced_service_account("default", name)),
            timeout,
            f"default ServiceAccount in namespace {name}",
        )
    return name


def delete_namespace(cluster: Cluster, name: str) -> None:
    """Delete a namespace without waiting for it to go away."""
    try:
        cluster.core.delete_namespace(name, propagation_policy="Background")
    except ApiException as exc:
        if exc.status != 404:
            raise


# --------------------------------------------------------------------------------------------
# KWOK nodes and Pod placement


def kwok_node_manifest(
    name: str,
    *,
    pods: int = 1000,
    cpu: str = "1000",
    memory: str = "4Ti",
    kubelet_version: str | None = None,
) -> dict:
    """A Node that the local KWOK controller manages (annotation ``kwok.x-k8s.io/node=fake``).

    Its addresses are loopback only, so API-server -> "kubelet" traffic (Pod logs) goes to the
    KWOK controller on 127.0.0.1; it is tainted so only Pods that tolerate KWOK land on it.
    """
    quantity = {"cpu": cpu, "memory": memory, "pods": str(pods)}
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"},
            "labels": {
                **KWOK_NODE_LABELS,
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "kubernetes.io/role": "agent",
                "node-role.kubernetes.io/agent": "",
            },
        },
        "spec": {"taints": [{"key": KWOK_TAINT_KEY, "value": "fake", "effect": "NoSchedule"}]},
        "status": {
            "addresses": [
                {"type": "InternalIP", "address": "127.0.0.1"},
                {"type": "Hostname", "address": "localhost"},
            ],
            "allocatable": dict(quantity),
            "capacity": dict(quantity),
            # Empty fields are filled in by KWOK's node-initialize stage.
            "nodeInfo": {
                "architecture": "amd64",
                "operatingSystem": "linux",
                "kubeletVersion": kubelet_version or pinned_versions()["K8S_VERSION"],
                "bootID": "",
                "containerRuntimeVersion": "",
                "kernelVersion": "",
                "kubeProxyVersion": "",
                "machineID": "",
                "osImage": "",
                "systemUUID": "",
            },
        },
    }


def _node_ready(node: client.V1Node) -> bool:
    return any(c.type == "Ready" and c.status == "True" for c in (node.status.conditions or []))


def ensure_kwok_nodes(
    cluster: Cluster, count: int, *, prefix: str = KWOK_NODE_PREFIX, timeout: float = 60, **kw
) -> list[str]:
    """Make sure nodes ``<prefix>0 .. <prefix>{count-1}`` exist and are Ready; return their names.

    Keyword arguments (pods, cpu, memory) go to kwok_node_manifest for nodes created here.
    """
    names = [f"{prefix}{i}" for i in range(count)]
    existing = {
        n.metadata.name
        for n in cluster.core.list_node(label_selector=_selector(KWOK_NODE_LABELS)).items
    }
    for name in names:
        if name not in existing:
            try:
                cluster.core.create_node(kwok_node_manifest(name, **kw))
            except ApiException as exc:
                if exc.status != 409:
                    raise

    def all_ready() -> bool:
        nodes = {
            n.metadata.name: n
            for n in cluster.core.list_node(label_selector=_selector(KWOK_NODE_LABELS)).items
        }
        return all(name in nodes and _node_ready(nodes[name]) for name in names)

    wait_for(all_ready, timeout, f"{count} KWOK node(s) Ready (is the KWOK controller running?)")
    return names


def kwok_placement() -> dict:
    """Pod spec fields that put a Pod on KWOK nodes: merge into ``spec`` (or a template's)."""
    return {
        "nodeSelector": dict(KWOK_NODE_LABELS),
        "tolerations": [{"key": KWOK_TAINT_KEY, "operator": "Exists", "effect": "NoSchedule"}],
    }


# --------------------------------------------------------------------------------------------
# The real node (a kubelet + containerd on this machine: ``cluster.sh node-up``)

#: Label and taint of the real node; Pods for it need both the selector and the toleration.
REAL_NODE_LABEL_KEY = "rollout.dev/node"
REAL_NODE_LABEL_VALUE = "real"
#: RuntimeClass (handler ``runc``) and images that ``cluster.sh node-up`` provides.
REAL_NODE_RUNTIME_CLASS = "runc"
REAL_NODE_IMAGE = "rollout.local/python:3-bookworm"
REAL_NODE_PAUSE_IMAGE = "rollout.local/pause:1"
# A cold node-up builds kubelet (if missing) and the images (debootstrap): minutes.
NODE_UP_TIMEOUT_S = int(os.environ.get("ROLLOUT_LOCALKUBE_NODE_UP_TIMEOUT", "2400"))


class RealNodeUnavailable(RuntimeError):
    """No node where Pods really run, and the local one could not be started."""


@dataclass(frozen=True)
class RealNode:
    """A Ready node that runs Pods in real containers, and how to put Pods on it."""

    name: str
    runtime_class: str = REAL_NODE_RUNTIME_CLASS
    image: str = REAL_NODE_IMAGE
    #: The images are imported into the node's containerd, never pulled.
    image_pull_policy: str = "Never"
    #: How long ``cluster.sh node-up`` took here (None when the node was found running).
    start_seconds: float | None = None

    @property
    def node_selector(self) -> dict[str, str]:
        return {REAL_NODE_LABEL_KEY: REAL_NODE_LABEL_VALUE}

    @property
    def tolerations(self) -> list[dict[str, str]]:
        return [{"key": REAL_NODE_LABEL_KEY, "operator": "Exists", "effect": "NoSchedule"}]

    def placement(self) -> dict:
        """Pod spec fields for this node: merge into ``spec`` (or a template's)."""
        return {"nodeSelector": self.node_selector, "tolerations": self.tolerations}

    def run_flags(self) -> list[str]:
        """`rollout run` options that run a batch's episodes on this node."""
        selector = ",".join(f"{k}={v}" for k, v in self.node_selector.items())
        return [
            "--backend",
            "kubernetes",
            "--image",
            self.image,
            "--runtime",
            self.runtime_class,
            "--image-pull-policy",
            self.image_pull_policy,
            "--node-selector",
            selector,
            "--toleration",
            f"{REAL_NODE_LABEL_KEY}:NoSchedule",
        ]

    def batch_fields(self) -> dict:
        """Fields of a batch request (``parse_spec``) that run its episodes on this node."""
        return {
            "image": self.image,
            "image_pull_policy": self.image_pull_policy,
            "runtime": self.runtime_class,
            "node_selector": self.node_selector,
            "tolerations": self.tolerations,
        }


def _ready_real_nodes(cluster: Cluster) -> list[str]:
    nodes = cluster.core.list_node(
        label_selector=f"{REAL_NODE_LABEL_KEY}={REAL_NODE_LABEL_VALUE}"
    ).items
    return sorted(n.metadata.name for n in nodes if _node_ready(n))


def handover_from(cluster: Cluster) -> str | None:
    """ROLLOUT_WARM_HANDOVER_FROM for workers run as processes of this machine: the local real
    node's IP/32 (their connections to its Pods leave from its bridge, whose address is the
    node IP). The node's InternalIP when it is up, else the address node.sh gives it
    (LOCALKUBE_NODE_IP, else 10.89.<ROLLOUT_LOCALKUBE_NODE_ID>.1). None on another cluster:
    its Pod IPs are not this machine's to reach, the hand-over goes by attach."""
    if not cluster.local:
        return None
    nodes = cluster.core.list_node(
        label_selector=f"{REAL_NODE_LABEL_KEY}={REAL_NODE_LABEL_VALUE}"
    ).items
    for node in nodes:
        for address in node.status.addresses or []:
            if address.type == "InternalIP":
                return f"{address.address}/32"
    node_id = os.environ.get("ROLLOUT_LOCALKUBE_NODE_ID") or "0"
    return f"{os.environ.get('LOCALKUBE_NODE_IP') or f'10.89.{node_id}.1'}/32"


def ensure_real_node(cluster: Cluster) -> RealNode:
    """A Ready real node: on the local cluster ``cluster.sh node-up`` starts it if needed.

    On another cluster, the first Ready node labelled ``rollout.dev/node=real``. Raises
    RealNodeUnavailable (with the script's output) when there is none / it cannot start.
    """
    if not cluster.local:
        names = _ready_real_nodes(cluster)
        if not names:
            raise RealNodeUnavailable(
                f"no Ready node labelled {REAL_NODE_LABEL_KEY}={REAL_NODE_LABEL_VALUE} in the "
                f"cluster at {cluster.kubeconfig}"
            )
        return RealNode(names[0])
    t0 = time.monotonic()
    try:
        proc = _run_script("node-up", timeout=NODE_UP_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        raise RealNodeUnavailable(
            f"cluster.sh node-up timed out after {NODE_UP_TIMEOUT_S}s"
        ) from exc
    elapsed = time.monotonic() - t0
    tail = "\n".join(proc.stdout.splitlines()[-80:])
    if proc.returncode != 0:
        raise RealNodeUnavailable(f"cluster.sh node-up failed (exit {proc.returncode}):\n{tail}")
    names = _ready_real_nodes(cluster)
    if not names:
        raise RealNodeUnavailable(f"cluster.sh node-up succeeded but no node is Ready:\n{tail}")
    already = re.search(r"^localkube: node '[^']*' already up", proc.stdout, flags=re.M)
    return RealNode(names[0], start_seconds=None if already else elapsed)


# --------------------------------------------------------------------------------------------
# Simulated Pod logs (KWOK Logs / ClusterLogs objects pointing at CRI-format files)


def write_cri_log(path: Path | str, lines: Iterable[str], *, stream: str = "stdout") -> Path:
    """Write ``lines`` as a CRI-format container log (``<RFC3339Nano> <stream> F <line>``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    t0 = _dt.datetime(2025, 1, 1, tzinfo=_dt.UTC)
    with path.open("w") as f:
        for i, line in enumerate(lines):
            ts = (t0 + _dt.timedelta(milliseconds=i)).strftime("%Y-%m-%dT%H:%M:%S.%f000Z")
            f.write(f"{ts} {stream} F {line}\n")
    # The KWOK controller reads the file itself (it runs on this machine as another process).
    path.chmod(0o644)
    return path


def create_pod_logs(
    cluster: Cluster,
    namespace: str,
    pod_name: str,
    logs_file: Path | str,
    *,
    containers: Sequence[str] | None = None,
    follow: bool = False,
) -> dict:
    """Create a KWOK ``Logs`` object: the Pod ``namespace/pod_name`` serves ``logs_file``."""
    entry: dict = {"logsFile": str(Path(logs_file).resolve()), "follow": follow}
    if containers:
        entry["containers"] = list(containers)
    body = {
        "apiVersion": f"{KWOK_GROUP}/{KWOK_VERSION}",
        "kind": "Logs",
        "metadata": {"name": pod_name, "namespace": namespace},
        "spec": {"logs": [entry]},
    }
    return cluster.custom.create_namespaced_custom_object(
        KWOK_GROUP, KWOK_VERSION, namespace, "logs", body
    )


def create_cluster_logs(
    cluster: Cluster,
    name: str,
    logs_file: Path | str,
    *,
    namespaces: Sequence[str] = (),
    pod_names: Sequence[str] = (),
    containers: Sequence[str] | None = None,
    follow: bool = False,
) -> dict:
    """Create a KWOK ``ClusterLogs`` object: matching Pods serve ``logs_file``.

    The selector matches Pods in ``namespaces`` and/or with names in ``pod_names`` (empty = any).
    """
    entry: dict = {"logsFile": str(Path(logs_file).resolve()), "follow": follow}
    if containers:
        entry["containers"] = list(containers)
    selector = {}
    if namespaces:
        selector["matchNamespaces"] = list(namespaces)
    if pod_names:
        selector["matchNames"] = list(pod_names)
    body = {
        "apiVersion": f"{KWOK_GROUP}/{KWOK_VERSION}",
        "kind": "ClusterLogs",
        "metadata": {"name": name},
        "spec": {"selector": selector, "logs": [entry]},
    }
    return cluster.custom.create_cluster_custom_object(
        KWOK_GROUP, KWOK_VERSION, "clusterlogs", body
    )


def delete_cluster_logs(cluster: Cluster, name: str) -> None:
    try:
        cluster.custom.delete_cluster_custom_object(KWOK_GROUP, KWOK_VERSION, "clusterlogs", name)
    except ApiException as exc:
        if exc.status != 404:
            raise


# --------------------------------------------------------------------------------------------
# Small utilities


def _selector(labels: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in labels.items())


def _exists(read) -> bool:
    try:
        read()
        return True
    except ApiException as exc:
        if exc.status == 404:
            return False
        raise


def wait_for(predicate, timeout: float, what: str, interval: float = 0.2):
    """Poll ``predicate`` until it returns a truthy value; raise TimeoutError after ``timeout``."""
    deadline = time.monotonic() + timeout
    last_exc: Exception | None = None
    while True:
        try:
            value = predicate()
            if value:
                return value
        except ApiException as exc:  # transient API errors: keep polling, report the last one
            last_exc = exc
        if time.monotonic() >= deadline:
            detail = f" (last error: {last_exc})" if last_exc else ""
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}{detail}")
        time.sleep(interval)
