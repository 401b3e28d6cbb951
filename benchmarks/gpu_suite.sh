#!/usr/bin/env bash
# The GPU result sets: peak device memory by depth, step time, and memory by sequence length,
# measured on one accelerator (the allocator's high-water mark, `revtrain.memory`). Each
# configuration runs in a fresh process, as on CPU. Run from the repository root on a
# machine with JAX for CUDA and revtrain's dependencies:
#
#   bash benchmarks/gpu_suite.sh OUT_DIR [memory|sequence|all]
#
# Writes OUT_DIR/<set>_gpu/{*.json,*.md,*.png} and OUT_DIR/gpu_results.tgz of all of them.
# Sizes: a d_model 1024 model on 2,048-token sequences for depth and step time (the CPU sets
# use d_model 256 on 512 tokens), the sequence-length set's CPU model at up to 1,048,576
# tokens.
set -uo pipefail
out=${1:?usage: gpu_suite.sh OUT_DIR [memory|sequence|all]}
part=${2:-all}
cd "$(dirname "$0")/.."
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
mkdir -p "$out"
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
size=(--d_model=1024 --d_ff=4096 --n_heads=8 --seq_len=2048 --batch_size=8 --vocab_size=256)
status=0
if [ "$part" = memory ] || [ "$part" = all ]; then
  timeout 330 python3 benchmarks/memory_vs_depth.py "${size[@]}" --depths=2,8,32 \
    --trainers=trainer,trainer_remat,reversible,memory_efficient --jobs=3 \
    --out_dir="$out/memory_vs_depth_gpu" || status=$?
  timeout 200 python3 benchmarks/step_time.py "${size[@]}" --depths=16 \
    --trainers=trainer,reversible,memory_efficient --steps=5 --warmup=2 \
    --out_dir="$out/step_time_gpu" || status=$?
fi
if [ "$part" = sequence ] || [ "$part" = all ]; then
  timeout 420 python3 benchmarks/sequence_length.py \
    --lengths=16384,65536,262144,1048576 --full_max_length=16384 \
    --attention_kinds=full,blockwise_chunked,lsh --out_dir="$out/sequence_length_gpu" \
    || status=$?
fi
tar -czf "$out/gpu_results.tgz" -C "$out" $(cd "$out" && ls -d *_gpu 2>/dev/null)
exit $status
