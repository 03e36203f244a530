"""The scripts a new user runs first say what they do."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _dependencies(extra: str | None) -> list[str]:
    import tomllib  # Python 3.11+

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = project["dependencies"] + (project["optional-dependencies"][extra] if extra else [])
    return [re.split(r"[<>=\[ ;]", item, maxsplit=1)[0] for item in wanted]


@pytest.mark.skipif(sys.version_info < (3, 11), reason="reads pyproject.toml with tomllib")
@pytest.mark.parametrize("extra", [None, "dev"])
def test_install_script_says_what_it_installs_and_how_long(extra: str | None) -> None:
    env = {key: value for key, value in os.environ.items() if key not in ("VIRTUAL_ENV", "CONDA_PREFIX")}
    env["ACTVIZ_INSTALL_DRY_RUN"] = "1"  # say everything, install nothing
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # `python` is this one
    done = subprocess.run(["bash", str(ROOT / "scripts" / "install.sh"), *([extra] if extra else [])],
                          capture_output=True, text=True, env=env, timeout=120, check=True)
    out = done.stdout
    assert "python -m venv .venv" in out  # no virtual environment: it says how to make one
    plan = next(line for line in out.splitlines() if line.startswith("== 2/2 actviz"))
    listed = plan.split("with what it needs: ", 1)[1].split(";", 1)[0].split(", ")
    assert listed == _dependencies(extra)
    assert re.search(r"about \d+ to \d+ (seconds|minutes)", plan)
    assert "1/2 PyTorch" in out and "nothing was installed" in out
    assert "(dry run, not run) python -m pip install" in out
    # a path entry, not an import hook: a folder named actviz beside a user's script cannot shadow the clone's package
    assert "--config-settings editable_mode=compat" in out


def _git(*args: str) -> subprocess.CompletedProcess[str]:
    if not (ROOT / ".git").exists() or shutil.which("git") is None:
        pytest.skip("not a git checkout")
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)


def test_every_source_file_is_tracked_so_a_fresh_clone_has_it() -> None:
    # A pattern such as "report/" once ignored actviz/report/ as well as the report output folder.
    sources = [str(path.relative_to(ROOT)) for folder in ("actviz", "tests", "scripts")
               for path in (ROOT / folder).rglob("*") if path.suffix in (".py", ".sh") and "__pycache__" not in path.parts]
    assert _git("check-ignore", "--no-index", *sources).stdout.split() == []


def test_the_notebooks_outputs_are_ignored_by_git() -> None:
    paths = ["notebooks/report_html/index.html", "notebooks/runs/quickstart/events.out.tfevents.1"]
    assert _git("check-ignore", "--no-index", *paths).stdout.split() == paths
    assert "notebooks/report_html/" in (ROOT / ".gitignore").read_text().splitlines()
    assert "notebooks/runs/" in (ROOT / ".gitignore").read_text().splitlines()


def test_the_instruction_counter_explains_itself_and_refuses_a_bad_mode() -> None:
    script = ROOT / "scripts" / "count_host_instructions.py"
    shown = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0 and "callgrind" in shown.stdout and "--tree" in shown.stdout
    refused = subprocess.run([sys.executable, str(script), "--modes", "fast"], capture_output=True, text=True,
                             timeout=120)
    expected = "--modes takes bare and watched, got 'fast'" if shutil.which("valgrind") else "apt install valgrind"
    assert refused.returncode != 0 and expected in refused.stderr
