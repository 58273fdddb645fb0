"""Shared pytest fixtures: offline environment, parity goldens, a locally trained tokenizer."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def parity_dir():
    from nemo_factuality.testing.paths import parity_dir as _parity_dir

    return _parity_dir()


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory):
    from nemo_factuality.testing.tiny_models import build_tiny_tokenizer

    out = tmp_path_factory.mktemp("tiny_tokenizer")
    build_tiny_tokenizer(out)
    return out


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir))
