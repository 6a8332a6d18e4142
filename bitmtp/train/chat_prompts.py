"""General chat prompts for distillation: varied questions and instructions, templates x topics.

Why: the evaluation's ``chat`` set (:data:`bitmtp.train.evaluate.CHAT_PROMPTS`) asks general
questions, while the shipped adapters were trained on code only, so their drafts had never seen a
chat answer about anything but code. ``distill --general-fraction`` sends these prompts through the
chat template so the corpus holds the base model's own answers to everyday requests.

The set is deterministic (a seed) and built to stay clear of the evaluation: no topic or request
form of the 12 evaluation prompts appears (:data:`EXCLUDED_WORDS` is checked on every prompt), so
training on it never sees those prompts or close paraphrases of them.
"""

from __future__ import annotations

import random

from bitmtp.errors import BitMTPError

#: (templates, topics) per kind of topic; a template's ``{t}`` is the topic
GROUPS: tuple[tuple[tuple[str, ...], tuple[str, ...]], ...] = (
    (  # ideas in science, technology and society
        ("Explain {t} in simple terms.", "What is {t}?", "Give a short definition of {t}.",
         "Why does {t} matter?", "Summarize the main ideas of {t}.", "Explain {t} to a ten-year-old.",
         "What are common misconceptions about {t}?", "Describe {t} in one paragraph.",
         "How would you teach {t} to a beginner?", "What are the pros and cons of {t}?"),
        ("inflation", "gravity", "the water cycle", "supply and demand", "machine learning", "democracy",
         "compound interest", "natural selection", "the greenhouse effect", "plate tectonics", "vaccination",
         "renewable energy", "the internet", "black holes", "the immune system", "recycling",
         "public key cryptography", "the scientific method", "electric circuits", "climate change",
         "opportunity cost", "the theory of relativity", "cloud computing", "biodiversity", "DNA",
         "the stock market", "nuclear fusion", "sleep cycles", "version control", "the printing press"),
    ),
    (  # activities and skills
        ("How can I get better at {t}?", "What are some tips for {t}?", "Give practical advice for {t}.",
         "What mistakes do beginners make when {t}?", "Write a short guide to {t}.",
         "What equipment do I need for {t}?", "Make a one-week plan for {t}.",
         "Describe a good routine for {t}."),
        ("learning a new language", "running a marathon", "public speaking", "saving money", "cooking rice",
         "growing tomatoes", "writing a cover letter", "studying for exams", "learning to swim",
         "taking better photos", "playing the guitar", "meditating", "planning a road trip",
         "keeping a journal", "painting with watercolors", "starting a small business", "baking bread",
         "learning to code", "managing stress", "organizing a closet"),
    ),
    (  # things to write (no haiku or limerick: the evaluation asks for those)
        ("Write a short poem about {t}.", "Write a four-line rhyme about {t}.", "Write a short story about {t}.",
         "Describe {t} in three sentences.", "Write a tweet about {t}.", "Write a product description for {t}.",
         "Write a friendly email inviting a friend to see {t}."),
        ("the ocean", "a rainy morning", "a lighthouse", "an old library", "a mountain village", "the night sky",
         "a busy train station", "a lost umbrella", "a desert at noon", "a snowy forest", "a city at dawn",
         "a garden in spring", "a quiet harbor", "a friendly robot", "a hot air balloon"),
    ),
    (  # comparisons
        ("Compare {t}.", "What is the difference between {t}?", "Which is better for a beginner: {t}?",
         "List the main similarities and differences between {t}."),
        ("tea and coffee", "hamsters and rabbits as pets", "trains and planes for travel", "email and phone calls",
         "renting and buying a home", "paper books and e-books", "running and cycling", "weather and climate",
         "viruses and bacteria", "a hurricane and a tornado", "Java and JavaScript", "RAM and storage",
         "speed and velocity", "a lake and a pond", "mitosis and meiosis", "a democracy and a monarchy"),
    ),
    (  # facts and history
        ("Tell me about {t}.", "What are three interesting facts about {t}?", "Give a brief history of {t}.",
         "Why is {t} famous?", "Summarize what is known about {t}."),
        ("the Great Wall of China", "the Roman Empire", "the Amazon rainforest", "Mount Everest",
         "the first Moon landing", "the Eiffel Tower", "ancient Egypt", "the Olympic Games", "honeybees",
         "the human heart", "octopuses", "the Sahara desert", "the invention of the telephone", "volcanoes",
         "the Industrial Revolution", "penguins", "the Pacific Ocean", "coral reefs", "the Renaissance"),
    ),
)

#: words of the evaluation's chat prompts' topics and request forms: no training prompt contains one
EXCLUDED_WORDS = ("capital", "france", "paris", "photosynthesis", "paperclip", "paper clip", "haiku", "autumn",
                  "romeo", "juliet", "shakespeare", "planet", "solar system", "season", "limerick", " cat ",
                  " cat.", "a cat", "job interview", "interview", "sky", "blue", "tuple", "bakery")


def _banned(prompt: str) -> str | None:
    low = f" {prompt.lower()} "
    return next((w for w in EXCLUDED_WORDS if w in low), None)


def all_chat_prompts() -> list[str]:
    """Every general prompt of the set, in a fixed order (a few hundred)."""
    out = []
    for templates, topics in GROUPS:
        for topic in topics:
            for template in templates:
                prompt = template.format(t=topic)
                if _banned(prompt) is None:
                    out.append(prompt)
    return out


def chat_prompts(count: int, *, seed: int = 0) -> list[str]:
    """``count`` distinct general chat prompts (questions and instructions), shuffled by ``seed``.

    Raises :class:`BitMTPError` if ``count`` is below 1 or above the size of the set."""
    pool = all_chat_prompts()
    if not 1 <= count <= len(pool):
        raise BitMTPError(f"count: the general chat prompt set has {len(pool)} prompts; ask for 1..{len(pool)}, "
                          f"got {count}")
    random.Random(seed).shuffle(pool)
    return pool[:count]
