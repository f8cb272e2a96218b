"""Batched data augmentation on tensors.

Local training gathers a batch of raw samples (``uint8 [B, C, H, W]`` images or
``float32 [B, D]`` features) and turns it into normalised, augmented float inputs with a
:class:`Transform`. A transform is a sequence of :class:`Op` s applied in order. Drawing the
random parameters (:meth:`Transform.sample`, from a per-client CPU ``torch.Generator``) is
separate from applying them (:meth:`Transform.__call__`, deterministic), so that a
sequential and a vectorised executor produce identical batches from the same generator.

Every op works on a whole batch with tensor operations on the device of the input: crops and
rotations are gathers at integer source coordinates, flips are a ``torch.where``. Geometric ops
run before :class:`ToFloat`, i.e. on ``uint8`` pixels. :class:`RandomResizedCrop`
interpolates and therefore returns floats in [0, 1]; the colour ops after it
(:class:`ColorJitter`, :class:`RandomGrayscale`, :class:`GaussianBlur`,
:class:`RandomSolarize`) work on such floats. Inputs may carry extra
leading dimensions, ``[K, B, C, H, W]`` with parameters ``[K, B, ...]``, to augment the batches
of ``K`` clients in one call.

:data:`AUGMENTATIONS` maps pipeline names (``DatasetSpec.augment``, or the config setting
``augment=NAME``, e.g. ``augment=simclr``) to factories ``(mean, std) -> Transform``, or
``-> Views`` for pipelines that differ per view (``augment=orchestra``);
``contrafl list augmentations`` prints the registered names.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import ClassVar

import torch

from ..registry import Registry

__all__ = [
    "AUGMENTATIONS",
    "ColorJitter",
    "FeatureCorruption",
    "GaussianBlur",
    "Normalize",
    "Op",
    "Params",
    "RandomCrop",
    "RandomGrayscale",
    "RandomHorizontalFlip",
    "RandomResizedCrop",
    "RandomRotation",
    "RandomSolarize",
    "ToFloat",
    "Transform",
    "TransformFactory",
    "Views",
    "eval_transform",
    "view_transform",
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

    def input_problem(self, shape: tuple[int, ...]) -> str | None:
        """Why the op cannot take samples of ``shape`` and give samples of the same shape
        (a phrase naming the op), or None. By default the op works on images ``[C, H, W]``."""
        return None if len(shape) == 3 else f"{type(self).__name__} works on images [C, H, W]"

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

    def input_problem(self, shape: tuple[int, ...]) -> str | None:
        """Why the transform cannot augment samples of ``shape`` (without the batch
        dimension) into inputs of the same shape, or None (:meth:`Op.input_problem`)."""
        return next((why for op in self.ops if (why := op.input_problem(shape)) is not None), None)

    def __repr__(self) -> str:
        return f"Transform({', '.join(map(repr, self.ops))})"


class Views:
    """Per-view training pipelines: view ``v`` of a sample goes through
    ``transforms[v % len(transforms)]`` (Orchestra's asymmetric ``T1``/``T2``: views 0 and
    2 through ``T1``, view 1 through ``T2``). A single :class:`Transform` is the case of
    one pipeline for every view."""

    def __init__(self, *transforms: Transform) -> None:
        if not transforms:
            raise ValueError("Views needs at least one Transform")
        self.transforms = transforms

    def __getitem__(self, view: int) -> Transform:
        return self.transforms[view % len(self.transforms)]

    def input_problem(self, shape: tuple[int, ...]) -> str | None:
        """The first problem of the views' pipelines (:meth:`Transform.input_problem`), or None."""
        return next((why for t in self.transforms if (why := t.input_problem(shape)) is not None), None)

    def __repr__(self) -> str:
        return f"Views({', '.join(map(repr, self.transforms))})"


def view_transform(pipeline: Transform | Views, view: int) -> Transform:
    """The transform of view ``view`` (0-based) of a training pipeline."""
    return pipeline[view] if isinstance(pipeline, Views) else pipeline


@dataclass(frozen=True)
class ToFloat(Op):
    """``uint8`` pixels to floats in [0, 1]: ``x / 255``; floating inputs pass unchanged."""

    def input_problem(self, shape: tuple[int, ...]) -> str | None:
        return None

    def apply(self, x: torch.Tensor, params: Params) -> torch.Tensor:
        return _unit_float(x)


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

    def input_problem(self, shape: tuple[int, ...]) -> str | None:
        if len(shape) != 3 or shape[0] != len(self.mean):
            return f"Normalize has {len(self.mean)} channel means for images [{len(self.mean)}, H, W]"
        return None

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


