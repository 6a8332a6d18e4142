"""The prompts the chat CLI tests use, defined once (tests import only from tests.support)."""

NEW = 8
SYSTEM = "You are a helpful assistant. Answer in one short sentence."
Q1 = "What is the capital of France?"
Q2 = "And of Germany?"
