cd /work/main
G=~/.cache/edgeserve/bench/qwen35-0.8b-mtp-Q4_K_M.gguf
G2=~/.cache/edgeserve/bench/qwen35-2b-mtp-Q4_K_M.gguf
for round in 1 2 3; do
 for side in before after; do
  for m in $G $G2; do
   if [ $side = before ]; then SD="--source-dir /tmp/base/kernels/cpu"; else SD=""; fi
   echo "### round $round side $side model $(basename $m)"
   OMP_NUM_THREADS=1 EDGESERVE_THREADS=1 .venv/bin/python benchmarks/engine/profile_fused_step.py --model $m --batch 1 --rows 1,3,4 --reps 20 $SD 2>/dev/null | grep median_per_step
  done
 done
done