@dataclass(frozen=True)
class RandomResizedCrop(Op):
    """Crop a random box of random area and aspect ratio, resized to ``size x size``.

    Like torchvision's ``RandomResizedCrop(size, scale, ratio, interpolation)``. The box of an
    ``H x W`` image follows ``RandomResizedCrop.get_params``: of 10 attempts with area
    ``a ~ U(scale) * H W`` and aspect ratio ``r = exp(U(log ratio))``, the first whose
    ``w = round(sqrt(a r))``, ``h = round(sqrt(a / r))`` satisfy ``0 < w <= W`` and
    ``0 < h <= H`` is taken, with top-left corner uniform in ``{0..H-h} x {0..W-w}``; if none
    fits, the centre crop of the whole image with its aspect ratio clamped to ``ratio``. The
    attempts are drawn for every sample at once. The box is resampled like torchvision's
    tensor ``resize(crop, size, antialias=False)``, i.e. ``F.interpolate(crop, size,
    mode="bilinear", align_corners=False)``: along each axis, output ``o`` reads the crop at
    ``s = max(0, (o + 0.5) h / size - 0.5)``, linearly between pixels ``floor(s)`` and
    ``min(floor(s) + 1, h - 1)`` (``interpolation="bilinear"``, the default).

    ``interpolation="bicubic"`` matches torchvision's ``InterpolationMode.BICUBIC`` on PIL
    images, i.e. PIL's ``Image.resize(..., BICUBIC)`` (``libImaging/Resample.c``), which is
    also what ``F.interpolate(crop, size, mode="bicubic", antialias=True)`` computes (the
    ``antialias`` path of torch uses PIL's filter; torch's plain ``bicubic`` uses
    ``a = -0.75`` and clamped indices instead): the Keys cubic ``k(t) = (a + 2)|t|^3 -
    (a + 3)|t|^2 + 1`` for ``|t| < 1``, ``a (|t|^3 - 5|t|^2 + 8|t| - 4)`` for
    ``1 <= |t| < 2`` with ``a = -0.5``, widened by ``f = max(1, h / size)`` when
    downscaling (antialias). Along each axis, output ``o`` is centred at
    ``c = (o + 0.5) h / size`` and takes crop pixel ``j`` (``0 <= j < h``; pixels outside
    the crop get no weight) with weight ``k((j + 0.5 - c) / f)``, normalised to sum 1 over
    ``j``. Unlike PIL on 8-bit images, the horizontal pass, the vertical pass and the
    output are neither rounded to integers nor clipped between the passes (on smooth images
    the two agree to about one grey level); outputs of ``uint8`` inputs are clamped to
    [0, 1] as PIL's are (cubic weights overshoot), float inputs are not. The weights form
    dense per-sample ``size x H`` and ``size x W`` matrices, applied as two batched float32
    matrix products (on CUDA these use TF32 only if TF32 matmuls are switched on).

    ``uint8`` pixels are first taken as ``x / 255``, so the output is float in [0, 1].

    The random draws do not depend on the image size (``area`` is the fraction of the image,
    ``position`` is ``U[0, 1)`` scaled to the free range in :meth:`boxes`); they are float64,
    so that the integer boxes are the same on every device.
    """

    size: int
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    interpolation: str = "bilinear"

    keys = ("area", "aspect", "position")
    attempts: ClassVar[int] = 10

    def __post_init__(self) -> None:
        (s0, s1), (r0, r1) = self.scale, self.ratio
        if self.size < 1 or not 0 <= s0 <= s1 or not 0 < r0 <= r1:
            raise ValueError(
                f"RandomResizedCrop needs size >= 1, 0 <= scale[0] <= scale[1] and "
                f"0 < ratio[0] <= ratio[1]; got size {self.size}, scale {self.scale}, ratio {self.ratio}"
            )
        if self.interpolation not in ("bilinear", "bicubic"):
            raise ValueError(f"interpolation {self.interpolation!r}: expected 'bilinear' or 'bicubic'")

    def input_problem(self, shape: tuple[int, ...]) -> str | None:
        if len(shape) != 3 or shape[1:] != (self.size, self.size):
            return f"RandomResizedCrop resizes images [C, H, W] to {self.size} x {self.size}"
        return None

    def sample(self, n: int, generator: torch.Generator) -> Params:
        shape = (n, self.attempts)
        area = torch.empty(shape, dtype=torch.float64).uniform_(*self.scale, generator=generator)
        log_ratio = (math.log(self.ratio[0]), math.log(self.ratio[1]))
        aspect = torch.empty(shape, dtype=torch.float64).uniform_(*log_ratio, generator=generator).exp_()
        position = torch.rand(n, 2, dtype=torch.float64, generator=generator)
        return {"area": area, "aspect": aspect, "position": position}

    def boxes(self, h: int, w: int, params: Params) -> tuple[torch.Tensor, ...]:
        """``(top, left, height, width)`` of every sample's crop box in an ``h x w`` image
        (int64, shaped like the leading dimensions of the parameters)."""
        area, aspect, position = params["area"] * (h * w), params["aspect"], params["position"]
        widths, heights = (area * aspect).sqrt_().round_(), (area / aspect).sqrt_().round_()
        fits = (widths >= 1) & (widths <= w) & (heights >= 1) & (heights <= h)
        first = fits.to(torch.uint8).argmax(-1, keepdim=True)  # first fitting attempt
        found = fits.any(-1)
        if w / h < self.ratio[0]:  # fallback: centre crop, aspect ratio clamped
            fallback = (round(w / self.ratio[0]), w)
        elif w / h > self.ratio[1]:
            fallback = (h, round(h * self.ratio[1]))
        else:
            fallback = (h, w)
        height = torch.where(found, heights.gather(-1, first).squeeze(-1), fallback[0])
        width = torch.where(found, widths.gather(-1, first).squeeze(-1), fallback[1])
        free_h, free_w = h - height, w - width  # the fallback is centred
        top = torch.where(found, (position[..., 0] * (free_h + 1)).floor_(), (free_h / 2).floor_())
        left = torch.where(found, (position[..., 1] * (free_w + 1)).floor_(), (free_w / 2).floor_())
        return top.long(), left.long(), height.long(), width.long()

    def apply(self, x: torch.Tensor, params: Params) -> torch.Tensor:
        _check_per_sample(x, params["area"], trailing=1)
        raw = x.dtype == torch.uint8
        x = _unit_float(x)
        *lead, c, h, w = x.shape
        top, left, height, width = (t.reshape(-1) for t in self.boxes(h, w, params))
        flat, s = x.reshape(-1, c, h, w), self.size
        n = flat.shape[0]
        if self.interpolation == "bicubic":  # out = R x C^T with R, C [n, s, h | w]
            rows = _cubic_weights(top, height, s, h, x.dtype)[:, None]
            cols = _cubic_weights(left, width, s, w, x.dtype)[:, None]
            out = rows @ flat @ cols.transpose(-1, -2)
            out = out.clamp_(0, 1) if raw else out
            return out.view(*lead, c, s, s)
        row0, row1, row_weight = _linear_taps(top, height, s, x.dtype)
        col0, col1, col_weight = _linear_taps(left, width, s, x.dtype)
        rows = [flat.gather(-2, r[:, None, :, None].expand(n, c, s, w)) for r in (row0, row1)]
        mid = torch.lerp(*rows, row_weight[:, None, :, None])
        cols = [mid.gather(-1, r[:, None, None, :].expand(n, c, s, s)) for r in (col0, col1)]
        return torch.lerp(*cols, col_weight[:, None, None, :]).view(*lead, c, s, s)


