"""sim.memory prices the kernel's block selection at the sizes the GPU path allocates: hand-computed bytes for
each kind of selection, and the same formula against the tensors the fused Triton selection really builds
(run through the Triton interpreter in a child process, which must set TRITON_INTERPRET before Triton loads)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from sparsebalance.sim.memory import selection_bytes

ROOT = Path(__file__).resolve().parents[2]
# block 16: documents of 3, 1 and 5 blocks (the last one partial); NB = 9, widest W = 5, causal pairs C = 22
LENGTHS = [40, 16, 70]
ONE_GROUP = np.zeros(3, dtype=int)


def test_top_p_lists_are_as_wide_as_the_longest_document_whatever_p_keeps():
    # 2 KV heads x int32: q2k_idx + q2k_start 2 x 9 x 5, counts 9, reverse lists 3 x C = 22 (every causal
    # pair); once: the row pointer's + 1, the two row-class block ends 2 x 9, fp32 kept and coverage 2 x 3
    expected = 4 * (2 * (2 * 9 * 5 + 2 * 9 + 3 * 22) + 1 + 2 * 9 + 2 * 3)
    assert expected == 1492
    for kept in (0.2, 0.6):
        per_layer, shared = selection_bytes(LENGTHS, [kept] * 3, ONE_GROUP, 1, kv_heads=2, block_size=16)
        assert per_layer.tolist() == [expected] and shared.tolist() == [0.0]


def test_top_k_lists_are_sized_from_the_budgets():
    # a 40-block document at kept 0.1 keeps round(4.0) = 4 blocks of its last row: width 4 + 16 tie slots = 20;
    # its rows 0..19 hold their causal blocks (210), rows 20..39 the width (20 x 20); the 2-block one both (3)
    per_layer, shared = selection_bytes([640, 32], [0.1, 0.1], np.zeros(2, dtype=int), 1, kv_heads=1,
                                        block_size=16, topk=[True, True])
    expected = 4 * (2 * 42 * 20 + 2 * 42 + 1 + 3 * (210 + 400 + 3) + 2 * 2)
    assert per_layer.tolist() == [expected] and shared.tolist() == [0.0]


def test_dense_selection_is_shared_and_its_reverse_lists_cover_every_slot():
    # 2 heads x (5 lists of 9 x 5 slots + counts 9 + pointer 9) + the pointer's 1 + one fp32 stats tensor [3]
    per_layer, shared = selection_bytes(LENGTHS, [1.0] * 3, ONE_GROUP, 1, kv_heads=2, block_size=16)
    assert per_layer.tolist() == [0.0] and shared.tolist() == [4 * (2 * (5 * 9 * 5 + 2 * 9) + 1 + 3)]


def test_micro_batches_are_priced_apart_and_an_empty_one_holds_nothing():
    per_layer, _ = selection_bytes([*LENGTHS, 16], [0.5] * 4, np.array([0, 0, 0, 1]), 3, kv_heads=2,
                                   block_size=16)
    one_block = 4 * (2 * (2 * 1 * 1 + 2 * 1 + 3 * 1) + 1 + 2 * 1 + 2 * 1)
    assert per_layer.tolist() == [1492, one_block, 0.0]


KERNEL_SCRIPT = r"""
import json, sys
import torch
from sparsebalance.kernels.sparse_attention import KernelOptions, select_blocks

def allocated(sel):
    layout = {t.untyped_storage().data_ptr() for t in vars(sel.layout).values() if isinstance(t, torch.Tensor)}
    tensors = [t for t in vars(sel).values() if isinstance(t, torch.Tensor)] + list(sel.row_class_end or ())
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(n for ptr, n in storages.items() if ptr not in layout)

out = []
for case in json.loads(sys.argv[1]):
    torch.manual_seed(0)
    lengths, hkv = case["lengths"], case["kv_heads"]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(sum(lengths), 2 * hkv, 16)
    k = torch.randn(sum(lengths), hkv, 16)
    budget = torch.full((len(lengths),), case["budget"])
    mode = {"kept_fraction": budget} if case["topk"] else {"p": budget}
    sel = select_blocks(q, k, cu, block_size=16, options=KernelOptions(selection="triton", precompile=False), **mode)
    out.append(allocated(sel))
print(json.dumps(out))
"""

CASES = [
    {"lengths": LENGTHS, "kv_heads": 2, "budget": 0.5, "topk": False},
    {"lengths": [640, 32, 200], "kv_heads": 1, "budget": 0.3, "topk": False},
    {"lengths": [640, 32, 200], "kv_heads": 2, "budget": 0.1, "topk": True},
    {"lengths": LENGTHS, "kv_heads": 2, "budget": 1.0, "topk": False},
]


@pytest.mark.slow
def test_priced_bytes_are_what_the_fused_selection_allocates():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", KERNEL_SCRIPT, json.dumps(CASES)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    if proc.returncode != 0 and "No module named 'triton'" in proc.stderr:
        pytest.skip("Triton is not installed")
    assert proc.returncode == 0, proc.stderr[-3000:]
    measured = json.loads(proc.stdout.splitlines()[-1])
    for case, nbytes in zip(CASES, measured, strict=True):
        n = len(case["lengths"])
        per_layer, shared = selection_bytes(case["lengths"], [case["budget"]] * n, np.zeros(n, dtype=int), 1,
                                            case["kv_heads"], 16, topk=[case["topk"]] * n)
        assert per_layer[0] + shared[0] == nbytes, case
