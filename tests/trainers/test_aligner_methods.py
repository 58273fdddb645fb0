"""Every method's served reward through its training stage on the aligner backend at TP=2, PP=2 and DP=2 (TP=1).

NeMo-Aligner's Megatron actor (CPU/gloo, torchrun, 2 processes) runs, one stage after another on one actor
per layout (``aligner_driver.py --scenario methods``): KLCF, FSPO and KnowRL through the GRPO stage, FactAlign
through the KTO stage and RLFH through the PPO stage with NeMo-Aligner's critic server — 2 steps each (KTO:
one iteration). As on a cluster, the rewards are not in the Aligner venv: each is served by ``nemo-factuality
serve --config-name <method>`` from the project venv (the production topology), its LLM judges pointed at a
scripted loopback judge, its knowledge store at a real SQLite store and its NLI verifier at a tiny classifier;
the stages reach them through ``remote_rm.url``. The servers start once for all layouts.
"""

from __future__ import annotations

import json
import math
import re
import time
import zlib
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest

from nemo_factuality.testing.aligner_env import aligner_venv, run_in_aligner_venv, skip_reason
from nemo_factuality.testing.fake_openai import Reply, ScriptedOpenAIServer
from nemo_factuality.testing.methods import FACTS, build_kb, method_judge
from nemo_factuality.testing.ports import free_ports
from nemo_factuality.testing.servers import critic_server, ppo_overrides, reward_server
from nemo_factuality.testing.training import write_jsonl

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
DRIVER = "tests/trainers/aligner_driver.py"
# method → (stage, tiny preset the stage config starts from)
METHODS = {"klcf": ("grpo", "tiny_cpu_klcf"), "fspo": ("grpo", "tiny_cpu_fspo"), "knowrl": ("grpo", "tiny_cpu_knowrl"),
           "factalign": ("kto", "tiny_cpu_factalign"), "rlfh": ("ppo", "tiny_cpu_rlfh")}


def _judge(req: dict) -> Reply:
    """``method_judge``, except that KLCF's checklist judge covers the item for about half of the responses (by a hash
    of its request, which holds the response): GRPO groups get different rewards, so the update is not zero."""
    reply = method_judge(req)
    if reply.text == "Covered":
        return Reply("Covered" if zlib.crc32(req["messages"][-1]["content"].encode()) % 2 else "Not covered")
    return reply


def _serve_overrides(method: str, judge: str, kb: Path, nli: Path) -> list[str]:
    """What points each method's serve config (conf/serve/<method>.yaml) at the test's judge, store and NLI model."""
    return {"klcf": [*(f"reward.{k}.base_url={judge}" for k in ("judge", "checklist_judge", "pipeline.extractor.judge",
                                                                "pipeline.verifier.judge")),
                     "reward.w_rm=0", "reward.general_rm=null"],
            "fspo": [f"reward.verifier.model_path={nli}"],
            "knowrl": [f"reward.judge.base_url={judge}", f"reward.pipeline.evidence.store_path={kb}",
                       f"reward.pipeline.verifier.model_path={nli}"],
            "factalign": [f"reward.judge.base_url={judge}", f"reward.pipeline.evidence.store_path={kb}"],
            "rlfh": [f"reward.judge.base_url={judge}"]}[method]


