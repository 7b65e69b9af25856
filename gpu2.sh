set -u
T0=$(date +%s)
R=$PWD
mkdir -p /tmp/pkg && cp -r fused_contrastive /tmp/pkg/ && cp -r kernels /tmp/pkg/fused_contrastive/kernels
export PYTHONPATH=/tmp/pkg
export TRITON_DEFAULT_FP_FUSION=1
cd /tmp
python $R/bench/gpu_profile.py --n 65536 --losses info_nce,simcse,clip --rows 8 --configs stats > $OUT/profile.txt 2>&1
grep -v "^  \|^$\|Warn\|warn" $OUT/profile.txt | tail -20
echo "profile done at $(( $(date +%s) - T0 )) s"
python -m fused_contrastive check --gpu-validate --budget $(( 370 - ($(date +%s) - T0) )) --jobs 8 > $OUT/gpu_validate.txt 2>&1
echo "rc $?"
grep "FAIL\|timing\|verdict\|prefer" $OUT/gpu_validate.txt | grep -v "not run" | tail -40
echo "all done at $(( $(date +%s) - T0 )) s"
