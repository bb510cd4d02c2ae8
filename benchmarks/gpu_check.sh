#!/usr/bin/env bash
# The GPU check (docs/performance.md, "The GPU check"): every GPU path run on CUDA and on the CPU path, compared
# within a tolerance, one table.
#
#   benchmarks/gpu_check.sh [--dry] [--fp32] [--out DIR] [--set KEY=VALUE ...]
#
#   --dry    the same steps at the smallest sizes with the CPU standing in for the GPU, on a machine without one
#            (tests/system/test_gpu_check.py runs it)
#   --fp32   the device side without TF32 (every tolerance 1e-4, see benchmarks/gpu_check.py)
#   --out    the folder for the result files and table.md (default: a new temporary folder)
#   --set    passed to raysim bench, e.g. --set dataset.root=/data (where Fashion-MNIST is)
#
# It runs the checkout's .venv/bin/python ($GPU_CHECK_PYTHON if set; python3 where neither is), which needs raysim's
# training code (torch, numpy, pydantic, numba) and for the hosts rows raysim's runtime (Ray, MLflow): without the
# runtime those rows are marked skipped.
#
# Exit status 1 when a check fails or a result is missing, 2 on a wrong argument or a missing GPU or package. About
# 4 minutes on one H100 with 16 CPU cores; the dry mode about a minute on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${GPU_CHECK_PYTHON:-$PWD/.venv/bin/python} # the checkout's environment, else the machine's python3
[ -x "$python" ] || python=$(command -v python3)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" # raysim from this checkout where it is not installed
device=cuda out="" dry=() fp32=() sets=()
value() { [ $# -ge 2 ] || { echo "gpu_check.sh: $1 needs a value (--out DIR, --set KEY=VALUE)" >&2 && exit 2; }; }
while [ $# -gt 0 ]; do
    case "$1" in
    --dry) dry=(--dry) device=cpu ;;
    --fp32) fp32=(--fp32) ;;
    --out) value "$@" && out=$2 && shift ;;
    --set) value "$@" && sets+=(--set "$2") && shift ;;
    -h | --help) sed -n '2,18p' "$0" && exit 0 ;;
    *) echo "gpu_check.sh: unknown argument $1 (allowed: --dry, --fp32, --out DIR, --set KEY=VALUE)" >&2 && exit 2 ;;
    esac
    shift
done
step() { "$python" benchmarks/gpu_check.py "$@"; }
step preflight --device "$device" >&2 || exit 2
out=${out:-$(mktemp -d -t gpu-check.XXXXXX)}
mkdir -p "$out"
rm -f "$out"/*.npz "$out"/hosts.json "$out"/hosts.skipped "$out"/table.md
echo "gpu check: results in $out" >&2

# 1. The vmap executor (MLP, CIFAR CNN at 1,000 clients), a ResNet8x4 round and FedSLR's GKR on the device, then
#    the same on the CPU path.
step run --side device --device "$device" --out "$out" "${dry[@]}" "${fp32[@]}" ||
    echo "gpu check: the device side failed (its rows are missing)" >&2
step run --side cpu --out "$out" "${dry[@]}" || echo "gpu check: the CPU side failed (its rows are missing)" >&2

# 2. Hosts with a GPU share of 0.25, 0.5 and 1 (and CPU hosts), their global model against raysim bench's torch loop
#    on the CPU. Dry: one declared GPU, the hosts in process, no CPU hosts' row (the same as the others there).
if [ ${#dry[@]} -gt 0 ]; then
    hosts=(--host-gpus 0.25 0.5 1 --clients 8 --chunk 4 --set runtime.num_gpus=1 --set runtime.actors=in_process)
else
    hosts=(--host-gpus 0 0.25 0.5 1 --clients 1000 --chunk 250)
fi
if [ ${#dry[@]} -gt 0 ] || step preflight --device "$device" --runtime >"$out/hosts.skipped"; then # dry: always, unasked
    rm -f "$out/hosts.skipped"
    "$python" -m raysim.cli bench --model mlp --rounds 3 --ways reference vectorized \
        --reference-device cpu "${hosts[@]}" "${sets[@]}" --json "$out/hosts.json" ||
        echo "gpu check: raysim bench failed (the hosts rows are missing)" >&2
fi

# 3. Every check compared, one table (also $out/table.md).
step table "$out"
