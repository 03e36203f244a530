"""Layer selection and schedules: every spec form, and every way to get one wrong."""

from collections import OrderedDict
from pathlib import Path

import pytest
import torch
import torchvision
from torch import nn

import actviz
from conftest import NO_HOOKS, hooks_left
from actviz.schedule import Schedule
from actviz.selection import ROOT_NAME, default_layers, select_layers

DATA = Path(__file__).parent / "data"


@pytest.fixture(scope="module")
def alexnet():
    return torchvision.models.alexnet(num_classes=10)


def names(pairs):
    return [name for name, _ in pairs]


def test_default_is_every_module_that_owns_parameters(alexnet):
    assert names(default_layers(alexnet)) == [
        "features.0", "features.3", "features.6", "features.8", "features.10",
        "classifier.1", "classifier.4", "classifier.6",
    ]


def test_default_includes_norms_embeddings_rnns_and_attention():
    model = nn.ModuleDict({
        "embed": nn.Embedding(10, 4), "norm": nn.LayerNorm(4), "rnn": nn.LSTM(4, 4),
        "attn": nn.MultiheadAttention(4, 2), "act": nn.GELU(),
    })
    assert names(default_layers(model)) == ["embed", "norm", "rnn", "attn", "attn.out_proj"]


def test_every_spec_form(alexnet):
    assert names(select_layers(alexnet, nn.Linear)) == ["classifier.1", "classifier.4", "classifier.6"]
    assert names(select_layers(alexnet, "features.3")) == ["features.3"]
    assert names(select_layers(alexnet, ["classifier.*"])) == ["classifier.0", "classifier.1", "classifier.2", "classifier.3", "classifier.4", "classifier.5", "classifier.6"]
    assert names(select_layers(alexnet, [alexnet.features[8]])) == ["features.8"]
    assert names(select_layers(alexnet, lambda name, m: isinstance(m, nn.ReLU) and name.startswith("features"))) == [
        "features.1", "features.4", "features.7", "features.9", "features.11",
    ]


def test_specs_union_in_model_order(alexnet):
    chosen = select_layers(alexnet, ["classifier.6", nn.MaxPool2d, "features.0"])
    assert names(chosen) == ["features.0", "features.2", "features.5", "features.12", "classifier.6"]


def test_the_model_itself_can_be_a_layer():
    model = nn.Linear(3, 2)
    assert names(select_layers(model)) == [""]
    from actviz.selection import layer_display_name
    assert layer_display_name("") == ROOT_NAME


def test_unknown_name_suggests_the_closest(alexnet):
    with pytest.raises(ValueError, match=r"unknown layer 'feature\.0'; did you mean 'features\.0'"):
        select_layers(alexnet, ["feature.0"])
    with pytest.raises(ValueError, match=r"layer pattern 'clasifier\.\*' matches no layer; did you mean 'classifier"):
        select_layers(alexnet, "clasifier.*")


def test_specs_that_match_nothing(alexnet):
    with pytest.raises(ValueError, match=r"no layer of type Conv3d.*types present: .*Conv2d"):
        select_layers(alexnet, nn.Conv3d)
    with pytest.raises(ValueError, match="not part of the model"):
        select_layers(alexnet, nn.Linear(2, 2))
    with pytest.raises(ValueError, match="matched no layer"):
        select_layers(alexnet, lambda name, module: False)
    with pytest.raises(ValueError, match="empty"):
        select_layers(alexnet, [])
    with pytest.raises(ValueError, match="no module with parameters"):
        select_layers(nn.Sequential(nn.ReLU(), nn.Flatten()))


def test_bad_spec_types(alexnet):
    with pytest.raises(TypeError, match="got int: 3"):
        select_layers(alexnet, [3])
    with pytest.raises(TypeError, match="nn.Module subclass, got int"):
        select_layers(alexnet, [int])


def test_named_sequential():
    net = nn.Sequential(OrderedDict(conv=nn.Conv2d(1, 1, 1), head=nn.Linear(1, 1)))
    assert names(select_layers(net, "he*")) == ["head"]


def test_schedules():
    assert [s for s in range(12) if Schedule.parse(5)(s)] == [0, 5, 10]
    assert [s for s in range(12) if Schedule.parse({2, 3})(s)] == [2, 3]
    assert [s for s in range(12) if Schedule.parse(lambda s: s > 9)(s)] == [10, 11]
    for bad, error, message in [
        (0, ValueError, "every must be a positive number of steps, got 0"),
        (-5, ValueError, "got -5"),
        ([], ValueError, "empty"),
        ([1, -2], ValueError, "-2"),
        ("10", TypeError, "got str"),
        (2.5, TypeError, "got float"),
    ]:
        with pytest.raises(error, match=message):
            Schedule.parse(bad)


