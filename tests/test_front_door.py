"""sparsebalance.partition: lists, numpy arrays and torch tensors in, index lists and budgets out; the numpy-only
path for verl's balancing gives the Planner's Plan; bad input is one ValueError line; importing and calling it
loads none of the configuration and simulation stack."""
import json
import subprocess
import sys

import numpy as np
import pytest

import sparsebalance
from sparsebalance.front_door import _planner
from sparsebalance.sim.memory import MemoryLimitError
from sparsebalance.sim.plan import Budget

LENGTHS = [4096, 512, 30000, 1200, 8000, 700, 16000, 2048, 900, 3000, 5000, 12000, 640, 20000, 1500, 7000]
HEAVY = ("hydra", "omegaconf", "simpy", "scipy", "pandas")


def every_index_once(indices, n: int) -> bool:
    return sorted(i for rank in indices for mb in rank for i in mb) == list(range(n))


def test_a_list_an_array_and_a_tensor_give_the_same_partition():
    torch = pytest.importorskip("torch")
    out = sparsebalance.partition(LENGTHS, dp=4, micro_batches=2)
    assert sparsebalance.partition(np.array(LENGTHS, dtype=np.int32), dp=4, micro_batches=2) == out
    assert sparsebalance.partition(torch.tensor(LENGTHS), dp=4, micro_batches=2) == out
    assert len(out.indices) == 4 and all(len(rank) == 2 for rank in out.indices)
    assert every_index_once(out.indices, len(LENGTHS))


def test_budgets_are_the_policys_beside_each_index():
    sparse = sparsebalance.partition(LENGTHS, dp=2, micro_batches=2)
    dense = sparsebalance.partition(LENGTHS, dp=2, micro_batches=2, policy="verl_dense")
    assert dense.indices == sparse.indices  # the same balancer, another budget
    for out, p in ((sparse, 0.9), (dense, 1.0)):
        assert [[len(mb) for mb in rank] for rank in out.budgets] == [[len(mb) for mb in rank] for rank in out.indices]
        assert {b for rank in out.budgets for mb in rank for b in mb} == {Budget(p=p)}


@pytest.mark.slow  # composes the Planner of each layout (Hydra): seconds
@pytest.mark.parametrize("policy", ["verl", "verl_dense"])
@pytest.mark.parametrize("dp,micro_batches,pp,cp",
                         [(4, 2, 1, 1), (2, 4, 2, 1), (2, 3, 4, 1), (8, 1, 1, 1), (2, 2, 2, 2)])
def test_the_numpy_path_gives_the_planners_plan(policy, dp, micro_batches, pp, cp):
    lengths = np.random.default_rng(dp * 100 + micro_batches * 10 + pp).integers(64, 32768, size=3 * dp * micro_batches)
    cluster = "h100" if policy == "verl_dense" else None  # dense_best: a profile that prices the dense peers
    out = sparsebalance.partition(lengths, dp=dp, micro_batches=micro_batches, pp=pp, cp=cp, policy=policy,
                                  cluster=cluster)
    plan = _planner(policy, None, cluster, dp, micro_batches, pp, cp, 1).plan(lengths.tolist(), 0)
    assert out.indices == plan.partitions()
    by_id = dict(zip(plan.seq_ids.tolist(), plan.budgets.budgets(), strict=True))
    assert out.budgets == [[[by_id[i] for i in mb] for mb in rank] for rank in out.indices]


@pytest.mark.slow  # builds a sparsebalance Planner (Hydra, the cost model): seconds
def test_a_cost_aware_policy_plans_through_the_planner_on_a_four_gpu_layout():
    out = sparsebalance.partition(LENGTHS, dp=4, micro_batches=2, policy="sparsebalance")
    assert every_index_once(out.indices, len(LENGTHS))
    assert len(out.indices) == 4 and all(len(rank) == 2 for rank in out.indices)
    assert all(isinstance(b, Budget) for rank in out.budgets for mb in rank for b in mb)
    assert sparsebalance.partition(LENGTHS, dp=4, micro_batches=2, policy="sparsebalance") == out


@pytest.mark.slow  # builds a Planner with the model's memory model: seconds
def test_the_memory_check_is_on_the_callers_model(tmp_path):
    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "num_hidden_layers": 32,
              "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
              "vocab_size": 128256, "max_position_embeddings": 131072}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    short = [2048] * 8
    assert every_index_once(sparsebalance.partition(short, dp=2, micro_batches=2, model=str(path)).indices, 8)
    assert every_index_once(sparsebalance.partition(short, dp=2, micro_batches=2, model="tiny").indices, 8)
    with pytest.raises(MemoryLimitError, match="allowed"):  # 8B with 2 x 60K tokens in one micro-batch
        sparsebalance.partition([60000] * 8, dp=2, micro_batches=2, model="llama3-8b")


@pytest.mark.parametrize("kwargs,named", [
    ({"lengths": [4096, 0, 12]}, "lengths=[4096, 0, 12]"),
    ({"lengths": [4096.5, 12.0]}, "lengths=[4096.5, 12.0]"),
    ({"lengths": [[1, 2], [3, 4]]}, "lengths=[[1, 2], [3, 4]]"),
    ({"lengths": "4096"}, "lengths='4096'"),
    ({"lengths": 4096}, "lengths=4096"),
    ({"lengths": []}, "lengths=[]"),
    ({"lengths": [1, 2, 3]}, "lengths has 3 sequences"),
    ({"dp": 0}, "dp=0"),
    ({"dp": 2.0}, "dp=2.0"),
    ({"micro_batches": True}, "micro_batches=True"),
    ({"policy": "verl_typo"}, "policy='verl_typo'"),
    ({"policy": None}, "policy=None"),
    ({"cluster": "b900"}, "cluster='b900'"),
    ({"model": "gpt5"}, "model='gpt5'"),
])
def test_bad_input_is_one_line_naming_the_value_and_what_is_allowed(kwargs, named):
    args = {"lengths": LENGTHS, "dp": 4, "micro_batches": 1, **kwargs}
    with pytest.raises(ValueError) as raised:
        sparsebalance.partition(args.pop("lengths"), **args)
    message = str(raised.value)
    assert named in message and "allowed" in message and "\n" not in message


def test_importing_and_calling_it_loads_no_configuration_or_simulation_stack():
    code = ("import sys, sparsebalance; sparsebalance.partition(list(range(1, 65)), dp=8, micro_batches=2, pp=2); "
            f"print([m for m in {HEAVY!r} if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
