"""Long-form factuality metrics, each numerically equal to its public implementation.

See ``tests/metrics`` for the parity checks against ``../shared/parity`` goldens.
"""

from nemo_factuality.metrics.abstain import is_response_abstained
from nemo_factuality.metrics.factscore import FactScoreResult, factscore, length_penalty
from nemo_factuality.metrics.hallulens import LongWikiResult, longwiki_scores
from nemo_factuality.metrics.safe import SafeScore, aggregate_f1_at_k, f1_at_k
from nemo_factuality.metrics.veriscore import domain_k, model_stats, veriscore_stats

__all__ = [
    "is_response_abstained", "FactScoreResult", "factscore", "length_penalty", "LongWikiResult",
    "longwiki_scores", "SafeScore", "aggregate_f1_at_k", "f1_at_k", "domain_k", "model_stats", "veriscore_stats",
]
