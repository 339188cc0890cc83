set -x
nvidia-smi --query-gpu=name,clocks.sm,power.draw --format=csv
python3 -c "import hypothesis, pytest" 2>/dev/null || pip install -q hypothesis pytest 2>&1 | tail -1
timeout 90 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_sparse_attention.py -k "overlapped or delta_prepass or fused_triton_selection or matches_naive" 2>&1 | tail -3
timeout 150 python3 lab/bwd_overlap_lab8.py $OUT 2>&1 | tee $OUT/lab8b.log
timeout 300 python3 benchmarks/attention.py --check --bench --deadline-s 150 --csv $OUT/grid.csv --check-csv $OUT/check.csv > $OUT/grid.log 2>&1
tail -30 $OUT/grid.log
