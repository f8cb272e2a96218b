#!/usr/bin/env bash
# pfl-research's CIFAR-10 "device" shape (issue #36) with contrafl's executors, each run a
# whole process, alternating executors, to compare them on one machine (CPU or GPU):
# FedAvg, MOON's CNN, 100 clients x ~50 images (iid over the CIFAR-10 subset), 50 per
# round, 1 local epoch of batch 10, SGD lr 0.1, drop_last=true as in docs/distributed.md's
# H200 figures (DROP_LAST=false keeps each client's partial last batch, as pfl does),
# the test set evaluated in the last round only.
#
#   bash benchmarks/device_shape.sh CIFAR_DIR DEVICE ROUNDS "EXECUTOR SETTINGS" ...
#   e.g. bash benchmarks/device_shape.sh ../shared/data/cifar-10-batches-py cuda 30 \
#          "executor=vectorized" "executor=distributed workers=2" "executor=sequential"
set -u
data=${1:?CIFAR_DIR}; device=${2:?DEVICE}; rounds=${3:?ROUNDS}; shift 3
python=${PYTHON:-python3}
common="dataset=cifar10 data_dir=$data allow_subset=true model=moon_cnn algorithm=fedavg num_clients=100
  partition=iid sample_fraction=0.5 local_epochs=1 batch_size=10 lr=0.1 momentum=0 weight_decay=0 drop_last=${DROP_LAST:-true}
  rounds=$rounds eval_every=$rounds device=$device seed=0 checkpoint_every=$rounds"
out=$(mktemp -d)
for pass in 1 2; do
    for settings in "$@"; do
        name=$(echo "$settings" | tr ' =' '_-')-$pass
        start=$(date +%s%N)
        $python -m contrafl run $common $settings --out "$out/$name" --quiet > "$out/$name.log" 2>&1
        rc=$?
        end=$(date +%s%N)
        acc=$($python -c "import json,sys; s=json.load(open('$out/$name/summary.json')); print(round(s['final']['test_acc'], 4))" 2>/dev/null)
        printf '%-40s pass %d: %6.1f s  exit %d  final accuracy %s\n' "$settings" "$pass" "$(( (end - start) / 1000000 ))e-3" "$rc" "$acc"
        [ $rc -eq 0 ] || tail -5 "$out/$name.log"
    done
done
