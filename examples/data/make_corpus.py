"""Generate the quickstart corpus: short, simple, English-like stories, one JSON object per line.

Every word and template below was written for this project (no third-party text). The language is
small and regular (a few dozen words, fixed sentence shapes, agreement, counting and sums), so a
tiny GPT's loss falls quickly and visibly. Deterministic: the same seed gives the same bytes.

    python examples/data/make_corpus.py                       # writes examples/data/corpus.jsonl
    python examples/data/make_corpus.py --docs 200 --output /tmp/small.jsonl
"""
from __future__ import annotations

import argparse
import json
import os
import random

NAMES = ["Ada", "Ben", "Cleo", "Dev", "Edda", "Finn", "Gus", "Hana", "Ivo", "Juno", "Kai", "Lena"]
ANIMALS = ["cat", "dog", "fox", "owl", "hen", "goat", "frog", "bear", "duck", "mole"]
COLOURS = ["red", "blue", "green", "yellow", "brown", "white", "black", "grey"]
SIZES = ["small", "big", "tiny", "tall", "round", "long"]
PLACES = ["the barn", "the river", "the hill", "the garden", "the market", "the forest",
          "the school", "the bridge", "the lake", "the old mill"]
THINGS = ["apple", "ball", "book", "cup", "hat", "kite", "lamp", "map", "pear", "shoe"]
VERBS = [("sees", "saw"), ("finds", "found"), ("likes", "liked"), ("takes", "took"),
         ("paints", "painted"), ("carries", "carried"), ("hides", "hid"), ("wants", "wanted")]
WEATHER = ["sunny", "rainy", "windy", "cold", "warm", "cloudy"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
NUMBERS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
           "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen",
           "eighteen"]


def plural(noun: str, count: int) -> str:
    return noun if count == 1 else noun + ("es" if noun.endswith(("s", "x", "sh", "ch")) else "s")


def thing_phrase(rng: random.Random) -> str:
    return f"the {rng.choice(COLOURS)} {rng.choice(THINGS)}"


def story(rng: random.Random) -> str:
    """A few sentences about one character, keeping who, where and when consistent."""
    name, animal, place = rng.choice(NAMES), rng.choice(ANIMALS), rng.choice(PLACES)
    day, size = rng.choice(DAYS), rng.choice(SIZES)
    sentences = [f"On {day} {name} went to {place}.",
                 f"It was {rng.choice(WEATHER)} at {place}.",
                 f"{name} had a {size} {animal}."]
    for _ in range(rng.randint(2, 5)):
        present, past = rng.choice(VERBS)
        kind = rng.randrange(4)
        if kind == 0:
            sentences.append(f"The {animal} {present} {thing_phrase(rng)}.")
        elif kind == 1:
            sentences.append(f"{name} {past} {thing_phrase(rng)} near {place}.")
        elif kind == 2:
            count = rng.randint(1, 9)
            thing = rng.choice(THINGS)
            sentences.append(f"There {'is' if count == 1 else 'are'} {NUMBERS[count]} "
                             f"{plural(thing, count)} in the {rng.choice(SIZES)} box.")
        else:
            a, b = rng.randint(0, 9), rng.randint(0, 9)
            sentences.append(f"{name} said that {NUMBERS[a]} plus {NUMBERS[b]} is "
                             f"{NUMBERS[a + b]}.")
    sentences.append(f"At night the {animal} slept and {name} went home.")
    return " ".join(sentences)


def generate(num_docs: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"id": i, "text": story(rng)} for i in range(num_docs)]


def main() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--docs", type=int, default=1500, help="number of stories")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--output", default=os.path.join(here, "corpus.jsonl"))
    args = parser.parse_args()
    with open(args.output, "w", encoding="utf-8") as out:
        for record in generate(args.docs, args.seed):
            out.write(json.dumps(record) + "\n")
    print(f"wrote {args.docs} documents, {os.path.getsize(args.output)} bytes to {args.output}")


if __name__ == "__main__":
    main()
