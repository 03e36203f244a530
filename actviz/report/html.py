"""The HTML page of :func:`actviz.report`: one ``index.html`` and its PNG files.

The page is static: inline CSS, system fonts, no JavaScript and nothing fetched
from the network, so it opens offline in any browser, can be zipped and mailed,
and prints one image per page: each image's section starts a page, and the print rules
shrink the table and the grids so that a section of up to 13 layers (VGG16's convolutions)
fits on an A4 or Letter page, the first with the header. Layout of the folder::

    index.html
    {run}/input.png          the image as the model saw it
    {run}/{layer}.png        one feature-map grid per layer, each its own (see layer_file_names)
"""

from __future__ import annotations

import datetime
import html
import math
import os
import re
import zlib
from pathlib import Path

from .._version import __version__
from ..output.png import encode_png
from .models import RANDOM_WEIGHTS_NOTE, SEED
from .results import ImageReport, LayerRecord, ReportResult

__all__ = ["format_number", "format_percent", "layer_file_names", "write_html"]

_CSS = """
:root { color-scheme: light; --ink: #1f2328; --muted: #59636e; --line: #d1d9e0; --soft: #f6f8fa; --accent: #0969da; }
* { box-sizing: border-box; }
body { margin: 0; font: 15px/1.5 system-ui, -apple-system, "Segoe UI", Roboto, "Helvetica Neue", Arial, sans-serif;
       color: var(--ink); background: #fff; }
main { max-width: 1180px; margin: 0 auto; padding: 28px 28px 56px; }
h1 { font-size: 26px; margin: 0 0 4px; }
h2 { font-size: 21px; margin: 44px 0 14px; padding-top: 14px; border-top: 2px solid var(--ink); }
h3 { font-size: 16px; margin: 26px 0 10px; }
code, .mono { font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, "Liberation Mono", monospace; font-size: 13px; }
.meta { color: var(--muted); margin: 0 0 10px; }
.meta dl { display: grid; grid-template-columns: max-content 1fr; gap: 2px 14px; margin: 10px 0 0; }
.meta dt { font-weight: 600; color: var(--ink); }
.meta dd { margin: 0; }
nav { margin: 14px 0; padding: 10px 14px; background: var(--soft); border: 1px solid var(--line); border-radius: 6px; }
nav a { margin-right: 14px; }
a { color: var(--accent); text-decoration: none; }
a:hover { text-decoration: underline; }
.banner { margin: 16px 0; padding: 12px 16px; border: 2px solid #bf8700; border-radius: 6px; background: #fff8c5;
          font-weight: 600; }
.failed { border: 1px solid #ff8182; background: #ffebe9; border-radius: 6px; padding: 10px 14px; margin: 14px 0; }
.failed ul { margin: 4px 0 0; padding-left: 20px; }
.intro { display: flex; flex-wrap: wrap; gap: 28px; align-items: flex-start; }
.intro figure { margin: 0; }
.input img { display: block; width: 224px; height: auto; border: 1px solid var(--line); border-radius: 4px; }
figcaption { color: var(--muted); font-size: 13px; margin-top: 6px; }
.preds { min-width: 320px; flex: 1; }
.preds h3 { margin-top: 0; }
table { border-collapse: collapse; font-variant-numeric: tabular-nums; }
th, td { padding: 5px 10px; border-bottom: 1px solid var(--line); text-align: left; }
th { background: var(--soft); font-weight: 600; font-size: 13px; }
td.num, th.num { text-align: right; }
.stats { width: 100%; font-size: 14px; }
.stats tbody tr:nth-child(even) { background: #fbfcfd; }
.bar { position: relative; width: 180px; height: 10px; background: var(--soft); border-radius: 5px; overflow: hidden; }
.bar span { position: absolute; inset: 0 auto 0 0; background: var(--accent); }
.warn { color: #bc4c00; font-weight: 600; }
.maps { display: grid; grid-template-columns: repeat(auto-fill, minmax(340px, 1fr)); gap: 22px; }
.layer { margin: 0; padding: 12px; border: 1px solid var(--line); border-radius: 6px; break-inside: avoid; }
.layer header { display: flex; justify-content: space-between; gap: 8px; flex-wrap: wrap; margin-bottom: 8px; }
.layer header b { font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; font-size: 14px; }
.layer header span { color: var(--muted); font-size: 13px; }
.layer img { display: block; width: 100%; height: auto; image-rendering: pixelated; background: #fff; }
footer { margin-top: 48px; color: var(--muted); font-size: 13px; border-top: 1px solid var(--line); padding-top: 12px; }
@media print {
  @page { margin: 12mm; }
  body { font-size: 10px; }
  main { max-width: none; padding: 0; }
  nav { display: none; }
  h1 { font-size: 17px; }
  h2 { font-size: 15px; margin: 0 0 6px; padding-top: 4px; }
  h3 { font-size: 12px; margin: 8px 0 4px; }
  code, .mono, .layer header b { font-size: 9px; }
  .meta dl { grid-template-columns: repeat(3, max-content 1fr); margin-top: 4px; }
  .banner, .failed { margin: 8px 0; padding: 6px 10px; }
  section { margin-top: 14px; }
  section + section { break-before: page; margin-top: 0; }
  .intro { gap: 14px; }
  .input, .input img { width: 130px; }  /* a caption wraps under its picture, beside the next */
  .preds { min-width: 240px; }
  th, td { padding: 1px 6px; }
  th, figcaption, .layer header span { font-size: 9px; }
  .stats { font-size: 10px; }
  .bar { width: 110px; height: 8px; }
  .maps { grid-template-columns: repeat(auto-fit, minmax(88px, 1fr)); gap: 6px; }
  .layer { padding: 4px; }
  .layer header { margin-bottom: 2px; }
  .layer header span, .layer figcaption { display: none; }
  figcaption { margin-top: 2px; }
  footer { margin-top: 14px; padding-top: 6px; font-size: 9px; }
  .layer, .intro, table { break-inside: avoid; }
}
"""


