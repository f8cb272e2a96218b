"""Tests of FedU2's SimCLR/BYOL augmentation ("simclr"): RandomResizedCrop, ColorJitter and
RandomGrayscale against per-sample references (torch.nn.functional, colorsys, hand formulas)."""

from __future__ import annotations

import colorsys
import math

import pytest
import torch
import torch.nn.functional as F

from contrafl.cli import main
from contrafl.data.augment import (
    AUGMENTATIONS,
    ColorJitter,
    Normalize,
    RandomGrayscale,
    RandomHorizontalFlip,
    RandomResizedCrop,
    ToFloat,
    Transform,
    view_transform,
)
from contrafl.data.augment import _rgb_to_hsv
from test_augment import DEVICES, MEAN, STD, images

LUMA = (0.2989, 0.587, 0.114)
INTERPOLATE_ATOL = 1e-6  # float32 [0, 1] pixels; gathers + lerp vs F.interpolate's own rounding


def ref_box(op: RandomResizedCrop, h: int, w: int, params: dict[str, torch.Tensor], b: int):
    """torchvision's RandomResizedCrop.get_params with the numbers drawn for sample ``b``, in
    Python: ``(top, left, height, width)``."""
    area, aspect, position = (params[key][b].tolist() for key in ("area", "aspect", "position"))
    for a, r in zip(area, aspect):
        cw, ch = int(round(math.sqrt(a * h * w * r))), int(round(math.sqrt(a * h * w / r)))
        if 0 < cw <= w and 0 < ch <= h:
            return int(position[0] * (h - ch + 1)), int(position[1] * (w - cw + 1)), ch, cw
    if w / h < min(op.ratio):
        cw, ch = w, int(round(w / min(op.ratio)))
    elif w / h > max(op.ratio):
        ch, cw = h, int(round(h * max(op.ratio)))
    else:
        cw, ch = w, h
    return (h - ch) // 2, (w - cw) // 2, ch, cw


# ----------------------------------------------------------------------------- resized crop


@pytest.mark.parametrize(
    "shape, size, scale", [((3, 32, 32), 32, (0.2, 1.0)), ((2, 20, 28), 16, (0.08, 1.0))]
)
def test_resized_crop_equals_interpolate_of_the_slice(shape, size, scale) -> None:
    x = images(48, *shape)
    op = RandomResizedCrop(size, scale=scale)
    params = op.sample(48, torch.Generator().manual_seed(1))
    out = op.apply(x, params)
    assert out.dtype == torch.float32 and out.shape == (48, shape[0], size, size)
    top, left, height, width = op.boxes(shape[1], shape[2], params)
    assert (height < shape[1]).any() and (height > size).any() == (shape[1] > size)  # up- and downsampling
    for b in range(48):
        t, l, h, w = top[b].item(), left[b].item(), height[b].item(), width[b].item()
        crop = x[b : b + 1, :, t : t + h, l : l + w].float() / 255
        ref = F.interpolate(crop, size=(size, size), mode="bilinear", align_corners=False)[0]
        torch.testing.assert_close(out[b], ref, rtol=0, atol=INTERPOLATE_ATOL)


def test_resized_crop_of_float_input_and_full_box_is_identity() -> None:
    x = images(4, h=8, w=8).float() / 255
    op = RandomResizedCrop(8)
    ones = torch.ones(4, 10, dtype=torch.float64)
    whole = {"area": ones, "aspect": ones, "position": torch.rand(4, 2, dtype=torch.float64)}
    torch.testing.assert_close(op.apply(x, whole), x, rtol=0, atol=1e-7)


