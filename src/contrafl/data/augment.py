"""Batched data augmentation on tensors.

Local training gathers a batch of raw samples (``uint8 [B, C, H, W]`` images or
``float32 [B, D]`` features) and turns it into normalised, augmented float inputs with a
:class:`Transform`. A transform is a sequence of :class:`Op` s applied in order. Drawing the
random parameters (:meth:`Transform.sample`, from a per-client CPU ``torch.Generator``) is
separate from applying them (:meth:`Transform.__call__`, deterministic), so that a
sequential and a vectorised executor produce identical batches from the same generator.

Every op works on a whole batch with tensor operations on the device of the input: crops and
rotations are gathers at integer source coordinates, flips are a ``torch.where``. Geometric ops
run before :class:`ToFloat`, i.e. on ``uint8`` pixels. Inputs may carry extra leading
dimensions, ``[K, B, C, H, W]`` with parameters ``[K, B, ...]``, to augment the batches of
``K`` clients in one call.

:data:`AUGMENTATIONS` maps pipeline names (``DatasetSpec.augment``) to factories
``(mean, std) -> Transform``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import ClassVar

import torch

from ..registry import Registry

__all__ = [
    "AUGMENTATIONS",
    "Normalize",
    "Op",
    "Params",
    "RandomCrop",
    "RandomHorizontalFlip",
    "RandomRotation",
    "ToFloat",
    "Transform",
    "TransformFactory",
    "eval_transform",
]

Params = dict[str, torch.Tensor]
"""Random parameters of a transform, one row per sample (``[n, ...]`` or ``[K, n, ...]``)."""


class Op(ABC):
    """One step of a :class:`Transform`.

    ``keys`` names the random parameters the op draws in :meth:`sample`, one row per sample
    (shape ``[n, ...]``); :meth:`apply` is a deterministic function of the batch and them.
    """

    keys: ClassVar[tuple[str, ...]] = ()

    def sample(self, n: int, generator: torch.Generator) -> Params:
        """Random parameters for ``n`` samples (CPU tensors); none for deterministic ops."""
        return {}

    @abstractmethod
    def apply(self, x: torch.Tensor, params: Params) -> torch.Tensor:
        """Apply to ``x [..., C, H, W]`` (or ``[..., D]``) with parameters shaped ``[..., *]``."""


class Transform:
    """A batched transform: raw samples -> normalised float inputs.

    The parameters of op ``i`` are stored under ``"{i}.{key}"`` so that several ops of the
    same kind can share a pipeline.
    """

    def __init__(self, *ops: Op) -> None:
        self.ops = ops
        self._keys = {f"{i}.{key}" for i, op in enumerate(ops) for key in op.keys}

    def sample(self, n: int, generator: torch.Generator) -> Params:
        """Random parameters for ``n`` samples, drawn op after op from ``generator``."""
        return {
            f"{i}.{key}": value
            for i, op in enumerate(self.ops)
            for key, value in op.sample(n, generator).items()
        }

    def __call__(self, x: torch.Tensor, params: Params | None = None) -> torch.Tensor:
        """Apply to ``x [B, ...]`` or ``x [K, B, ...]`` with parameters from :meth:`sample`
        (``[B, ...]`` or ``[K, B, ...]``, moved to ``x.device`` here)."""
        params = {} if params is None else params
        if set(params) != self._keys:
            raise ValueError(
                f"{self!r} takes parameters {sorted(self._keys)}, got {sorted(params)}; "
                "draw them with Transform.sample"
            )
        own = [{key: params[f"{i}.{key}"].to(x.device) for key in op.keys} for i, op in enumerate(self.ops)]
        i = 0
        while i < len(self.ops):
            run = _geometric_run(self.ops, i)
            if len(run) > 1:  # compose the coordinate maps, then gather once
                x = _remap_composed(x, [(self.ops[j], own[j]) for j in run])
                i += len(run)
            else:
                x = self.ops[i].apply(x, own[i])
                i += 1
        return x

    def __repr__(self) -> str:
        return f"Transform({', '.join(map(repr, self.ops))})"


@dataclass(frozen=True)
class ToFloat(Op):
    """``uint8`` pixels to floats in [0, 1]: ``x / 255``; floating inputs pass unchanged."""

    def apply(self, x: torch.Tensor, params: Params) -> torch.Tensor:
        return x.to(torch.float32).div_(255) if x.dtype == torch.uint8 else x


@dataclass(frozen=True)
class Normalize(Op):
    """Per-channel standardisation of images ``[..., C, H, W]``: ``(x - mean[c]) / std[c]``.

    ``uint8`` pixels are first taken as ``x / 255``; the conversion and the
    standardisation are then one multiply-add, ``x * (1 / (255 std)) - mean / std``.
    """

    mean: tuple[float, ...]
    std: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.mean) != len(self.std) or min(self.std) <= 0:
            raise ValueError(f"mean {self.mean} and std {self.std} need one entry per channel, std > 0")

    def apply(self, x: torch.Tensor, params: Params) -> torch.Tensor:
        if x.dtype == torch.uint8:
            scale = tuple(1 / (255 * s) for s in self.std)
            x = x.to(torch.float32)
        else:
            scale = tuple(1 / s for s in self.std)
        shift = tuple(-m / s for m, s in zip(self.mean, self.std))
        return torch.addcmul(
            _channel_constant(shift, x.device, x.dtype), x, _channel_constant(scale, x.device, x.dtype)
        )


@dataclass(frozen=True)
class RandomCrop(Op):
    """Pad by ``padding`` pixels on every side, then crop back to the input size.

    Like torchvision's ``RandomCrop(size=(H, W), padding=padding)``: the top-left corner
    ``(i, j)`` of the crop in the padded image is uniform in ``{0..2p} x {0..2p}``, and
    ``out[r, c] = padded[i + r, j + c]``. ``padding_mode`` is ``"constant"`` (zeros) or
    ``"reflect"`` (mirror without repeating the edge, as ``torch.nn.functional.pad``).
    """

    padding: int
    padding_mode: str = "constant"

    keys = ("offset",)

    def __post_init__(self) -> None:
        if self.padding_mode not in ("constant", "reflect"):
            raise ValueError(f"padding_mode {self.padding_mode!r}: expected 'constant' or 'reflect'")

    def sample(self, n: int, generator: torch.Generator) -> Params:
        return {"offset": torch.randint(0, 2 * self.padding + 1, (n, 2), generator=generator)}

    def apply(self, x: torch.Tensor, params: Params) -> torch.Tensor:
        return _remap_composed(x, [(self, params)])

    def source(self, x: torch.Tensor, rows, cols, inside, params: Params):
        """Input pixel of every output pixel: ``(r + i - p, c + j - p)``, mirrored into
        the image (reflect) or marked outside (zero padding)."""
        offset = params["offset"]
        _check_per_sample(x, offset, trailing=1)
        h, w = x.shape[-2:]
        rows = rows + (offset[..., 0, None, None] - self.padding)
        cols = cols + (offset[..., 1, None, None] - self.padding)
        if self.padding_mode == "reflect":
            if self.padding >= min(h, w):
                raise ValueError(f"reflect padding {self.padding} needs images larger than {h}x{w}")
            return _reflect(rows, h), _reflect(cols, w), inside
        return rows, cols, _and(inside, (rows >= 0) & (rows < h) & (cols >= 0) & (cols < w))


@dataclass(frozen=True)
class RandomHorizontalFlip(Op):
    """Mirror each image left-right with probability ``p``: ``out[r, c] = x[r, W - 1 - c]``."""

    p: float = 0.5

    keys = ("flip",)

    def sample(self, n: int, generator: torch.Generator) -> Params:
        return {"flip": torch.rand(n, generator=generator) < self.p}

    def apply(self, x: torch.Tensor, params: Params) -> torch.Tensor:
        flip = params["flip"]
        _check_per_sample(x, flip)
        return torch.where(flip[..., None, None, None], x.flip(-1), x)

    def source(self, x: torch.Tensor, rows, cols, inside, params: Params):
        """``(r, W - 1 - c)`` for flipped images, ``(r, c)`` for the others."""
        flip = params["flip"]
        _check_per_sample(x, flip)
        w = x.shape[-1]
        return rows, torch.where(flip[..., None, None], w - 1 - cols, cols), inside


@dataclass(frozen=True)
class RandomRotation(Op):
    """Rotate each image by an angle uniform in ``[-degrees, degrees]`` about its centre.

    Matches torchvision's ``rotate`` (``RandomRotation(degrees)``, nearest interpolation,
    ``expand=False``): a positive angle turns the image counter-clockwise as displayed (row
    0 on top), so 90 degrees equals ``torch.rot90(x, 1, dims=(-2, -1))``. With pixel
    coordinates relative to the centre ``((W - 1) / 2, (H - 1) / 2)``, output pixel
    ``(x, y)`` takes the input pixel nearest to
    ``(cos a * x - sin a * y, sin a * x + cos a * y)``; pixels mapped from outside the image
    get ``fill``.
    """

    degrees: float
    fill: float = 0.0

    keys = ("angle",)

    def sample(self, n: int, generator: torch.Generator) -> Params:
        return {"angle": torch.empty(n).uniform_(-self.degrees, self.degrees, generator=generator)}

    def apply(self, x: torch.Tensor, params: Params) -> torch.Tensor:
        return _remap_composed(x, [(self, params)], fill=self.fill)

    def source(self, x: torch.Tensor, rows, cols, inside, params: Params):
        """The nearest input pixel of the rotated position (see the class docstring)."""
        angle = params["angle"]
        _check_per_sample(x, angle)
        h, w = x.shape[-2:]
        radians = torch.deg2rad(angle.to(torch.float32))[..., None, None]
        cos, sin = radians.cos(), radians.sin()
        cy, cx = (h - 1) / 2, (w - 1) / 2
        py, px = rows.to(torch.float32) - cy, cols.to(torch.float32) - cx
        src_x = (cos * px - sin * py + cx).round().long()
        src_y = (sin * px + cos * py + cy).round().long()
        return src_y, src_x, _and(inside, (src_y >= 0) & (src_y < h) & (src_x >= 0) & (src_x < w))


TransformFactory = Callable[[Sequence[float] | None, Sequence[float] | None], Transform]

AUGMENTATIONS: Registry[TransformFactory] = Registry("augmentation")


def eval_transform(mean: Sequence[float] | None, std: Sequence[float] | None) -> Transform:
    """To float, then normalise (skipped when ``mean`` is ``None``, e.g. tabular data)."""
    return _then_normalise([], mean, std)


AUGMENTATIONS.add("none", eval_transform)


@AUGMENTATIONS.register("cifar10")
def cifar10_transform(mean: Sequence[float] | None, std: Sequence[float] | None) -> Transform:
    """MOON's CIFAR-10 training transform: reflect-pad 4 + random crop 32 -> flip (p = 0.5)
    -> normalise."""
    return _then_normalise([RandomCrop(4, "reflect"), RandomHorizontalFlip(0.5)], mean, std)


@AUGMENTATIONS.register("cifar100")
def cifar100_transform(mean: Sequence[float] | None, std: Sequence[float] | None) -> Transform:
    """MOON's CIFAR-100 training transform: zero-pad 4 + random crop 32 -> flip (p = 0.5)
    -> rotation uniform in [-15, 15] degrees -> normalise."""
    ops = [RandomCrop(4, "constant"), RandomHorizontalFlip(0.5), RandomRotation(15.0)]
    return _then_normalise(ops, mean, std)


@AUGMENTATIONS.register("flip")
def flip_transform(mean: Sequence[float] | None, std: Sequence[float] | None) -> Transform:
    """Generic image default: flip (p = 0.5) -> normalise."""
    return _then_normalise([RandomHorizontalFlip(0.5)], mean, std)


def _then_normalise(
    ops: list[Op], mean: Sequence[float] | None, std: Sequence[float] | None
) -> Transform:
    """``ops`` (on raw pixels), then :class:`Normalize` (which converts ``uint8`` pixels)
    or, without ``mean``, :class:`ToFloat`."""
    if mean is None:
        return Transform(*ops, ToFloat())
    return Transform(*ops, Normalize(tuple(mean), tuple(std)))


@lru_cache(maxsize=None)
def _channel_constant(
    values: tuple[float, ...], device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    """``values`` as a ``[C, 1, 1]`` tensor, built once per device and dtype."""
    return torch.tensor(values, dtype=dtype, device=device).view(-1, 1, 1)


def _check_per_sample(x: torch.Tensor, value: torch.Tensor, trailing: int = 0) -> None:
    """Require one parameter row per image: ``value.shape[:-trailing] == x.shape[:-3]``."""
    if value.shape[: value.dim() - trailing] != x.shape[:-3]:
        raise ValueError(
            f"parameters of shape {tuple(value.shape)} do not match images of shape "
            f"{tuple(x.shape)}; draw one row per image with Transform.sample"
        )


def _reflect(index: torch.Tensor, size: int) -> torch.Tensor:
    """Mirror indices in ``[-size + 1, 2 size - 2]`` into ``[0, size - 1]`` (edge not repeated)."""
    index = index.abs()
    return torch.where(index > size - 1, 2 * (size - 1) - index, index)


def _geometric_run(ops: Sequence[Op], start: int) -> list[int]:
    """Indices of the consecutive pixel-moving ops (those with a ``source`` map and the
    same fill) starting at ``start``."""
    run = []
    fill = getattr(ops[start], "fill", 0.0)
    for j in range(start, len(ops)):
        if not hasattr(ops[j], "source") or getattr(ops[j], "fill", 0.0) != fill:
            break
        run.append(j)
    return run


def _and(inside: torch.Tensor | None, mask: torch.Tensor) -> torch.Tensor:
    return mask if inside is None else inside & mask


def _remap_composed(x: torch.Tensor, ops: list[tuple[Op, Params]], fill: float = 0.0) -> torch.Tensor:
    """Apply pixel-moving ops in order with ONE gather: map every output pixel back
    through the ops' ``source`` maps (last op first) to a pixel of ``x``, then read it,
    ``fill`` where some op's source fell outside its input."""
    h, w = x.shape[-2:]
    rows = torch.arange(h, device=x.device)[:, None]
    cols = torch.arange(w, device=x.device)[None, :]
    inside = None
    for op, params in reversed(ops):
        rows, cols, inside = op.source(x, rows, cols, inside, params)
    rows, cols = torch.broadcast_tensors(rows, cols)
    if inside is not None:
        rows, cols = rows.clamp(0, h - 1), cols.clamp(0, w - 1)
    index = (rows * w + cols).flatten(-2).unsqueeze(-2)
    out = x.flatten(-2).gather(-1, index.expand(*x.shape[:-2], h * w)).view_as(x)
    if inside is not None:
        out = out.masked_fill_(~inside.expand(rows.shape).unsqueeze(-3), fill)
    return out
