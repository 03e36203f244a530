"""The Lightning and Hugging Face callbacks, trained for real and read back from the event files.

``pytest.importorskip`` only guards machines without the extras; the dev extra installs
lightning, transformers and accelerate, so in CI every test here runs.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import subprocess
import sys
import warnings

import pytest
import torch
from conftest import NO_HOOKS, Run, hooks_left, small_cnn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.tensorboard import SummaryWriter

import actviz

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_DISABLED", "true")

# The small CNN inside the LightningModule, named from the module: conv, conv, batch norm, linear.
LIT_LAYERS = ["net.0", "net.2", "net.3", "net.6"]


# -- Lightning ---------------------------------------------------------------------------------


def lightning():
    return pytest.importorskip("lightning.pytorch")


def lit_cnn(pl, call_self: bool = True, fail_at: int | None = None):
    """A LightningModule around the small CNN; it counts its validation batches."""

    class LitCNN(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = small_cnn(inplace=True)
            self.validation_batches = 0

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            if fail_at is not None and self.trainer.global_step == fail_at:
                raise RuntimeError("boom")
            x, y = batch
            logits = self(x) if call_self else self.net(x)
            loss = F.cross_entropy(logits, y)
            self.log("train_loss", loss)
            return loss

        def validation_step(self, batch, batch_idx):
            self.validation_batches += 1
            x, y = batch
            self.log("val_loss", F.cross_entropy(self(x), y))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    return LitCNN()


def image_loader(batches: int = 4, batch_size: int = 4) -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(batches * batch_size, 3, 8, 8, generator=generator)
    targets = torch.randint(0, 3, (batches * batch_size,), generator=generator)
    return DataLoader(TensorDataset(inputs, targets), batch_size=batch_size)


def fit(pl, module, tmp_path, callbacks, **trainer_kwargs):
    from lightning.pytorch.loggers import TensorBoardLogger

    options = dict(
        max_steps=6,
        accelerator="cpu",
        devices=1,
        logger=TensorBoardLogger(str(tmp_path), name="lit"),
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        limit_val_batches=2,
        log_every_n_steps=1,
        default_root_dir=str(tmp_path),
    )
    options.update(trainer_kwargs)
    trainer = pl.Trainer(callbacks=callbacks, **options)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        warnings.filterwarnings("ignore", message=".*number of training batches.*")
        trainer.fit(module, image_loader(), image_loader(batches=2))
    return trainer


def histogram_steps(run: Run, tag: str) -> list[int]:
    """Steps of a histogram tag, ``[]`` when the tag was never written."""
    return run.histogram_steps(tag) if tag in run.histogram_tags else []


def image_steps(run: Run, tag: str) -> list[int]:
    return run.image_steps(tag) if tag in run.image_tags else []


def assert_logged_at(run: Run, layers: list[str], steps: list[int]) -> None:
    """Every kind of tag of every layer, each scheduled step exactly once (a duplicate would show twice)."""
    for layer in layers:
        assert histogram_steps(run, f"activations/{layer}") == steps, layer
        assert histogram_steps(run, f"gradients/{layer}") == steps, layer
        assert histogram_steps(run, f"weights/{layer}.weight") == steps, layer
        assert histogram_steps(run, f"weight_grads/{layer}.weight") == steps, layer
    assert image_steps(run, f"feature_maps/{layers[0]}") == steps


def test_lightning_logs_at_global_steps_into_the_loggers_run(tmp_path):
    pl = lightning()
    from actviz.integrations.lightning import ActvizCallback

    class WriterStillOpen(pl.Callback):
        """Runs after ActvizCallback: the logger's writer must still be open."""

        def teardown(self, trainer, pl_module, stage):
            self.open = trainer.logger.experiment.all_writers is not None

    module = lit_cnn(pl)
    callback, spy = ActvizCallback(every=2), WriterStillOpen()
    trainer = fit(pl, module, tmp_path, [callback, spy])

    assert trainer.global_step == 6
    # The sanity check (2) and the end-of-epoch validation (2) ran between logged steps.
    assert module.validation_batches >= 4
    run = Run(trainer.logger.log_dir)
    assert_logged_at(run, LIT_LAYERS, [0, 2, 4])
    assert {"train_loss", "val_loss"} <= run.scalar_tags  # one run: Lightning's metrics and actviz's tags
    assert spy.open
    assert callback.viz is None
    assert hooks_left(module) == NO_HOOKS


