"""Shared fixtures, and how the run says what it left out.

Tests that need Redis, workers or a cluster start real ones: a missing redis-server, cluster,
KWOK controller or real node is a failure, never a skip. Parts of the suite are left out only
when the person running it says so, and the closing summary names them:

- ``-m`` with a marker expression (``-m "not k8s_real"``): pytest deselects those tests; the
  summary lists what ``-m`` deselected, counted by marker.
- ``ROLLOUT_TEST_SKIP`` (:data:`SKIP_ENV`): comma-separated marker names
  (``ROLLOUT_TEST_SKIP=k8s_real,kwok``); tests carrying any of them are deselected and the
  summary says ``left out by request: k8s_real (ROLLOUT_TEST_SKIP)``. A name that is not a
  registered marker is a usage error (a typo never runs less than asked for).

Markers follow the fixtures a test uses (:data:`FIXTURE_MARKERS`): a test that asks for
``kwok_nodes`` is a ``kwok`` test whatever its file declares, so both mechanisms see it. A skip
raised inside a test or fixture that needs infrastructure (:data:`INFRA_MARKERS`) is turned into
a failure: nothing that needs a cluster, Redis or workers is skipped silently.

Kubernetes (logic in tests/k8s/cluster.py):
- ``k8s_cluster`` (session): ``$KUBECONFIG`` if it answers, else the local cluster from
  ``hack/localkube/cluster.sh up`` (torn down at session end only if started here).
- ``local_k8s_cluster`` (session): the same, but it must be the hack/localkube cluster
  (marker ``k8s_local``).
- ``k8s_namespace`` (function): a fresh namespace labelled ``rollout.dev/test=true``.
- ``kwok_nodes`` (session): names of Ready KWOK nodes (created if missing).
- ``kwok_logs`` (function): factory making a simulated Pod log served through the API server.
- ``real_node`` (session, tests/k8s/node_fixtures.py): a node where Pods really run.
- ``real_stack`` (session): Redis + Celery workers whose Kubernetes backend uses ``k8s_cluster``.

Time limits (pytest-timeout, set in pyproject.toml: 900 s per test, its fixtures included): a
hang fails that test with every thread's stack and the run goes on. A test known to take longer
says so with ``@pytest.mark.timeout(N)``; the first test to set up a fixture that builds or
starts infrastructure (:data:`PROVISIONING_SECONDS`) gets that fixture's own bound on top.
pytest-timeout missing is a usage error; ``-p no:timeout`` runs without limits, on request.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

import pytest

from rollout_worker.cli.stack import LocalStack
from tests.k8s import cluster as kc
from tests.k8s.node_fixtures import real_node  # noqa: F401 - a fixture
from trainer_stub.client import RolloutClient

# --------------------------------------------------------------------------------------------
# Leaving parts out, only on request

#: Comma-separated marker names whose tests this run leaves out (deselects), by request.
SKIP_ENV = "ROLLOUT_TEST_SKIP"

#: Markers of tests that need something outside the Python process. A skip raised inside such a
#: test (or its fixtures) fails it instead: what they need is started or found, or they fail.
INFRA_MARKERS = frozenset(
    {"redis", "workers", "k8s", "k8s_real", "k8s_local", "kwok", "compose", "helm"}
)

#: A test that uses one of these fixtures (directly or through another fixture) carries these
#: markers, so ``-m`` and ROLLOUT_TEST_SKIP select it by what it really needs.
FIXTURE_MARKERS: dict[str, tuple[str, ...]] = {
    "k8s_cluster": ("k8s",),
    "local_k8s_cluster": ("k8s", "k8s_local"),
    "kwok_nodes": ("k8s", "kwok"),
    "kwok_logs": ("k8s", "kwok"),
    "real_node": ("k8s", "k8s_real"),
    "real_stack": ("k8s", "redis", "workers"),
    "stack": ("redis", "workers"),
}


def parse_skip_request(value: str | None, known: Iterable[str]) -> tuple[str, ...]:
    """The marker names in a ROLLOUT_TEST_SKIP value (commas and/or spaces), sorted.

    Raises pytest.UsageError for a name that is not a registered marker.
    """
    names = {part for part in (value or "").replace(",", " ").split() if part}
    unknown = sorted(names - set(known))
    if unknown:
        raise pytest.UsageError(
            f"{SKIP_ENV}={value!r} names {unknown}, which are not registered markers; "
            f"use any of {sorted(known)}"
        )
    return tuple(sorted(names))


def left_out_by_request(
    items: Mapping[str, Iterable[str]], skip: Iterable[str]
) -> tuple[list[str], dict[str, list[str]]]:
    """Split ``{test id: its marker names}`` into the ids that run and, per requested marker,
    the ids it leaves out (a test with two requested markers is listed under both)."""
    requested = set(skip)
    keep: list[str] = []
    left_out: dict[str, list[str]] = {}
    for test_id, markers in items.items():
        hit = sorted(requested & set(markers))
        if not hit:
            keep.append(test_id)
        for name in hit:
            left_out.setdefault(name, []).append(test_id)
    return keep, left_out


def markexpr_matcher(markexpr: str) -> Callable[[Iterable[str]], bool] | None:
    """``markers -> bool``: whether ``-m markexpr`` keeps a test with these markers (None when
    this pytest's expression parser is not available; the summary then cannot tell -m from
    -k)."""
    try:
        from _pytest.mark.expression import Expression  # pytest's own -m grammar
    except ImportError:  # pragma: no cover - a future pytest moved it
        return None
    expression = Expression.compile(markexpr)

    def keeps(markers: Iterable[str]) -> bool:
        names = set(markers)
        return expression.evaluate(lambda name, /, **kwargs: not kwargs and name in names)

    return keeps


@dataclass
class LeftOut:
    """What this run left out, for the closing summary."""

    skip_request: tuple[str, ...] = ()
    by_request: dict[str, list[str]] = field(default_factory=dict)
    markexpr: str = ""
    by_markexpr: list[Sequence[str]] = field(default_factory=list)  # markers of each test
    by_other: int = 0  # deselected by -k (or -m when the expression could not be read)
    markexpr_unreadable: bool = False

    def summary_lines(self) -> list[str]:
        lines = []
        if self.skip_request:
            for name in self.skip_request:
                count = len(self.by_request.get(name, []))
                lines.append(f"left out by request: {name} ({SKIP_ENV}): {_tests(count)}")
        if self.markexpr and self.by_markexpr:
            counts = Counter(m for markers in self.by_markexpr for m in set(markers))
            per_marker = ", ".join(f"{name} {n}" for name, n in sorted(counts.items()))
            lines.append(
                f"deselected by -m {self.markexpr!r}: {_tests(len(self.by_markexpr))}"
                + (f" (markers: {per_marker})" if per_marker else "")
            )
        if self.by_other:
            how = "-k/-m" if self.markexpr_unreadable else "-k"
            lines.append(f"deselected by {how}: {_tests(self.by_other)}")
        return lines


def _tests(count: int) -> str:
    return f"{count} test" + ("" if count == 1 else "s")


_LEFT_OUT = pytest.StashKey[LeftOut]()


def fail_missing(marker: str, what: str) -> NoReturn:
    """Fail a test whose infrastructure is missing, saying how to leave such tests out."""
    pytest.fail(
        f"{what}. To run without the {marker!r} tests, say so: -m 'not {marker}' or "
        f"{SKIP_ENV}={marker}",
        pytrace=False,
    )


def _marker_names(item: pytest.Item) -> set[str]:
    return {mark.name for mark in item.iter_markers()}


def pytest_configure(config: pytest.Config) -> None:
    known = {line.split(":", 1)[0].split("(", 1)[0].strip() for line in config.getini("markers")}
    state = LeftOut(
        skip_request=parse_skip_request(os.environ.get(SKIP_ENV), known),
        markexpr=config.option.markexpr or "",
    )
    config.stash[_LEFT_OUT] = state
    config.stash[_PROVISIONED] = set()
    config.pluginmanager.register(
        ProvisioningTracker(config.stash[_PROVISIONED]), "rollout-provisioning-tracker"
    )
    if not config.pluginmanager.hasplugin("timeout"):
        if not config.pluginmanager.is_blocked("timeout"):
            raise pytest.UsageError(
                "pytest-timeout is not installed, so a hanging test would hang the whole run: "
                "install the dev extras (hack/setup.sh --dev), or say -p no:timeout to run "
                "without time limits"
            )
        # Off on request: the tests' timeout marks stay valid under --strict-markers.
        config.addinivalue_line("markers", "timeout(seconds): per-test limit (pytest-timeout)")


@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(session, config: pytest.Config, items: list[pytest.Item]):
    # Before every other implementation (pytest's -k/-m deselection included): markers from
    # fixtures, then what ROLLOUT_TEST_SKIP leaves out.
    state = config.stash[_LEFT_OUT]
    for item in items:
        if item.nodeid in LONG_TESTS and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(LONG_TESTS[item.nodeid]))
        have = _marker_names(item)
        for fixture in set(getattr(item, "fixturenames", ())) & set(FIXTURE_MARKERS):
            for marker in FIXTURE_MARKERS[fixture]:
                if marker not in have:
                    item.add_marker(marker)
                    have.add(marker)
    if state.skip_request:
        by_id = {item.nodeid: item for item in items}
        keep, state.by_request = left_out_by_request(
            {item.nodeid: _marker_names(item) for item in items}, state.skip_request
        )
        kept = set(keep)
        removed = [item for item in items if item.nodeid not in kept]
        if removed:
            config.hook.pytest_deselected(items=removed)
        items[:] = [by_id[test_id] for test_id in keep]
    before = list(items)
    result = yield
    remaining = {id(item) for item in items}
    gone = [item for item in before if id(item) not in remaining]
    keeps = markexpr_matcher(state.markexpr) if state.markexpr and gone else None
    state.markexpr_unreadable = bool(state.markexpr and gone and keeps is None)
    for item in gone:
        markers = sorted(_marker_names(item))
        if keeps is not None and not keeps(markers):
            state.by_markexpr.append(markers)
        else:
            state.by_other += 1
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    if (
        report.skipped
        and call.excinfo is not None
        and not hasattr(report, "wasxfail")
        and item.get_closest_marker("skip") is None
        and item.get_closest_marker("skipif") is None
    ):
        needs = sorted(_marker_names(item) & INFRA_MARKERS)
        if needs:
            reason = getattr(call.excinfo.value, "msg", None) or str(call.excinfo.value)
            report.outcome = "failed"
            report.longrepr = (
                f"skipped silently ({reason}): a test marked {needs} must find what it needs "
                f"or fail. To leave such tests out say so: -m 'not {needs[0]}' or "
                f"{SKIP_ENV}={needs[0]}"
            )
    return report


# --------------------------------------------------------------------------------------------
# Time limits

#: Session fixtures that build or start infrastructure, with the bound their own subprocess
#: timeouts put on that (seconds). The first test to set one up gets that much more than its
#: limit; later tests find it ready.
PROVISIONING_SECONDS: dict[str, float] = {
    "k8s_cluster": kc.UP_TIMEOUT_S,  # cluster.sh up (builds Kubernetes from source when cold)
    "real_node": kc.NODE_UP_TIMEOUT_S,  # cluster.sh node-up (containerd, kubelet, images)
    "helm": 1800,  # tests/helm/conftest.py: hack/helm.sh builds the pinned helm
    "docker_ready": 1200,  # tests/compose/conftest.py: hack/docker-up.sh
    "images": 1200 + 300,  # tests/compose/conftest.py: image build, then `compose up`
}

#: Tests in files whose own marks are not set yet, known to take longer than the default
#: (node id -> seconds). A test's own @pytest.mark.timeout wins over this table.
LONG_TESTS: dict[str, float] = {
    # Builds and imports the worker and Redis images (docker-up 1200 s, build 1800 s) inside
    # the test, then four helm installs (6 min each at most) with a batch after each.
    "tests/helm/test_chart_install.py::test_chart_installs_serves_scales_and_uninstalls": 5400,
}

_PROVISIONED = pytest.StashKey[set[str]]()


def timeout_of(item: pytest.Item) -> float:
    """The item's time limit before provisioning (0: none): its own timeout mark, else the
    run's default in pytest-timeout's order (--timeout, PYTEST_TIMEOUT, the ini file)."""
    config = item.config
    if not config.pluginmanager.hasplugin("timeout"):
        return 0.0
    mark = item.get_closest_marker("timeout")
    if mark is not None:
        value = mark.args[0] if mark.args else mark.kwargs.get("timeout")
    else:
        value = config.getoption("timeout")
        if value is None:
            value = os.environ.get("PYTEST_TIMEOUT") or config.getini("timeout")
    return float(value or 0)


def provisioning_extra(fixturenames: Iterable[str], provisioned: set[str]) -> float:
    """Seconds to add for the provisioning fixtures among `fixturenames` not yet set up."""
    return sum(
        PROVISIONING_SECONDS[name]
        for name in set(fixturenames) - provisioned
        if name in PROVISIONING_SECONDS
    )


class ProvisioningTracker:
    """Notes each provisioning fixture once it has been set up (or tried to). A plugin, not a
    conftest hook: a session fixture is set up through the session's hooks, which do not
    include those of a conftest below the rootdir."""

    def __init__(self, provisioned: set[str]) -> None:
        self.provisioned = provisioned

    @pytest.hookimpl(wrapper=True)
    def pytest_fixture_setup(self, fixturedef, request):
        try:
            return (yield)
        finally:
            if fixturedef.argname in PROVISIONING_SECONDS:
                self.provisioned.add(fixturedef.argname)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem):
    # Outside pytest-timeout's own wrapper, which reads the item's timeout mark when it starts.
    limit = timeout_of(item)
    extra = provisioning_extra(
        getattr(item, "fixturenames", ()), item.config.stash.get(_PROVISIONED, set())
    )
    if limit > 0 and extra > 0:
        item.add_marker(pytest.mark.timeout(limit + extra), append=False)
    return (yield)


def pytest_terminal_summary(terminalreporter, exitstatus, config: pytest.Config) -> None:
    state = config.stash.get(_LEFT_OUT, None)
    lines = state.summary_lines() if state is not None else []
    if lines:
        terminalreporter.write_sep("=", "left out by request")
        for line in lines:
            terminalreporter.write_line(line)


# --------------------------------------------------------------------------------------------
# Redis and workers


@pytest.fixture(scope="session")
def stack():
    """A private redis-server, one `control` worker and two `collect` workers (real processes)."""
    with LocalStack(collectors=2, extra_env={"ROLLOUT_MAX_BATCH_EPISODES": "300"}) as running:
        running.wait_ready()
        yield running


@pytest.fixture
def client(stack):
    stack.check_alive()
    rollout = RolloutClient(stack.redis_url)
    yield rollout
    rollout.close()


# --------------------------------------------------------------------------------------------
# Kubernetes


@pytest.fixture(scope="session")
def k8s_cluster():
    try:
        cluster = kc.ensure_cluster()
    except (kc.ClusterUnavailable, OSError) as exc:
        fail_missing("k8s", f"no Kubernetes cluster for the k8s tests: {exc}")
    yield cluster
    kc.stop_cluster(cluster)


@pytest.fixture(scope="session")
def local_k8s_cluster(k8s_cluster):
    """``k8s_cluster``, which must be the one hack/localkube built (pinned, from source)."""
    if not k8s_cluster.local:
        fail_missing(
            "k8s_local",
            f"KUBECONFIG points at {k8s_cluster.kubeconfig}, not the hack/localkube cluster",
        )
    return k8s_cluster


@pytest.fixture
def k8s_namespace(k8s_cluster, request):
    name = kc.create_test_namespace(k8s_cluster, request.node.name)
    yield name
    kc.delete_namespace(k8s_cluster, name)


@pytest.fixture(scope="session")
def kwok_nodes(k8s_cluster):
    if not k8s_cluster.has_kwok():
        if k8s_cluster.local:
            fail_missing(
                "kwok", "the local cluster serves no kwok.x-k8s.io API: KWOK controller broken"
            )
        fail_missing("kwok", f"the cluster at {k8s_cluster.kubeconfig} runs no KWOK controller")
    count = int(os.environ.get("ROLLOUT_KWOK_NODES", "4"))
    nodes = kc.ensure_kwok_nodes(k8s_cluster, count)
    # A KWOK API that is served is not enough: its controller must run this clone's stages, or
    # every KWOK test would wait for its deadline. Fail fast, saying why.
    from tests.integration.kwok_episodes import StagesMismatch, verify_stages

    try:
        verify_stages(k8s_cluster)
    except StagesMismatch as exc:
        fail_missing("kwok", str(exc))
    return nodes


@pytest.fixture
def kwok_logs(k8s_cluster, k8s_namespace, tmp_path):
    """``kwok_logs(pod_name, lines, namespace=None, containers=None) -> Path``.

    Writes ``lines`` to a CRI-format file and creates a KWOK ``Logs`` object so that the Pod's
    log, read through the API server, is those lines (KWOK picks the object up within moments,
    so poll the first read).
    """

    def make(pod_name: str, lines, namespace: str | None = None, containers=None):
        path = kc.write_cri_log(tmp_path / f"{pod_name}.log", lines)
        kc.create_pod_logs(
            k8s_cluster, namespace or k8s_namespace, pod_name, path, containers=containers
        )
        return path

    return make


@pytest.fixture(scope="session")
def real_stack(k8s_cluster):
    """A private redis-server, a control worker and two collectors whose Kubernetes backend
    talks to ``k8s_cluster`` (for batches on the real node). On the local cluster they hand
    warm Pods their episodes directly (tests/integration/test_warm_pool.py keeps one test on
    attach)."""
    env = {"KUBECONFIG": str(k8s_cluster.kubeconfig)}
    if direct := kc.handover_from(k8s_cluster):
        env["ROLLOUT_WARM_HANDOVER_FROM"] = direct
    with LocalStack(collectors=2, extra_env=env) as stack:
        stack.wait_ready()
        yield stack


@pytest.fixture
def open_tmp_path():
    """A fresh directory that other users may traverse (mode 0755): local sandboxes run as host
    uid 1000 and must reach their run folder, which pytest's own tmp_path (below a 0700
    directory) does not allow."""
    path = Path(tempfile.mkdtemp(prefix="rollout-test-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)
