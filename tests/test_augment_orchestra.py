"""Tests of Orchestra's asymmetric pipelines ("orchestra"): bicubic RandomResizedCrop,
GaussianBlur and RandomSolarize against hand-computed values and per-sample references
(numpy loops of PIL's resampling, torch.nn.functional), and the registered Views."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from contrafl.data.augment import (
    AUGMENTATIONS,
    ColorJitter,
    GaussianBlur,
    Normalize,
    RandomGrayscale,
    RandomHorizontalFlip,
    RandomResizedCrop,
    RandomSolarize,
    ToFloat,
    Transform,
    Views,
    view_transform,
)
from test_augment import DEVICES, MEAN, STD, images


def whole_image(n: int) -> dict[str, torch.Tensor]:
    """RandomResizedCrop parameters whose first attempt is the whole (square) image."""
    ones = torch.ones(n, 10, dtype=torch.float64)
    return {"area": ones, "aspect": ones, "position": torch.zeros(n, 2, dtype=torch.float64)}


# ----------------------------------------------------------------------------- bicubic crop


def pil_cubic(t: float) -> float:
    """PIL's ``bicubic_filter`` (Resample.c, a = -0.5)."""
    a, t = -0.5, abs(t)
    if t < 1:
        return ((a + 2) * t - (a + 3)) * t * t + 1
    if t < 2:
        return (((t - 5) * t + 8) * t - 4) * a
    return 0.0


def pil_resize_1d(line: np.ndarray, size: int) -> np.ndarray:
    """PIL's ``precompute_coeffs`` + convolution along one axis, in float64 loops."""
    n = len(line)
    scale = n / size
    filterscale = max(scale, 1.0)
    support = 2.0 * filterscale
    out = np.empty(size)
    for o in range(size):
        centre = (o + 0.5) * scale
        xmin = max(int(centre - support + 0.5), 0)
        xmax = min(int(centre + support + 0.5), n)
        weights = [pil_cubic((x - centre + 0.5) / filterscale) for x in range(xmin, xmax)]
        out[o] = sum(w * line[x] for w, x in zip(weights, range(xmin, xmax))) / sum(weights)
    return out


def pil_resize(img: np.ndarray, size: int) -> np.ndarray:
    """``[C, h, w]`` -> ``[C, size, size]``: horizontal pass, then vertical (no rounding)."""
    rows = np.stack([[pil_resize_1d(r, size) for r in ch] for ch in img])  # [C, h, size]
    return np.stack([np.stack([pil_resize_1d(col, size) for col in ch.T], axis=1) for ch in rows])


def test_bicubic_whole_box_is_exactly_the_image() -> None:
    x = images(4, h=8, w=8)
    out = RandomResizedCrop(8, interpolation="bicubic").apply(x, whole_image(4))
    assert out.dtype == torch.float32
    assert torch.equal(out, x.float() / 255)
    xf = torch.rand(4, 3, 8, 8, generator=torch.Generator().manual_seed(1)) * 3 - 1  # any floats
    assert torch.equal(RandomResizedCrop(8, interpolation="bicubic").apply(xf, whole_image(4)), xf)


