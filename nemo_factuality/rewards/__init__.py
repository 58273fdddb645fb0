"""The five methods' rewards behind one batched call: ``reward(prompts, completions, **columns) -> RewardBatch``.

Registered in ``nemo_factuality.registry.REWARDS``: klcf, rlfh, fspo, knowrl, factalign (and general_rm, a
general reward model served for KLCF's w_rm term).
"""

from nemo_factuality.rewards import factalign, fspo, general_rm, klcf, knowrl, rlfh  # noqa: F401  (register)
from nemo_factuality.rewards.adapters import FactualityEnvironment, make_compute_score, make_trl_reward_funcs
from nemo_factuality.rewards.factalign import FactAlignLabeler
from nemo_factuality.rewards.fspo import FSPOReward
from nemo_factuality.rewards.klcf import KLCFReward
from nemo_factuality.rewards.knowrl import KnowRLReward
from nemo_factuality.rewards.rlfh import RLFHReward

__all__ = ["FactualityEnvironment", "make_compute_score", "make_trl_reward_funcs", "FactAlignLabeler", "FSPOReward",
           "KLCFReward", "KnowRLReward", "RLFHReward"]
