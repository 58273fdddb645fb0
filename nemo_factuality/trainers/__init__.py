"""Training stages: GRPO (KLCF, FSPO, KnowRL), dense-reward PPO (RLFH), iterated KTO + fKTO (FactAlign)."""
