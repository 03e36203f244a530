"""Never break the program it watches: copies, pickles, forks, compile/script/trace/export, dead writers, odd outputs.

Anything that could hang runs in a subprocess with a hard timeout.
"""

from __future__ import annotations

import copy
import dataclasses
import io
import os
import pickle
import re
import subprocess
import sys
import tempfile
import textwrap
import threading
import warnings
from pathlib import Path

import pytest
import torch
from conftest import NO_HOOKS, hooks_left, train
from torch import nn

import actviz

ROOT = Path(__file__).resolve().parents[1]


def run_script(source: str, timeout: float = 120) -> str:
    """Run ``source`` in a fresh Python with this checkout first on the path; fail on a non-zero exit or a hang."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as folder:
        script = Path(folder) / "script.py"  # a file, so that spawned workers can import its functions
        script.write_text(textwrap.dedent(source))
        done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=timeout, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


# -- one optimizer hook per process: several steps end at one optimizer.step() -----------------------------------


def test_encoder_and_decoder_watched_separately_share_one_optimizer(tmp_path, read_run):
    encoder, decoder = mlp(), nn.Linear(2, 3)
    optimizer = torch.optim.SGD([*encoder.parameters(), *decoder.parameters()], lr=0.1)
    with actviz.watch(encoder, tmp_path / "enc", every=1) as a, actviz.watch(decoder, tmp_path / "dec", every=1) as b:
        for _ in range(3):
            optimizer.zero_grad()
            decoder(encoder(torch.randn(3, 4))).square().mean().backward()
            optimizer.step()
    assert (a.step, b.step) == (3, 3)
    assert read_run(tmp_path / "enc").histogram_steps("weight_grads/0.weight") == [0, 1, 2]
    assert read_run(tmp_path / "dec").histogram_steps("weight_grads/weight") == [0, 1, 2]
    assert hooks_left(encoder) == NO_HOOKS and hooks_left(decoder) == NO_HOOKS


def test_a_model_and_its_submodule_both_watched(tmp_path, read_run):
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with actviz.watch(model, tmp_path / "all", every=1), actviz.watch(model[2], tmp_path / "head", every=1):
        for _ in range(3):
            optimizer.zero_grad()
            model(torch.randn(3, 4)).square().mean().backward()
            optimizer.step()
    assert read_run(tmp_path / "head").histogram_steps("weight_grads/weight") == [0, 1, 2]
    assert hooks_left(model) == NO_HOOKS


def test_the_readme_siamese_pair_with_a_schedule_function(tmp_path, read_run):
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    with actviz.watch(model, tmp_path, every=lambda step: step < 10 or step % 100 == 0):  # each forward a step
        for _ in range(8):
            optimizer.zero_grad()
            (model(torch.randn(3, 4)) - model(torch.randn(3, 4))).square().mean().backward()
            optimizer.step()
    run = read_run(tmp_path)
    assert run.histogram_steps("activations/0") == list(range(10))
    assert run.histogram_steps("gradients/0") == list(range(10))  # both halves waited for their backward


def test_two_watched_models_train_in_two_threads(tmp_path, read_run):
    errors: list[BaseException] = []

    def loop(name: str) -> None:
        try:
            model = mlp()
            optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
            with actviz.watch(model, tmp_path / name, every=1):
                for _ in range(20):
                    optimizer.zero_grad()
                    model(torch.randn(3, 4)).square().mean().backward()
                    optimizer.step()
        except BaseException as error:  # noqa: BLE001
            errors.append(error)

    threads = [threading.Thread(target=loop, args=(name,)) for name in ("a", "b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads) and errors == []
    for name in ("a", "b"):
        assert read_run(tmp_path / name).histogram_steps("activations/0") == list(range(20))


# -- copies carry nothing live ---------------------------------------------------------------------------------


def copies_of(model: nn.Module) -> dict[str, nn.Module]:
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    averaged = torch.optim.swa_utils.AveragedModel(model)
    return {
        "deepcopy": copy.deepcopy(model),
        "pickle": pickle.loads(pickle.dumps(model)),
        "torch.save": torch.load(buffer, weights_only=False),
        "AveragedModel": averaged.module,
    }


def test_copies_and_pickles_of_a_watched_model_carry_nothing_live(tmp_path, read_run):
    model = mlp()
    viz = actviz.watch(model, tmp_path / "original", every=1)
    train(model, optimizer=False)  # during and after a logging step
    copies = copies_of(model)
    for name, twin in copies.items():
        train(twin, 3, optimizer=False)
        assert viz.step == 1, name  # the copies' forwards are not the original's steps
        assert torch.equal(twin[0].weight, model[0].weight)
    second = actviz.watch(copies["deepcopy"], tmp_path / "copy", every=1)  # watch() on a copy works
    train(copies["deepcopy"], 2, optimizer=False)
    second.close()
    viz.close()
    for twin in copies.values():
        train(twin, optimizer=False)  # trained after close(): nothing waits on the closed writer
    assert hooks_left(model) == NO_HOOKS and hooks_left(copies["deepcopy"]) == NO_HOOKS
    assert read_run(tmp_path / "copy").histogram_steps("activations/0") == [0, 1]
    assert read_run(tmp_path / "original").histogram_steps("activations/0") == [0]


def test_lazy_modules_are_watched_before_their_first_forward_and_log_their_parameters_once_they_have_them(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.LazyLinear(4), nn.ReLU(), nn.LazyLinear(2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "skips '0.weight' from now on"
        viz = actviz.watch(model, tmp_path, every=2, image_every=False, statistics=["default", "update_ratio"])
        with torch.no_grad():
            model(torch.randn(3, 5))  # the dry run lazy modules need (not a step: no grad), then the optimizer
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            before = model[0].weight.detach().clone()
            loss = model(torch.randn(3, 5)).square().mean()
            optimizer.zero_grad()
            loss.backward()
            applied = model[0].weight.grad.clone()
            optimizer.step()
            if step == 2:
                viz.flush()
                logged = viz.latest.statistics()
                assert viz.latest.step == 2
                assert logged["weights/0.weight"]["mean"] == pytest.approx(before.double().mean().item(), rel=1e-6)
                assert logged["weight_grads/0.weight"]["norm"] == pytest.approx(applied.double().norm().item(),
                                                                                rel=1e-6)
                expected = ((model[0].weight - before).norm() / before.norm()).item()
                assert viz.latest.scalars["update_ratio/0.weight"] == pytest.approx(expected, rel=1e-5)
        viz.close()
    assert hooks_left(model) == NO_HOOKS


def test_a_shallow_copy_runs_unwatched_and_leaves_the_original_watched(tmp_path, read_run):
    # copy.copy shared the model's hook dict: the root hook, finding itself on a copy, took itself off both.
    model = mlp()
    with actviz.watch(model, tmp_path, every=1) as viz:
        train(model, 1, optimizer=False)
        shallow = copy.copy(model)
        train(shallow, 1, optimizer=False)
        train(model, 2, optimizer=False)
        assert viz.step == 3  # the original's three forwards, not the copy's
    assert len(shallow._forward_pre_hooks) == 0
    assert read_run(tmp_path).histogram_steps("activations/0") == [0, 1, 2]


def test_an_ema_teacher_copied_while_a_step_is_open_logs_nothing(tmp_path, read_run):
    model = mlp()
    with actviz.watch(model, tmp_path, every=1) as viz:
        output = model(torch.randn(3, 4))  # the logging step's hooks are on the model now
        teacher = copy.deepcopy(model)
        pickle.dumps(model)
        output.square().mean().backward()
        teacher(torch.randn(3, 4)).sum().backward()
        assert viz.step == 1
    assert hooks_left(model) == NO_HOOKS
    assert read_run(tmp_path).histogram_steps("activations/0") == [0]


@pytest.mark.parametrize("dynamo", [False, True])
def test_copies_in_a_fresh_process_with_and_without_dynamo(dynamo):
    out = run_script(f"""
        import copy, io, pickle, tempfile, torch
        {"import torch._dynamo" if dynamo else ""}
        import actviz
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        viz = actviz.watch(model, tempfile.mkdtemp(), every=1)
        model(torch.randn(3, 4)).sum().backward()
        twin = copy.deepcopy(model)
        buffer = io.BytesIO(); torch.save(model, buffer); buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
        for other in (twin, loaded, pickle.loads(pickle.dumps(model))):
            other(torch.randn(3, 4)).sum().backward()
        viz.close()
        twin(torch.randn(3, 4)).sum().backward()
        print(viz.step, sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules()))
    """)
    assert out.split() == ["1", "0"]


def test_spawned_workers_get_an_unwatched_model():
    out = run_script("""
        import tempfile, torch, torch.multiprocessing as mp
        import actviz

        def worker(model, queue):
            model(torch.randn(2, 4)).sum().backward()
            queue.put(sum(p.grad.abs().sum().item() > 0 for p in model.parameters()))

        if __name__ == "__main__":
            model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
            viz = actviz.watch(model, tempfile.mkdtemp(), every=1)
            context = mp.get_context("spawn")
            queue = context.Queue()
            process = context.Process(target=worker, args=(model, queue))
            process.start()
            print(queue.get(timeout=60)); process.join(60); print(process.exitcode, viz.step)
            viz.close()
    """, timeout=180)
    assert out.split() == ["4", "0", "0"]


# -- never wait on a writer that cannot answer ------------------------------------------------------------------


def test_on_step_may_raise_system_exit_and_training_goes_on(tmp_path, read_run):
    def on_step(results):
        raise SystemExit(3)

    model = mlp()
    with pytest.warns(RuntimeWarning, match="on_step callback raised SystemExit"):
        with actviz.watch(model, tmp_path, every=1, on_step=on_step):
            train(model, 6, optimizer=False)  # more steps than the queue holds: a dead thread would hang here
    assert read_run(tmp_path).histogram_steps("activations/0") == list(range(6))


@pytest.mark.parametrize("call", ["flush", "close"])
def test_on_step_may_call_flush_or_close(call, tmp_path, read_run):
    model = mlp()
    viz = None

    def on_step(results):
        getattr(viz, call)()

    viz = actviz.watch(model, tmp_path, every=1, on_step=on_step)
    train(model, 4, optimizer=False)
    viz.flush()
    viz.close()
    assert hooks_left(model) == NO_HOOKS
    steps = read_run(tmp_path).histogram_steps("activations/0")
    assert steps == ([0, 1, 2, 3] if call == "flush" else steps[:1] + [s for s in steps[1:] if s > 0]) and 0 in steps


def test_a_forked_child_writes_nothing_and_exits_at_once():
    out = run_script("""
        import os, sys, tempfile, torch
        import actviz
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        viz = actviz.watch(model, tempfile.mkdtemp(), every=1)
        model(torch.randn(3, 4)).sum().backward()
        for runs_model in (True, False):
            pid = os.fork()
            if pid == 0:  # the child trains (Hogwild) or just exits; the atexit close must not wait
                if runs_model:
                    for _ in range(5):
                        model(torch.randn(3, 4)).sum().backward()
                sys.exit(0)
            _, status = os.waitpid(pid, 0)
            print(os.waitstatus_to_exitcode(status))
        model(torch.randn(3, 4)).sum().backward()
        viz.close()
        print(viz.step)
    """, timeout=120)
    assert out.split() == ["0", "0", "2"]


def test_flush_and_close_warn_about_a_write_error_instead_of_raising(tmp_path):
    model = mlp()
    viz = actviz.watch(model, tmp_path, every=1)
    train(model, optimizer=False)

    def broken(*args):
        raise OSError(28, "No space left on device")

    viz.writer.flush = broken
    with pytest.warns(RuntimeWarning, match="No space left on device"):
        viz.flush()
        viz.close()
    assert viz.closed


def test_a_second_close_after_an_interrupted_one_writes_what_was_queued(tmp_path, read_run, monkeypatch):
    model = mlp()
    viz = actviz.watch(model, tmp_path, every=1)
    background = viz._writer
    release = threading.Event()
    original = background.sink.write

    def slow_write(results):
        release.wait(30)
        original(results)

    background.sink.write = slow_write
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        train(model, optimizer=False)
        optimizer.step()  # each step ends here, and is queued
    queue_put = background._queue.put
    interrupted = []

    def interrupted_put(item, *args, **kwargs):
        if not interrupted:
            interrupted.append(item)
            raise KeyboardInterrupt  # Ctrl-C while close() waits for room in the writer's queue
        queue_put(item, *args, **kwargs)

    background._queue.put = interrupted_put
    with pytest.raises(KeyboardInterrupt):
        viz.close()
    release.set()
    viz.close()
    assert interrupted == [None]
    assert read_run(tmp_path).histogram_steps("activations/0") == [0, 1, 2]


# -- compile, script, trace and export after watch() -------------------------------------------------------------

COMPILE_RUN = """
    import sys, tempfile, torch
    {preimport}
    import actviz
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    results = []
    for order in ("first", "after"):
        for style in ("torch.compile", "model.compile"):
            import torch._dynamo
            torch._dynamo.reset(); torch._dynamo.utils.counters.clear()
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
            optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
            log_dir = tempfile.mkdtemp()

            def compiled(module):
                if style == "torch.compile":
                    return torch.compile(module, backend="{backend}", fullgraph=True)
                module.compile(backend="{backend}", fullgraph=True)
                return module

            if order == "first":
                target = compiled(model); viz = actviz.watch(target, log_dir, every=3)
            else:
                viz = actviz.watch(model, log_dir, every=3); target = compiled(model)
            for _ in range(8):
                optimizer.zero_grad()
                target(torch.randn(5, 4)).square().mean().backward()
                optimizer.step()
            viz.close()
            events = EventAccumulator(log_dir, size_guidance={{"histograms": 0}}); events.Reload()
            steps = [event.step for event in events.Histograms("~activations/0")]
            graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
            results.append((graphs, steps, viz.step))
    print(results)
