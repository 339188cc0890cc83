"""``python -m benchmarks.attention`` on a machine without a GPU, and with bad lists: one-line errors, no
traceback; its interleaved timing rounds; the HBM floors and FLOP counts of ``--kernels``; bad input to the
other benchmarks (plan_overhead, sim_speed, kernel_ptx). The entry points run in this process (argparse's
exits), but for the no-GPU case, which runs the module as a process."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from benchmarks.attention import breakdown, cli, common, fair, flex_variants, grid
from pinned import BACKENDS_PROFILE, PINNED_PROFILE, SPARSE_PEER_PROFILE
from sparsebalance.kernels.backends.flash_sparse import padded_documents, selection_block_mask
from sparsebalance.sim.cost import diag_fraction

ROOT = Path(__file__).resolve().parents[2]


def run_module(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "benchmarks.attention", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("args, message", [
    (["--lengths", "8k"], "argument --lengths: '8k' is not a comma-separated list of ints"),
    (["--lengths", "8192,0"], "argument --lengths: '8192,0': 0 is not allowed; allowed: positive token counts"),
    (["--sparsities", "0,1"], "argument --sparsities: '0,1': 1.0 is not allowed; allowed: sparsities in [0, 1)"),
    (["--rounds", "0"], "argument --rounds: '0': expected a round count (an integer >= 1)"),
    (["--rounds", "two"], "argument --rounds: 'two': expected a round count (an integer >= 1)"),
    (["--graph-max-tokens", "-1"], "argument --graph-max-tokens: '-1': expected a token count (an integer >= 0)"),
    (["--flex-mode", "fast"],
     "argument --flex-mode: invalid choice: 'fast' (choose from 'max-autotune-no-cudagraphs', 'default', "
     "'max-autotune-coordinate-descent')"),
], ids=["lengths-not-int", "lengths-zero", "sparsity-one", "rounds-zero", "rounds-not-int", "graph-tokens-negative",
        "flex-mode-unknown"])
def test_bad_lists_are_one_line_errors(args, message, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(args)
    assert exc.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith("error: " + message)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_no_gpu_is_one_line(tmp_path):
    out = run_module("--bench", "--csv", str(tmp_path / "grid.csv"))
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "error: no CUDA GPU here" in out.stderr.splitlines()[-1]
    assert not (tmp_path / "grid.csv").exists()


def test_rounds_take_turns_and_report_medians(monkeypatch):
    """Each round times every implementation's fwd then fwd+bwd, in turn; the result is the median per
    implementation; one that raises keeps its exception and sits out the later rounds."""
    calls = []
    samples = {"a.f": [3.0, 1.0, 2.0], "a.fb": [30.0, 10.0, 20.0], "b.f": [5.0, 7.0, 6.0], "b.fb": [50.0, 70.0, 60.0]}

    def fake_bench(fn):
        name = fn()
        calls.append(name)
        if name == "c.fb" and calls.count(name) == 2:
            raise RuntimeError("no graph")
        return samples[name].pop(0) if name in samples else 1.0

    monkeypatch.setattr(common, "bench", fake_bench)
    fns = {impl: (lambda impl=impl: f"{impl}.f", lambda impl=impl: f"{impl}.fb") for impl in "abc"}
    out = common.interleaved_ms(fns, 3)
    assert calls == ["a.f", "a.fb", "b.f", "b.fb", "c.f", "c.fb"] * 2 + ["a.f", "a.fb", "b.f", "b.fb"]
    assert out["a"] == (2.0, 20.0) and out["b"] == (6.0, 60.0)
    assert isinstance(out["c"], RuntimeError)


def test_flex_modes_compile_as_named(monkeypatch):
    """Every --flex-mode compiles flex_attention for static shapes: max-autotune without CUDA graphs, the default
    mode, and max-autotune with coordinate-descent tuning given as Inductor options (torchtitan's)."""
    calls = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: calls.append(kwargs) or fn)
    for mode in common.FLEX_MODES:
        common.compiled_flex(mode)
    assert calls == [dict(dynamic=False, mode="max-autotune-no-cudagraphs"), dict(dynamic=False),
                     dict(dynamic=False, options={"max_autotune": True, "coordinate_descent_tuning": True})]


