"""Backbones (moon_cnn, fedavg_cnn, resnet18/50, mlp) and the fast 2x2 max-pooling."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call, grad, jvp, stack_module_state, vjp, vmap

import contrafl.models.cnn  # noqa: F401  (registers the backbones)
import contrafl.models.mlp  # noqa: F401
import contrafl.models.resnet  # noqa: F401
from contrafl.errors import ConfigError
from contrafl.models.layers import max_pool2x2
from contrafl.models.base import Heads
from contrafl.models.build import build_model

# ---------------------------------------------------------------------------------------------
# State dicts and shapes


def test_moon_cnn_state_dict_matches_moon_reference():
    model = build_model("moon_cnn", (3, 32, 32), 10)
    layout = [(k, tuple(v.shape)) for k, v in model.state_dict().items()]
    assert layout == [
        ("features.conv1.weight", (6, 3, 5, 5)),
        ("features.conv1.bias", (6,)),
        ("features.conv2.weight", (16, 6, 5, 5)),
        ("features.conv2.bias", (16,)),
        ("features.fc1.weight", (120, 400)),
        ("features.fc1.bias", (120,)),
        ("features.fc2.weight", (84, 120)),
        ("features.fc2.bias", (84,)),
        ("l1.weight", (84, 84)),
        ("l1.bias", (84,)),
        ("l2.weight", (256, 84)),
        ("l2.bias", (256,)),
        ("l3.weight", (10, 256)),
        ("l3.bias", (10,)),
    ]


def test_moon_cnn_matches_reference_forward():
    """MOON's order relu -> MaxPool2d gives the same h as our pool -> relu."""
    torch.manual_seed(0)
    enc = build_model("moon_cnn", (3, 32, 32), 10).features
    x = torch.randn(4, 3, 32, 32)
    ref = F.max_pool2d(F.relu(enc.conv1(x)), 2, 2)
    ref = F.max_pool2d(F.relu(enc.conv2(ref)), 2, 2).view(-1, 16 * 5 * 5)
    ref = F.relu(enc.fc2(F.relu(enc.fc1(ref))))
    assert torch.equal(enc(x), ref)


def test_resnet_state_dict_keys_follow_moon_sequential():
    """MOON's encoder is nn.Sequential(*children[:-1]) of ResNetCifar10."""
    sd = build_model("resnet18", (3, 32, 32), 10).state_dict()
    assert tuple(sd["features.0.weight"].shape) == (64, 3, 3, 3)
    assert tuple(sd["features.1.running_mean"].shape) == (64,)
    assert tuple(sd["features.3.1.conv2.weight"].shape) == (64, 64, 3, 3)
    assert "features.3.0.downsample.0.weight" not in sd  # identity shortcut in stage 1
    assert tuple(sd["features.4.0.downsample.0.weight"].shape) == (128, 64, 1, 1)
    assert tuple(sd["features.6.1.bn2.weight"].shape) == (512,)
    assert tuple(sd["l1.weight"].shape) == (512, 512)
    sd50 = build_model("resnet50", (3, 32, 32), 100).state_dict()
    assert tuple(sd50["features.3.0.downsample.0.weight"].shape) == (256, 64, 1, 1)
    assert tuple(sd50["features.4.0.conv2.weight"].shape) == (128, 128, 3, 3)
    assert tuple(sd50["features.6.2.conv3.weight"].shape) == (2048, 512, 1, 1)
    assert tuple(sd50["l1.weight"].shape) == (2048, 2048)


def test_resnet50_bottleneck_is_v1_5_and_keeps_resolution_in_the_stem():
    enc = build_model("resnet50", (3, 64, 64), 10).features
    first = enc[4][0]  # first block of stage 2
    assert first.conv1.stride == (1, 1) and first.conv2.stride == (2, 2)
    assert enc[0].stride == (1, 1) and not any(isinstance(m, torch.nn.MaxPool2d) for m in enc)
    with torch.no_grad():
        maps = enc[:7](torch.randn(1, 3, 64, 64))  # up to the last stage
    assert tuple(maps.shape) == (1, 2048, 8, 8)


CASES = [
    ("moon_cnn", (3, 32, 32), 84, 4),
    ("moon_cnn", (1, 28, 28), 84, 4),
    ("moon_cnn", (3, 64, 64), 84, 4),
    ("fedavg_cnn", (3, 32, 32), 128, 4),
    ("fedavg_cnn", (1, 28, 28), 128, 4),
    ("resnet18", (3, 32, 32), 512, 2),
    ("resnet18", (1, 28, 28), 512, 2),
    ("resnet18", (3, 64, 64), 512, 2),
    ("resnet50", (3, 32, 32), 2048, 2),
    ("mlp", (64,), 200, 4),
    ("mlp", (1, 28, 28), 200, 4),
]