def test_crop_boxes_follow_get_params() -> None:
    op = RandomResizedCrop(32, scale=(0.2, 1.0))
    params = op.sample(4000, torch.Generator().manual_seed(0))
    assert params["area"].shape == params["aspect"].shape == (4000, 10)
    assert params["position"].shape == (4000, 2)
    top, left, height, width = op.boxes(32, 32, params)
    for b in range(0, 4000, 7):
        box = (top[b].item(), left[b].item(), height[b].item(), width[b].item())
        assert box == ref_box(op, 32, 32, params, b)
    # every box lies in the image; its area and aspect ratio are in range up to the rounding of w and h
    assert (top >= 0).all() and (left >= 0).all()
    assert (top + height <= 32).all() and (left + width <= 32).all()
    fraction = (height * width).double() / 1024
    a = 0.2 * 1024  # smallest target area; w, h each rounded by at most 1/2:
    low_area = (a - 0.5 * math.sqrt(a) * (math.sqrt(4 / 3) + math.sqrt(3 / 4)) + 0.25) / 1024
    assert low_area <= fraction.min() < 0.22 and 0.95 < fraction.max() <= 1
    aspect = width.double() / height.double()
    assert aspect.min() >= 3 / 4 * (1 - 1 / 8) and aspect.max() <= 4 / 3 * (1 + 1 / 8)
    assert aspect.min() < 0.8 and aspect.max() > 1.25
    # the corner is uniform on the free positions: both ends are reached, mean in the middle
    free = 32 - height
    small = free >= 10
    relative = top[small].double() / free[small].double()
    assert (top[small] == 0).any() and (top[small] == free[small]).any() and 0.45 < relative.mean() < 0.55
    # the first fitting attempt is taken
    drawn = op.sample(3, torch.Generator().manual_seed(3))
    drawn["area"][:, :3] = torch.tensor([1.0, 0.25, 0.5], dtype=torch.float64)
    drawn["aspect"][:, :3] = torch.tensor([2.0, 1.0, 1.0], dtype=torch.float64)  # 1st: w = 45 > 32
    assert torch.equal(op.boxes(32, 32, drawn)[2], torch.full((3,), 16))


@pytest.mark.parametrize(
    "h, w, expected",
    [(4, 64, (0, 29, 4, 5)), (64, 4, (29, 0, 5, 4)), (32, 32, (0, 0, 32, 32)), (30, 36, (0, 0, 30, 36))],
)
def test_crop_box_fallback_is_the_clamped_centre_crop(h: int, w: int, expected) -> None:
    op = RandomResizedCrop(8, scale=(0.9, 1.0))
    params = op.sample(5, torch.Generator().manual_seed(0))
    if h == w or h * 6 == w * 5:  # ratio in range: make every attempt too wide, the whole image remains
        params["area"].fill_(1.0)
        params["aspect"].fill_(2.0)
    boxes = torch.stack(op.boxes(h, w, params), dim=-1)
    assert torch.equal(boxes, torch.tensor(expected).expand(5, 4))
    assert ref_box(op, h, w, params, 0) == expected


# ----------------------------------------------------------------------------- colour ops

TINY = torch.tensor([[[0.2, 0.8]], [[0.4, 0.1]], [[0.6, 0.3]]])  # [3, 1, 2]: pixels (R, G, B)


def only(op_index: int, factor: float, n: int = 1) -> dict[str, torch.Tensor]:
    """Jitter parameters applying op ``op_index`` with ``factor`` first (others neutral)."""
    factors = torch.tensor([1.0, 1.0, 1.0, 0.0])
    factors[op_index] = factor
    order = torch.tensor([op_index] + [k for k in range(4) if k != op_index])
    apply = torch.ones(n, dtype=torch.bool)
    return {"apply": apply, "order": order.expand(n, 4), "factor": factors.expand(n, 4)}


def luma(r: float, g: float, b: float) -> float:
    return 0.2989 * r + 0.587 * g + 0.114 * b


def clamp(v: float) -> float:
    return min(1.0, max(0.0, v))


def ref_jitter(img: torch.Tensor, order: list[int], factor: list[float]) -> torch.Tensor:
    """One image, the ops in its order, in float64: hand formulas and colorsys for the hue."""
    img = img.double()
    for k in order:
        f = factor[k]
        gray = 0.2989 * img[0] + 0.587 * img[1] + 0.114 * img[2]
        if k == 0:
            img = (f * img).clamp(0, 1)
        elif k == 1:
            img = (f * img + (1 - f) * gray.mean()).clamp(0, 1)
        elif k == 2:
            img = (f * img + (1 - f) * gray).clamp(0, 1)
        else:
            out = torch.empty_like(img)
            for i in range(img.shape[1]):
                for j in range(img.shape[2]):
                    h, s, v = colorsys.rgb_to_hsv(*img[:, i, j].tolist())
                    out[:, i, j] = torch.tensor(colorsys.hsv_to_rgb((h + f) % 1.0, s, v))
            img = out
    return img.float()


