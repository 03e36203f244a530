"""The README's code, pasted into a plain PyTorch loop, does what the README says."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from conftest import NO_HOOKS, Run, hooks_left
from torch import nn

import actviz

README = Path(__file__).parent.parent / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def block_containing(text: str) -> str:
    (block,) = [b for b in python_blocks() if text in b]
    return block


class MiniNet(nn.Module):
    """Shaped like torchvision's AlexNet and VGG: features, then a classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(inplace=True), nn.MaxPool2d(2), nn.Conv2d(8, 8, 3))
        self.classifier = nn.Sequential(nn.Dropout(), nn.Linear(8 * 4 * 4, 16), nn.ReLU(inplace=True), nn.Linear(16, 4))

    def forward(self, x):
        return self.classifier(self.features(x).flatten(1))


def plain_loop_namespace() -> dict:
    torch.manual_seed(0)
    model = MiniNet()
    loader = [(torch.randn(2, 3, 14, 14), torch.tensor([0, 3])) for _ in range(3)]
    return {
        "actviz": actviz,
        "model": model,
        "loader": loader,
        "loss_fn": nn.CrossEntropyLoss(),
        "optimizer": torch.optim.SGD(model.parameters(), lr=0.01),
    }


def test_the_one_liner_in_a_plain_loop(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace = plain_loop_namespace()
    exec(block_containing('viz = actviz.watch(model, "runs/exp1")'), namespace)
    run = Run(tmp_path / "runs" / "exp1")
    assert run.image_steps("feature_maps/features.0") == [0]
    assert run.histogram_steps("gradients/classifier.3") == [0]
    assert hooks_left(namespace["model"]) == NO_HOOKS


def test_the_more_control_example(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace = plain_loop_namespace()
    exec(block_containing("image_every=200"), namespace)
    viz, model = namespace["viz"], namespace["model"]
    assert viz.layer_names == ["features.0", "features.3"] + [f"classifier.{i}" for i in range(4)]
    for inputs, targets in namespace["loader"]:
        namespace["loss_fn"](model(inputs), targets).backward()
    viz.close()
    namespace["viz"].writer.close()  # the README's writer is the user's to close
    run = Run(tmp_path / "runs" / "x")
    assert run.image("feature_maps/features.0", 0).shape[0] > 0
    assert run.histogram_steps("activations/classifier.2") == [0]


@pytest.mark.parametrize("marker", ["every=[0, 1, 2, 5, 10, 100]", "auto_step=False"])
def test_the_schedule_examples_run(marker, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace = plain_loop_namespace()
    if marker == "auto_step=False":
        namespace["loader"] = [torch.randn(16, 3, 14, 14) for _ in range(2)]
    code = block_containing(marker)
    if marker.startswith("every="):
        code = code.splitlines()[0]  # the first of two alternative lines
        code = "viz = " + code
    exec(code, namespace)
    namespace["viz"].close()
    assert (tmp_path / "runs" / "x").is_dir()


def test_the_report_example_from_python(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "data").symlink_to(Path(__file__).parent / "data")
    exec(block_containing("result = actviz.report("), {"actviz": actviz})
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("features.0 Conv2d (1, 64, 31, 31) ")  # size=128
    assert printed[-1] == f"{Path('report_html') / 'index.html'} {{}}"  # the page; no image failed
    assert (tmp_path / "report_html" / "index.html").is_file()
    assert list((tmp_path / "runs" / "report" / "alexnet" / "chelsea").glob("events.out.tfevents.*"))
