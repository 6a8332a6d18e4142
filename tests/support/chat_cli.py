"""The prompts the chat CLI tests use, defined once (tests import only from tests.support)."""

NEW = 8
SYSTEM = "You are a helpful assistant. Answer in one short sentence."
Q1 = "What is the capital of France?"
Q2 = "And of Germany?"


def two_turn_answers(model) -> tuple[str, str, str]:
    """The chat CLI's expected replies (greedy, ``NEW`` tokens, system prompt ``SYSTEM``) to Q1 and then, in
    the same conversation, Q2, and Q2's reply in a fresh chat (checked to differ: Q2 must need Q1)."""
    import bitmtp

    def reply(messages: list[dict[str, str]]) -> str:
        return bitmtp.generate(model, messages, max_new_tokens=NEW).text

    sys_msg = {"role": "system", "content": SYSTEM}
    a1 = reply([sys_msg, {"role": "user", "content": Q1}])
    a2 = reply([sys_msg, {"role": "user", "content": Q1}, {"role": "assistant", "content": a1},
                {"role": "user", "content": Q2}])
    fresh2 = reply([sys_msg, {"role": "user", "content": Q2}])
    assert a2 != fresh2, "pick questions whose answer needs the first"
    return a1, a2, fresh2
