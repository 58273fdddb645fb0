"""A rerun into a run folder resumes only a checkpoint of the same model, and keeps the first run's config
(issue 50, item 10), through the real ``nemo-factuality train grpo`` command.

Before, a rerun whose ``model.path`` was another model loaded the checkpoint into it after minutes and ended in a
55-line ``size mismatch for lm_head.weight`` traceback — with the first run's ``config.yaml`` already overwritten — and a
rerun with another learning rate took it silently. Now the first is one line (exit 2) naming what differs, before
anything is written or loaded; the second keeps ``config.yaml`` and writes what changed beside it.
"""

from __future__ import annotations

import pytest
import yaml

from nemo_factuality.cli import main as cli_main
from nemo_factuality.testing.fake_openai import ScriptedOpenAIServer
from nemo_factuality.testing.methods import method_judge
from nemo_factuality.testing.training import build_policy, write_jsonl

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def judge():
    with ScriptedOpenAIServer(method_judge) as server:
        yield server


def _train(tmp_path, judge, policy, run, *extra: str) -> int:
    data = write_jsonl(tmp_path / "klcf.jsonl", [{"prompt": f"Tell me about Ada {i}.", "checklist": ["Ada was born in 1917."]}
                                                 for i in range(4)])
    roles = ("judge", "checklist_judge", "pipeline.extractor.judge", "pipeline.verifier.judge")
    return cli_main(["train", "grpo", "--config-name", "tiny_cpu_klcf", f"data.train={data}", "reward.w_rm=0",
                     "reward.general_rm=null", *[f"reward.{k}.base_url={judge.url}" for k in roles], f"model.path={policy}",
                     f"exp_manager.explicit_log_dir={run}", "model.length_params.max_length=6", "trainer.save_interval=1",
                     *extra])


def _files(run) -> dict[str, int]:
    return {str(p.relative_to(run)): p.stat().st_mtime_ns for p in run.rglob("*") if p.is_file()}


def test_a_rerun_of_another_model_is_refused_before_anything_is_written(tmp_path, judge, tiny_policy, capfd):
    run = tmp_path / "run"
    assert _train(tmp_path, judge, tiny_policy, run, "trainer.max_steps=1") == 0
    first_config, before = (run / "config.yaml").read_bytes(), _files(run)
    other = build_policy(tmp_path / "other", head_dim=16)  # hidden 64 instead of 48
    capfd.readouterr()
    assert _train(tmp_path, judge, other, run, "trainer.max_steps=2") == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert err[-1] == (f"nemo-factuality train: error: exp_manager.explicit_log_dir={run}: its checkpoint step_000001 "
                       "was trained from another model (head_dim 12 there, 16 now; hidden_size 48 there, 64 now; "
                       "intermediate_size 96 there, 128 now): point exp_manager.explicit_log_dir at a new folder, or "
                       "set exp_manager.resume_if_exists=false to start this model there from its first step"), err[-3:]
    assert not any("Traceback" in line for line in err)
    assert (run / "config.yaml").read_bytes() == first_config and _files(run) == before  # nothing written


def test_a_resume_keeps_the_first_config_and_writes_what_it_changed_beside_it(tmp_path, judge, tiny_policy, caplog):
    run = tmp_path / "run"
    assert _train(tmp_path, judge, tiny_policy, run, "trainer.max_steps=1") == 0
    first_config = (run / "config.yaml").read_bytes()
    assert _train(tmp_path, judge, tiny_policy, run, "trainer.max_steps=2", "model.optim.lr=5.0e-4") == 0
    assert (run / "config.yaml").read_bytes() == first_config
    changes = yaml.safe_load((run / "config.resume.step_000001.yaml").read_text())
    assert changes == {"resumed_from": "step_000001",
                       "changed": {"model.optim.lr": {"first": 1.0e-3, "now": 5.0e-4},
                                   "trainer.max_steps": {"first": 1, "now": 2}}}
    assert any("resuming step_000001 with 2 changed setting(s): model.optim.lr 0.001 → 0.0005" in r.getMessage()
               for r in caplog.records)
