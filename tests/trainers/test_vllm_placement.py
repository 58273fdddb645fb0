"""Where the vLLM rollout engines sit (``rollout.vllm.placement``): the GPU split per rank computed by
``nemo_factuality.placement`` for colocated and separate engines, TP > 1 engines and pipeline parallelism; the
``CUDA_VISIBLE_DEVICES`` the trainer gives each engine (``vllm_rollout.engine_devices``, in the ids its own
``CUDA_VISIBLE_DEVICES`` names) and that the engine process really starts with it; srun's task variables as
torch.distributed's rank, world and local rank."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest

from nemo_factuality import placement
from nemo_factuality.config import ConfigError
from nemo_factuality.trainers.backends.collectives import ranks_from_slurm
from nemo_factuality.trainers.config import VLLMEngineConfig
from nemo_factuality.trainers.engines.vllm_engine import EngineError, VLLMEngine
from nemo_factuality.trainers.engines.vllm_rollout import engine_devices


def _gpus(world, **layout):
    return {r: placement.engine_gpus(r, world=world, **layout) for r in range(world)}


def test_colocated_engines_share_their_replicas_first_gpus_hand_computed():
    # TP=2 on 8 GPUs: replicas {0,1} {2,3} {4,5} {6,7}; each source starts an engine on its replica's 2 GPUs
    got = _gpus(8, placement="colocated", tasks_per_node=8, gpus_per_node=8, tensor=2, pipeline=1, engine_tp=2)
    assert got == {0: (0, 1), 1: (), 2: (2, 3), 3: (), 4: (4, 5), 5: (), 6: (6, 7), 7: ()}
    # an engine narrower than its replica takes the replica's first GPUs (TP=8 replica, TP=4 engine)
    got = _gpus(16, placement="colocated", tasks_per_node=8, gpus_per_node=8, tensor=8, pipeline=1, engine_tp=4)
    assert {r: g for r, g in got.items() if g} == {0: (0, 1, 2, 3), 8: (0, 1, 2, 3)}  # one per node, local GPUs
    # the hf backend under torchrun (TP=1): every rank is a replica and shares its own GPU with its engine
    assert _gpus(2, placement="colocated", tasks_per_node=2, gpus_per_node=2, tensor=1, pipeline=1, engine_tp=1) == \
        {0: (0,), 1: (1,)}


def test_separate_engines_take_the_gpus_after_the_trainer_ranks_hand_computed():
    # 8 GPUs, TP=2 trainer + TP=2 engines: 2 replicas (ranks 0-3 on GPUs 0-3), engines on 4,5 and 6,7
    assert placement.trainer_tasks_per_node("separate", gpus_per_node=8, tensor=2, pipeline=1, engine_tp=2) == 4
    got = _gpus(8, placement="separate", tasks_per_node=4, gpus_per_node=8, tensor=2, pipeline=1, engine_tp=2)
    assert got == {0: (4, 5), 1: (), 2: (6, 7), 3: (), 4: (4, 5), 5: (), 6: (6, 7), 7: ()}  # two nodes alike
    # TP=4 trainer + TP=2 engine: one replica per node (4 + 2 GPUs), two GPUs idle
    assert placement.trainer_tasks_per_node("separate", gpus_per_node=8, tensor=4, pipeline=1, engine_tp=2) == 4
    assert _gpus(4, placement="separate", tasks_per_node=4, gpus_per_node=8, tensor=4, pipeline=1, engine_tp=2)[0] == (4, 5)
    # TP=1 (DP ranks): 4 ranks and 4 single-GPU engines
    assert _gpus(4, placement="separate", tasks_per_node=4, gpus_per_node=8, tensor=1, pipeline=1, engine_tp=1) == \
        {0: (4,), 1: (5,), 2: (6,), 3: (7,)}


def test_with_pipeline_parallelism_only_the_first_stage_holds_engines():
    """TP=8 PP=2 DP=2 on 4 nodes: Megatron's order puts pipeline stage 0 of both replicas on nodes 0 and 1."""
    got = _gpus(32, placement="colocated", tasks_per_node=8, gpus_per_node=8, tensor=8, pipeline=2, engine_tp=8)
    assert {r: g for r, g in got.items() if g} == {0: tuple(range(8)), 8: tuple(range(8))}
    splits = placement.node_splits(nodes=4, placement="colocated", tasks_per_node=8, gpus_per_node=8, tensor=8,
                                   pipeline=2, engine_tp=8)
    assert [[(s.replica, s.rank) for s in n.engines] for n in splits] == [[(0, 0)], [(1, 8)], [], []]


