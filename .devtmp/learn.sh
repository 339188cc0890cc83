. runner/h200_env.sh
gpu_environment > $OUT/environment.txt 2>&1
mkdir -p $OUT/runs
for pol in baseline sparsebalance; do
  d=$OUT/runs/retrieval_${pol}_s0
  timeout 205 python3 -m torch.distributed.run --standalone --nproc_per_node=1 -m runner.train +experiment=learning \
    hydra.run.dir=$d runner.task.kind=retrieval policy=$pol seed=0 steps=2000 runner.checkpoint_every=250 \
    workload.min_len=96 workload.max_len=512 workload.median=128 runner.lr=1e-3 runner.lr_schedule=cosine \
    runner.warmup_steps=20 runner.min_lr_ratio=0.1 > $OUT/runs/$pol.train.log 2>&1
  echo "$pol train rc=$? steps=$(($(wc -l < $d/train.csv) - 1))" >> $OUT/runs/status.txt
  timeout 35 python3 -m runner.evaluate $d --lengths 128,256,512 --p 1.0,0.9,0.8 --sequences 64 > $OUT/runs/$pol.eval.log 2>&1
  echo "$pol eval rc=$?" >> $OUT/runs/status.txt
  rm -f $d/checkpoint.pt; gzip -f $d/plans.jsonl
done
cat $OUT/runs/status.txt; tail -12 $OUT/runs/*.eval.log
