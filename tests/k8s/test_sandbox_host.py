"""A sandbox host on the real node (issue 46, docs/sandbox-hosts.md): a user-namespace Pod
(`hostUsers: false`, `procMount: Unmasked`, the Localhost seccomp profile node.sh installs) runs
the local backend's bubblewrap sandbox as it is launched on a worker machine: the command line
is `plan_sandbox`'s own (its namespaces, a fresh /proc, uid 1000, no capabilities). Pods
without those fields must not be able to."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
from kubernetes.client.rest import ApiException

from rollout_worker.backends.local.sandbox import plan_sandbox

from . import cluster as kc

pytestmark = [pytest.mark.k8s, pytest.mark.k8s_real]

# hack/localkube/seccomp/bwrap-host.json, as node.sh installs it under the kubelet's root.
HOST_PROFILE = "rollout/bwrap-host.json"
POD_TMP = "/tmp"
PROGRAM = f"{POD_TMP}/probe.py"
WORKSPACE = f"{POD_TMP}/workspace"

# What the sandboxed program reports: who it is, what it sees of processes and network.
PROBE = """\
import json, os
status = dict(l.split(':\\t', 1) for l in open('/proc/self/status').read().splitlines()
              if ':\\t' in l)
print(json.dumps({
    'uid': os.getuid(), 'gid': os.getgid(), 'pid': os.getpid(),
    'procs': sorted(int(p) for p in os.listdir('/proc') if p.isdigit()),
    'cap_eff': status['CapEff'], 'uid_map': open('/proc/self/uid_map').read().split(),
    'net': sorted(l.split(':')[0].strip() for l in open('/proc/net/dev').readlines()[2:]),
    'cwd': os.getcwd(),
    'cost_source': os.environ.get('ROLLOUT_COST_SOURCE'),
}))
"""

# The Pod's own process: writes the probe, then runs the sandbox's argv and reports.
LAUNCHER = """\
import json, os, subprocess
os.makedirs(os.environ['WORKSPACE'], exist_ok=True)
with open(os.environ['PROGRAM'], 'w') as f:
    f.write(os.environ['PROBE'])
done = subprocess.run(json.loads(os.environ['SANDBOX_ARGV']), capture_output=True, text=True,
                      timeout=60)
print(json.dumps({'pod_uid_map': open('/proc/self/uid_map').read().split(),
                  'rc': done.returncode, 'out': done.stdout, 'err': done.stderr}))
"""


def _sandbox_argv() -> list[str]:
    """The local backend's bwrap command line for one episode, with the Pod's paths."""
    plan = plan_sandbox(
        isolation="bwrap",
        python="/usr/bin/python3",
        python_prefix="/usr",
        program=Path(PROGRAM),
        workspace=Path(WORKSPACE),
        episode_id="host-probe",
        action="run",
        running_as_root=False,
    )
    assert plan.argv[0] == "bwrap" and "--proc" in plan.argv and "--unshare-all" in plan.argv
    return plan.argv


def _pod(node: kc.RealNode, name: str, *, host_users: bool, seccomp: dict, proc_mount: str):
    container_context = {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "readOnlyRootFilesystem": True,
        "privileged": False,
    }
    if proc_mount != "Default":
        container_context["procMount"] = proc_mount
    env = {
        "PROGRAM": PROGRAM,
        "WORKSPACE": WORKSPACE,
        "PROBE": PROBE,
        "SANDBOX_ARGV": json.dumps(_sandbox_argv()),
    }
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            **node.placement(),
            "runtimeClassName": node.runtime_class,
            "restartPolicy": "Never",
            "automountServiceAccountToken": False,
            "enableServiceLinks": False,
            "hostUsers": host_users,
            "securityContext": {
                "runAsUser": 1000,
                "runAsGroup": 1000,
                "runAsNonRoot": True,
                "seccompProfile": seccomp,
            },
            "containers": [
                {
                    "name": "host",
                    "image": node.image,
                    "imagePullPolicy": node.image_pull_policy,
                    "command": ["python3", "-B", "-c", LAUNCHER],
                    "env": [{"name": k, "value": v} for k, v in env.items()],
                    "securityContext": container_context,
                    "volumeMounts": [{"name": "tmp", "mountPath": POD_TMP}],
                }
            ],
            "volumes": [{"name": "tmp", "emptyDir": {"sizeLimit": "64Mi"}}],
        },
    }


LOCALHOST = {"type": "Localhost", "localhostProfile": HOST_PROFILE}
RUNTIME_DEFAULT = {"type": "RuntimeDefault"}


def _run_pods(cluster: kc.Cluster, namespace: str, pods: dict[str, dict]) -> dict[str, dict]:
    """Create the Pods together, wait for each to end; its launcher's report by name."""
    for body in pods.values():
        cluster.core.create_namespaced_pod(namespace, body)
    reports = {}
    for name in pods:

        def ended(name=name):
            pod = cluster.core.read_namespaced_pod_status(name, namespace)
            return pod if pod.status.phase in ("Succeeded", "Failed") else None

        pod = kc.wait_for(ended, 180, f"Pod {name} to finish", interval=0.5)
        log = cluster.core.read_namespaced_pod_log(name, namespace)
        assert pod.status.phase == "Succeeded", f"{name}: {pod.status}\n{log}"
        reports[name] = json.loads(log.strip().splitlines()[-1])
    return reports


