"""The documentation as a newcomer meets it: the quickstart's and the plug-in guide's commands run from a
fresh copy of the repository, and the built site shows its content in a real browser (headless Chromium),
with screenshots kept in build/docs-screenshots/."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.runs import ROOT

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
SHOTS = ROOT / "build" / "docs-screenshots"
RUNNABLE = ("getting-started/quickstart.md", "guides/environments.md")
"""Pages whose ```bash blocks are run, in order, as a reader would type them."""


def bash_blocks(page: str) -> list[str]:
    """The ```bash blocks of a docs page, each as one script (comments and blank lines kept)."""
    text = (ROOT / "docs" / page).read_text()
    return re.findall(r"^```bash\n(.*?)^```", text, flags=re.S | re.M)


def fresh_copy(dest: Path) -> Path:
    """The repository's files as a fresh clone has them: what git tracks, plus what it would add."""
    if not (ROOT / ".git").exists():
        pytest.skip("needs the git checkout (the files a clone has)")
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for name in filter(None, (n.decode() for n in listed)):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


def reader_env(clone: Path) -> dict[str, str]:
    """The reader's shell after the install: the copy's own `.venv` (its `tempering`, `python`, `pip` and
    `activate`), which sees the packages installed here (so `pip install` in a guide changes nothing outside
    the test) and imports tempering from the copy."""
    venv = clone / ".venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = next((venv / "lib").glob("python*/site-packages"))
    shared = [p for p in sys.path if p.endswith("site-packages")]
    (site / "shared.pth").write_text("\n".join([str(clone / "src"), *shared]) + "\n")
    bin_ = venv / "bin"
    (bin_ / "tempering").write_text(
        f"#!{bin_ / 'python'}\nfrom tempering.cli import main\nraise SystemExit(main())\n"
    )
    (bin_ / "pip").write_text(f'#!/bin/sh\nexec {bin_ / "python"} -m pip "$@"\n')
    for tool in ("tempering", "pip"):
        (bin_ / tool).chmod(0o755)
    return {
        **{k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")},
        "PATH": f"{bin_}:{os.environ['PATH']}",
        "VIRTUAL_ENV": str(venv),
        "PIP_NO_INDEX": "1",  # nothing to download: what a guide installs is in the repository
        "PIP_NO_BUILD_ISOLATION": "0",  # (pip reads 0 as "off"): build with the setuptools already here
    }


@pytest.mark.slow
@pytest.mark.parametrize("page", RUNNABLE)
def test_a_pages_commands_run_from_a_fresh_copy(page, tmp_path):
    blocks = bash_blocks(page)
    assert blocks, f"docs/{page} has no ```bash block to run"
    clone = fresh_copy(tmp_path / "clone")
    env = reader_env(clone)
    for script in blocks:
        done = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", script],
            cwd=clone,
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert done.returncode == 0, (
            f"docs/{page}:\n{script}\nfailed:\n{done.stdout[-2000:]}{done.stderr[-3000:]}"
        )


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    pytest.importorskip("mkdocs", reason="needs the docs extra (`make docs` installs it)")
    out = tmp_path_factory.mktemp("site")
    subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "-d", str(out)],
        cwd=ROOT,
        check=True,
        capture_output=True,
        timeout=300,
    )
    return out


def render(page: Path, shot: Path) -> str:
    """The page's DOM after headless Chromium ran its scripts; a screenshot of it at `shot`."""
    common = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--hide-scrollbars",
        "--window-size=1280,1400",
    ]
    shot.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [*common, f"--screenshot={shot}", page.as_uri()], check=True, capture_output=True, timeout=120
    )
    dom = subprocess.run([*common, "--dump-dom", page.as_uri()], check=True, capture_output=True, timeout=120)
    return dom.stdout.decode()


@pytest.mark.skipif(CHROMIUM is None, reason="needs Chromium (`make test` installs Debian's chromium)")
@pytest.mark.parametrize(
    ("page", "expected"),
    [
        ("index.html", ("tempering", "Quickstart", "Your own environment")),
        ("guides/environments/index.html", ("Environment", "env.plugins", "ReverseEnv")),
        ("reference/config/index.html", ("algo.lr", "rollout.engine", "checkpoint.every")),
    ],
)
def test_the_site_renders_its_pages_in_chromium(site, page, expected):
    from PIL import Image

    shot = SHOTS / (page.replace("/index.html", "").replace("/", "-").replace(".html", "") + ".png")
    dom = render(site / page, shot)
    text = re.sub(r"<[^>]+>", " ", dom)
    missing = [word for word in expected if word not in text]
    assert not missing, f"{page} rendered without {missing}"
    assert "md-content" in dom  # the theme's layout, not a bare page
    pixels = Image.open(shot).convert("L")
    assert pixels.size == (1280, 1400)
    assert len(pixels.getcolors(256)) > 50  # anti-aliased grey levels: text, not a blank or one-colour page
    print(f"screenshot: {shot}")