@dataclass(frozen=True)
class ColorJitter(Op):
    """With probability ``p``, jitter brightness, contrast, saturation and hue in a random
    order (torchvision's ``RandomApply([ColorJitter(...)], p)`` on float tensors).

    Factors are uniform in ``[max(0, 1 - b), 1 + b]`` (likewise contrast ``c`` and saturation
    ``s``) and the hue shift in ``[-hue, hue]``; an op whose argument is 0 is skipped. With
    ``blend(x, y, f) = clamp(f x + (1 - f) y, 0, 1)`` and ``gray`` the luma
    ``0.2989 R + 0.587 G + 0.114 B``:

    - brightness: ``blend(x, 0, f)``;
    - contrast: ``blend(x, mean(gray(x)), f)``, the mean over the whole image;
    - saturation: ``blend(x, gray(x), f)``;
    - hue: RGB -> HSV (torchvision's ``_rgb2hsv``), ``H <- (H + f) mod 1``, HSV -> RGB.

    torchvision draws the order with ``torch.randperm(4)`` per call; here every sample has its
    own permutation, and in slot ``t`` each op is applied to the samples whose permutation puts
    it there, so each sample gets each op exactly once, in its own order. RGB images only;
    ``uint8`` pixels are first taken as ``x / 255``.

    On the CPU each op runs on the samples it applies to only; elsewhere it runs on every
    sample and its result is kept where it applies, which costs more arithmetic but waits
    for nothing (selecting the samples needs their number on the host), so that a training
    step with this op can be captured as a CUDA graph.
    """

    brightness: float = 0.0
    contrast: float = 0.0
    saturation: float = 0.0
    hue: float = 0.0
    p: float = 1.0

    keys = ("apply", "order", "factor")

    def __post_init__(self) -> None:
        if min(self.brightness, self.contrast, self.saturation) < 0 or not 0 <= self.hue <= 0.5:
            raise ValueError(
                f"ColorJitter needs brightness, contrast, saturation >= 0 and 0 <= hue <= 0.5; got "
                f"{self.brightness}, {self.contrast}, {self.saturation}, {self.hue}"
            )
        if not 0 <= self.p <= 1:
            raise ValueError(f"ColorJitter probability p = {self.p} outside [0, 1]")

    def input_problem(self, shape: tuple[int, ...]) -> str | None:
        return None if len(shape) == 3 and shape[0] == 3 else f"{type(self).__name__} works on RGB images [3, H, W]"

    def sample(self, n: int, generator: torch.Generator) -> Params:
        """``apply [n]`` (bool), ``order [n, 4]`` (a permutation of brightness, contrast,
        saturation, hue = 0..3) and ``factor [n, 4]`` (in that op order), drawn in that order."""
        apply = torch.rand(n, generator=generator) < self.p
        order = torch.rand(n, 4, generator=generator).argsort(dim=-1)
        b, c, s, h = self.brightness, self.contrast, self.saturation, self.hue
        low = torch.tensor([max(0.0, 1 - b), max(0.0, 1 - c), max(0.0, 1 - s), -h])
        high = torch.tensor([1 + b, 1 + c, 1 + s, h])
        factor = low + (high - low) * torch.rand(n, 4, generator=generator)
        return {"apply": apply, "order": order, "factor": factor}

    def apply(self, x: torch.Tensor, params: Params) -> torch.Tensor:
        _check_per_sample(x, params["apply"])
        x = _unit_float(x)
        _check_rgb(x)
        out = x.reshape(-1, *x.shape[-3:]).clone()
        apply = params["apply"].reshape(-1)
        order, factor = params["order"].reshape(-1, 4), params["factor"].reshape(-1, 4)
        active = (self.brightness > 0, self.contrast > 0, self.saturation > 0, self.hue > 0)
        jitter = _jitter_selected if x.device.type == "cpu" else _jitter_masked
        for slot in range(4):
            for k in range(4):
                if active[k]:
                    out = jitter(out, apply & (order[:, slot] == k), factor[:, k], k)
        return out.view_as(x)


