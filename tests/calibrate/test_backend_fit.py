"""Peer attention backends in the calibration, dense and sparse: their grid points, their timing (CPU stand-ins),
their rows' keys, their fit into a profile's ``backends`` with the version the run recorded, and the simulator
pricing them."""
from __future__ import annotations

import json
from shlex import join as shlex_join

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

import sparsebalance.kernels.sparse_attention as kernel
from sparsebalance.calibrate import fit, fitting, run, store, timing
from sparsebalance.calibrate.backends import backend_checks
from sparsebalance.calibrate.grid import GridPoint, attention_points, build_grid, dense_points, sparse_points
from sparsebalance.calibrate.measure import Measurer
from sparsebalance.kernels.backends import BACKENDS, load
from pinned import PINNED_PROFILE
from sparse_peer import NAME as SPARSE, NaiveSparse
from sparsebalance.runner.attention import make_attention
from sparsebalance.sim.backends import DENSE_FEATURES, DENSE_TERMS
from sparsebalance.sim.cluster import Cluster, Layout
from sparsebalance.sim.core import ConfigError
from sparsebalance.sim.config import compose_config
from sparsebalance.sim.cost import dense_features, make_cost, sparse_features
from sparsebalance.sim.profile import load_profile
from sparsebalance.sim.shapes import ModelShape, load_shapes

BLOCK = 128
TRUE = {"attn_fwd": {"const": 0.02, "tokens": 3e-6, "head_tokens": 5e-8, "docs": 0.004, "doc_heads": 1e-4,
                     "flops": 1 / 550e9},
        "attn_bwd": {"const": 0.05, "tokens": 6e-6, "head_tokens": 1e-6, "docs": 0.01, "doc_heads": 0.0,
                     "flops": 2.6 / 550e9}}
OURS_TRUE = load_profile(str(PINNED_PROFILE))["terms"]
# a sparse peer's: its own per-call, per-token and per-kept-FLOP costs
SPARSE_TRUE = {"attn_fwd": {"const": 0.3, "tokens": 2e-6, "head_tokens": 2e-8, "docs": 0.003, "doc_heads": 2e-4,
                            "flops": 1 / 450e9},
               "attn_bwd": {"const": 0.6, "tokens": 5e-6, "head_tokens": 3e-7, "docs": 0.008, "doc_heads": 1e-4,
                            "flops": 2.4 / 450e9}}


def realised(lengths, budgets):
    """Kept fractions a selection realises for these budgets: not the budgets (the diagonal blocks, rounding), so
    a fit that priced the budgets instead would miss."""
    return tuple(min(1.0, f * 1.1 + 256 / n) for n, f in zip(lengths, budgets, strict=True))


@pytest.fixture(scope="module")
def shapes():
    return load_shapes(list(run.CALIBRATED_MODELS))


def test_dense_points_are_the_grids_documents_all_kept_and_hold_out_the_validation_documents(shapes):
    ours = {p.lengths for s in shapes for p in build_grid([s]) if p.kind == "attn"}
    for shape in shapes:
        points = dense_points(shape, "fa4")
        assert all(p.key.startswith(f"attn@fa4|{shape.name}|") and p.terms == DENSE_TERMS for p in points)
        assert all(set(p.kept_fractions) == {1.0} and sum(n * n for n in p.lengths) <= 65536 ** 2 for p in points)
        assert {p.lengths for p in points if p.split == "fit"} <= ours
        assert {(1024,), (min(shape.max_context, 65536),)} <= {p.lengths for p in points if p.split == "fit"}
        assert sum(p.split == "heldout" for p in points) >= 4
    grid = build_grid(shapes, ("cudnn", "fa4"))
    assert len(grid) == len(build_grid(shapes)) + 2 * sum(len(dense_points(s, "fa4")) for s in shapes)