def test_lightning_gradient_accumulation_logs_once_per_optimizer_step(tmp_path):
    pl = lightning()
    from actviz.integrations.lightning import ActvizCallback

    module = lit_cnn(pl)
    trainer = fit(pl, module, tmp_path, [ActvizCallback(every=2)], accumulate_grad_batches=2)

    assert trainer.global_step == 6  # 12 batches
    assert_logged_at(Run(trainer.logger.log_dir), LIT_LAYERS, [0, 2, 4])
    assert hooks_left(module) == NO_HOOKS


@pytest.mark.parametrize("where", ["log_dir", "no_logger"])
def test_lightning_own_log_dir(where, tmp_path):
    pl = lightning()
    from actviz.integrations.lightning import ActvizCallback

    module = lit_cnn(pl)
    if where == "log_dir":
        trainer = fit(pl, module, tmp_path, [ActvizCallback(tmp_path / "viz", every=3)])
        run = Run(tmp_path / "viz")
        assert not any("activations/" in tag for tag in Run(trainer.logger.log_dir).histogram_tags)
    else:
        fit(pl, module, tmp_path, [ActvizCallback(every=3)], logger=False)
        run = Run(tmp_path / "actviz")
    assert_logged_at(run, LIT_LAYERS, [0, 3])
    assert hooks_left(module) == NO_HOOKS


def test_lightning_exception_in_training_removes_the_hooks(tmp_path):
    pl = lightning()
    from actviz.integrations.lightning import ActvizCallback

    module = lit_cnn(pl, fail_at=3)
    callback = ActvizCallback(every=2)
    with pytest.raises(RuntimeError, match="boom"):
        fit(pl, module, tmp_path, [callback])
    assert callback.viz is None
    assert hooks_left(module) == NO_HOOKS
    assert histogram_steps(Run(tmp_path / "lit" / "version_0"), "activations/net.0") == [0, 2]


def test_lightning_warns_when_training_step_bypasses_the_modules_forward(tmp_path):
    pl = lightning()
    from actviz.integrations.lightning import ActvizCallback

    module = lit_cnn(pl, call_self=False)
    with pytest.warns(RuntimeWarning, match=r"training_step does not call the module itself"):
        trainer = fit(pl, module, tmp_path, [ActvizCallback(every=2)], max_steps=2)
    assert not any("activations/" in tag for tag in Run(trainer.logger.log_dir).histogram_tags)
    assert hooks_left(module) == NO_HOOKS


def test_lightning_no_warning_when_training_step_calls_self(tmp_path):
    pl = lightning()
    from actviz.integrations.lightning import ActvizCallback

    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        fit(pl, lit_cnn(pl), tmp_path, [ActvizCallback(every=2)], max_steps=2)


def test_lightning_ddp_strategy(tmp_path):
    # Under DDP Lightning redirects training_step through the module's forward, and
    # training_step then calls self(x): the module runs nested inside itself.
    pl = lightning()
    from actviz.integrations.lightning import ActvizCallback

    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not available")
    module = lit_cnn(pl)
    environ = dict(os.environ)  # Lightning's DDP setup sets MASTER_ADDR, MASTER_PORT and friends
    try:
        trainer = fit(pl, module, tmp_path, [ActvizCallback(every=2)], strategy="ddp")
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        os.environ.clear()
        os.environ.update(environ)
    assert type(trainer.strategy).__name__ == "DDPStrategy"
    assert hooks_left(module) == NO_HOOKS
    assert_logged_at(Run(trainer.logger.log_dir), LIT_LAYERS, [0, 2, 4])


def test_lightning_other_ranks_watch_nothing(tmp_path):
    lightning()
    from types import SimpleNamespace

    from actviz.integrations.lightning import ActvizCallback

    model = small_cnn()
    callback = ActvizCallback(tmp_path / "viz", every=1)
    callback.on_fit_start(SimpleNamespace(is_global_zero=False), model)
    assert callback.viz is None
    assert hooks_left(model) == NO_HOOKS
    assert not (tmp_path / "viz").exists()


# -- Hugging Face ------------------------------------------------------------------------------


def transformers():
    pytest.importorskip("accelerate")  # Trainer needs it
    return pytest.importorskip("transformers")


