"""The harness's vault: the records' key and the channel to the runner, held where the code
under test cannot read them. It runs inside the harness (`harness_source` joins its part to the
harness's, so os and sys stay its only imports)."""

from __future__ import annotations

import os
import sys
import typing

# -- harness: begin
# The code under test runs in the harness's interpreter, so whatever the harness keeps in a
# Python object it can reach: the key in a frame's locals or a closure once earned a forged
# passing run (tests/red_team.py, frame_forgery and gc_forgery). The vault is an audit hook
# (sys.addaudithook: it cannot be removed, and nothing lists it): the key and the channel live
# only in its closure, reached by no frame or module. The harness hands it a run's counts and
# the end as audit events (`tell`); the vault writes them only when no frame below the caller
# is code of the workspace (the test script's own top level excepted), so a record raised by
# the code under test is refused and marks the run tampered. The ways to reach the closure
# anyway (the garbage collector's view of every object, raw memory) are refused, and each
# marks the run tampered before the operation would have run. Not closed: code that knows the
# harness, runs its own code under a file name outside the workspace and alters the counts
# the harness keeps before it tells them (docs/grading.md).
VAULT_EVENT = "rollout.harness"
PRYING_EVENTS = frozenset(
    {
        "gc.get_objects",
        "gc.get_referrers",
        "gc.get_referents",
        "ctypes.string_at",
        "ctypes.wstring_at",
        "ctypes.cdata",
    }
)
SITE_FOLDERS = ("site-packages", "dist-packages")
COUNT_NAMES = ("collected", "passed", "failed", "skipped")


def tell(*message: object) -> None:
    """Hand the vault a message: ("run", counts) or ("end",)."""
    sys.audit(VAULT_EVENT, *message)


def _roots(harness_dir: str) -> tuple:
    """(the folders whose code is the harness's side: the interpreter's, its site-packages
    folders, the harness's own; the site-packages folders alone), each ending in a separator,
    as written and as resolved (frames carry the names imports used)."""
    found = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, harness_dir}
    sites = {p for p in sys.path if p.rstrip(os.sep).endswith(SITE_FOLDERS)}
    both = {form for p in found | sites for form in (p, os.path.realpath(p)) if p}
    site_both = {form for p in sites for form in (p, os.path.realpath(p))}
    return (
        tuple(p.rstrip(os.sep) + os.sep for p in both),
        tuple(p.rstrip(os.sep) + os.sep for p in site_both),
    )


def _safe_name(text: object) -> str:
    """`text` (a str; anything else is "?": no method of the caller's objects runs in here) as
    the inside of a JSON string, quotes, backslashes and control characters replaced."""
    if type(text) is not str:
        return "?"
    return "".join(c if c.isprintable() and c not in '"\\' else "?" for c in text[:200])


def _keeper(key: str, write: typing.Callable, fd: int) -> typing.Generator[None, str, None]:
    """Writes each record sent to it with the key. The key lives only in this generator's
    frame: reaching it takes `gi_frame`, an audited attribute the vault refuses."""
    while True:
        body = yield
        write(fd, ('{"key": "' + key + '", ' + body + "}\n").encode())


def _run_record(counts: dict, tampered: list) -> str:
    numbers = [f'"{n}": {counts[n] if type(counts.get(n)) is int else 0}' for n in COUNT_NAMES]
    names = ", ".join(f'"{_safe_name(t)}"' for t in tampered[:20])
    return '"run": {' + ", ".join(numbers) + ', "tampered": [' + names + "]}"


def _harness_check(script: str) -> typing.Callable[[], bool]:
    """A check that no frame below the vault's caller is code of the workspace (or code without
    a file), the test script's own excepted."""
    getframe = sys._getframe  # bound now: the code under test can replace sys._getframe
    workspace = os.path.realpath(os.getcwd()) + "/"
    roots, sites = _roots(os.path.dirname(os.path.abspath(sys.argv[0])))
    known: dict = {}

    def harness_side(filename: str) -> bool:
        if filename.startswith("<frozen "):  # the standard library's, built into the binary
            return True
        if not filename.startswith("/") or "/../" in filename or "/./" in filename:
            return False
        if filename.startswith(workspace) and not filename.startswith(sites):
            return False
        return filename.startswith(roots)

    def from_the_harness() -> bool:
        frame: typing.Any = getframe(1)  # the vault's frames, then tell()'s and its callers'
        while frame is not None:
            name = frame.f_code.co_filename
            if name not in known:
                known[name] = harness_side(name) or (bool(script) and name == script)
            if not known[name]:
                return False
            frame = frame.f_back
        return True

    return from_the_harness


def _memory_check() -> typing.Callable[[object], str]:
    """A check of a path opened: why it is refused ("" when it is not). A process's memory
    (/proc/PID/mem, or a link into /proc) is; so is a path given as an object of any other type
    than str, bytes or a descriptor (io.FileIO's, the one opening that hands one to the hook:
    open() and os.open pass the str): telling its path would run a method of an object the
    code under test may have made (a subclass of pathlib's paths, a class of its own whose
    __fspath__ names /proc/self/mem), and no such method may run inside the vault."""
    stat, lstat = os.stat, os.lstat
    try:
        proc = stat("/proc").st_dev
    except OSError:
        proc = -1

    def refused(path: object) -> str:
        if type(path) is bytes:
            path = path.decode(errors="replace")
        elif type(path) in (int, bool):  # a descriptor, already open
            return ""
        if type(path) is not str:
            return "a path object opened"
        try:
            if stat(path).st_dev != proc:
                return ""
            linked = lstat(path).st_dev != proc
        except OSError:
            return ""
        if linked or path.rstrip("/").rsplit("/", 1)[-1] == "mem":
            return "a process's memory opened"
        return ""

    return refused


def lock_up(key: str, fd: int, script: str) -> None:
    """Install the vault: it alone knows `key` and writes on `fd`. `script` is the test script
    run as __main__ ("" for `-m unittest|pytest`): its frames count as the harness's (it is
    the task's file; unittest.main() runs from it). No function here refers to `key`: a
    closure would hold it."""
    keeper = _keeper(key, os.write, fd)
    next(keeper)
    from_the_harness, refused_open = _harness_check(script), _memory_check()
    state = {"runs": 0, "ended": 0}
    marked: set = set()

    def mark(what: str) -> None:
        if what not in marked:
            marked.add(what)
            keeper.send(_run_record({}, [what]))

    def receive(message: tuple) -> None:
        kind = message[0] if message and type(message[0]) is str else "?"
        if state["ended"]:
            return
        if not from_the_harness():
            mark(f"{_safe_name(kind)} record sent from the code under test")
        elif kind == "run" and len(message) == 2 and type(message[1]) is dict:
            tampered = message[1].get("tampered")
            state["runs"] += 1
            keeper.send(_run_record(message[1], tampered if type(tampered) is list else []))
        elif kind == "end":
            state["ended"] = 1
            keeper.send(f'"end": true, "runs": {state["runs"]}')

    def hook(event: str, args: tuple) -> None:
        if event == VAULT_EVENT:
            receive(args)
        elif event in PRYING_EVENTS or (event == "object.__getattr__" and args[0] is keeper):
            mark(event)
            raise RuntimeError(f"{event} is refused while tests are graded")
        elif event == "open":
            why = refused_open(args[0])
            if why:
                mark(why)
                raise PermissionError(f"{why}: refused while tests are graded")

    sys.addaudithook(hook)


# -- harness: end
