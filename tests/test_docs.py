"""Every ```python block in README.md and docs/*.md runs as written, and prints what the page says.

The blocks of one page run in order in one namespace, like a notebook's cells, in a fresh
folder that holds ``tests/data`` (the sample images). A line ``print(...)  # -> text``
must print exactly ``text``. A block that cannot run here (it needs a GPU, a network or a
cluster) is fenced as ```python no-run; any other ``py`` info string fails, so that no block
escapes the suite. New pages under docs/ are picked up without a change here.
"""

from __future__ import annotations

import contextlib
import io
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from conftest import NO_HOOKS, Run, hooks_left

import actviz

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUN, NO_RUN = "python", "python no-run"
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.S | re.M)
EXPECT = re.compile(r"^(?P<indent>\s*)print\((?P<args>.*)\)\s*# -> (?P<expected>.*?)\s*$")


@dataclass
class Block:
    page: Path
    line: int  # of the block's first line of code, counted from 1
    info: str
    code: str

    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    text = page.read_text()
    return [
        Block(page, text.count("\n", 0, match.start(2)) + 1, match.group(1).strip(), match.group(2))
        for match in FENCE.finditer(text)
    ]


def runnable(page: Path) -> list[Block]:
    return [block for block in blocks(page) if block.info == RUN]


def _with_expectations(block: Block) -> str:
    """The block's code, each ``print(...)  # -> text`` line turned into a checked print; same line numbers."""
    lines = []
    for number, line in enumerate(block.code.splitlines(), start=block.line):
        found = EXPECT.match(line)
        if found:
            line = f"{found['indent']}__expect__({number}, {found['expected']!r}, {found['args']})"
        lines.append(line)
    return "\n" * (block.line - 1) + "\n".join(lines) + "\n"