@pytest.mark.parametrize("layout, named", [
    (dict(placement="colocated", tasks_per_node=8, gpus_per_node=8, tensor=2, pipeline=1, engine_tp=4),
     "rollout.vllm.tensor_parallel_size=4: a colocated engine shares its replica's GPUs on one node, 2 here"),
    (dict(placement="separate", tasks_per_node=8, gpus_per_node=8, tensor=8, pipeline=2, engine_tp=8),
     "rollout.vllm.placement=separate needs model.pipeline_model_parallel_size=1"),
    (dict(placement="separate", tasks_per_node=8, gpus_per_node=8, tensor=2, pipeline=1, engine_tp=2),
     "4 replica(s) of 2 GPU(s) and their engines of 2 need 16 GPUs per node, the node has 8"),
    (dict(placement="colocated", tasks_per_node=8, gpus_per_node=8, tensor=3, pipeline=1, engine_tp=1),
     "model.tensor_model_parallel_size=3 splits replicas across the node boundary of 8 ranks"),
    (dict(placement="nearby", tasks_per_node=8, gpus_per_node=8, tensor=2, pipeline=1, engine_tp=2),
     "rollout.vllm.placement='nearby' (choose one of colocated, separate)"),
])
def test_a_layout_that_cannot_place_its_engines_is_refused_naming_the_setting(layout, named):
    assert any(named in p for p in placement.layout_problems(**layout))
    with pytest.raises(ValueError, match="rollout.vllm"):
        placement.engine_gpus(0, world=8, **layout)


def _cfg(placement_, *, tp=1, pp=1, engine_tp=1, device="cuda"):
    return SimpleNamespace(trainer=SimpleNamespace(device=device),
                           model=SimpleNamespace(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp),
                           rollout=SimpleNamespace(vllm=SimpleNamespace(placement=placement_, tensor_parallel_size=engine_tp)))


def test_the_trainer_gives_each_engine_the_gpus_as_its_own_process_sees_them():
    """The split's indices are positions in the trainer's CUDA_VISIBLE_DEVICES (what cuda:LOCAL_RANK means), so an
    engine gets the ids the node's GPUs have there: on a node whose job holds GPUs 8-15 the separate engines of two
    TP=2 replicas get 12,13 and 14,15."""
    env = {"CUDA_VISIBLE_DEVICES": "8,9,10,11,12,13,14,15", "LOCAL_WORLD_SIZE": "4"}
    cfg = _cfg("separate", tp=2, engine_tp=2)
    got = {r: engine_devices(cfg, r, 8, {**env, "LOCAL_RANK": str(r % 4)}, source=r % 2 == 0) for r in range(8)}
    assert got == {0: ["12", "13"], 1: [], 2: ["14", "15"], 3: [], 4: ["12", "13"], 5: [], 6: ["14", "15"], 7: []}
    colocated = _cfg("colocated", tp=4, engine_tp=4)
    assert engine_devices(colocated, 4, 8, {**env, "LOCAL_WORLD_SIZE": "8", "LOCAL_RANK": "4"}, source=True) == \
        ["12", "13", "14", "15"]
    assert engine_devices(_cfg("separate", device="cpu"), 0, 1, {}, source=True) is None  # CPU: no devices set


