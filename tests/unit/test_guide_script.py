"""The guide's script is rebuilt from the guide's text at run time (benchmarks/guide_script.py)."""

import ast
from pathlib import Path

import pytest

from benchmarks.guide_script import GUIDE, GUIDE_PLACES, GuideScriptError, guide_script


@pytest.fixture(scope="module")
def guide_text() -> str:
    if not GUIDE.is_file():
        places = "\n  ".join(str(place) for place in GUIDE_PLACES)
        pytest.fail(
            f"the guide (shared/seed/rl-batch-demo-guide.txt) is in none of:\n  {places}\n"
            "it belongs in the workplace's shared folder beside the clone, or set ROLLOUT_GUIDE",
            pytrace=False,
        )
    return GUIDE.read_text()


def test_the_guide_is_looked_for_beside_the_clone_first(guide_text):
    beside = Path(__file__).resolve().parents[3] / "shared" / "seed" / "rl-batch-demo-guide.txt"
    assert beside in GUIDE_PLACES
    assert GUIDE.name == "rl-batch-demo-guide.txt" and "def kubectl(" in guide_text


def test_the_rebuilt_script_and_its_episode_program_compile(guide_text):
    tree = ast.parse(guide_script(guide_text))
    functions = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    assert {"percentile", "collect", "main"} <= functions
    (worker,) = [
        n.value
        for n in tree.body
        if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "WORKER"
    ]
    episode = ast.parse(ast.literal_eval(worker))
    calls = {
        n.func.id for n in ast.walk(episode) if isinstance(n, ast.Call) and hasattr(n.func, "id")
    }
    assert {"emit", "test"} <= calls


def test_the_default_is_the_guide_itself(guide_text):
    assert guide_script() == guide_script(guide_text)


def test_a_changed_guide_is_refused_rather_than_guessed(guide_text):
    text = guide_text.replace("def kubectl(", "def kube_ctl(")
    assert text != guide_text, "the guide defines no kubectl() to rename"
    with pytest.raises(GuideScriptError, match="not used"):
        guide_script(text)
