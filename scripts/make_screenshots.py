"""Make the README's pictures: real TensorBoard pages, rendered by headless Chromium.

    python scripts/make_screenshots.py              # writes notebooks/figures/*.png
    python scripts/make_screenshots.py --steps 100  # quicker, fewer steps in the histograms

It trains the demo CNN (scripts/demo_train.py) with actviz watching, starts
``tensorboard`` on the run, opens the Images, Histograms and Scalars dashboards in
Debian's chromium through Playwright, and saves one clipped, palette-quantised PNG
of each. Needs ``apt-get install chromium`` and ``pip install playwright``;
Playwright downloads nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import torch
from demo_train import make_dataset, small_cnn
from PIL import Image
from torch import nn

import actviz

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_FLAGS = [
    "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--no-first-run",
]
MAX_BYTES = 300_000
# (dashboard, tag filter on TensorBoard's names (actviz's start with "~"), element that shows the data has
# loaded, settle time in ms, file)
SHOTS = [
    # the conv layers' feature maps of the probe image, at the last logged step
    ("images", r"feature_maps/(0|4|8)$", "tf-image-loader:visible img", 1500, "images_dashboard.png"),
    # the probe image and Grad-CAM of the last conv over it
    ("images", r"^~(probe/input|gradcam/8)$", "tf-image-loader:visible img", 1500, "probe_gradcam.png"),
    # one chart per statistic, every layer on it
    ("custom_scalars", None, "tf-custom-scalar-multi-line-chart-card:visible", 3500, "custom_scalars.png"),
    # gradients flowing back into each watched layer, over steps
    ("histograms", r"^~gradients/(0|4|8|13)$", "vz-histogram-timeseries:visible", 2500, "histograms_dashboard.png"),
    # per-layer gradient norms, one chart per layer
    ("scalars", r"^~gradient_stats/norm@(0|4|8|13)$", "tf-scalar-card:visible", 2500, "scalars_chart.png"),
]
TIMEOUT_MS = 60_000


def train(log_dir: Path, steps: int) -> None:
    """Train the demo CNN, logging statistics every 10 steps and a fixed probe's pictures every 50."""
    torch.manual_seed(0)
    images, labels = make_dataset(2048, 32, seed=0)
    probe, _ = make_dataset(1, 32, seed=7)  # one drawn shape, the same at every image step
    model = small_cnn()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    with actviz.watch(model, log_dir, every=10, image_every=50, statistics=["default", "update_ratio"],
        extras=[actviz.Probe(probe, gradcam=True)]):
        for _ in range(steps):
            batch = torch.randint(0, len(images), (64,))
            loss = nn.functional.cross_entropy(model(images[batch]), labels[batch])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def tensorboard(log_dir: Path) -> Iterator[str]:
    """Serve ``log_dir`` on a free port, with every image step kept; yield the URL; always stop it."""
    port = free_port()
    command = [
        sys.executable, "-m", "tensorboard.main", "--logdir", str(log_dir), "--host", "127.0.0.1",
        "--port", str(port), "--samples_per_plugin", "images=100",
    ]
    process = subprocess.Popen(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(f"{url}/data/plugin/images/tags", timeout=5) as response:
                    if b"feature_maps" in response.read():
                        break
            if time.monotonic() > deadline or process.poll() is not None:
                raise RuntimeError(f"tensorboard did not serve {log_dir} at {url}")
            time.sleep(0.5)
        time.sleep(2)  # let it read the rest of the run
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=10)


def save_small(png: bytes, path: Path) -> None:
    """Save ``png`` quantised to a palette, so each picture stays well under 300 KB."""
    with Image.open(io.BytesIO(png)) as picture:
        small = picture.convert("RGB").quantize(colors=128, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE)
    small.save(path, optimize=True)
    size = path.stat().st_size
    if size > MAX_BYTES:
        raise RuntimeError(f"{path} is {size} bytes, over {MAX_BYTES}")
    print(f"wrote {path} ({small.width}x{small.height}, {size // 1024} KB)")


def filter_tags(page, pattern: str) -> None:
    """Type a regex into the dashboard's tag filter."""
    box = page.locator("tf-tag-filterer input:visible").first
    box.fill(pattern)
    box.press("Enter")


def shoot(url: str, out_dir: Path) -> None:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright, tempfile.TemporaryDirectory() as profile:
        context = playwright.chromium.launch_persistent_context(
            profile, executable_path=CHROMIUM, headless=True, args=CHROMIUM_FLAGS,
            viewport={"width": 1400, "height": 1600}, device_scale_factor=1,
        )
        try:
            page = context.new_page()
            page.set_default_timeout(TIMEOUT_MS)

            for dashboard, tags, ready, settle_ms, file_name in SHOTS:
                page.goto(f"{url}/#{dashboard}")
                if tags is not None:
                    filter_tags(page, tags)
                page.locator(ready).first.wait_for()
                page.wait_for_timeout(settle_ms)  # let the charts finish drawing
                if tags is not None:
                    png = page.locator("tf-category-paginated-view:visible").first.screenshot()
                else:  # the whole tab, down to its last chart
                    png = page.screenshot(clip={"x": 0, "y": 0, "width": 1400, "height": 1080})
                save_small(png, out_dir / file_name)
        finally:
            context.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=400, help="training steps (default: 400)")
    parser.add_argument("--out", type=Path, default=ROOT / "notebooks" / "figures", help="where the PNGs go")
    parser.add_argument("--logdir", type=Path, help="keep the run here; an existing run there is reused, not retrained")
    args = parser.parse_args()
    if not os.path.exists(CHROMIUM):
        sys.exit(f"{CHROMIUM} is missing: apt-get install chromium")
    args.out.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        logs = args.logdir or Path(stack.enter_context(tempfile.TemporaryDirectory()))
        if not any(logs.glob("demo/events.out.tfevents.*")):
            start = time.monotonic()
            train(logs / "demo", args.steps)
            print(f"trained {args.steps} steps in {time.monotonic() - start:.0f} s")
        with tensorboard(logs) as url:
            shoot(url, args.out)


if __name__ == "__main__":
    main()
