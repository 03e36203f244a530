"""The bytes a long run writes with every feature on: the event file's total, per 1,000 steps, per image step,
and its share by kind of record, read back from the file.

A tiny CNN (the tests' ``small_cnn``: Conv-ReLU-Conv-BN-ReLU-Linear on 8 × 8 inputs) trains for ``--steps`` steps
under ``actviz.watch(every=10, layers="all", statistics=["default", "update_ratio"], extras=[actviz.Probe(...,
gradcam=True), actviz.Spikes()])`` with the default alerts and statistics (``--flow-pictures``: and
``actviz.Options(flow_pictures=True)``); ``image_every`` defaults to ``every``, so every logging step is an image step. After
each 1,000 steps the script flushes the watcher and measures the folder's event files, so that the growth per
1,000 steps shows whether the run's size is linear in its length (a flat cost per 1,000 steps). At the end it reads
every record back (TensorBoard's ``RawEventFileLoader``) and splits the bytes by kind: scalars, histograms, texts,
images by the first part of their tag (``flow``, ``feature_maps``, ``gradcam``, ``probe``), and the records' framing.

Usage: ``python scripts/bench_run_size.py [--steps 20000] [--every 10] [--image-every N] [--keep DIR]``;
about 7 minutes for 20,000 steps on a busy 2-core CPU. docs/diagnosis.md gives the measured table.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
import warnings
from collections import Counter
from pathlib import Path

import torch
from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
from tensorboard.compat.proto.event_pb2 import Event
from torch import nn
from tqdm import tqdm

import actviz

RECORD_FRAMING = 16  # bytes a TFRecord adds to each event: its length, and the checksums of length and data


def small_cnn() -> nn.Sequential:
    """The tests' ``small_cnn`` (tests/conftest.py): Conv-ReLU(in place)-Conv-BN-ReLU-Linear, 8 × 8 inputs."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1), nn.ReLU(inplace=True), nn.Conv2d(6, 5, 3, stride=2, padding=1),
        nn.BatchNorm2d(5), nn.ReLU(inplace=True), nn.Flatten(), nn.Linear(5 * 4 * 4, 3),
    )


def folder_bytes(folder: Path) -> int:
    """The bytes of every event file in ``folder``."""
    return sum(path.stat().st_size for path in folder.glob("events.out.tfevents.*"))


def kind_of(value) -> str:  # a Summary.Value proto
    """What a value is, for the share table: ``images: flow``, ``histograms``, ``scalars``, ``texts``..."""
    tag = value.tag.removeprefix("~")
    if value.HasField("image"):
        return f"images: {tag.split('/', 1)[0]}"
    if value.HasField("histo"):
        return "histograms"
    if value.HasField("simple_value"):
        return "scalars"
    plugin = value.metadata.plugin_data.plugin_name
    return {"text": "texts", "custom_scalars": "layout"}.get(plugin, plugin or "other values")


def shares(folder: Path) -> tuple[Counter[str], int]:
    """Bytes by kind of record over every event file of ``folder``, and the number of records."""
    by_kind: Counter[str] = Counter()
    records = 0
    for path in sorted(folder.glob("events.out.tfevents.*")):
        for raw in RawEventFileLoader(str(path)).Load():
            records += 1
            event = Event.FromString(raw)
            values = event.summary.value
            by_kind["record framing and event headers"] += RECORD_FRAMING + len(raw) - sum(
                value.ByteSize() for value in values)
            for value in values:
                by_kind[kind_of(value)] += value.ByteSize()
    return by_kind, records


def run(folder: Path, steps: int, every: int, image_every: int | None, flow_pictures: bool = False,
        ) -> list[tuple[int, int, float]]:
    """Train for ``steps`` steps watched with every feature on; (steps done, bytes on disk, seconds) per 1,000."""
    model = small_cnn()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    probe = torch.randn(1, 3, 8, 8)
    marks = []
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the alerts of a random-input run are not what is measured
        with actviz.watch(model, folder, every=every, image_every=image_every, layers="all",
            statistics=["default", "update_ratio"], extras=[actviz.Probe(probe, gradcam=True), actviz.Spikes()],
            options=actviz.Options(flow_pictures=flow_pictures)) as viz:
            for step in tqdm(range(1, steps + 1), desc="steps", unit="step", mininterval=2.0):
                loss = model(torch.randn(4, 3, 8, 8)).square().mean()
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                if step % 1000 == 0 or step == steps:
                    viz.flush()
                    marks.append((step, folder_bytes(folder), time.perf_counter() - start))
        dropped = viz.dropped_steps
    if dropped:
        print(f"warning: {dropped} logging steps were dropped; the sizes below miss them", file=sys.stderr)
    return marks


def megabytes(count: float) -> str:
    return f"{count / 1e6:,.2f} MB"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20_000, help="training steps (default 20000)")
    parser.add_argument("--every", type=int, default=10, help="watch(every=...) (default 10)")
    parser.add_argument("--image-every", type=int, default=None, help="watch(image_every=...) (default: every)")
    parser.add_argument("--keep", type=Path, default=None, help="write the run here and keep it (default: a "
                                                                 "temporary folder, deleted at the end)")
    parser.add_argument("--flow-pictures", action="store_true", help="also draw the flow/* pictures "
                        "(actviz.Options(flow_pictures=True); off by default)")
    args = parser.parse_args()
    if args.steps < 1 or args.every < 1:
        parser.error("--steps and --every must be at least 1")
    folder = args.keep or Path(tempfile.mkdtemp(prefix="actviz-run-size-"))
    try:
        marks = run(folder, args.steps, args.every, args.image_every, args.flow_pictures)
        by_kind, records = shares(folder)
        total = folder_bytes(folder)
    finally:
        if args.keep is None:
            shutil.rmtree(folder, ignore_errors=True)
    image_every = args.image_every or args.every
    image_steps = len(range(0, args.steps, image_every))
    print(f"\n{args.steps:,} steps, every={args.every}, image_every={image_every}: {image_steps:,} image steps, "
          f"{records:,} records, {marks[-1][2]:.0f} s")
    print(f"event files: {megabytes(total)} ({total:,} bytes)")
    print(f"per 1,000 steps: {megabytes(total / args.steps * 1000)}; per image step: {total / image_steps / 1e3:,.1f} KB")
    print("\nsteps    bytes on disk   the last 1,000 steps cost")
    before = 0
    for steps, size, _ in marks:
        print(f"{steps:>6,}   {megabytes(size):>13}   {megabytes(size - before):>10}")
        before = size
    print("\nshare by kind of record")
    read = sum(by_kind.values())
    for kind, count in by_kind.most_common():
        print(f"  {kind:<34} {megabytes(count):>12}  {100 * count / read:5.1f} %   "
              f"{count / image_steps / 1e3:8.1f} KB per image step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
