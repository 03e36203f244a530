"""Feature-map grids and heat maps, checked pixel by pixel on small hand-made inputs."""

import io

import numpy as np
import pytest
import torch
from PIL import Image

from actviz.output.png import encode_png
from actviz.pictures.heatmap_sources import HEATMAP_COLOURS
from actviz.pictures.rendering import (
    _resize,
    feature_map_grid,
    grid_layout,
    heatmap,
    select_channels,
    tile_size,
)


def test_tile_size_enlarges_small_maps_by_whole_factors_and_shrinks_big_ones():
    assert tile_size(13, 13) == (39, 39)        # x3
    assert tile_size(7, 7) == (35, 35)          # x5
    assert tile_size(31, 31) == (62, 62)        # x2
    assert tile_size(32, 32) == (32, 32)
    assert tile_size(100, 50) == (100, 50)
    assert tile_size(256, 128) == (128, 64)
    assert tile_size(1, 30) == (2, 60)


def test_grid_layout_is_ceil_sqrt_columns():
    assert grid_layout(1, 10, 10) == (10, 10)  # make_grid adds no border to a lone tile
    assert grid_layout(2, 10, 10) == (14, 26)   # 2 columns, 1 row
    assert grid_layout(10, 10, 10) == (38, 50)  # 4 columns, 3 rows
    assert grid_layout(64, 52, 52) == (434, 434)


def test_each_channel_is_normalised_on_its_own():
    fmap = torch.zeros(2, 48, 48)
    fmap[0] = torch.linspace(10, 20, 48 * 48).view(48, 48)    # large values
    fmap[1] = torch.linspace(-1e-3, 1e-3, 48 * 48).view(48, 48)  # tiny values
    grid = feature_map_grid(fmap)
    assert grid.dtype == torch.uint8 and grid.shape == (1, *grid_layout(2, 48, 48))
    first = grid[0, 2:50, 2:50]
    second = grid[0, 2:50, 52:100]
    for tile in (first, second):
        assert tile.min() == 0 and tile.max() == 255
        assert tile[0, 0] == 0 and tile[-1, -1] == 255
    assert (grid[0, :2, :] == 255).all() and (grid[0, :, 50:52] == 255).all()  # white gaps


def test_small_maps_are_enlarged_with_sharp_pixels():
    fmap = torch.tensor([[[0.0, 1.0], [2.0, 3.0]]])
    grid = feature_map_grid(fmap)
    assert grid.shape == (1, 32, 32)  # 2 px x 16, a lone tile has no border
    tile = grid[0]
    expected = torch.tensor([[0, 85], [170, 255]], dtype=torch.uint8).repeat_interleave(16, 0).repeat_interleave(16, 1)
    assert torch.equal(tile, expected)


@pytest.mark.parametrize("size", [(6, 4), (3, 8), (9, 12)])
def test_whole_factor_enlarging_repeats_pixels_as_nearest_interpolation_does(size):
    images = torch.arange(2 * 1 * 3 * 4, dtype=torch.uint8).reshape(2, 1, 3, 4)
    expected = torch.nn.functional.interpolate(images, size=size, mode="nearest")
    assert torch.equal(_resize(images, size), expected)


def test_strongest_channels_are_kept_in_channel_order():
    strengths = torch.tensor([0.1, 5.0, 0.2, 3.0, 4.0])
    fmap = strengths.view(5, 1, 1) * torch.randn(5, 6, 6).sign()
    assert select_channels(fmap, 3).tolist() == [1, 3, 4]
    assert select_channels(fmap, 10).tolist() == [0, 1, 2, 3, 4]
    assert feature_map_grid(fmap, max_channels=3).shape == (1, *grid_layout(3, 36, 36))  # 6 px x 6


def test_grid_matches_the_kept_channels_drawn_alone():
    fmap = torch.randn(6, 8, 8)
    fmap[2] *= 100
    fmap[4] *= 100
    grid = feature_map_grid(fmap, max_channels=2)
    assert torch.equal(grid, feature_map_grid(fmap[[2, 4]]))


def test_nan_inf_and_constant_channels_do_not_break_the_picture():
    fmap = torch.stack([torch.full((4, 4), 3.0), torch.arange(16.0).view(4, 4)])
    fmap[1, 0, 0] = float("nan")
    fmap[1, 0, 1] = float("inf")
    before = fmap.clone()
    grid = feature_map_grid(fmap)
    torch.testing.assert_close(fmap, before, equal_nan=True)  # input untouched
    constant = grid[0, 2:34, 2:34]  # 4 px x 8 = 32 px tiles
    assert (constant == 0).all()
    varied = grid[0, 2:34, 36:68]
    assert varied[0, 0] == 0  # NaN drawn black
    assert varied[0, 8] == 255  # +Inf drawn white (pixel (0, 1) at x8 scale)
    assert varied[-1, -1] == 255  # finite max


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64, torch.int64])
def test_grid_accepts_any_real_dtype(dtype):
    fmap = torch.arange(2 * 3 * 3).view(2, 3, 3).to(dtype)
    assert torch.equal(feature_map_grid(fmap), feature_map_grid(fmap.float()))


def test_bad_inputs_are_refused_with_the_shape_named():
    with pytest.raises(TypeError, match="ndarray"):
        feature_map_grid(np.zeros((2, 3, 3)))
    with pytest.raises(ValueError, match=r"\(2, 3\)"):
        feature_map_grid(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="max_channels"):
        feature_map_grid(torch.zeros(2, 3, 3), max_channels=0)
    with pytest.raises(ValueError, match=r"\(4,\)"):
        heatmap(torch.zeros(4))