def format_number(value: float) -> str:
    """Every statistic on the page: four significant digits, trailing zeros kept, an exponent only outside [1e-4, 1e4).

    Zero is ``0``; NaN and ±Inf (no finite value to show) are an en dash.

    Example:
        >>> [format_number(v) for v in (0.000123456, -1.06, 1234.5678, 123456.0, -2.5e-7, -0.0, float("nan"))]
        ['0.0001235', '-1.060', '1235', '1.235e5', '-2.500e-7', '0', '–']
    """
    if not math.isfinite(value):
        return "–"
    if value == 0:
        return "0"  # not "-0" or "0.000"
    mantissa, _, exponent = f"{value:#.4g}".partition("e")
    mantissa = mantissa.rstrip(".")  # "1235." -> "1235"
    return f"{mantissa}e{int(exponent)}" if exponent else mantissa


def format_percent(fraction: float) -> str:
    """Every fraction on the page (zero after ReLU, probabilities): a percentage with one decimal.

    Example:
        >>> format_percent(0.25), format_percent(1 / 3), format_percent(float("nan"))
        ('25.0%', '33.3%', '–')
    """
    return f"{fraction:.1%}" if math.isfinite(fraction) else "–"


#: Most characters of a layer's file name stem: file systems take 255 bytes a name.
MAX_STEM = 96


def _file_name(layer: str) -> str:
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", layer).strip("_") or "layer"
    if len(stem) > MAX_STEM:  # a long layer name: its start, and a checksum of all of it to keep it apart
        stem = f"{stem[:MAX_STEM - 9]}-{zlib.crc32(layer.encode('utf-8', 'surrogatepass')):08x}"
    return stem


def layer_file_names(layers: list[str]) -> dict[str, str]:
    """One PNG file name per layer, each its own, in a run folder where ``input.png`` and ``gradcam.png`` are taken.

    Names are made safe for any file system (a stem over :data:`MAX_STEM` characters keeps its start and
    a checksum of the whole name); two layers whose names become the same
    (``blocks.a b`` and ``blocks.a_b``), or differ only in case, get a numbered second file.

    Example:
        >>> layer_file_names(["blocks.a b", "blocks.a_b", "input", "Conv"])
        {'blocks.a b': 'blocks.a_b.png', 'blocks.a_b': 'blocks.a_b-2.png', 'input': 'input-2.png', 'Conv': 'Conv.png'}
        >>> len(layer_file_names(["x" * 300])["x" * 300])
        100
    """
    taken = {"input.png", "gradcam.png"}  # the run folder's other files
    names: dict[str, str] = {}
    for layer in layers:
        stem = _file_name(layer)
        name, number = f"{stem}.png", 1
        while name.lower() in taken:  # lower: a case-insensitive disk (macOS, Windows) would merge them too
            number += 1
            name = f"{stem}-{number}.png"
        taken.add(name.lower())
        names[layer] = name
    return names


