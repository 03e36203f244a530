"""How fast the actviz tab answers on a long, wide run: each view's time on a live TensorBoard.

Writes two synthetic runs of ``--steps`` steps (default 20,000) and ``--layers`` layers (default 200) as actviz
writes them (``~gradient_stats/norm@{layer}``, ``~activation_stats/std@{layer}`` and ``/zero_fraction`` every
step, output and gradient histograms every 100 steps, a ``layers`` table and a few ``alerts``); ``b`` parts from
``a`` at three quarters of the run. Then starts ``tensorboard --logdir`` with the plugin, waits until it has
read both runs, and times each of the tab's routes (``/runs``, ``/heatmap``, ``/alerts``, ``/cell``,
``/feature_maps``, ``/compare``) three times: the first call and the best of the next two. With
``--samples N`` TensorBoard keeps N scalars per tag instead of its default 1,000 (``--samples_per_plugin``).

Usage: ``python scripts/bench_view.py [--steps 20000] [--layers 200] [--samples 20000] [--keep DIR]``.
docs/view.md gives the measured table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

import numpy as np
from tensorboard.compat.proto.event_pb2 import Event
from tensorboard.compat.proto.summary_pb2 import Summary
from tensorboard.summary.writer.event_file_writer import EventFileWriter
from torch.utils.tensorboard.summary import histogram

from actviz.diagnosis.alerts import Alert
from actviz.output.tensorboard import _text_value  # a text under its own tag, as actviz writes it

REPO = Path(__file__).resolve().parent.parent


def write_run(folder: Path, steps: int, layers: int, part_at: int | None, seed: int = 0) -> None:
    """One synthetic actviz run: per-layer scalars every step, histograms every 100 steps, a few alerts."""
    rng = np.random.default_rng(seed)
    names = [f"blocks.{index}.conv" for index in range(layers)]
    writer = EventFileWriter(str(folder), max_queue_size=1000)
    table = "| layer | type | output shape | parameters |\n|---|---|---|---|\n" + "".join(
        f"| {name} | Conv2d | (8, 16, 16) | 2320 |\n" for name in names)
    writer.add_event(Event(step=0, wall_time=time.time(), summary=Summary(value=[_text_value("layers", table)])))
    scale = np.exp(np.linspace(-4, 0, layers))  # gradient norms grow towards the output
    walk = np.zeros(layers)
    for step in range(steps):
        walk += rng.normal(0, 0.01, layers)
        if part_at is not None and step >= part_at:
            walk[layers // 2] += 0.05
        norms, stds, zeros = scale * np.exp(walk), 0.5 + 0.1 * np.tanh(walk), 0.4 + 0.05 * np.sin(walk + step / 500)
        values = [Summary.Value(tag=f"~gradient_stats/norm@{name}", simple_value=norm) for name, norm in zip(names, norms)]
        values += [Summary.Value(tag=f"~activation_stats/std@{name}", simple_value=std) for name, std in zip(names, stds)]
        values += [Summary.Value(tag=f"~activation_stats/zero_fraction@{name}", simple_value=zero)
                   for name, zero in zip(names, zeros)]
        event = Event(step=step, wall_time=time.time(), summary=Summary(value=values))
        if step % 100 == 0:
            for name in names[:: max(1, layers // 20)]:
                for kind in ("activations", "gradients"):
                    event.summary.value.extend(histogram(f"~{kind}/{name}", rng.normal(size=256), bins=64).value)
        if step % 2500 == 1000:
            alert = Alert(step, "exploding_gradients", names[step % layers], "gradient_norm", 1e3, 1e2, "large")
            event.summary.value.append(_text_value("alerts", alert.line()))
        writer.add_event(event)
    writer.close()


def plugin_path(folder: Path) -> str:
    """A folder that registers the tab's entry point (pyproject.toml's) where the installed actviz lacks it."""
    from importlib.metadata import entry_points

    if any(entry.name == "actviz" for entry in entry_points(group="tensorboard_plugins")):
        return ""
    info = folder / "actviz_tab-0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: actviz-tab\nVersion: 0\n")
    (info / "entry_points.txt").write_text("[tensorboard_plugins]\nactviz = actviz.view.plugin:ActvizPlugin\n")
    return str(folder)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def get(url: str) -> tuple[float, bytes]:
    start = time.perf_counter()
    with urllib.request.urlopen(url, timeout=300) as response:
        body = response.read()
    return time.perf_counter() - start, body


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20_000)
    parser.add_argument("--layers", type=int, default=200)
    parser.add_argument("--samples", type=int, default=None, help="TensorBoard's scalars kept per tag")
    parser.add_argument("--keep", type=Path, default=None, help="write the runs here and keep them")
    args = parser.parse_args()
    root = args.keep or Path(tempfile.mkdtemp(prefix="actviz-bench-view-"))
    started = time.perf_counter()
    for run, part_at in (("a", None), ("b", args.steps * 3 // 4)):
        if not (root / run).exists():
            write_run(root / run, args.steps, args.layers, part_at)
    size = sum(path.stat().st_size for path in root.rglob("*") if path.is_file())
    print(f"2 runs of {args.steps:,} steps x {args.layers} layers: {size / 1e6:.0f} MB, "
          f"written in {time.perf_counter() - started:.0f} s")
    port = free_port()
    flags = ["--samples_per_plugin", f"scalars={args.samples}"] if args.samples else []
    extra = plugin_path(Path(tempfile.mkdtemp(prefix="actviz-entry-point-")))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), extra, os.environ.get("PYTHONPATH")])))
    server = subprocess.Popen([sys.executable, "-m", "tensorboard.main", "--logdir", str(root), "--host", "127.0.0.1",
                               "--port", str(port), *flags], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True)
    base = f"http://127.0.0.1:{port}/data/plugin/actviz"
    try:
        started = time.perf_counter()
        statistic, loaded = "gradient_stats/norm", "activation_stats/zero_fraction"
        while True:  # until both runs are read to their last step (asked of a statistic not timed below)
            try:
                _, body = get(f"{base}/heatmap?" + urllib.parse.urlencode({"run": "b", "statistic": loaded}))
                if json.loads(body)["last_steps"][-1] == args.steps - 1:
                    _, body = get(f"{base}/heatmap?" + urllib.parse.urlencode({"run": "a", "statistic": loaded}))
                    if json.loads(body)["last_steps"][-1] == args.steps - 1:
                        break
            except OSError:
                pass
            if server.poll() is not None or time.perf_counter() - started > 1200:
                raise SystemExit("tensorboard did not load the runs")
            time.sleep(2)
        print(f"tensorboard read both runs in about {time.perf_counter() - started:.0f} s "
              f"(scalars kept per tag: {args.samples or 1000})\n")
        layer = "blocks.0.conv"
        routes = {
            "runs": {},
            "heatmap gradient norm": ("heatmap", {"run": "a", "statistic": statistic}),
            "heatmap activation std": ("heatmap", {"run": "a", "statistic": "activation_stats/std"}),
            "alerts": ("alerts", {"run": "a"}),
            "cell (click)": ("cell", {"run": "a", "layer": layer, "step": args.steps // 2}),
            "feature_maps": ("feature_maps", {"run": "a", "layer": layer}),
            "compare a, b (where they part)": ("compare", {"a": "a", "b": "b"}),
        }
        print(f"{'view':28} {'first':>8} {'again':>8} {'bytes':>10}  what")
        for name, route in routes.items():
            path, params = ("runs", {}) if name == "runs" else route
            url = f"{base}/{path}?" + urllib.parse.urlencode(params)
            times = []
            for _ in range(3):
                seconds, body = get(url)
                times.append(seconds)
            shown = json.loads(body)
            what = ""
            if path == "heatmap":
                what = f"{len(shown['layers'])} layers x {len(shown['first_steps'])} columns of {shown['points']:,} points"
            elif path == "compare":
                what = f"parts at {shown['first_divergence']}"
            print(f"{name:28} {times[0]:7.2f}s {min(times[1:]):7.2f}s {len(body):>10,}  {what}")
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
