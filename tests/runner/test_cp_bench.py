"""runner.cp_bench's kept-work shares: a selection's work per CP rank, read off the kernel's selection, against
a count by hand and against sim.cp_shards's model where the model is exact (a dense selection and the
diagonal-only one)."""
import numpy as np
import pytest
import torch

from sparsebalance.kernels.sparse_attention import selection_from_mask
from sparsebalance.runner.cp import Shards, shard_bounds
from sparsebalance.runner.cp_bench import rank_shares, shares

B = 64


def selection(length: int, keep) -> object:
    """One sequence's selection keeping, in row r, the causal blocks where ``keep(r, c)``."""
    nb = -(-length // B)
    mask = torch.tensor([[keep(r, c) and c <= r for c in range(nb)] for r in range(nb)])[None]
    return selection_from_mask(mask, torch.tensor([0, length], dtype=torch.int32), block_size=B)


def counted(length: int, cp: int, per_row) -> list[float]:
    """Each rank's tokens times their row's kept blocks, token by token."""
    cuts = shard_bounds(length, cp)
    work = [sum(per_row[t // B] for j in (r, 2 * cp - 1 - r) for t in range(cuts[j], cuts[j + 1]))
            for r in range(cp)]
    return [w / sum(work) for w in work]


@pytest.mark.parametrize("length", [130, 1000, 1333])
@pytest.mark.parametrize("cp", [2, 3])
def test_rank_shares_count_every_token_of_every_rank(length, cp):
    per_row = torch.tensor([1.0 + (r * 7) % 5 for r in range(-(-length // B))], dtype=torch.float64)
    got = rank_shares(per_row, Shards.build(torch.tensor([0, length], dtype=torch.int32), cp, 0), B)
    np.testing.assert_allclose(got, counted(length, cp, per_row.tolist()), rtol=1e-12)


@pytest.mark.parametrize("length", [1000, 1333])
@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("keep", [lambda r, c: True, lambda r, c: c == r], ids=["dense", "diagonal"])
def test_the_model_matches_the_selection_where_it_is_exact(length, cp, keep):
    measured, model = shares(selection(length, keep), Shards.build(torch.tensor([0, length], dtype=torch.int32), cp, 0),
                             B, length)
    np.testing.assert_allclose(model, measured, atol=1e-9)
    assert sum(measured) == pytest.approx(1.0)
