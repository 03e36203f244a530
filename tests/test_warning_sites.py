"""Every actviz warning points at the user's line and names the watcher it is about: model class and run folder."""

from __future__ import annotations

import warnings

import torch
from torch import nn

import actviz

QUIET = actviz.Options(quiet=True)


def _actviz(caught: list) -> list:
    return [warning for warning in caught if str(warning.message).startswith("actviz")]


def test_a_warning_from_a_step_points_at_the_users_line_and_names_the_model_and_folder(tmp_path):
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with actviz.watch(model, tmp_path, every=1, options=QUIET):
            model(torch.randn(3, 4))  # step 0: no backward follows
            model(torch.randn(3, 4)).sum().backward()  # step 1
            optimizer.step()  # applies step 1's gradients: step 0 ends, told to have got no backward
            step_line = __import__("inspect").currentframe().f_lineno - 1
    (warning,) = [w for w in _actviz(caught) if "logs no gradients for step 0" in str(w.message)]
    assert (warning.filename, warning.lineno) == (__file__, step_line)
    assert str(warning.message).endswith(f"[Linear → {tmp_path}]")
    assert "auto_step=False" in str(warning.message) and "docs/training-setups.md" in str(warning.message)


def test_an_alert_found_on_the_writer_thread_points_at_the_watch_line(tmp_path):
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with actviz.watch(model, tmp_path, every=1, options=QUIET):
            watch_line = __import__("inspect").currentframe().f_lineno - 1
            model(torch.full((3, 4), float("nan"))).sum().backward()
    (alert,) = [w for w in _actviz(caught) if "NaN or Inf first at step 0" in str(w.message)]
    assert (alert.filename, alert.lineno) == (__file__, watch_line)
    assert str(alert.message).endswith(f"[Sequential → {tmp_path}]")


def test_two_models_with_step_axes_apart_are_told_the_auto_step_fix(tmp_path):
    generator, discriminator = nn.Linear(2, 2), nn.Linear(2, 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with actviz.watch(generator, tmp_path / "g", every=1000, options=QUIET), \
                actviz.watch(discriminator, tmp_path / "d", every=1000, options=QUIET):
            for _ in range(12):  # a GAN's iteration: one forward of G, two of D
                fake = generator(torch.randn(3, 2))
                discriminator(torch.randn(3, 2)).sum().backward()
                discriminator(fake.detach()).sum().backward()
    (told,) = [w for w in _actviz(caught) if "step axes do not match" in str(w.message)]
    message = str(told.message)
    assert message.startswith("actviz counted 24 steps of this model and 12 of Linear")
    assert "options=actviz.Options(auto_step=False)" in message and "viz.set_step(iteration)" in message
    assert "docs/training-setups.md" in message and message.endswith(f"[Linear → {tmp_path / 'd'}]")
    assert told.filename == __file__
