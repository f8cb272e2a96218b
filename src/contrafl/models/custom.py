"""Encoders from the user's code: ``model=MODULE:FACTORY`` or ``model=FILE.py:FACTORY``.

``FACTORY`` is a callable returning an ``nn.Module`` that maps a batch of inputs to
``[B, D]`` features; contrafl wraps it as it wraps its own backbones
(:class:`~contrafl.models.base.FedModel` adds the projection head and the classifier).
``D`` is found by a forward pass on a zero batch of 2 samples. The ``model.*`` options
other than the head options are passed to the factory as keyword arguments, converted to
the types its signature gives (annotations, else defaults; values without either are read
as YAML); a factory that has an ``input_shape`` or ``num_classes`` parameter also gets
those. Every problem (a missing file, an import that fails, a factory that raises or
returns something else than an encoder of flat features) is a one-line
:class:`~contrafl.errors.ConfigError`.

:func:`vectorizable` says whether ``torch.func`` can train a model for a stack of clients
(the vectorized executor); :func:`contrafl.engine.setup.prepare` falls back to sequential
training when it cannot.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib
import importlib.util
import inspect
import re
import sys
import traceback
import types
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import yaml
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.utils import _pytree as pytree

from .. import params as P
from ..errors import ConfigError, one_line
from ..usercode import Reference, is_reference, parse, source_digest
from .registry import MODELS, HeadOptions, ModelSpec

PASSED = ("input_shape", "num_classes")
"""Factory parameters that contrafl fills in (when the factory has them)."""

HEAD_KEYS = tuple(f.name for f in dataclasses.fields(HeadOptions))


def user_spec(text: str) -> ModelSpec:
    """The :class:`ModelSpec` of ``model=text`` (``MODULE:FACTORY`` or ``FILE.py:FACTORY``),
    named by the reference with file paths made absolute."""
    ref = parse(text)
    factory = load_factory(ref, text)
    params = parameters(ref, factory)
    return ModelSpec(
        name=str(ref),
        summary=f"the encoder of {text}",
        features=functools.partial(build_encoder, ref, factory),
        inputs="any",
        make_options=functools.partial(factory_options, ref, factory, params),
        takes_num_classes=True,
    )


# -- import ------------------------------------------------------------------------------


def load_factory(ref: Reference, text: str) -> Callable[..., Any]:
    """The object ``ref`` names, checked to be callable."""
    module = _load_file(ref.module, source_digest(ref), text) if ref.is_file else _import(ref.module, text)
    where = ref.module if ref.is_file else f"module {ref.module}"
    if not hasattr(module, ref.attr):
        names = [n for n, v in vars(module).items() if callable(v) and not n.startswith("_") and getattr(v, "__module__", None) == module.__name__]
        raise ConfigError(
            f"model={text}: {where} has no attribute '{ref.attr}'{P.suggest(ref.attr, names)}; name a function that "
            f"returns the encoder (functions defined there: {', '.join(names) or 'none'})"
        )
    factory = getattr(module, ref.attr)
    if not callable(factory):
        raise ConfigError(
            f"model={text}: {ref.attr} in {where} is not callable (type {type(factory).__name__}); "
            "name a function (or nn.Module class) that returns the encoder"
        )
    return factory


def _load_file(path: str, digest: str, text: str) -> types.ModuleType:
    """The module of the Python file ``path`` (``model=text``), with one-line errors."""
    if not Path(path).is_file():
        raise ConfigError(
            f"model={text}: file {path} does not exist; give the path of a Python file (relative paths start "
            f"from the current directory, {Path.cwd()}) or an importable module, model=MODULE:FACTORY"
        )
    try:
        return _exec_file(path, digest)
    except SyntaxError as exc:
        raise ConfigError(f"model={text}: {exc.filename} line {exc.lineno}: SyntaxError: {exc.msg}; fix the file") from None
    except Exception as exc:
        raise ConfigError(f"model={text}: importing {path} raised {one_line(exc)}{_at(exc)}; fix the file") from None


@functools.lru_cache(maxsize=None)
def _exec_file(path: str, digest: str) -> types.ModuleType:
    """The module of the Python file ``path``, executed once per content (``digest``).
    Its folder goes on ``sys.path`` (as ``python path`` puts a script's), so that the
    file imports the modules beside it."""
    folder = str(Path(path).resolve().parent)
    if folder not in sys.path:
        sys.path.append(folder)
    stem = re.sub(r"\W", "_", Path(path).stem)
    name = f"_contrafl_user_{stem}_{digest[:12]}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # for dataclasses and pickling of what the file defines
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _import(name: str, text: str) -> types.ModuleType:
    """``importlib.import_module(name)`` with one-line errors."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name and (name == exc.name or name.startswith(exc.name + ".")):
            raise ConfigError(
                f"model={text}: no module named {exc.name!r}; give an importable module (installed, or on PYTHONPATH) "
                f"or a file, e.g. model=./{name.replace('.', '/')}.py:FACTORY"
            ) from None
        raise ConfigError(f"model={text}: importing module {name} raised {one_line(exc)}{_at(exc)}; fix the module or install what it imports") from None
    except SyntaxError as exc:
        raise ConfigError(f"model={text}: {exc.filename} line {exc.lineno}: SyntaxError: {exc.msg}; fix the file") from None
    except Exception as exc:
        raise ConfigError(f"model={text}: importing module {name} raised {one_line(exc)}{_at(exc)}; fix the module") from None


def _at(exc: BaseException) -> str:
    """`` at FILE line N``: where in the user's code ``exc`` was raised (the last frame
    outside contrafl, torch and importlib)."""
    skip = (str(Path(__file__).parents[1]), str(Path(torch.__file__).parent), "<frozen ")
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith(skip)]
    return f" at {frames[-1].filename} line {frames[-1].lineno}" if frames else ""


