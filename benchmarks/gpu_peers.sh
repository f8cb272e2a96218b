#!/usr/bin/env bash
# Issue #36 item 6 on one GPU, in one call (or one per shape): contrafl against pfl-research (pfl 0.6.0) on
# equal work (checked: benchmarks/peers/pfl_research.py), both shapes, one seed. pfl
# in one process and with 2 and 4 processes sharing the GPU (its docs' advice for small
# models); contrafl's vectorized executor with CUDA graphs (executor=auto on a GPU) and
# its persistent workers (executor=distributed, 2 and 4 ranks sharing the GPU, each stacking
# its share of the clients: rank_executor=auto), each shape after
# a profile of contrafl's round (round_profile.py: where the round's time goes). The device
# shape first; each step capped in time (at most 11 minutes in all) and logged, the tables
# at the end of each log. `convolutions` profiles the device shape's round three more ways,
# to read whether the grouped convolution that vmap makes (one group per client) bounds the
# steps: with cuDNN's timed algorithm choice, with each convolution as unfold + a batched
# matmul, and with both (round_profile.py --cudnn-benchmark, --unfold-conv).
#
#   bash benchmarks/gpu_peers.sh CIFAR_DIR LOG_DIR [ITEM ...]   # ITEM: device, silo, convolutions (default: device silo)
#   WHEELS=.whl bash benchmarks/gpu_peers.sh ...   # first install pfl from these wheels, without the network
#
# pfl must be importable: on a machine without the package registries, carry the wheels
# of benchmarks/peers/device_wheels.sh and name their folder in WHEELS.
set -u
data=$(cd "${1:?CIFAR_DIR}" && pwd) || exit 2; logs=${2:?LOG_DIR}  # the data by its absolute path: the programs run in their own folders
shapes=("${@:3}"); [ ${#shapes[@]} -gt 0 ] || shapes=(device silo)  # one per call on a short lease
here=$(cd "$(dirname "$0")" && pwd)
STEP_TAIL=30  # the tables at the end of each log
. "$here/_steps.sh"
if [ -n "${WHEELS:-}" ]; then  # device_wheels.sh's wheels, beside the torch of the machine
    python3 -m pip install -q --no-index --no-deps --target /tmp/pfl-site "$WHEELS"/*.whl || exit 2
    export PYTHONPATH=/tmp/pfl-site:$here/../src${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -c "import importlib.metadata as m; print('pfl', m.version('pfl'))" || { echo "pfl is not installed: see benchmarks/peers/device_wheels.sh"; exit 2; }
contrafl=("device=cuda" "device=cuda executor=distributed workers=2" "device=cuda executor=distributed workers=4")  # ranks stack their shares (rank_executor=auto)
for shape in "${shapes[@]}"; do
    case $shape in device|silo) ;;
    convolutions)
        for how in "--cudnn-benchmark" "--unfold-conv" "--unfold-conv --cudnn-benchmark"; do
            name=$(echo "$how" | tr -d '-' | tr ' ' '_')
            step "round_profile_device_$name" 90 python3 "$here/round_profile.py" --data-dir "$data" --shape device \
                --device cuda $how
        done
        continue;;
    *) echo "unknown item $shape: expected device, silo or convolutions"; exit 2;; esac
    step "round_profile_$shape" 90 python3 "$here/round_profile.py" --data-dir "$data" --shape $shape --device cuda
    step "pfl_$shape" $([ $shape = device ] && echo 400 || echo 160) python3 "$here/peers/pfl_research.py" \
        --data-dir "$data" --shape $shape --seeds 1 --configs single torchrun --processes 2 4 \
        --contrafl "${contrafl[@]}" --work "/tmp/contrafl-peers/gpu-$shape" --json "$logs/pfl_$shape.json"
done
