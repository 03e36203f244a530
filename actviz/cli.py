"""The ``actviz`` command line: thin wrappers over :func:`actviz.report`, :mod:`actviz.diagnosis.doctor`
and :mod:`actviz.run_diff`.

``actviz report`` exit codes: 0 when every image was processed, 1 when at least one image
failed (the others are still reported), 2 when the report could not start (bad option,
unknown model, weights that cannot be downloaded or loaded), 130 on Ctrl-C.
``actviz doctor`` exit codes: 0 no alert, 1 at least one alert, 2 no actviz run, 3 a damaged event file.
``actviz diff`` exit codes: 0 the runs agree, 1 they part, 2 no actviz run or no common step, 3 a damaged event file.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from collections.abc import Iterator, Sequence
from typing import Any

from .diagnosis.doctor import add_doctor_parser, doctor
from .options import CaptureOptions
from .run_diff import add_diff_parser, diff
from .view.command import add_export_parser, run_export

__all__ = ["main", "build_parser"]

EXIT_OK, EXIT_IMAGE_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130

#: The first thing ``actviz report --help`` shows: a whole command that runs offline.
OFFLINE_EXAMPLE = "actviz report --model alexnet --weights none --image cat.jpg --html report_html"

_REPORT_DESCRIPTION = f"""\
try it (offline: random weights, nothing is downloaded; any photo works as cat.jpg):
  {OFFLINE_EXAMPLE}
  # then open report_html/index.html, or run: tensorboard --logdir runs/report

Run each image once through a torchvision classification model and write, for every
selected layer, the feature-map grid (drawn exactly as actviz.watch draws it) and its
statistics to TensorBoard and, with --html, to a self-contained web page. Random
weights show edges and colours, not learned features: --weights DEFAULT downloads
torchvision's pretrained weights once.
"""

_REPORT_EPILOG = """\
examples:
  # every conv layer of pretrained AlexNet on one image (weights downloaded once)
  actviz report --model alexnet --image cat.jpg --html report_html

  # VGG16 offline: random weights (seed 0), ReLU outputs, two images, no progress bar
  actviz report --model vgg16 --weights none --layers relu --image cat.jpg --image dog.png --quiet

  # weights you downloaded yourself, a few named layers, a smaller input
  actviz report --model vgg16_bn --weights vgg16_bn.pth --layers features.0 'features.1*' --size 160 --image cat.jpg

  tensorboard --logdir runs/report      # then open the IMAGES tab; one run per model and image

output:
  TensorBoard: one run per model and image in LOGDIR/<model>/<image name>, at step 0,
    with the tags ~feature_maps/<layer>, ~activations/<layer>, ~activation_stats/<statistic>@<layer>
    and ~input as TensorBoard names them, and the texts image (file, model, weights) and, with
    pretrained weights, predictions (top-5 table).
  HTML: DIR/index.html with the input, top-5, a statistics table and every grid;
    PNGs next to it in DIR/<image name>/. No JavaScript or network needed.