# -- options -----------------------------------------------------------------------------


def parameters(ref: Reference, factory: Callable[..., Any]) -> dict[str, inspect.Parameter]:
    """The factory's parameters; a parameter named as a head option is an error (the
    head options are contrafl's)."""
    try:
        params = dict(inspect.signature(factory).parameters)
    except (TypeError, ValueError):  # a builtin without a signature: anything goes
        return {"kwargs": inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD)}
    clash = [n for n in params if n in HEAD_KEYS]
    if clash:
        raise ConfigError(
            f"model={ref}: the factory's parameter '{clash[0]}' has the name of the head option model.{clash[0]}, "
            "which contrafl sets itself; rename the parameter"
        )
    return params


def _signature(name: str, params: Mapping[str, inspect.Parameter]) -> str:
    return f"{name}({', '.join(str(p) for p in params.values())})"


def factory_options(
    ref: Reference, factory: Callable[..., Any], params: Mapping[str, inspect.Parameter], values: Mapping[str, Any]
) -> Any:
    """The factory's keyword arguments ``values`` (the ``model.*`` options that are not
    head options) checked against its signature and converted to its types, as a frozen
    dataclass instance (what :func:`contrafl.params.to_dict` records)."""
    name = getattr(factory, "__name__", ref.attr)
    free = any(p.kind is p.VAR_KEYWORD for p in params.values())
    named = [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and n not in PASSED]
    for key in values:
        if key in PASSED:
            raise ConfigError(f"model.{key} is set by contrafl (from the dataset) for model {ref}; remove model.{key}")
        if not free and key not in named:
            raise ConfigError(
                f"unknown option 'model.{key}'{P.suggest(key, named)} for model {ref}: its factory is "
                f"{_signature(name, params)}; valid options are: {', '.join(named + list(HEAD_KEYS))}"
            )
    missing = [n for n in named if params[n].default is inspect.Parameter.empty and n not in values]
    if missing:
        raise ConfigError(
            f"model {ref} needs model.{missing[0]}: its factory is {_signature(name, params)}; set model.{missing[0]}=VALUE"
        )
    hints = _hints(factory)
    converted = {k: _convert(ref, k, v, hints.get(k), params.get(k)) for k, v in values.items()}
    fields = [(k, Any, dataclasses.field(default_factory=functools.partial(copy.deepcopy, v))) for k, v in converted.items()]
    return dataclasses.make_dataclass("FactoryOptions", fields, frozen=True)()


def _hints(factory: Callable[..., Any]) -> dict[str, Any]:
    target = factory.__init__ if isinstance(factory, type) else factory
    try:
        return typing.get_type_hints(target)
    except Exception:  # annotations that do not evaluate
        return {}


PLAIN = (bool, int, float, str)


def _convert(ref: Reference, key: str, value: Any, hint: Any, param: inspect.Parameter | None) -> Any:
    """``value`` as the factory's parameter ``key`` takes it: converted to its annotation
    (or its default's type) when that is a plain type, a list, a tuple or an optional of
    those; else a string (from the command line) read as YAML."""
    tp = hint
    if tp is None and param is not None and param.default not in (inspect.Parameter.empty, None):
        tp = type(param.default)
    if tp in (list, tuple):
        tp = tp[Any]
    if tp not in PLAIN and typing.get_origin(tp) not in (typing.Union, types.UnionType, list, tuple):
        return _yaml(value)
    if typing.get_origin(tp) in (list, tuple) and (typing.get_args(tp)[:1] or (Any,))[0] is Any:
        value = _yaml(value)
    try:
        return P._convert(value, tp)
    except ValueError as exc:
        raise ConfigError(
            f"model.{key}={value!r} is invalid: expected {exc} (parameter {key} of {ref}); set it with model.{key}=VALUE"
        ) from None


def _yaml(value: Any) -> Any:
    """A command-line string read as YAML (``64`` -> 64, ``[1, 2]`` -> [1, 2]); other values as they are."""
    if not isinstance(value, str):
        return value
    try:
        return yaml.safe_load(value)
    except yaml.YAMLError:
        return value


# -- the encoder -------------------------------------------------------------------------