def test_node_runtime_reports_user_namespaces(k8s_cluster, real_node):
    """The kubelet admits `hostUsers: false` only when the runtime says it can (containerd 2 with
    runc >= 1.2); Debian's containerd 1.6 did not."""
    node = k8s_cluster.core.read_node(real_node.name)
    handlers = {h.name: h.features for h in node.status.runtime_handlers or []}
    assert "runc" in handlers, handlers
    assert handlers["runc"] is not None and handlers["runc"].user_namespaces is True, handlers
    version = node.status.node_info.container_runtime_version
    assert version.startswith("containerd://2."), version


def test_user_namespace_pod_runs_the_local_sandbox(k8s_cluster, k8s_namespace, real_node):
    """The host Pod runs the local backend's bwrap sandbox: own user namespace mapped to its
    uid 1000, PID namespace with a fresh /proc (only its own process), no network but
    loopback, no capabilities. Pods missing `hostUsers: false` or the profile cannot."""
    suffix = uuid.uuid4().hex[:6]
    pods = {
        f"host-{suffix}": _pod(
            real_node, f"host-{suffix}", host_users=False, seccomp=LOCALHOST, proc_mount="Unmasked"
        ),
        # Today's sandbox Pods: host users, RuntimeDefault, masked /proc.
        f"plain-{suffix}": _pod(
            real_node,
            f"plain-{suffix}",
            host_users=True,
            seccomp=RUNTIME_DEFAULT,
            proc_mount="Default",
        ),
        # A user namespace alone: RuntimeDefault still refuses the namespace calls.
        f"userns-only-{suffix}": _pod(
            real_node,
            f"userns-only-{suffix}",
            host_users=False,
            seccomp=RUNTIME_DEFAULT,
            proc_mount="Unmasked",
        ),
        # The profile without an unmasked /proc: the kernel refuses bwrap's new procfs.
        f"masked-{suffix}": _pod(
            real_node,
            f"masked-{suffix}",
            host_users=False,
            seccomp=LOCALHOST,
            proc_mount="Default",
        ),
    }
    reports = _run_pods(k8s_cluster, k8s_namespace, pods)

    host = reports[f"host-{suffix}"]
    assert host["rc"] == 0, host
    # The Pod's root is not the node's: uid 0 inside maps to a range of its own.
    inside, outside, length = host["pod_uid_map"]
    assert (inside, length) == ("0", "65536") and outside != "0", host
    facts = json.loads(host["out"])
    assert facts == {
        "uid": 1000,
        "gid": 1000,
        "pid": 1,
        "procs": [1],
        "cap_eff": "0000000000000000",
        # bwrap nests a second user namespace (--dev needs a devpts made as root): 1000 there
        # is 0 of its first one, itself the Pod's uid 1000, as on a worker machine.
        "uid_map": ["1000", "0", "1"],
        "net": ["lo"],
        "cwd": "/workspace",
        "cost_source": "proc",
    }, host

    for kind in ("plain", "userns-only", "masked"):
        report = reports[f"{kind}-{suffix}"]
        assert report["rc"] != 0 and not report["out"], (kind, report)
        assert report["err"].startswith("bwrap: "), (kind, report)
    # Which step each one fails at: creating the namespaces, or mounting the new /proc.
    assert "proc" not in reports[f"plain-{suffix}"]["err"], reports
    assert "proc" not in reports[f"userns-only-{suffix}"]["err"], reports
    assert "Can't mount proc" in reports[f"masked-{suffix}"]["err"], reports


def test_unmasked_proc_needs_a_user_namespace(k8s_cluster, k8s_namespace, real_node):
    """The API refuses `procMount: Unmasked` on a Pod that shares the node's users."""
    body = _pod(
        real_node,
        "unmasked-host-users",
        host_users=True,
        seccomp=LOCALHOST,
        proc_mount="Unmasked",
    )
    with pytest.raises(ApiException) as refused:
        k8s_cluster.core.create_namespaced_pod(k8s_namespace, body)
    assert refused.value.status == 422
    assert "hostUsers" in refused.value.body, refused.value.body
