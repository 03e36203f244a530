"""torch holds one process-wide flag while any thread compiles: actviz's eager code must not take it for its own.

``torch.compiler.is_compiling()`` is true for the whole of a compile session, seen from every thread. actviz's
optimizer hook asked it and, true in eager code, called its untraced twin, which asked again: a
``RecursionError`` out of ``optimizer.step()`` whenever another thread compiled (with ``ACTVIZ_FUSED=1`` the
writer thread compiled its small summaries). The flag is set here as that other thread's compile sets it.
"""

from __future__ import annotations

import tempfile
import threading
import warnings

import pytest
import torch
from torch import nn

import actviz
from actviz.common.optimizer_steps import subscribe
from actviz.summaries import fused
from actviz.summaries.one_pass import header_sums


@pytest.fixture
def another_thread_compiles(monkeypatch):
    monkeypatch.setattr(torch.compiler, "_is_compiling_flag", True)
    assert torch.compiler.is_compiling()


def test_an_optimizer_step_while_another_thread_compiles_calls_each_listener_once(another_thread_compiles):
    heard = []
    subscription = subscribe(lambda optimizer: heard.append("before"), lambda optimizer: heard.append("after"))
    try:
        param = nn.Parameter(torch.ones(2))
        param.grad = torch.ones(2)
        torch.optim.SGD([param], lr=0.5).step()
    finally:
        subscription.remove()
    assert heard == ["before", "after"]
    assert param.tolist() == [0.5, 0.5]


def test_a_watched_training_step_while_another_thread_compiles(another_thread_compiles, monkeypatch):
    monkeypatch.setenv("ACTVIZ_FUSED", "1")
    monkeypatch.setattr(fused, "_compiled", {})  # the failure below is this test's alone
    monkeypatch.setattr(fused, "_warned", False)
    monkeypatch.setattr(fused, "CompiledFunction", None)  # nothing compiles here: the flag alone is the point
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings():  # where a summary is made on the training thread, its compile fails: eager path
        warnings.filterwarnings("ignore", message="actviz: compiling header_sums")
        with actviz.watch(model, tempfile.mkdtemp(), every=1, extras=[actviz.Spikes()]) as viz:
            for _ in range(3):
                optimizer.zero_grad()
                model(torch.randn(64, 4)).square().mean().backward()
                optimizer.step()
            viz.flush()
    assert viz.latest is not None and sorted(viz.latest.weight_grads) == ["0.bias", "0.weight", "2.bias", "2.weight"]


def test_the_writer_thread_and_the_interpreters_exit_compile_nothing(monkeypatch):
    monkeypatch.setenv("ACTVIZ_FUSED", "1")
    monkeypatch.setattr(fused, "_compiled", {})
    made = []
    monkeypatch.setattr(fused, "CompiledFunction", lambda *args: made.append(args))
    found = []
    writer = threading.Thread(target=lambda: found.append(fused.run(header_sums, torch.ones(4))), name=fused.WRITER_THREAD)
    writer.start()
    writer.join(timeout=30)
    assert found == [None] and made == []  # the eager path, and nothing compiled
    ended = threading.Thread(target=lambda: None)
    ended.start()
    ended.join()
    monkeypatch.setattr(threading, "main_thread", lambda: ended)  # as at exit: the main thread has stopped
    assert fused.run(header_sums, torch.ones(4)) is None and made == []
