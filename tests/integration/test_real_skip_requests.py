"""No silent skips: what a run leaves out is what the person running it asked for, and the
summary says so (tests/conftest.py: ROLLOUT_TEST_SKIP, -m, markers from fixtures, skips of
infrastructure tests turned into failures).

The selection functions are checked directly; then pytest itself runs on small generated test
modules (with tests/conftest.py loaded as a plugin) to show the behaviour end to end. Nothing
here needs a cluster: the generated tests that would need one are left out or skip on purpose.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import (
    SKIP_ENV,
    LeftOut,
    left_out_by_request,
    markexpr_matcher,
    parse_skip_request,
)

ROOT = Path(__file__).resolve().parents[2]
KNOWN = ("redis", "workers", "k8s", "k8s_real", "k8s_local", "kwok", "compose", "slow")


# -- the selection functions ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, ()),
        ("", ()),
        ("k8s_real", ("k8s_real",)),
        ("kwok,k8s_real", ("k8s_real", "kwok")),
        (" k8s_real , kwok ", ("k8s_real", "kwok")),
        ("kwok k8s_local", ("k8s_local", "kwok")),
    ],
)
def test_skip_request_names_markers(value, expected):
    assert parse_skip_request(value, KNOWN) == expected


def test_skip_request_refuses_names_that_are_not_markers():
    with pytest.raises(pytest.UsageError, match=r"\['k8s-real'\]"):
        parse_skip_request("k8s-real,kwok", KNOWN)


def test_left_out_by_request_lists_each_requested_marker():
    items = {
        "unit": set(),
        "kwok": {"k8s", "kwok"},
        "real": {"k8s", "k8s_real"},
        "both": {"k8s", "kwok", "k8s_real"},
        "api": {"k8s"},
    }
    keep, left_out = left_out_by_request(items, ("k8s_real", "kwok"))
    assert keep == ["unit", "api"]
    assert left_out == {"kwok": ["kwok", "both"], "k8s_real": ["real", "both"]}
    assert left_out_by_request(items, ()) == (list(items), {})


def test_markexpr_matcher_follows_pytest_grammar():
    keeps = markexpr_matcher("k8s and not (k8s_real or kwok)")
    assert keeps is not None
    assert keeps({"k8s"}) is True
    assert keeps({"k8s", "kwok"}) is False
    assert keeps({"k8s", "k8s_real"}) is False
    assert keeps(set()) is False


def test_summary_names_what_was_left_out_and_how():
    state = LeftOut(
        skip_request=("k8s_real", "kwok"),
        by_request={"k8s_real": ["a", "b"]},
        markexpr="not slow",
        by_markexpr=[["k8s", "slow"], ["slow"]],
        by_other=1,
    )
    assert state.summary_lines() == [
        f"left out by request: k8s_real ({SKIP_ENV}): 2 tests",
        f"left out by request: kwok ({SKIP_ENV}): 0 tests",
        "deselected by -m 'not slow': 2 tests (markers: k8s 1, slow 2)",
        "deselected by -k: 1 test",
    ]
    state.markexpr_unreadable = True
    assert state.summary_lines()[-1] == "deselected by -k/-m: 1 test"
    assert LeftOut().summary_lines() == []


# -- pytest, for real ---------------------------------------------------------------------------

GENERATED = """
import pytest


@pytest.mark.k8s
def test_needs_a_cluster_and_skips():
    pytest.skip("no cluster here")


def test_pure_and_skips():
    pytest.skip("nothing to do here")


def test_uses_kwok_nodes(kwok_nodes):
    raise AssertionError("must be left out: this run has no cluster")


@pytest.mark.k8s_real
def test_marked_real():
    raise AssertionError("must be left out")


def test_plain():
    pass
"""


def _pytest(tmp_path: Path, *args: str, skip: str | None = None) -> subprocess.CompletedProcess:
    module = tmp_path / "test_generated.py"
    module.write_text(textwrap.dedent(GENERATED))
    env = {k: v for k, v in os.environ.items() if k != SKIP_ENV}
    if skip is not None:
        env[SKIP_ENV] = skip
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "tests.conftest",
            "-p",
            "no:cacheprovider",
            "-c",
            str(ROOT / "pyproject.toml"),
            "--rootdir",
            str(tmp_path),
            "-o",
            "console_output_style=classic",
            str(module),
            *args,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_a_skip_in_an_infrastructure_test_fails(tmp_path):
    done = _pytest(tmp_path, "-k", "skips")
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert "1 failed, 1 skipped" in out, out
    assert "skipped silently (no cluster here)" in out, out
    assert f"{SKIP_ENV}=k8s" in out, out  # the failure says how to leave such tests out


def test_skip_request_leaves_groups_out_and_says_so(tmp_path):
    done = _pytest(tmp_path, "-k", "not skips", skip="kwok,k8s_real")
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "1 passed" in out, out
    # test_uses_kwok_nodes is not marked in its file: the fixture makes it a kwok test.
    assert f"left out by request: k8s_real ({SKIP_ENV}): 1 test" in out, out
    assert f"left out by request: kwok ({SKIP_ENV}): 1 test" in out, out
    assert "deselected by -k: 2 tests" in out, out


def test_marker_expression_deselection_is_named(tmp_path):
    done = _pytest(tmp_path, "-m", "not kwok and not k8s_real and not k8s")
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "1 passed, 1 skipped" in out, out  # a pure test may still skip
    assert (
        "deselected by -m 'not kwok and not k8s_real and not k8s': 3 tests "
        "(markers: k8s 2, k8s_real 1, kwok 1)"
    ) in out, out


def test_unknown_group_is_a_usage_error(tmp_path):
    done = _pytest(tmp_path, skip="k8s-real")
    assert done.returncode == 4, done.stdout + done.stderr
    assert "not registered markers" in done.stderr, done.stderr


def test_missing_kwok_fails_with_how_to_leave_it_out(tmp_path):
    """The kwok_nodes fixture on a cluster without KWOK: a failure naming the way out."""
    (tmp_path / "conftest.py").write_text(
        textwrap.dedent(
            """
            import pytest

            class NoKwok:
                local = False
                kubeconfig = "/nowhere/kubeconfig"
                def has_kwok(self):
                    return False

            @pytest.fixture(scope="session")
            def k8s_cluster():
                return NoKwok()
            """
        )
    )
    done = _pytest(tmp_path, "-k", "kwok_nodes")
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert "1 error" in out, out
    assert "runs no KWOK controller" in out, out
    assert f"-m 'not kwok' or {SKIP_ENV}=kwok" in out, out
