"""The trainer's het group from a stage's model preset: nodes, tasks per node, the image, and — on the megatron backend
with rollouts on vLLM — where each engine sits (``nemo_factuality.placement``, the split the trainer computes too).

Presets are read from their YAML here (``conf/train/<backend>/<name>.yaml``), not through the trainers' loaders: the
launcher never imports the trainers (torch on a login node); the tests check that both readings agree. The trainer
command's own ``key=value`` words for the layout (TP, PP, the engine's settings) win over the preset's, as they do in
the trainer.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, replace

import yaml

from nemo_factuality import placement
from nemo_factuality.config import conf_dir
from nemo_factuality.config import merge_tree as _merge

BACKENDS_WITH_PRESETS = ("aligner", "megatron")
# the image each backend's trainer runs (the profile's images map): NeMo-Aligner's stack, or the maintained one
TRAINER_IMAGES = {"hf": "trainer", "aligner": "trainer", "megatron": "megatron"}
PACKAGE_IMAGES = ("trainer", "megatron")  # images with this package in /workspace/nemo_factuality
VLLM_PYTHON_ENV = "NEMO_FACTUALITY_VLLM_PYTHON"  # trainers/engines/vllm_engine.PYTHON_ENV (not imported: see above)

_PYTHON_MODULE = re.compile(r"(?:^|[\s;&|(])\S*python[\d.]*\s+(?:-[A-Za-z]+\s+)*-m\s+([A-Za-z_][\w.]*)")
_STAGE_MODULE = re.compile(r"^nemo_factuality\.trainers\.(grpo|ppo|kto)$")
_BACKEND = re.compile(r"(?:^|\s)trainer\.backend=(\S+)")
_LAYOUT_KEYS = ("model.tensor_model_parallel_size", "model.pipeline_model_parallel_size", "rollout.engine",
                "rollout.vllm.placement", "rollout.vllm.tensor_parallel_size", "rollout.vllm.gpu_memory_utilization")


class PresetError(ValueError):
    """The stage's preset cannot be read (the renderer reports it as a launch config error)."""


def python_modules(command: str) -> list[str]:
    """Modules a shell command runs with ``python -m X`` (in order)."""
    return _PYTHON_MODULE.findall(command)


def command_backend(trainer_command: str) -> str | None:
    """The ``trainer.backend=`` the trainer command names (its last), or None."""
    found = _BACKEND.findall(trainer_command)
    return found[-1].strip("'\"") if found else None


@dataclass(frozen=True)
class Engines:
    """The vLLM engines of the trainer's replicas (``rollout.vllm.*``)."""

    placement: str
    tensor_parallel: int
    gpu_memory_utilization: float


@dataclass(frozen=True)
class PresetLayout:
    """Where a preset puts the policy: what the job must allocate, and how it splits each node's GPUs."""

    name: str
    backend: str
    nodes: int
    gpus_per_node: int  # GPUs per node the job takes (engines' included)
    tensor_parallel: int
    pipeline_parallel: int
    tasks_per_node: int  # trainer ranks per node, one per GPU
    engines: Engines | None = None  # rollouts on vLLM (megatron backend), else None
    fitted_from: tuple[int, int] | None = None  # (nodes, GPUs per node) the preset gives, when laid out on others

    @property
    def data_parallel(self) -> int:
        return self.nodes * self.tasks_per_node // (self.tensor_parallel * self.pipeline_parallel)

    @property
    def image(self) -> str:
        return TRAINER_IMAGES[self.backend]


def _command_overrides(trainer_command: str) -> dict[str, str]:
    words = shlex.split(trainer_command.replace("$", "\\$"))  # shell variables stay words
    pairs = (w.split("=", 1) for w in words if "=" in w and not w.startswith("-"))
    return {k: v for k, v in pairs if k in _LAYOUT_KEYS}


def _get(tree: dict, dotted: str, default):
    for part in dotted.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return default
        tree = tree[part]
    return tree