def rows_of(shapes, backends=("fa4",), noise=0.0, seed=0, sparse=()):
    """CSV rows of a run: ours timed as the pinned profile prices it, each dense backend as TRUE, each sparse
    peer of ``sparse`` as SPARSE_TRUE at the kept fractions its selection realised (recorded in the rows)."""
    rng = np.random.default_rng(seed)
    features = fitting.FeatureSource({s.name: vars(s) for s in shapes}, BLOCK)
    rows = []
    for p in build_grid(shapes, backends, sparse):
        kept = p.kept_fractions
        if p.backend == "ours":
            probe = fitting.Measurement(p.key, "", p.split, p.model, p.lengths, p.kept_fractions, 1.0, 0.0)
            times = {t: fitting.term_prediction(t, OURS_TRUE, features(probe)) or 0.4 for t in p.terms}
        elif p.backend in sparse:
            kept = realised(p.lengths, p.kept_fractions)
            feats = sparse_features(p.lengths, kept, features.taps[p.model].model, BLOCK)
            times = {t: sum(c * feats[f] for f, c in SPARSE_TRUE[t].items()) for t in p.terms}
        else:
            feats = dense_features(p.lengths, features.taps[p.model].model, BLOCK)
            times = {t: sum(c * feats[f] for f, c in TRUE[t].items()) for t in p.terms}
        for term, t in times.items():
            t *= float(np.exp(rng.normal(0.0, noise)))
            rows.append({"key": p.key, "term": term, "split": p.split, "model": p.model,
                         "lengths": ";".join(map(str, p.lengths)),
                         "kept_fractions": ";".join(map(str, kept)), "median_ms": t,
                         "p20_ms": t * 0.99, "p80_ms": t * 1.01, "reps": 9})
    return rows


def write_run(tmp_path, shapes, rows, backends=("fa4",), name="h100_raw.csv"):
    csv = tmp_path / name
    store.append_rows(csv, rows)
    grid = run.grid_description(shapes, BLOCK, None, len(rows), backends)
    run.write_meta(csv, {"command": "python -m calibrate.run", "date": "2026-12-06T00:00:00+00:00", "torch": "t",
                         "triton": "tr", "gpu_name": "synthetic", "driver": "d", "grid": grid,
                         "backends": {b: f"{b} 1.2.3" for b in backends}})
    return csv


def test_fit_writes_each_dense_backends_terms_version_and_errors(tmp_path, shapes, capsys):
    csv = write_run(tmp_path, shapes, rows_of(shapes))
    out = tmp_path / "h100.json"
    assert fit.main(["--csv", str(csv), "--out", str(out)]) == 0
    profile = load_profile(str(out))
    entry = profile["backends"]["fa4"]
    assert entry["version"] == "fa4 1.2.3" and set(entry["terms"]) == set(DENSE_TERMS)
    for term in DENSE_TERMS:
        assert set(entry["terms"][term]) == set(DENSE_FEATURES)
        for feat, coef in TRUE[term].items():
            assert entry["terms"][term][feat] == pytest.approx(coef, rel=1e-3), (term, feat)
    assert entry["fit"]["heldout_mape"]["attn_fwd+bwd"]["max_ape_pct"] < 1e-3
    assert entry["fit"]["points"]["heldout"] >= 8
    assert "backend fa4 (fa4 1.2.3)" in capsys.readouterr().out
    # ours is fitted from its own rows alone: the dense backend's rows change none of its coefficients
    plain = tmp_path / "plain"
    plain.mkdir()
    ours_only = [r for r in rows_of(shapes) if "@" not in r["key"]]
    assert fit.main(["--csv", str(write_run(plain, shapes, ours_only, ())), "--out", str(plain / "h100.json")]) == 0
    assert json.loads((plain / "h100.json").read_text())["terms"] == profile["terms"]
    assert "backends" not in json.loads((plain / "h100.json").read_text())
    # and the simulator prices the backend it names
    cfg = OmegaConf.to_object(compose_config([f"cost.profile={out}", "cost.attention_backend=dense_best",
                                              "model=llama3-8b"]))
    cost = make_cost(cfg.cost, cfg.model, Cluster.from_config(cfg.cluster), recompute=False)
    mb = cost.micro_batch_cost([8192, 4096], [0.3, 1.0], Layout(dp=8))
    feats = dense_features([8192, 4096], cfg.model, BLOCK)
    assert mb.dense and mb.attn_fwd_ms == pytest.approx(
        cfg.model.layers * sum(c * feats[f] for f, c in entry["terms"]["attn_fwd"].items()))