def test_heatmap_uses_viridis_from_low_to_high_and_keeps_rows():
    matrix = torch.tensor([[0.0, 1.0], [2.0, 4.0]])
    image = heatmap(matrix)
    assert image.shape == (3, 64, 64)  # shorter side 2 -> x32
    assert image[:, 0, 0].tolist() == [68, 1, 84]  # viridis at 0
    assert image[:, -1, -1].tolist() == [253, 231, 37]  # viridis at 1
    assert image[:, 0, 63].tolist() == image[:, 0, 32].tolist()  # one value per 32 x 32 block


def test_heatmap_size_limits():
    assert heatmap(torch.randn(16, 64)).shape == (3, 64, 256)
    assert heatmap(torch.randn(2048, 8)).shape == (3, 512, 64)  # area-averaged to 512 px, each column 8 px wide


def test_a_vocabulary_sized_side_keeps_every_row_legible():
    """A language model's decoder output (20 tokens over an 18,328-word vocabulary, word_language_model's
    size): each row is a band of 4 px (80 x 512), not 1 x 512 px for the whole; its colour is the row's level."""
    rows = torch.arange(20, dtype=torch.float32)[:, None].expand(20, 18_328)  # row i holds i everywhere
    picture = heatmap(rows)
    assert picture.shape == (3, 80, 512)
    for row in range(20):
        level = round(255 * row / 19)
        band = picture[:, 4 * row:4 * row + 4]
        assert (band == HEATMAP_COLOURS[level][:, None, None]).all(), row


def test_png_round_trip():
    gray = feature_map_grid(torch.randn(3, 5, 5))
    decoded = np.asarray(Image.open(io.BytesIO(encode_png(gray))))
    assert decoded.shape == gray.shape[1:] and (decoded == gray[0].numpy()).all()
    colour = heatmap(torch.randn(4, 6))
    decoded = np.asarray(Image.open(io.BytesIO(encode_png(colour))))
    assert (decoded == colour.permute(1, 2, 0).numpy()).all()
    with pytest.raises(ValueError):
        encode_png(torch.zeros(2, 4, 4, dtype=torch.uint8))


@pytest.mark.parametrize("shape", [(1, 1, 1), (1, 1, 9), (3, 7, 1), (1, 40, 33), (3, 40, 33)])
def test_png_round_trip_of_noise_and_repeated_rows(shape):
    # Noise makes the "Sub" filter wrap below 0; the copied rows take the "Up" filter.
    image = torch.randint(0, 256, shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    if shape[1] > 2:
        image[:, 1] = image[:, 0]
        image[:, -1] = image[:, -2]
    decoded = np.asarray(Image.open(io.BytesIO(encode_png(image))))
    expected = image[0].numpy() if shape[0] == 1 else image.permute(1, 2, 0).numpy()
    assert decoded.shape == expected.shape and (decoded == expected).all()


def test_a_heat_map_is_stored_as_palette_indices_that_decode_to_the_same_pixels() -> None:
    from actviz.pictures.heatmap_sources import HEATMAP_COLOURS, heatmap_source
    from actviz.common.pixels import PaletteImage

    torch.manual_seed(0)
    matrix = torch.randn(20, 200).cumsum(1)
    draw, source = heatmap_source(matrix)
    picture = draw(source)
    assert isinstance(picture, PaletteImage) and picture.palette is HEATMAP_COLOURS
    rgb = picture.rgb()
    assert torch.equal(rgb, heatmap(matrix)) and rgb.shape == picture.shape == (3, 40, 400)  # enlarged twice
    indexed, plain = encode_png(picture), encode_png(rgb)
    assert indexed[25] == 3 and plain[25] == 2  # colour types: indexed, RGB
    decoded = Image.open(io.BytesIO(indexed))
    assert decoded.mode == "P"
    assert np.array_equal(np.asarray(decoded.convert("RGB")), rgb.permute(1, 2, 0).numpy())
    assert len(indexed) < len(plain)
    with pytest.raises(ValueError, match="uint8 indices"):
        encode_png(PaletteImage(picture.indices.long(), HEATMAP_COLOURS))


def test_an_rgb_flow_picture_is_compressed_with_full_matching_and_decodes_the_same(tmp_path):
    # A flow picture's text and colour bar: zlib's full matching at level 1 is at least a fifth smaller than
    # run-length matching alone, and the pixels are the same.
    import zlib

    import actviz
    from actviz.output import png

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[m for _ in range(8) for m in (torch.nn.Linear(16, 16), torch.nn.Tanh())])
    viz = actviz.watch(model, tmp_path, every=1, image_every=1, layers="all",
                       options=actviz.Options(flow_pictures=True))
    for _ in range(20):
        model(torch.randn(8, 16)).square().mean().backward()
    viz.flush()
    picture = viz.latest.pictures["flow/gradient_norm"]
    viz.close()
    encoded = encode_png(picture)
    pixels = picture.permute(1, 2, 0).numpy()
    assert (np.asarray(Image.open(io.BytesIO(encoded))) == pixels).all()
    run_length = png._encode(pixels.reshape(pixels.shape[0], -1), 3, 2, 1, zlib.Z_RLE)
    assert len(encoded) <= 0.8 * len(run_length), (len(encoded), len(run_length))