def preset_layout(name: str, trainer_command: str, node_gpus: int | None = None) -> PresetLayout:
    """The layout of preset ``name`` for the method and backend the trainer command runs (an aligner preset when the
    command names no backend, as before megatron presets existed; ``preset_problems`` then asks for the word), laid
    out on nodes of ``node_gpus`` GPUs when given (``fit``)."""
    backend = command_backend(trainer_command) or "aligner"
    if backend not in BACKENDS_WITH_PRESETS:
        raise PresetError(f"preset {name!r}: trainer.backend={backend} has no presets (conf/train/<aligner|megatron>/): "
                          "a preset stage runs trainer.backend=aligner or megatron")
    path = conf_dir() / "train" / backend / f"{name}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in path.parent.glob("*.yaml"))
        raise PresetError(f"no {backend} preset {name!r} ({path}); known: {', '.join(known)}")
    methods = [m.group(1) for m in map(_STAGE_MODULE.match, python_modules(trainer_command)) if m]
    if not methods:
        raise PresetError(f"preset {name!r} needs a trainer command running python -m "
                          "nemo_factuality.trainers.{grpo,ppo,kto} (the preset's method section)")
    preset = yaml.safe_load(path.read_text(encoding="utf-8"))
    section = preset[methods[-1]]
    merged = _merge(preset["common"], section.get("overrides", {}))
    given = _command_overrides(trainer_command)

    def value(key: str, default):
        return given.get(key, _get(merged, key, default))

    tp, pp = int(value(_LAYOUT_KEYS[0], 1)), int(value(_LAYOUT_KEYS[1], 1))
    nodes, gpus = int(section.get("nodes", preset["nodes"])), int(preset["gpus_per_node"])
    engines = None
    if backend != "aligner" and value("rollout.engine", "megatron") == "vllm":
        engines = Engines(str(value("rollout.vllm.placement", "colocated")),
                          int(value("rollout.vllm.tensor_parallel_size", 1)),
                          float(value("rollout.vllm.gpu_memory_utilization", 0.3)))
    layout = PresetLayout(name, backend, nodes, gpus, tp, pp, _tasks_per_node(engines, gpus, tp, pp), engines)
    return layout if node_gpus is None or node_gpus == gpus else fit(layout, node_gpus)


def _tasks_per_node(engines: Engines | None, gpus: int, tp: int, pp: int) -> int:
    if engines is None or engines.placement not in placement.PLACEMENTS:
        return gpus
    return placement.trainer_tasks_per_node(engines.placement, gpus_per_node=gpus, tensor=tp, pipeline=pp,
                                            engine_tp=engines.tensor_parallel)


def fit(layout: PresetLayout, node_gpus: int) -> PresetLayout:
    """``layout`` on nodes of ``node_gpus`` GPUs (the stage's ``fit_nodes``): the same trainer ranks (so TP, PP and DP,
    and with them the preset's memory arithmetic and batch sizes), as many per node as the node holds beside its
    engines, on as many nodes as that takes. ``PresetError`` when the ranks do not fill whole nodes, or for an aligner
    preset (NeMo's trainer takes its devices and num_nodes from the preset itself)."""
    if layout.backend == "aligner":
        raise PresetError(f"fit_nodes=true: aligner preset {layout.name} cannot be laid out on other nodes (NeMo's "
                          f"trainer takes devices={layout.gpus_per_node} and num_nodes={layout.nodes} from the preset); "
                          "the megatron_* stage of the method fits any node size")
    world = layout.nodes * layout.tasks_per_node
    tasks = _tasks_per_node(layout.engines, node_gpus, layout.tensor_parallel, layout.pipeline_parallel)
    if tasks < 1 or world % tasks:
        raise PresetError(f"fit_nodes=true: the {world} trainer ranks of preset {layout.name} (TP={layout.tensor_parallel}"
                          f", PP={layout.pipeline_parallel}) do not fill whole nodes of {node_gpus} GPUs ({tasks} ranks "
                          "each); use a profile whose nodes hold them, or a preset of another size")
    return replace(layout, nodes=world // tasks, gpus_per_node=node_gpus, tasks_per_node=tasks,
                   fitted_from=(layout.nodes, layout.gpus_per_node))


