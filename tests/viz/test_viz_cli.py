"""``python -m viz`` with several inputs, bad options and output paths, calibrate's other profiles, and the
--fair CSV of benchmarks.attention: one figure file per input, one ``error:`` line before anything is written."""
from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from sparsebalance.viz.cli import main
from sparsebalance.viz.kernels import fair_ratios

ROOT = Path(__file__).resolve().parents[2]


def learning_tables(path: Path) -> Path:
    """runner.collect's tables of one 60-step run: the cheapest input that draws a figure."""
    path.mkdir(parents=True)
    pd.DataFrame({"run": "task_s0", "step": range(60), "loss": 1.0, "accuracy": 0.5, "answers": 10}).to_csv(
        path / "train.csv", index=False)
    return path


def one_error_line(capsys, exc) -> str:
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and err.startswith("error: "), err
    return err


def test_inputs_sharing_an_output_directory_get_a_figure_each(tmp_path, capsys):
    a, b = learning_tables(tmp_path / "a" / "baseline"), learning_tables(tmp_path / "b" / "sparsebalance")
    out = tmp_path / "figs"
    assert main([str(a), str(b), "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["baseline-learning.png", "sparsebalance-learning.png"]
    assert capsys.readouterr().out.count("figure: ") == 2
    assert main([str(a), "--out", str(tmp_path / "one")]) == 0  # alone, a figure keeps its plain name
    assert [p.name for p in (tmp_path / "one").iterdir()] == ["learning.png"]


def test_inputs_of_one_name_into_one_directory_are_refused_before_drawing(tmp_path, capsys):
    a, b = learning_tables(tmp_path / "a" / "run"), learning_tables(tmp_path / "b" / "run")
    with pytest.raises(SystemExit) as exc:
        main([str(a), str(b), "--out", str(tmp_path / "figs")])
    assert "2 inputs named 'run' would write the same figures" in one_error_line(capsys, exc)
    assert not (tmp_path / "figs").exists()


def test_a_bad_input_leaves_no_figures_of_the_good_ones(tmp_path, capsys):
    good, bad = learning_tables(tmp_path / "good"), learning_tables(tmp_path / "bad")
    (bad / "train.csv").write_text("run,step\n")
    with pytest.raises(SystemExit) as exc:
        main([str(good), str(bad), "--out", str(tmp_path / "figs")])
    one_error_line(capsys, exc)
    assert not any((tmp_path / "figs").glob("*"))


@pytest.mark.parametrize("args, message", [
    (["--skip", "-1"], "error: --skip -1: allowed: >= 0"),
    (["--step", "-2"], "error: --step -2: allowed: >= 0"),
    (["--format", "pdf"], "error: argument --format: invalid choice: 'pdf'"),
], ids=["skip", "step", "format"])
def test_bad_options_are_one_line(args, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main([str(learning_tables(tmp_path / "run")), "--out", str(tmp_path / "figs"), *args])
    assert one_error_line(capsys, exc).startswith(message)


@pytest.mark.parametrize("out, message", [("file", "is a file"), ("file/figs", "cannot be written")],
                         ids=["a-file", "under-a-file"])
def test_an_unwritable_output_directory_is_one_line_before_drawing(out, message, tmp_path, capsys):
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit) as exc:
        main([str(learning_tables(tmp_path / "run")), "--out", str(tmp_path / out)])
    err = one_error_line(capsys, exc)
    assert err.startswith(f"error: --out='{tmp_path / out}' ") and message in err, err


@pytest.mark.parametrize("name, what", [("sensitivity_tiny_h200.json", "a sensitivity profile"),
                                        ("h200_memory.json", "a memory profile")], ids=["sensitivity", "memory"])
def test_other_profiles_are_named_for_what_they_are(name, what, tmp_path, capsys):
    path = ROOT / "calibrate" / "profiles" / name
    with pytest.raises(SystemExit) as exc:
        main([str(path), "--out", str(tmp_path)])
    err = one_error_line(capsys, exc)
    assert f"{path}: {what}" in err and "allowed: a cost profile" in err and "refit" not in err, err


FAIR_CSV = """case,heads,T,ndocs,padded_T,sparsity,kept_fraction,impl,fwd_ms,fwdbwd_ms,fwd_tflops,fwdbwd_tflops,error
packed64k,16:16,62567,49,,0.9,0.1,triton_sparse,0.5,2.0,100,250,
packed64k,16:16,65536,49,,0.9,0.1,triton_sparse_aligned,0.5,4.0,100,240,
packed64k,16:16,62567,49,,0.9,0.1,flex_token_mask,1.5,8.0,40,60,
packed64k,16:16,62567,49,65536,0.9,0.1,flex_padded,0.6,3.0,90,220,
packed64k,16:16,65536,49,,0.9,0.1,flex_exact,0.55,2.0,95,240,
packed64k,16:16,62567,49,,0.9,0.1,flex_flash_exact,,,,,"absent: ModuleNotFoundError('flash_attn')"
packed64k,32:4,62567,49,,0.5,0.5,triton_sparse,1.0,5.0,100,250,
packed64k,32:4,62567,49,,0.5,0.5,cudnn_per_document_dense,1.0,10.0,100,250,
"""


def test_fair_csv_draws_each_peer_over_ours_on_its_batch(tmp_path, capsys):
    """Each peer against ours on the batch it starts from (same head layout, sparsity and tokens); an absent
    peer is left out."""
    path = tmp_path / "attention_fair.csv"
    path.write_text(FAIR_CSV)
    ratios = fair_ratios(path).set_index(["heads", "impl"])["ratio"]
    assert ratios.to_dict() == {("16:16", "flex_token_mask"): 4.0, ("16:16", "flex_padded"): 1.5,
                                ("16:16", "flex_exact"): 0.5, ("32:4", "cudnn_per_document_dense"): 2.0}
    assert main([str(path), "--out", str(tmp_path / "figs")]) == 0
    assert [p.name for p in (tmp_path / "figs").iterdir()] == ["fair.png"]


@pytest.mark.parametrize("content, message", [("", "unreadable (No columns to parse from file)"),
                                              ("dtype,D,ok\nbf16,128,True\n", "not a kernel benchmark CSV")],
                         ids=["empty", "check-csv"])
def test_a_csv_viz_does_not_draw_is_one_line(content, message, tmp_path, capsys):
    path = tmp_path / "other.csv"
    path.write_text(content)
    with pytest.raises(SystemExit) as exc:
        main([str(path), "--out", str(tmp_path / "figs")])
    assert one_error_line(capsys, exc).startswith(f"error: {path}: {message}")