def _write_data(d: Path) -> dict[str, Path]:
    """Two prompts per GRPO/KTO method, four for RLFH (one PPO minibatch), in each method's data format."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    template = "<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\nLet me solve this step by step.\n<think>"
    pq.write_table(pa.Table.from_pylist([
        {"prompt": [{"role": "user", "content": template.format(q=f"Who was born in 1917? ({i})")}],
         "reward_model": {"style": "rule", "ground_truth": "Ada Varga"}, "knowledge": FACTS[0][3], "data_source": "HotpotQA"}
        for i in range(2)]), d / "fspo.parquet")
    (d / "knowrl.json").write_text(json.dumps([{"question": f"When was Ada Varga born? ({i})", "answers": "1917",
                                                "title": "Ada Varga;Lev Novak"} for i in range(2)]))
    return {"klcf": write_jsonl(d / "klcf.jsonl", [{"prompt": f"Tell me about Ada {i}.", "checklist": ["Ada was born in 1917."]}
                                                   for i in range(2)]),
            "fspo": d / "fspo.parquet", "knowrl": d / "knowrl.json",
            "factalign": write_jsonl(d / "factalign.jsonl", [{"prompt": f"Write a bio of Ada Varga ({i}).", "topic": "Ada Varga"}
                                                             for i in range(2)]),
            "rlfh": write_jsonl(d / "rlfh.jsonl", [{"question": f"When was Ada Varga born ({i})?", "titles": ["Ada Varga"],
                                                    "materials": [FACTS[0][3]], "extra_materials": []} for i in range(4)])}


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_policy, tiny_nli, stage_policy):
    """The scripted judge, one reward server per method and the critic server, for both layouts."""
    venv = aligner_venv()
    if venv is None:
        pytest.skip(skip_reason())
    root = tmp_path_factory.mktemp("aligner_methods")
    kb = build_kb(root)
    t0 = time.monotonic()
    stopped = {m: {} for m in METHODS}
    with ScriptedOpenAIServer(_judge) as judge, ExitStack() as stack:
        # all ports drawn at once (distinct); every reward server starts (Popen) before any is waited for, so their
        # start-ups overlap each other's and the critic's
        ports = free_ports(5 * len(METHODS) + 1)
        port = ports.pop()
        rewards = {m: stack.enter_context(reward_server(m, [f"policy_tokenizer={tiny_policy}",
                                                            *_serve_overrides(m, judge.url, kb, tiny_nli)],
                                                        root / f"serve_{m}", stopped[m], ports[5 * i : 5 * i + 5]))
                   for i, m in enumerate(METHODS)}
        # the PPO stage's config, given to the critic server too (it builds no reward: the stage's is served)
        ppo_stage = [*ppo_overrides(stage_policy, root / "critic_run", port), "reward=null",
                     f"remote_rm.url={rewards['rlfh']['url']}"]
        critic_args = ["--config-name", "tiny_cpu_rlfh", *ppo_stage]
        stack.enter_context(critic_server(venv, critic_args, port, root / "critic_server.log"))
        for server in rewards.values():
            server["wait_ready"]()
        yield {"venv": venv, "root": root, "judge": judge, "rewards": rewards, "critic_args": critic_args,
               "data": _write_data(root), "nemo": stage_policy, "startup_s": time.monotonic() - t0}
    for method, info in stopped.items():  # each server stopped on SIGTERM, nothing left in its process group
        assert info["exit_code"] == 0 and not info["left_after_kill"], (method, info)


def _plan(served: dict, layout: dict, out: Path) -> list[dict]:
    tp, pp = layout.get("tp", 1), layout.get("pp", 1)
    common = [f"model.restore_from_path={served['nemo']}", "trainer.backend=aligner", "trainer.max_steps=2",
              "trainer.save_interval=0", "trainer.progress_bar=false", f"model.tensor_model_parallel_size={tp}",
              f"model.pipeline_model_parallel_size={pp}", "model.length_params.max_length=6", "model.dtype=float32",
              "model.optim.name=sgd", "model.optim.lr=0.05", "model.optim.sched.name=constant",
              "exp_manager.create_tensorboard_logger=false", "reward=null"]
    per_stage = {"grpo": ["grpo.num_prompts_per_step=2", "grpo.num_rollouts_per_prompt=2", "model.micro_batch_size=2",
                          "model.global_batch_size=4", "model.forward_micro_batch_size=4"],
                 "kto": ["kto.num_iterations=1", "kto.prompts_per_iteration=2", "kto.samples_per_prompt=2",
                         "kto.epochs_per_iteration=1", "model.micro_batch_size=2", "model.global_batch_size=4",
                         "model.forward_micro_batch_size=4"],
                 "ppo": served["critic_args"][2:]}  # the critic server's own stage config, then this run's keys
    plan = []
    for method, (stage, preset) in METHODS.items():
        overrides = [*per_stage[stage], *common, f"data.train={served['data'][method]}",
                     f"remote_rm.url={served['rewards'][method]['url']}", f"exp_manager.explicit_log_dir={out / method}"]
        plan.append({"name": method, "stage": stage, "config": preset, "overrides": overrides})
    return plan


def _served_counts(server: dict) -> tuple[float, float]:
    """The reward server's own counts of ``factuality_reward`` batches and samples (its Prometheus endpoint)."""
    text = httpx.get(f"http://127.0.0.1:{server['ports']['metrics_port']}/metrics", timeout=10).text

    def count(name: str) -> float:
        found = re.search(rf'^{name}_total\{{model="factuality_reward"\}} (\S+)$', text, re.M)
        return float(found.group(1)) if found else 0.0

    return count("factuality_requests"), count("factuality_samples")