@dataclass(frozen=True)
class RandomGrayscale(Op):
    """Replace each RGB image by its luma ``0.2989 R + 0.587 G + 0.114 B`` in all three
    channels with probability ``p`` (torchvision's ``RandomGrayscale``); ``uint8`` pixels are
    first taken as ``x / 255``."""

    p: float = 0.1

    keys = ("gray",)

    def input_problem(self, shape: tuple[int, ...]) -> str | None:
        return None if len(shape) == 3 and shape[0] == 3 else f"{type(self).__name__} works on RGB images [3, H, W]"

    def sample(self, n: int, generator: torch.Generator) -> Params:
        return {"gray": torch.rand(n, generator=generator) < self.p}

    def apply(self, x: torch.Tensor, params: Params) -> torch.Tensor:
        gray = params["gray"]
        _check_per_sample(x, gray)
        x = _unit_float(x)
        _check_rgb(x)
        return torch.where(gray[..., None, None, None], _grayscale(x).expand_as(x), x)


@dataclass(frozen=True)
class GaussianBlur(Op):
    """With probability ``p``, blur each image with a ``kernel_size x kernel_size`` Gaussian
    of standard deviation ``sigma ~ U(sigma)`` (torchvision's ``RandomApply([GaussianBlur(
    kernel_size, sigma)], p)``, whose ``F.gaussian_blur`` builds the kernel and pads the same
    way on tensors and, via a tensor, on PIL images).

    The kernel is separable: ``g = exp(-u^2 / (2 sigma^2))`` normalised to sum 1 over
    ``u = -(k - 1) / 2 .. (k - 1) / 2`` (torchvision's ``_get_gaussian_kernel1d``), and
    ``out[r, c] = sum_ij g[i] g[j] x[r + i - k // 2, c + j - k // 2]`` with the image
    mirrored at its border without repeating the edge (``F.pad(..., mode="reflect")``).
    Every sample has its own ``sigma``; the blur is the same filter in both directions.
    ``uint8`` pixels are first taken as ``x / 255``; unlike torchvision on ``uint8``/PIL
    images, the result is not rounded back to integers.
    """

    kernel_size: int = 3
    sigma: tuple[float, float] = (0.1, 2.0)
    p: float = 0.5

    keys = ("apply", "sigma")

    def __post_init__(self) -> None:
        if self.kernel_size < 1 or self.kernel_size % 2 == 0:
            raise ValueError(f"GaussianBlur kernel_size {self.kernel_size}: expected an odd positive integer")
        if not 0 < self.sigma[0] <= self.sigma[1]:
            raise ValueError(f"GaussianBlur sigma {self.sigma}: expected 0 < sigma[0] <= sigma[1]")
        if not 0 <= self.p <= 1:
            raise ValueError(f"GaussianBlur probability p = {self.p} outside [0, 1]")

    def sample(self, n: int, generator: torch.Generator) -> Params:
        """``apply [n]`` (bool) and ``sigma [n]`` (float32), drawn in that order."""
        apply = torch.rand(n, generator=generator) < self.p
        sigma = torch.empty(n).uniform_(*self.sigma, generator=generator)
        return {"apply": apply, "sigma": sigma}

    def kernel(self, sigma: torch.Tensor) -> torch.Tensor:
        """The 1-D kernels ``[..., kernel_size]`` of the standard deviations ``sigma [...]``."""
        half = (self.kernel_size - 1) * 0.5
        u = torch.linspace(-half, half, self.kernel_size, device=sigma.device)
        pdf = torch.exp(-0.5 * (u / sigma[..., None]).pow(2))
        return pdf / pdf.sum(-1, keepdim=True)

    def apply(self, x: torch.Tensor, params: Params) -> torch.Tensor:
        apply = params["apply"]
        _check_per_sample(x, apply)
        x = _unit_float(x)
        *lead, c, h, w = x.shape
        k, pad = self.kernel_size, self.kernel_size // 2
        if pad >= min(h, w):
            raise ValueError(f"GaussianBlur kernel_size {k} needs images larger than {h}x{w}")
        flat = x.reshape(-1, c, h, w)
        g = self.kernel(params["sigma"].reshape(-1)).to(x.dtype)[:, None, None, None, :]  # [N, 1, 1, 1, k]
        padded = torch.nn.functional.pad(flat, (pad, pad, pad, pad), mode="reflect")
        rows = padded[..., :h, :] * g[..., 0]  # vertical pass: [N, C, H, W + 2 pad]
        for i in range(1, k):
            rows.addcmul_(padded[..., i : i + h, :], g[..., i])
        out = rows[..., :w] * g[..., 0]  # horizontal pass
        for j in range(1, k):
            out.addcmul_(rows[..., j : j + w], g[..., j])
        return torch.where(apply.reshape(-1)[:, None, None, None], out, flat).view_as(x)


