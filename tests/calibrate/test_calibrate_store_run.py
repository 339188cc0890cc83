"""The runner side of calibration: the grid, the per-point CSV and resuming a killed run."""
from __future__ import annotations

import json

import pytest

from sparsebalance.calibrate import grid, run, store
from sparsebalance.calibrate.grid import GridPoint, build_grid
from sparsebalance.sim.core import ConfigError
from sparsebalance.sim.shapes import load_shapes


class FakeMeasurer:
    """Rows with made-up times; ``die_after`` points, it raises as a kill at the time limit would."""

    def __init__(self, die_after: int | None = None):
        self.die_after = die_after
        self.seen: list[str] = []

    def measure(self, point: GridPoint) -> list[dict]:
        if self.die_after is not None and len(self.seen) == self.die_after:
            raise KeyboardInterrupt("killed")
        self.seen.append(point.key)
        return [
            {"key": point.key, "term": t, "split": point.split, "model": point.model,
             "lengths": ";".join(map(str, point.lengths)),
             "kept_fractions": ";".join(map(str, point.kept_fractions)),
             "median_ms": 1.0, "p20_ms": 0.9, "p80_ms": 1.1, "reps": 5}
            for t in point.terms
        ]


@pytest.fixture
def points():
    return build_grid(load_shapes(list(run.CALIBRATED_MODELS)))[:12]


def test_killed_run_keeps_points_and_rerun_measures_only_the_rest(tmp_path, points):
    csv = tmp_path / "raw.csv"
    with pytest.raises(KeyboardInterrupt):
        run.measure_all(points, FakeMeasurer(die_after=5), csv, time_budget_s=None)
    assert len(run.pending(points, csv)) == len(points) - 5

    second = FakeMeasurer()
    run.measure_all(run.pending(points, csv), second, csv, time_budget_s=None)
    assert second.seen == [p.key for p in points[5:]]
    rows = store.read_rows(csv)
    assert sorted({r["key"] for r in rows}) == sorted(p.key for p in points)
    assert len(rows) == sum(len(p.terms) for p in points)
    assert run.pending(points, csv) == []


def test_half_written_line_is_dropped_and_the_point_measured_again(tmp_path, points):
    csv = tmp_path / "raw.csv"
    run.measure_all(points[:2], FakeMeasurer(), csv, time_budget_s=None)
    with csv.open("a") as f:  # a kill in the middle of writing the third point's first row
        f.write(f"{points[2].key},{points[2].terms[0]},fit,mod")
    assert [p.key for p in run.pending(points, csv)][0] == points[2].key
    run.measure_all(run.pending(points, csv), FakeMeasurer(), csv, time_budget_s=None)
    assert run.pending(points, csv) == []
    assert all(r["model"] != "mod" for r in store.read_rows(csv))


def test_point_missing_a_term_is_not_done(tmp_path, points):
    csv = tmp_path / "raw.csv"
    attn = next(p for p in points if p.kind == "attn")
    store.append_rows(csv, FakeMeasurer().measure(attn)[:1])
    assert store.done_keys(csv, {attn.key: attn.terms}) == set()


def test_time_budget_stops_starting_points(tmp_path, points, capsys):
    csv = tmp_path / "raw.csv"
    measured = run.measure_all(points, FakeMeasurer(), csv, time_budget_s=0.0)
    assert measured <= 1
    # off a terminal: plain lines, never a progress bar's carriage-return redraws
    err = capsys.readouterr().err
    assert "\r" not in err
    assert err.endswith(f"time budget of 0s spent; {len(points) - measured} points left for a rerun\n")


def test_csv_with_foreign_columns_is_refused(tmp_path, capsys):
    csv = tmp_path / "raw.csv"
    csv.write_text("a,b\n1,2\n")
    with pytest.raises(ConfigError, match="columns"):
        store.read_rows(csv)
    with pytest.raises(SystemExit) as exc:
        run.main(["--csv", str(csv), "--dry-run"])
    assert exc.value.code == 2
    assert capsys.readouterr().err.splitlines() == [f"error: {csv}: columns ['a', 'b']; allowed: calibrate.run's, "
                                                    + ", ".join(store.COLUMNS)]