# two processes each: one replica split over TP or PP, or two data-parallel replicas at TP=PP=1
LAYOUTS = {"tp2": {"tp": 2}, "pp2": {"pp": 2}, "dp2": {}}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def layout_run(request, served):
    """One torchrun (2 processes) of every method's stage on one actor; both ranks' results and the servers'
    request counts before and after."""
    name, layout = request.param, LAYOUTS[request.param]
    out = served["root"] / name
    out.mkdir(exist_ok=True)
    (out / "plan.json").write_text(json.dumps(_plan(served, layout, out / "runs")))
    before = {m: _served_counts(s) for m, s in served["rewards"].items()}
    t0 = time.monotonic()
    flags = [f"--{k}={v}" for k, v in layout.items()]
    res = run_in_aligner_venv(served["venv"], [DRIVER, f"--nemo={served['nemo']}", f"--out={out}", "--scenario=methods",
                                               f"--plan={out / 'plan.json'}", *flags], nproc=2, timeout=600,
                              preload=True)
    assert res.returncode == 0, res.stdout[-8000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    served_now = {m: tuple(now - then for now, then in zip(_served_counts(s), before[m], strict=True))
                  for m, s in served["rewards"].items()}
    return {"name": name, "layout": layout, "ranks": ranks, "served": served_now, "wall_s": time.monotonic() - t0,
            "out": out, "dp": 1 if layout else 2}


def _no_timings(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if not k.startswith("time/")} for row in rows]


def _finite(values) -> list[float]:
    return [v for v in values if v is not None and math.isfinite(v)]


def test_every_stage_ran_its_steps_on_both_ranks_with_the_same_metrics(layout_run, served, record_property):
    r0, r1 = layout_run["ranks"]
    # the measured times go into the report (``-rP`` / junit properties); the stages ran inside the torchrun
    stages = {m: round(s["wall_s"], 1) for m, s in r0["stages"].items()}
    record_property("startup_s", round(served["startup_s"], 1))
    record_property(f"{layout_run['name']}_s", round(layout_run["wall_s"], 1))
    print(f"layout {layout_run['name']}: {layout_run['wall_s']:.1f} s (stages {stages}); servers up in "
          f"{served['startup_s']:.1f} s")
    assert set(stages) == set(METHODS) and all(t > 0 for t in stages.values())
    assert sum(stages.values()) < layout_run["wall_s"]
    assert r0["dp_size"] == r1["dp_size"] == layout_run["dp"]  # TP=2 / PP=2: one replica; dp2: two replicas
    for method, (stage, _) in METHODS.items():
        s0, s1 = r0["stages"][method], r1["stages"][method]
        expected = [1, 2] if stage != "kto" else [1]  # KTO: one iteration, one minibatch of 4 examples
        assert [m["step"] for m in s0["logged"]] == expected, (method, s0["logged"])
        # one replica's ranks computed the same step, and DP ranks log the all-reduced metrics: the same on both
        assert _no_timings(s0["logged"]) == _no_timings(s1["logged"]), method
        assert [m["step"] for m in s0["metrics"]] == expected  # metrics.jsonl written once (rank 0)
        assert s0["final"] and "latest" in s0["checkpoints"], (method, s0["checkpoints"])
        for m in s0["logged"]:
            # GRPO's gradient needs rewards that differ within a group: KLCF's do (its judge below), FSPO's and KnowRL's
            # are constant for this untrained policy (only the KL term's rounding noise is left); served FSPO/KnowRL rewards
            # that vary within a group, and FSPO's flip, are tested on formatted responses in test_stages_cli.py
            assert math.isfinite(m["grad_norm"]) and (m["grad_norm"] > 0 or stage == "grpo"), (method, m)
            assert m.get("optimizer_steps", 1) >= 1, (method, m)
            losses = {k: v for k, v in m.items() if k.startswith("loss")}
            assert losses and all(v is not None and math.isfinite(v) for v in losses.values()), (method, m)