@pytest.mark.parametrize("factor", [0.3, 1.5])
def test_brightness_contrast_saturation_by_hand(factor: float) -> None:
    pixels = [tuple(TINY[:, 0, j].tolist()) for j in range(2)]
    grays = [luma(*p) for p in pixels]
    mean = sum(grays) / 2
    expected = {
        0: [[clamp(factor * v) for v in p] for p in pixels],
        1: [[clamp(factor * v + (1 - factor) * mean) for v in p] for p in pixels],
        2: [[clamp(factor * v + (1 - factor) * g) for v in p] for p, g in zip(pixels, grays)],
    }
    for k, values in expected.items():
        op = ColorJitter(**{("brightness", "contrast", "saturation")[k]: 0.8})  # the others are skipped
        out = op.apply(TINY[None], only(k, factor))[0]
        ref = torch.tensor(values).T[:, None, :]  # [3, 1, 2]
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-6)
    assert ColorJitter(brightness=0.8).apply(TINY[None], only(0, 1.5))[0, 0, 0, 1] == 1.0  # 1.2 clamped


def test_rgb_hsv_round_trip_and_known_hues() -> None:
    x = torch.rand(4, 3, 5, 5, generator=torch.Generator().manual_seed(0))
    x[0, :, 0, 0], x[0, :, 0, 1] = 0.5, 0.0  # a gray and a black pixel: S = H = 0
    op = ColorJitter(hue=0.5)
    torch.testing.assert_close(op.apply(x, only(3, 0.0, 4)), x, rtol=0, atol=2e-6)  # float32
    hsv = torch.cat(_rgb_to_hsv(x), dim=-3).permute(0, 2, 3, 1).reshape(-1, 3)
    pixels = x.permute(0, 2, 3, 1).reshape(-1, 3).tolist()
    ref = torch.tensor([colorsys.rgb_to_hsv(*pixel) for pixel in pixels])
    torch.testing.assert_close(hsv, ref, rtol=0, atol=1e-6)
    orange = torch.tensor([1.0, 0.5, 0.0]).view(1, 3, 1, 1)
    torch.testing.assert_close(torch.cat(_rgb_to_hsv(orange)).flatten(), torch.tensor([1 / 12, 1.0, 1.0]))
    red = torch.tensor([1.0, 0.0, 0.0]).view(1, 3, 1, 1).expand(3, 3, 1, 1)
    params = only(3, 0.0, 3)
    params["factor"] = torch.tensor([[1.0, 1.0, 1.0, 1 / 3], [1.0, 1.0, 1.0, -1 / 3], [1.0, 1.0, 1.0, 1 / 6]])
    shifted = op.apply(red, params)
    expected = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 1.0, 0.0]]).view(3, 3, 1, 1)
    torch.testing.assert_close(shifted, expected, rtol=0, atol=1e-5)  # green, blue, yellow


@pytest.mark.parametrize("shift", [0.5, -0.5, 0.45, -0.3, 0.1])
def test_hue_shift_wraps_around_like_colorsys(shift: float) -> None:
    x = torch.rand(3, 3, 4, 4, generator=torch.Generator().manual_seed(1))
    params = only(3, shift, 3)
    out = ColorJitter(hue=0.5).apply(x, params)
    for b in range(3):
        torch.testing.assert_close(out[b], ref_jitter(x[b], [3], [1.0, 1.0, 1.0, shift]), rtol=0, atol=1e-5)


