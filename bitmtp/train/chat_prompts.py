"""General chat prompts for distillation: varied questions and instructions, templates x topics.

Why: the evaluation's ``chat`` set (:data:`bitmtp.train.evaluate.CHAT_PROMPTS`) asks general
questions, while the shipped adapters were trained on code only, so their drafts had never seen a
chat answer about anything but code. ``distill --general-fraction`` sends these prompts through the
chat template so the corpus holds the base model's own answers to everyday requests.

Four pools, each extending the one before: ``base`` (the first ~700 prompts, what the session-7/8
corpora drew from), ``wide`` (``base`` plus :data:`MORE_GROUPS`, ~1900 prompts: how things work,
practical how-to and advice, letters and messages, arguments for and against, animals, countries,
everyday maths; the session-9/10 corpora) and ``xl`` (``wide`` plus :data:`EXTRA_GROUPS`, ~3100: food,
professions, the body, sports and games, materials, programming ideas in words, hard moments, places
in nature, people of history, rewriting a sentence, ideas and plans); ``xxl`` (session 14, ``xl`` and every ``xl``
prompt with one of :data:`ANSWER_SHAPES` appended, ~31000: for a GPU distillation run). All four are frozen (a
test pins them by hash): corpora's provenance commands reproduce only while they are, so more prompts go
into a new pool. The shipped
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

#: the groups the ``xl`` pool adds to the ``wide`` pool's (same rules; session 10: ``wide`` was nearly used up)
EXTRA_GROUPS: tuple[tuple[tuple[str, ...], tuple[str, ...]], ...] = (
    (  # food and cooking
        ("Give me a simple recipe for {t}.", "What goes well with {t}?", "How should I store {t}?",
         "Where does {t} come from?", "Is {t} healthy? Explain briefly.", "Describe the taste of {t}."),
        ("pasta with tomato sauce", "lentil soup", "vegetable curry", "sushi", "oatmeal", "pizza dough", "hummus",
         "fresh salsa", "an omelette", "fried rice", "banana bread", "dumplings", "guacamole", "chili", "lemonade",
         "granola", "tacos", "risotto", "a vegetable stir-fry", "falafel", "pesto", "homemade yogurt", "popcorn",
         "roasted vegetables", "chicken soup", "apple pie", "ramen", "cornbread", "a fruit smoothie", "flatbread"),
    ),
    (  # work and professions
        ("What does {t} do all day?", "What skills does {t} need?", "How do you become {t}?",
         "What is the hardest part of being {t}?", "Describe a typical week for {t}."),
        ("a nurse", "an electrician", "a pilot", "a firefighter", "an architect", "a chef", "a veterinarian",
         "a software engineer", "a journalist", "an accountant", "a plumber", "a pharmacist", "a park ranger",
         "a translator", "a dentist", "a farmer", "a judge", "a data analyst", "a mechanic", "a photographer",
         "a carpenter", "a lawyer", "a social worker", "a museum curator", "a marine biologist", "a tailor",
         "a bus driver", "a game designer", "a beekeeper", "an air traffic controller"),
    ),
    (  # the body
        ("Why do we {t}?", "What happens in the body when we {t}?", "Explain to a child why we {t}.",
         "Is it normal to {t} often?"),
        ("yawn", "sneeze", "dream", "get hiccups", "shiver", "sweat", "blush", "get goosebumps", "need water",
         "get sunburned", "forget things", "feel hungry", "catch colds", "get muscle cramps", "snore", "cry",
         "laugh", "get dizzy", "need vitamins", "stretch in the morning"),
    ),
    (  # sports and games
        ("Explain the rules of {t}.", "What makes {t} fun?", "How did {t} begin?", "What are the basic skills in {t}?",
         "What should a beginner know about {t}?"),
        ("basketball", "tennis", "cricket", "baseball", "rugby", "volleyball", "golf", "table tennis", "ice hockey",
         "badminton", "sailing", "rock climbing", "fencing", "archery", "bowling", "skiing", "surfing", "poker",
         "checkers", "Scrabble", "sudoku", "crossword puzzles", "the card game bridge", "water polo", "handball"),
    ),
    (  # materials and everyday things
        ("What is {t} made of?", "How is {t} made?", "Why is {t} so widely used?", "Tell me the history of {t}."),
        ("glass", "paper", "steel", "plastic", "rubber", "cotton", "concrete", "chocolate", "cheese", "soap",
         "glue", "ink", "silk", "wool", "aluminum", "brick", "a candle", "a coin", "a pencil", "denim", "leather",
         "porcelain", "nylon", "table salt", "a glass bottle"),
    ),
    (  # programming ideas, asked in words
        ("Explain {t} with an example.", "When should I use {t}?", "What problems does {t} solve?",
         "What are the downsides of {t}?", "How would you explain {t} to a new programmer?"),
        ("recursion", "a hash table", "a linked list", "binary search", "caching", "an API", "a database index",
         "unit testing", "object-oriented programming", "a compiler", "garbage collection", "multithreading",
         "regular expressions", "a REST API", "big O notation", "a stack", "a queue", "encryption",
         "a virtual machine", "software containers", "DNS", "a firewall", "JSON", "SQL joins", "a binary tree",
         "dynamic programming", "pointers", "exceptions", "a load balancer", "code review"),
    ),
    (  # hard moments
        ("How do I deal with {t}?", "Give advice to someone facing {t}.", "Why is {t} so hard?",
         "Write a short reassuring message about {t}."),
        ("a difficult coworker", "a noisy neighbor", "homesickness", "a missed deadline",
         "a disagreement with a friend", "stage fright", "a breakup", "a rejected application", "loneliness",
         "a messy roommate", "burnout", "jealousy", "procrastination", "a long commute", "a first day at a new school",
         "exam anxiety", "a bad haircut", "losing a game", "a rainy vacation", "a broken phone"),
    ),
    (  # places in nature
        ("Describe {t}.", "What lives in {t}?", "Why are {t} important?", "How do {t} form?",
         "Write a short travel note about visiting {t}."),
        ("deserts", "wetlands", "caves", "glaciers", "rivers", "islands", "rainforests", "mountain ranges",
         "grasslands", "tide pools", "canyons", "waterfalls", "hot springs", "sand dunes", "mangrove forests",
         "lakes", "sandy beaches", "river valleys", "geysers", "fjords"),
    ),
    (  # people of history
        ("Who was {t}?", "What is {t} remembered for?", "Write a short biography of {t}.",
         "What can we learn from {t}?"),
        ("Marie Curie", "Leonardo da Vinci", "Isaac Newton", "Ada Lovelace", "Nelson Mandela", "Albert Einstein",
         "Cleopatra", "Charles Darwin", "Mahatma Gandhi", "Galileo Galilei", "Nikola Tesla", "Florence Nightingale",
         "Alan Turing", "Frida Kahlo", "Abraham Lincoln", "Confucius", "Amelia Earhart", "Mozart", "Rosa Parks",
         "Thomas Edison", "Jane Austen", "Louis Pasteur", "Genghis Khan", "Julius Caesar", "Harriet Tubman"),
    ),
    (  # rewriting a sentence
        ("Rewrite this sentence to sound more formal: {t}", "Fix the grammar of this sentence: {t}",
         "Make this sentence shorter: {t}", "Rewrite this sentence in a friendly tone: {t}",
         "Explain what this sentence means: {t}"),
        ("the meeting got moved to friday cause nobody could come", "i think we should of left earlier",
         "me and him went to the store and buyed some apples", "the report is late because the data was wrong",
         "can u send me the files asap", "their going to the park after lunch",
         "we was not able to finish the project on time", "the new phone is more better than the old one",
         "please dont forget to water the plants while im away", "the train was delayed so i missed the start",
         "everyone have to bring there own lunch tomorrow", "the team did good on the last test",
         "i seen that movie three times already", "the price of rent keeps going up every year",
         "he dont like waiting in long lines", "our office will be closed on monday for repairs",
         "the dog barked all night and nobody could sleep", "she is the most smartest person in the class",
         "the package arrived broken and nobody answered my email", "lets meet at noon near the library"),
    ),
    (  # ideas and plans
        ("Brainstorm ideas for {t}.", "Give me five ideas for {t}.", "Plan {t} on a small budget.",
         "What would make {t} memorable?"),
        ("a birthday party", "a rainy weekend", "a science fair project", "a team-building day",
         "a school fundraiser", "a family dinner", "a garden party", "a short film", "a board game night",
         "a gift for a new parent", "a blog post", "a community event", "a summer camp", "a retirement party",
         "a packed lunch for a child", "decorating a small apartment", "a first date", "a holiday card",
         "a class reunion", "a picnic"),
    ),
)

#: the prompt pools by name: ``base`` = :data:`GROUPS`, ``wide`` = ``base`` + :data:`MORE_GROUPS`,
#: ``xl`` = ``wide`` + :data:`EXTRA_GROUPS`; ``xxl`` is ``xl`` and then every ``xl`` prompt with each of
#: :data:`ANSWER_SHAPES` appended (:func:`all_chat_prompts`)
POOLS = {"base": GROUPS, "wide": GROUPS + MORE_GROUPS, "xl": GROUPS + MORE_GROUPS + EXTRA_GROUPS,
         "xxl": GROUPS + MORE_GROUPS + EXTRA_GROUPS}

#: ``xxl``'s second dimension (session 14): how the answer should be shaped, appended to an ``xl`` prompt — ~10×
#: the prompts for a GPU distillation run (the chat drafts gain ~0.035 per doubling of distinct prompts). The same
#: topic asked for a list, two sentences or an example is answered differently, but its content repeats: a
#: shaped prompt is likely worth less than a new topic (not measured yet).
ANSWER_SHAPES = ("Answer in two sentences.", "Keep it under fifty words.", "Number the points.",
                 "Give one concrete example.", "Start with a one-line summary.", "Write it for a complete beginner.",
                 "End with a practical tip.", "Use plain, friendly language.", "Be brief and precise.")

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


def all_chat_prompts(pool: str = "xl") -> list[str]:
    """Every general prompt of ``pool`` (``base``: ~700, ``wide``: ~1900, ``xl``: ~3100, ``xxl``: ~31000), in a
    fixed order (a pool's prompts start with those of the pool it extends)."""
    out = []
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