def test_the_rewards_came_from_the_servers_once_per_replica(layout_run):
    """At TP=2 / PP=2 the two ranks hold one replica and the same rollout: the model-parallel source rank alone
    scores it (once per rollout micro batch), the other gets its result; at DP=2 each replica scores its own prompts. Each
    server's own request counter rose by exactly those calls, and every logged reward metric is finite."""
    r0, r1 = layout_run["ranks"]
    for method, (stage, _) in METHODS.items():
        calls = len(r0["stages"][method]["calls"])
        # one call per rollout micro batch (3 prompts: aligner_driver's actor) per step; KTO: one labeller group
        per_step = math.ceil(4 // layout_run["dp"] / 3)
        assert calls == (2 * per_step if stage != "kto" else 1), method
        assert len(r1["stages"][method]["calls"]) == (calls if layout_run["dp"] == 2 else 0), method
        requests, samples = layout_run["served"][method]
        # the server scored exactly the samples the stages sent; Triton's dynamic batcher may merge the two DP
        # replicas' concurrent requests into one batch, so at DP=2 the batch count is at most the call count
        assert samples == sum(len(c["scores"]) for r in (r0, r1) for c in r["stages"][method]["calls"]), method
        assert requests == calls if layout_run["dp"] == 1 else calls <= requests <= 2 * calls, (method, requests)
        if stage != "kto":
            for m in r0["stages"][method]["logged"]:
                assert math.isfinite(m["reward/score"]), (method, m)


def _samples(layout_run: dict, method: str, key: str) -> list:
    """Every scored sample's ``key`` (both ranks' calls: at DP=2 each scored its own prompts)."""
    calls = [c for r in layout_run["ranks"] for c in r["stages"][method]["calls"]]
    return [v for c in calls for v in (c["scores"] if key == "score" else c["components"][key])]


def _mixed_groups(layout_run: dict, method: str, steps: int = 2) -> list[bool]:
    """Per GRPO step: whether some prompt's samples got different scores (both ranks' calls; each step made one call
    per rollout micro batch of 3 of the rank's 4 / DP samples)."""
    per_step = math.ceil(4 // layout_run["dp"] / 3)
    out = []
    for step in range(steps):
        scores: dict[str, set] = {}
        for rank in layout_run["ranks"]:
            for call in rank["stages"][method]["calls"][step * per_step : (step + 1) * per_step]:
                for prompt, score in zip(call["prompts"], call["scores"], strict=True):
                    scores.setdefault(prompt, set()).add(score)
        out.append(any(len(v) > 1 for v in scores.values()))
    return out


def test_each_reward_is_its_methods_pipeline_on_the_scripted_judge(layout_run):
    """Values only the method's pipeline (with the scripted judge's replies) gives — not a default or a zero."""
    # KLCF: the judge covers the checklist item or not (recall 1 or 0) and calls every claim true; w_rm=0
    recall, precision = _samples(layout_run, "klcf", "checklist_recall"), _samples(layout_run, "klcf", "truthfulness_precision")
    assert set(recall) == {0.0, 1.0} and set(precision) == {1.0}
    assert _samples(layout_run, "klcf", "score") == [r + p for r, p in zip(recall, precision, strict=True)]
    # GRPO's update moves the policy exactly in the steps where some prompt's samples got different rewards (the
    # verdict hashes the sampled response, so which steps those are depends on the samples)
    for m, mixed in zip(layout_run["ranks"][0]["stages"]["klcf"]["logged"], _mixed_groups(layout_run, "klcf"), strict=True):
        assert (m["advantage/abs_mean"] > 0) == mixed and (m["grad_norm"] > 0 or not mixed), (m, mixed)
    # FSPO and KnowRL: the untrained policy never writes the answer/think tags (their format penalties)
    assert set(_finite(_samples(layout_run, "fspo", "format"))) == {-2.0}
    assert set(_finite(_samples(layout_run, "knowrl", "format"))) == {-1.0}
    # FactAlign: every claim supported (precision 1), f1@100 = 2R/(1+R) with R = claims/100 → undesirable
    precision, claims = _samples(layout_run, "factalign", "precision"), _samples(layout_run, "factalign", "n_claims")
    f1 = _samples(layout_run, "factalign", "f1")
    judged = [(p, n, f) for p, n, f in zip(precision, claims, f1, strict=True) if p is not None]
    assert judged and all(p == 1.0 and n >= 1 and f == pytest.approx(2 * n / 100 / (1 + n / 100)) for p, n, f in judged)
    assert set(_finite(_samples(layout_run, "factalign", "label"))) == {0.0}
    # RLFH: the statement is Correct, informativeness '4': r_truth = 0.45 × |INFO['4']| = 0.45; the scalar is
    # r_truth + r_info + the missing-EOS penalty (responses cut at max_length)
    truth, info, eos = (_samples(layout_run, "rlfh", k) for k in ("truth", "info", "eos_penalty"))
    assert {round(v, 6) for v in _finite(truth)} == {0.45} and set(_finite(eos)) <= {0.0, -1.0}
    for score, t, i, e in zip(_samples(layout_run, "rlfh", "score"), truth, info, eos, strict=True):
        assert score == pytest.approx(t + i + e, abs=1e-5)


def test_token_level_outputs_and_labels_reach_the_stages(layout_run):
    """RLFH's dense token rewards and FSPO's token signs (the served reward tokenises with policy_tokenizer) arrive
    one per response token, RLFH's summing to its scalar; FactAlign's sentence labels arrive for KTO's fKTO."""
    stages = layout_run["ranks"][0]["stages"]
    for call in stages["rlfh"]["calls"]:
        assert call["token_rewards"] is not None and [len(t) for t in call["token_rewards"]] == call["n_ids"]
        for tokens, score in zip(call["token_rewards"], call["scores"], strict=True):
            if score is not None:
                assert sum(tokens) == pytest.approx(score, abs=1e-5)
    for call in stages["fspo"]["calls"]:
        assert call["token_signs"] is not None and [len(t) for t in call["token_signs"]] == call["n_ids"]
    assert all(c["sentence_labels"] is not None for c in stages["factalign"]["calls"])
    kto = stages["factalign"]["logged"][0]
    assert kto["kto/labelled"] + kto["kto/dropped_unlabelled"] == 4 and kto["kto/labelled"] >= 1


def test_the_ppo_stage_trained_the_critic_server(layout_run):
    r0, r1 = layout_run["ranks"]
    for r in (r0, r1):
        rlfh = r["stages"]["rlfh"]
        assert rlfh["server_step_after"] == rlfh["server_step_before"] + 2  # one critic_train per PPO step
        assert all(math.isfinite(m["loss/value"]) and m["actor_trained"] == 1.0 for m in rlfh["logged"])