@dataclass(frozen=True)
class RandomSolarize(Op):
    """With probability ``p``, invert every pixel at or above ``threshold``: ``x -> 1 - x``
    for floats in [0, 1], ``x -> 255 - x`` for ``uint8`` pixels (which stay ``uint8``),
    as torchvision's ``RandomSolarize`` / ``F.solarize``. ``threshold`` is a fraction of the
    maximum value, compared with ``x`` for floats and with ``x / 255`` for ``uint8``: the
    default 0.5 inverts ``uint8`` pixels ``>= 128``, which is PIL's ``ImageOps.solarize``
    (threshold 128) that Orchestra/BYOL's ``Solarization`` applies, and on unrounded floats
    it inverts exactly the values that round to such pixels (``round(255 x) >= 128``)."""

    threshold: float = 0.5
    p: float = 0.2

    keys = ("apply",)

    def __post_init__(self) -> None:
        if not 0 <= self.p <= 1:
            raise ValueError(f"RandomSolarize probability p = {self.p} outside [0, 1]")

    def sample(self, n: int, generator: torch.Generator) -> Params:
        return {"apply": torch.rand(n, generator=generator) < self.p}

    def apply(self, x: torch.Tensor, params: Params) -> torch.Tensor:
        apply = params["apply"]
        _check_per_sample(x, apply)
        if x.dtype == torch.uint8:
            bound, threshold = 255, self.threshold * 255
        else:
            bound, threshold = 1.0, self.threshold
        invert = (x >= threshold) & apply[..., None, None, None]
        return torch.where(invert, bound - x, x)


@dataclass(frozen=True)
class FeatureCorruption(Op):
    """SCARF's random feature corruption (Bahri, Jiang, Tay, Metzler, "SCARF:
    Self-Supervised Contrastive Learning using Random Feature Corruption", ICLR 2022) for
    feature vectors ``[..., B, D]``: each feature ``j`` of each sample is, with probability
    ``rate``, replaced by feature ``j`` of a sample ``d`` of the same batch drawn uniformly
    (a draw from the feature's empirical marginal within the batch; SCARF draws from the
    whole training set)::

        out[i, j] = x[d_ij, j] if u_ij < rate else x[i, j],    u_ij ~ U[0, 1), d_ij ~ U{0..B-1}

    The per-feature draws need the number of features, which :meth:`sample` does not see:
    it draws one 32-bit ``seed`` per sample, and :meth:`apply` derives ``u_ij`` and
    ``d_ij`` from ``(seed_i, j)`` with an integer hash (lowbias32), exact in int64
    arithmetic on every device, so the executors agree whatever the batch layout.
    """

    rate: float = 0.6

    keys = ("seed",)

    def __post_init__(self) -> None:
        if not 0 <= self.rate <= 1:
            raise ValueError(f"FeatureCorruption rate {self.rate} outside [0, 1]")

    def input_problem(self, shape: tuple[int, ...]) -> str | None:
        return None if len(shape) == 1 else "FeatureCorruption works on feature vectors [D]"

    def sample(self, n: int, generator: torch.Generator) -> Params:
        return {"seed": torch.randint(0, 2**32, (n,), dtype=torch.int64, generator=generator)}

    def apply(self, x: torch.Tensor, params: Params) -> torch.Tensor:
        seed = params["seed"]
        if seed.shape != x.shape[:-1]:
            raise ValueError(
                f"parameters of shape {tuple(seed.shape)} do not match features of shape "
                f"{tuple(x.shape)}; draw one row per sample with Transform.sample"
            )
        batch, features = x.shape[-2], x.shape[-1]
        j = torch.arange(features, device=x.device)
        u = _unit_interval(seed[..., None], _hash32(2 * j))  # [..., B, D]
        donor = (_unit_interval(seed[..., None], _hash32(2 * j + 1)) * batch).long().clamp_(max=batch - 1)
        x = _unit_float(x)
        return torch.where(u < self.rate, x.gather(-2, donor), x)


TransformFactory = Callable[[Sequence[float] | None, Sequence[float] | None], "Transform | Views"]
"""An augmentation pipeline's factory: the dataset's per-channel ``(mean, std)`` (``None``:
not normalised) to its :class:`Transform`, or :class:`Views`."""

AUGMENTATIONS: Registry[TransformFactory] = Registry("augmentation", "contrafl.augmentations")
"""The augmentation pipelines by name (``augment=NAME``, ``DatasetSpec.augment``): factories
``(mean, std) -> Transform`` (or ``Views``); plugins join from the entry-point group ``contrafl.augmentations``."""

