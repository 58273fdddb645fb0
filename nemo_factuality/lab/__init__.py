"""The factuality lab (``nemo-factuality lab``): a synthetic world, a tiny policy that hallucinates on rare
people, factuality RL through the GRPO stage against the served lab reward, and a before/after report."""