def run_page(page: Path, folder: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[dict, str]:
    """Run a page's blocks in ``folder``; return their namespace and everything they printed."""
    (folder / "tests").mkdir(exist_ok=True)
    (folder / "tests" / "data").symlink_to(ROOT / "tests" / "data")
    monkeypatch.chdir(folder)
    printed = io.StringIO()

    def expect(line: int, expected: str, *args: object) -> None:
        text = " ".join(str(arg) for arg in args)
        print(text)
        assert text == expected, f"{page.relative_to(ROOT)}:{line} printed {text!r}; the page says {expected!r}"

    namespace: dict = {"__name__": "__main__", "__expect__": expect}
    with torch.random.fork_rng(), warnings.catch_warnings(), contextlib.redirect_stdout(printed):
        for block in runnable(page):
            exec(compile(_with_expectations(block), str(page), "exec"), namespace)
    return namespace, printed.getvalue()


def _check_readme(namespace: dict, printed: str, folder: Path) -> None:
    # The one line: the default schedule's 24 of 150 steps (0-9, 10, 20, ..., 140), every watched layer, gradients
    # and the loss; pictures at steps 0 and 100.
    run = Run(folder / "runs" / "exp1")
    default_steps = [*range(10), *range(10, 150, 10)]
    assert run.image_steps("feature_maps/0") == [0, 100]
    assert run.histogram_steps("gradients/3") == default_steps == run.histogram_steps("weight_grads/3.weight")
    assert [event.step for event in run.scalar_events("loss/backward_root")] == default_steps
    # Reading results: the last written step is 100, read after flush().
    assert printed.splitlines()[1].startswith("100 ")
    assert hooks_left(namespace["model"]) == NO_HOOKS


def _check_user_guide(namespace: dict, printed: str, folder: Path) -> None:
    run = Run(folder / "runs" / "probe")
    assert run.image_steps("probe/input") == [0, 2] and run.image_steps("gradcam/features.3") == [0, 2]
    assert Run(folder / "runs" / "explicit").histogram_steps("activations/features.0") == [0, 1, 2, 5, 10]
    assert hooks_left(namespace["model"]) == NO_HOOKS


def _check_report(namespace: dict, printed: str, folder: Path) -> None:
    assert printed.splitlines()[0].startswith("features.0 Conv2d (1, 64, 31, 31) ")  # size=128
    assert (folder / "report_html" / "index.html").is_file()
    assert list((folder / "runs" / "report" / "alexnet" / "chelsea").glob("events.out.tfevents.*"))


def _check_integrations(namespace: dict, printed: str, folder: Path) -> None:
    lightning = Run(folder / "lightning_runs" / "lightning_logs" / "version_0")
    assert lightning.histogram_steps("gradients/net.2") == [0, 4]
    assert [event.step for event in lightning.events.Scalars("loss")] == [3, 7]  # Lightning's own, beside actviz's
    # Hugging Face: actviz's event file beside the Trainer's, in the one folder of its TensorBoardCallback.
    (bert_folder,) = {path.parent for path in (folder / "hf_out").rglob("events.out.tfevents.*")}
    assert bert_folder.parent == folder / "hf_out" / "runs"
    bert = Run(bert_folder)
    assert bert.histogram_steps("activations/classifier") == [4, 8]  # the loss's steps
    losses = {entry["step"]: entry["loss"] for entry in namespace["trainer"].state.log_history if "loss" in entry}
    assert sorted(losses) == [2, 4, 6, 8]
    assert {step: bert.scalar("train/loss", step) for step in losses} == pytest.approx(losses, rel=1e-6)


CHECKS = {"README.md": _check_readme, "docs/integrations.md": _check_integrations, "docs/user-guide.md": _check_user_guide, "docs/report.md": _check_report}


def test_the_pages_are_found() -> None:
    found = {str(page.relative_to(ROOT)) for page in PAGES}
    assert set(CHECKS) <= found
    assert all(runnable(ROOT / name) for name in CHECKS)


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_python_fence_is_run_or_marked_no_run(page: Path) -> None:
    unknown = [f"{block.where()} '{block.info}'" for block in blocks(page)
               if block.info.startswith("py") and block.info not in (RUN, NO_RUN)]
    assert not unknown, f"use ```python (run by the suite) or ```python no-run: {unknown}"
    indented = [number for number, line in enumerate(page.read_text().splitlines(), 1)
                if re.match(r"\s+```py", line)]
    assert not indented, f"{page.relative_to(ROOT)}: indented ```python fences at lines {indented} are not run"


@pytest.mark.parametrize("page", [page for page in PAGES if runnable(page)], ids=lambda page: str(page.relative_to(ROOT)))
def test_python_blocks_run_as_written(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    namespace, printed = run_page(page, tmp_path, monkeypatch)
    left_open = [name for name, value in namespace.items() if isinstance(value, actviz.Watcher) and not value.closed]
    assert not left_open, f"{page.relative_to(ROOT)} leaves watchers open: {left_open}"
    check = CHECKS.get(str(page.relative_to(ROOT)))
    if check is not None:
        check(namespace, printed, tmp_path)
    assert_ignored_in_the_clone(page, tmp_path)


def assert_ignored_in_the_clone(page: Path, folder: Path) -> None:
    """What the page's blocks wrote in ``folder`` would be ignored by git in a clone, where a reader runs them:
    ``git status`` stays clean."""
    import subprocess

    written = sorted(path.name + ("/" if path.is_dir() else "") for path in folder.iterdir() if path.name != "tests")
    if not written or not (ROOT / ".git").exists():
        return
    ignored = subprocess.run(["git", "-C", str(ROOT), "check-ignore", "--no-index", "--stdin"], input="\n".join(written),
                             capture_output=True, text=True, timeout=30).stdout.split()
    left = [name for name in written if name not in ignored]
    assert not left, f"{page.relative_to(ROOT)}'s blocks leave {left} in a clone: add them to .gitignore or write elsewhere"


#: Pages other branches write; linked already. The test fails once one exists and is still listed here.
PENDING: set[str] = set()
LINK = re.compile(r"\]\((?!https?://|mailto:)([^)\s]+)\)")


def anchors(page: Path) -> set[str]:
    """GitHub's anchors for a page's headings: lower case, punctuation dropped, spaces as hyphens."""
    headings = re.findall(r"^#+ (.+)$", FENCE.sub("", page.read_text()), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-") for heading in headings}


def test_every_link_between_the_pages_resolves() -> None:
    broken, pending_seen = [], set()
    for page in [*PAGES, ROOT / "CHANGELOG.md"]:
        for target in LINK.findall(FENCE.sub("", page.read_text())):
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            name = str(file.relative_to(ROOT)) if file.is_relative_to(ROOT) else str(file)
            if name in PENDING:
                pending_seen.add(name)
            elif not file.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
            elif anchor and file.suffix == ".md" and anchor not in anchors(file):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, f"links to nothing: {broken}"
    written = sorted(name for name in PENDING if (ROOT / name).exists())
    assert not written, f"these pages exist now: take them off PENDING in tests/test_docs.py: {written}"
    assert pending_seen == PENDING, f"no page links these any more: {sorted(PENDING - pending_seen)}"


def test_a_wrong_expectation_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    page = tmp_path / "page.md"
    page.write_text("Text.\n\n```python\nx = 2\nprint(x + 1, 'a')   # -> 3 a\nprint(x)   # -> 3\n```\n")
    (tmp_path / "run").mkdir()
    with pytest.raises(AssertionError, match=r"page.md:6 printed '2'; the page says '3'"):
        run_page(page, tmp_path / "run", monkeypatch)


def test_no_page_advises_samples_per_plugin_images_0() -> None:
    """TensorBoard 2.21 serves no image with ``--samples_per_plugin images=0``, as
    tests/test_tensorboard_server.py::test_samples_per_plugin_zero_hides_every_image checks against a live server:
    a page may name it only to warn against it."""
    advice = []
    for page in PAGES:
        text = " ".join(page.read_text().split())
        for found in re.finditer(r"images=0\b", text):
            sentence = text[text.rfind(". ", 0, found.start()) + 2:text.find(". ", found.end()) + 1]
            if not re.search(r"\b(not|no images?|none)\b", sentence, re.I):
                advice.append(f"{page.relative_to(ROOT)}: {sentence}")
    assert not advice, f"images=0 serves no image (TensorBoard 2.21); advise images=100: {advice}"