def tiny_bert(hf):
    torch.manual_seed(0)
    config = hf.BertConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, vocab_size=100,
        max_position_embeddings=32, num_labels=2,
    )
    return hf.BertForSequenceClassification(config)


def token_batches(count: int, length: int = 8) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [
        {
            "input_ids": torch.randint(1, 100, (length,), generator=generator),
            "attention_mask": torch.ones(length, dtype=torch.long),
            "labels": torch.tensor(i % 2),
        }
        for i in range(count)
    ]


def hf_train(hf, model, tmp_path, callbacks, **kwargs):
    options = dict(
        output_dir=str(tmp_path / "out"),
        max_steps=4,
        per_device_train_batch_size=2,
        per_device_eval_batch_size=2,
        eval_strategy="steps",
        eval_steps=1,  # evaluation between every two steps: it must add none
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    options.update(kwargs)
    args = hf.TrainingArguments(**options)
    trainer = hf.Trainer(
        model=model, args=args, train_dataset=token_batches(16), eval_dataset=token_batches(2), callbacks=callbacks
    )
    trainer.train()
    return trainer


#: BERT's modules by their tag names (actviz.selection.layer_tag_names): bert.embeddings.word_embeddings,
#: bert.encoder.layer.0.attention.self.query, classifier.
BERT_LAYERS = ["word_embeddings", "0.query", "classifier"]


def assert_bert_logged_at(run: Run, steps: list[int]) -> None:
    for layer in BERT_LAYERS:
        assert histogram_steps(run, f"activations/{layer}") == steps, layer
        assert histogram_steps(run, f"gradients/{layer}") == steps, layer
        assert histogram_steps(run, f"weight_grads/{layer}.weight") == steps, layer
    assert image_steps(run, "feature_maps/1.o.dense") == steps  # bert.encoder.layer.1.output.dense, (N, T, D): a heat map


def test_huggingface_logs_at_global_steps(tmp_path):
    hf = transformers()
    from actviz.integrations.huggingface import ActvizCallback

    model = tiny_bert(hf)
    callback = ActvizCallback(every=2)
    trainer = hf_train(hf, model, tmp_path, [callback])

    assert trainer.state.global_step == 4
    assert sum("eval_loss" in entry for entry in trainer.state.log_history) >= 4  # evaluation did run
    default = getattr(trainer.args, "logging_dir", None) or tmp_path / "out" / "runs"
    assert_bert_logged_at(Run(default), [2, 4])  # the steps the Trainer logs those batches' loss at
    assert callback.viz is None
    assert hooks_left(model) == NO_HOOKS


def event_folders(root):
    return {path.parent for path in root.rglob("events.out.tfevents.*")}


def test_huggingface_writes_into_the_trainers_tensorboard_run(tmp_path):
    hf = transformers()
    from actviz.integrations.huggingface import ActvizCallback

    model = tiny_bert(hf)
    callback = ActvizCallback(every=2)
    trainer = hf_train(hf, model, tmp_path, [callback], report_to="tensorboard")

    (folder,) = event_folders(tmp_path)  # one run: the Trainer's TensorBoardCallback's folder
    assert folder.parent == tmp_path / "out" / "runs" and len(list(folder.glob("events.out.tfevents.*"))) == 2
    run = Run(folder)
    losses = {entry["step"]: entry["loss"] for entry in trainer.state.log_history if "loss" in entry}
    assert sorted(losses) == [1, 2, 3, 4]  # logging_steps=1
    assert {step: run.scalar("train/loss", step) for step in losses} == pytest.approx(losses, rel=1e-6)
    assert_bert_logged_at(run, [2, 4])
    assert callback.viz is None and callback._writer is None
    assert hooks_left(model) == NO_HOOKS


def test_huggingface_histograms_and_the_trainers_loss_share_one_run(tmp_path):
    hf = transformers()
    from actviz.integrations.huggingface import ActvizCallback

    args = hf.TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=4, per_device_train_batch_size=2, logging_steps=1,
        learning_rate=0.0, save_strategy="no", report_to="tensorboard", use_cpu=True, disable_tqdm=True,
    )
    trainer = hf.Trainer(model=ValueModel(), args=args, train_dataset=value_dataset(8),
                         callbacks=[ActvizCallback(every=1)])
    trainer.train()
    losses = {entry["step"]: entry["loss"] for entry in trainer.state.log_history if "loss" in entry}
    (folder,) = event_folders(tmp_path)
    run = Run(folder)
    assert run.histogram_steps("activations/layer") == sorted(losses) == [1, 2, 3, 4]
    assert len(set(losses.values())) > 1  # shuffled batches of different means: a step mixed up would show
    for step, loss in losses.items():  # the batch's mean value, from actviz's histogram and the Trainer's scalar
        histogram = run.histogram("activations/layer", step)
        assert histogram.sum / histogram.num == pytest.approx(loss, abs=1e-6)
        assert run.scalar("train/loss", step) == pytest.approx(loss, rel=1e-6)