def test_flex_variants_cover_every_mode_and_tile_option():
    """--flex-variants times Flex in every compile mode and, in the default mode, with each fixed tile option,
    all on the same block mask, the GQA flag following the group; forward+backward differentiates the
    forward's output against the head-first leaves with the batch's dO."""
    seen = []

    def stub(mode):
        def flex(q, k, v, block_mask, enable_gqa, kernel_options=None):
            seen.append((mode, block_mask, enable_gqa, kernel_options))
            return (q * k * v).sum(-1, keepdim=True) * q
        return flex

    leaves = [torch.randn(1, 2, 4, 3, requires_grad=True) for _ in range(3)]
    batch = {"al_heads": [*leaves, torch.ones(1, 2, 4, 3)]}
    fns = flex_variants.flex_variant_fns({mode: stub(mode) for mode in common.FLEX_MODES}, batch, "mask", G=8)
    assert sorted(fns) == sorted([f"flex_{m}" for m in common.FLEX_MODES]
                                 + [f"flex_default_{n}" for n in flex_variants.FLEX_KERNEL_OPTIONS])
    for name, (_fwd, fwdbwd) in fns.items():
        seen.clear()
        grads = fwdbwd()
        mode = "default" if name.startswith("flex_default") else name[len("flex_"):]
        tiles = flex_variants.FLEX_KERNEL_OPTIONS
        options = tiles.get(name[len("flex_default_"):]) if name != "flex_default" else None
        assert seen == [(mode, "mask", True, options)]
        assert len(grads) == 3 and all(g.shape == (1, 2, 4, 3) for g in grads)


def test_grid_cases_packed_first_or_left_out():
    cases = grid.grid_cases([8192, 131072], packed=True)
    assert [c for c, _ in cases] == ["packed64k", "single", "single"]
    assert sum(cases[0][1]) == 65536 and cases[1][1] == [8192] and cases[2][1] == [131072]
    assert grid.grid_cases([131072], packed=False) == [("single", [131072])]


GRID_CSV = """case,T,ndocs,sparsity,kept_fraction,impl,fwd_ms,fwdbwd_ms,speedup_vs_flex_fwdbwd,fwdbwd_graph_ms,\
speedup_vs_flex_fwdbwd_graph,error
selection_32k,32768,1,0.9,0.1,select[kept_fraction=0.1],0.2,4.0,,,,select/attn_fwdbwd=0.050
selection_32k,32768,1,0.9,0.1,select[kept_fraction=0.1],0.4,4.0,,,,select/attn_fwdbwd=0.100
packed64k,65536,3,0.5,0.5,flex,1.0,6.0,,,,block_mask_build_s=0.00
packed64k,65536,3,0.5,0.5,triton_sparse,1.0,3.0,2.0,,,
single,8192,1,0.0,1.0,cudnn_dense,0.5,2.0,,1.5,,
single,8192,1,0.0,1.0,triton_sparse,0.5,2.5,1.1,3.0,1.2,
single,8192,1,0.5,0.5,triton_sparse,0.5,1.25,,,,
"""


def test_results_table_from_a_grid_csv(tmp_path, capsys):
    """The README's table: ours (speedup over Flex) per case and sparsity, the graph timing as its own row,
    missing points as '-', dense against cuDNN; one line per selection mode. No GPU needed."""
    path = tmp_path / "grid.csv"
    path.write_text(GRID_CSV)
    cli.main(["--table", str(path)])
    assert capsys.readouterr().out.splitlines() == [
        "| fwd+bwd ms (FlexAttention's time / ours) | sparsity 0 | sparsity 0.5 | dense: cuDNN's time / ours |",
        "| --- | --- | --- | --- |",
        "| packed 64K (3 documents) | - | 3.00 (2.00x) | - |",
        "| single 8K | 2.50 (1.10x) | 1.25 | 0.80x |",
        "| single 8K, CUDA graph | 3.00 (1.20x) | - | 0.50x |",
        "",
        "* selection (kept_fraction=0.1) at 32K tokens: 0.20-0.40 ms, 5.0-10.0% of the fwd+bwd over it (2 samples)",
    ]