def test_grayscale_weights_and_rate() -> None:
    primaries = torch.eye(3).view(3, 3, 1, 1)  # pure red, green, blue
    op = RandomGrayscale(0.2)
    out = op.apply(primaries, {"gray": torch.tensor([True, True, False])})
    torch.testing.assert_close(out[:2], torch.tensor(LUMA[:2]).view(2, 1, 1, 1).expand(2, 3, 1, 1))
    assert torch.equal(out[2], primaries[2])
    white = torch.full((1, 3, 2, 2), 255, dtype=torch.uint8)
    out = op.apply(white, {"gray": torch.tensor([True])})
    torch.testing.assert_close(out, torch.full((1, 3, 2, 2), sum(LUMA)))
    rate = op.sample(5000, torch.Generator().manual_seed(0))["gray"].float().mean()
    assert 0.18 < rate < 0.22


def test_each_sample_gets_each_op_once_in_its_own_order() -> None:
    op = ColorJitter(0.8, 0.8, 0.8, 0.2, p=0.8)
    x = images(64, h=4, w=4)
    params = op.sample(64, torch.Generator().manual_seed(4))
    order, factor, apply = params["order"], params["factor"], params["apply"]
    assert torch.equal(order.sort(-1).values, torch.arange(4).expand(64, 4))  # permutations
    assert len({tuple(row) for row in order.tolist()}) >= 18  # ~22 of the 24 expected in 64 draws
    many = op.sample(5000, torch.Generator().manual_seed(0))
    low, high = torch.tensor([0.2, 0.2, 0.2, -0.2]), torch.tensor([1.8, 1.8, 1.8, 0.2])
    assert ((many["factor"] >= low) & (many["factor"] <= high)).all()
    assert (many["factor"].amin(0) < low + 0.01).all() and (many["factor"].amax(0) > high - 0.01).all()
    assert 0.78 < many["apply"].float().mean() < 0.82
    out = op.apply(x, params)
    for b in range(64):
        ref = ref_jitter(x[b].float() / 255, order[b].tolist() if apply[b] else [], factor[b].tolist())
        torch.testing.assert_close(out[b], ref, rtol=0, atol=1e-5)
    fixed = dict(params, order=torch.arange(4).expand(64, 4))
    assert not torch.allclose(op.apply(x, fixed), out, rtol=0, atol=1e-3)  # the order matters


def test_colour_ops_need_rgb_and_valid_arguments() -> None:
    with pytest.raises(ValueError, match="RGB"):
        RandomGrayscale(1.0).apply(images(2, c=1), {"gray": torch.ones(2, dtype=torch.bool)})
    with pytest.raises(ValueError, match="hue"):
        ColorJitter(hue=0.6)
    with pytest.raises(ValueError, match="scale"):
        RandomResizedCrop(32, scale=(0.5, 0.2))


# ----------------------------------------------------------------------------- the pipeline


def test_simclr_pipeline_is_registered_and_listed(capsys) -> None:
    assert AUGMENTATIONS.canonical("SimCLR") == "simclr"
    assert main(["list", "augmentations"]) == 0
    assert "simclr" in capsys.readouterr().out.split()


def test_simclr_factory_with_and_without_normalisation() -> None:
    plain, normalised = AUGMENTATIONS.get("simclr")(None, None), AUGMENTATIONS.get("simclr")(MEAN, STD)
    assert [type(op) for op in plain.ops] == [
        RandomResizedCrop, ColorJitter, RandomGrayscale, RandomHorizontalFlip, ToFloat
    ]
    assert isinstance(normalised.ops[-1], Normalize)
    crop, jitter = plain.ops[0], plain.ops[1]
    assert (crop.size, crop.scale, crop.ratio) == (32, (0.2, 1.0), (3 / 4, 4 / 3))
    assert (jitter.brightness, jitter.contrast, jitter.saturation, jitter.hue) == (0.8, 0.8, 0.8, 0.2)
    assert jitter.p == 0.8 and plain.ops[2].p == 0.2 and plain.ops[3].p == 0.5
    x = images(256, h=40, w=40)
    params = plain.sample(256, torch.Generator().manual_seed(8))
    out = plain(x, params)
    assert out.dtype == torch.float32 and out.shape == (256, 3, 32, 32)
    assert out.min() == 0 and out.max() == 1 and 0.2 < out.mean() < 0.8  # [0, 1], not normalised
    mean, std = torch.tensor(MEAN).view(3, 1, 1), torch.tensor(STD).view(3, 1, 1)
    torch.testing.assert_close(normalised(x, params), (out - mean) / std, rtol=0, atol=1e-5)
    gray = params["2.gray"]
    assert torch.equal(out[gray][:, 0], out[gray][:, 2])
    assert not torch.equal(out[~gray][:, 0], out[~gray][:, 2])


