"""The CLI error boundary: every user error is one line on stderr and exit 2 (no traceback); --debug shows it.

Each case runs the real ``nemo-factuality`` entry point in a subprocess, in a scratch working directory.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from nemo_factuality import __version__
from nemo_factuality.config import REPO_ROOT

ENV = dict(os.environ, PYTHONPATH=str(REPO_ROOT), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1")
ENV.pop("NEMO_FACTUALITY_DEBUG", None)
FILES = ["bad.yaml", "empty.jsonl", "existing.txt", "hf_corrupt", "kb.sqlite", "kb.sqlite.bm25", "labelled.jsonl",
         "no_documents.db", "not_sqlite.db", "unclosed.jsonl", "unlabelled.jsonl", "unterminated.jsonl", "wrong_fields.jsonl"]
# a record whose closing brace is missing: Python's parser places the error at the end of the line, not column 1
UNCLOSED = json.dumps({"id": 1, "prompt": "Tell me about Ada Varga.", "response": "Ada Varga was born in 1917."})[:-1]


def _parser_column(text: str) -> int:
    try:
        json.loads(text)
    except json.JSONDecodeError as err:
        return err.colno
    raise AssertionError("UNCLOSED must not parse")


def _cli(args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nemo_factuality.cli", *args], cwd=cwd, env=dict(ENV, **env),
                          capture_output=True, text=True, timeout=180)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    from nemo_factuality.knowledge.store import build_store

    root = tmp_path_factory.mktemp("cli")
    (root / "unlabelled.jsonl").write_text(json.dumps({"id": 1, "prompt": "p", "response": "Ada Varga was born in 1917."}) + "\n")
    (root / "labelled.jsonl").write_text(json.dumps({"id": 1, "prompt": "p", "response": "r",
                                                     "claims": [{"text": "c", "label": "supported"}]}) + "\n")
    (root / "existing.txt").write_text("not a report\n")
    (root / "empty.jsonl").write_text("\n")
    (root / "bad.yaml").write_text("trainer: {max_steps: [1,\n")
    data = REPO_ROOT / "nemo_factuality" / "data"
    build_store(data / "demo_passages.jsonl", root / "kb.sqlite", facts_jsonl=data / "demo_facts.jsonl", progress=False)
    (root / "hf_corrupt").mkdir()
    (root / "hf_corrupt" / "config.json").write_text('{"model_type": "qwen2", "hidden_size": ')
    (root / "unclosed.jsonl").write_text(UNCLOSED + "\n")
    (root / "unterminated.jsonl").write_text('{"id": 1, "prompt": "Tell me\n')  # the string starts at column 21
    (root / "wrong_fields.jsonl").write_text(json.dumps({"id": 1, "question": "q"}) + "\n")
    (root / "not_sqlite.db").write_text("title,text\nAda,born 1917\n")
    with sqlite3.connect(root / "no_documents.db") as db:  # SQLite, but not FActScore's documents(title, text)
        db.execute("CREATE TABLE passages (title TEXT, text TEXT)")
    assert sorted(p.name for p in root.iterdir()) == FILES
    return root


CASES = {  # name: (argv, a phrase the one line must contain)
    "eval_missing_input": (["eval", "--input", "nope.jsonl", "--output", "out"], "--input nope.jsonl does not exist"),
    "eval_unlabelled_without_config": (["eval", "--input", "unlabelled.jsonl", "--output", "out"],
                                       "--config-name demo_kb pipeline.verifier.store_path="),
    "eval_safe_vllm_without_store": (["eval", "--input", "unlabelled.jsonl", "--output", "out", "--config-name", "safe_vllm"],
                                     "pipeline.evidence.store_path has no value"),
    "eval_output_is_a_file": (["eval", "--input", "labelled.jsonl", "--output", "existing.txt"], "is an existing file"),
    # issue 43: before, only "Not a directory: existing.txt/out"
    "eval_output_under_a_file": (["eval", "--input", "labelled.jsonl", "--output", "existing.txt/out"],
                                 "--output existing.txt/out is under existing.txt, which is a file, not a directory"),
    "eval_k_zero": (["eval", "--input", "labelled.jsonl", "--output", "out", "--k", "0"], "--k values must be positive"),
    "eval_k_not_a_number": (["eval", "--input", "labelled.jsonl", "--output", "out", "--k", "abc"], "--k must be a comma-separated"),
    "eval_unknown_flag": (["eval", "--input", "labelled.jsonl", "--output", "out", "--bogus"], "unrecognized arguments: --bogus"),
    "kb_query_missing_store": (["kb", "query", "--kb", "nope.sqlite", "born"], "nope.sqlite does not exist"),
    "kb_query_dense_without_index": (["kb", "query", "--kb", "kb.sqlite", "--dense", "born"], "no dense index at"),
    "kb_build_missing_passages": (["kb", "build", "--passages", "nope.jsonl", "--out", "x.sqlite"], "--passages nope.jsonl does not exist"),
    "launch_unknown_stage": (["launch", "nope", "--dry-run"], "Config 'nope' not found"),
    "launch_unknown_cluster": (["launch", "grpo_klcf", "--cluster", "nope", "--dry-run"], "Config 'nope' not found"),
    "launch_misspelled_override": (["launch", "grpo_klcf", "--dry-run", "actor_nodez=4"], "did you mean 'actor_nodes'"),
    "launch_gpu_stage_on_local_cpu": (["launch", "ppo_rlfh", "--cluster", "local_cpu", "--dry-run", "params.policy_model=/p",
                                       "params.train_data=/d", "params.judge_model=/j"], "trainer.device=cuda but the profile"),
    "launch_required_params": (["launch", "grpo_fspo", "--dry-run"], "grpo_fspo needs params.policy_model, params.train_data"),
    "convert_corrupt_config": (["convert", "hf-to-nemo", "--hf", "hf_corrupt", "--out", "x.nemo"], "config.json:1:"),
    "convert_missing_directory": (["convert", "hf-to-nemo", "--hf", "nope", "--out", "x.nemo"], "--hf nope does not exist"),
    # before: eight Megatron "Transformer Engine and Apex are not installed" warnings ahead of the error
    "convert_verify_corrupt_reference": (["convert", "verify", "--hf", "hf_corrupt", "--nemo", "kb.sqlite"], "config.json:1:"),
    "kb_build_factscore_not_sqlite": (["kb", "build", "--factscore-db", "not_sqlite.db", "--out", "x.sqlite"],
                                      "not_sqlite.db is not a FActScore database (file is not a database)"),
    "kb_build_factscore_no_documents": (["kb", "build", "--factscore-db", "no_documents.db", "--out", "x.sqlite"],
                                        "no_documents.db is not a FActScore database (no such table: documents)"),
    "eval_unclosed_record": (["eval", "--input", "unclosed.jsonl", "--output", "out"],
                             f"unclosed.jsonl:1: invalid JSON (Expecting ',' delimiter at column {_parser_column(UNCLOSED)})"),
    # issue 54 item 6: before, "Unterminated string starting at at column 21"
    "eval_unterminated_string": (["eval", "--input", "unterminated.jsonl", "--output", "out"],
                                 "unterminated.jsonl:1: invalid JSON (Unterminated string starting at column 21); each"),
    "convert_nemo_to_hf_missing": (["convert", "nemo-to-hf", "--nemo", "nope.nemo", "--out", "o"], "--nemo nope.nemo does not exist"),
    "unknown_command": (["evaluate"], "unknown command 'evaluate'"),
    # a value YAML cannot parse: one line naming the override, in every command taking overrides
    "train_malformed_override": (["train", "grpo", "--config-name", "tiny_cpu_klcf", "trainer.max_steps=[1,"],
                                 "override 'trainer.max_steps=[1,': cannot parse the value '[1,'"),
    "eval_malformed_override": (["eval", "--demo", "--output", "out", "pipeline.evidence.k=[1,"],
                                "override 'pipeline.evidence.k=[1,'"),
    "serve_malformed_override": (["serve", "--config-name", "demo", "http_port=[1,"], "override 'http_port=[1,'"),
    "launch_malformed_override": (["launch", "cpu_standin", "--dry-run", "actor_nodes=[1,"], "override 'actor_nodes=[1,'"),
    "train_malformed_config_file": (["train", "grpo", "--config-name", "bad.yaml"], "config bad.yaml is not valid YAML"),
    # counts that would run nothing are config errors, not an untrained final/
    # issue 43 item 9: every missing field named at once, with the fields the record has
    "train_record_missing_fields": (["train", "grpo", "--config-name", "tiny_cpu_klcf", "data.format=klcf",
                                     "data.train=wrong_fields.jsonl", "model.path=hf_corrupt"],
                                    "wrong_fields.jsonl:1: missing fields 'prompt', 'checklist' (the record has: 'id', 'question')"),
    "train_max_steps_zero": (["train", "grpo", "--config-name", "tiny_cpu_klcf", "trainer.max_steps=0"],
                             "trainer.max_steps must be >= 1, got 0"),
    "train_max_steps_negative": (["train", "ppo", "--config-name", "tiny_cpu_rlfh", "trainer.max_steps=-1"],
                                 "trainer.max_steps must be >= 1, got -1"),
    "train_kto_zero_iterations": (["train", "kto", "--config-name", "tiny_cpu_factalign", "kto.num_iterations=0"],
                                  "kto.num_iterations must be >= 1, got 0"),
    "train_megatron_sequence_parallel_at_tp1": (["train", "grpo", "--config-name", "tiny_cpu_klcf", "trainer.backend=megatron",
                                                 "model.megatron.sequence_parallel=true"],
                                                "model.megatron.sequence_parallel=true needs model.tensor_model_parallel_size > 1"),
    # issue 39: a rank's server/engine window longer than the process groups' timeout is refused, naming both keys
    "train_retry_window_past_the_group_timeout": (
        ["train", "grpo", "--config-name", "tiny_cpu_klcf", "reward=null", "remote_rm.url=http://127.0.0.1:9",
         "trainer.distributed_timeout_s=600"],
        "2 × remote_rm.timeout_s + remote_rm.retry.max_wait_s = 1800 s does not fit inside trainer.distributed_timeout_s=600 s"),
    "train_vllm_window_past_the_group_timeout": (
        ["train", "grpo", "--config-name", "tiny_cpu_klcf", "rollout.engine=vllm", "rollout.vllm.request_timeout_s=3000"],
        "rollout.vllm.restarts × (40 s to stop + rollout.vllm.start_timeout_s + 2 × rollout.vllm.reply_timeout_s) = "
        "11680 s does not fit inside trainer.distributed_timeout_s=7200 s"),
    # issue 50 item 7: every attempt with its reply counted — the old one-timeout settings (900 s for every reply)
    # reach 10280 s (the old formula said 5700 s and passed them); a broadcast refit's join and stream close too
    "train_vllm_window_every_attempt_and_reply": (
        ["train", "grpo", "--config-name", "tiny_cpu_klcf", "rollout.engine=vllm", "rollout.vllm.request_timeout_s=900",
         "rollout.vllm.reply_timeout_s=900"], "= 10280 s does not fit inside trainer.distributed_timeout_s=7200 s"),
    "train_vllm_broadcast_window_counts_the_join": (
        ["train", "grpo", "--config-name", "tiny_cpu_klcf", "rollout.engine=vllm", "rollout.vllm.refit=broadcast",
         "rollout.vllm.reply_timeout_s=400"],
        "4 × rollout.vllm.reply_timeout_s) = 8680 s does not fit inside trainer.distributed_timeout_s=7200 s"),
    "train_in_process_judges_window": (
        ["train", "grpo", "--config-name", "tiny_cpu_klcf", "trainer.distributed_timeout_s=100"],
        "the in-process reward's judges one after another"),
    # issue 43: abbreviations are off in every parser (--seed silently meant --seeds)
    "lab_abbreviated_flag": (["lab", "--seed", "3", "--out", "out"], "unrecognized arguments: --seed"),
    "eval_abbreviated_flag": (["eval", "--inp", "labelled.jsonl", "--output", "out"], "unrecognized arguments: --inp"),
    "kb_abbreviated_flag": (["kb", "build", "--pass", "x.jsonl", "--out", "x.sqlite"], "--pass"),
    # issue 43: a typo inside a free-form block (a reward's options) is the same one line as a top-level typo
    "serve_nested_typo": (["serve", "--config-name", "demo", "reward.pipeline.verifier.store_path=kb.sqlite", "reward.kk=10"],
                          "unknown config key reward.kk; did you mean 'k'?"),
    "serve_nested_guard_typo": (["serve", "--config-name", "demo", "reward.pipeline.verifier.store_path=kb.sqlite",
                                 "reward.guards.dedup_claim=true"], "unknown config key reward.guards.dedup_claim; did you mean"),
    "train_nested_typo": (["train", "grpo", "--config-name", "tiny_cpu_klcf", "model.path=hf_corrupt", "reward.min_claimz=2"],
                          "unknown config key reward.min_claimz"),
    # issue 43: the megatron backend on a CPU machine is one line naming the route that runs (before: a 48-line
    # "Torch not compiled with CUDA enabled" traceback and a config.yaml left behind)
    "train_megatron_on_cpu": (["train", "grpo", "--config-name", "tiny_cpu_klcf", "trainer.backend=megatron",
                               "model.path=hf_corrupt"],
                              "the megatron backend trains on GPUs (trainer.device=cuda"),
    "kb_build_empty_passages": (["kb", "build", "--passages", "empty.jsonl", "--out", "x.sqlite"],
                                "empty.jsonl has no passages"),
    "serve_same_port_twice": (["serve", "--config-name", "demo", "grpc_port=5555"], "grpc_port=5555 is also http_port"),
    # flags and overrides are checked before the demo store is built into --output
    "eval_demo_bad_k": (["eval", "--demo", "--output", "out", "--k", "0"], "--k values must be positive"),
    "eval_demo_unknown_key": (["eval", "--demo", "--output", "out", "pipeline.verifer.name=x"],
                              "unknown config key pipeline.verifer in override 'pipeline.verifer.name=x'; did you mean "
                              "'verifier'?"),
    # issue 54 item 6: a typo beside the ??? the config leaves was "pipeline.verifier.store_path has no value"
    "eval_typo_beside_a_missing_value": (["eval", "--input", "unlabelled.jsonl", "--output", "out", "--config-name",
                                          "demo_kb", "pipeline.verifer.store_path=kb.sqlite"],
                                         "unknown config key pipeline.verifer in override "
                                         "'pipeline.verifer.store_path=kb.sqlite'; did you mean 'verifier'?"),
    "eval_demo_unknown_option": (["eval", "--demo", "--output", "out", "pipeline.verifier.bogus=1"],
                                 "unknown option(s) ['bogus']"),
    # issue 54 item 2: a directory where a file belongs is said to be one (kb.sqlite.bm25/ is the store's own index
    # folder, the likely mistake); before, "does not exist" — and kb build indexed, then failed on a temporary name
    "kb_query_directory_store": (["kb", "query", "--kb", "kb.sqlite.bm25", "born"],
                                 "knowledge store kb.sqlite.bm25 is a directory, not a file; pass the store's SQLite file"),
    "eval_directory_store": (["eval", "--input", "unlabelled.jsonl", "--output", "out", "--config-name", "demo_kb",
                              "pipeline.verifier.store_path=."],
                             "knowledge store . is a directory, not a file (it holds kb.sqlite, no_documents.db, "
                             "not_sqlite.db); pass the store's SQLite file"),
    "eval_directory_input": (["eval", "--input", ".", "--output", "out"],
                             "--input . is a directory, not a file (it holds empty.jsonl, labelled.jsonl, unclosed.jsonl, "
                             "…); --input takes the records' JSONL file"),
    "train_directory_data": (["train", "grpo", "--config-name", "tiny_cpu_klcf", "data.train=kb.sqlite.bm25",
                              "model.path=hf_corrupt"],
                             "data file kb.sqlite.bm25 is a directory, not a file; point data.train / data.validation at"),
    "kb_build_into_a_directory": (["kb", "build", "--demo", "--out", "kb.sqlite.bm25"],
                                  "--out kb.sqlite.bm25 is a directory; pass the file to write, e.g. --out "
                                  "kb.sqlite.bm25/kb.sqlite"),
    "kb_build_directory_passages": (["kb", "build", "--passages", "kb.sqlite.bm25", "--out", "x.sqlite"],
                                    "--passages kb.sqlite.bm25 is a directory, not a file"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_user_error_is_one_line_and_exit_2(work, name):
    args, phrase = CASES[name]
    res = _cli(args, work)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1, f"rc={res.returncode}\n{res.stderr}"
    assert lines[0].startswith("nemo-factuality") and ": error: " in lines[0] and phrase in lines[0], lines[0]
    assert "Traceback" not in res.stderr and res.stdout == ""
    assert sorted(p.name for p in work.iterdir()) == FILES  # an error writes nothing


def test_a_training_config_error_reaches_the_user_before_torch_loads(work):
    """The config and inputs are checked before the backends, the reward runtime and torch are imported (torch alone
    took 1.9 s of the 3.2 s such an error took): the user waits for the error line only."""
    probe = ("import sys\nfrom nemo_factuality.cli import main\ntry:\n    code = main(sys.argv[1:])\nexcept SystemExit as stop:\n"
             "    code = stop.code\nprint(code, 'torch' in sys.modules)")
    for args in (CASES["train_max_steps_zero"][0], CASES["train_kto_zero_iterations"][0]):
        res = subprocess.run([sys.executable, "-c", probe, *args], cwd=work, env=ENV, capture_output=True, text=True,
                             timeout=180)
        assert res.stdout.split() == ["2", "False"], (args, res.stdout, res.stderr[-2000:])


def test_debug_flag_and_env_var_show_the_traceback(work):
    args, _ = CASES["eval_k_zero"]
    for res in (_cli(["--debug", *args], work), _cli([*args, "--debug"], work), _cli(args, work, NEMO_FACTUALITY_DEBUG="1")):
        assert res.returncode != 0 and "Traceback" in res.stderr and "UsageError: --k values must be positive" in res.stderr


def test_version_and_help_texts(work):
    res = _cli(["--version"], work)
    assert res.returncode == 0 and res.stdout.strip() == f"nemo-factuality {__version__}"
    helps = {c: _cli([*c.split(), "--help"], work) for c in ("eval", "kb build", "kb query", "serve", "convert hf-to-nemo",
                                                           "convert nemo-to-hf", "convert verify", "launch")}
    for command, res in helps.items():
        assert res.returncode == 0 and "``" not in res.stdout, (command, res.stdout)  # no RST markup in a terminal
    for command in ("eval", "serve", "launch"):  # commands taking config overrides say so in their usage line
        assert "[key=value ...]" in helps[command].stdout.splitlines()[0], helps[command].stdout
    assert "(default: 64,100,178)" in helps["eval"].stdout and "(default: h100_pyxis)" in helps["launch"].stdout
    assert "(default: 5)" in helps["kb query"].stdout and "(default: float32)" in helps["convert hf-to-nemo"].stdout
    assert "(default: 0.0)" in " ".join(helps["eval"].stdout.split())  # a zero default is a default too


def test_the_recipes_the_errors_give_work(work, tmp_path):
    """The unlabelled-input error names --config-name demo_kb pipeline.verifier.store_path=...: that runs."""
    out = tmp_path / "out"
    res = _cli(["eval", "--input", str(work / "unlabelled.jsonl"), "--output", str(out), "--config-name", "demo_kb",
                f"pipeline.verifier.store_path={work / 'kb.sqlite'}"], tmp_path)
    assert res.returncode == 0, res.stderr
    report = json.loads((out / "report.json").read_text())["groups"]["all"]
    assert report["n_records"] == 1 and report["label_counts"]["supported"] == 1  # Ada Varga was born in 1917


def test_pipeline_parts_are_switched_on_the_command_line(work, tmp_path):
    """Issue 54 item 3: safe_vllm's LLM pipeline turned into the offline one by choosing other parts. Before: kb_exact
    got llm_judge's `style` (unknown option), safe's extractor options, and `evidence={name: none}` merged into the kb
    block, whose store_path stayed ??? ("has no value")."""
    out = tmp_path / "out"
    res = _cli(["eval", "--input", str(work / "unlabelled.jsonl"), "--output", str(out), "--config-name", "safe_vllm",
                "pipeline.extractor.name=identity", "pipeline.evidence={name: none}", "pipeline.verifier.name=kb_exact",
                f"pipeline.verifier.store_path={work / 'kb.sqlite'}"], tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    report = json.loads((out / "report.json").read_text())["groups"]["all"]
    assert report["n_records"] == 1 and report["label_counts"]["supported"] == 1


def test_kb_query_shows_rank_and_explains_the_score(work):
    res = _cli(["kb", "query", "--kb", "kb.sqlite", "born", "-k", "3"], work)
    rows = [json.loads(line) for line in res.stdout.splitlines()]
    assert res.returncode == 0 and [r["rank"] for r in rows] == [1, 2, 3]
    assert all(rows[i]["score"] >= rows[i + 1]["score"] for i in range(2))
    assert "rank 1 = best match" in res.stderr and "BM25" in res.stderr