@pytest.mark.parametrize("name,shape,feature_dim,batch", CASES)
def test_forward_shapes(name, shape, feature_dim, batch):
    torch.manual_seed(0)
    model = build_model(name, shape, 7, heads=Heads(predictor_hidden=16))
    h, z, logits, p, _ = model(torch.randn(batch, *shape))
    assert tuple(h.shape) == (batch, feature_dim)
    assert tuple(z.shape) == (batch, 256)
    assert tuple(logits.shape) == (batch, 7)
    assert tuple(p.shape) == (batch, 256)
    assert model.feature_dim == feature_dim


def test_predictor_without_batchnorm_is_linear_relu_linear():
    """``Heads(predictor_bn=False)``: ``p = W2 relu(W1 z + b1) + b2`` with no buffers
    (FedX's prediction MLP); the default keeps the BatchNorm."""
    torch.manual_seed(0)
    plain = build_model("mlp", (6,), 3, {"hidden": [5]}, heads=Heads(predictor_hidden=4, predictor_bn=False))
    layout = [(k, tuple(v.shape)) for k, v in plain.state_dict().items() if k.startswith("predictor.")]
    assert layout == [
        ("predictor.0.weight", (4, 256)),
        ("predictor.0.bias", (4,)),
        ("predictor.2.weight", (256, 4)),
        ("predictor.2.bias", (256,)),
    ]
    out = plain.train()(torch.randn(3, 6))
    first, last = plain.predictor[0], plain.predictor[2]
    torch.testing.assert_close(out.p, F.linear(F.relu(F.linear(out.z, first.weight, first.bias)), last.weight, last.bias))
    default = build_model("mlp", (6,), 3, {"hidden": [5]}, heads=Heads(predictor_hidden=4))
    assert isinstance(default.predictor[1], torch.nn.BatchNorm1d) and "predictor.1.running_mean" in default.state_dict()


def test_without_projection_head_classifier_reads_h():
    torch.manual_seed(0)
    model = build_model("fedavg_cnn", (1, 28, 28), 10, {"projection": False, "dim": 32})
    assert not hasattr(model, "l1") and tuple(model.l3.weight.shape) == (10, 32)
    h, z, logits, p, _ = model(torch.randn(3, 1, 28, 28))
    assert z is h and p is None
    assert torch.allclose(logits, h @ model.l3.weight.T + model.l3.bias)


def test_mlp_without_hidden_layers_is_logistic_regression():
    model = build_model("mlp", (64,), 10, {"hidden": "[]", "projection": "false"})
    assert [(k, tuple(v.shape)) for k, v in model.state_dict().items()] == [
        ("l3.weight", (10, 64)),
        ("l3.bias", (10,)),
    ]
    x = torch.randn(5, 64)
    assert torch.allclose(model(x).logits, x @ model.l3.weight.T + model.l3.bias)


def test_mlp_flattens_images_and_names_layers_fc():
    model = build_model("mlp", (1, 28, 28), 10, {"hidden": [50]})
    assert tuple(model.state_dict()["features.fc1.weight"].shape) == (50, 784)
    x = torch.randn(2, 1, 28, 28)
    assert torch.equal(model(x).h, model(x.flatten(1)).h)


# Encoder sizes computed by hand:
#   moon_cnn 3ch: conv1 6*3*25+6=456, conv2 16*6*25+16=2416, fc1 400*120+120=48120,
#                 fc2 120*84+84=10164; 1ch: conv1 156, fc1 256*120+120=30840.
#   fedavg_cnn 3ch, d=128: conv1 32*3*25+32=2432, conv2 64*32*25+64=51264, fc1 1600*128+128.
#   resnet18: torchvision's 11,689,512 minus fc (512*1000+1000) minus its 7x7 stem (64*3*49)
#             plus the 3x3 stem (64*3*9); 1 channel: minus 64*2*9.
#   resnet50: torchvision's 25,557,032 minus fc (2048*1000+1000) minus 64*3*49 plus 64*3*9.
#   mlp (200, 200) on 784 inputs: 784*200+200 + 200*200+200.
@pytest.mark.parametrize(
    "name,shape,expected",
    [
        ("moon_cnn", (3, 32, 32), 456 + 2416 + 48120 + 10164),
        ("moon_cnn", (1, 28, 28), 156 + 2416 + 30840 + 10164),
        ("fedavg_cnn", (3, 32, 32), 2432 + 51264 + 1600 * 128 + 128),
        ("resnet18", (3, 32, 32), 11_689_512 - 513_000 - 9408 + 1728),
        ("resnet18", (1, 28, 28), 11_689_512 - 513_000 - 9408 + 1728 - 1152),
        ("resnet50", (3, 32, 32), 25_557_032 - 2_049_000 - 9408 + 1728),
        ("mlp", (1, 28, 28), 784 * 200 + 200 + 200 * 200 + 200),
    ],
)
def test_encoder_parameter_counts(name, shape, expected):
    encoder = build_model(name, shape, 10).features
    assert sum(p.numel() for p in encoder.parameters()) == expected


