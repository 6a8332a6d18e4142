"""General chat prompts for distillation: varied questions and instructions, templates x topics.

Why: the evaluation's ``chat`` set (:data:`bitmtp.train.evaluate.CHAT_PROMPTS`) asks general
questions, while the shipped adapters were trained on code only, so their drafts had never seen a
chat answer about anything but code. ``distill --general-fraction`` sends these prompts through the
chat template so the corpus holds the base model's own answers to everyday requests.

Two pools: ``base`` (the first ~700 prompts, what the session-7/8 corpora drew from) and ``wide``
(``base`` plus :data:`MORE_GROUPS`, ~1900 prompts: how things work, practical how-to and advice,
letters and messages, arguments for and against, animals, countries, everyday maths). The shipped
adapter's first corpora plateaued at ~0.64 first-row accuracy on their own chat records against
~0.49 on the evaluation's chat generations (teacher-forced, session 9): a gap that more varied
prompts, not more passes over the same ones, close.

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

#: the groups the ``wide`` pool adds to :data:`GROUPS` (same rules: no evaluation topic or request form)
MORE_GROUPS: tuple[tuple[tuple[str, ...], tuple[str, ...]], ...] = (
    (  # how things work
        ("How does {t} work?", "What happens inside {t}?", "Explain how {t} works, step by step.",
         "Who invented {t}, and why?", "What are the main parts of {t}?", "What can go wrong with {t}?",
         "How has {t} changed over time?", "Why do people use {t}?"),
        ("a refrigerator", "a bicycle", "an elevator", "a microwave oven", "a camera", "a thermostat", "a compass",
         "a solar panel", "a wind turbine", "a car engine", "a washing machine", "a smartphone battery",
         "a search engine", "a credit card", "a traffic light", "a dishwasher", "a 3D printer", "GPS navigation",
         "a heat pump", "an electric guitar", "a submarine", "a helicopter", "a parachute", "a lock and key",
         "a water filter", "a barometer", "a telescope", "a microscope", "a hearing aid", "a dam",
         "a suspension bridge", "a spreadsheet", "email", "a password manager", "noise-cancelling headphones",
         "an air conditioner", "a printer", "a coffee machine", "a sewing machine", "a smoke detector"),
    ),
    (  # advice for a goal
        ("I want to {t}. Where should I start?", "What should I know before I {t}?", "Give me a checklist to {t}.",
         "What are the first three steps to {t}?", "How long does it take to {t}?",
         "What is the cheapest way to {t}?", "Help me {t}."),
        ("adopt a dog", "buy a used car", "move to a new city", "learn chess", "train for a 5k race",
         "write a novel", "fix a leaky faucet", "paint a room", "build a website", "start a podcast",
         "get more sleep", "eat healthier", "learn to draw", "plan a wedding", "prepare for a camping trip",
         "reduce my screen time", "learn basic first aid", "make new friends", "ask for a raise",
         "teach my kid to read", "set up a home network", "brew beer at home", "start composting",
         "learn sign language", "become a teacher", "pay off debt", "buy my first home", "grow herbs indoors",
         "learn to juggle", "repair a bike tire", "declutter my house", "improve my handwriting",
         "memorize a speech", "travel on a budget", "write a resume", "volunteer in my community"),
    ),
    (  # letters and messages
        ("Write a thank-you note to {t}.", "Write a short speech for {t}.", "Write an apology message to {t}.",
         "Write a two-paragraph letter to {t}.", "Write a funny short message for {t}.",
         "Write a motivational message for {t}.", "Draft a short announcement for {t}."),
        ("a teacher", "a neighbor", "a coworker who is leaving", "a team that won a game", "a new employee",
         "a retiring nurse", "a group of volunteers", "my grandmother", "a customer", "a landlord", "a book club",
         "a graduating class", "a soccer coach", "a local librarian", "a mail carrier", "the runners of a charity race",
         "a friend who moved away", "a new student", "a hiking group", "my younger brother"),
    ),
    (  # arguments for and against
        ("What are the arguments for and against {t}?", "Is {t} a good idea? Explain.",
         "What are the effects of {t} on society?", "Write a short persuasive paragraph about {t}.",
         "What do critics say about {t}?", "How might {t} change in the next twenty years?"),
        ("homework", "school uniforms", "working from home", "electric cars", "social media", "nuclear power",
         "a four-day work week", "zoos", "video games", "fast food", "self-driving cars", "online learning",
         "space exploration", "tipping at restaurants", "daylight saving time", "banning plastic bags",
         "universal basic income", "standardized tests", "open-plan offices", "bike lanes in cities"),
    ),
    (  # animals
        ("Describe the life of {t}.", "Where do {t} live, and what do they eat?", "What makes {t} unique?",
         "Tell a child three fun facts about {t}.", "How do {t} raise their young?"),
        ("wolves", "dolphins", "owls", "elephants", "ants", "sea turtles", "kangaroos", "bats", "sharks", "foxes",
         "frogs", "eagles", "giraffes", "jellyfish", "beavers", "camels", "butterflies", "polar bears", "parrots",
         "snails"),
    ),
    (  # countries
        ("What should a visitor know about {t}?", "Describe the food of {t}.", "Give a short history of {t}.",
         "Plan a three-day trip to {t}.", "What is daily life like in {t}?"),
        ("Japan", "Brazil", "Kenya", "Norway", "Mexico", "India", "Italy", "Egypt", "Canada", "Peru", "Vietnam",
         "Iceland", "Morocco", "New Zealand", "Greece", "Scotland", "Thailand", "Argentina", "Turkey",
         "Australia"),
    ),
    (  # everyday maths
        ("Explain how to calculate {t}.", "Give an example of {t} with numbers.", "When would I need {t}?"),
        ("a percentage", "the average of a list of numbers", "the area of a circle", "simple interest",
         "a tip at a restaurant", "the slope of a line", "a probability", "the volume of a box",
         "a unit conversion", "the median", "a ratio", "a square root", "the perimeter of a rectangle",
         "a weighted average", "a discount price"),
    ),
    (  # how do I
        ("How do I {t}?", "Explain how to {t} in simple steps.", "What is the easiest way to {t}?"),
        ("back up my photos", "make a strong password", "speed up a slow laptop", "clean a keyboard",
         "remove a stain from a shirt", "boil an egg", "tie a tie", "change a flat tire", "iron a shirt",
         "sharpen a knife", "jump-start a car", "make a budget spreadsheet", "write a formal email",
         "take notes in a lecture", "make cold brew coffee", "clean a cast iron pan", "unclog a drain",
         "hang a picture frame", "keep houseplants alive", "make pancakes", "fold a fitted sheet", "read a map",
         "start a campfire safely", "make a simple website", "sort a list in Python", "read a CSV file in Python",
         "center text in HTML", "undo a commit in git", "make a pie chart", "convert Celsius to Fahrenheit"),
    ),
)

#: the prompt pools by name: ``base`` = :data:`GROUPS`, ``wide`` = :data:`GROUPS` + :data:`MORE_GROUPS`
POOLS = {"base": GROUPS, "wide": GROUPS + MORE_GROUPS}

#: words of the evaluation's chat prompts' topics and request forms: no training prompt contains one
EXCLUDED_WORDS = ("capital", "france", "paris", "photosynthesis", "paperclip", "paper clip", "haiku", "autumn",
                  "romeo", "juliet", "shakespeare", "planet", "solar system", "season", "limerick", " cat ",
                  " cat.", "a cat", "job interview", "interview", "sky", "blue", "tuple", "bakery")


def _banned(prompt: str) -> str | None:
    low = f" {prompt.lower()} "
    return next((w for w in EXCLUDED_WORDS if w in low), None)


def _groups(pool: str):
    if pool not in POOLS:
        raise BitMTPError(f"pool: expected one of {sorted(POOLS)}, got {pool!r}")
    return POOLS[pool]


def all_chat_prompts(pool: str = "wide") -> list[str]:
    """Every general prompt of ``pool`` (``base``: ~700, ``wide``: ~1900), in a fixed order."""
    out = []
    for templates, topics in _groups(pool):
        for topic in topics:
            for template in templates:
                prompt = template.format(t=topic)
                if _banned(prompt) is None:
                    out.append(prompt)
    return out


def chat_prompts(count: int, *, seed: int = 0, pool: str = "wide") -> list[str]:
    """``count`` distinct general chat prompts (questions and instructions) of ``pool``, shuffled by
    ``seed``.

    Raises :class:`BitMTPError` if ``count`` is below 1 or above the size of the pool, or for an
    unknown pool."""
    prompts = all_chat_prompts(pool)
    if not 1 <= count <= len(prompts):
        raise BitMTPError(f"count: the {pool!r} general chat prompt pool has {len(prompts)} prompts; ask for "
                          f"1..{len(prompts)}, got {count}")
    random.Random(seed).shuffle(prompts)
    return prompts[:count]