SUMMARIES = {
    "none": "no augmentation: to float and normalise (any data)",
    "cifar10": "MOON's CIFAR-10 training: reflect-pad 4, random crop back to the size, flip (images)",
    "cifar100": "MOON's CIFAR-100 training: zero-pad 4, random crop back to the size, flip, rotation of up to 15 degrees (images)",
    "flip": "horizontal flip with p = 0.5 (images of any size; two views for self-supervised learning on them)",
    "simclr": "FedU2's SimCLR/BYOL views: resized crop, colour jitter, grayscale, flip (3x32x32 images)",
    "scarf": "SCARF's random feature corruption, rate 0.6 (feature vectors)",
    "finetune": "FedU2's fine-tuning: resized crop (area 0.64-1), flip (3x32x32 images)",
    "orchestra": "Orchestra's two asymmetric views: resized crops, colour jitter, grayscale, blur, flip (3x32x32 images)",
}
"""One line for ``contrafl list`` per built-in pipeline (a plugin's: its docstring's first line)."""


def summary(name: str) -> str:
    """What the pipeline ``name`` does, in one line."""
    canonical = AUGMENTATIONS.canonical(name)
    if canonical in SUMMARIES:
        return SUMMARIES[canonical]
    return ((AUGMENTATIONS.get(canonical).__doc__ or "").strip().splitlines() or [""])[0]


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


@AUGMENTATIONS.register("simclr")
def simclr_transform(mean: Sequence[float] | None, std: Sequence[float] | None) -> Transform:
    """The SimCLR/BYOL transform of FedU2 (Liao et al., CVPR 2024; official code
    XeniaLLL/FedU2, ``src/mains/train_fedU2.py``), selected with ``augment=simclr``:
    random resized crop to 32 x 32 (area fraction in [0.2, 1], aspect ratio in [3/4, 4/3],
    bilinear) -> with p = 0.8 colour jitter (brightness, contrast, saturation 0.8, hue 0.2,
    random order) -> grayscale (p = 0.2) -> flip (p = 0.5) -> normalise. The official code
    feeds the unnormalised [0, 1] pixels of ``ToTensor``; here normalisation follows when
    ``mean`` is given, as in the other pipelines."""
    ops = [
        RandomResizedCrop(32, scale=(0.2, 1.0)),
        ColorJitter(0.8, 0.8, 0.8, 0.2, p=0.8),
        RandomGrayscale(0.2),
        RandomHorizontalFlip(0.5),
    ]
    return _then_normalise(ops, mean, std)


@AUGMENTATIONS.register("scarf")
def scarf_transform(mean: Sequence[float] | None, std: Sequence[float] | None) -> Transform:
    """Two-view augmentation of feature vectors (tabular data, scikit-learn's digits,
    FedProx's synthetic data), selected with ``augment=scarf``: SCARF's random feature
    corruption at its paper's rate 0.6 (:class:`FeatureCorruption`), then to float."""
    return Transform(FeatureCorruption(0.6), ToFloat())


@AUGMENTATIONS.register("finetune")
def finetune_transform(mean: Sequence[float] | None, std: Sequence[float] | None) -> Transform:
    """FedU2's fine-tuning transform (``semi_eval.py``): random resized crop to 32 x 32
    with area fraction in [0.64, 1] and a square box -> flip (p = 0.5) -> normalise."""
    return _then_normalise([RandomResizedCrop(32, scale=(0.64, 1.0), ratio=(1.0, 1.0)), RandomHorizontalFlip(0.5)], mean, std)


@AUGMENTATIONS.register("orchestra")
def orchestra_transform(mean: Sequence[float] | None, std: Sequence[float] | None) -> Views:
    """Orchestra's two asymmetric pipelines (Lubana et al., "Orchestra: Unsupervised Federated
    Learning via Globally Consistent Clustering", ICML 2022; ``OrchestraTransform`` in
    akhilmathurs/orchestra ``utils.py``, as copied into FedU2's Orchestra baseline,
    XeniaLLL/FedU2 ``src/my/data/aug.py`` lines 75-118, ``AugOrchestraDataset``: ``T1`` =
    ``transform`` at lines 79-87, ``T2`` = ``transform_prime`` at 89-98, ``Solarization`` at
    64-72), selected with ``augment=orchestra``. Views 0 and 2 go through ``T1``, view 1 through ``T2``
    (Orchestra's ``x1 = transform(x)``, ``x2 = transform_prime(x)``, and the third view
    ``transform(x)``, which Orchestra then rotates by a multiple of 90 degrees for its
    rotation-prediction head; that rotation is not part of this transform).

    ``T1``: random resized crop to 32 x 32 (area fraction in [0.5, 1], aspect ratio in
    [3/4, 4/3], bicubic) -> flip (p = 0.5) -> with p = 0.8 colour jitter (brightness 0.4,
    contrast 0.4, saturation 0.2, hue 0.1, random order) -> grayscale (p = 0.2) -> Gaussian
    blur (kernel 3, sigma uniform in [0.1, 2], p = 0.5) -> normalise.
    ``T2``: the same with blur p = 0.1, then solarize (pixels >= 128 of 255 inverted,
    p = 0.2) -> normalise.

    The official code normalises with ``Normalize((0.5,) * 3, (0.5,) * 3)`` (pixels to
    [-1, 1]); here, as in the other pipelines, normalisation uses the given ``mean``/``std``
    (the dataset's by default), so the config setting ``normalize=half`` reproduces
    Orchestra's exactly (``normalize=none`` leaves pixels in [0, 1]). The reference works on
    PIL ``uint8`` images and rounds after every step; these ops keep floats (see
    :class:`RandomResizedCrop`, :class:`GaussianBlur`, :class:`RandomSolarize`)."""

    def pipeline(blur: float, solarize: float | None) -> Transform:
        ops: list[Op] = [
            RandomResizedCrop(32, scale=(0.5, 1.0), interpolation="bicubic"),
            RandomHorizontalFlip(0.5),
            ColorJitter(0.4, 0.4, 0.2, 0.1, p=0.8),
            RandomGrayscale(0.2),
            GaussianBlur(3, (0.1, 2.0), p=blur),
        ]
        if solarize is not None:
            ops.append(RandomSolarize(0.5, p=solarize))
        return _then_normalise(ops, mean, std)

    return Views(pipeline(0.5, None), pipeline(0.1, 0.2))


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