def layout_problems(layout: PresetLayout, trainer_command: str, profile_gpus: int) -> list[str]:
    """What keeps the preset's trainer from this profile's nodes (each a setting to change)."""
    problems = []
    if command_backend(trainer_command) is None:
        problems.append(f"trainer_command must name trainer.backend={layout.backend} (the backend of preset "
                        f"{layout.name}: the trainer looks for it in conf/train/<trainer.backend>/)")
    if layout.gpus_per_node > profile_gpus:
        what = "trainer tasks (one per GPU)" if layout.engines is None else "GPUs (trainer ranks and vLLM engines)"
        way = ("fit_nodes=true lays its trainer GPUs out on the profile's nodes, TP, PP and DP kept, nodes derived"
               if layout.backend == "megatron" else
               "an aligner preset's layout is NeMo's trainer's own; the megatron_* stage of the method with "
               "fit_nodes=true fits any node size")
        problems.append(f"preset {layout.name} runs {layout.gpus_per_node if layout.engines else layout.tasks_per_node} "
                        f"{what} per node but the profile's nodes have {profile_gpus} GPUs ({way})")
    e = layout.engines
    if e is not None:
        problems += placement.layout_problems(e.placement, tasks_per_node=layout.tasks_per_node,
                                              gpus_per_node=layout.gpus_per_node, tensor=layout.tensor_parallel,
                                              pipeline=layout.pipeline_parallel, engine_tp=e.tensor_parallel)
    world = layout.nodes * layout.tasks_per_node
    if layout.tasks_per_node < 1 or world % (layout.tensor_parallel * layout.pipeline_parallel):
        problems.append(f"TP×PP = {layout.tensor_parallel * layout.pipeline_parallel} does not divide the {world} trainer "
                        f"ranks of preset {layout.name}")
    return problems


def gpu_split_lines(layout: PresetLayout) -> list[str]:
    """The GPU split the rendered job writes out: per node, the trainer ranks' GPUs and each engine's
    ``CUDA_VISIBLE_DEVICES`` (what ``trainers/engines/vllm_rollout.engine_devices`` gives it at run time)."""
    e = layout.engines
    gpus = ",".join(map(str, range(layout.gpus_per_node)))
    lines = [f"every trainer task sees CUDA_VISIBLE_DEVICES={gpus} and trains on GPU <local rank> (LOCAL_RANK)"]
    if e is None:
        return lines + ["rollouts: the backend's own generation on the trainer's GPUs (no vLLM engines)"]
    where = ("on the first GPUs of its replica, beside the trainer" if e.placement == "colocated" else
             "on GPUs of its own")
    lines += [f"vLLM engines (rollout.vllm.placement={e.placement}, TP={e.tensor_parallel}, gpu_memory_utilization="
              f"{e.gpu_memory_utilization}):", f"  one per model replica, started by its first rank, {where}"]
    for split in placement.node_splits(nodes=layout.nodes, placement=e.placement, tasks_per_node=layout.tasks_per_node,
                                       gpus_per_node=layout.gpus_per_node, tensor=layout.tensor_parallel,
                                       pipeline=layout.pipeline_parallel, engine_tp=e.tensor_parallel):
        first, last = split.ranks[0], split.ranks[-1]
        idle = layout.gpus_per_node - layout.tasks_per_node - (len(split.engines) * e.tensor_parallel
                                                               if e.placement == "separate" else 0)
        lines.append(f"node {split.node}: trainer ranks {first}-{last} on GPUs 0-{layout.tasks_per_node - 1}"
                     + (f", {idle} GPU(s) idle" if idle else ""))
        lines += [f"  engine of replica {slot.replica} (started by rank {slot.rank}): "
                  f"CUDA_VISIBLE_DEVICES={','.join(map(str, slot.gpus))}" for slot in split.engines]
    return lines
