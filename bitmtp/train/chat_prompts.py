"""General chat prompts for distillation: varied questions and instructions, templates x topics.

Why: the evaluation's ``chat`` set (:data:`bitmtp.train.evaluate.CHAT_PROMPTS`) asks general
questions, while the shipped adapters were trained on code only, so their drafts had never seen a
chat answer about anything but code. ``distill --general-fraction`` sends these prompts through the
chat template so the corpus holds the base model's own answers to everyday requests. Variety is the
point: the shipped adapter's first corpora plateaued at ~0.64 first-row accuracy on their own chat
records against ~0.49 on the evaluation's chat generations (teacher-forced), a gap that more varied
prompts, not more passes over the same ones, close.

The templates and topics are package data (``bitmtp/data/chat_prompt_groups.json``). Four pools, each
extending the one before: ``base`` (:data:`GROUPS`, ~700 prompts), ``wide`` (``base`` plus
:data:`MORE_GROUPS`, ~1900: how things work, practical how-to and advice, letters and messages,
arguments for and against, animals, countries, everyday maths), ``xl`` (``wide`` plus
:data:`EXTRA_GROUPS`, ~3100: food, professions, the body, sports and games, materials, programming ideas
in words, hard moments, places in nature, people of history, rewriting a sentence, ideas and plans) and
``xxl`` (``xl`` and every ``xl`` prompt with one of :data:`ANSWER_SHAPES` appended, ~31000: for a GPU
distillation run). All four are frozen (a test pins them by hash): a distillation corpus records the
``distill --general-pool`` command that built it, which reproduces the corpus only while its pool stays
as it is, so more prompts go into a new pool.

The set is deterministic (a seed) and built to stay clear of the evaluation: no topic or request
form of the 12 evaluation prompts appears (:data:`EXCLUDED_WORDS` is checked on every prompt), so
training on it never sees those prompts or close paraphrases of them.
"""

from __future__ import annotations

import json
import random
from importlib.resources import files

from bitmtp.errors import BitMTPError

#: one group: (templates, topics); a template's ``{t}`` is the topic
Group = tuple[tuple[str, ...], tuple[str, ...]]

_DATA: dict[str, list] = json.loads((files("bitmtp") / "data" / "chat_prompt_groups.json").read_text(encoding="utf-8"))


def _groups_of(key: str) -> tuple[Group, ...]:
    # tuples, as the pools' concatenation (POOLS) and their frozen hashes were built from
    return tuple((tuple(g["templates"]), tuple(g["topics"])) for g in _DATA[key])


#: the ``base`` pool's groups, one per kind of topic (ideas in science and society, activities and
#: skills, things to write, comparisons, facts and history)
GROUPS: tuple[Group, ...] = _groups_of("groups")

#: the groups the ``wide`` pool adds to :data:`GROUPS` (same rules: no evaluation topic or request form)
MORE_GROUPS: tuple[Group, ...] = _groups_of("more_groups")

#: the groups the ``xl`` pool adds to the ``wide`` pool's (same rules), for when ``wide`` was nearly used up
EXTRA_GROUPS: tuple[Group, ...] = _groups_of("extra_groups")

#: the prompt pools by name: ``base`` = :data:`GROUPS`, ``wide`` = ``base`` + :data:`MORE_GROUPS`,
#: ``xl`` = ``wide`` + :data:`EXTRA_GROUPS`; ``xxl`` is ``xl`` and then every ``xl`` prompt with each of
#: :data:`ANSWER_SHAPES` appended (:func:`all_chat_prompts`)
POOLS: dict[str, tuple[Group, ...]] = {
    "base": GROUPS, "wide": GROUPS + MORE_GROUPS, "xl": GROUPS + MORE_GROUPS + EXTRA_GROUPS,
    "xxl": GROUPS + MORE_GROUPS + EXTRA_GROUPS}

#: ``xxl``'s second dimension: how the answer should be shaped, appended to an ``xl`` prompt — ~10× the
#: prompts for a GPU distillation run (the chat drafts gain ~0.035 per doubling of distinct prompts). The
#: same topic asked for a list, two sentences or an example is answered differently, but its content
#: repeats: a shaped prompt is likely worth less than a new topic (not measured).
ANSWER_SHAPES: tuple[str, ...] = tuple(_DATA["answer_shapes"])

#: words of the evaluation's chat prompts' topics and request forms: no training prompt contains one
EXCLUDED_WORDS: tuple[str, ...] = tuple(_DATA["excluded_words"])


def _banned(prompt: str) -> str | None:
    low = f" {prompt.lower()} "
    return next((w for w in EXCLUDED_WORDS if w in low), None)


def _groups(pool: str) -> tuple[Group, ...]:
    if pool not in POOLS:
        raise BitMTPError(f"pool: expected one of {sorted(POOLS)}, got {pool!r}")
    return POOLS[pool]


def all_chat_prompts(pool: str = "xl") -> list[str]:
    """Every general prompt of ``pool`` (``base``: ~700, ``wide``: ~1900, ``xl``: ~3100, ``xxl``: ~31000), in a
    fixed order (a pool's prompts start with those of the pool it extends)."""
    out: list[str] = []
    for templates, topics in _groups(pool):
        for topic in topics:
            for template in templates:
                prompt = template.format(t=topic)
                if _banned(prompt) is None:
                    out.append(prompt)
    if pool == "xxl":
        out += [f"{prompt} {shape}" for shape in ANSWER_SHAPES for prompt in out
                if _banned(f"{prompt} {shape}") is None]
    return out


def chat_prompts(count: int | None, *, seed: int = 0, pool: str = "xl") -> list[str]:
    """``count`` distinct general chat prompts (questions and instructions) of ``pool``, shuffled by
    ``seed`` (``None``: the whole pool in that order).

    Raises :class:`BitMTPError` if ``count`` is below 1 or above the size of the pool, or for an
    unknown pool."""
    prompts = all_chat_prompts(pool)
    if count is None:
        count = len(prompts)
    if not 1 <= count <= len(prompts):
        raise BitMTPError(f"count: the {pool!r} general chat prompt pool has {len(prompts)} prompts; ask for "
                          f"1..{len(prompts)}, got {count}")
    random.Random(seed).shuffle(prompts)
    return prompts[:count]
