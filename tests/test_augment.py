"""Tests of contrafl.data.augment against per-sample references built from torch primitives."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from contrafl.data.augment import (
    AUGMENTATIONS,
    RandomCrop,
    RandomHorizontalFlip,
    RandomRotation,
    Transform,
    eval_transform,
)
from contrafl.errors import ConfigError

MEAN = (0.4914, 0.4822, 0.4465)
STD = (0.2470, 0.2435, 0.2616)
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def images(n: int, c: int = 3, h: int = 32, w: int = 32, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (n, c, h, w), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def ref_crop(img: torch.Tensor, offset: torch.Tensor, padding: int, mode: str) -> torch.Tensor:
    """torchvision RandomCrop on one image: F.pad, then slice at the offset."""
    _, h, w = img.shape
    padded = F.pad(img[None].float(), (padding,) * 4, mode=mode)[0]
    i, j = offset.tolist()
    return padded[:, i : i + h, j : j + w]


def ref_rotate(img: torch.Tensor, degrees: float) -> torch.Tensor:
    """torchvision's tensor ``rotate`` on one image: pixel-centred grid, inverse rotation,
    ``grid_sample(mode="nearest", padding_mode="zeros", align_corners=False)``."""
    _, h, w = img.shape
    a = math.radians(degrees)
    inverse = torch.tensor([[math.cos(a), -math.sin(a), 0.0], [math.sin(a), math.cos(a), 0.0]])
    xs = torch.linspace(-w / 2 + 0.5, w / 2 - 0.5, w).expand(h, w)
    ys = torch.linspace(-h / 2 + 0.5, h / 2 - 0.5, h)[:, None].expand(h, w)
    base = torch.stack([xs, ys, torch.ones(h, w)], dim=-1).view(-1, 3)
    grid = (base @ inverse.T / torch.tensor([w / 2, h / 2])).view(1, h, w, 2)
    return F.grid_sample(img[None].float(), grid, mode="nearest", padding_mode="zeros", align_corners=False)[0]


def ref_pipeline(x: torch.Tensor, params: dict, name: str) -> torch.Tensor:
    """MOON's training transforms, one image at a time."""
    mean, std = torch.tensor(MEAN).view(3, 1, 1), torch.tensor(STD).view(3, 1, 1)
    out = []
    for b in range(x.shape[0]):
        img = ref_crop(x[b], params["0.offset"][b], 4, "reflect" if name == "cifar10" else "constant")
        if params["1.flip"][b]:
            img = img.flip(-1)
        if name == "cifar100":
            img = ref_rotate(img, float(params["2.angle"][b]))
        out.append((img / 255 - mean) / std)
    return torch.stack(out)


@pytest.mark.parametrize("mode", ["reflect", "constant"])
@pytest.mark.parametrize("shape", [(3, 32, 32), (2, 6, 9)])
def test_crop_equals_slice_of_padded_image(mode: str, shape: tuple[int, int, int]) -> None:
    x = images(24, *shape)
    op = RandomCrop(4, mode)
    params = op.sample(24, torch.Generator().manual_seed(1))
    out = op.apply(x, params)
    assert out.dtype == torch.uint8 and out.shape == x.shape
    for b in range(24):
        assert torch.equal(out[b].float(), ref_crop(x[b], params["offset"][b], 4, mode))


def test_crop_offsets_cover_zero_to_twice_padding() -> None:
    offset = RandomCrop(4).sample(9000, torch.Generator().manual_seed(0))["offset"]
    assert offset.shape == (9000, 2)
    for axis in range(2):
        counts = torch.bincount(offset[:, axis], minlength=9)
        assert len(counts) == 9 and counts.min() > 850  # uniform on {0..8}: 1000 expected each


def test_flip_mirrors_columns_of_selected_images() -> None:
    x = images(4, h=5, w=7)
    flip = torch.tensor([True, False, False, True])
    out = RandomHorizontalFlip().apply(x, {"flip": flip})
    assert torch.equal(out[0, :, :, 0], x[0, :, :, 6]) and torch.equal(out[3], x[3].flip(-1))
    assert torch.equal(out[1:3], x[1:3])
    rate = RandomHorizontalFlip(0.5).sample(4000, torch.Generator().manual_seed(0))["flip"].float().mean()
    assert 0.47 < rate < 0.53


def test_normalisation_by_hand() -> None:
    x = torch.tensor([0, 51, 255], dtype=torch.uint8).view(1, 1, 1, 3).expand(1, 2, 1, 3)
    out = eval_transform((0.5, 0.2), (0.25, 0.4))(x)
    # channel 0: (v/255 - 0.5) / 0.25 ; channel 1: (v/255 - 0.2) / 0.4
    expected = torch.tensor([[[[-2.0, -1.2, 2.0]], [[-0.5, 0.0, 2.0]]]])
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("degrees, k", [(90.0, 1), (-90.0, -1), (180.0, 2), (270.0, 3)])
def test_rotation_by_right_angles_equals_rot90(degrees: float, k: int) -> None:
    x = images(3, h=8, w=8)
    out = RandomRotation(15).apply(x, {"angle": torch.full((3,), degrees)})
    assert torch.equal(out, torch.rot90(x, k, dims=(-2, -1)))  # positive angle = counter-clockwise


