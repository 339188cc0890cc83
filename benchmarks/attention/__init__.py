"""Benchmark and GPU checks of kernels.sparse_attention (run on an H200).

    python -m benchmarks.attention --check            # bf16/fp16 fwd + grads vs the fp32 naive reference
    python -m benchmarks.attention --tune             # time a few (BM, BN, warps, stages, grid order) per kernel
    python -m benchmarks.attention --tune --apply-tuned --check --bench --csv grid.csv --check-csv check.csv
    python -m benchmarks.attention --csv out.csv      # the benchmark grid (default)
    python -m benchmarks.attention --rounds 3 --csv out.csv   # each point 3 times, implementations in turn: medians
    python -m benchmarks.attention --no-packed --lengths 131072 --csv part.csv   # part of the grid (split over calls)
    python -m benchmarks.attention --selection        # selection time vs fwd+bwd, 3 repeats
    python -m benchmarks.attention --kernels --sparsities 0.9,0.95   # per-kernel times on the fair batch
    python -m benchmarks.attention --flex-variants    # Flex's compile modes and tile options against ours

Grid: single sequences L in {8K, 32K, 128K} x sparsity {0, .5, .75, .9, .95} and a packed 64K-token batch of
long-tail documents; H=16, D=128, bf16, block 128. Sparsity s means ``kept_fraction = 1 - s`` (selection by
routing score, diagonal always kept). Compared in the same run: FlexAttention (``torch.compile(flex_attention)``
in ``--flex-mode``, by default max-autotune-no-cudagraphs, its fastest construction measured, with a BlockMask
built from the very same selection) and cuDNN SDPA (dense causal). Effective TFLOP/s count the
attended (query, key) pairs of kept blocks: fwd = 4*D*pairs*Hq, fwd+bwd = 3.5x that. If a config fails its
error is recorded in the CSV and the run continues.
"""
