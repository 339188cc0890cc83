"""``python -m calibrate.fit --check [PROFILE]``: a short report, exit 0 when the recorded fit meets the
error targets, 1 and one line naming every miss when it does not, 2 for a file that is not a profile."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from sparsebalance.calibrate import fit
from pinned import BACKENDS_PROFILE, PINNED_PROFILE

ROOT = Path(__file__).resolve().parents[2]


def within_attention_targets(report: dict) -> None:
    report["heldout_mape"]["attn_fwd+bwd"].update(median_ape_pct=2.9, max_ape_pct=9.9)


def doctored(tmp_path: Path, change) -> Path:
    """The pinned profile, its attention's held-out errors brought within the targets, then ``change``d."""
    profile = json.loads(PINNED_PROFILE.read_text())
    within_attention_targets(profile["fit"])
    change(profile["fit"])
    path = tmp_path / "doctored.json"
    path.write_text(json.dumps(profile))
    return path


def check(capsys, path: Path) -> tuple[int, str, str]:
    code = fit.main(["--check", str(path)])
    out, err = capsys.readouterr()
    return code, out, err


def test_the_pinned_profile_misses_only_its_attention_error_targets(capsys):
    """The frozen H200 profile's attention: held-out 3.94% median, 36.6% max, beyond every backend's 3% / 10%."""
    code, out, err = check(capsys, PINNED_PROFILE)
    assert code == 1
    assert err.splitlines() == [f"{PINNED_PROFILE}: error targets missed: held-out attn_fwd+bwd median, ours +3.943% "
                                "(target within 3%); held-out attn_fwd+bwd max, ours +36.563% (target within 10%)"]
    assert "held-out layer median" in out and out.count("MISSED") == 2
    assert out.count("validation ") == len(json.loads(PINNED_PROFILE.read_text())["fit"]["validation"])


def test_a_profile_within_every_target_passes(tmp_path, capsys):
    code, out, err = check(capsys, doctored(tmp_path, lambda report: None))
    assert code == 0 and err == "" and out.rstrip().endswith("error targets met") and "MISSED" not in out


def test_every_dense_backend_is_held_to_the_same_targets(tmp_path, capsys):
    profile = json.loads(BACKENDS_PROFILE.read_text())
    within_attention_targets(profile["fit"])
    for name, (median, worst) in {"cudnn": (2.5, 9.0), "fa4": (3.4, 6.0)}.items():
        profile["backends"][name]["fit"] = {"heldout_mape": {"attn_fwd+bwd": {"median_ape_pct": median,
                                                                              "max_ape_pct": worst, "points": 11}}}
    path = tmp_path / "backends.json"
    path.write_text(json.dumps(profile))
    code, out, err = check(capsys, path)
    assert code == 1 and "held-out attn_fwd+bwd max, cudnn: 9.00% (target within 10%) ok" in out
    assert err.splitlines()[0].endswith("error targets missed: held-out attn_fwd+bwd median, fa4 +3.4% "
                                        "(target within 3%)")


def set_validation_error(value):
    return lambda report: report["validation"][1].update(error_pct=value)


@pytest.mark.parametrize(
    "change, named",
    [
        (lambda r: r["heldout_mape"]["attn_fwd+bwd"].update(median_ape_pct=7.6),
         "held-out attn_fwd+bwd median, ours +7.6% (target within 3%)"),
        (lambda r: r["heldout_mape"]["attn_fwd+bwd"].update(max_ape_pct=10.2),
         "held-out attn_fwd+bwd max, ours +10.2% (target within 10%)"),
        (lambda r: r["heldout_mape"]["layer"].update(median_ape_pct=5.01), "held-out layer median +5.01%"),
        (set_validation_error(-10.5), "validation llama3-8b [30000, 20480, 10240, 3000] -10.5% (target within 10%)"),
        (lambda r: r["heldout_mape"].pop("layer"), "held-out layer median not recorded"),
        (lambda r: r["heldout_mape"]["layer"].update(median_ape_pct="2.9"), "held-out layer median not recorded"),
        (lambda r: r.update(validation=[]), "validation not recorded"),
        (lambda r: r.clear(), "held-out attn_fwd+bwd median, ours not recorded (target within 3%); held-out "
                               "attn_fwd+bwd max, ours not recorded (target within 10%); held-out layer median not "
                               "recorded (target within 5%); validation not recorded"),
    ],
    ids=["attention", "attention-max", "layer", "validation", "no-layer", "non-numeric", "no-validation", "no-fit"],
)
def test_a_doctored_profile_fails_naming_what_missed(tmp_path, capsys, change, named):
    path = doctored(tmp_path, change)
    code, out, err = check(capsys, path)
    assert code == 1 and "MISSED" in out and "error targets met" not in out
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{path}: error targets missed: ") and named in lines[0], err


def test_a_point_just_inside_the_limit_passes(tmp_path, capsys):
    assert check(capsys, doctored(tmp_path, set_validation_error(-10.0)))[0] == 0


def test_a_file_that_is_not_a_profile_is_bad_input(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("[]")
    with pytest.raises(SystemExit) as done:
        fit.main(["--check", str(bad)])
    err = capsys.readouterr().err
    assert done.value.code == 2 and err.splitlines() == [f"error: --check='{bad}': the top level is an array; "
                                                          "a profile is a JSON object"]


def test_check_defaults_to_the_committed_profile():
    assert fit.parse_args(["--check"]).check == fit.DEFAULT_OUT == ROOT / "calibrate" / "profiles" / "h200.json"


def test_check_from_the_shell_exits_with_the_verdict(tmp_path):
    def shell(path):
        return subprocess.run([sys.executable, "-m", "sparsebalance.calibrate.fit", "--check", str(path)], cwd=ROOT,
                              capture_output=True, text=True, timeout=120)

    assert shell(doctored(tmp_path, lambda report: None)).returncode == 0
    missed = shell(doctored(tmp_path, set_validation_error(25.0)))
    assert missed.returncode == 1 and len(missed.stderr.splitlines()) == 1 and "Traceback" not in missed.stderr