def _anchor(*parts: str) -> str:
    return "-".join(re.sub(r"[^A-Za-z0-9_-]+", "_", part) for part in parts)


def _shape(shape: tuple[int, ...]) -> str:
    return "×".join(str(size) for size in shape)


def _img(src: str, alt: str, width: int, height: int) -> str:
    """The picture, linked to its PNG file: a click (no JavaScript) shows it at full size."""
    return (
        f'<a href="{html.escape(src)}" title="open at full size, {width}×{height} px">'
        f'<img src="{html.escape(src)}" alt="{html.escape(alt)}" width="{width}" height="{height}"></a>'
    )


def _predictions(item: ImageReport) -> str:
    if not item.predictions:  # random weights or your own model: no class names, so no box at all
        return ""
    rows = "".join(
        f'<tr><td class="num">{rank}</td><td>{html.escape(label)}</td><td class="num">{format_percent(p)}</td>'
        f'<td><div class="bar"><span style="width:{p * 100:.1f}%"></span></div></td></tr>'
        for rank, (label, p) in enumerate(item.predictions, 1)
    )
    return (
        '<div class="preds"><h3>Top-5 predictions</h3><table><thead><tr><th class="num">#</th><th>class</th>'
        f'<th class="num">probability</th><th></th></tr></thead><tbody>{rows}</tbody></table></div>'
    )


def _stats_row(item: ImageReport, record: LayerRecord) -> str:
    summary = record.summary
    known = record.dead_channels is not None and record.channels > 0
    dead = f"{record.dead_channels} / {record.channels}" if known else "–"
    dead_class = ' class="num warn"' if known and record.dead_channels * 4 >= record.channels else ' class="num"'
    name = html.escape(record.name)
    linked = f'<a href="#{_anchor(item.run, record.name)}">{name}</a>' if record.grid is not None else name
    return (
        f'<tr><td class="mono">{linked}</td><td>{html.escape(record.type)}</td><td class="mono">{_shape(record.shape)}</td>'
        f'<td class="num">{format_number(summary.mean)}</td><td class="num">{format_number(summary.std)}</td>'
        f'<td class="num">{format_number(summary.min)}</td><td class="num">{format_number(summary.max)}</td>'
        f'<td class="num">{format_percent(record.relu_zero_fraction)}</td><td{dead_class}>{dead}</td></tr>'
    )


def _gradcam(item: ImageReport, folder: Path) -> str:
    if item.gradcam is None:
        return ""
    layer, picture = item.gradcam
    file_name = f"{item.run}/gradcam.png"
    (folder / file_name).write_bytes(encode_png(picture))
    _, height, width = picture.shape
    return (
        '<figure class="input">' + _img(file_name, f"Grad-CAM of {layer} over {item.path.name}", width, height)
        + f"<figcaption>Grad-CAM of the top class at <code>{html.escape(layer)}</code>: yellow where it "
        "looks</figcaption></figure>"
    )


def _section(item: ImageReport, folder: Path) -> str:
    run_dir = folder / item.run
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "input.png").write_bytes(encode_png(item.input_image))
    _, height, width = item.input_image.shape
    source_w, source_h = item.source_size
    intro = (
        '<div class="intro"><figure class="input">'
        + _img(f"{item.run}/input.png", f"input image {item.path.name}", width, height)
        + f"<figcaption>Model input: {width}×{height} crop of the {source_w}×{source_h} file</figcaption></figure>"
        + _gradcam(item, folder)
        + _predictions(item)
        + "</div>"
    )
    rows = "".join(_stats_row(item, record) for record in item.layers)
    table = (
        "<h3>Layer statistics</h3>"
        '<table class="stats"><thead><tr><th>layer</th><th>type</th><th>output shape</th>'
        '<th class="num">mean</th><th class="num">std</th><th class="num">min</th><th class="num">max</th>'
        '<th class="num" title="share of the output at or below zero: what a ReLU sets to zero">zero after ReLU</th>'
        '<th class="num">dead channels</th></tr></thead>'
        f"<tbody>{rows}</tbody></table>"
    )
    figures = []
    file_names = layer_file_names([record.name for record in item.layers if record.grid is not None])
    for record in item.layers:
        if record.grid is None:
            continue
        file_name = f"{item.run}/{file_names[record.name]}"
        (folder / file_name).write_bytes(encode_png(record.grid))
        _, grid_h, grid_w = record.grid.shape
        caption = [f"{record.shown_channels} of {record.channels} channels"] if record.channels else []
        caption += [f"mean {format_number(record.summary.mean)}", f"zero after ReLU {format_percent(record.relu_zero_fraction)}"]
        caption += [] if record.dead_channels is None else [f"dead {record.dead_channels}"]
        figures.append(
            f'<figure class="layer" id="{_anchor(item.run, record.name)}"><header><b>{html.escape(record.name)}</b>'
            f"<span>{html.escape(record.type)} · {_shape(record.shape)}</span></header>"
            + _img(file_name, f"feature maps of {record.name}", grid_w, grid_h)
            + f"<figcaption>{' · '.join(caption)}</figcaption></figure>"
        )
    maps = '<h3>Feature maps</h3><div class="maps">' + "".join(figures) + "</div>" if figures else ""
    return (
        f'<section id="{_anchor(item.run)}"><h2>{html.escape(item.path.name)}</h2>'
        f"{intro}{table}{maps}</section>"
    )