def test_grid_keys_unique_lengths_within_context_and_validation_outside_grid():
    shapes = load_shapes(list(run.CALIBRATED_MODELS))
    points = build_grid(shapes)
    assert len({p.key for p in points}) == len(points)
    context = {s.name: s.max_context for s in shapes}
    assert all(max(p.lengths) <= context[p.model] for p in points)
    assert all(grid.kept_work(p.lengths, p.kept_fractions) <= grid.MAX_KEPT_WORK for p in points if p.kind == "attn")
    fitted = {(p.lengths, p.kept_fractions) for p in points if p.split == "fit"}
    validate = [p for p in points if p.split == "validate"]
    assert len(validate) == 3 * len(shapes)
    assert not any((p.lengths, p.kept_fractions) in fitted for p in validate)
    assert all(len(set(p.kept_fractions)) > 1 and len(p.lengths) > 1 for p in validate)


def test_heldout_points_are_interior_and_a_real_share():
    shapes = load_shapes(list(run.CALIBRATED_MODELS))
    for s in shapes:
        attn = grid.attention_points(s)
        held = [p for p in attn if p.split == "heldout"]
        assert 0.1 < len(held) / len(attn) < 0.5
        longest = max(max(p.lengths) for p in attn)
        for p in held:
            assert p.lengths not in ((1024,), (longest,))
            assert len(set(p.kept_fractions)) > 1 or p.kept_fractions[0] not in (1.0, grid.KEPT_FRACTIONS[-1])


def test_dry_run_prints_estimate_and_writes_nothing(tmp_path, capsys):
    csv = tmp_path / "raw.csv"
    assert run.main(["--csv", str(csv), "--dry-run"]) == 0
    assert "points" in capsys.readouterr().err
    assert not csv.exists()


@pytest.mark.parametrize("args, message", [
    (["--models", "llama3-8b", "gpt5"], "--models gpt5: no such model config; allowed: llama3-8b, qwen2.5-3b, tiny"),
    (["--block-size", "96"], "--block-size 96: the kernel is tuned for 64 or 128"),
    (["--models"], "--models: no model named; allowed: one or more of llama3-8b, qwen2.5-3b, tiny"),
    (["--max-tokens", "0"], "--max-tokens 0: must be a finite number > 0"),
    (["--min-tokens", "-1"], "--min-tokens -1: must be a finite number > 0"),
    (["--min-tokens", "8192", "--max-tokens", "4096"],
     "--min-tokens 8192: above --max-tokens 4096; allowed: at most it"),
    (["--time-budget-s", "-5"], "--time-budget-s -5.0: must be a finite number > 0"),
    (["--time-budget-s", "nan"], "--time-budget-s nan: must be a finite number > 0"),
    (["--time-budget-s", "inf"], "--time-budget-s inf: must be a finite number > 0"),
], ids=["unknown-model", "block-size", "no-model", "max-tokens", "min-tokens", "min-above-max", "time-budget",
        "time-budget-nan", "time-budget-inf"])
def test_bad_arguments_are_one_line_errors(tmp_path, capsys, args, message):
    with pytest.raises(SystemExit) as exc:
        run.main(["--csv", str(tmp_path / "raw.csv"), "--dry-run", *args])
    assert exc.value.code == 2
    assert capsys.readouterr().err.splitlines() == ["error: " + message]


def measured_run(tmp_path, points, **facts):
    """A CSV with ``points`` measured by a run over the calibrated models at block 128, busy timing on cuda,
    changed by ``facts``; its text and its metadata's."""
    csv = tmp_path / "raw.csv"
    run.measure_all(points, FakeMeasurer(), csv, time_budget_s=None)
    shapes = load_shapes(list(run.CALIBRATED_MODELS))
    entry = {"timing": "busy", "device": "cuda", "grid": run.grid_description(shapes, 128, None, len(points))}
    run.write_meta(csv, entry | facts)
    return csv, csv.read_text(), run.meta_path(csv).read_text()


