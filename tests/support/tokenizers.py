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


def trained_bpe(added_tokens: tuple[str, ...] = ()):
    """A small byte-level BPE trained here (a transformers fast tokenizer, vocabulary < 300) with the special
    tokens <pad>, <s>, </s>, the non-special ``added_tokens``, and a chat template that writes the special ones:
    ``<s>{role}: {content}</s>`` per message. Needs transformers."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=290, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    core.train_from_iterator(["the quick brown fox jumps over the lazy dog " * 4], trainer)
    if added_tokens:
        core.add_tokens([AddedToken(t, special=False, normalized=False) for t in added_tokens])
    tok = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    tok.chat_template = "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
    return tok