def write_html(result: ReportResult, folder: str | os.PathLike[str]) -> Path:
    """Write ``index.html`` and its PNG files for a report into ``folder``; return the page's path.

    Args:
        result: What :func:`actviz.report` computed.
        folder: Output folder, created if needed. Files of an earlier report are overwritten.

    Example:
        >>> import actviz, tempfile
        >>> result = actviz.report("alexnet", ["tests/data/chelsea.jpg"], logdir=None, size=96, progress=False)
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     sorted(p.name for p in write_html(result, folder).parent.rglob("*.png"))[:3]
        ['features.0.png', 'features.10.png', 'features.3.png']
    """
    root = Path(folder)
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise OSError(f"cannot create html folder '{root}': {error.strerror or error}") from error
    title = f"What {result.model} sees" + (" (random weights, untrained)" if result.random_weights else "")
    nav = ""
    if len(result.images) > 1:
        nav = "<nav>Images: " + "".join(
            f'<a href="#{_anchor(item.run)}">{html.escape(item.path.name)}</a>' for item in result.images
        ) + "</nav>"
    failed = ""
    if result.failed:
        items = "".join(f"<li>{html.escape(reason)}</li>" for reason in result.failed.values())
        failed = f'<div class="failed"><b>{len(result.failed)} image(s) could not be processed:</b><ul>{items}</ul></div>'
    weights = result.weights + (f" (random initialisation, seed {SEED})" if result.random_weights else "")
    banner = f'<p class="banner" role="note">{html.escape(RANDOM_WEIGHTS_NOTE)}</p>' if result.random_weights else ""
    now = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    header = (
        f"<header><h1>{html.escape(title)}</h1><div class=\"meta\">"
        f"<dl><dt>model</dt><dd><code>{html.escape(result.model)}</code></dd>"
        f"<dt>weights</dt><dd>{html.escape(weights)}</dd>"
        f"<dt>input</dt><dd>{result.input_size}×{result.input_size} pixels, one forward pass per image</dd>"
        f"<dt>layers</dt><dd>{len(result.layer_names)} selected; up to {result.max_channels} channels drawn per layer</dd>"
        f"<dt>made</dt><dd>{now} with actviz {__version__}</dd></dl></div></header>"
    )
    body = "".join(_section(item, root) for item in result.images)
    footer = (
        "<footer>Each tile of a grid is one channel of the layer's output for this image, scaled on its own "
        "from black (its lowest value) to white (its highest); when a layer has more channels than are drawn, "
        "the strongest by mean |activation| are shown, in channel order. Statistics cover the whole output; "
        "conv outputs are recorded before their in-place ReLU. <em>Zero after ReLU</em> is the share of the "
        "output at or below zero, which a ReLU sets to zero: for a conv, the share its ReLU zeroes; for a ReLU's "
        "own output, its zero fraction. A <em>dead</em> channel has no positive value for this image, so it is "
        "all zero after a ReLU. Click a picture to open its PNG at full size.</footer>"
    )
    page = (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{html.escape(title)}</title><style>{_CSS}</style></head>\n"
        f"<body><main>{header}{banner}{nav}{failed}{body}{footer}</main></body></html>\n"
    )
    index = root / "index.html"
    index.write_text(page, encoding="utf-8")
    return index