exit codes: 0 all images done, 1 some image failed, 2 bad option, model or weights.
"""


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the epilog's line breaks and shows each real default (not None or False)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if default in (None, False, argparse.SUPPRESS) or "default" in text:
            return text
        shown = " ".join(default) if isinstance(default, list) else default
        return f"{text} (default: {shown})"


def build_parser() -> argparse.ArgumentParser:
    """The ``actviz`` argument parser, with its ``report`` subcommand."""
    from ._version import __version__

    parser = argparse.ArgumentParser(
        prog="actviz",
        description="See inside PyTorch networks. 'actviz report' shows what every layer of a CNN sees in images; "
        "'actviz doctor RUN_DIR' says what is wrong in a training run; 'actviz diff RUN_A RUN_B' where two runs part.",
        epilog="Run 'actviz report --help', 'actviz doctor --help' or 'actviz diff --help' for options and examples.",
    )
    parser.add_argument("--version", action="version", version=f"actviz {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    report = commands.add_parser(
        "report",
        help="feature-map report of a torchvision model on images (TensorBoard and HTML)",
        description=_REPORT_DESCRIPTION,
        epilog=_REPORT_EPILOG,
        formatter_class=_Formatter,
    )
    report.add_argument(
        "--model", required=True,
        help="torchvision classification model: alexnet, vgg11/13/16/19 and their _bn variants, resnet18, ...",
    )
    report.add_argument(
        "--image", dest="images", action="extend", nargs="+", required=True, metavar="FILE",
        help="image file (JPEG, PNG, ...; grayscale, RGBA and 16-bit work); repeat or list several",
    )
    report.add_argument(
        "--weights", default="DEFAULT", metavar="DEFAULT|none|PATH",
        help="DEFAULT: torchvision's pretrained weights, downloaded on first use; none: random weights "
        "with a fixed seed; PATH: a state_dict file, loaded with torch.load(weights_only=True) so it "
        "cannot run code",
    )
    report.add_argument(
        "--logdir", default="runs/report",
        help="folder for the TensorBoard runs, one per model and image: LOGDIR/<model>/<image>",
    )
    report.add_argument(
        "--no-tensorboard", action="store_true", help="do not write TensorBoard runs (use with --html)"
    )
    report.add_argument(
        "--html", metavar="DIR", default=None,
        help="also write DIR/index.html and its PNG files, viewable offline in any browser",
    )
    report.add_argument(
        "--layers", nargs="+", default=["conv"], metavar="conv|relu|all|NAME",
        help="conv: every Conv2d (before its ReLU); relu: every ReLU output; all: every leaf module; "
        "or layer names and globs such as features.0 'features.1*'",
    )
    report.add_argument(
        "--gradcam", nargs="?", const=True, default=False, metavar="LAYER",
        help="also draw Grad-CAM of each image's top-1 class over it (HTML and TensorBoard gradcam/LAYER), "
        "at the last Conv2d or at LAYER",
    )
    report.add_argument(
        "--max-channels", type=int, default=CaptureOptions.max_channels, metavar="N",
        help="most channels drawn per layer; the strongest by mean |activation| are kept",
    )
    report.add_argument(
        "--size", type=int, default=None, metavar="PIXELS",
        help="side of the square model input; default: the pretrained weights' crop size, else 224",
    )
    report.add_argument("--device", default="cpu", help="cpu or cuda")
    report.add_argument("--quiet", action="store_true", help="no progress bar and no summary lines")
    add_doctor_parser(commands, _Formatter)
    add_diff_parser(commands, _Formatter)
    add_export_parser(commands, _Formatter)
    return parser


class _Messages(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return f"actviz: {record.levelname.lower()}: {record.getMessage()}"


@contextlib.contextmanager
def _messages_on_stderr(quiet: bool) -> Iterator[None]:
    """Print actviz's log messages as ``actviz: warning: ...`` for the command's duration.

    The logger's previous state comes back afterwards, so calling :func:`main` in-process
    (tests, notebooks) leaves the application's logging as it was.
    """
    package_logger = logging.getLogger("actviz")
    saved = package_logger.handlers[:], package_logger.level, package_logger.propagate
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Messages())
    package_logger.handlers[:] = [handler]
    package_logger.setLevel(logging.ERROR if quiet else logging.WARNING)
    package_logger.propagate = False
    try:
        yield
    finally:
        package_logger.handlers[:], package_logger.level, package_logger.propagate = saved


def _run_report(args: argparse.Namespace) -> int:
    from .report import ReportError, report
    from .report.models import RANDOM_WEIGHTS_NOTE

    try:
        result = report(
            args.model,
            args.images,
            weights=args.weights,
            logdir=None if args.no_tensorboard else args.logdir,
            html=args.html,
            layers=args.layers,
            max_channels=args.max_channels,
            size=args.size,
            device=args.device,
            progress=not args.quiet,
            gradcam=args.gradcam,
        )
    except ReportError as error:
        print(f"actviz: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as error:  # an output folder that cannot be created
        print(f"actviz: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    if not args.quiet:
        done = len(result.images)
        print(f"{result.model}: {done} of {done + len(result.failed)} image(s), {len(result.layer_names)} layers")
        if result.random_weights:
            print(f"{result.model}: {RANDOM_WEIGHTS_NOTE}")
        written = [item.run_dir for item in result.images if item.run_dir is not None]
        if result.logdir is not None and written:
            print(f"TensorBoard runs: {written[0].parent}   (view: tensorboard --logdir {result.logdir})")
        if result.html is not None:
            print(f"HTML report:      {result.html}")
    if result.failed:
        print(f"actviz: error: {len(result.failed)} image(s) failed:", file=sys.stderr)
        for reason in result.failed.values():
            print(f"  {reason}", file=sys.stderr)
        return EXIT_IMAGE_FAILED
    return EXIT_OK


def _print(text: str, stream: Any) -> None:
    """Print ``text``; a reader that stopped reading (``actviz doctor --json | head -1``) ends it quietly, as
    other commands do: the rest goes to ``os.devnull``, so that Python's own flush at exit raises nothing either."""
    try:
        print(text, file=stream)
        stream.flush()
    except BrokenPipeError:
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, stream.fileno())
            os.close(devnull)
        except (OSError, ValueError, AttributeError):  # a stream without a file descriptor
            pass


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``actviz`` command; returns the exit code.

    Example:
        >>> main(["report", "--model", "alexnet", "--weights", "none", "--size", "64",
        ...       "--image", "tests/data/chelsea.jpg", "--no-tensorboard", "--quiet"])
        0
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    if args.command == "doctor":
        status, text = doctor(args.run_dir, as_json=args.json)
        _print(text, sys.stderr if status == EXIT_USAGE and not args.json else sys.stdout)
        return status
    if args.command == "diff":
        status, text = diff(args.run_a, args.run_b, rtol=args.rtol, atol=args.atol, as_json=args.json)
        _print(text, sys.stderr if status == EXIT_USAGE and not args.json else sys.stdout)
        return status
    if args.command == "export":
        status, text = run_export(args)
        _print(text, sys.stderr if status else sys.stdout)
        return status
    try:
        CaptureOptions(max_channels=args.max_channels)  # the watcher's check and message
    except ValueError as error:
        parser.error(str(error).replace("max_channels=", "--max-channels ").replace("max_channels", "--max-channels"))
    if args.size is not None and args.size < 16:
        parser.error(f"--size must be at least 16 pixels, got {args.size}; for example --size 224")
    try:
        with _messages_on_stderr(args.quiet):
            return _run_report(args)
    except KeyboardInterrupt:
        print("actviz: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
