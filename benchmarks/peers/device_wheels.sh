#!/usr/bin/env bash
# Wheels of pfl 0.6.0 and what it needs beyond a PyTorch image (numpy, scipy, absl-py,
# attrs, wrapt, packaging), for a GPU machine that cannot reach the package registries:
# download them here, carry the folder there, install them there without the network.
#
#   bash benchmarks/peers/device_wheels.sh [DIR] [PYTHON_VERSION]     # here (default: .whl, 3.12)
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site DIR/*.whl   # there
#   export PYTHONPATH=/tmp/site:$PWD/src                                       # there: pfl and contrafl
#
# pfl pins dp-accounting below 0.6 (0.5.0 here); dm-tree is dp-accounting's compiled need.
set -eu
dir=${1:-.whl}; version=${2:-3.12}
mkdir -p "$dir"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$version" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$dir" \
    pfl==0.6.0 dp-accounting==0.5.0 "dm-tree~=0.1.8" "multiprocess>=0.70.15,<0.71" "dill>=0.4.1" prv-accountant==0.2.0
ls "$dir"
