set -x
nvidia-smi --query-gpu=name,clocks.sm,power.draw --format=csv
timeout 240 python3 lab/bwd_overlap_lab8.py $OUT 2>&1 | tee $OUT/lab8.log
python3 - <<'PY' || exit 0
import csv, math, os, sys
rows = list(csv.DictReader(open(os.environ["OUT"] + "/bwd_overlap_lab8_h200.csv")))
g = math.exp(sum(math.log(float(r["fb_new_over_old"])) for r in rows) / len(rows))
print("geomean fb_new_over_old", g)
sys.exit(0 if g > 1.0 else 1)
PY
timeout 330 python3 benchmarks/attention.py --check --bench --deadline-s 170 --csv $OUT/grid.csv --check-csv $OUT/check.csv 2>&1 | tail -60
