"""The guide's script is rebuilt from the guide's text at run time (benchmarks/guide_script.py)."""

import ast

import pytest

from benchmarks.guide_script import GUIDE, GuideScriptError, guide_script

pytestmark = pytest.mark.skipif(not GUIDE.exists(), reason=f"{GUIDE} is not on this machine")


def test_the_rebuilt_script_and_its_episode_program_compile():
    tree = ast.parse(guide_script())
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


def test_a_changed_guide_is_refused_rather_than_guessed():
    text = GUIDE.read_text().replace("def kubectl(", "def kube_ctl(")
    with pytest.raises(GuideScriptError, match="not used"):
        guide_script(text)