FAIR_CSV = """case,heads,T,ndocs,padded_T,sparsity,kept_fraction,impl,fwd_ms,fwdbwd_ms,fwd_tflops,fwdbwd_tflops,error
packed64k,16:16,62567,49,,0.9,0.1,triton_sparse,0.5,2.0,100,250,
packed64k,16:16,62567,49,,0.9,0.1,flex_token_mask,1.5,8.0,40,60,
packed64k,16:16,62567,49,65536,0.9,0.1,flex_padded,0.6,2.2,90,220,
packed64k,16:16,65536,49,,0.9,0.1,triton_sparse_aligned,0.5,2.1,100,240,
packed64k,16:16,65536,49,,0.9,0.1,flex_exact,0.55,2.1,95,240,
packed64k,16:16,62567,49,,0.9,0.1,flex_flash_exact,,,,,"absent: ModuleNotFoundError('flash_attn')"
packed64k,16:16,62567,49,,0.0,1.0,triton_sparse,2.0,8.0,300,360,
packed64k,16:16,62567,49,,0.0,1.0,fa4_varlen_dense,1.5,6.0,400,480,
packed64k,16:16,62567,49,,0.0,1.0,fa3_varlen_dense,,,,,"absent: BackendAbsent('fa3: absent (ModuleNotFoundError)')"
"""


def test_fair_table_from_a_fair_csv(tmp_path, capsys):
    """The fair grid's table: ours on each batch, every Flex construction against ours on the batch it starts
    from, a dense backend (timed at sparsity 0) against ours at every sparsity, no column for an implementation
    the CSV never names (cuDNN here), why an implementation is absent, the padded batch's size."""
    path = tmp_path / "fair.csv"
    path.write_text(FAIR_CSV)
    cli.main(["--table", str(path)])
    lines = capsys.readouterr().out.splitlines()
    assert "cuDNN" not in lines[0]
    assert lines[0].endswith("| FlashAttention-4 dense varlen | FlashAttention-3 dense varlen |")
    assert lines[2] == ("| 16:16 | 0.9 | 0.100 | 2.00 (250) | 2.10 (240) | 8.00 (4.00x) | 2.20 (1.10x) "
                        "| 2.10 (1.00x) | - | 6.00 (3.00x) | - |")
    assert lines[3] == "| 16:16 | 0 | 1.000 | 8.00 (360) | - | - | - | - | - | 6.00 (0.75x) | - |"
    assert lines[5:] == ["* Flex FLASH, aligned, exact blocks: absent: ModuleNotFoundError('flash_attn')",
                         "* FlashAttention-3 dense varlen: absent: BackendAbsent('fa3: absent (ModuleNotFoundError)')",
                         "* padded batch: 65536 tokens for 62567 (4.7% more), 49 documents"]


FAIR_HYBRID_CSV = """case,heads,T,ndocs,padded_T,sparsity,kept_fraction,impl,fwd_ms,fwdbwd_ms,fwd_tflops,\
fwdbwd_tflops,error,backend
packed64k,16:16,62567,49,,0.0,1.0,triton_sparse,2.0,8.0,300,360,,
packed64k,16:16,62567,49,,0.0,1.0,fa4_varlen_dense,1.5,6.0,400,480,,
packed64k,16:16,62567,49,,0.0,1.0,cudnn_per_document_dense,1.6,6.4,380,450,,
packed64k,16:16,62567,49,,0.0,1.0,hybrid,1.5,6.1,400,470,,fa4
packed64k,16:16,62567,49,,0.25,0.75,triton_sparse,1.8,7.0,250,300,,
packed64k,16:16,62567,49,,0.25,0.75,hybrid,1.8,7.0,250,300,,ours
packed64k,16:16,62567,49,,0.5,0.5,triton_sparse,1.2,5.0,200,250,,
packed64k,16:16,62567,49,,0.5,0.5,hybrid,1.2,5.05,200,248,,ours
"""