def test_huggingface_tensorboard_callback_after_it_warns_and_writes_a_run_of_its_own(tmp_path):
    hf = transformers()
    from transformers.integrations import TensorBoardCallback

    from actviz.integrations.huggingface import ActvizCallback

    args = hf.TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=2, logging_steps=1,
        save_strategy="no", report_to="none", use_cpu=True, disable_tqdm=True,
    )
    trainer = hf.Trainer(model=ValueModel(), args=args, train_dataset=value_dataset(4),
                         callbacks=[ActvizCallback(every=1), TensorBoardCallback()])  # its folder is made after ours
    with pytest.warns(RuntimeWarning, match="could not find the folder of the Trainer's TensorBoardCallback"):
        trainer.train()
    default = getattr(trainer.args, "logging_dir", None) or tmp_path / "out" / "runs"
    assert Run(default).histogram_steps("activations/layer") == [1, 2]


def test_huggingface_gradient_accumulation_logs_once_per_optimizer_step(tmp_path):
    hf = transformers()
    from actviz.integrations.huggingface import ActvizCallback

    model = tiny_bert(hf)
    trainer = hf_train(hf, model, tmp_path, [ActvizCallback(tmp_path / "viz", every=2)], gradient_accumulation_steps=2)

    assert trainer.state.global_step == 4  # 8 micro-batches
    assert_bert_logged_at(Run(tmp_path / "viz"), [2, 4])
    assert hooks_left(model) == NO_HOOKS


def test_huggingface_other_processes_watch_nothing(tmp_path):
    hf = transformers()
    from actviz.integrations.huggingface import ActvizCallback

    model = small_cnn()
    callback = ActvizCallback(tmp_path / "viz", every=1)
    state = hf.TrainerState(is_world_process_zero=False)
    callback.on_train_begin(None, state, hf.TrainerControl(), model=model)
    assert callback.viz is None
    assert hooks_left(model) == NO_HOOKS
    assert not (tmp_path / "viz").exists()


# -- Import guards and arguments ---------------------------------------------------------------


@pytest.mark.parametrize(
    "adapter, packages, extra",
    [
        ("actviz.integrations.lightning", ("lightning", "pytorch_lightning"), "lightning"),
        ("actviz.integrations.huggingface", ("transformers",), "huggingface"),
    ],
)
def test_import_without_the_framework_says_what_to_install(adapter, packages, extra, monkeypatch):
    # A None entry makes Python treat the package, and any submodule already loaded, as not installed.
    for name in list(sys.modules):
        if name.split(".")[0] in packages:
            monkeypatch.setitem(sys.modules, name, None)
    for name in packages:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.delitem(sys.modules, adapter, raising=False)
    with pytest.raises(ImportError, match=re.escape(f'pip install -e ".[{extra}]"')):
        importlib.import_module(adapter)