def test_resnet_initialisation():
    torch.manual_seed(0)
    enc = build_model("resnet18", (3, 32, 32), 10).features
    w = enc[4][0].conv1.weight  # 64 -> 128, 3x3: fan_out 1152, fan_in 576
    assert w.std().item() == pytest.approx(math.sqrt(2 / 1152), rel=0.02)
    bn = enc[4][0].bn2
    assert torch.equal(bn.weight, torch.ones(128)) and torch.equal(bn.bias, torch.zeros(128))


def test_moon_cnn_uses_pytorch_default_initialisation():
    torch.manual_seed(0)
    conv1 = build_model("moon_cnn", (3, 32, 32), 10).features.conv1
    bound = 1 / math.sqrt(3 * 25)  # kaiming_uniform_(a=sqrt(5)) on fan_in = 75
    assert 0.9 * bound < conv1.weight.abs().max().item() <= bound


def test_user_errors():
    with pytest.raises(ConfigError, match="at least 16x16"):
        build_model("moon_cnn", (3, 12, 12), 10)
    with pytest.raises(ConfigError, match="model.hidden"):
        build_model("mlp", (64,), 10, {"hidden": "[100, 0]"})
    with pytest.raises(ConfigError, match="model.dim"):
        build_model("fedavg_cnn", (3, 32, 32), 10, {"dim": 0})


# ---------------------------------------------------------------------------------------------
# max_pool2x2


def _reference_pool(x):
    """``F.max_pool2d(x, 2)`` for ``[..., C, H, W]`` (it takes 3-d or 4-d inputs only)."""
    y = F.max_pool2d(x.reshape(-1, *x.shape[-3:]), 2)
    return y.reshape(*x.shape[:-2], *y.shape[-2:])