def test_fair_table_shows_hybrid_against_the_fastest_dense_kernel_and_ours(tmp_path, capsys):
    """--profile's hybrid rows: hybrid's time and choice, the fastest dense kernel's time (timed at sparsity 0)
    and ours' over hybrid's, and a note where the profile chose the slower option."""
    path = tmp_path / "fair.csv"
    path.write_text(FAIR_HYBRID_CSV)
    cli.main(["--table", str(path)])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith("| hybrid: ms, backend (fastest dense's ms / hybrid's, ours' / hybrid's) |")
    assert [line.rsplit("|", 2)[1].strip() for line in lines[2:5]] == [
        "6.10 fa4 (0.98x, 1.31x)", "7.00 ours (0.86x, 1.00x)", "5.05 ours (1.19x, 0.99x)"]
    assert lines[5:] == ["", "* hybrid at 16:16, sparsity 0.25: the profile chose ours (7.00 ms), fa4 ran 6.00 ms "
                             "(0.86x)"]


def test_hybrid_is_held_against_the_dense_kernels_timed_in_its_own_turns(tmp_path, capsys):
    """Where the run timed the dense kernels at a point too (``--fair --profile`` does at every sparsity), hybrid's
    ratio and the note read those, not the sparsity-0 times from other turns."""
    point = ("packed64k,16:16,62567,49,,0.25,0.75,fa4_varlen_dense,1.9,7.5,300,380,,\n"
             "packed64k,16:16,62567,49,,0.25,0.75,cudnn_per_document_dense,2.0,8.2,290,350,,\n")
    path = tmp_path / "fair.csv"
    path.write_text(FAIR_HYBRID_CSV + point)
    cli.main(["--table", str(path)])
    lines = capsys.readouterr().out.splitlines()
    assert lines[3].rsplit("|", 2)[1].strip() == "7.00 ours (1.07x, 1.00x)"
    assert "* hybrid at 16:16, sparsity 0.25" not in lines  # ours beat the fa4 timed beside it
    assert lines[3].split("|")[-3].strip() == "7.50 (1.07x)"  # fa4's column shows the time of its own turns


def test_fair_table_holds_the_sparse_peer_and_hybrid_on_it_against_ours(tmp_path, capsys):
    """FlashAttention-4's block-sparse form runs ours' selection of the unaligned batch: its column is held
    against ours on that batch, hybrid may run it, and a note says where ours or another ran faster than the
    profile's choice."""
    point = ("packed64k,16:16,62567,49,,0.5,0.5,fa4_sparse,1.0,4.5,250,280,,\n"
             "packed64k,16:16,62567,49,,0.25,0.75,fa4_sparse,1.7,7.4,260,290,,\n")
    path = tmp_path / "fair.csv"
    path.write_text(FAIR_HYBRID_CSV.replace("0.5,0.5,hybrid,1.2,5.05,200,248,,ours", "0.5,0.5,hybrid,1.0,4.6,250,275,,"
                                            "fa4_sparse") + point)
    cli.main(["--table", str(path)])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split("|")[-3].strip() == "FlashAttention-4 block-sparse, our blocks, documents padded"
    assert lines[4].split("|")[-3].strip() == "4.50 (0.90x)"
    assert lines[4].rsplit("|", 2)[1].strip() == "4.60 fa4_sparse (1.30x, 1.09x)"
    assert lines[3].split("|")[-3].strip() == "7.40 (1.06x)"
    assert not any(line.startswith("* hybrid at 16:16, sparsity 0.5:") for line in lines)  # its choice ran fastest
    assert any(line.startswith("* hybrid at 16:16, sparsity 0.25: the profile chose ours") for line in lines)