@pytest.mark.parametrize("args, recorded, named", [
    (["--block-size", "64"], {}, "measured with block_size=128 (its raw.meta.json), this run has block_size=64"),
    (["--timing", "events"], {}, "measured with timing='busy' (its raw.meta.json), this run has timing='events'"),
    ([], {"device": "cpu"}, "measured with device='cpu' (its raw.meta.json), this run has device='cuda'"),
], ids=["block-size", "timing", "device"])
def test_a_csv_measured_with_other_settings_is_not_resumed(tmp_path, capsys, points, args, recorded, named):
    """Its points time something else: they must not count as done (nor be mixed with this run's)."""
    csv, rows, meta = measured_run(tmp_path, points, **recorded)
    capsys.readouterr()  # the measuring's progress bar
    with pytest.raises(SystemExit) as exc:
        run.main(["--csv", str(csv), "--dry-run", *args])
    lines = capsys.readouterr().err.splitlines()
    assert exc.value.code == 2 and len(lines) == 1 and named in lines[0], lines
    assert lines[0].startswith(f"error: --csv {csv}: ") and lines[0].endswith("; allowed: the same settings, or "
                                                                              "another --csv for these")
    assert csv.read_text() == rows and run.meta_path(csv).read_text() == meta


def test_a_csv_measured_with_the_same_settings_resumes_with_other_models(tmp_path, capsys, points):
    csv, _, _ = measured_run(tmp_path, points)
    assert run.main(["--csv", str(csv), "--dry-run", "--models", "llama3-8b", "--max-tokens", "4096"]) == 0
    assert run.main(["--csv", str(csv), "--dry-run"]) == 0
    peers = run.peer_backends(None, dry_run=True, block_size=128)[0]  # a dry run counts every peer's points
    total = len(build_grid(load_shapes(list(run.CALIBRATED_MODELS)), *run.split_peers(peers)))
    assert capsys.readouterr().err.splitlines()[-1].startswith(f"{total} points, {total - len(points)} to measure")


def test_no_gpu_is_one_line_before_anything_is_written(tmp_path):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    csv = tmp_path / "raw.csv"
    with pytest.raises(SystemExit, match="--device cuda: this machine has no CUDA GPU"):
        run.main(["--csv", str(csv), "--max-tokens", "1024"])
    assert list(tmp_path.iterdir()) == []


def test_meta_lists_each_run_and_the_last_is_rewritten_at_its_end(tmp_path):
    csv = tmp_path / "raw.csv"
    run.write_meta(csv, {"command": "first", "points_measured": 3})
    run.write_meta(csv, {"command": "second", "points_measured": None})
    run.write_meta(csv, {"command": "second", "points_measured": 7}, replace_last=True)
    runs = json.loads(run.meta_path(csv).read_text())["runs"]
    assert [(r["command"], r["points_measured"]) for r in runs] == [("first", 3), ("second", 7)]


@pytest.mark.slow
def test_comm_bandwidth_over_message_sizes_with_two_processes():
    from sparsebalance.calibrate.comm import measure_comm

    comm = measure_comm(2, backend="gloo", sizes=(1 << 12, 1 << 16))
    assert [r["bytes"] for r in comm["allreduce"]] == [1 << 12, 1 << 16] == [r["bytes"] for r in comm["p2p"]]
    assert comm["allreduce_busbw_gbps"] > 0 and comm["p2p_gbps"] > 0


def test_one_device_records_comm_as_not_measured():
    assert run.comm_figures("cpu").startswith("not measured")


def test_min_tokens_times_only_the_long_end_again(tmp_path, capsys):
    """The long end of a grid timed again into another CSV: only points of at least --min-tokens tokens."""
    shapes = load_shapes(["llama3-8b"])
    long = run.select_points(build_grid(shapes), None, 65536)
    assert long and all(p.tokens >= 65536 for p in long)
    assert {p.key for p in long} == {p.key for p in build_grid(shapes) if p.tokens >= 65536}
    assert run.main(["--csv", str(tmp_path / "raw.csv"), "--dry-run", "--models", "llama3-8b", "--backends", "ours",
                     "--min-tokens", "65536"]) == 0
    assert capsys.readouterr().err.splitlines()[-1].startswith(f"{len(long)} points, {len(long)} to measure")