def test_a_dense_backend_without_fit_points_of_a_term_is_one_line(tmp_path, shapes, capsys):
    rows = [r for r in rows_of(shapes) if not (r["key"].startswith("attn@") and r["term"] == "attn_bwd"
                                               and r["split"] == "fit")]
    csv = write_run(tmp_path, shapes, rows)
    with pytest.raises(SystemExit) as done:
        fit.main(["--csv", str(csv), "--out", str(tmp_path / "h100.json")])
    err = capsys.readouterr().err.splitlines()
    assert done.value.code == 2 and err == [f"error: --csv {csv}: backend fa4: no 'fit' measurements of attn_bwd; "
                                            "allowed: raw measurements with them (calibrate.run times them)"]
    assert not (tmp_path / "h100.json").exists()


@pytest.mark.parametrize("key, term, ok", [
    ("attn@fa4|llama3-8b|4096|1", "attn_bwd", True),
    ("attn@fa4|llama3-8b|4096|1", "select", False),
    ("attn@ours|llama3-8b|4096|1", "attn_fwd", False),
    ("layer@fa4|llama3-8b|4096|1", "layer_fwd", False),
    ("attn@FA4|llama3-8b|4096|1", "attn_fwd", False),
])
def test_row_keys_of_dense_backends(key, term, ok):
    row = {"key": key, "term": term, "split": "fit", "model": "llama3-8b", "lengths": "4096", "kept_fractions": "1",
           "median_ms": "1.0", "p20_ms": "0.9", "p80_ms": "1.1", "reps": "5"}
    if ok:
        assert fitting.Measurement.from_row(row, ["llama3-8b"]).backend == "fa4"
    else:
        with pytest.raises(ConfigError, match=f"row key={key!r}"):
            fitting.Measurement.from_row(row, ["llama3-8b"])


def test_the_measurer_times_a_dense_backend_forward_and_backward():
    tiny = ModelShape("tiny", hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, ffn=128, vocab=100,
                      max_context=4096)
    ours = load("ours")
    ours.block_size = 32
    measurer = Measurer([tiny], kernel, make_attention("kernel", 32), timing.bench_cpu, device="cpu",
                        dtype=torch.float32, block_size=32, backends={"ours_dense": ours})
    point = GridPoint("attn", "tiny", (256, 77), (1.0, 1.0), "heldout", "ours_dense")
    rows = measurer.measure(point)
    assert [r["term"] for r in rows] == ["attn_fwd", "attn_bwd"]
    assert all(r["key"] == "attn@ours_dense|tiny|256+77|1+1" and float(r["median_ms"]) > 0 for r in rows)
    assert rows[0]["kept_fractions"] == "1;1" and rows[0]["split"] == "heldout"


def test_calibrate_run_names_the_backends_it_leaves_out(tmp_path, capsys):
    assert run.main(["--dry-run", "--csv", str(tmp_path / "x.csv"), "--backends", "ours,fa4"]) == 0
    assert run.peer_backends(["ours", "fa4"], dry_run=True, block_size=128) == ({"fa4": None}, [])
    if not torch.cuda.is_available():
        loaded, absent = run.peer_backends(None, dry_run=False, block_size=128)
        assert loaded == {} and [line.split(":")[0] for line in absent] == ["cudnn", "fa4", "fa3", "fa4_sparse"]
        with pytest.raises(ConfigError, match=r"^--backends fa4: fa4: absent \("):
            run.peer_backends(["fa4"], dry_run=False, block_size=128)


def test_backends_only_adds_the_dense_backends_to_a_profile_and_leaves_its_own_fit(tmp_path, shapes, capsys):
    """A peer timed later beside a committed profile: its terms join the profile, ours stay byte for byte."""
    ours_only = [r for r in rows_of(shapes) if "@" not in r["key"]]
    out = tmp_path / "h100.json"
    assert fit.main(["--csv", str(write_run(tmp_path, shapes, ours_only, ())), "--out", str(out)]) == 0
    before = json.loads(out.read_text())
    later = tmp_path / "later"
    later.mkdir()
    csv = write_run(later, shapes, rows_of(shapes, noise=0.02, seed=1))  # ours re-timed too: not refitted
    assert fit.main(["--csv", str(csv), "--out", str(out), "--backends-only"]) == 0
    after = load_profile(str(out))
    assert {k: v for k, v in after.items() if k not in ("backends", "meta")} == \
        {k: v for k, v in before.items() if k != "meta"}
    assert after["meta"]["backends_command"].startswith("python -m calibrate.run && python -m calibrate.fit --csv ")
    assert after["backends"]["fa4"]["terms"]["attn_fwd"]["flops"] == pytest.approx(TRUE["attn_fwd"]["flops"], rel=0.1)
    capsys.readouterr()
    (tmp_path / "none").mkdir()
    csv = write_run(tmp_path / "none", shapes, ours_only, ())
    with pytest.raises(SystemExit) as done:
        fit.main(["--csv", str(csv), "--out", str(out), "--backends-only"])
    assert done.value.code == 2 and "--backends-only: the CSV holds no peer backend's measurements" in \
        capsys.readouterr().err


