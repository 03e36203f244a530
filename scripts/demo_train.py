"""Train a small CNN on shapes drawn with PIL, with actviz watching it.

    python scripts/demo_train.py               # about a minute on a CPU, writes runs/demo
    python scripts/demo_train.py --seconds 10  # shorter
    python scripts/demo_train.py --lr 10 --logdir runs/diverged --seconds 10   # a run that diverges:
    actviz doctor runs/diverged                                                # names it, exits 1

Nothing is downloaded: each image is a circle, ring, square, frame, triangle or
cross of a random colour, size and place on a noisy background.
"""

from __future__ import annotations

import argparse
import logging
import math
import random
import time

import numpy as np
import torch
from PIL import Image, ImageDraw
from torch import nn

import actviz

CLASSES = ("circle", "ring", "square", "frame", "triangle", "cross")


def draw_shape(kind: str, size: int, rng: random.Random) -> np.ndarray:
    """One ``size × size`` RGB picture of ``kind`` as a float array in [0, 1]."""
    background = tuple(rng.randrange(0, 90) for _ in range(3))
    colour = tuple(rng.randrange(120, 256) for _ in range(3))
    image = Image.new("RGB", (size, size), background)
    draw = ImageDraw.Draw(image)
    radius = rng.uniform(0.15, 0.4) * size
    cx, cy = (rng.uniform(radius, size - radius) for _ in range(2))
    box = [cx - radius, cy - radius, cx + radius, cy + radius]
    if kind == "circle":
        draw.ellipse(box, fill=colour)
    elif kind == "ring":
        draw.ellipse(box, outline=colour, width=2)
    elif kind == "square":
        draw.rectangle(box, fill=colour)
    elif kind == "frame":
        draw.rectangle(box, outline=colour, width=2)
    elif kind == "triangle":
        angle = rng.uniform(0, 2 * math.pi)
        corners = [(cx + radius * math.cos(angle + k * 2 * math.pi / 3), cy + radius * math.sin(angle + k * 2 * math.pi / 3)) for k in range(3)]
        draw.polygon(corners, fill=colour)
    else:
        width = max(2, int(radius / 2.5))
        draw.line([cx - radius, cy, cx + radius, cy], fill=colour, width=width)
        draw.line([cx, cy - radius, cx, cy + radius], fill=colour, width=width)
    pixels = np.asarray(image, dtype=np.float32) / 255.0
    noise = np.random.default_rng(rng.randrange(1 << 30)).normal(0, 0.15, pixels.shape).astype(np.float32)
    return np.clip(pixels + noise, 0, 1)


def make_dataset(count: int, size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    rng = random.Random(seed)
    labels = [rng.randrange(len(CLASSES)) for _ in range(count)]
    images = np.stack([draw_shape(CLASSES[label], size, rng) for label in labels])
    return torch.from_numpy(images).permute(0, 3, 1, 2).contiguous(), torch.tensor(labels)


def small_cnn(num_classes: int = len(CLASSES)) -> nn.Sequential:
    """A VGG-style CNN for 32×32 inputs, with the in-place ReLUs torchvision models use."""

    def block(c_in: int, c_out: int) -> list[nn.Module]:
        return [nn.Conv2d(c_in, c_out, 3, padding=1), nn.BatchNorm2d(c_out), nn.ReLU(inplace=True)]

    return nn.Sequential(
        *block(3, 16), nn.MaxPool2d(2),
        *block(16, 32), nn.MaxPool2d(2),
        *block(32, 64), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * 4 * 4, 64), nn.ReLU(inplace=True), nn.Linear(64, num_classes),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--logdir", default="runs/demo", help="where the TensorBoard run goes (default: runs/demo)")
    parser.add_argument("--seconds", type=float, default=60.0, help="how long to train (default: 60)")
    parser.add_argument("--every", type=int, default=20, help="log histograms and scalars every N steps (default: 20)")
    parser.add_argument("--image-every", type=int, default=100, help="log feature maps every N steps (default: 100)")
    parser.add_argument("--lr", type=float, default=5e-4,
                        help="Adam's learning rate (default: 5e-4; 10 makes the run diverge, for the alerts)")
    args = parser.parse_args()
    # actviz says what it watches, where it goes and, at the end, how to look, through the logger "actviz"
    # (on a terminal it says so even without this): shown here wherever the output goes.
    logging.basicConfig(format="%(message)s")
    logging.getLogger("actviz").setLevel(logging.INFO)

    torch.manual_seed(0)
    train_x, train_y = make_dataset(4096, 32, seed=0)
    test_x, test_y = make_dataset(512, 32, seed=1)
    model = small_cnn()
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    loss_fn = nn.CrossEntropyLoss()

    # The one line. probe=: a fixed test picture drawn at every image step, so the feature-map slider
    # shows the same shape over training; alerts are on by default (see docs/diagnosis.md).
    viz = actviz.watch(model, args.logdir, every=args.every, image_every=args.image_every,
        extras=[actviz.Probe(test_x[:1])])
    start, step = time.monotonic(), 0
    with viz:
        while time.monotonic() - start < args.seconds:
            batch = torch.randint(0, len(train_x), (64,))
            model.train()
            loss = loss_fn(model(train_x[batch]), train_y[batch])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            if step == 1:  # step 0 logged: the table of watched layers, also in TensorBoard's Text tab
                viz.flush()
                print(viz.layer_table, "\n")
            if step % 100 == 0:
                model.eval()  # eval forwards are not steps and log nothing
                with torch.no_grad():
                    accuracy = (model(test_x).argmax(1) == test_y).float().mean().item()
                viz.writer.add_scalar("demo/loss", loss.item(), viz.step)
                viz.writer.add_scalar("demo/test_accuracy", accuracy, viz.step)
                print(f"step {step:5d}  loss {loss.item():.3f}  test accuracy {accuracy:.1%}")
    # actviz's end line, said at close (the end of the with block above), gave the steps logged, the alerts
    # and the commands that show the run.
    print(f"trained {step} steps in {time.monotonic() - start:.0f} s")


if __name__ == "__main__":
    main()