def test_keywords_select_by_type(alexnet):
    assert names(select_layers(alexnet, "conv")) == ["features.0", "features.3", "features.6", "features.8", "features.10"]
    assert names(select_layers(alexnet, "relu")) == [
        "features.1", "features.4", "features.7", "features.9", "features.11", "classifier.2", "classifier.5"]
    leaves = [name for name, module in alexnet.named_modules() if name and not list(module.children())]
    assert names(select_layers(alexnet, "all")) == leaves and len(leaves) == 21
    assert names(select_layers(alexnet, ["classifier.6", "conv"]))[-2:] == ["features.10", "classifier.6"]
    assert names(select_layers(nn.Linear(2, 2), "all")) == [""]  # a model without children is its one layer


def test_a_keyword_wins_over_a_layer_of_that_name_and_a_glob_reaches_the_layer():
    # Like torchvision's ResNet: a layer named "relu" beside the ReLUs of the blocks.
    conv_block = nn.Sequential(nn.Conv2d(1, 1, 1), nn.Conv2d(1, 1, 1))
    net = nn.Sequential(OrderedDict(conv=conv_block, relu=nn.ReLU(), block=nn.Sequential(nn.ReLU())))
    assert names(select_layers(net, "conv")) == ["conv.0", "conv.1"]  # every Conv2d, not the block
    assert names(select_layers(net, "relu")) == ["relu", "block.0"]
    assert names(select_layers(net, "con[v]")) == ["conv"]  # the layer itself, by a glob
    assert names(select_layers(net, [conv_block])) == ["conv"]  # or by its module object


def test_keyword_errors_teach(alexnet):
    with pytest.raises(ValueError, match=r"unknown layer 'convs'; did you mean the keyword 'conv' \(every nn.Conv2d\)"):
        select_layers(alexnet, "convs")
    transformer = nn.TransformerEncoderLayer(8, 2)
    with pytest.raises(ValueError, match=r"layers='conv' selects every nn.Conv2d, and the model has none; "
                                         r"types present: .*Linear.*Pass 'all', a module type or layer names"):
        select_layers(transformer, "conv")


def test_watch_and_report_share_the_keywords(tmp_path):
    import actviz

    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 3), nn.ReLU())
    with actviz.watch(model, tmp_path, layers="relu") as viz:
        assert viz.layer_names == ["1", "3"]
    result = actviz.report(model, [DATA / "chelsea.jpg"], layers="relu", logdir=None, size=32, progress=False)
    assert result.layer_names == ["1", "3"]


class _ForwardForwardNet(nn.Module):
    """pytorch/examples' forward-forward network keeps its layers in a plain list (and has no forward of its own)."""

    def __init__(self, plain: bool = True) -> None:
        super().__init__()
        layers = [nn.Linear(6, 5), nn.Linear(5, 4)]
        self.layers = layers if plain else nn.ModuleList(layers)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x).relu()
        return x


def test_a_model_with_layers_in_a_plain_list_is_told_so_and_the_fix_works(tmp_path, read_run):
    with pytest.raises(ValueError) as raised:
        select_layers(_ForwardForwardNet())
    message = str(raised.value)
    assert "self.layers is a plain Python list of 2 (Linear)" in message
    assert "nn.ModuleList" in message and "nn.ReLU" not in message
    fixed = _ForwardForwardNet(plain=False)  # what the message says to do
    assert [name for name, _ in select_layers(fixed)] == ["layers.0", "layers.1"]
    with actviz.watch(fixed, tmp_path) as viz:
        x = torch.randn(3, 6)
        fixed(x).sum().backward()
    run = read_run(tmp_path)
    expected = fixed.layers[0](x)
    assert run.scalar("activation_stats/mean@layers.0", 0) == pytest.approx(expected.double().mean().item(), rel=1e-5)
    assert viz.parameter_names == ["layers.0.weight", "layers.0.bias", "layers.1.weight", "layers.1.bias"]


class _PlainTensorNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.randn(3, 3, requires_grad=True)

    def forward(self, x):
        return x @ self.weight


@pytest.mark.parametrize(
    ("model", "says", "suggested"),
    [
        (nn.Sequential(nn.ReLU(), nn.Flatten()), "layers='all' (every module without children) or layers='relu'",
         ["all", "relu"]),
        (nn.Sequential(nn.Tanh(), nn.Flatten()), "layers='all' (every module without children), or", ["all"]),
        (nn.ReLU(), "layers='all' to watch the model's own output", ["all"]),
        (_PlainTensorNet(), "self.weight is a tensor that requires grad: wrap it in nn.Parameter", []),
    ],
)
def test_no_default_layers_says_what_is_true_and_every_suggestion_works(model, says, suggested, tmp_path):
    with pytest.raises(ValueError) as raised:
        select_layers(model)
    assert says in str(raised.value)
    assert "nn.ReLU]" not in str(raised.value)
    for spec in suggested:  # each suggestion selects layers, and a watcher made with it logs
        assert select_layers(model, spec)
        with actviz.watch(model, tmp_path / spec, layers=spec) as viz:
            model(torch.randn(2, 3))
            viz.flush()
            assert viz.latest is not None and viz.latest.activations