def test_import_actviz_needs_no_framework():
    code = (
        "import sys, actviz, actviz.integrations; "
        "print(sorted(m for m in ('lightning', 'pytorch_lightning', 'transformers', 'accelerate') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert result.stdout.strip() == "[]"


def adapters():
    found = []
    if importlib.util.find_spec("lightning") is not None:
        found.append(importlib.import_module("actviz.integrations.lightning").ActvizCallback)
    if importlib.util.find_spec("transformers") is not None:
        found.append(importlib.import_module("actviz.integrations.huggingface").ActvizCallback)
    return found


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"evry": 2}, TypeError, "unknown actviz.watch() argument 'evry'; did you mean 'every'?"),
        ({"auto_step": True}, TypeError, "ActvizCallback no longer takes auto_step=; pass options=actviz.Options(auto_step=...)"),
        ({"bins": 0}, TypeError, "ActvizCallback no longer takes bins=; pass options=actviz.Options(bins=...)"),
        ({"writer": object()}, TypeError, "ActvizCallback no longer takes writer=; pass sink=writer (a SummaryWriter "),
        ({"model": torch.nn.Linear(1, 1)}, TypeError, "sets model= itself"),
        ({"every": 0}, ValueError, "every must be a positive number of steps"),
        ({"image_every": "often"}, TypeError, "image_every must be an int"),
        ({"log_dir": "runs/x", "sink": SummaryWriter.__new__(SummaryWriter)}, ValueError, "a log_dir or a SummaryWriter as sink=, not both"),
        ({"options": {"bins": 0}}, TypeError, "options must be an actviz.Options, got dict"),
        ({"statistics": ["default", "update_ratios"]}, ValueError,
         "unknown statistic 'update_ratios'; did you mean 'update_ratio'?"),
        ({"extras": [actviz.Spikes(), actviz.Spikes()]}, ValueError, "extras holds two Spikes objects; give one"),
    ],
)
def test_callbacks_check_their_arguments_when_made(kwargs, error, message):
    callbacks = adapters()
    if not callbacks:
        pytest.skip("neither lightning nor transformers is installed")
    for callback in callbacks:
        with pytest.raises(error, match=re.escape(message)):
            callback(**kwargs)


# -- the same batch in actviz's histograms and in the trainer's loss curve -----------------------


class ValueModel(torch.nn.Module):
    """``layer`` passes its input through unchanged, and the loss is the batch's mean value.

    A dataset whose sample i holds the value i then tells, from the histogram of
    ``activations/layer`` at a step, which batch actviz logged there.
    """

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        with torch.no_grad():
            self.layer.weight.fill_(1.0)
            self.layer.bias.zero_()

    def forward(self, x, labels=None):
        out = self.layer(x)
        loss = x.mean() + (out - out.detach()).sum()  # the batch's value, with a gradient through the layer
        return {"loss": loss, "logits": out}


def value_dataset(count: int):
    return [{"x": torch.tensor([float(i)])} for i in range(count)]


def test_huggingface_histograms_line_up_with_the_trainers_loss(tmp_path):
    hf = transformers()
    from actviz.integrations.huggingface import ActvizCallback

    args = hf.TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=6, per_device_train_batch_size=2, logging_steps=1,
        learning_rate=0.0, save_strategy="no", report_to="none", use_cpu=True, disable_tqdm=True,
    )
    trainer = hf.Trainer(model=ValueModel(), args=args, train_dataset=value_dataset(12),
                         callbacks=[ActvizCallback(tmp_path / "viz", every=1)])
    trainer.train()
    losses = {entry["step"]: entry["loss"] for entry in trainer.state.log_history if "loss" in entry}
    run = Run(tmp_path / "viz")
    steps = run.histogram_steps("activations/layer")
    assert steps == sorted(losses) and len(steps) == 6
    for step in steps:
        histogram = run.histogram("activations/layer", step)
        assert histogram.sum / histogram.num == pytest.approx(losses[step], abs=1e-6), step


def test_lightning_histograms_line_up_with_the_loss_it_logs(tmp_path):
    pl = lightning()
    from lightning.pytorch.loggers import TensorBoardLogger

    from actviz.integrations.lightning import ActvizCallback

    class LitValue(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = ValueModel()

        def forward(self, x):
            return self.model(x)

        def training_step(self, batch, batch_idx):
            loss = self(batch["x"])["loss"]
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)

    logger = TensorBoardLogger(str(tmp_path), name="lit")
    trainer = pl.Trainer(
        max_steps=6, accelerator="cpu", devices=1, logger=logger, callbacks=[ActvizCallback(every=1)],
        enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False, log_every_n_steps=1,
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        trainer.fit(LitValue(), DataLoader(value_dataset(12), batch_size=2, shuffle=True))
    run = Run(logger.log_dir)
    losses = {event.step: event.value for event in run.events.Scalars("train_loss")}
    steps = run.histogram_steps("activations/model.layer")
    assert steps == sorted(losses) and len(steps) == 6
    for step in steps:
        histogram = run.histogram("activations/model.layer", step)
        assert histogram.sum / histogram.num == pytest.approx(losses[step], abs=1e-6), step
