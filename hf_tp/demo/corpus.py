"""The embedded default's corpus: a fixed-seed grammar of short documents (one per line).

Each document is a few sentences of one kind; the kinds teach a tiny model different things: fixed
sequences (counting, days, letters), facts (arithmetic, animal sounds, comparisons) and copying
from earlier in the line (stories, questions, repetitions), so the loss falls visibly within ~100
optimizer steps.
"""

from __future__ import annotations

import random

CORPUS_SEED = 1234
NUM_DOCUMENTS = 3000

NUMBERS = (
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
    "sixteen seventeen eighteen nineteen twenty"
).split()
DAYS = "monday tuesday wednesday thursday friday saturday sunday".split()
MONTHS = "january february march april may june july august september october november december".split()
LETTERS = list("abcdefghijklmnopqrstuvwxyz")
NAMES = "anna ben carla dan emma finn gina hugo ida jack kim leo mia nora omar pia".split()
COLORS = "red blue green yellow black white brown pink orange purple gray".split()
SIZES = "big small old new little shiny".split()
OBJECTS = "ball box cup book hat key lamp chair pen bag kite boat coin shoe clock bell".split()
PLACES = "kitchen garden school park shop library station market forest beach river farm".split()
FOUND = "found lost bought painted dropped carried washed sold hid opened".split()
MOVES = "went walked ran drove".split()
SOUNDS = dict(
    pair.split(":")
    for pair in "cat:meow dog:woof bird:tweet cow:moo duck:quack frog:croak mouse:squeak sheep:baa horse:neigh "
    "owl:hoot lion:roar bee:buzz".split()
)
ANIMALS = list(SOUNDS)


def generate_corpus(seed: int = CORPUS_SEED, num_documents: int = NUM_DOCUMENTS) -> list[str]:
    """``num_documents`` lines of generated text; the same ``seed`` always gives the same lines."""
    rng = random.Random(seed)
    kinds = (_story, _story, _question, _counting, _arithmetic, _calendar, _animals, _compare, _letters, _repeat)
    return [rng.choice(kinds)(rng) for _ in range(num_documents)]


def _a(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def _join(sentences: list[str]) -> str:
    return " ".join(s + " ." if not s.endswith("?") else s for s in sentences)


def _story(rng: random.Random) -> str:
    name, color, size, obj, place = (rng.choice(x) for x in (NAMES, COLORS, SIZES, OBJECTS, PLACES))
    verb = rng.choice(FOUND)
    sentences = [
        f"{name} {rng.choice(MOVES)} to the {place}",
        f"in the {place} {name} {verb} {_a(size)} {size} {color} {obj}",
        f"the {obj} was {color}",
    ]
    if rng.random() < 0.5:
        sentences.append(f"on {rng.choice(DAYS)} {name} {rng.choice(MOVES)} to the {rng.choice(PLACES)} with the {obj}")
    sentences.append(f"then {name} went home")
    return _join(sentences)


def _question(rng: random.Random) -> str:
    name, color, obj, place = (rng.choice(x) for x in (NAMES, COLORS, OBJECTS, PLACES))
    sentences = [f"{name} has {_a(color)} {color} {obj} in the {place}"]
    asks = [
        (f"question : what color is the {obj} ?", color),
        (f"question : where is the {obj} ?", f"in the {place}"),
        (f"question : who has the {obj} ?", name),
    ]
    for ask, answer in rng.sample(asks, rng.randint(1, 3)):
        sentences += [ask, f"answer : {answer}"]
    return _join(sentences)


def _counting(rng: random.Random) -> str:
    sentences = []
    for _ in range(rng.randint(1, 3)):
        length = rng.randint(4, 10)
        if rng.random() < 0.7:
            start = rng.randint(0, len(NUMBERS) - length)
            sentences.append("counting up : " + " ".join(NUMBERS[start : start + length]))
        else:
            start = rng.randint(length - 1, len(NUMBERS) - 1)
            sentences.append("counting down : " + " ".join(NUMBERS[start - length + 1 : start + 1][::-1]))
    return _join(sentences)


def _arithmetic(rng: random.Random) -> str:
    sentences = []
    for _ in range(rng.randint(2, 5)):
        op = rng.choice(("plus", "minus", "times"))
        if op == "times":
            a = rng.randint(0, 5)
            b = rng.randint(0, 20 // max(a, 1))
            c = a * b
        else:
            x, y = rng.randint(0, 10), rng.randint(0, 10)
            a, b, c = (x, y, x + y) if op == "plus" else (x + y, y, x)
        sentences.append(f"{NUMBERS[a]} {op} {NUMBERS[b]} is {NUMBERS[c]}")
    return _join(sentences)


def _calendar(rng: random.Random) -> str:
    seq = rng.choice((DAYS, MONTHS))
    unit = "days" if seq is DAYS else "months"
    i = rng.randrange(len(seq))
    sentences = [
        f"after {seq[i]} comes {seq[(i + 1) % len(seq)]}",
        f"before {seq[i]} comes {seq[i - 1]}",
        f"the {unit} are " + " ".join(seq[(i + k) % len(seq)] for k in range(rng.randint(3, len(seq)))),
    ]
    rng.shuffle(sentences)
    return _join(sentences)


def _animals(rng: random.Random) -> str:
    sentences = []
    for animal in rng.sample(ANIMALS, rng.randint(2, 5)):
        if rng.random() < 0.7:
            sentences.append(f"the {animal} says {SOUNDS[animal]}")
        else:
            sentences.append(f"the {rng.choice(SIZES)} {animal} in the {rng.choice(PLACES)} says {SOUNDS[animal]}")
    return _join(sentences)


def _compare(rng: random.Random) -> str:
    sentences = []
    for _ in range(rng.randint(2, 4)):
        a, b = rng.sample(range(len(NUMBERS)), 2)
        word = "bigger" if a > b else "smaller"
        sentences.append(f"{NUMBERS[a]} is {word} than {NUMBERS[b]}")
    return _join(sentences)


def _letters(rng: random.Random) -> str:
    length = rng.randint(4, 12)
    start = rng.randint(0, len(LETTERS) - length - 1)
    letters = LETTERS[start : start + length + 1]
    return _join([f"the letters are {' '.join(letters[:-1])}", f"after {letters[-2]} comes {letters[-1]}"])


def _repeat(rng: random.Random) -> str:
    phrase = rng.choice(
        (
            f"the {rng.choice(SIZES)} {rng.choice(ANIMALS)} sleeps",
            f"{rng.choice(NAMES)} likes the {rng.choice(COLORS)} {rng.choice(OBJECTS)}",
            f"we go to the {rng.choice(PLACES)} on {rng.choice(DAYS)}",
        )
    )
    return "say it again : " + _join([phrase] * rng.randint(2, 4))
