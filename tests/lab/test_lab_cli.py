"""``nemo-factuality lab`` at its command line: usage errors are one line, every override is checked before any
work, ``--help`` shows the defaults (issue 26, items 5 and 6)."""

from __future__ import annotations

import time

import pytest

from nemo_factuality.cli import main


def _err_lines(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.strip()]


def test_a_misspelt_override_fails_before_any_work(tmp_path, capsys):
    out = tmp_path / "run"
    start = time.monotonic()
    assert main(["lab", "--out", str(out), "trainer.max_stepz=3"]) == 2
    assert time.monotonic() - start < 30  # no world, no pretraining, no evaluation first
    lines = _err_lines(capsys)
    assert len(lines) == 1 and lines[0].startswith("nemo-factuality lab: error:") and "max_stepz" in lines[0], lines
    assert not out.exists()


@pytest.mark.parametrize("argv, needle", [
    (["--bogus"], "--bogus"),
    (["--methods", "klcf,nope"], "nope"),
    (["--seeds", "0,x"], "--seeds"),
    (["--jobs", "0"], "--jobs"),
    (["rlfh:grpo.num_epochs=2", "--methods", "rlfh"], "grpo"),
    (["klcf:critic.optim.lr=1"], "critic"),
    (["notanoverride"], "notanoverride"),
    (["reward.gamma=[1,"], "cannot parse the value '[1,'"),
    (["--methods", "knowrl", "knowrl:reward.gamma=[1,"], "reward.gamma"),
])
def test_usage_errors_are_one_line_with_exit_2(tmp_path, capsys, argv, needle):
    assert main(["lab", "--out", str(tmp_path / "run"), *argv]) == 2
    lines = _err_lines(capsys)
    assert len(lines) == 1 and lines[0].startswith("nemo-factuality lab: error:") and needle in lines[0], lines


def test_lab_refuses_a_used_run_folder(tmp_path, capsys):
    (tmp_path / "something").write_text("x")
    assert main(["lab", "--quick", "--out", str(tmp_path)]) == 2
    assert "not an empty folder" in capsys.readouterr().err


def test_help_shows_every_default(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["lab", "--help"])
    assert exit_.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for default in ("(default: all)", "(default: 0)", "(default: 1)", "(default: pytriton)", "(default: synthetic)",
                    "Synthetic (default calibration)", "Countries (default top_layers)", "default smollm2-135m-instruct"):
        assert default in text, default


@pytest.mark.parametrize("argv, needle", [
    (["--policy", "smollm2-135m-instruct"], "--policy 'smollm2-135m-instruct': the synthetic world trains its own tiny"),
    (["--trainable", "lora"], "--trainable lora is for a real policy (--world countries)"),
    (["--world", "countries", "--trainable", "calibration"], "--trainable calibration is the tiny policy's; a real policy "
                                                             "takes top_layers, lora"),
    (["--world", "countries", "--policy", "no-such-model"], "--policy 'no-such-model' is neither a known model"),
])
def test_world_and_policy_pairs_are_checked_before_any_work(tmp_path, capsys, argv, needle):
    out = tmp_path / "o"
    assert main(["lab", "--out", str(out), *argv]) == 2
    err = capsys.readouterr().err
    assert needle in " ".join(err.split()) and "Traceback" not in err and not out.exists()
