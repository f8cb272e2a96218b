# Sourced by the GPU scripts (gpu.sh, gpu_peers.sh) after they set $logs: unbuffered
# Python, the LOG_DIR folder, the GPU and torch printed, and `step`, which runs one
# measurement with a time cap, so that a short lease still brings back the first ones.
mkdir -p "$logs"
export PYTHONUNBUFFERED=1
STEP_TAIL=${STEP_TAIL:-25}  # lines of each step's log printed when it ends
step() {  # step NAME SECONDS COMMAND...: run it with a time cap, log to LOG_DIR/NAME.log
    local name=$1 cap=$2; shift 2
    echo "=== $name ($(date +%T), cap ${cap}s): $*"
    local start=$SECONDS
    timeout "$cap" "$@" > "$logs/$name.log" 2>&1
    local rc=$?
    tail -n "$STEP_TAIL" "$logs/$name.log"
    echo "=== $name: exit $rc after $((SECONDS - start)) s"
}
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"
