"""What does every conv layer of AlexNet see in a picture? A worked example of ``actviz.report``.

    python scripts/feature_map_report.py                          # random weights, works offline
    python scripts/feature_map_report.py --weights DEFAULT        # pretrained (downloads ~240 MB once)
    python scripts/feature_map_report.py --model vgg16 --image my.jpg

Then open ``report_html/index.html`` in a browser, or run ``tensorboard --logdir runs/report``
(one run per model and image: ``runs/report/<model>/<image>``).
The ``actviz report`` command does the same with more options (``actviz report --help``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import actviz
from actviz.report.models import RANDOM_WEIGHTS_NOTE

HERE = Path(__file__).resolve().parent
SAMPLES = [HERE.parent / "tests" / "data" / name for name in ("chelsea.jpg", "coffee.jpg")]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="alexnet")
    parser.add_argument("--weights", default="none", help="DEFAULT, none, or a state_dict file")
    parser.add_argument("--image", action="append", help="image file; repeat for several (default: two samples)")
    args = parser.parse_args()

    result = actviz.report(
        args.model,
        args.image or SAMPLES,
        weights=args.weights,
        logdir="runs/report",
        html="report_html",
        layers="conv",  # every Conv2d, recorded before its in-place ReLU
    )

    for image in result.images:
        top = ", ".join(f"{label} {p:.0%}" for label, p in image.predictions)  # empty for random weights
        print(f"\n{image.path.name}" + (f": {top}" if top else ""))
        for layer in image.layers:
            stats = layer.summary
            print(
                f"  {layer.name:<12} {layer.type:<8} {'x'.join(map(str, layer.shape)):<16} "
                f"mean {stats.mean:+.3f}  std {stats.std:.3f}  dead channels {layer.dead_channels}/{layer.channels}"
            )
    if result.random_weights:  # say it where the numbers are read, as the page and the command do
        print(f"\n{RANDOM_WEIGHTS_NOTE}")
    print(f"\nHTML: {result.html}\nTensorBoard: tensorboard --logdir {result.logdir}")
    for reason in result.failed.values():
        print(f"failed: {reason}", file=sys.stderr)
    return 0 if result.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
