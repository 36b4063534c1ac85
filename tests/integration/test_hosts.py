"""Sandbox hosts (issue 46) without Kubernetes: host agents as real processes (`python -m
rollout_worker.backends.host.agent`) on a real redis-server, each episode in a real bwrap
sandbox with the scripted policy in the loop.

The first tests drive the hosts' queue directly (what HostBackend enqueues, what it reads);
the last ones run whole batches through real Celery workers (`backend: kubernetes`,
`isolation: host`), as a trainer submits them.
"""

from __future__ import annotations

import copy
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import orjson
import pytest
import redis

from rollout_wire import constants as k
from rollout_wire.codec import decode_entry
from rollout_wire.errors import BackendUnavailable
from rollout_wire.request import BatchSpec, parse_spec
from rollout_wire.tasksets import load_task_set
from rollout_worker.backends.host.agent import Agent
from rollout_worker.backends.host.backend import HostBackend
from rollout_worker.backends.host.queue import HostQueue
from rollout_worker.backends.host.run import Machine
from rollout_worker.backends.local.run_file import run_document
from rollout_worker.backends.local.sandbox import rootfs_dirname
from rollout_worker.cli.policy_server import bundled_script, running
from rollout_worker.cli.stack import LocalStack
from rollout_worker.settings import Settings

HARBOR = Path(__file__).resolve().parents[1] / "data" / "harbor"
# Short leases: a lost host's episodes go back to the list after this, not the default 15 s.
LEASE_SECONDS = 3.0
# The scripted policy's answers to the fresh-workspace task: the first thing its episode does
# is list its workspace; its test passes only when that listing is the task's files alone (its
# file and its test file, which this task format puts in the workspace).
FRESH_TASK = {
    "id": "fresh-workspace",
    "statement": "List the workspace, then submit.",
    "files": {"seed.txt": "seed\n"},
    "test_files": {
        "test_fresh.py": (
            "import unittest\n\n\n"
            "class FreshTest(unittest.TestCase):\n"
            "    def test_the_workspace_held_only_the_task_files(self):\n"
            "        with open('seen.txt') as seen:\n"
            "            self.assertEqual(seen.read(), 'seed.txt\\ntest_fresh.py\\n')\n"
        )
    },
    "test_command": ["python", "-B", "-m", "unittest", "-v"],
    "reward": "all",
    "time_limit_seconds": 60,
}
FRESH_PLAN = [
    {"tool": "run", "arguments": {"command": "ls -A > /tmp/seen && mv /tmp/seen seen.txt"}},
    {"tool": "submit", "arguments": {}},
]


def script() -> dict:
    found = copy.deepcopy(bundled_script())
    found["tasks"]["fresh-workspace"] = {"plans": [FRESH_PLAN]}
    return found


def wait_for(what: Callable[[], object], timeout: float, why: str) -> object:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        found = what()
        if found:
            return found
        time.sleep(0.05)
    raise AssertionError(f"not within {timeout:.0f}s: {why}")


# Every agent a test started: killed at its end if the test failed before it stopped them.
STARTED: list[subprocess.Popen[bytes]] = []


