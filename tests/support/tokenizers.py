"""A stand-in tokenizer for tests that need one without downloading a real one."""

from __future__ import annotations


class CharTokenizer:
    """A test double: one token per character (ids 3..96), chat = role tags + text."""

    def __call__(self, text):
        return {"input_ids": [3 + ord(c) % 94 for c in text]}

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages) + ("<assistant>" if add_generation_prompt
                                                                           else "")
        return self(text)["input_ids"] if tokenize else text

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + i % 26) for i in ids)