def test_bicubic_doubles_a_ramp_like_cubic_convolution_by_hand() -> None:
    """4 -> 8 pixels: the a = -0.5 kernel reproduces the ramp ``v(s) = s`` at the source
    position ``c - 1/2`` inside; at the border the weights of the missing pixel are dropped
    and the rest renormalised (PIL), not clamped to the edge pixel (torch's plain bicubic)."""
    ramp = torch.arange(4.0).expand(1, 1, 4, 4)  # value = column index
    out = RandomResizedCrop(8, interpolation="bicubic").apply(ramp, whole_image(1))
    row = out[0, 0, 0].double()
    torch.testing.assert_close(out[0, 0], row.float().expand(8, 8), rtol=0, atol=1e-6)  # same in every row
    # output 3: c = 1.75, weights k(-1.25), k(-0.25), k(0.75), k(1.75) of pixels 0..3
    w = [-0.0703125, 0.8671875, 0.2265625, -0.0234375]
    assert [pil_cubic(j + 0.5 - 1.75) for j in range(4)] == w and sum(w) == 1.0
    assert row[3].item() == pytest.approx(sum(v * k for v, k in zip(range(4), w)), abs=1e-6)
    torch.testing.assert_close(row[3:5], torch.tensor([1.25, 1.75], dtype=torch.float64))  # all 4 taps inside
    # output 2: c = 1.25, pixel -1 (weight k(-1.75)) is missing, the other three renormalised
    expected = (0 * 0.2265625 + 1 * 0.8671875 + 2 * -0.0703125) / (0.2265625 + 0.8671875 - 0.0703125)
    assert row[2].item() == pytest.approx(expected, abs=1e-6)
    # output 0: c = 0.25, pixel -1 is missing: (0 k(-0.25) + 1 k(0.75)) / (k(-0.25) + k(0.75))
    assert [pil_cubic(j + 0.5 - 0.25) for j in range(3)] == [0.8671875, -0.0703125, 0.0]
    assert row[0].item() == pytest.approx((1 * -0.0703125) / (0.8671875 - 0.0703125), abs=1e-6)
    assert row[0].item() == pytest.approx(-0.088235294, abs=1e-6)  # an overshoot below 0
    assert row[7].item() == pytest.approx(3 - row[0].item(), abs=1e-6)  # mirror symmetry
    ref = pil_resize(ramp[0].numpy().astype(np.float64), 8)
    np.testing.assert_allclose(out[0].numpy(), ref, rtol=0, atol=1e-6)
    # uint8 inputs are clamped to [0, 1] like PIL's 8-bit output; floats are not
    ramp8 = (ramp * 85).to(torch.uint8)  # 0, 85, 170, 255
    out8 = RandomResizedCrop(8, interpolation="bicubic").apply(ramp8, whole_image(1))
    assert out8[0, 0, 0, 0] == 0 and out8[0, 0, 0, 7] == 1
    assert out8.min() == 0 and out8.max() == 1


@pytest.mark.parametrize("shape, size", [((3, 32, 32), 32), ((2, 20, 28), 12), ((1, 9, 9), 24)])
def test_bicubic_random_boxes_match_pil_and_antialiased_interpolate(shape, size) -> None:
    """Per sample: the numpy loops of PIL's resampling, and F.interpolate(bicubic,
    antialias=True), for up- and downscaled boxes."""
    x = torch.rand(24, *shape, generator=torch.Generator().manual_seed(2))
    op = RandomResizedCrop(size, scale=(0.08, 1.0), interpolation="bicubic")
    params = op.sample(24, torch.Generator().manual_seed(3))
    out = op.apply(x, params)
    assert out.shape == (24, shape[0], size, size)
    top, left, height, width = op.boxes(shape[1], shape[2], params)
    for b in range(24):
        t, l, h, w = top[b].item(), left[b].item(), height[b].item(), width[b].item()
        crop = x[b : b + 1, :, t : t + h, l : l + w]
        ref = F.interpolate(crop, size=(size, size), mode="bicubic", align_corners=False, antialias=True)[0]
        torch.testing.assert_close(out[b], ref, rtol=0, atol=2e-6)
        if b % 4 == 0:
            ref = pil_resize(crop[0].double().numpy(), size)
            np.testing.assert_allclose(out[b].numpy(), ref, rtol=0, atol=2e-6)
    if size == 12:  # some boxes are larger than the output, some smaller
        assert (height > size).any() and (height < size).any()


def test_bilinear_stays_the_default_and_interpolation_is_checked() -> None:
    assert RandomResizedCrop(32).interpolation == "bilinear"
    x = images(8)
    params = RandomResizedCrop(32, scale=(0.5, 1.0)).sample(8, torch.Generator().manual_seed(0))
    bilinear = RandomResizedCrop(32, scale=(0.5, 1.0)).apply(x, params)
    bicubic = RandomResizedCrop(32, scale=(0.5, 1.0), interpolation="bicubic").apply(x, params)
    assert not torch.allclose(bilinear, bicubic, rtol=0, atol=1e-3)
    with pytest.raises(ValueError, match="interpolation"):
        RandomResizedCrop(32, interpolation="nearest")


# ----------------------------------------------------------------------------- gaussian blur


def gauss(sigma: float, k: int = 3) -> list[float]:
    half = (k - 1) / 2
    pdf = [math.exp(-((i - half) ** 2) / (2 * sigma**2)) for i in range(k)]
    return [p / sum(pdf) for p in pdf]


