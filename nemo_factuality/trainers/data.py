"""Prompt data for the stages, one loader per method's released format, all yielding ``PromptRecord``.

=========  ========================================================================================
format     file → record
=========  ========================================================================================
jsonl      ``{"prompt": str, ...}`` → every other key is a reward column (``ground_truth``, ``topic``, ...)
klcf       ``{"prompt", "checklist": [str]}`` (``rewards.klcf_checklist.build_checklists`` output)
rlfh       HotpotQA-style ``{"question", "titles", "materials", "extra_materials"}``
           → ``materials`` = materials + extra_materials, ``topic`` = first title
fspo       parquet (or jsonl) in verl's layout: ``prompt`` = ``[{"role", "content"}]`` pre-templated and
           used verbatim (no chat template), ``reward_model.ground_truth``, ``knowledge`` (absent for math)
knowrl     JSON list ``[{"question", "answers", "title"}]`` → system prompt + question,
           ``ground_truth`` = answers, ``topic`` = title (``;``-joined titles kept)
factalign  ``{"prompt", "topic"?}``; general preference pairs (``data.general_pairs``) are
           ``{"prompt", "chosen", "rejected"}``
=========  ========================================================================================

The reward sees ``prompt`` (the question text); the policy sees the rendered prompt: the tokenizer's
chat template over ``messages`` when ``data.apply_chat_template``, else the raw text.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from nemo_factuality.fileio import input_file
from nemo_factuality.jsonl import iter_jsonl
from nemo_factuality.registry import Registry
from nemo_factuality.types import FactualityInputError

# KnowRL's system prompt (zjunlp/KnowRL train/main.py), in our words with the same instructions.
KNOWRL_SYSTEM = ("Answer this question using the following format strictly:\n\n"
                 "1. First use <think> </think> tags to show your step-by-step reasoning process.\n"
                 "2. Then use <answer> </answer> tags for your final answer. Use your factual knowledge to iteratively "
                 "verify your reasoning and derive the answer. If you genuinely do not know the answer, you can reply "
                 "exactly with: I don't know.")


@dataclass
class PromptRecord:
    prompt: str  # what the reward sees as the prompt
    messages: list[dict[str, str]] | None = None  # chat messages to render (None: `prompt` is raw text)
    verbatim: bool = False  # the prompt is already templated: never apply a chat template
    columns: dict[str, Any] = field(default_factory=dict)  # reward columns
    where: str = ""  # file:line, for errors


@dataclass
class PreferencePair:
    prompt: str
    chosen: str
    rejected: str
    where: str = ""


LOADERS: Registry[Callable[[Path], list[PromptRecord]]] = Registry("data format")


def _require(obj: dict, key: str, where: str, kind: type | tuple[type, ...] = str) -> Any:
    return _require_all(obj, {key: kind}, where)[0]


def _require_all(obj: dict, fields: dict[str, type | tuple[type, ...]], where: str) -> list[Any]:
    """The values of ``fields`` (name → type) in order; a record missing some, or holding a wrong type, is one error
    naming every such field at once and the fields the record has (at most ten), so one fix mends the record."""
    missing = [k for k in fields if obj.get(k) is None]
    wrong = [f"{k!r} must be {_type_names(kind)}, got {type(obj[k]).__name__}" for k, kind in fields.items()
             if k not in missing and not isinstance(obj[k], kind)]
    if missing or wrong:
        parts = [f"missing field{'s' if len(missing) > 1 else ''} {', '.join(map(repr, missing))}"] if missing else []
        parts += [f"field {w}" for w in wrong]
        has = ", ".join(map(repr, list(obj)[:10])) + (", …" if len(obj) > 10 else "") if obj else "none"
        raise FactualityInputError(f"{where}: {'; '.join(parts)} (the record has: {has})")
    return [obj[k] for k in fields]


def _type_names(kind: type | tuple[type, ...]) -> str:
    return kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)


@LOADERS.register("jsonl")
def load_jsonl(path: Path) -> list[PromptRecord]:
    out = []
    for where, obj in iter_jsonl(path):
        prompt = _require(obj, "prompt", where)
        columns = {k: v for k, v in obj.items() if k != "prompt"}
        out.append(PromptRecord(prompt, [{"role": "user", "content": prompt}], columns=columns, where=where))
    return out


@LOADERS.register("klcf")
def load_klcf(path: Path) -> list[PromptRecord]:
    out = []
    for where, obj in iter_jsonl(path):
        prompt, checklist = _require_all(obj, {"prompt": str, "checklist": list}, where)
        if not all(isinstance(c, str) for c in checklist):
            raise FactualityInputError(f"{where}: every checklist item must be a string")
        out.append(PromptRecord(prompt, [{"role": "user", "content": prompt}], columns={"checklist": checklist}, where=where))
    return out


@LOADERS.register("rlfh")
def load_rlfh(path: Path) -> list[PromptRecord]:
    out = []
    for where, obj in iter_jsonl(path):
        question, materials = _require_all(obj, {"question": str, "materials": list}, where)
        materials = list(materials) + list(obj.get("extra_materials") or [])
        if not all(isinstance(m, str) for m in materials):
            raise FactualityInputError(f"{where}: materials and extra_materials must be lists of strings")
        titles = obj.get("titles") or []
        out.append(PromptRecord(question, [{"role": "user", "content": question}],
                                columns={"materials": materials, "topic": titles[0] if titles else None}, where=where))
    return out


def _fspo_rows(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        for i, row in enumerate(pq.read_table(path).to_pylist()):
            yield f"{path}:row {i}", row
    else:
        yield from iter_jsonl(path)


@LOADERS.register("fspo")
def load_fspo(path: Path) -> list[PromptRecord]:
    out = []
    for where, obj in _fspo_rows(path):
        messages = _require(obj, "prompt", where, (list, np.ndarray))
        messages = [dict(m) for m in messages]
        if not messages or not all(isinstance(m.get("content"), str) for m in messages):
            raise FactualityInputError(f"{where}: 'prompt' must be a list of {{role, content}} messages")
        reward_model = obj.get("reward_model") or {}
        gold = reward_model.get("ground_truth", obj.get("answer"))
        if gold is None:
            raise FactualityInputError(f"{where}: missing reward_model.ground_truth (or answer)")
        text = "".join(m["content"] for m in messages)
        out.append(PromptRecord(obj.get("question") or text, messages, verbatim=True,
                                columns={"ground_truth": str(gold), "knowledge": obj.get("knowledge") or None},
                                where=where))
    return out


@LOADERS.register("knowrl")
def load_knowrl(path: Path) -> list[PromptRecord]:
    try:
        items = json.loads(Path(path).read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise FactualityInputError(f"{path}: not a JSON list of {{question, answers, title}} ({err})") from None
    if not isinstance(items, list):
        raise FactualityInputError(f"{path}: expected a JSON list, got {type(items).__name__}")
    out = []
    for i, obj in enumerate(items):
        where = f"{path}:item {i}"
        if not isinstance(obj, dict):
            raise FactualityInputError(f"{where}: each item must be an object")
        question, answers = _require_all(obj, {"question": str, "answers": (str, list)}, where)
        gold = answers if isinstance(answers, str) else "; ".join(map(str, answers))
        messages = [{"role": "system", "content": KNOWRL_SYSTEM}, {"role": "user", "content": question}]
        out.append(PromptRecord(question, messages, columns={"ground_truth": gold, "topic": obj.get("title")}, where=where))
    return out


@LOADERS.register("factalign")
def load_factalign(path: Path) -> list[PromptRecord]:
    out = []
    for where, obj in iter_jsonl(path):
        prompt = _require(obj, "prompt", where)
        out.append(PromptRecord(prompt, [{"role": "user", "content": prompt}], columns={"topic": obj.get("topic")},
                                where=where))
    return out


def load_pairs(path: str | Path) -> list[PreferencePair]:
    """General preference pairs ``{"prompt", "chosen", "rejected"}`` (FactAlign mixes them into KTO)."""
    path = input_file(path, "data file", suffixes=(".jsonl",), hint="point data.general_pairs at the pairs' JSONL file")
    return [PreferencePair(_require(o, "prompt", w), _require(o, "chosen", w), _require(o, "rejected", w), w)
            for w, o in iter_jsonl(path)]


def packaged_path(path: str) -> Path:
    """``package:demo_prompts.jsonl`` → the file shipped in ``nemo_factuality/data``; other paths unchanged."""
    if path.startswith("package:"):
        return Path(__file__).resolve().parents[1] / "data" / path[len("package:"):]
    return Path(path)


def load_prompts(path: str | Path | None, fmt: str) -> list[PromptRecord]:
    """Records of ``path`` in format ``fmt``; a missing or empty file is an input error naming it."""
    if path is None:
        raise FactualityInputError("data.train is not set; point it at a prompt file (data.train=prompts.jsonl)")
    p = input_file(packaged_path(str(path)), "data file", suffixes=(".jsonl", ".json", ".parquet"),
                   hint="point data.train / data.validation at the prompt file itself")
    records = LOADERS.get(fmt)(p)
    if not records:
        raise FactualityInputError(f"data file {p} has no records")
    return records


class PromptSampler:
    """Seeded epoch permutations with a resumable position ``(epoch, offset)``."""

    def __init__(self, n: int, seed: int) -> None:
        self.n, self.seed, self.epoch, self.offset = n, seed, 0, 0
        self._order = self._permutation()

    def _permutation(self) -> list[int]:
        return np.random.default_rng([self.seed, self.epoch]).permutation(self.n).tolist()

    def take(self, k: int) -> list[int]:
        out: list[int] = []
        while len(out) < k:
            if self.offset >= self.n:
                self.epoch, self.offset = self.epoch + 1, 0
                self._order = self._permutation()
            take = min(k - len(out), self.n - self.offset)
            out.extend(self._order[self.offset : self.offset + take])
            self.offset += take
        return out

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "offset": self.offset, "n": self.n, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["n"] != self.n:
            raise FactualityInputError(f"the checkpoint was written for {state['n']} prompts but the data has {self.n}; "
                                       "resume with the same data.train or start a new run directory")
        self.seed, self.epoch, self.offset = state["seed"], state["epoch"], state["offset"]
        self._order = self._permutation()