def test_a_peer_whose_run_left_points_is_not_fitted_until_a_rerun_measures_them(tmp_path, shapes, capsys):
    """A run that spent its time budget leaves the longest points of a peer unmeasured: a fit of the rest would
    price long documents from short ones, so the peer stays out of the profile, with one line, until a rerun
    on the same CSV measures them (its run then leaves none)."""
    ours_only = [r for r in rows_of(shapes) if "@" not in r["key"]]
    out = tmp_path / "h100.json"
    assert fit.main(["--csv", str(write_run(tmp_path, shapes, ours_only, ())), "--out", str(out)]) == 0
    later = tmp_path / "later"
    later.mkdir()
    csv = write_run(later, shapes, rows_of(shapes))
    meta = json.loads(run.meta_path(csv).read_text())
    cut = {**meta["runs"][-1], "command": "python -m calibrate.run --backends fa4", "points_left": 7}
    run.meta_path(csv).write_text(json.dumps({"runs": [*meta["runs"][:-1], cut]}))
    with pytest.raises(SystemExit) as done:
        fit.main(["--csv", str(csv), "--out", str(out), "--backends-only"])
    err = capsys.readouterr().err
    assert done.value.code == 2 and "backend fa4: not fitted, 7 of its points are not measured; measure them " \
        f"first: python -m calibrate.run --csv {csv} --backends fa4" in err
    assert "backends" not in json.loads(out.read_text())
    assert fit.main(["--csv", str(csv), "--out", str(later / "h100.json")]) == 0  # a whole fit leaves it out too
    assert "backends" not in json.loads((later / "h100.json").read_text())
    run.write_meta(csv, {**cut, "command": "python -m calibrate.run --backends fa4 (rerun)", "points_left": 0})
    assert fit.main(["--csv", str(csv), "--out", str(out), "--backends-only"]) == 0
    after = load_profile(str(out))
    assert set(after["backends"]) == {"fa4"}
    assert after["meta"]["backends_command"].startswith("python -m calibrate.run --backends fa4 && ")


def test_the_calibration_figures_leave_the_dense_backends_rows_to_their_own_terms(tmp_path, shapes):
    from sparsebalance.viz.calibration import calibration_frame

    rows = rows_of(shapes)
    csv = write_run(tmp_path, shapes, rows)
    assert fit.main(["--csv", str(csv), "--out", str(tmp_path / "h100.json")]) == 0
    frame = calibration_frame(tmp_path / "h100.json")
    assert len(frame) == sum("@" not in r["key"] for r in rows) < len(rows)
    priced = frame[frame.predicted_ms > 0]  # an all-dense batch's selection is timed but priced at 0
    assert priced["residual_pct"].abs().max() < 1e-3  # ours' rows, priced by ours' terms


@pytest.fixture
def naive_sparse(monkeypatch):
    """``naive_sparse`` (tests/sparse_peer.py) in the registry for one test."""
    monkeypatch.setitem(BACKENDS, SPARSE, NaiveSparse)


def test_sparse_points_are_our_attention_points_and_the_validation_batches_held_out(shapes):
    for shape in shapes:
        points = sparse_points(shape, SPARSE)
        assert all(p.key.startswith(f"attn@{SPARSE}|{shape.name}|") and p.terms == DENSE_TERMS for p in points)
        ours = [(p.lengths, p.kept_fractions, p.split) for p in attention_points(shape)]
        assert [(p.lengths, p.kept_fractions, p.split) for p in points[:len(ours)]] == ours
        validation = points[len(ours):]
        assert len(validation) >= 2 and all(p.split == "heldout" for p in validation)
        assert any(n % BLOCK for p in validation for n in p.lengths)  # padding shows on held-out points
    grid = build_grid(shapes, ("fa4",), (SPARSE,))
    assert len(grid) == len(build_grid(shapes, ("fa4",))) + sum(len(sparse_points(s, SPARSE)) for s in shapes)