def blur_by_hand(img: torch.Tensor, sigma: float, k: int, r: int, c: int) -> list[float]:
    """One output pixel, every channel: ``sum_ij g_i g_j x[r + i - k//2, c + j - k//2]`` with
    indices mirrored without repeating the edge."""
    _, h, w = img.shape
    g, half = gauss(sigma, k), k // 2

    def mirror(i: int, n: int) -> int:
        i = abs(i)
        return 2 * (n - 1) - i if i > n - 1 else i

    return [
        sum(
            g[i] * g[j] * img[ch, mirror(r + i - half, h), mirror(c + j - half, w)].item()
            for i in range(k)
            for j in range(k)
        )
        for ch in range(img.shape[0])
    ]


def test_blur_by_hand_inside_and_at_the_reflected_border() -> None:
    x = torch.rand(2, 3, 6, 5, generator=torch.Generator().manual_seed(0))
    params = {"apply": torch.tensor([True, True]), "sigma": torch.tensor([1.0, 0.4])}
    out = GaussianBlur(3, (0.1, 2.0)).apply(x, params)
    g = gauss(1.0)
    assert g[0] == pytest.approx(math.exp(-0.5) / (1 + 2 * math.exp(-0.5)))  # 0.274068...
    # sample 0, channel 0, pixel (2, 2), written out
    inner = sum(g[i] * g[j] * x[0, 0, 1 + i, 1 + j].item() for i in range(3) for j in range(3))
    assert out[0, 0, 2, 2].item() == pytest.approx(inner, abs=1e-6)
    # corner (0, 0): row -1 is row 1, column -1 is column 1 (reflect, edge not repeated)
    x0 = x[0, 0]
    corner = sum(
        g[i] * g[j] * x0[abs(i - 1), abs(j - 1)].item() for i in range(3) for j in range(3)
    )
    assert out[0, 0, 0, 0].item() == pytest.approx(corner, abs=1e-6)
    for b, sigma in ((0, 1.0), (1, 0.4)):
        for r, c in ((0, 0), (5, 4), (0, 3), (3, 4), (2, 2)):
            expected = blur_by_hand(x[b], sigma, 3, r, c)
            torch.testing.assert_close(out[b, :, r, c], torch.tensor(expected), rtol=0, atol=1e-6)


@pytest.mark.parametrize("kernel_size", [3, 5])
def test_blur_equals_torchvision_style_conv2d(kernel_size: int) -> None:
    """torchvision's ``F.gaussian_blur``: outer product kernel, reflect pad, depthwise conv2d."""
    x = images(6, h=9, w=7)
    op = GaussianBlur(kernel_size, (0.1, 2.0), p=1.0)
    params = op.sample(6, torch.Generator().manual_seed(4))
    out = op.apply(x, params)
    half = (kernel_size - 1) * 0.5
    for b in range(6):
        u = torch.linspace(-half, half, kernel_size)
        pdf = torch.exp(-0.5 * (u / params["sigma"][b].item()).pow(2))
        k1 = pdf / pdf.sum()
        kernel = torch.mm(k1[:, None], k1[None, :]).expand(3, 1, kernel_size, kernel_size)
        pad = kernel_size // 2
        padded = F.pad(x[b : b + 1].float() / 255, (pad,) * 4, mode="reflect")
        ref = F.conv2d(padded, kernel, groups=3)[0]
        torch.testing.assert_close(out[b], ref, rtol=0, atol=1e-6)


def test_blur_probability_and_sigma_range() -> None:
    x = images(64, h=8, w=8)
    never, always = GaussianBlur(3, (0.1, 2.0), p=0.0), GaussianBlur(3, (0.1, 2.0), p=1.0)
    generator = torch.Generator().manual_seed(0)
    params = never.sample(64, generator)
    assert not params["apply"].any()
    assert torch.equal(never.apply(x, params), x.float() / 255)  # p = 0: identity
    params = always.sample(64, generator)
    assert params["apply"].all()
    blurred = always.apply(x, params)
    visible = params["sigma"] > 0.3  # below, the side weights are < 0.4 % and blur barely shows
    assert visible.sum() > 50
    assert all(not torch.allclose(blurred[b], x[b].float() / 255, atol=1e-2) for b in range(64) if visible[b])
    many = GaussianBlur(3, (0.1, 2.0), p=0.5).sample(5000, generator)
    assert many["sigma"].dtype == torch.float32
    assert many["sigma"].min() >= 0.1 and many["sigma"].max() <= 2.0
    assert many["sigma"].min() < 0.11 and many["sigma"].max() > 1.99
    assert 0.47 < many["apply"].float().mean() < 0.53
    # samples not drawn for blurring are returned unchanged, the others blurred
    mixed = {"apply": torch.tensor([True, False]), "sigma": torch.tensor([1.5, 1.5])}
    out = GaussianBlur().apply(x[:2], mixed)
    assert torch.equal(out[1], x[1].float() / 255)
    assert not torch.allclose(out[0], x[0].float() / 255, atol=1e-3)
    # a tiny sigma leaves the image as it is (side weights exp(-50) / (1 + 2 exp(-50)))
    tiny = {"apply": torch.tensor([True]), "sigma": torch.tensor([0.1])}
    torch.testing.assert_close(GaussianBlur().apply(x[:1], tiny), x[:1].float() / 255, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="odd"):
        GaussianBlur(4)


