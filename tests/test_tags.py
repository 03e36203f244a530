"""actviz.tags is the vocabulary: every tag a run writes matches one of its patterns, every pattern is written by
some run, and the tag tables of README.md and docs/how-it-works.md are generated from it."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from conftest import Run, small_cnn

import actviz
from actviz.tags import PATTERNS, ROWS, markdown_table, pattern_of

ROOT = Path(__file__).resolve().parents[1]


def table_in(page: Path, heading: str) -> str:
    """The first Markdown table under ``heading`` of ``page``."""
    section = page.read_text().split(f"\n{heading}\n", 1)[1].split("\n## ", 1)[0]
    lines = section.splitlines()
    start = next(index for index, line in enumerate(lines) if line.startswith("| TensorBoard tab |"))
    end = next((index for index in range(start, len(lines)) if not lines[index].startswith("|")), len(lines))
    return "\n".join(lines[start:end])


def patterns_of_table(table: str) -> list[str]:
    """The tag patterns a table lists, ``std@`` after ``activation_stats/mean@{layer}`` read as its sibling."""
    found = []
    for row in table.splitlines()[2:]:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        tags = [tag.strip().strip("`") for tag in cells[1].split(",")]
        group, _, layer = tags[0].partition("/")[0], None, tags[0].partition("@")[2]
        found += [tags[0]] + [f"{group}/{tag}{layer}" if tag.endswith("@") else tag for tag in tags[1:]]
    return found


def shown(row) -> list[str]:
    """The tags of ``row`` as TensorBoard names them: after "~", but for the Text tab's."""
    return list(row.tags) if row.tab == "Text" else ["~" + tag for tag in row.tags]


def test_the_readme_tag_table_is_the_vocabularys_readme_rows():
    table = table_in(ROOT / "README.md", "## What you see")
    expected = markdown_table(tuple(row for row in ROWS if row.readme))
    assert patterns_of_table(table) == [tag for row in ROWS if row.readme for tag in shown(row)]
    assert table == expected, f"README.md's tag table: replace it with actviz.tags.markdown_table(readme rows):\n{expected}"


def test_the_how_it_works_tag_table_is_every_tag():
    table = table_in(ROOT / "docs" / "how-it-works.md", "## Every tag")
    assert patterns_of_table(table) == [tag for row in ROWS for tag in shown(row)]
    assert [pattern_of(tag.replace("{", "").replace("}", "")) for tag in patterns_of_table(table)] == list(PATTERNS)
    assert table == markdown_table(), f"docs/how-it-works.md's tag table: replace it with:\n{markdown_table()}"


def test_the_table_reader_reads_a_wrong_table():
    table = "| TensorBoard tab | tag | what it is |\n|---|---|---|\n| Scalars | `a/x@{layer}`, `y@`, `b/z` | m |"
    assert patterns_of_table(table) == ["a/x@{layer}", "a/y@{layer}", "b/z"]
    assert pattern_of("a/x@conv") is None and pattern_of("activation_stats/" + "conv/std") is None
    assert pattern_of("activation_stats/std@conv") == "activation_stats/std@{layer}"
    assert pattern_of("a/conv/x") is None and pattern_of("activations/lstm/1.0") == "activations/{layer}"
    assert pattern_of("~activations/lstm/1.0") == "activations/{layer}" and pattern_of("~~activations/x") is None


def all_tags(run: Run) -> set[str]:
    tags = run.events.Tags()
    return run.image_tags | run.histogram_tags | run.scalar_tags | set(tags["tensors"])


class TopTwo(torch.nn.Module):
    """A router's top 2 of 4 experts, in a class no name says is one: ``moe=True`` finds it."""

    def __init__(self) -> None:
        super().__init__()
        self.router = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.router(x).softmax(-1).topk(2).values


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> set[str]:
    """Every tag of two runs that turn everything on: a CNN (probe, Grad-CAM, AMP, update ratio, a spike, a NaN)
    and a transformer (attention and its logit bound, logits, outliers, attention maps, gradient noise, the residual
    stream), and a mixture of experts' router."""
    folder = tmp_path_factory.mktemp("runs")
    model = small_cnn(inplace=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with actviz.watch(model, folder / "cnn", every=1000, layers="all",
                          statistics=["default", "update_ratio", "gradient_kurtosis", "weight_grad_kurtosis",
                                      "dormant_units", "fp8_readiness", "fp8_gradients"],
            extras=[actviz.Probe(torch.randn(1, 3, 8, 8), gradcam=True), actviz.Spikes()],
            options=actviz.Options(grad_scaler=scaler, flow_pictures=True)) as viz:
            for step in range(20):  # a spike at step 18 logs 19 in full, where a NaN comes in
                loss = model(torch.randn(4, 3, 8, 8) / (0.0 if step == 19 else 1.0)).square().mean()
                loss = loss * (1000.0 if step == 18 else 1.0)
                optimizer.zero_grad()
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
        assert {"gradient_spike", "nonfinite"} <= {alert.rule for alert in viz.alerts}
        # No dropout: SDPA's fused kernel, whose log-sum-exp gives attention/logit_bound@
        transformer = torch.nn.TransformerEncoder(
            torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True), 1, enable_nested_tensor=False)
        with actviz.watch(transformer, folder / "transformer", every=1, statistics=[
                "default", "gradient_noise", "update_rms", "update_lost", "adam_epsilon", "residual"],
            extras=[actviz.Probe(torch.randn(1, 6, 16))]):
            with torch.autocast("cpu", dtype=torch.bfloat16):  # low precision: headroom_bits
                output = transformer(torch.randn(2, 6, 16))
            output.float().sum().backward()
            torch.optim.Adam(transformer.parameters()).step()  # the update statistics: update_stats/*
        router = TopTwo()
        with actviz.watch(router, folder / "moe", every=1, statistics=["default", "moe"]):
            router(torch.randn(8, 16)).sum().backward()
        mlp = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU())
        with torch.no_grad():
            mlp[0].weight[1], mlp[0].bias[1] = 0.0, -1.0  # unit 1 dormant: the text of dormant units
        with actviz.watch(mlp, folder / "dormant", every=1, statistics=["dormant_units"]):
            mlp(torch.randn(8, 4)).sum().backward()
    return (all_tags(Run(folder / "cnn")) | all_tags(Run(folder / "transformer")) | all_tags(Run(folder / "moe"))
            | all_tags(Run(folder / "dormant")))


def test_every_tag_written_is_in_the_vocabulary(written):
    assert not {tag for tag in written if pattern_of(tag) is None and not tag.startswith("custom_scalars")}


def test_every_pattern_of_the_vocabulary_is_written(written):
    assert set(PATTERNS) - {pattern_of(tag) for tag in written} == set()


def test_tensorboard_holds_actvizs_scalars_histograms_and_images_after_a_tilde(tmp_path):
    """Read without conftest's Run, which maps the names: TensorBoard's own tags, as its dashboards list them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    model = small_cnn()
    with actviz.watch(model, tmp_path, every=1):
        model(torch.randn(2, 3, 8, 8)).square().mean().backward()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    tags = events.Tags()
    assert "~activations/0" in tags["histograms"] and "~gradient_stats/norm@0" in tags["scalars"]
    assert "~feature_maps/0" in tags["images"] and "layers" in tags["tensors"]
    for kind in ("images", "histograms", "scalars"):
        assert tags[kind] and all(tag.startswith("~") and pattern_of(tag) for tag in tags[kind]), (kind, tags[kind])