"""


@pytest.mark.parametrize("preimport", [True, False])
def test_compiling_after_watch_gives_the_graphs_and_steps_of_compiling_first(preimport):
    # The optimizer is made before watch() in most scripts, and it imports torch._dynamo: the "not imported"
    # case is the model alone, so the optimizer comes after watch() here when preimport is False.
    source = COMPILE_RUN.format(preimport="import torch._dynamo" if preimport else "", backend="eager")
    if not preimport:
        source = source.replace("            optimizer = torch.optim.SGD(model.parameters(), lr=0.01)\n", "")
        source = source.replace("            for _ in range(8):\n",
                                "            optimizer = torch.optim.SGD(model.parameters(), lr=0.01)\n"
                                "            for _ in range(8):\n")
    results = eval(run_script(source, timeout=300))
    assert results[0] == results[1] == results[2] == (1, [0, 3, 6], 8)  # compiled first, either style
    if preimport:
        assert results[3] == (1, [0, 3, 6], 8)
    else:  # the first forward ran compiled before actviz could ask for it eagerly: said in one warning
        assert results[3][0] == 1 and results[3][1][1:] == [3, 6] and results[3][2] == 8


def test_inductor_after_watch_with_fullgraph():
    results = eval(run_script(COMPILE_RUN.format(preimport="import torch._dynamo", backend="inductor"), timeout=500))
    assert all(result == (1, [0, 3, 6], 8) for result in results)


def mentions_actviz(graph_text: str) -> bool:
    """Whether a graph's text names actviz code: its package folder, or the word outside file paths.

    Graph dumps carry the file paths of the code they come from, and a clone of this repository
    may itself sit in a folder named actviz (``actviz/.venv/.../torch/nn/modules/conv.py``).
    """
    without_paths = re.sub(r"(?:[A-Za-z]:)?[\\/][^\s\"',)]*", "", graph_text)
    return str(Path(actviz.__file__).parent) in graph_text or "actviz" in without_paths


def test_mentions_actviz_finds_actviz_code_but_not_a_clone_folder_named_actviz():
    package = Path(actviz.__file__).parent
    assert not mentions_actviz("%x = prim::CallMethod(%y) # /home/me/actviz/.venv/lib/torch/nn/modules/conv.py:12:3")
    assert not mentions_actviz('stack_trace: "File C:\\src\\actviz\\.venv\\torch\\module.py"')
    assert mentions_actviz("%h : __torch__.actviz.root_hook.RootHook = prim::GetAttr")
    assert mentions_actviz(f"# {package / 'root_hook.py'}:40:8")


def cnn() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 2))


def test_script_trace_and_export_of_a_watched_model_contain_no_actviz_op_and_take_no_step(tmp_path):
    inputs = torch.randn(2, 3, 8, 8)
    bare = torch.export.export(cnn().train(), (inputs,))
    model = cnn().train()
    with actviz.watch(model, tmp_path, every=1) as viz:
        scripted = torch.jit.script(model)
        traced = torch.jit.trace(model, (inputs,))
        exported = torch.export.export(model, (inputs,))
        model.eval()
        torch.jit.script(model)
        model.train()
        assert viz.step == 0
        for result in (scripted, traced):
            assert torch.allclose(result(inputs), model(inputs))
        assert viz.step == 2  # the scripted and traced models' forwards are not steps; the eager one is
    assert len(exported.graph.nodes) == len(bare.graph.nodes)
    assert not mentions_actviz(str(exported.graph) + str(traced.graph) + str(scripted.graph))
    buffer = io.BytesIO()
    torch.jit.save(scripted, buffer)  # a scripted model saves: its hook is TorchScript
    assert hooks_left(model) == NO_HOOKS


def test_onnx_export_of_a_watched_model_takes_no_step(tmp_path):
    pytest.importorskip("onnxscript")
    model = cnn()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with actviz.watch(model, tmp_path, every=1) as viz:
            program = torch.onnx.export(model, (torch.randn(2, 3, 8, 8),), dynamo=True)
            assert viz.step == 0
    assert not mentions_actviz(str(program.model))


# -- odd outputs never stop training ------------------------------------------------------------------------------


class Ragged(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(3, 3)

    def forward(self, parts):
        nested = torch.nested.as_nested_tensor([self.proj(part) for part in parts], layout=torch.jagged)
        return nested


def test_a_nested_tensor_output_is_logged_from_its_values(tmp_path, read_run):
    model = nn.Sequential()
    model.ragged = Ragged()
    parts = [torch.randn(2, 3), torch.randn(5, 3)]
    with actviz.watch(model, tmp_path, layers=["ragged"], every=1):
        output = model(parts)
        output.values().sum().backward()
    histogram = read_run(tmp_path).histogram("activations/ragged", 0)
    values = torch.cat([model.ragged.proj(part) for part in parts]).detach().double()
    assert histogram.num == 21
    assert histogram.sum == pytest.approx(values.sum().item(), rel=1e-5)


@dataclasses.dataclass
class Output:
    logits: torch.Tensor
    hidden: torch.Tensor


class DataclassModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 3)

    def forward(self, x):
        hidden = self.body(x)
        return Output(logits=hidden * 2, hidden=hidden)


def test_dataclass_outputs_log_their_tensor_fields(tmp_path, read_run):
    model = DataclassModel()
    inputs = torch.randn(5, 4)
    with actviz.watch(model, tmp_path, layers=["", "body"], every=1, options=actviz.Options(outputs="all")):
        model(inputs).logits.sum().backward()
    run = read_run(tmp_path)
    expected = (model.body(inputs) * 2).detach().double()
    tags = sorted(tag for tag in run.histogram_tags if tag.startswith("activations/"))
    assert "activations/(model)/logits" in tags and "activations/(model)/hidden" in tags, tags
    assert run.histogram("activations/(model)/logits", 0).sum == pytest.approx(expected.sum().item(), rel=1e-5)


def test_warnings_as_errors_never_raise_in_training(tmp_path):
    model = mlp()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with actviz.watch(model, tmp_path, every=1):
            for _ in range(3):
                model(torch.randn(3, 4))  # no backward: actviz warns about it, through a log record
            model[0].weight.data[0, 0] = float("nan")
            train(model, 2, optimizer=False)  # NaN alert: also a warning


def test_per_sample_gradients_skip_the_transformed_call_not_the_layer(tmp_path, read_run):
    from torch.func import functional_call, grad, vmap

    model = mlp()
    params = {name: param.detach() for name, param in model.named_parameters()}

    def loss(params, sample):
        return functional_call(model, params, (sample.unsqueeze(0),)).square().sum()

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with actviz.watch(model, tmp_path, every=1) as viz:
            train(model, optimizer=False)
            per_sample = vmap(grad(loss), in_dims=(None, 0))(params, torch.randn(6, 4))
            assert viz.step == 1  # the transformed calls are not steps
            train(model, optimizer=False)
    assert per_sample["0.weight"].shape == (6, 8, 4)
    assert read_run(tmp_path).histogram_steps("activations/0") == [0, 1]


def test_a_layer_replaced_after_watch_is_followed_with_one_warning(tmp_path, read_run):
    model = mlp()
    optimizer_steps = 3
    with actviz.watch(model, tmp_path, every=1):
        train(model, optimizer=False)
        model[2] = nn.Linear(8, 5)
        with pytest.warns(RuntimeWarning, match="follows '2'") as caught:
            train(model, optimizer_steps, optimizer=False)
    assert sum("follows" in str(w.message) for w in caught) == 1
    run = read_run(tmp_path)
    assert run.histogram("weights/2.weight", 1).num == 40  # the new layer's weights, not the old one's 16
    assert run.histogram("activations/2", 3).num == 15