# ----------------------------------------------------------------------------- solarize


def test_solarize_exact_values() -> None:
    floats = torch.tensor([0.0, 0.25, 0.4999, 0.5, 0.75, 1.0]).view(1, 1, 1, 6)
    on, off = {"apply": torch.tensor([True])}, {"apply": torch.tensor([False])}
    op = RandomSolarize(0.5, p=0.2)
    assert op.apply(floats, on).flatten().tolist() == pytest.approx([0.0, 0.25, 0.4999, 0.5, 0.25, 0.0])
    assert torch.equal(op.apply(floats, off), floats)
    pixels = torch.tensor([0, 100, 127, 128, 200, 255], dtype=torch.uint8).view(1, 1, 1, 6)
    out = op.apply(pixels, on)
    assert out.dtype == torch.uint8  # PIL's ImageOps.solarize(img, 128): >= 128 -> 255 - x
    assert out.flatten().tolist() == [0, 100, 127, 127, 55, 0]
    assert RandomSolarize(0.25).apply(floats, on).flatten().tolist() == pytest.approx(
        [0.0, 0.75, 0.5001, 0.5, 0.25, 0.0]
    )
    batch = torch.full((3, 3, 2, 2), 0.9)
    out = op.apply(batch, {"apply": torch.tensor([True, False, True])})
    assert torch.allclose(out[[0, 2]], torch.tensor(0.1)) and torch.equal(out[1], batch[1])
    rate = op.sample(5000, torch.Generator().manual_seed(0))["apply"].float().mean()
    assert 0.18 < rate < 0.22


# ----------------------------------------------------------------------------- the pipeline


def test_orchestra_views_are_t1_t2_t1() -> None:
    views = AUGMENTATIONS.get("orchestra")(MEAN, STD)
    assert isinstance(views, Views) and len(views.transforms) == 2
    t1, t2 = views[0], views[1]
    assert views[2] is t1 and views[3] is t2 and view_transform(views, 2) is t1
    assert [type(op) for op in t1.ops] == [
        RandomResizedCrop, RandomHorizontalFlip, ColorJitter, RandomGrayscale, GaussianBlur, Normalize
    ]
    assert [type(op) for op in t2.ops] == [
        RandomResizedCrop, RandomHorizontalFlip, ColorJitter, RandomGrayscale, GaussianBlur, RandomSolarize,
        Normalize,
    ]
    for t in (t1, t2):
        crop, flip, jitter, gray, blur = t.ops[:5]
        assert (crop.size, crop.scale, crop.ratio) == (32, (0.5, 1.0), (3 / 4, 4 / 3))
        assert crop.interpolation == "bicubic"
        assert flip.p == 0.5 and gray.p == 0.2
        assert (jitter.brightness, jitter.contrast, jitter.saturation, jitter.hue) == (0.4, 0.4, 0.2, 0.1)
        assert jitter.p == 0.8
        assert (blur.kernel_size, blur.sigma) == (3, (0.1, 2.0))
        assert (t.ops[-1].mean, t.ops[-1].std) == (MEAN, STD)
    assert t1.ops[4].p == 0.5 and t2.ops[4].p == 0.1
    assert (t2.ops[5].threshold, t2.ops[5].p) == (0.5, 0.2)
    plain = AUGMENTATIONS.get("orchestra")(None, None)
    assert isinstance(plain[0].ops[-1], ToFloat) and isinstance(plain[1].ops[-1], ToFloat)
    half = AUGMENTATIONS.get("orchestra")((0.5,) * 3, (0.5,) * 3)  # normalize=half: Orchestra's own
    x = images(4)
    params = half[1].sample(4, torch.Generator().manual_seed(0))
    torch.testing.assert_close(half[1](x, params), plain[1](x, params) * 2 - 1, rtol=0, atol=1e-6)


