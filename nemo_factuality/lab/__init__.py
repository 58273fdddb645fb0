"""The factuality lab (``nemo-factuality lab``): a synthetic world, a tiny policy that hallucinates on rare
people, the five methods each trained through its own stage against its own reward (served on PyTriton),
and one report comparing them with honest no-training references."""
