"""The pictures of docs/transformers.md: a live TensorBoard on a small ViT trained with actviz watching.

    python scripts/transformer_screenshots.py            # writes docs/figures/transformer_*.png

It trains a 4-layer ViT on the demo's drawn shapes (scripts/demo_train.py), with a fixed probe
image, then opens TensorBoard's Images and Scalars dashboards in headless Chromium, as
scripts/make_screenshots.py does (same needs: apt-get install chromium, pip install playwright).
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
from pathlib import Path

import torch
from demo_train import make_dataset
from make_screenshots import CHROMIUM, CHROMIUM_FLAGS, TIMEOUT_MS, filter_tags, save_small, tensorboard
from torchvision.models import VisionTransformer

import actviz

ROOT = Path(__file__).resolve().parent.parent
SHOTS = [
    ("images", r"^~(probe/input|attention_rollout|attention_maps/encoder_layer_(0|3).self_attention)$",
     "tf-image-loader:visible img", 2000, "transformer_attention_maps.png"),
    ("scalars", r"^~attention/(max_logit|entropy_min)@encoder_layer_(0|3).self_attention$",
     "tf-scalar-card:visible", 3000, "transformer_attention_scalars.png"),
]


def train(log_dir: Path, steps: int) -> None:
    torch.manual_seed(0)
    images, labels = make_dataset(2048, 32, seed=0)
    probe, _ = make_dataset(1, 32, seed=7)
    model = VisionTransformer(image_size=32, patch_size=4, num_layers=4, num_heads=4, hidden_dim=64, mlp_dim=128,
                              num_classes=int(labels.max()) + 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with actviz.watch(model, log_dir, every=10, image_every=50, extras=[actviz.Probe(probe)]):
        for _ in range(steps):
            batch = torch.randint(0, len(images), (64,))
            loss = torch.nn.functional.cross_entropy(model(images[batch]), labels[batch])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()


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
                filter_tags(page, tags)
                page.locator(ready).first.wait_for()
                page.wait_for_timeout(settle_ms)
                save_small(page.locator("tf-category-paginated-view:visible").first.screenshot(), out_dir / file_name)
        finally:
            context.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "figures")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        logs = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        train(logs / "vit", args.steps)
        shoot(stack.enter_context(tensorboard(logs)), args.out)


if __name__ == "__main__":
    main()
