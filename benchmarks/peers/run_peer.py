"""Run a peer's script unchanged, made to run on this machine:

    python benchmarks/peers/run_peer.py PATH/TO/main.py [its arguments ...]

Before ``runpy.run_path(main.py, run_name="__main__")`` (in the script's folder, with that
folder first on ``sys.path``, as ``cd DIR && python main.py`` would have it):

* where PyTorch sees no CUDA device, ``torch.Tensor.cuda`` and ``torch.nn.Module.cuda``
  return their object unchanged, so that a script's unconditional ``.cuda()`` calls
  (the official MOON code's) leave tensors and models on the CPU;
* torchvision's CIFAR checksums are accepted (``CIFAR10._check_integrity`` and the
  meta file's ``check_integrity``), so that the 10% CIFAR-10 subset in the official
  python format loads like the full files. Nothing is downloaded: files that are not
  there still fail to load;
* where the script's folder has a ``utils.py`` with ``compute_accuracy`` /
  ``compute_loss`` (the official MOON code's), these get a CPU ``torch.device`` as the
  string ``"cpu"``: they test ``device == 'cpu'``, which is False for a ``torch.device``
  in current PyTorch, and then leave their loss function unset on the CPU.

Nothing of the peer's own files is edited.
"""

import os
import runpy
import sys


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    script = os.path.abspath(sys.argv[1])
    sys.argv = [script] + sys.argv[2:]

    import torch

    if not torch.cuda.is_available():
        torch.Tensor.cuda = lambda self, *args, **kwargs: self
        torch.nn.Module.cuda = lambda self, *args, **kwargs: self

    import torchvision.datasets.cifar as cifar

    cifar.CIFAR10._check_integrity = lambda self: True
    cifar.check_integrity = lambda *args, **kwargs: True

    folder = os.path.dirname(script)
    os.chdir(folder)
    sys.path.insert(0, folder)
    if os.path.exists(os.path.join(folder, "utils.py")):
        import importlib

        utils = importlib.import_module("utils")
        for name in ("compute_accuracy", "compute_loss"):
            fn = getattr(utils, name, None)
            if callable(fn):
                setattr(utils, name, _cpu_device_as_str(fn))
    runpy.run_path(script, run_name="__main__")


def _cpu_device_as_str(fn):
    import functools

    import torch

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        device = kwargs.get("device")
        if isinstance(device, torch.device) and device.type == "cpu":
            kwargs["device"] = "cpu"
        return fn(*args, **kwargs)

    return wrapper


if __name__ == "__main__":
    main()