def test_fit_recovers_a_sparse_peers_terms_at_the_kept_fractions_it_realised(tmp_path, shapes, naive_sparse):
    csv = write_run(tmp_path, shapes, rows_of(shapes, sparse=(SPARSE,)), backends=("fa4", SPARSE))
    out = tmp_path / "h100.json"
    assert fit.main(["--csv", str(csv), "--out", str(out)]) == 0
    profile = load_profile(str(out))
    entry = profile["backends"][SPARSE]
    assert entry["sparse"] is True and "sparse" not in profile["backends"]["fa4"]
    assert entry["version"] == f"{SPARSE} 1.2.3"
    for term in DENSE_TERMS:
        for feat, coef in SPARSE_TRUE[term].items():
            assert entry["terms"][term][feat] == pytest.approx(coef, rel=1e-3), (term, feat)
    assert entry["fit"]["heldout_mape"]["attn_fwd+bwd"]["max_ape_pct"] < 1e-3
    assert entry["fit"]["points"]["heldout"] >= 8
    checked = [what for what, _, _ in backend_checks(profile, lambda section, *keys: 0.0)]
    assert f"held-out attn_fwd+bwd median, {SPARSE}" in checked and f"held-out attn_fwd+bwd max, {SPARSE}" in checked
    cfg = OmegaConf.to_object(compose_config([f"cost.profile={out}", "cost.attention_backend=hybrid",
                                              "model=llama3-8b"]))
    cost = make_cost(cfg.cost, cfg.model, Cluster.from_config(cfg.cluster), recompute=False)
    assert cost.sparse_backends() == (SPARSE,) and cost.dense_backends() == ("fa4",)


def test_a_peer_with_host_work_is_fitted_only_from_the_event_clock(tmp_path, shapes, naive_sparse, monkeypatch,
                                                                    capsys):
    """The busy clock sums a call's kernels; a peer whose call also does host work the GPU waits on (fa4_sparse:
    padding, a BlockMask, a compiled dispatch) would be priced low from it, so the fit leaves it out, with one
    line, and fits it from a CSV timed on the event clock, which holds that work."""
    monkeypatch.setattr(NaiveSparse, "host_work", True)
    rows = rows_of(shapes, sparse=(SPARSE,))
    busy = write_run(tmp_path, shapes, rows, backends=("fa4", SPARSE))
    out = tmp_path / "h100.json"
    assert fit.main(["--csv", str(busy), "--out", str(out)]) == 0
    assert set(load_profile(str(out))["backends"]) == {"fa4"}
    assert (f"backend {SPARSE}: not fitted, its calls do host work beside their kernels, which the busy clock this "
            "CSV was timed on leaves out; allowed: a CSV timed with calibrate.run --timing events") \
        in capsys.readouterr().err
    timed = tmp_path / "events"
    timed.mkdir()
    events = write_run(timed, shapes, rows, backends=("fa4", SPARSE))
    meta = json.loads(run.meta_path(events).read_text())
    run.meta_path(events).write_text(json.dumps({"runs": [{**meta["runs"][-1], "timing": "events"}]}))
    assert fit.main(["--csv", str(events), "--out", str(timed / "h100.json")]) == 0
    assert set(load_profile(str(timed / "h100.json"))["backends"]) == {"fa4", SPARSE}
    assert "not fitted" not in capsys.readouterr().err