def test_the_trainers_split_is_the_one_the_launcher_writes_out():
    """Every rank of a 2-node job (TP=2, separate TP=2 engines; TP=4 colocated) gets from ``engine_devices`` exactly
    the GPUs ``node_splits`` (the rendered comment block) names for it."""
    for place, tp, etp in (("separate", 2, 2), ("colocated", 4, 4), ("colocated", 8, 2)):
        tasks = placement.trainer_tasks_per_node(place, gpus_per_node=8, tensor=tp, pipeline=1, engine_tp=etp)
        world = 2 * tasks
        written = {s.rank: s.gpus for n in placement.node_splits(nodes=2, placement=place, tasks_per_node=tasks,
                                                                  gpus_per_node=8, tensor=tp, pipeline=1, engine_tp=etp)
                   for s in n.engines}
        env = {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7", "LOCAL_WORLD_SIZE": str(tasks)}
        for rank in range(world):
            got = engine_devices(_cfg(place, tp=tp, engine_tp=etp), rank, world, {**env, "LOCAL_RANK": str(rank % tasks)},
                                 source=rank % tp == 0)
            assert got == [str(g) for g in written.get(rank, ())], (place, tp, rank)


def test_a_rank_layout_the_split_does_not_know_is_refused():
    cfg = _cfg("colocated", tp=2, engine_tp=2)
    with pytest.raises(ConfigError, match="rank 3 is local rank 0 of 4 on its node, not 3"):
        engine_devices(cfg, 3, 8, {"CUDA_VISIBLE_DEVICES": "0,1,2,3", "LOCAL_WORLD_SIZE": "4", "LOCAL_RANK": "0"},
                       source=False)
    with pytest.raises(RuntimeError, match="the actor says it is its replica's source rank"):
        engine_devices(cfg, 1, 2, {"CUDA_VISIBLE_DEVICES": "0,1", "LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "1"}, source=True)
    with pytest.raises(ConfigError, match="need 6 GPUs per node, the node has 4"):
        engine_devices(_cfg("separate", tp=2, engine_tp=4), 0, 2,
                       {"CUDA_VISIBLE_DEVICES": "0,1,2,3", "LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "0"}, source=True)


def test_the_engine_process_starts_with_the_devices_it_was_given(tmp_path):
    """A real engine process: started with this interpreter (no vLLM here), its log's first line is its own
    CUDA_VISIBLE_DEVICES, then it fails importing vLLM — the error is one line quoting the log's root cause and
    naming the log, whose first line is the process's."""
    cfg = VLLMEngineConfig(python=sys.executable, start_timeout_s=60, tensor_parallel_size=2)
    engine = VLLMEngine(tmp_path / "model", cfg, dtype="bfloat16", log_dir=tmp_path / "log", devices=["6", "7"])
    with pytest.raises(EngineError, match=r"exited with code 1 while starting: ModuleNotFoundError: No module named "
                                          r"'vllm' \(its log: .*engine0.log\)$") as err:
        engine.start()
    assert "\n" not in str(err.value)
    first = (tmp_path / "log" / "engine0.log").read_text().splitlines()[0]
    assert "CUDA_VISIBLE_DEVICES=6,7, tensor_parallel_size=2" in first
    assert engine.environment({})["CUDA_VISIBLE_DEVICES"] == "6,7"
    assert "CUDA_VISIBLE_DEVICES" not in VLLMEngine(tmp_path, cfg, dtype="float32").environment({})  # CPU: untouched
    assert "VLLM_ENABLE_V1_MULTIPROCESSING=1" in first  # on GPUs the engine core keeps its own processes


@pytest.mark.parametrize("setting, inherited, on_gpus, expected", [
    (None, {}, False, "0"), (None, {}, True, "1"),  # null: inside on CPU, vLLM's own processes on GPUs
    (None, {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}, False, None),  # an inherited setting is left as it is
    (True, {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}, True, "0"), (False, {}, False, "1"),  # a set key wins
])
def test_where_the_engine_core_runs(tmp_path, setting, inherited, on_gpus, expected):
    cfg = VLLMEngineConfig(python=sys.executable, engine_core_in_process=setting)
    engine = VLLMEngine(tmp_path, cfg, dtype="float32", devices=["0"] if on_gpus else None)
    assert engine.environment(inherited).get("VLLM_ENABLE_V1_MULTIPROCESSING") == expected


def test_srun_task_variables_become_torch_distributed_ranks():
    srun = {"SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_STEP_NUM_TASKS": "8", "SLURM_STEP_TASKS_PER_NODE": "4(x2)"}
    assert ranks_from_slurm(srun) == {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}
    assert ranks_from_slurm({**srun, "LOCAL_WORLD_SIZE": "4"})["LOCAL_WORLD_SIZE"] == "4"  # the launcher's export
    assert ranks_from_slurm({**srun, "WORLD_SIZE": "8"}) == {}  # torchrun's own variables win
    assert ranks_from_slurm({**srun, "SLURM_STEP_NUM_TASKS": "1"}) == {}  # a single task: no job to join
    assert ranks_from_slurm({}) == {}


def test_an_engine_of_another_build_is_refused_at_the_first_refit_without_a_restart(tmp_path):
    """Issue 39: NCCL refuses a communicator across versions; the failure surfaced as a transport error, the engine
    was restarted, the run exited 75 and was requeued, forever. The versions the engine's health answer carries are
    checked before the group forms: one line naming both builds and rollout.vllm.refit=file, nothing sent, no restart."""
    from nemo_factuality.trainers.engines import vllm_worker
    from nemo_factuality.trainers.engines.vllm_engine import TRANSPORT_ERRORS, RefitGroupMismatch

    cfg = VLLMEngineConfig(python=sys.executable, refit="broadcast", restarts=2)
    engine = VLLMEngine(tmp_path / "model", cfg, dtype="float32", log_dir=tmp_path / "log")
    ours = vllm_worker.collective_versions()
    engine.engine_versions = {**ours, "torch": ours["torch"] + ".other"}  # what the engine's health answer said
    with pytest.raises(RefitGroupMismatch) as err:
        engine.open_stream([("w", "float32", [2])])
    message = str(err.value)
    assert "\n" not in message and "rollout.vllm.refit=file" in message and ours["torch"] + ".other" in message
    assert not isinstance(err.value, TRANSPORT_ERRORS)  # not a dead engine: VLLMRollout does not restart it
    assert engine.starts == 0 and engine.restarts_left == 2 and engine._store is None  # nothing was sent or hosted
    engine.engine_versions = dict(ours)
    assert vllm_worker.versions_problem(engine.group_backend, ours, engine.engine_versions) is None


@pytest.mark.parametrize("peer", ["gone", "silent"])
def test_a_refit_broadcast_is_bounded_on_the_host_not_by_the_groups_timeout(peer):
    """Issue 39: under NCCL ``wait()`` does not block the host, so a peer dead mid-stream went unnoticed until the
    watchdog. The trainer's side now polls each broadcast against the stream's deadline and the engine process: a
    dead process (``gone``) is seen at once, a silent peer at the deadline — here both long before the group's own
    60 s timeout, on a real two-rank gloo group whose rank 1 never joins the broadcast."""
    import datetime
    import threading
    import time

    import torch

    from nemo_factuality.testing.ports import free_ports
    from nemo_factuality.trainers.engines import vllm_worker

    (port,) = free_ports(1)
    store = torch.distributed.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                                       timeout=datetime.timedelta(seconds=30))
    groups = {}

    def join(rank: int) -> None:
        peer_store = store if rank == 0 else torch.distributed.TCPStore("127.0.0.1", port, is_master=False,
                                                                         timeout=datetime.timedelta(seconds=30))
        groups[rank] = vllm_worker.make_group(peer_store, "bounded/", rank, 2, "gloo", 60.0, torch.device("cpu"))

    other = threading.Thread(target=join, args=(1,), daemon=True)
    other.start()
    join(0)
    other.join(timeout=30)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="exited during" if peer == "gone" else "did not complete before its deadline"):
        vllm_worker.broadcast(groups[0], torch.ones(4), deadline=time.monotonic() + 1.0,
                              peer_alive=(lambda: False) if peer == "gone" else (lambda: True))
    took = time.monotonic() - start
    assert took < (0.5 if peer == "gone" else 3.0), took  # the group itself would have waited 60 s
    vllm_worker.broadcast(groups[1], torch.zeros(4))  # rank 1 takes the pending broadcast: nothing left waiting


def test_a_refit_stream_reaches_both_workers_of_an_engine_at_tensor_parallel_2(tmp_path):
    """Issue 39: the vLLM tests' engines run at TP=1, so a refit group of more than 2 ranks never formed — the R1-7B
    preset's engine (TP=2) puts 3 in it: the trainer's source rank and the engine's 2 workers. Here the trainer's side of
    the stream (``VLLMEngine.open_stream`` / ``send_tensor`` / ``close_stream``) broadcasts over a real 3-rank gloo group
    into two workers running ``vllm_worker.receive`` (what ``BroadcastRefit.receive_refit`` feeds vLLM's
    ``reload_weights``): each worker gets every tensor bit for bit, in the order sent, and the END header's count. The
    engine process's messages (``refit_stream`` and its reply) are not exchanged here: no vLLM engine runs."""
    import datetime
    import subprocess
    import threading

    import torch

    from nemo_factuality.testing.ports import free_ports
    from nemo_factuality.trainers.engines import vllm_worker

    (port,) = free_ports(1)
    store = torch.distributed.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                                       timeout=datetime.timedelta(seconds=30))
    tensors = {"embed": torch.randn(7, 4), "layer.0.w": torch.randn(3, 5).to(torch.bfloat16), "bias": torch.arange(6.0)}
    manifest = [[name, str(t.dtype).removeprefix("torch."), list(t.shape)] for name, t in tensors.items()]
    received: dict[int, list] = {}

    def worker(rank: int) -> None:
        peer = torch.distributed.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=30))
        group = vllm_worker.make_group(peer, "tp2/", rank, 3, "gloo", 30.0, torch.device("cpu"))
        received[rank] = list(vllm_worker.receive(group, manifest, torch.device("cpu")))

    threads = [threading.Thread(target=worker, args=(rank,), daemon=True) for rank in (1, 2)]
    for t in threads:
        t.start()
    cfg = VLLMEngineConfig(python=sys.executable, refit="broadcast", tensor_parallel_size=2, request_timeout_s=30)
    engine = VLLMEngine(tmp_path / "model", cfg, dtype="float32", log_dir=tmp_path / "log")
    engine._group = vllm_worker.make_group(store, "tp2/", 0, 3, "gloo", 30.0, torch.device("cpu"))
    engine._proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # "the engine is alive"
    sent: list[dict] = []

    def reply(op: str) -> dict:  # the engine's answer once its workers returned: what each took
        for t in threads:
            t.join(timeout=30)
        return {"received": [len(received.get(r, [])) for r in (1, 2)], "retied": []}

    engine._send, engine._reply = sent.append, reply
    try:
        engine.open_stream([tuple(entry) for entry in manifest])
        for name in ("layer.0.w", "embed", "bias"):  # any order: each header names its manifest entry
            engine.send_tensor(name, tensors[name])
        engine.close_stream()  # the END header with the count; raises if a worker took another number
    finally:
        engine._proc.kill()
        engine._proc.wait()
    assert [m["op"] for m in sent] == ["refit_stream"]
    for rank in (1, 2):
        assert [name for name, _ in received[rank]] == ["layer.0.w", "embed", "bias"]
        for name, tensor in received[rank]:
            assert tensor.dtype == tensors[name].dtype and torch.equal(tensor, tensors[name]), (rank, name)


