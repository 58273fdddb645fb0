"""The scripted judge, policy and reward config the NeMo-Gym resources-server tests share (``tests/serving``).

``gym_judge`` answers KLCF's three judge roles so a test knows each response's reward by hand: one claim per
sentence, a claim is true iff it is in ``TRUE_CLAIMS``, a checklist item is covered iff the response says it word for
word. Serve it with ``ScriptedOpenAIServer(gym_judge)`` or ``python -m nemo_factuality.testing.fake_openai --script
nemo_factuality.testing.gym_judge:gym_judge``; ``POLICY_ANSWERS`` is what the scripted policy says.
"""

from __future__ import annotations

import re
from typing import Any

from nemo_factuality.testing.fake_openai import Reply

#: The claims the scripted judge calls true; every other claim is false.
TRUE_CLAIMS = frozenset({"Paris is the capital of France.", "Rome is the capital of Italy.", "Tokyo is the capital of Japan."})
#: What the scripted policy answers to each question (by a word of it), and the rows the tests collect.
POLICY_ANSWERS = {"Paris": "Paris is the capital of France. Paris has nine airports.",
                  "Rome": "Rome is the capital of Spain.",
                  "Tokyo": "Tokyo is the capital of Japan. Tokyo is in Japan."}
QUESTIONS = {"Paris": ("Tell me about Paris.", ["Paris is the capital of France."]),
             "Rome": ("Tell me about Rome.", ["Rome is the capital of Italy."]),
             "Tokyo": ("Tell me about Tokyo.", ["Tokyo is the capital of Japan.", "Tokyo hosted the 1964 Olympics."])}
#: How the scripted verifier fails, set by a test in the judge's process: "down" (HTTP 503), "garbage" (verdicts
#: nobody can read) or None.
MODE: dict[str, Any] = {"verify": None}
#: A claim holding this fails its verification with HTTP 503 whatever the mode (a judge outage a test in another
#: process can cause), and the question the scripted policy answers with such a claim.
OUTAGE = "[judge-outage]"
OUTAGE_QUESTION = "Tell me about Atlantis."
POLICY_REPLIES = {**POLICY_ANSWERS, "Atlantis": f"Atlantis sank {OUTAGE}."}  # what the scripted policy serves
_CLAIM = re.compile(r"Claim: (.*)$", re.S)


def klcf_config(judge_url: str) -> dict[str, Any]:
    """KLCF's reward on the scripted judge: checklist recall + truthfulness precision (no general RM), no retries."""
    judge = {"base_url": judge_url, "model": "judge", "max_retries": 0, "timeout_s": 10}
    return {"name": "klcf", "w_rm": 0.0, "judge": judge,
            "pipeline": {"extractor": {"name": "klcf"}, "evidence": {"name": "none"},
                         "verifier": {"name": "llm_judge", "style": "truthfulness"}}}


def gym_judge(req: dict) -> Reply:
    """KLCF's extractor, truthfulness verifier and checklist judge, scripted (module docstring)."""
    content = req["messages"][-1]["content"]
    if "Extract every verifiable factual claim" in content:
        response = content.split("Response:", 1)[-1].strip()
        return Reply("\n".join(f"- {s.strip()}." for s in response.split(".") if s.strip()))
    if "Is the following claim true" in content:
        if MODE["verify"] == "down" or OUTAGE in content:
            return Reply("judge process died", status=503)
        if MODE["verify"] == "garbage":
            return Reply("I would rather not say.")
        claim = _CLAIM.search(content).group(1).strip()
        return Reply("True" if claim in TRUE_CLAIMS else "False")
    if "Covered" in content:
        item = content.split("Fact:", 1)[-1].split("\nResponse:", 1)[0].strip()
        return Reply("Covered" if item in content.split("\nResponse:", 1)[-1] else "Not covered")
    return Reply("unscripted", status=400)
