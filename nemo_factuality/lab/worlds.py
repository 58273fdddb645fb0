"""The lab's worlds behind one interface: ``synthetic`` (invented people, ``lab/world.py``) and ``countries`` (real
facts about real countries, ``lab/countries.py``).

What the rest of the lab needs from a world, and nothing else: its attributes (an answer's slots), the prompt (raw
text, or chat messages for a chat model), how a sentence reads as a claim (``read`` → ``readings.Reading``), how a
claim is declined (``abstain``), the verifier that labels claims against its knowledge store, and the words the
report uses for its entities and its development seed. The rewards, the evaluation and the decode-time threshold
all go through it, so each of those is one piece of code for both worlds. How a reading is judged against the
stored values (``is_correct``, ``covers`` ...) is ``lab/readings.py``, below both worlds.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from nemo_factuality.lab import countries as C
from nemo_factuality.lab import world as W
from nemo_factuality.lab.readings import Reading, sentences_of
from nemo_factuality.types import FactualityInputError

WORLDS = ("synthetic", "countries")


@dataclass(frozen=True)
class LabWorld:
    """One world's parts (see the module docstring)."""

    name: str
    attributes: tuple[str, ...]
    prompt_for: Callable[[str], str]  # what the reward and the eval see as the prompt
    messages_for: Callable[[str], list[dict[str, str]]] | None  # chat messages (None: the prompt is raw text)
    read: Callable[[str], Reading | None]
    abstain: Callable[[str, str], str]  # (sentence, entity) → the sentence declined ("": dropped)
    response_marker: str | None  # the text before a response in the reward server's token rows (None: the template's)
    verifier: Callable[[str], Any]  # store path → the verifier that labels this world's claims
    entity: str  # the report's noun for one entity ("person") ...
    entities: str  # ... and for several ("people")
    development: str  # what was looked at on the development seed (``DEVELOPMENT_SEED``), as a clause
    other_seeds: str  # what any other seed is, as a clause

    @property
    def slots(self) -> int:
        """An answer's slots, one per attribute: SAFE's K, FactAlign's K and KnowRL's length penalty γ."""
        return len(self.attributes)

    def is_abstention(self, sentence: str) -> bool:
        reading = self.read(sentence)
        return reading is not None and reading.abstains

    def record(self, entity: str, columns: dict[str, Any] | None = None) -> Any:
        """The ``PromptRecord`` a stage trains on (chat messages when the world has them)."""
        from nemo_factuality.trainers.data import PromptRecord

        messages = self.messages_for(entity) if self.messages_for is not None else None
        return PromptRecord(prompt=self.prompt_for(entity), messages=messages, columns=dict(columns or {}))


#: The seed each world was developed on: its held-out answers were looked at while the world and the lab were
#: designed, so its numbers are no fresh test (the report says so, in the world's words).
DEVELOPMENT_SEED = 0


@functools.cache
def get_world(name: str) -> LabWorld:
    if name == "synthetic":
        return LabWorld("synthetic", tuple(W.ATTRIBUTES), W.prompt_for, None, W.read, W.abstain, W.RESPONSE_MARKER,
                        W.verifier, "person", "people",
                        development="its held-out numbers were looked at while the lab was designed",
                        other_seeds="fresh worlds of invented people that no design decision looked at")
    if name == "countries":
        return LabWorld("countries", C.ATTRIBUTES, C.prompt_for, C.messages_for, C.read, C.abstain, None,
                        C.CountryVerifier, "country", "countries",
                        development="the countries world (its prompt, aliases and run sizes) was built and tuned on "
                                    "its runs, their held-out answers read",
                        other_seeds="other held-out countries drawn from the same countries the world was tuned on "
                                    "(a few may have been seed 0's held-out countries too)")
    raise FactualityInputError(f"lab: unknown world {name!r}; choose from {', '.join(WORLDS)}")


def check_gold(world: LabWorld, gold: Any, where: str) -> dict[str, str]:
    """The ground_truth column of one prompt: attribute → accepted values (``a|b``), every attribute present."""
    if not isinstance(gold, dict) or set(gold) != set(world.attributes):
        raise FactualityInputError(f"{where} must map every attribute {sorted(world.attributes)} to its value")
    return gold


def abstain_response(world: LabWorld, response: str, entity: str, confidences: Sequence[float], tau: float) -> str:
    """The decode-time threshold: each sentence whose confidence is below ``tau`` declined (``LabWorld.abstain``).
    ``confidences``: one per sentence of ``sentences_of(response)``, in order."""
    out = []
    for k, sent in enumerate(sentences_of(response)):
        if k < len(confidences) and confidences[k] < tau:
            sent = world.abstain(sent, entity)
        if sent:
            out.append(sent)
    return " ".join(out)
