"""Fixtures of the reward-server tests that need a stack venv of their own."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def gym_venv() -> Path:
    """The NeMo-Gym venv NeMo-Gym's own runner, client and rollout collection run in; skips with the reason when not
    built."""
    from nemo_factuality.testing.gym_env import gym_venv as find_gym_venv
    from nemo_factuality.testing.gym_env import skip_reason

    found = find_gym_venv()
    if found is None:
        pytest.skip(skip_reason())
    return found