def test_hybrid_takes_the_profiles_choice_for_the_fair_batch():
    """The fair batch priced by the fixture profile: its dense fa4 beats ours keeping every block, ours wins
    keeping only the diagonal blocks (the simulator's and the runner's hybrid choice)."""
    costs = fair.hybrid_costs(str(BACKENDS_PROFILE))
    lengths = np.array(fair.fair_lengths()[1])
    for heads, cost in costs.items():
        assert (cost.model.heads, cost.model.kv_heads) == fair.FAIR_HEADS[heads]
        assert fair.hybrid_choice(cost, lengths, np.ones(lengths.size)) == "fa4"
        assert fair.hybrid_choice(cost, lengths, diag_fraction(lengths, common.B)) == "ours"


def test_hybrid_may_run_the_sparse_peer_a_profile_prices():
    """With a profile that prices FlashAttention-4's block-sparse form (the fixture's made-up terms), hybrid runs
    the fair batch dense, on the sparse peer, or on ours, as the kept fraction falls."""
    costs = fair.hybrid_costs(str(SPARSE_PEER_PROFILE))
    lengths = np.array(fair.fair_lengths()[1])
    choices = [fair.hybrid_choice(costs["mha"], lengths, np.full(lengths.size, kept)) for kept in (1.0, 0.4, 0.05)]
    assert choices == ["fa4", "fa4_sparse", "ours"]


@pytest.mark.parametrize("args, message", [
    (["--fair", "--profile", str(PINNED_PROFILE)], f"--profile {PINNED_PROFILE}: cost.attention_backend=hybrid: the "
                                                   f"profile {PINNED_PROFILE} prices no dense backend"),
    (["--profile", str(BACKENDS_PROFILE)], f"--profile '{BACKENDS_PROFILE}' prices --fair's hybrid row; allowed: "
                                           "with --fair"),
], ids=["no-dense-backend", "without-fair"])
def test_a_profile_the_hybrid_row_cannot_use_is_one_line_before_any_gpu_work(args, message, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(args)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


def test_missing_table_csv_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["--table", str(tmp_path / "none.csv")])
    assert exc.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith("none.csv': no such file (a grid CSV of this benchmark)")


