"""A reference-style local-training loop, as in MOON's official code (QinbinLi/MOON).

This is the baseline the benchmarks compare against: clients trained one after another,
each with its own ``DataLoader`` over a ``Dataset`` whose ``__getitem__`` applies MOON's
CIFAR-10 training transform to one sample at a time (``ToTensor`` → reflect pad 4 →
``ToPILImage`` → ``ColorJitter(brightness=0)`` → ``RandomCrop(32)`` →
``RandomHorizontalFlip`` → ``ToTensor`` → ``Normalize``), MOON's ``SimpleCNN`` with
``nn.MaxPool2d`` and its ``ModelFedCon`` head, a fresh ``torch.optim.SGD`` per client and
the loss of ``train_net`` (FedAvg) or ``train_net_fedcon`` (MOON). torchvision's
transforms are written out with PIL and torch because torchvision is not a dependency.
"""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image
from torch import nn
from torch.nn import functional as F

MEAN = torch.tensor([125.3, 123.0, 113.9]).view(3, 1, 1) / 255.0
STD = torch.tensor([63.0, 62.1, 66.7]).view(3, 1, 1) / 255.0
_COS = nn.CosineSimilarity(dim=-1)


class SimpleCNNHeader(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.relu = nn.ReLU()
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)

    def forward(self, x):
        x = self.pool(self.relu(self.conv1(x)))
        x = self.pool(self.relu(self.conv2(x)))
        x = x.view(-1, 16 * 5 * 5)
        x = self.relu(self.fc1(x))
        return self.relu(self.fc2(x))


class ModelFedCon(nn.Module):
    def __init__(self, out_dim: int = 256, n_classes: int = 10):
        super().__init__()
        self.features = SimpleCNNHeader()
        self.l1 = nn.Linear(84, 84)
        self.l2 = nn.Linear(84, out_dim)
        self.l3 = nn.Linear(out_dim, n_classes)

    def forward(self, x):
        h = self.features(x).squeeze()
        x = F.relu(self.l1(h))
        x = self.l2(x)
        return h, x, self.l3(x)


def _to_tensor(img: Image.Image) -> torch.Tensor:
    arr = np.array(img, copy=True)
    return torch.from_numpy(arr).permute(2, 0, 1).contiguous().float().div(255)


def moon_train_transform(img: np.ndarray) -> torch.Tensor:
    """MOON's CIFAR-10 ``transform_train`` on one HWC uint8 image."""
    x = _to_tensor(Image.fromarray(img))  # ToTensor
    x = F.pad(x.unsqueeze(0), (4, 4, 4, 4), mode="reflect").squeeze()  # Lambda(pad, reflect)
    pil = Image.fromarray(x.mul(255).byte().permute(1, 2, 0).numpy())  # ToPILImage
    torch.randperm(4)  # ColorJitter(brightness=0): draws an order, changes nothing
    i, j = int(torch.randint(0, 9, (1,))), int(torch.randint(0, 9, (1,)))  # RandomCrop(32)
    pil = pil.crop((j, i, j + 32, i + 32))
    if torch.rand(1) < 0.5:  # RandomHorizontalFlip
        pil = pil.transpose(Image.FLIP_LEFT_RIGHT)
    return _to_tensor(pil).sub_(MEAN).div_(STD)  # ToTensor, Normalize


class CIFAR10Truncated(torch.utils.data.Dataset):
    """MOON's ``CIFAR10_truncated``: the rows of one party, transformed per sample."""

    def __init__(self, images_hwc: np.ndarray, labels: np.ndarray):
        self.data, self.target = images_hwc, labels

    def __getitem__(self, index):
        return moon_train_transform(self.data[index]), int(self.target[index])

    def __len__(self):
        return len(self.data)


def local_step(algorithm: str, net, global_net, prev_nets, optimizer, x, target, mu=5.0, temperature=0.5) -> None:
    """One optimiser step of ``train_net`` (FedAvg) or ``train_net_fedcon`` (MOON)."""
    optimizer.zero_grad()
    _, pro1, out = net(x)
    if algorithm == "moon":
        _, pro2, _ = global_net(x)
        logits = _COS(pro1, pro2).reshape(-1, 1)
        for previous_net in prev_nets:
            _, pro3, _ = previous_net(x)
            logits = torch.cat((logits, _COS(pro1, pro3).reshape(-1, 1)), dim=1)
        logits /= temperature
        labels = torch.zeros(x.size(0)).long()
        loss = F.cross_entropy(out, target) + mu * F.cross_entropy(logits, labels)
    else:
        loss = F.cross_entropy(out, target)
    loss.backward()
    optimizer.step()


def frozen_copy(state: dict) -> ModelFedCon:
    """A ``ModelFedCon`` holding ``state`` in eval mode without gradients (MOON's global
    and previous models)."""
    net = ModelFedCon()
    net.load_state_dict(state)
    net.eval()
    for p in net.parameters():
        p.requires_grad = False
    return net


def client_optimizer(net: nn.Module, lr: float = 0.01) -> torch.optim.SGD:
    """MOON's client optimiser (``args.optimizer == 'sgd'``)."""
    return torch.optim.SGD(filter(lambda p: p.requires_grad, net.parameters()), lr=lr,
                           momentum=0.9, weight_decay=1e-5)


def train_clients(algorithm: str, images_hwc, labels, parts, epochs, global_state, prev_states,
                  lr=0.01, mu=5.0, temperature=0.5, batch_size=64) -> int:
    """Train every party in ``parts`` (lists of rows) one after another; returns the
    number of samples processed in local steps."""
    global_net = frozen_copy(global_state)
    processed = 0
    for cid, rows in enumerate(parts):
        net = ModelFedCon()
        net.load_state_dict(global_state)
        prev_nets = [frozen_copy(prev_states[cid])] if algorithm == "moon" else []
        loader = torch.utils.data.DataLoader(CIFAR10Truncated(images_hwc[rows], labels[rows]),
                                             batch_size=batch_size, shuffle=True, drop_last=True)
        optimizer = client_optimizer(net, lr)
        net.train()
        for _ in range(epochs):
            for x, target in loader:
                local_step(algorithm, net, global_net, prev_nets, optimizer, x, target.long(), mu, temperature)
                processed += len(x)
    return processed


def arithmetic_only(algorithm: str, steps: int, global_state, prev_state, batch_size=64) -> int:
    """``steps`` of the reference's local steps on batches already in memory (normalised
    images, cycled through :func:`batch_pool`): its model and loss with no data pipeline
    (no loading, augmentation or collation)."""
    pool = batch_pool(batch_size)
    global_net = frozen_copy(global_state)
    prev_nets = [frozen_copy(prev_state)] if algorithm == "moon" else []
    net = ModelFedCon()
    net.load_state_dict(global_state)
    optimizer = client_optimizer(net)
    net.train()
    for step in range(steps):
        x, target = pool[step % len(pool)]
        local_step(algorithm, net, global_net, prev_nets, optimizer, x, target)
    return steps * batch_size


def batch_pool(batch_size: int = 64, batches: int = 32) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Seeded CIFAR-shaped batches of normalised images and random labels, about one
    epoch of a client of 2,000 images. (Training on one batch over and over is no
    stand-in: the model memorises it, and the shrinking gradients reach subnormal floats,
    which slow the CPU down.)"""
    generator = torch.Generator().manual_seed(0)
    return [(torch.randn(batch_size, 3, 32, 32, generator=generator), torch.randint(0, 10, (batch_size,), generator=generator))
            for _ in range(batches)]