def test_rotation_by_zero_is_identity_and_half_turn_of_a_rectangle() -> None:
    x = images(2, h=6, w=9)
    op = RandomRotation(15)
    assert torch.equal(op.apply(x, {"angle": torch.zeros(2)}), x)
    assert torch.equal(op.apply(x, {"angle": torch.full((2,), 180.0)}), x.flip(-1, -2))


def test_rotation_matches_torchvision_grid_and_fills_zero() -> None:
    x = images(64) | 1  # no zero pixels, so zeros in the output are fill
    op = RandomRotation(15)
    angle = op.sample(64, torch.Generator().manual_seed(3))["angle"]
    assert angle.abs().max() <= 15 and angle.min() < -10 and angle.max() > 10
    out = op.apply(x, {"angle": angle})
    ref = torch.stack([ref_rotate(x[b], float(angle[b])) for b in range(64)])
    assert torch.equal(out.float(), ref)
    corner = op.apply(x[:1], {"angle": torch.tensor([45.0])})[0, :, 0, 0]
    assert torch.equal(corner, torch.zeros(3, dtype=torch.uint8))


@pytest.mark.parametrize("name", ["cifar10", "cifar100"])
def test_batched_pipeline_equals_per_sample_reference(name: str) -> None:
    x = images(32)
    transform = AUGMENTATIONS.get(name)(MEAN, STD)
    params = transform.sample(32, torch.Generator().manual_seed(7))
    torch.testing.assert_close(transform(x, params), ref_pipeline(x, params, name), rtol=0, atol=1e-5)


def test_same_seed_same_params() -> None:
    transform = AUGMENTATIONS.get("cifar100")(MEAN, STD)
    a = transform.sample(16, torch.Generator().manual_seed(5))
    b = transform.sample(16, torch.Generator().manual_seed(5))
    c = transform.sample(16, torch.Generator().manual_seed(6))
    assert sorted(a) == ["0.offset", "1.flip", "2.angle"]
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["2.angle"], c["2.angle"])


@pytest.mark.parametrize("device", DEVICES)
def test_many_clients_at_once_equals_separate_calls(device: str) -> None:
    transform = AUGMENTATIONS.get("cifar100")(MEAN, STD)
    x = images(3 * 8).view(3, 8, 3, 32, 32)
    per_client = [transform.sample(8, torch.Generator().manual_seed(k)) for k in range(3)]
    stacked = {key: torch.stack([p[key] for p in per_client]) for key in per_client[0]}
    out = transform(x.to(device), stacked)
    assert out.device.type == device and out.shape == (3, 8, 3, 32, 32)
    for k in range(3):
        torch.testing.assert_close(out[k].cpu(), transform(x[k], per_client[k]), rtol=0, atol=1e-5)


def test_params_must_match_batch() -> None:
    transform = AUGMENTATIONS.get("cifar10")(MEAN, STD)
    x = images(6).view(2, 3, 3, 32, 32)
    with pytest.raises(ValueError, match="do not match"):
        transform(x, transform.sample(3, torch.Generator()))  # [B] params for [K, B] images
    with pytest.raises(ValueError, match="Transform.sample"):
        transform(x)


def test_unknown_pipeline_is_a_config_error() -> None:
    assert {"none", "cifar10", "cifar100", "flip"} <= set(AUGMENTATIONS.names())
    with pytest.raises(ConfigError, match="unknown augmentation 'cifar1000'.*cifar100"):
        AUGMENTATIONS.get("cifar1000")


@pytest.mark.parametrize("name", ["none", "flip", "cifar10", "cifar100"])
def test_uint8_and_float_inputs_agree(name: str) -> None:
    x = images(8)
    transform = AUGMENTATIONS.get(name)(MEAN, STD)
    params = transform.sample(8, torch.Generator().manual_seed(2))
    torch.testing.assert_close(transform(x.float() / 255, params), transform(x, params), rtol=0, atol=1e-5)


def test_tabular_features_pass_through_none() -> None:
    features = torch.randn(5, 7)
    transform = AUGMENTATIONS.get("none")(None, None)
    assert transform.sample(5, torch.Generator()) == {}
    assert torch.equal(transform(features), features)


def test_unnormalised_images_are_scaled_to_unit_interval() -> None:
    x = images(2)
    assert torch.equal(AUGMENTATIONS.get("none")(None, None)(x), x.float() / 255)
    assert isinstance(AUGMENTATIONS.get("flip")(None, None), Transform)