def build_encoder(
    ref: Reference, factory: Callable[..., Any], input_shape: tuple[int, ...], options: Any, num_classes: int
) -> tuple[nn.Module, int]:
    """``(encoder, D)``: the factory's module and the width of its features, checked by
    a forward pass on a zero batch of 2 samples (eval mode, no gradients)."""
    params = parameters(ref, factory)
    kwargs = {f.name: getattr(options, f.name) for f in dataclasses.fields(options)}
    kwargs.update({k: v for k, v in (("input_shape", tuple(input_shape)), ("num_classes", num_classes)) if k in params})
    name = getattr(factory, "__name__", ref.attr)
    try:
        encoder = factory(**kwargs)
    except TypeError as exc:
        if "unexpected keyword argument" in str(exc):
            raise ConfigError(
                f"model {ref}: {one_line(exc)}; the factory is {_signature(name, params)}, remove the option or add the parameter"
            ) from None
        raise ConfigError(f"model {ref}: the factory {name}({_kwargs(kwargs)}) raised {one_line(exc)}{_at(exc)}; fix the factory or its options") from None
    except Exception as exc:
        raise ConfigError(f"model {ref}: the factory {name}({_kwargs(kwargs)}) raised {one_line(exc)}{_at(exc)}; fix the factory or its options") from None
    if not isinstance(encoder, nn.Module):
        raise ConfigError(
            f"model {ref}: the factory {name} returned a value of type {type(encoder).__name__}, expected a torch.nn.Module "
            "(the encoder); return the module, e.g. nn.Sequential(...)"
        )
    return encoder, feature_dim(ref, encoder, tuple(input_shape))


def _kwargs(kwargs: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in kwargs.items())


def feature_dim(ref: Reference, encoder: nn.Module, input_shape: tuple[int, ...]) -> int:
    """``D`` of an encoder mapping ``[2, *input_shape]`` to ``[2, D]``; a one-line error
    for any other output."""
    batch = [2, *input_shape]
    training = encoder.training
    encoder.eval()
    try:
        with torch.no_grad():
            out = encoder(torch.zeros(batch))
    except Exception as exc:
        raise ConfigError(
            f"model {ref}: the encoder's forward pass on a batch of shape {batch} (the dataset's samples) raised "
            f"{one_line(exc)}{_at(exc)}; make it accept inputs of shape [B, {', '.join(map(str, input_shape))}]"
        ) from None
    finally:
        encoder.train(training)
    if not isinstance(out, torch.Tensor):
        raise ConfigError(
            f"model {ref}: the encoder returned a value of type {type(out).__name__} for a batch of shape {batch}, expected a tensor "
            "[B, D] of features; return the features alone"
        )
    shape = list(out.shape)
    if out.dim() != 2:
        raise ConfigError(
            f"model {ref}: the encoder returned shape {shape} for a batch of shape {batch}, expected [2, D] "
            "(flat features); flatten them, e.g. end the encoder with nn.Flatten()"
        )
    if shape[0] != 2:
        raise ConfigError(
            f"model {ref}: the encoder returned shape {shape} for a batch of shape {batch}, expected [2, D]: the first "
            "dimension must stay the batch's; do not reduce or reshape over the batch"
        )
    if shape[1] == 0:
        raise ConfigError(f"model {ref}: the encoder returned shape {shape}: no features; give it at least one output")
    return shape[1]


# -- the vectorized executor --------------------------------------------------------------


def from_user(name: str) -> bool:
    """Whether model ``name`` is the user's code, which the vectorized executor may not
    be able to train: a factory reference or a plugin's model (not a built-in)."""
    return is_reference(name) or (name in MODELS and MODELS.package(name) is not None)


def vectorizable(model: nn.Module, input_shape: tuple[int, ...]) -> str | None:
    """Why ``torch.func`` cannot train ``model`` for a stack of clients as the vectorized
    executor does (``vmap`` of ``grad`` over ``functional_call``, train mode, 2 clients of
    2 samples), as one line; None when it can. Data-dependent control flow (``if
    x.sum() > 0``, ``.item()``) and in-place updates of tensors that are not registered
    buffers are what usually fails."""
    probe = copy.deepcopy(model).train()  # a copy: a failed step may leave state half-changed
    names = {name for name, _ in probe.named_parameters()}
    state = probe.state_dict()
    params = {k: torch.stack([v.detach()] * 2) for k, v in state.items() if k in names}
    buffers = {k: torch.stack([v.detach()] * 2) for k, v in state.items() if k not in names}
    x = torch.randn(2, 2, *input_shape, generator=torch.Generator().manual_seed(0))

    def loss(p: dict, b: dict, xs: torch.Tensor) -> torch.Tensor:
        out = functional_call(probe, {**p, **b}, (xs,))
        leaves = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]
        return sum(t.float().sum() for t in leaves)

    try:
        vmap(grad(loss), in_dims=(0, 0, 0), randomness="different")(params, buffers, x)
    except Exception as exc:
        return one_line(exc).split(". ")[0] + _at(exc)
    return None