def test_a_tied_policy_is_taken_for_vllm_rollouts(tmp_path):
    """Tied policies were refused (vLLM's reload left the output layer at its starting weights); the engine re-ties it
    after every reload now (``vllm_worker.retie_output_layers``, ``test_vllm_tied.py`` on SmolLM2), so a tied
    checkpoint gets past ``with_rollout_engine``'s start-up checks to the engine's Python, as an untied one does."""
    import json

    from nemo_factuality.trainers.config import GRPOConfig, load_train_config
    from nemo_factuality.trainers.engines.vllm_engine import EngineStartError
    from nemo_factuality.trainers.engines.vllm_rollout import with_rollout_engine

    policy = tmp_path / "policy"
    policy.mkdir()
    cfg = load_train_config(GRPOConfig, None, [f"model.path={policy}", "rollout.engine=vllm",
                                               f"rollout.vllm.python={tmp_path / 'no-such-python'}",
                                               "remote_rm.url=http://127.0.0.1:9"])
    for tied in (True, False):
        (policy / "config.json").write_text(json.dumps({"model_type": "qwen2", "tie_word_embeddings": tied}))
        with pytest.raises(EngineStartError, match="cannot run the engine's Python") as err:
            with_rollout_engine(cfg, SimpleNamespace(), tmp_path / "run")
        assert "tie_word_embeddings" not in str(err.value)