def test_orchestra_outputs_in_range_and_solarized_only_in_t2() -> None:
    views = AUGMENTATIONS.get("orchestra")(None, None)
    x = images(256)
    for v in (0, 1):
        transform = views[v]
        params = transform.sample(256, torch.Generator().manual_seed(7))
        assert all(value.device.type == "cpu" for value in params.values())
        out = transform(x, params)
        assert out.dtype == torch.float32 and out.shape == (256, 3, 32, 32)
        # [0, 1] up to the float32 rounding of the blur kernel's sum
        assert out.min() >= -1e-6 and out.max() <= 1 + 1e-6 and 0.2 < out.mean() < 0.8
    params = views[1].sample(256, torch.Generator().manual_seed(7))
    solarized = params["5.apply"]
    assert 20 < solarized.sum() < 85
    out = views[1](x, params)
    assert (out[solarized] <= 0.5).all()  # every pixel >= 1/2 was inverted
    assert (out[~solarized] > 0.6).any()
    keep = dict(params)
    keep["5.apply"] = torch.zeros(256, dtype=torch.bool)
    before = views[1](x, keep)
    torch.testing.assert_close(out[solarized], torch.where(before >= 0.5, 1 - before, before)[solarized])


def test_orchestra_seeded_generator_reproduces() -> None:
    views = AUGMENTATIONS.get("orchestra")(MEAN, STD)
    x = images(16)
    for transform in (views[0], views[1]):
        a = transform.sample(16, torch.Generator().manual_seed(5))
        b = transform.sample(16, torch.Generator().manual_seed(5))
        c = transform.sample(16, torch.Generator().manual_seed(6))
        assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
        assert torch.equal(transform(x, a), transform(x, b))
        assert not torch.allclose(transform(x, a), transform(x, c))
    assert "5.apply" in views[1].sample(2, torch.Generator())
    assert "5.apply" not in views[0].sample(2, torch.Generator())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "op",
    [
        RandomResizedCrop(24, (0.2, 1.0), interpolation="bicubic"),
        GaussianBlur(3, (0.1, 2.0), p=0.5),
        GaussianBlur(5, (0.5, 3.0), p=1.0),
        RandomSolarize(0.5, p=0.5),
    ],
)
def test_new_ops_layout_and_device_independent(op, device: str) -> None:
    transform = Transform(op)
    x = images(12, h=16, w=16).float() / 255
    params = transform.sample(12, torch.Generator().manual_seed(9))
    flat = transform(x, params)
    per_client = {key: value.view(3, 4, *value.shape[1:]) for key, value in params.items()}
    stacked = transform(x.view(3, 4, 3, 16, 16).to(device), per_client)
    torch.testing.assert_close(stacked.cpu().flatten(0, 1), flat, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="parameters of shape"):
        op.apply(x[:5], op.sample(4, torch.Generator()))


def test_orchestra_uint8_and_float_inputs_agree_up_to_the_clamp() -> None:
    """Bicubic overshoot is clamped to [0, 1] for uint8 inputs (as PIL's 8-bit output) and
    kept for float inputs (as torch's float resampling); otherwise the same pipeline."""
    x = images(8)
    for transform in AUGMENTATIONS.get("orchestra")(None, None).transforms:
        params = transform.sample(8, torch.Generator().manual_seed(2))
        crop = transform.ops[0]
        raw = crop.apply(x, {key: params[f"0.{key}"] for key in crop.keys})
        floats = crop.apply(x.float() / 255, {key: params[f"0.{key}"] for key in crop.keys})
        assert raw.min() == 0 and raw.max() == 1 and (floats.min() < 0 or floats.max() > 1)
        torch.testing.assert_close(raw, floats.clamp(0, 1), rtol=0, atol=0)
        rest = Transform(*transform.ops[1:])
        rest_params = {f"{int(k[0]) - 1}{k[1:]}": v for k, v in params.items() if not k.startswith("0.")}
        torch.testing.assert_close(transform(x, params), rest(raw, rest_params), rtol=0, atol=0)
