#!/usr/bin/env bash
# The GPU measurements of docs/performance.md in one go, each step capped in time and
# logged, most important first, so that a short lease still brings back the first ones:
#   1. the CUDA tests: executors against each other, against the CPU, and steps replayed
#      from CUDA graphs against eager steps (tests/test_cuda.py)
#   2. MOON's CIFAR-10 round in the paper's setting (round_time.py), vectorized fp32 with
#      CUDA graphs, without and with the finished clients padded (pad_finished_clients=true:
#      one graph per phase), and contrafl's FedAvg against PFLlib's on the same GPU
#      (peers/pfllib.py), without and with padding: the measurement that decides whether
#      padding becomes the default on a GPU
#   3. MOON against PFLlib (fp32 and bf16), the round in bf16 and with every step launched
#      eagerly, and local-training throughput (throughput.py): figures measured before
#
#   bash benchmarks/gpu.sh CIFAR_DIR PFLLIB_CHECKOUT LOG_DIR
#
# CIFAR_DIR: a cifar-10-batches-py folder (the subset in ../shared/data works); PFLLIB_CHECKOUT:
# see benchmarks/peers/README.md (the PFLlib step is skipped when it is "-").
set -u
data=${1:?CIFAR_DIR}; pfllib=${2:?PFLLIB_CHECKOUT or -}; logs=${3:?LOG_DIR}
here=$(cd "$(dirname "$0")" && pwd)
. "$here/_steps.sh"

step cuda_tests 150 python3 -m pytest -q -p no:cacheprovider "$here/../tests/test_cuda.py" \
    "$here/../tests/test_augment.py" "$here/../tests/test_representation.py" -k "cuda"
step round_time_fp32 90 python3 "$here/round_time.py" --device cuda --executor vectorized --precision fp32
step round_time_padded 90 python3 "$here/round_time.py" --device cuda --executor vectorized --precision fp32 --pad-finished-clients
if [ "$pfllib" != "-" ]; then
    step pfllib_fedavg 90 python3 "$here/peers/pfllib.py" --pfllib "$pfllib" --data-dir "$data" --device cuda \
        --algorithms fedavg --repeats 1 --work /tmp/contrafl-peers/pfllib
    step pfllib_fedavg_padded 60 python3 "$here/peers/pfllib.py" --pfllib "$pfllib" --data-dir "$data" --device cuda \
        --algorithms fedavg --repeats 1 --contrafl pad_finished_clients=true --work /tmp/contrafl-peers/pfllib-padded
    step pfllib_moon 120 python3 "$here/peers/pfllib.py" --pfllib "$pfllib" --data-dir "$data" --device cuda \
        --algorithms moon --repeats 1 --bf16 --work /tmp/contrafl-peers/pfllib-moon
fi
step round_time_bf16 90 python3 "$here/round_time.py" --device cuda --executor vectorized --precision bf16
step round_time_eager 90 python3 "$here/round_time.py" --device cuda --executor vectorized --precision fp32 --no-cuda-graphs
step throughput 80 python3 "$here/throughput.py" --device cuda --algorithms moon --clients 10,100 \
    --modes sequential,vectorized
