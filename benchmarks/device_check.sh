#!/usr/bin/env bash
# The device check of issue 28 in one command: CPU against GPU for the batched jobs in flight.
#
#   bash benchmarks/device_check.sh [tiny]     (from anywhere; PYTHON=... picks the interpreter)
#
# Prints, on a host with CUDA (about 5 minutes on one H100/H200 host; tiny: a minute, to check it runs):
#   1. bench_device.py: the paper's run (Rescaled, C = 10) and a population (vanilla ASGD, N = C = 100),
#      one by one (--no-batch) / batched / batched --workers 2 on the CPU, batched on cuda, and the
#      bare loops (CPU, 1 thread; cuda): each a whole run, median of interleaved repeats;
#   2. bench_userapp.py: the example app's CNN, its own ClientApp in process (workers 1, 2), the bare
#      loop (1, 2 threads) and the batched helper (vmap and one job after the other), with the GPU
#      hidden (everything on the CPU), then with it visible (the app's own ClientApp trains on cuda
#      there, the helper runs with --device cuda);
#   3. bench_stack.py: the MNIST stack on the CPU with one and with two worker processes (two is the
#      default where three cores are free), the loop alone (every gradient free) and the bare loops.
# Without a GPU the cuda rows are left out. Needs MNIST: the project's cache
# (~/.cache/fl_rescaled/mnist.npz, or the folder FL_RESCALED_CACHE names; copy it there first on a
# machine without the network) or the network.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
if [ "${1:-}" = "tiny" ]; then
  PAPER=20 POP=3 REPEATS=1 TRAININGS=10 UREPEATS=1 UPDATES=300
else
  PAPER=1000 POP=40 REPEATS=3 TRAININGS=60 UREPEATS=2 UPDATES=4000
fi
"$PY" - <<'PY'
import os, platform, torch, flwr
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), platform.processor())
gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
print(f"python {platform.python_version()}, torch {torch.__version__}, flwr {flwr.__version__}; "
      f"CPU {cpu} ({os.cpu_count()} cores), GPU {gpu}; load average {os.getloadavg()}", flush=True)
PY
GPU=$("$PY" -c "import torch; print(int(torch.cuda.is_available()))")
echo "== 1. the paper's run and a population (bench_device.py --paper-budget $PAPER --pop-budget $POP --repeats $REPEATS)"
"$PY" benchmarks/bench_device.py --paper-budget "$PAPER" --pop-budget "$POP" --repeats "$REPEATS"
U=(--no-flower --helper --helper-vmap both --trainings "$TRAININGS" --repeats "$UREPEATS")
echo "== 2a. the example app's CNN, GPU hidden (bench_userapp.py ${U[*]} --device cpu)"
CUDA_VISIBLE_DEVICES="" "$PY" benchmarks/bench_userapp.py "${U[@]}" --device cpu
if [ "$GPU" = 1 ]; then
  echo "== 2b. the example app's CNN, GPU visible (bench_userapp.py ${U[*]} --device cuda)"
  "$PY" benchmarks/bench_userapp.py "${U[@]}" --device cuda
fi
echo "== 3. the MNIST stack on the CPU (bench_stack.py --updates $UPDATES --repeats $REPEATS)"
CUDA_VISIBLE_DEVICES="" "$PY" benchmarks/bench_stack.py --updates "$UPDATES" --repeats "$REPEATS"
echo "== done"
