"""Fuzz suite settings: seeded, bounded, and the tokenizers the alignment properties run on.

Every property runs the same examples on every run (``derandomize``, no example database), on a
fixed budget per test, so the suite is a regression test with a known cost (under 3 minutes on
2 CPU cores). For a longer soak: ``FUZZ_SCALE=20`` multiplies every budget and ``FUZZ_RANDOM=1``
draws fresh examples (seed with ``--hypothesis-seed=N`` to repeat a run).
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "fuzz",
    derandomize=os.environ.get("FUZZ_RANDOM", "0") != "1",
    database=None,
    deadline=None,  # wall-clock limits live in the degenerate-input tests, sized to catch quadratic cost
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)
settings.load_profile("fuzz")

# A corpus unlike the default one, so the second tokenizer has other merges (and another vocabulary
# size): merges across accents, CJK and emoji bytes land elsewhere.
_OTHER_CORPUS = [
    "ÆØÅ æøå naïve façade coöperate jalapeño crème brûlée — déjà vu.",
    "中文分词测试。日本語のテキストです！한국어 문장입니다?",
    "👩‍💻🧑🏽‍🚀🏳️‍🌈 👍🏿 e\u0301 a\u0308 o\u0302\u0323 zalgo z\u0351\u0352\u0353",
    "Plain ASCII words: the quick brown fox jumps over the lazy dog. A. B. C.",
]


@pytest.fixture(scope="session")
def second_tokenizer():
    from nemo_factuality.testing.tiny_models import build_tiny_tokenizer

    return build_tiny_tokenizer(vocab_size=520, corpus=_OTHER_CORPUS)


@pytest.fixture(scope="session")
def byte_fallback_tokenizer():
    from fuzz_support import build_byte_fallback_tokenizer

    return build_byte_fallback_tokenizer()