def test_a_class_name_as_a_string_is_told_to_pass_the_class():
    model = nn.Sequential(nn.Linear(2, 4), nn.ReLU(), nn.Linear(4, 2))
    with pytest.raises(ValueError, match=r"^unknown layer 'Linear'; 'Linear' is a class name, not a layer name: pass "
                                         r"the class, layers=nn\.Linear \(2 of this model's modules are one\)$"):
        actviz.watch(model, layers="Linear")
    with pytest.raises(ValueError, match=r"layers=nn\.Conv2d \(this model has none\)$"):
        actviz.watch(model, layers="conv2d")
    assert hooks_left(model) == NO_HOOKS


def bert_like() -> nn.Module:
    """BERT's module names (bert.embeddings..., bert.encoder.layer.N.attention.self.query, ...), tiny layers."""
    def block() -> nn.Module:
        return nn.ModuleDict({
            "attention": nn.ModuleDict({
                "self": nn.ModuleDict({name: nn.Linear(2, 2) for name in ("query", "key", "value")}),
                "output": nn.ModuleDict({"dense": nn.Linear(2, 2), "LayerNorm": nn.LayerNorm(2)})}),
            "intermediate": nn.ModuleDict({"dense": nn.Linear(2, 2)}),
            "output": nn.ModuleDict({"dense": nn.Linear(2, 2), "LayerNorm": nn.LayerNorm(2)})})

    bert = nn.ModuleDict({
        "embeddings": nn.ModuleDict({"word_embeddings": nn.Embedding(4, 2), "LayerNorm": nn.LayerNorm(2)}),
        "encoder": nn.ModuleDict({"layer": nn.ModuleList([block(), block()])}),
        "pooler": nn.ModuleDict({"dense": nn.Linear(2, 2)})})
    return nn.ModuleDict({"bert": bert, "classifier": nn.Linear(2, 2)})


def test_long_module_names_get_short_unique_tag_names_that_keep_what_tells_them_apart():
    from actviz.selection import layer_tag_names

    model = bert_like()
    names = layer_tag_names(model)
    watched = {name: names[name] for name, _ in default_layers(model)}
    layer_0 = {
        "bert.encoder.layer.0.attention.self.query": "0.query",
        "bert.encoder.layer.0.attention.self.key": "0.key",
        "bert.encoder.layer.0.attention.self.value": "0.value",
        "bert.encoder.layer.0.attention.output.dense": "0.a.o.dense",
        "bert.encoder.layer.0.attention.output.LayerNorm": "0.a.o.LayerNorm",
        "bert.encoder.layer.0.intermediate.dense": "0.i.dense",
        "bert.encoder.layer.0.output.dense": "0.o.dense",
        "bert.encoder.layer.0.output.LayerNorm": "0.o.LayerNorm",
    }
    assert watched == {
        "bert.embeddings.word_embeddings": "word_embeddings",
        "bert.embeddings.LayerNorm": "e.LayerNorm",  # "LayerNorm" alone: other modules end so too
        **layer_0,
        **{name.replace(".0.", ".1."): short.replace("0.", "1.", 1) for name, short in layer_0.items()},
        "bert.pooler.dense": "pooler.dense",
        "classifier": "classifier",
    }
    assert len(set(names.values())) == len(names)  # every module of the model, not only the watched, unique
    assert names[""] == ROOT_NAME


@pytest.mark.parametrize("make", [lambda: torchvision.models.resnet18(), lambda: torchvision.models.mobilenet_v3_small(),
                                  lambda: nn.Sequential(*[nn.Sequential(nn.Linear(2, 2)) for _ in range(12)])])
def test_short_names_are_kept_and_every_tag_name_is_unique(make):
    from actviz.selection import SHORT_NAME, layer_tag_names

    model = make()
    names = layer_tag_names(model)
    assert len(set(names.values())) == len(names)
    assert all(tag == name for name, tag in names.items() if name and len(name) <= SHORT_NAME)


def test_a_watched_bert_logs_and_describes_its_layers_by_tag_name(tmp_path, read_run):
    model = bert_like()["bert"]["encoder"]["layer"]  # blocks that take a tensor: a forward of our own
    model = nn.ModuleDict({"encoder": nn.ModuleDict({"layer": model})})

    class Run(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bert = model

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.bert["encoder"]["layer"]:
                x = block["attention"]["self"]["query"](x) + block["attention"]["self"]["key"](x)
            return x

    net = Run()
    with actviz.watch(net, tmp_path, every=1, layers=nn.Linear) as viz:
        net(torch.randn(3, 2)).sum().backward()
    run = read_run(tmp_path)
    assert "activation_stats/std@0.query" in run.scalar_tags and "activation_stats/std@1.key" in run.scalar_tags
    assert "gradients/1.query" in run.histogram_tags and "weights/0.query.weight" in run.histogram_tags
    table = viz.layer_table
    assert table.splitlines()[0] == "| layer | type | output shape | parameters | module |"
    assert "| 0.query | Linear | 3 × 2 | 6 | bert.encoder.layer.0.attention.self.query |" in table.splitlines()
