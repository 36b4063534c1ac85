"""The local sandbox really is isolated: run a probe inside the exact command we use."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from rollout_worker.backends.local.backend import describe_python, probe_bwrap
from rollout_worker.backends.local.sandbox import plan_sandbox

PROBE = textwrap.dedent(
    """
    import json, os, socket
    facts = {"uid": os.getuid(), "gid": os.getgid()}
    status = open("/proc/self/status").read().splitlines()
    facts["cap_eff"] = [l.split()[1] for l in status if l.startswith("CapEff")][0]
    try:
        socket.create_connection(("1.1.1.1", 53), timeout=1)
        facts["network"] = "reachable"
    except OSError as exc:
        facts["network"] = type(exc).__name__
    facts["interfaces"] = sorted(n for _, n in socket.if_nameindex())
    try:
        open("/usr/pwned", "w")
        facts["usr_writable"] = True
    except OSError:
        facts["usr_writable"] = False
    facts["tmp_entries"] = os.listdir("/tmp")
    facts["root_dir_visible"] = os.path.exists("/root")
    facts["sa_token"] = os.path.exists("/var/run/secrets/kubernetes.io")
    open("probe-output", "w").write("ok")
    facts["cwd"] = os.getcwd()
    print(json.dumps(facts))
    """
)


def test_bwrap_sandbox_is_unprivileged_offline_and_read_only(open_tmp_path):
    tmp_path = open_tmp_path
    problem = probe_bwrap()
    assert problem is None, f"bubblewrap must work on CI machines: {problem}"
    program = tmp_path / "probe.py"
    program.write_text(PROBE)
    workspace = tmp_path / "ws"
    workspace.mkdir()
    (tmp_path / "host-secret").write_text("x")
    prefix, _ = describe_python("/usr/bin/python3")
    plan = plan_sandbox(
        isolation="bwrap",
        python="/usr/bin/python3",
        python_prefix=prefix,
        program=program,
        workspace=workspace,
        episode_id="probe",
        action="fix",
        running_as_root=os.geteuid() == 0,
    )
    if plan.run_as:
        os.chown(workspace, *plan.run_as)
    done = subprocess.run(
        plan.argv,
        env=plan.env or None,
        cwd=plan.cwd,
        capture_output=True,
        text=True,
        timeout=30,
        user=plan.run_as[0] if plan.run_as else None,
        group=plan.run_as[1] if plan.run_as else None,
        extra_groups=[] if plan.run_as else None,
    )
    assert done.returncode == 0, done.stderr
    facts = json.loads(done.stdout)
    assert (facts["uid"], facts["gid"]) == (1000, 1000)
    # uid 1000 inside is uid 1000 on the host, never host root (even when we are root): what
    # the sandbox writes is owned by 1000 out here.
    assert (workspace / "probe-output").stat().st_uid == 1000
    assert int(facts["cap_eff"], 16) == 0
    assert facts["network"] != "reachable" and facts["interfaces"] == ["lo"]
    assert facts["usr_writable"] is False
    assert facts["tmp_entries"] == []  # private /tmp, not the host's
    assert facts["root_dir_visible"] is False
    assert facts["sa_token"] is False
    assert facts["cwd"] == "/workspace"
    assert (workspace / "probe-output").read_text() == "ok"  # the workspace is the only RW place


def test_episode_program_runs_standalone(tmp_path):
    """The shipped program follows the episode protocol on its own (no sandbox needed)."""
    from rollout_worker.sandbox import episode_program_text

    program = tmp_path / "episode.py"
    program.write_text(episode_program_text())
    env = {"EPISODE_ID": "e-1", "ROLLOUT_WORKSPACE": str(tmp_path), "PATH": os.environ["PATH"]}
    done = subprocess.run(
        [sys.executable, "-B", str(program)], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    ready, reward = (json.loads(line) for line in done.stdout.splitlines())
    assert ready["event"] == "ready" and ready["episode_id"] == "e-1"
    assert reward["reward"] == 1 and reward["tests_exit"] == 0 and reward["baseline_exit"] != 0
    assert ready["at"] <= reward["at"]
    assert "total >= 99" in (tmp_path / "shipping.py").read_text()

    failing = subprocess.run(
        [sys.executable, "-B", str(program)],
        env=env | {"ROLLOUT_ACTION": "none"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert failing.returncode != 0
    assert json.loads(failing.stdout.splitlines()[1])["reward"] == 0


@pytest.mark.parametrize("python", ["/usr/bin/python3"])
def test_python_identity_is_stable(python):
    assert describe_python(python) == describe_python.__wrapped__(python)