def test_simclr_seeded_generator_reproduces() -> None:
    transform = AUGMENTATIONS.get("simclr")(MEAN, STD)
    a = transform.sample(16, torch.Generator().manual_seed(5))
    b = transform.sample(16, torch.Generator().manual_seed(5))
    c = transform.sample(16, torch.Generator().manual_seed(6))
    keys = ["0.area", "0.aspect", "0.position", "1.apply", "1.factor", "1.order", "2.gray", "3.flip"]
    assert sorted(a) == keys
    assert all(torch.equal(a[k], b[k]) for k in a) and not torch.equal(a["1.factor"], c["1.factor"])
    x = images(16)
    assert torch.equal(transform(x, a), transform(x, b))
    assert not torch.allclose(transform(x, a), transform(x, c))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name, view", [("simclr", 0), ("orchestra", 0), ("orchestra", 1)])
def test_many_clients_at_once_equals_separate_calls(device: str, name: str, view: int) -> None:
    transform = view_transform(AUGMENTATIONS.get(name)(MEAN, STD), view)
    x = images(3 * 8).view(3, 8, 3, 32, 32)
    per_client = [transform.sample(8, torch.Generator().manual_seed(k)) for k in range(3)]
    stacked = {key: torch.stack([p[key] for p in per_client]) for key in per_client[0]}
    out = transform(x.to(device), stacked)
    assert out.device.type == device and out.shape == (3, 8, 3, 32, 32)
    for k in range(3):
        torch.testing.assert_close(out[k].cpu(), transform(x[k], per_client[k]), rtol=0, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "op", [RandomResizedCrop(24, (0.2, 1.0)), ColorJitter(0.8, 0.8, 0.8, 0.2, 0.8), RandomGrayscale(0.5)]
)
def test_new_ops_layout_and_device_independent(op, device: str) -> None:
    transform = Transform(op)
    x = images(12, h=16, w=16).float() / 255
    params = transform.sample(12, torch.Generator().manual_seed(9))
    flat = transform(x, params)
    per_client = {key: value.view(3, 4, *value.shape[1:]) for key, value in params.items()}
    stacked = transform(x.view(3, 4, 3, 16, 16).to(device), per_client)
    torch.testing.assert_close(stacked.cpu().flatten(0, 1), flat, rtol=0, atol=1e-5)


def test_simclr_uint8_and_float_inputs_agree() -> None:
    x = images(8)
    transform = AUGMENTATIONS.get("simclr")(MEAN, STD)
    params = transform.sample(8, torch.Generator().manual_seed(2))
    torch.testing.assert_close(transform(x.float() / 255, params), transform(x, params), rtol=0, atol=1e-5)


@pytest.mark.parametrize("k", range(4))
def test_colour_jitter_masked_equals_selected(k):
    """The GPU form of ColorJitter (every image adjusted, the result kept where the op
    applies: no host sync, so a step can be captured as a CUDA graph) equals the CPU form
    (only the selected images adjusted), black and constant images included."""
    from contrafl.data.augment import _jitter_masked, _jitter_selected

    g = torch.Generator().manual_seed(k)
    x = torch.rand(12, 3, 5, 5, generator=g)
    x[0] = 0.0  # black: hue's S = (max - min) / max divides by zero
    x[1] = 0.5  # grey: contrast's blend with its own mean
    where = torch.tensor([True, True, False, True] * 3)
    factor = torch.rand(12, generator=g) * 1.6 + (0.2 if k < 3 else -1.0)
    selected = _jitter_selected(x.clone(), where, factor, k)
    masked = _jitter_masked(x.clone(), where, factor, k)
    assert torch.equal(masked[~where], x[~where])
    torch.testing.assert_close(masked, selected, rtol=0, atol=1e-6)
    assert torch.isfinite(masked).all()