class Host:
    """One agent process, its root and its output."""

    def __init__(self, redis_url: str, name: str, base: Path, slots: int = 2, *extra: str) -> None:
        self.name = name
        self.root = base / name
        self.out = base / f"{name}.out"
        with open(self.out, "wb") as out:
            self.proc = subprocess.Popen(
                [
                    *(sys.executable, "-m", "rollout_worker.backends.host.agent"),
                    *("--redis-url", redis_url, "--name", name, "--slots", str(slots)),
                    *("--root", str(self.root), "--lease-seconds", str(LEASE_SECONDS)),
                    *extra,
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        STARTED.append(self.proc)

    def left(self) -> list[str]:
        """What is under its root but the program it links into each run."""
        return sorted(p.name for p in self.root.iterdir() if p.name != "_program")

    def output(self) -> str:
        return self.out.read_text(errors="replace")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(30)


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    stack = LocalStack()
    stack.start_redis()
    try:
        yield stack.redis_url
    finally:
        stack.stop()


@pytest.fixture
def queue(redis_url: str) -> Iterator[HostQueue]:
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    yield HostQueue(client)
    client.close()


@pytest.fixture
def base() -> Iterator[Path]:
    # Not pytest's tmp_path: the sandboxes' user (uid 1000) must pass through to the roots.
    path = Path(f"/tmp/rollout-hosts-test-{os.getpid()}-{time.monotonic_ns()}")
    path.mkdir(mode=0o755)
    yield path
    while STARTED:
        proc = STARTED.pop()
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    subprocess.run(["rm", "-rf", str(path)], check=False)


def enqueue(queue: HostQueue, spec: BatchSpec, redis_url: str, deadline: float = 300) -> str:
    doc = run_document(
        spec,
        isolation="bwrap",
        python="/usr/bin/python3",
        rootfs_dir="/nonexistent",
        node="worker",
        redis_url=redis_url,
        record_ttl=600,
    )
    queue.enqueue(
        spec.batch_id,
        doc["run_uid"],
        orjson.dumps(doc),
        spec.count,
        spec.parallelism,
        time.time() + deadline,
        spec.infra_retries,
    )
    return str(doc["run_uid"])


def slow_spec(server_url: str, count: int = 2, **fields: object) -> BatchSpec:
    """Episodes of a few seconds (each turn of the policy waits): still running when the test
    acts on them."""
    return parse_spec(
        {
            "tasks": load_task_set("bundled", only=["shipping-boundary"]),
            "samples_per_task": count,
            "policy": {"model": "scripted", "url": server_url, "request_timeout_seconds": 30},
        }
        | fields,
        max_episodes=100,
    )


def sandboxes(root: Path) -> list[int]:
    """Pids of the bwrap processes running an episode under `root`, one per sandbox: bwrap
    forks its namespace's init from itself (same command line), and counting that child too
    made a sandbox starting or ending look like two."""
    found: dict[int, int] = {}  # pid -> parent pid
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                argv = (proc / "cmdline").read_bytes().split(b"\0")
                stat = (proc / "stat").read_text()
            except OSError:
                continue
            if argv[0].endswith(b"bwrap") and any(str(root).encode() in a for a in argv):
                found[int(proc.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    return [pid for pid, parent in found.items() if parent not in found]


pytestmark = pytest.mark.redis


def test_a_host_whose_lease_was_taken_kills_that_sandbox_and_records_nothing(
    queue, redis_url, base
):
    host = Host(redis_url, "h-lease", base)
    with running(turn_seconds=2.0) as server:
        spec = slow_spec(server.url)
        run_uid = enqueue(queue, spec, redis_url)
        batch = spec.batch_id
        wait_for(lambda: len(queue.taken(batch)) == 2, 20, "both episodes taken")
        wait_for(lambda: len(sandboxes(host.root)) == 2, 20, "two sandboxes running")
        # The queue gives episode 0 up (what a host silent for a lease's time gets): with no
        # retry budget it ends HostLost at once, whatever the host still does.
        queue.redis.delete(k.host_batch_key(batch, "lease:0"))
        assert queue.reap(batch) == []
        assert queue.status(batch, 0)["reason"] == "HostLost"
        wait_for(lambda: len(sandboxes(host.root)) == 1, 5, "the lost episode's sandbox killed")
        wait_for(lambda: len(queue.statuses(batch)) == 2, 30, "the other episode ended")
    statuses = queue.statuses(batch)
    assert statuses[0]["reason"] == "HostLost"  # not overwritten by the host that lost it
    assert statuses[1]["phase"] == "Succeeded" and statuses[1]["node"] == "h-lease"
    assert queue.delete(batch, run_uid)
    wait_for(lambda: host.left() == [], 10, f"{host.root} emptied")
    assert host.stop() == 0
    assert queue.hosts() == {}


def test_an_episode_given_back_to_the_host_that_still_runs_it_runs_there_once_at_a_time(
    queue, redis_url, base
):
    host = Host(redis_url, "h-again", base)  # two slots: one free to take the episode again
    with running(turn_seconds=1.0) as server:
        spec = slow_spec(server.url, count=1, infra_retries=1)
        enqueue(queue, spec, redis_url)
        batch = spec.batch_id
        wait_for(lambda: len(sandboxes(host.root)) == 1, 20, "its sandbox running")
        # The queue gives the episode up while the host still runs it (renewals it missed):
        # with a retry left it goes back to the list, and this host's free slot takes it.
        queue.redis.delete(k.host_batch_key(batch, "lease:0"))
        given_back = time.time()
        assert queue.reap(batch) == [0]
        most = 0
        while not queue.statuses(batch) and time.time() < given_back + 40:
            most = max(most, len(sandboxes(host.root)))
            time.sleep(0.02)
    status = queue.status(batch, 0)
    assert status is not None, host.output()
    # The old sandbox was killed before the new one started, and its end was dropped: what
    # is recorded is the new sandbox's run, under the new lease.
    assert most == 1, host.output()
    assert status["phase"] == "Succeeded" and status["created_at"] > given_back, status
    assert [a["reason"] for a in status["retried"]] == ["HostLost"]
    assert status["episode_id"].endswith("-retry1")
    assert host.stop() == 0


def test_a_retry_on_a_host_is_an_attempt_the_queue_knows(queue, redis_url, base):
    host = Host(redis_url, "h-retry", base)
    outage = copy.deepcopy(bundled_script())
    plans = outage["tasks"]["shipping-boundary"]["plans"]
    plans[0] = [{**plans[0][0], "unavailable_on_attempts": [0]}, *plans[0][1:]]
    # The first attempt's first turn gets a 503 (exit 4); the host runs it again itself.
    with running(script=outage) as server:
        policy = {"model": "scripted", "url": server.url, "max_retries": 0}
        spec = slow_spec(server.url, count=1, infra_retries=1, policy=policy)
        enqueue(queue, spec, redis_url)
        status = wait_for(lambda: queue.status(spec.batch_id, 0), 60, "the episode's end")
    assert isinstance(status, dict) and status["phase"] == "Succeeded", status
    (first,) = status["retried"]
    assert first["exit_code"] == 4 and status["episode_id"].endswith("-retry1")
    # Were the host lost next, the queue would count this attempt (budget, sandbox name).
    assert queue.attempts(spec.batch_id, 0) == status["retried"]
    assert host.stop() == 0


def test_a_stopped_batch_is_killed_and_a_terminated_host_drains_then_exits(queue, redis_url, base):
    host = Host(redis_url, "h-drain", base)
    with running(turn_seconds=1.0) as server:
        stopped, drained = slow_spec(server.url), slow_spec(server.url)
        enqueue(queue, stopped, redis_url)
        wait_for(lambda: len(sandboxes(host.root)) == 2, 20, "two sandboxes running")
        queue.stop(stopped.batch_id)
        wait_for(lambda: len(queue.statuses(stopped.batch_id)) == 2, 10, "stopped ends")
        assert {s["reason"] for s in queue.statuses(stopped.batch_id).values()} == {"Stopped"}
        enqueue(queue, drained, redis_url)
        wait_for(lambda: len(queue.taken(drained.batch_id)) == 2, 20, "both taken")
        host.proc.send_signal(signal.SIGTERM)
        # Drained: the running episodes end as they would have, then the host leaves.
        assert host.proc.wait(30) == 0
    statuses = queue.statuses(drained.batch_id)
    assert sorted(statuses) == [0, 1]
    assert {s["phase"] for s in statuses.values()} == {"Succeeded"}, statuses
    assert host.left() == [] and sandboxes(host.root) == []
    assert queue.hosts() == {}


def test_a_batch_larger_than_the_hosts_slots_is_refused_before_it_starts(queue, redis_url, base):
    host = Host(redis_url, "h-small", base, 1, "--slot-memory", "64Mi", "--slot-storage", "1Gi")
    beat = wait_for(lambda: queue.hosts().get("h-small"), 20, "its heartbeat")
    assert (beat["slot_memory_bytes"], beat["slot_storage_bytes"]) == (64 * 2**20, 2**30)
    backend = HostBackend(Settings(redis_url=redis_url))

    def sized(memory: str, storage: str = "1Gi") -> BatchSpec:
        resources = {"memory_request": memory, "memory_limit": memory, "storage_limit": storage}
        request = {"backend": "kubernetes", "isolation": "host", "count": 1}
        return parse_spec(request | {"resources": resources}, max_episodes=None)

    assert backend.preflight(sized("64Mi")) == []
    for spec, what in ((sized("128Mi"), "memory"), (sized("64Mi", "2Gi"), "storage")):
        with pytest.raises(BackendUnavailable, match=f"{what} bytes .* over a host slot's"):
            backend.preflight(spec)
    assert queue.runs() == {}  # nothing was created
    assert host.stop() == 0


def test_an_agent_refuses_to_start_without_redis(base):
    done = subprocess.run(
        [
            *(sys.executable, "-m", "rollout_worker.backends.host.agent"),
            *("--redis-url", "redis://127.0.0.1:9/0", "--root", str(base / "r")),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "unreachable" in done.stderr


# -- task images ----------------------------------------------------------------------------
# What an image task's episode runs in the test's image: its runner's Python, the task's bash
# scripts and the tools they call.
IMAGE_TOOLS = ("python3", "bash", "sh", "dash", "mkdir", "cat", "ls", "rm", "cp", "mv", "env")


def _link(source: str | Path, target: str | Path) -> None:
    try:
        os.link(source, target)
    except OSError:  # another filesystem
        shutil.copy2(source, target)


def system_rootfs(dest: Path) -> None:
    """A task image's root made of this machine's own files (no download, no Docker): the
    system Python with its standard library, bash and a few tools, and the libraries they
    load, hard-linked. Nothing of ours in it (no /sandbox, /workspace...): as a Kubernetes
    image volume shows an image, unlike `rollout tasks build --rootfs`."""
    python = Path(os.path.realpath("/usr/bin/python3"))
    stdlib = Path("/usr/lib") / python.name
    assert stdlib.is_dir(), f"no standard library for {python} at {stdlib}"
    (dest / "usr" / "bin").mkdir(parents=True)
    shutil.copytree(stdlib, dest / "usr" / "lib" / python.name, symlinks=True, copy_function=_link)
    binaries = [python]
    _link(python, dest / "usr" / "bin" / python.name)
    for tool in IMAGE_TOOLS:
        found, target = Path("/usr/bin") / tool, dest / "usr" / "bin" / tool
        if found.is_symlink():
            target.symlink_to(os.readlink(found))
        else:
            _link(found, target)
        binaries.append(Path(os.path.realpath(found)))
    modules = sorted(str(p) for p in (stdlib / "lib-dynload").glob("*.so"))
    listed = subprocess.run(
        ["ldd", *map(str, binaries), *modules], capture_output=True, text=True, timeout=60
    ).stdout
    for found in re.findall(r"(/\S+) \(0x[0-9a-f]+\)", listed):
        relative = Path(found).relative_to("/")
        if relative.parts[0] != "usr":  # merged /usr: /lib/x -> usr/lib/x
            relative = Path("usr", *relative.parts)
        target = dest / relative
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            _link(os.path.realpath(found), target)
    for top in ("bin", "lib", "lib64"):
        (dest / top).symlink_to(f"usr/{top}")


def image_task() -> dict:
    """The Harbor task that is its image (environment/Dockerfile, WORKDIR /app), and in the
    test's image the folder its Dockerfile copies (/app, writable by anyone)."""
    (task,) = load_task_set(str(HARBOR), ["image-task"])
    assert task["image"] and not task["files"] and task["workdir"] == "/app"
    return task


def carry(base: Path, image: str) -> Path:
    """A hosts' --rootfs holding `image`'s root as an image volume would: its files only."""
    rootfs = base / "images"
    root = rootfs / rootfs_dirname(image)
    system_rootfs(root)
    app = root / "app"
    app.mkdir()
    shutil.copy(HARBOR / "image-task" / "environment" / "greet.py", app / "greet.py")
    app.chmod(0o777)
    (app / "greet.py").chmod(0o666)
    rootfs.chmod(0o755)
    return rootfs


def tree(root: Path) -> list[tuple[str, int, int]]:
    """Every path under `root` with its size and mtime: what an episode could have changed."""
    found = []
    for folder, dirs, files in os.walk(root):
        for name in sorted([*dirs, *files]):
            path = Path(folder) / name
            st = path.lstat()
            found.append((str(path.relative_to(root)), st.st_size, st.st_mtime_ns))
    return sorted(found)


def test_an_image_task_is_refused_unless_every_live_host_carries_its_image(queue, redis_url, base):
    task = image_task()
    folder = rootfs_dirname(task["image"])
    rootfs = base / "images"
    (rootfs / folder).mkdir(parents=True)  # a mounted image, as far as the heartbeat goes
    carrier = Host(
        redis_url,
        "h-carrier",
        base,
        1,
        "--rootfs",
        str(rootfs),
        "--image-workdir",
        f"{task['image']}=/app",
    )
    bare = Host(redis_url, "h-bare", base, 1)
    wait_for(lambda: {"h-carrier", "h-bare"} <= set(queue.hosts()), 20, "both heartbeats")
    assert queue.hosts()["h-carrier"]["images"] == [folder]
    assert (rootfs / f"{folder}.workdir").read_text() == "/app\n"  # written by the agent
    assert queue.hosts()["h-bare"]["images"] == []
    backend = HostBackend(Settings(redis_url=redis_url))
    request = {"backend": "kubernetes", "isolation": "host", "tasks": [task], "agent": "oracle"}
    spec = parse_spec(request, max_episodes=None)
    # Any host takes any episode: one host without the image and the batch is refused.
    with pytest.raises(BackendUnavailable) as refused:
        backend.preflight(spec)
    assert (
        f"task image {task['image']} (folder {folder}): sandbox hosts ['h-bare'] do not "
        "carry it (their images: {'h-bare': []})" in str(refused.value)
    )
    assert carrier.stop() == 0
    with pytest.raises(BackendUnavailable, match="no live sandbox host carries it"):
        backend.preflight(spec)
    assert queue.runs() == {}  # nothing was created
    # Past preflight (a host that joined after it): the host without the image does not run
    # the episode on its own root, it fails its start and says why.
    enqueue(queue, spec, redis_url)
    status = wait_for(lambda: queue.status(spec.batch_id, 0), 30, "the episode's end")
    assert isinstance(status, dict) and status["reason"] == "StartError", status
    assert status["node"] == "h-bare"
    assert f"does not carry the task image {task['image']}" in bare.output()
    assert bare.stop() == 0


# -- whole batches through real Celery workers -----------------------------------------------
def start_hosts(stack: LocalStack, base: Path, *names: str) -> list[Host]:
    hosts = [Host(stack.redis_url, name, base) for name in names]
    queue = HostQueue(redis.Redis.from_url(stack.redis_url))
    wait_for(lambda: set(names) <= set(queue.hosts()), 30, f"{names} heartbeating")
    return hosts


def batch_keys(client: redis.Redis, batch: str) -> list[bytes]:
    return list(client.scan_iter(match=k.host_batch_key(batch, "*")))


def host_batch(server_url: str, tasks: list[dict], **fields: object) -> dict:
    return {
        "backend": "kubernetes",
        "isolation": "host",
        "tasks": tasks,
        "samples_per_task": 2,
        "parallelism": 4,
        "policy": {"url": server_url, "request_timeout_seconds": 10, "max_retries": 0},
    } | fields


@pytest.mark.workers
def test_two_hosts_run_a_batch_each_episode_once_in_a_fresh_sandbox(client, stack, base):
    hosts = start_hosts(stack, base, "host-a0", "host-a1")
    tasks = [*load_task_set("bundled"), FRESH_TASK]
    with running(script=script()) as server:
        batch = client.submit(**host_batch(server.url, tasks)).batch_id
        report = client.wait(batch, timeout=120)
    count = 2 * len(tasks)
    rows = report["pods"]
    assert sorted(r["index"] for r in rows) == list(range(count)), report["errors"]
    assert len({r["pod"] for r in rows}) == count  # one sandbox per episode, never reused
    assert {r["node"] for r in rows} == {"host-a0", "host-a1"}
    assert report["run_isolation"] == "host"
    fresh = [r for r in rows if r["task_id"] == "fresh-workspace"]
    # Each saw only its task's files: no other episode's left in its workspace.
    assert [(r["status"], r["reward"]) for r in fresh] == [("ok", 1), ("ok", 1)], fresh
    shipped = [r["reward"] for r in rows if r["task_id"] == "shipping-boundary"]
    assert shipped == [1, 1]
    assert report["infrastructure_failures"] == 0 and report["lost_episodes"] == 0
    # Counted once: one episode entry per index in the trainer's stream.
    entries = [decode_entry(d) for _, d in client.redis.xrange(k.stream_key(batch))]
    streamed = [e.index for e in entries if e.type == k.ENTRY_EPISODE]
    assert sorted(streamed) == list(range(count))
    # Nothing left: the run's keys go with its cleanup, the hosts' folders after it.
    wait_for(lambda: not batch_keys(client.redis, batch), 30, "the run's host keys deleted")
    wait_for(lambda: all(h.left() == [] for h in hosts), 10, "the hosts' roots emptied")
    assert [h.stop() for h in hosts] == [0, 0]


@pytest.mark.workers
def test_a_host_killed_mid_batch_loses_nothing(client, stack, base):
    doomed, spare = start_hosts(stack, base, "host-b0", "host-b1")
    queue = HostQueue(client.redis)
    tasks = load_task_set("bundled", only=["shipping-boundary", "fizzbuzz-order"])
    # Each turn waits: the doomed host is still running its episodes when it is killed.
    with running(script=script(), turn_seconds=1.0) as server:
        batch = client.submit(**host_batch(server.url, tasks, infra_retries=1)).batch_id
        held = wait_for(
            lambda: [i for i, h in queue.taken(batch).items() if h == "host-b0"],
            30,
            "the doomed host running episodes",
        )
        doomed.proc.kill()  # SIGKILL: no drain, no goodbye; its leases just stop renewing
        report = client.wait(batch, timeout=90)
    rows = {r["index"]: r for r in report["pods"]}
    assert sorted(rows) == [0, 1, 2, 3], report["errors"]
    assert all(r["status"] == "ok" for r in rows.values()), report["errors"]
    lost = {i for i, r in rows.items() if any(a["reason"] == "HostLost" for a in r["retried"])}
    assert set(held) <= lost  # each episode the host held ran again elsewhere
    for index in lost:
        row = rows[index]
        assert row["node"] == "host-b1", row
        assert row["retried"][0]["host"] == "host-b0"
        assert row["pod"].endswith("-retry1")  # a fresh sandbox name for the new attempt
    # The killed host's sandboxes died with it (bwrap --die-with-parent).
    wait_for(lambda: sandboxes(doomed.root) == [], 10, "the killed host's sandboxes gone")
    wait_for(lambda: not batch_keys(client.redis, batch), 30, "the run's host keys deleted")
    wait_for(lambda: spare.left() == [], 10, "the spare host's root emptied")
    assert spare.stop() == 0


def test_a_loop_stuck_longer_than_a_lease_loses_no_episode(queue, redis_url, base, monkeypatch):
    # The agent's loop stuck (a slow Redis call, a slow disk) for more than a lease: its
    # leases are renewed meanwhile, on their own thread and client, so the queue never gives
    # its episode to another host. An agent in this process, to hold its loop.
    name = "h-stuck"
    machine = Machine(
        node=name,
        python=Settings().local_python,
        redis_url=redis_url,
        rootfs_dir=Path("/rootfs"),
    )
    agent = Agent(
        redis.Redis.from_url(redis_url, socket_timeout=10),
        name=name,
        slots=1,
        root=base / name,
        machine=machine,
        lease_seconds=LEASE_SECONDS,
        renew_client=redis.Redis.from_url(redis_url, socket_timeout=1),
    )
    stuck, look = threading.Event(), agent.look

    def stuck_look() -> None:
        if agent.runs and not stuck.is_set():
            stuck.set()
            time.sleep(2.5 * LEASE_SECONDS)
        look()

    monkeypatch.setattr(agent, "look", stuck_look)
    loop = threading.Thread(target=agent.serve, daemon=True)
    loop.start()
    with running(turn_seconds=1.0) as server:
        spec = slow_spec(server.url, count=1, infra_retries=1)
        enqueue(queue, spec, redis_url)
        batch = spec.batch_id
        wait_for(stuck.is_set, 20, "the loop stuck with an episode of its own")
        end = time.monotonic() + 2 * LEASE_SECONDS
        while time.monotonic() < end:
            assert queue.reap(batch) == [], "the lease expired while the loop was stuck"
            assert queue.taken(batch) == {0: name}
            time.sleep(0.2)
        status = wait_for(lambda: queue.status(batch, 0), 60, "the episode's end")
    assert isinstance(status, dict) and status["phase"] == "Succeeded", status
    assert status["retried"] == [] and status["node"] == name
    agent.drain()
    loop.join(30)
    assert not loop.is_alive() and queue.hosts() == {}


@pytest.mark.workers
def test_an_image_task_runs_in_its_image_on_a_host_that_carries_it(client, stack, base):
    task = image_task()
    rootfs = carry(base, task["image"])
    root = rootfs / rootfs_dirname(task["image"])
    before = tree(root)
    host = Host(
        stack.redis_url,
        "host-img",
        base,
        2,
        "--rootfs",
        str(rootfs),
        "--image-workdir",
        f"{task['image']}=/app",
    )
    queue = HostQueue(client.redis)
    beat = wait_for(lambda: queue.hosts().get("host-img"), 30, "its heartbeat")
    assert beat["images"] == [rootfs_dirname(task["image"])]
    # The oracle writes /app/greet.py and the tests read it there: /app is the image's (the
    # host's own root has none), the episode's copy of it at the image's WORKDIR.
    batch = client.submit(
        backend="kubernetes", isolation="host", tasks=[task], samples_per_task=2, agent="oracle"
    ).batch_id
    report = client.wait(batch, timeout=120)
    rows = report["pods"]
    assert [(r["status"], r["reward"]) for r in rows] == [("ok", 1), ("ok", 1)], (
        report["errors"],
        host.output(),
    )
    assert {r["node"] for r in rows} == {"host-img"}
    assert len({r["pod"] for r in rows}) == 2  # a fresh sandbox each
    # Shared by every episode, read-only: nothing was written into the image's root (the
    # oracle's edit went to each episode's own copy of /app).
    assert tree(root) == before
    wait_for(lambda: not batch_keys(client.redis, batch), 30, "the run's host keys deleted")
    wait_for(lambda: host.left() == [], 10, "the host's root emptied")
    assert host.stop() == 0


# -- warm sandboxes inside hosts (host/warm.py) ----------------------------------------------
def sandbox_processes(root: Path) -> set[int]:
    """Every process of the sandboxes under `root`: each bwrap and all it started."""
    found = set(sandboxes(root))
    todo = list(found)
    while todo:
        pid = todo.pop()
        try:
            tasks = list(Path(f"/proc/{pid}/task").iterdir())
        except OSError:
            continue
        for task in tasks:
            try:
                children = {int(c) for c in (task / "children").read_text().split()}
            except OSError:
                continue
            todo += children - found
            found |= children
    return found


def alive(pids: set[int]) -> set[int]:
    """Those of `pids` still running (a zombie is reaped by nobody but its parent)."""
    running = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            running.add(pid)
    return running


def waiting_homes(host: Host, batch: str) -> list[str]:
    """The homes of the batch's waiting (and handed-out) sandboxes on the host."""
    warm = host.root / batch / "warm"
    return sorted(p.name for p in warm.iterdir()) if warm.is_dir() else []


def watch(
    host: Host, queue: HostQueue, batch: str, until: Callable[[], bool], timeout: float
) -> tuple[int, set[int]]:
    """Until `until()`: the most sandboxes the host ran beyond the batch's episodes it held
    (its waiting ones) and every process of its sandboxes seen meanwhile."""
    most, seen = 0, set()
    end = time.monotonic() + timeout
    while not until():
        assert time.monotonic() < end, f"not within {timeout:.0f}s: {host.output()[-3000:]}"
        held = len(queue.taken(batch))
        running = sandboxes(host.root)
        most = max(most, len(running) - held)
        seen |= sandbox_processes(host.root)
        time.sleep(0.05)
    return most, seen


def test_a_warm_host_batch_hands_first_attempts_to_waiting_sandboxes_and_leaves_none(
    queue, redis_url, base
):
    host = Host(redis_url, "h-warm", base, 3)
    with running(turn_seconds=1.0) as server:
        spec = slow_spec(server.url, count=3, parallelism=1, warm_pool=2)
        enqueue(queue, spec, redis_url)
        batch = spec.batch_id
        most, seen = watch(host, queue, batch, lambda: len(queue.statuses(batch)) == 3, 90)
        # When the last episode ended, no sandbox of the batch waited any more (the host keeps
        # none beyond the episodes left to take), though its run is still open there.
        left_at_end = sandboxes(host.root), waiting_homes(host, batch)
    statuses = queue.statuses(batch)
    assert {s["phase"] for s in statuses.values()} == {"Succeeded"}, statuses
    # One episode at a time (parallelism 1), and a sandbox waited beside it for the next.
    assert most >= 1, host.output()
    # The first taken started cold; each next one in a sandbox the host had started before
    # it took that episode (its end records the sandbox and when it started), one each.
    first, *rest = sorted(statuses.values(), key=lambda s: s["created_at"])
    assert "pool_created_at" not in first["timing"] and "sandbox" not in first, first
    assert all(s["timing"]["pool_created_at"] < s["created_at"] for s in rest), rest
    assert len({s["sandbox"] for s in rest}) == 2
    assert all(s["episode_id"] == f"rollout-{batch}-{s['index']}" for s in statuses.values())
    assert left_at_end == ([], []), (left_at_end, host.output()[-3000:])
    wait_for(lambda: not alive(seen), 5, f"every process of its sandboxes gone: {alive(seen)}")
    wait_for(lambda: host.left() == [], 15, f"{host.root} emptied")
    assert host.stop() == 0


def test_a_waiting_sandbox_gives_its_slot_to_another_batchs_episode(queue, redis_url, base):
    host = Host(redis_url, "h-warm-evict", base, 2)
    with running(turn_seconds=1.0) as server:
        warm = slow_spec(server.url, count=2, parallelism=1, warm_pool=1)
        enqueue(queue, warm, redis_url)
        wait_for(
            lambda: len(queue.taken(warm.batch_id)) == 1 and len(sandboxes(host.root)) == 2,
            20,
            "one episode running and one sandbox waiting: both slots held",
        )
        (waiting,) = waiting_homes(host, warm.batch_id)
        cold = slow_spec(server.url, count=1)
        enqueue(queue, cold, redis_url)
        most = 0
        while len(queue.statuses(cold.batch_id)) < 1 or len(queue.statuses(warm.batch_id)) < 2:
            most = max(most, len(sandboxes(host.root)))
            assert host.proc.poll() is None, host.output()
            time.sleep(0.02)
    # The other batch's episode took the waiting sandbox's slot: never more sandboxes than
    # slots, and that sandbox was killed, not handed to an episode of another batch.
    assert most == 2, host.output()[-3000:]
    (other,) = queue.statuses(cold.batch_id).values()
    assert other["phase"] == "Succeeded" and "sandbox" not in other, other
    statuses = queue.statuses(warm.batch_id)
    assert {s["phase"] for s in statuses.values()} == {"Succeeded"}, statuses
    assert waiting not in {s.get("sandbox") for s in statuses.values()}, statuses
    wait_for(lambda: not sandboxes(host.root) and host.left() == [], 15, "the host emptied")
    assert host.stop() == 0


def test_a_draining_host_kills_its_waiting_sandboxes_at_once(queue, redis_url, base):
    host = Host(redis_url, "h-warm-drain", base, 2)
    with running(turn_seconds=1.0) as server:
        spec = slow_spec(server.url, count=3, parallelism=1, warm_pool=2)
        enqueue(queue, spec, redis_url)
        batch = spec.batch_id
        wait_for(
            lambda: len(queue.taken(batch)) == 1 and len(sandboxes(host.root)) == 2,
            20,
            "one episode running and one sandbox waiting",
        )
        seen = sandbox_processes(host.root)
        host.proc.send_signal(signal.SIGTERM)
        # The waiting one goes at once; the running episode ends as it would have.
        wait_for(lambda: len(sandboxes(host.root)) == 1, 3, "the waiting sandbox killed")
        assert queue.statuses(batch) == {}, "the running episode had ended already"
        assert host.proc.wait(30) == 0
    statuses = queue.statuses(batch)
    assert list(statuses) == [0] and statuses[0]["phase"] == "Succeeded", statuses
    assert queue.taken(batch) == {}  # the rest is left for other hosts
    assert sandboxes(host.root) == [] and host.left() == []
    wait_for(lambda: not alive(seen), 5, f"every process of its sandboxes gone: {alive(seen)}")


@pytest.mark.workers
def test_a_warm_pool_host_batch_runs_from_waiting_sandboxes_each_counted_once(client, stack, base):
    (host,) = start_hosts(stack, base, "host-w0")
    tasks = [*load_task_set("bundled", only=["shipping-boundary"]), FRESH_TASK]
    with running(script=script()) as server:
        request = host_batch(server.url, tasks, parallelism=1, warm_pool=2)
        batch = client.submit(**request).batch_id
        report = client.wait(batch, timeout=120)
    rows = sorted(report["pods"], key=lambda r: r["created_at"])
    count = 2 * len(tasks)
    assert sorted(r["index"] for r in rows) == list(range(count)), report["errors"]
    assert [(r["status"], r["reward"]) for r in rows] == [("ok", 1)] * count, report["errors"]
    # The report counts the episodes the hosts ran warm: all but the first one taken (one at a
    # time, and the first had nothing waiting yet), each in its own waiting sandbox.
    assert report["warm_episodes"] == count - 1, rows
    warm = [r for r in rows if "pool_created_at" in r["timing"]]
    assert "pool_created_at" not in rows[0]["timing"] and warm == rows[1:], rows
    assert all(r["timing"]["pool_created_at"] < r["created_at"] for r in warm), warm
    assert len({r["timing"]["pool_created_at"] for r in warm}) == len(warm)
    assert len({r["pod"] for r in rows}) == count
    for row in warm:
        # The hand-over line made it this episode: its events carry its own episode id.
        log = client.redis.hget(k.logs_key(batch), str(row["index"])).decode()
        events = [orjson.loads(line) for line in log.splitlines() if line.startswith("{")]
        assert events and all(e.get("episode_id") == row["pod"] for e in events), log[-2000:]
    assert report["infrastructure_failures"] == 0 and report["lost_episodes"] == 0
    entries = [decode_entry(d) for _, d in client.redis.xrange(k.stream_key(batch))]
    streamed = [e.index for e in entries if e.type == k.ENTRY_EPISODE]
    assert sorted(streamed) == list(range(count))
    wait_for(lambda: not batch_keys(client.redis, batch), 30, "the run's host keys deleted")
    wait_for(lambda: host.left() == [] and not sandboxes(host.root), 10, "the host emptied")
    assert host.stop() == 0


@pytest.mark.workers
def test_a_quota_met_with_sandboxes_waiting_on_a_host_leaves_nothing_behind(client, stack, base):
    host = Host(stack.redis_url, "host-q0", base, 4)
    queue = HostQueue(client.redis)
    wait_for(lambda: "host-q0" in queue.hosts(), 30, "the host heartbeating")
    found = script()
    fast, *slow = ["stack-pop", "clamp-range", "palindrome", "leap-year"]
    found["tasks"][fast]["plans"][0][0]["delay"] = 4  # long enough to see the sandboxes wait
    for task in slow:
        found["tasks"][task] = {"plans": [[{"tool": "submit", "arguments": {}, "delay": 120}]]}
    tasks = load_task_set("bundled", only=[fast, *slow])
    with running(script=found) as server:
        policy = {"url": server.url, "request_timeout_seconds": 150, "max_retries": 0}
        request = host_batch(
            server.url,
            tasks,
            samples_per_task=1,
            parallelism=2,
            warm_pool=2,
            groups_wanted=1,
            policy=policy,
        )
        batch = client.submit(**request).batch_id
        # Two episodes running, two sandboxes waiting in the host's two other slots.
        most, seen = watch(host, queue, batch, lambda: client.report(batch) is not None, 90)
        report = client.wait(batch, timeout=60)
    assert most == 2, host.output()[-3000:]
    assert report["status"] == "succeeded", report["errors"]
    assert [g.split(":")[1] for g in report["quota"]["counted"]] == [fast]
    rows = {r["task_id"]: r for r in report["pods"]}
    assert sorted(r["index"] for r in report["pods"]) == [0, 1, 2, 3], report["errors"]
    assert (rows[fast]["status"], rows[fast]["reward"]) == ("ok", 1), rows[fast]
    assert all(rows[t]["status"] == "aborted" and rows[t]["reward"] == 0 for t in slow), rows
    entries = [decode_entry(d) for _, d in client.redis.xrange(k.stream_key(batch))]
    streamed = [e.index for e in entries if e.type == k.ENTRY_EPISODE]
    assert sorted(streamed) == [0, 1, 2, 3]
    # Nothing of it left on the host: no sandbox waiting or running, no process, no folder.
    wait_for(lambda: not sandboxes(host.root), 10, "the host's sandboxes gone")
    wait_for(lambda: not alive(seen), 5, f"every process of its sandboxes gone: {alive(seen)}")
    wait_for(lambda: host.left() == [], 15, f"{host.root} emptied")
    wait_for(lambda: not batch_keys(client.redis, batch), 30, "the run's host keys deleted")
    assert host.stop() == 0
