"""A pool's read-only import paths (`python_path`) and modules preloaded by its fork servers (`preload`)."""

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from tempering.errors import SandboxError
from tempering.sandbox import ExecRequest, LocalSandbox, SandboxLimits

BACKENDS = ["bwrap", "process"] if shutil.which("bwrap") else ["process"]
MODULE = """\
import os
import sys
LOADED_IN = os.getpid()
print("printed while preloading")  # must not reach the worker's protocol pipe
"""


@pytest.fixture(scope="module")
def lib_dir():
    # World-readable, writable only by root. (Under /var/tmp; tests below put one under /tmp too.)
    path = Path(tempfile.mkdtemp(prefix="tempering-preload-", dir="/var/tmp"))
    path.chmod(0o755)
    (path / "preloaded_fixture.py").write_text(MODULE)
    (path / "broken_fixture.py").write_text("raise ImportError('this module is broken')\n")
    yield path
    shutil.rmtree(path)


@pytest.fixture(scope="module", params=BACKENDS)
def sb(request, lib_dir):
    with LocalSandbox(
        SandboxLimits(timeout_s=5.0, cpu_s=5.0),
        workers=1,
        isolation=request.param,
        python_path=(str(lib_dir),),
        preload=("preloaded_fixture",),
    ) as sandbox:
        yield sandbox


def call(sb, code, *args):
    raw = sb.execute(ExecRequest(code=code, entry_point="f", calls=[list(args)], limits=sb.limits))
    assert raw["status"] == "ok", raw
    return raw["calls"][0]


def test_a_preloaded_module_is_imported_once_by_the_server_not_by_each_execution(sb):
    code = "import os, preloaded_fixture\ndef f():\n    return [preloaded_fixture.LOADED_IN, os.getpid()]\n"
    first = eval(call(sb, code)["value"])  # noqa: S307 - a list of two ints, from our own test program
    second = eval(call(sb, code)["value"])  # noqa: S307
    assert first[0] == second[0]  # the server's pid: loaded before the fork
    assert first[1] != first[0] and second[1] != first[0]


def test_the_import_path_is_read_only_inside(sb, lib_dir):
    code = (
        "import os, preloaded_fixture\n"
        "def f(path):\n    inside = os.path.dirname(preloaded_fixture.__file__)\n    out = []\n"
        "    for where in (path, inside):\n        try:\n            open(where + '/planted.py', 'w').write('x')\n"
        "            out.append('written')\n        except OSError as e:\n            out.append(type(e).__name__)\n"
        "    return out\n"
    )
    assert "written" not in call(sb, code, str(lib_dir))["value"]
    assert sorted(os.listdir(lib_dir)) == ["broken_fixture.py", "preloaded_fixture.py"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_import_path_under_tmp_is_bound_in_explicitly(backend):
    """A checkout or venv in the temporary directory: each contained worker mounts its own scratch on
    /tmp, which would hide the path; it is bound in at a path of its own. Imported lazily by a program
    (not preloaded), so the program's uid must be able to read it too."""
    path = Path(tempfile.mkdtemp(prefix="tempering-import-", dir="/tmp"))
    try:
        path.chmod(0o755)
        (path / "lazy_fixture_mod.py").write_text("VALUE = 41 + 1\n")
        with LocalSandbox(workers=1, isolation=backend, python_path=(str(path),)) as sandbox:
            r = sandbox.run("import lazy_fixture_mod\nprint(lazy_fixture_mod.VALUE)")
        assert (r.status, r.stdout) == ("ok", "42\n"), r
    finally:
        shutil.rmtree(path)


def test_without_the_options_the_module_is_not_importable(lib_dir):
    with LocalSandbox(workers=1, isolation=BACKENDS[0]) as plain:
        r = plain.run("import preloaded_fixture")
    assert r.status == "runtime_error" and "ModuleNotFoundError" in r.stderr


def test_a_module_that_fails_to_preload_is_named(lib_dir):
    with pytest.raises(SandboxError, match="cannot preload module 'broken_fixture'.*this module is broken"):
        LocalSandbox(
            workers=1, isolation=BACKENDS[0], python_path=(str(lib_dir),), preload=("broken_fixture",)
        )


def test_an_import_path_must_be_an_absolute_directory(lib_dir):
    with pytest.raises(SandboxError, match="not an absolute path"):
        LocalSandbox(workers=1, isolation="process", python_path=("relative/dir",))
    with pytest.raises(SandboxError, match="not an absolute path"):
        LocalSandbox(workers=1, isolation="process", python_path=(str(lib_dir / "missing"),))


def test_the_sandbox_factory_opens_a_pool_with_import_paths(lib_dir):
    """`open_sandbox` builds every pool, one with its own import paths too (the reasoning-gym verifiers');
    a service, which imports its own, cannot take them."""
    from tempering.config_sections import SandboxSection
    from tempering.sandbox import open_sandbox

    section = SandboxSection(timeout_s=5.0, cpu_s=5.0, workers=1, isolation="process")
    with open_sandbox(section, python_path=(str(lib_dir),), preload=("preloaded_fixture",)) as sandbox:
        assert isinstance(sandbox, LocalSandbox) and sandbox.limits.timeout_s == 5.0
        code = "import preloaded_fixture\ndef f():\n    return preloaded_fixture.__name__\n"
        assert call(sandbox, code)["value"] == "'preloaded_fixture'"
    with pytest.raises(ValueError, match="a sandbox service imports its own"):
        open_sandbox(SandboxSection(url="http://127.0.0.1:9"), python_path=(str(lib_dir),))