SHAPES = [(4, 6, 28, 28), (2, 3, 7, 9), (3, 5, 5), (2, 2, 3, 6, 7), (1, 2, 3, 2)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("ties", [False, True])
def test_max_pool2x2_matches_max_pool2d(shape, ties):
    torch.manual_seed(0)
    # Integer inputs put ties in most windows; the gradient must follow PyTorch's rule.
    x = torch.randint(0, 3, shape).float() if ties else torch.randn(shape)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y1, y2 = max_pool2x2(x1), _reference_pool(x2)
    assert torch.equal(y1, y2)
    g = torch.randn_like(y1)
    y1.backward(g)
    y2.backward(g)
    assert torch.equal(x1.grad, x2.grad)


@pytest.mark.parametrize("ties", [False, True])
def test_max_pool2x2_of_a_channels_last_batch(ties):
    """A channels-last batch goes to PyTorch's kernel: the same values and gradients
    (ties included) as the hand-written pooling of the NCHW batch, channels-last out."""
    torch.manual_seed(0)
    x = torch.randint(0, 3, (4, 6, 9, 10)).float() if ties else torch.randn(4, 6, 9, 10)
    x1 = x.contiguous(memory_format=torch.channels_last).requires_grad_()
    x2 = x.clone().requires_grad_()
    y1, y2 = max_pool2x2(x1), max_pool2x2(x2)
    assert y1.is_contiguous(memory_format=torch.channels_last) and y2.is_contiguous()
    assert torch.equal(y1, y2)
    g = torch.randn_like(y2)
    y1.backward(g)
    y2.backward(g)
    assert torch.equal(x1.grad, x2.grad)


@pytest.mark.parametrize("channels", [6, 32])
def test_max_pool2x2_of_a_channels_last_batch_without_gradient(channels):
    """Without a gradient (frozen models, evaluation), a channels-last batch of few
    channels takes the hand-written kernel and one of many PyTorch's: either way
    ``F.max_pool2d``'s values, ties included, and a channels-last result for the next
    convolution."""
    torch.manual_seed(0)
    for x in (torch.randn(4, channels, 9, 10), torch.randint(0, 3, (4, channels, 9, 10)).float()):
        x = x.contiguous(memory_format=torch.channels_last)
        with torch.no_grad():
            y = max_pool2x2(x)
        assert torch.equal(y, F.max_pool2d(x, 2)) and y.is_contiguous(memory_format=torch.channels_last)
        assert torch.equal(max_pool2x2(x), y)  # grad mode, but x needs none


def test_max_pool2x2_gradcheck():
    x = torch.randn(2, 3, 7, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(max_pool2x2, (x,), check_forward_ad=True)
    assert torch.autograd.gradgradcheck(max_pool2x2, (x,))


def test_max_pool2x2_under_vmap_and_jvp():
    torch.manual_seed(0)
    x = torch.randn(5, 2, 3, 7, 9)
    assert torch.equal(vmap(max_pool2x2)(x), _reference_pool(x))
    per_sample = vmap(grad(lambda t: max_pool2x2(t).square().sum()))(x)
    xr = x.clone().requires_grad_()
    _reference_pool(xr).square().sum().backward()
    assert torch.equal(per_sample, xr.grad)
    # Unbatched input, batched cotangents (rows of a Jacobian).
    y, pullback = vjp(max_pool2x2, x[0])
    cotangents = torch.randn(4, *y.shape)
    rows = vmap(pullback)(cotangents)[0]
    xr = x[0].clone().requires_grad_()
    expected = [torch.autograd.grad(_reference_pool(xr), xr, c)[0] for c in cotangents]
    assert torch.equal(rows, torch.stack(expected))
    tangent = torch.randn_like(x)
    _, forward_grad = jvp(max_pool2x2, (x,), (tangent,))
    assert torch.equal(forward_grad, jvp(_reference_pool, (x,), (tangent,))[1])


# ---------------------------------------------------------------------------------------------
# torch.func: stacked models and BatchNorm buffers


def _moon_reference(params, x):
    """MOON's SimpleCNN_header + ModelFedCon written with F.max_pool2d."""
    p = params
    h = F.max_pool2d(F.relu(F.conv2d(x, p["features.conv1.weight"], p["features.conv1.bias"])), 2)
    h = F.max_pool2d(F.relu(F.conv2d(h, p["features.conv2.weight"], p["features.conv2.bias"])), 2)
    h = F.relu(F.linear(h.flatten(1), p["features.fc1.weight"], p["features.fc1.bias"]))
    h = F.relu(F.linear(h, p["features.fc2.weight"], p["features.fc2.bias"]))
    z = F.linear(F.relu(F.linear(h, p["l1.weight"], p["l1.bias"])), p["l2.weight"], p["l2.bias"])
    return z, F.linear(z, p["l3.weight"], p["l3.bias"])


def test_vmap_grad_over_stacked_moon_cnn_matches_per_model_autograd():
    torch.manual_seed(0)
    models = [build_model("moon_cnn", (3, 32, 32), 10) for _ in range(3)]
    x, y = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))
    stacked, _ = stack_module_state(models)

    def loss(params):
        out = functional_call(models[0], params, (x,))
        return F.cross_entropy(out.logits, y) + 0.1 * out.z.square().mean()

    grads = vmap(grad(loss))(stacked)
    for i, model in enumerate(models):
        params = {k: v.detach().requires_grad_() for k, v in model.named_parameters()}
        z, logits = _moon_reference(params, x)
        ref_loss = F.cross_entropy(logits, y) + 0.1 * z.square().mean()
        ref = torch.autograd.grad(ref_loss, list(params.values()))
        for name, g_ref in zip(params, ref):
            torch.testing.assert_close(grads[name][i], g_ref, atol=1e-5, rtol=1e-4)


def _stem_stats(params, x):
    """Running mean/var of the stem BatchNorm after one training step from (0, 1)."""
    a = F.conv2d(x, params["features.0.weight"], padding=1)
    mean = a.mean(dim=(0, 2, 3))
    var = a.var(dim=(0, 2, 3), unbiased=True)
    return 0.1 * mean, 0.9 + 0.1 * var


def test_batchnorm_buffers_updated_through_functional_call():
    torch.manual_seed(0)
    model = build_model("resnet18", (3, 16, 16), 10).train()
    params = dict(model.named_parameters())
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    x = torch.randn(4, 3, 16, 16)
    functional_call(model, (params, buffers), (x,))
    mean, var = _stem_stats(params, x)
    torch.testing.assert_close(buffers["features.1.running_mean"], mean)
    torch.testing.assert_close(buffers["features.1.running_var"], var)
    assert buffers["features.1.num_batches_tracked"].item() == 1
    assert torch.equal(model.features[1].running_mean, torch.zeros(64))  # module untouched


def test_batchnorm_buffers_updated_under_vmap_over_stacked_models():
    torch.manual_seed(0)
    models = [build_model("resnet18", (3, 16, 16), 10).train() for _ in range(2)]
    params, buffers = stack_module_state(models)
    x = torch.randn(4, 3, 16, 16)
    vmap(lambda p, b: functional_call(models[0], (p, b), (x,)).logits)(params, buffers)
    for i, model in enumerate(models):
        mean, var = _stem_stats(dict(model.named_parameters()), x)
        torch.testing.assert_close(buffers["features.1.running_mean"][i], mean)
        torch.testing.assert_close(buffers["features.1.running_var"][i], var)