def _unit_float(x: torch.Tensor) -> torch.Tensor:
    """``uint8`` pixels as floats in [0, 1] (``x / 255``); floating inputs unchanged."""
    return x.to(torch.float32).div_(255) if x.dtype == torch.uint8 else x


def _check_rgb(x: torch.Tensor) -> None:
    if x.dim() < 3 or x.shape[-3] != 3:
        raise ValueError(f"colour augmentation needs RGB images [..., 3, H, W], got shape {tuple(x.shape)}")


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 (C. Wellons' integer hash) of int64 values, taken modulo ``2^32``: a
    bijection of 32-bit integers whose output bits all depend on every input bit. Products
    are split into 16-bit halves so that they stay exact in int64."""
    mask = 0xFFFFFFFF

    def times(v: torch.Tensor, c: int) -> torch.Tensor:  # v * c mod 2^32
        return (v * (c & 0xFFFF) + (((v * (c >> 16)) & 0xFFFF) << 16)) & mask

    x = x & mask
    x = x ^ (x >> 16)
    x = times(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = times(x, 0x846CA68B)
    return x ^ (x >> 16)


def _unit_interval(seed: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """Pseudo-random numbers in [0, 1) (float64) from 32-bit ``seed`` and ``key``
    (broadcast): ``hash32(seed + key) / 2^32``."""
    return _hash32(seed + key).to(torch.float64) / 2**32


def _linear_taps(
    start: torch.Tensor, length: torch.Tensor, size: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Bilinear resampling of the segments ``[start, start + length)`` (``[N]``) to ``size``
    points, as ``F.interpolate(align_corners=False)``: output ``o`` reads
    ``s = max(0, (o + 0.5) length / size - 0.5)``. Returns the two source indices
    ``start + floor(s)``, ``start + min(floor(s) + 1, length - 1)`` and the weight
    ``s - floor(s)`` of the second, each ``[N, size]``."""
    out = torch.arange(size, device=start.device, dtype=dtype)
    source = ((out + 0.5) * (length.to(dtype) / size)[:, None] - 0.5).clamp_(min=0)
    lower = source.long()
    upper = torch.minimum(lower + 1, length[:, None] - 1)
    return start[:, None] + lower, start[:, None] + upper, source - lower


def _cubic(t: torch.Tensor) -> torch.Tensor:
    """PIL's bicubic filter: Keys' cubic convolution kernel with ``a = -0.5``, support 2."""
    a, t = -0.5, t.abs()
    inner = ((a + 2) * t - (a + 3)) * t * t + 1
    outer = (((t - 5) * t + 8) * t - 4) * a
    return torch.where(t < 1, inner, torch.where(t < 2, outer, torch.zeros_like(t)))


def _cubic_weights(
    start: torch.Tensor, length: torch.Tensor, size: int, extent: int, dtype: torch.dtype
) -> torch.Tensor:
    """PIL's bicubic resampling (``precompute_coeffs`` of ``Resample.c``) of the segments
    ``[start, start + length)`` (``[N]``) of an axis of ``extent`` pixels to ``size``
    points, as a dense matrix ``[N, size, extent]``: output ``o`` is centred at
    ``c = (o + 0.5) length / size``, the filter is widened by ``f = max(1, length / size)``,
    and pixel ``start + j`` weighs ``cubic((j + 0.5 - c) / f)`` for ``0 <= j < length``
    (0 elsewhere), normalised to sum 1 over ``j``. Only the ``T`` pixels of the window
    ``|j + 0.5 - c| < 2 f`` are evaluated (float64), then scattered into the matrix; taps
    outside the segment have weight 0 (their index is clamped into it)."""
    taps = math.ceil(4 * max(1.0, extent / size))  # integers in an open window of length 4 f
    length = length.to(torch.float64)[:, None, None]
    scale = length / size
    widen = scale.clamp(min=1.0)
    centre = (torch.arange(size, device=start.device, dtype=torch.float64)[:, None] + 0.5) * scale
    j = (centre - 2 * widen + 0.5).floor() + torch.arange(taps, device=start.device, dtype=torch.float64)
    weight = _cubic((j + 0.5 - centre) / widen) * ((j >= 0) & (j < length))  # [N, size, T]
    weight = (weight / weight.sum(-1, keepdim=True)).to(dtype)
    index = torch.minimum(j.clamp(min=0), length - 1).long() + start[:, None, None]
    dense = torch.zeros(start.shape[0], size, extent, dtype=dtype, device=start.device)
    return dense.scatter_add_(-1, index, weight)


def _grayscale(x: torch.Tensor) -> torch.Tensor:
    """Luma of RGB images ``[..., 3, H, W]`` as ``[..., 1, H, W]``:
    ``0.2989 R + 0.587 G + 0.114 B`` (torchvision's ``rgb_to_grayscale``)."""
    r, g, b = x.unbind(-3)
    return (0.2989 * r + 0.587 * g + 0.114 * b).unsqueeze(-3)


def _blend(x: torch.Tensor, y: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    """``clamp(f x + (1 - f) y, 0, 1)`` (torchvision's ``_blend`` for floats)."""
    return (f * x + (1 - f) * y).clamp_(0, 1)


def _jitter_selected(x: torch.Tensor, where: torch.Tensor, factor: torch.Tensor, k: int) -> torch.Tensor:
    """Colour adjustment ``k`` (brightness, contrast, saturation, hue) with ``factor [N]``
    on the images ``x [N, 3, H, W]`` where ``where [N]`` holds, in place."""
    index = where.nonzero().squeeze(-1)
    f = factor[index].to(x.dtype)[:, None, None, None]
    return x.index_copy_(0, index, _ADJUST[k](x.index_select(0, index), f))


def _jitter_masked(x: torch.Tensor, where: torch.Tensor, factor: torch.Tensor, k: int) -> torch.Tensor:
    """:func:`_jitter_selected` computed on every image and kept where ``where`` holds."""
    return torch.where(where[:, None, None, None], _ADJUST[k](x, factor.to(x.dtype)[:, None, None, None]), x)


def _adjust_brightness(x: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    """``blend(x, 0, f) = clamp(f x, 0, 1)``."""
    return (f * x).clamp_(0, 1)


def _adjust_contrast(x: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    return _blend(x, _grayscale(x).mean(dim=(-3, -2, -1), keepdim=True), f)


def _adjust_saturation(x: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    return _blend(x, _grayscale(x), f)


def _adjust_hue(x: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    h, s, v = _rgb_to_hsv(x)
    h = h + f
    return _hsv_to_rgb(h - h.floor(), s, v)  # (H + f) mod 1


_ADJUST = (_adjust_brightness, _adjust_contrast, _adjust_saturation, _adjust_hue)


def _rgb_to_hsv(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """RGB in [0, 1] ``[..., 3, H, W]`` to ``H, S, V`` in [0, 1], each ``[..., 1, H, W]``
    (torchvision's ``_rgb2hsv``): ``V = max``, ``S = (max - min) / max``, and ``6 H`` is
    ``(G - B) / (max - min)`` where R is the max, ``2 + (B - R) / (max - min)`` where G is
    (and R is not), ``4 + (R - G) / (max - min)`` otherwise, taken mod 6; ``S = H = 0`` for
    grays. The branches are selected by multiplying with masks (``torch.where`` is several
    times slower on CPU)."""
    r, g, b = x.split(1, dim=-3)
    high, low = x.amax(-3, keepdim=True), x.amin(-3, keepdim=True)
    chroma = high - low
    tiny = torch.finfo(x.dtype).tiny  # 0 / tiny = 0 for black and gray pixels
    s = chroma / high.clamp(min=tiny)
    chroma = chroma.clamp_(min=tiny)
    is_r = high == r
    is_g = (high == g) & ~is_r
    is_b = ~(is_r | is_g)
    h = (is_r * (g - b) + is_g * (b - r + 2.0 * chroma) + is_b * (r - g + 4.0 * chroma)) / (6.0 * chroma)
    return h - h.floor(), s, high


def _hsv_to_rgb(h: torch.Tensor, s: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``H, S, V`` in [0, 1] (``[..., 1, H, W]``) to RGB ``[..., 3, H, W]``: channel
    ``V - V S clamp(2 - d, 0, 1)``, ``d`` the distance of ``6 H`` from ``3, 5, 1`` (R, G, B)
    around the circle of length 6. This is the closed form of torchvision's ``_hsv2rgb``,
    which takes ``(R, G, B) = (V, t, p), (q, V, p), (p, V, t), (p, q, V), (t, p, V), (V, p, q)``
    in the sectors ``floor(6 H) = 0..5``, with ``f = 6 H - floor(6 H)``, ``p = V (1 - S)``,
    ``q = V (1 - S f)`` and ``t = V (1 - S (1 - f))``."""
    d = (6.0 * h - _channel_constant((3.0, 5.0, 1.0), h.device, h.dtype)).abs_()
    d = torch.minimum(d, 6.0 - d)
    return v - v * s * (2.0 - d).clamp_(0, 1)


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