def test_the_measurer_times_a_sparse_peer_on_its_selection_and_records_the_kept_fractions_realised():
    tiny = ModelShape("tiny", hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, ffn=128, vocab=100,
                      max_context=4096)
    peer = NaiveSparse(block_size=32)
    measurer = Measurer([tiny], kernel, make_attention("kernel", 32), timing.bench_cpu, device="cpu",
                        dtype=torch.float32, block_size=32, backends={SPARSE: peer})
    point = GridPoint("attn", "tiny", (256, 77), (0.5, 0.25), "fit", SPARSE)
    rows = measurer.measure(point)
    assert [r["term"] for r in rows] == ["attn_fwd", "attn_bwd"]
    assert all(r["key"] == f"attn@{SPARSE}|tiny|256+77|0.5+0.25" and float(r["median_ms"]) > 0 for r in rows)
    torch.manual_seed(0)  # the measurer's inputs
    q, k = torch.randn(333, 4, 16), torch.randn(333, 2, 16)
    sel = peer.select(q, k, peer.documents(point.lengths, "cpu"), kept_fraction=torch.tensor([0.5, 0.25]))
    assert rows[0]["kept_fractions"] == rows[1]["kept_fractions"] == ";".join(f"{f:.6g}" for f in
                                                                              sel.kept_fraction.tolist())
    assert rows[0]["kept_fractions"] != "0.5;0.25"  # the 77-token document keeps its 3 diagonal blocks of 6
    with pytest.raises(ValueError, match=f"backend {SPARSE}: block size 128, the calibration's 32"):
        Measurer([tiny], kernel, make_attention("kernel", 32), timing.bench_cpu, device="cpu", dtype=torch.float32,
                 block_size=32, backends={SPARSE: NaiveSparse()}).measure(point)


def test_calibrate_run_times_a_sparse_peer_at_our_attention_points(tmp_path, capsys, shapes, naive_sparse):
    assert run.main(["--dry-run", "--csv", str(tmp_path / "x.csv"), "--backends", SPARSE]) == 0
    total = len(build_grid(shapes, (), (SPARSE,)))
    assert capsys.readouterr().err.splitlines()[-1].startswith(f"{total} points, {total} to measure")
    assert run.split_peers(["fa4", SPARSE, "cudnn"]) == (("fa4", "cudnn"), (SPARSE,))
    loaded, absent = run.peer_backends([SPARSE], dry_run=False, block_size=64)
    assert absent == [] and loaded[SPARSE].block_size == 64  # it selects at the calibration's block size


def test_a_peer_timed_on_the_event_clock_in_a_csv_of_its_own_joins_the_profile_beside_the_others(
        tmp_path, shapes, naive_sparse, monkeypatch, capsys):
    """A CSV holds one clock: a host-work peer is timed alone (--peers-only) on the event clock into a CSV of its
    own, and --backends-only adds it to a profile fitted from the busy clock, keeping the peers already there."""
    monkeypatch.setattr(NaiveSparse, "host_work", True)
    out = tmp_path / "h100.json"
    assert fit.main(["--csv", str(write_run(tmp_path, shapes, rows_of(shapes))), "--out", str(out)]) == 0
    before = load_profile(str(out))
    assert before["backends"]["fa4"]["timing"] == "busy"
    assert run.main(["--dry-run", "--csv", str(tmp_path / "x.csv"), "--backends", SPARSE, "--peers-only"]) == 0
    only = [p for p in build_grid(shapes, (), (SPARSE,)) if p.backend == SPARSE]
    assert capsys.readouterr().err.splitlines()[-1].startswith(f"{len(only)} points, {len(only)} to measure")
    timed = tmp_path / "events"
    timed.mkdir()
    rows = [r for r in rows_of(shapes, (), sparse=(SPARSE,)) if r["key"].startswith(f"attn@{SPARSE}|")]
    events = write_run(timed, shapes, rows, backends=(SPARSE,), name="h100_fa4_sparse_events_raw.csv")
    meta = json.loads(run.meta_path(events).read_text())
    timed_run = {**meta["runs"][-1], "timing": "events", "command": f"python -m calibrate.run --backends {SPARSE} "
                 "--peers-only --timing events"}
    run.meta_path(events).write_text(json.dumps({"runs": [timed_run]}))
    with pytest.raises(SystemExit) as done:
        fit.main(["--csv", str(events), "--out", str(out)])
    assert done.value.code == 2 and f"--csv {events}: holds no measurements of our kernel or the layer" in \
        capsys.readouterr().err
    assert fit.main(["--csv", str(events), "--out", str(out), "--backends-only"]) == 0
    after = load_profile(str(out))
    assert set(after["backends"]) == {"fa4", SPARSE} and after["backends"]["fa4"] == before["backends"]["fa4"]
    assert after["backends"][SPARSE]["timing"] == "events" and after["backends"][SPARSE]["sparse"] is True
    assert after["terms"] == before["terms"] and after["fit"] == before["fit"]
    assert after["meta"]["backends_command"].split(" && ")[-2:] == [timed_run["command"], shlex_join(
        ["python", "-m", "calibrate.fit", "--csv", str(events), "--out", str(out), "--backends-only"])]