@pytest.mark.parametrize("content, message", [
    ("dtype,D,ok\nbf16,128,True\n", "no column 'case'"),
    ("", "not a readable CSV (No columns to parse from file)"),
    ("case,heads,T,ndocs,padded_T,sparsity,impl,fwdbwd_ms,fwdbwd_tflops,error\n", "a header without rows"),
], ids=["check-csv", "empty", "header-only"])
def test_table_of_a_non_benchmark_csv_is_one_line(content, message, tmp_path, capsys):
    path = tmp_path / "other.csv"
    path.write_text(content)
    with pytest.raises(SystemExit) as exc:
        cli.main(["--table", str(path)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: --table '{path}': {message}; allowed: a grid CSV"), err


@pytest.mark.parametrize("args, message", [
    (["--steps", "1"], "--steps 1: allowed: >= 2"),
    (["--dp", "0"], "--dp 0: allowed: a positive multiple of 8"),
    (["--dp", "-4"], "--dp -4: allowed: a positive multiple of 8"),
    (["--dp", "12"], "--dp 12: allowed: a positive multiple of 8"),
    (["--dp", "8", "--global-batch", "15"], "--global-batch 15: allowed: >= 16"),
    (["--policy", "nope"], "--policy 'nope': no policy 'nope' in conf/policy/"),
    (["--policy", "sparsebalance:bogus=1"], "--policy 'sparsebalance:bogus=1': Key 'bogus' not in"),
    (["--policy", "sparsebalance:sparsity.params.floor=nan"], "floor=nan is not allowed"),
], ids=["steps", "dp-zero", "dp-negative", "dp-not-whole-nodes", "batch-below-ranks", "policy", "override",
        "nan-param"])
def test_plan_overhead_bad_arguments_are_one_line(args, message, capsys):
    from benchmarks import plan_overhead

    with pytest.raises(SystemExit) as exc:
        plan_overhead.main(["--steps", "2", *args])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err, err


@pytest.mark.parametrize("module", ["plan_overhead", "sim_speed"])
def test_benchmark_usage_names_the_module(module, capsys):
    main = __import__(f"benchmarks.{module}", fromlist=["main"]).main
    with pytest.raises(SystemExit):
        main(["--help"])
    assert capsys.readouterr().out.startswith(f"usage: python -m benchmarks.{module} ")


@pytest.mark.parametrize("out, message", [
    ("file", "is a file; allowed: a directory path"),
    ("file/sub", "cannot be written"),
], ids=["a-file", "under-a-file"])
def test_kernel_ptx_checks_its_output_directory_first(out, message, tmp_path, monkeypatch, capsys):
    from benchmarks import kernel_ptx

    (tmp_path / "file").write_text("")
    compiled = []
    monkeypatch.setattr(kernel_ptx, "compile_ptx", lambda *a: compiled.append(a))
    monkeypatch.setattr(sys, "argv", ["kernel_ptx", str(tmp_path / out)])
    with pytest.raises(SystemExit) as exc:
        kernel_ptx.main()
    assert exc.value.code == 2 and not compiled
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: OUT_DIR='{tmp_path / out}'") and message in err, err


def test_kernel_ptx_names_a_missing_reference_directory_in_one_line(tmp_path, monkeypatch, capsys):
    from benchmarks import kernel_ptx

    monkeypatch.setattr(sys, "argv", ["kernel_ptx", str(tmp_path / "out"), "--compare", str(tmp_path / "missing")])
    with pytest.raises(SystemExit) as exc:
        kernel_ptx.main()
    assert exc.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith("is not a directory (write one first: python -m "
                                                "benchmarks.kernel_ptx REF_DIR)")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("gqa", [1, 2], ids=["mha", "gqa2"])
def test_fair_flex_constructions_attend_exactly_our_kept_blocks(gqa):
    """The fair grid's Flex inputs compute what our kernel computes: on whole-block documents Flex given our
    kept blocks (selection_block_mask), and on the unaligned documents padded to whole blocks (padded_tensors),
    match the reference at every real token. Eager FlexAttention (on the CPU) reads only the mask_mod, which
    the fused kernel evaluates on partial (diagonal) blocks only: here it also reads the BlockMask's blocks."""
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    from sparsebalance.kernels.sparse_attention import select_blocks, sparse_attention_naive

    aligned = [256, 128, 384]
    for lens in (aligned, [200, 100, 379]):
        T, Hkv = sum(lens), 2
        g = torch.Generator().manual_seed(len(lens) + sum(lens))
        q, k, v = [torch.randn(T, h, 16, generator=g) for h in (Hkv * gqa, Hkv, Hkv)]
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        sel = select_blocks(q, k, cu, kept_fraction=0.5, block_size=common.B)
        ref = sparse_attention_naive(q, k, v, cu, sel)
        padded = padded_documents(lens, common.B, "cpu")
        pos, ends = padded.positions, padded.kv_end
        qb, kb, vb, _ = fair.padded_tensors(pos, ends.numel(), q, k, v, q)
        mask = selection_block_mask(sel, q.shape[1], ends)
        blocks = mask.to_dense()[0].bool()  # [Hq, NB, NB]: partial and full blocks
        assert torch.equal(blocks, sel.to_dense_mask().repeat_interleave(gqa, dim=0))
        eager = BlockMask.from_kv_blocks(
            mask.kv_num_blocks, mask.kv_indices, mask.full_kv_num_blocks, mask.full_kv_indices, BLOCK_SIZE=common.B,
            mask_mod=lambda b, h, qi, ki, mask=mask, blocks=blocks: (
                mask.mask_mod(b, h, qi, ki) & blocks[h, qi // common.B, ki // common.B]),
            seq_lengths=mask.seq_lengths)
        qb, kb, vb = [x.detach() for x in (qb, kb, vb)]  # no Flex backward on a CPU
        o = flex_attention(qb, kb, vb, block_mask=eager, enable_gqa=gqa > 1)[0].transpose(0, 1)[pos]
        torch.testing.assert_close(o, ref, atol=1e-5, rtol=0)


def test_grid_points_weight_kept_fractions_by_length_squared():
    """One kept fraction per grid point: each document's weighted by its length squared, to 4 places."""
    from types import SimpleNamespace

    sel = SimpleNamespace(kept_fraction=torch.tensor([0.5, 1.0, 0.2]))
    assert common.weighted_kept_fraction(sel, [1, 3, 0]) == 0.95
    assert common.weighted_kept_fraction(SimpleNamespace(kept_fraction=torch.tensor([1 / 3])), [7]) == 0.3333


def test_heads_first_gives_leaves_for_qkv_and_a_plain_copy_of_do():
    q, k, v, do = [torch.randn(5, h, 3) for h in (4, 2, 2, 4)]
    out = common.heads_first(q, k, v, do)
    assert [tuple(x.shape) for x in out] == [(1, 4, 5, 3), (1, 2, 5, 3), (1, 2, 5, 3), (1, 4, 5, 3)]
    assert [x.requires_grad for x in out] == [True, True, True, False]
    assert all(x.is_contiguous() and torch.equal(x[0].transpose(0, 1), y)
               for x, y in zip(out, (q, k, v, do), strict=True))


def test_fair_lengths_pad_back_to_the_aligned_batch():
    aligned, unaligned = fair.fair_lengths()
    assert sum(aligned) == 65536 and all(n % common.B == 0 for n in aligned)
    assert all(0 < u <= a < u + common.B for a, u in zip(aligned, unaligned, strict=True))
    assert padded_documents(unaligned, common.B, "cpu").padded_tokens == 65536


# T 256, D 16, bf16: Q, O, dO, dQ of T*Hq*D*2 bytes; K, V, dK, dV of T*Hkv*D*2; LSE, delta of T*Hq*4.
# Each sum: the reads, then the writes.
@pytest.mark.parametrize("Hq, Hkv, expected", [
    (2, 2, {"fwd": 3 * 16384 + 16384 + 2048,
            "dq": 5 * 16384 + 2048 + 16384 + 2048,
            "dkdv": 4 * 16384 + 2 * 2048 + 2 * 16384}),
    (4, 1, {"fwd": 32768 + 2 * 8192 + 32768 + 4096,
            "dq": 3 * 32768 + 2 * 8192 + 4096 + 32768 + 4096,
            "dkdv": 2 * 32768 + 2 * 8192 + 2 * 4096 + 2 * 8192}),
], ids=["mha", "gqa4"])
def test_kernel_floor_bytes_count_each_operand_once(Hq, Hkv, expected):
    """--kernels' HBM floor of each kernel: every tensor it touches, once. fwd reads Q, K, V and writes O,
    LSE; dq reads Q, dO, O, K, V, LSE and writes dQ, delta; dkdv reads Q, dO, K, V, LSE, delta and writes
    dK, dV."""
    assert breakdown.kernel_floor_bytes(256, Hq, Hkv, 16, 2) == expected


def test_floor_fields_of_a_kernels_row():
    """Each kernel's floor at the copy bandwidth, the summed times and floors, and the effective fwd+bwd
    TFLOP/s (3.5x the forward FLOPs) of each."""
    fields = breakdown.floor_fields({"fwd": 1.0, "dq": 2.0, "dkdv": 3.0}, {"fwd": 2e9, "dq": 3e9, "dkdv": 5e9},
                                    bytes_per_ms=4e9, fwd_flops=1e12)
    assert fields == {"fwd_floor_ms": 0.5, "dq_floor_ms": 0.75, "dkdv_floor_ms": 1.25, "sum_ms": 6.0,
                      "floor_sum_ms": 2.5, "tflops": round(3500 / 6.0, 1), "floor_tflops": 1400.0}


def test_kept_fwd_flops_count_every_query_head():
    """The FLOP convention of --fair and --kernels: 4*D per attended pair of each query head, so GQA counts the
    pairs of a KV head once per query head of its group."""
    from sparsebalance.kernels.sparse_attention import select_blocks

    q, k = torch.randn(256, 4, common.D), torch.randn(256, 1, common.D)
    sel = select_blocks(q, k, torch.tensor([0, 256], dtype=torch.int32), kept_fraction=1.0, block_size=common.B)
    assert common.kept_fwd_flops(sel, 4) == 4 * common.D * 4 * (256 * 257 // 2)
