"""Rollout engines: what generates a stage's rollouts when it is not the actor's own ``generate`` (``rollout.engine``)."""
