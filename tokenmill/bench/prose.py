"""Natural prompts for the `prose` workload: passages of the Python documentation that ships
with CPython (`pydoc_data.topics`), each with a task a chat user might set about it.

The other workloads' prompts are random vocabulary words, on which a small model soon repeats
itself: that flatters speculative decoding's n-gram drafts. Prose, with the answer ending
where the model ends it, shows how many drafts ordinary requests keep. The passages come with
the interpreter, so a plan is the same on every machine with the same Python minor version.
"""

from __future__ import annotations

import functools
import random
import re
from typing import Protocol

TASKS = (
    "Summarize the following passage from the Python documentation in a few sentences.",
    "Explain the following passage from the Python documentation to a beginner.",
    "List the key points of the following passage from the Python documentation.",
    "Write a short Python example that illustrates the following passage.",
    "Ask two questions a student might have about the following passage, and answer them.",
)


class Encoder(Protocol):
    def encode(self, text: str) -> list[int]: ...


@functools.cache
def _pieces() -> tuple[list[str], list[int]]:
    """Every paragraph of the documentation topics, cut into words that keep the whitespace
    after them (so any run of them joins back into the original text), and the index of each
    paragraph's first word."""
    from pydoc_data.topics import topics
    pieces, starts = [], []
    for key in sorted(topics):
        for paragraph in re.split(r"\n\s*\n", topics[key]):
            words = re.findall(r"\S+\s*", paragraph.strip())
            if words:
                words[-1] = words[-1].rstrip() + "\n\n"
                starts.append(len(pieces))
                pieces += words
    return pieces, starts


def prose_prompt(tokenizer: Encoder, rng: random.Random, max_tokens: int) -> str:
    """A task and a passage from the docs starting at a random paragraph: the longest such
    prompt of at most `max_tokens` tokens."""
    task = rng.choice(TASKS) + "\n\n"
    if len(tokenizer.encode(task)) + 8 > max_tokens:
        raise ValueError(f"input length {max_tokens}: too short for a prose prompt (need "
                         f"{len(tokenizer.encode(task)) + 8} tokens or more)")
    pieces, starts = _pieces()
    index = rng.randrange(len(starts))

    def fits(count: int) -> bool:
        return len(tokenizer.encode(task + "".join(window[:count]).rstrip())) <= max_tokens

    # from the drawn paragraph on, the first whose first word fits (a long code line may not)
    for offset in range(len(starts)):
        start = starts[(index + offset) % len(starts)]
        window = [pieces[(start + i) % len(pieces)] for i in range(max_tokens)]
        if fits(1):
            break
    else:
        raise ValueError(f"input length {max_tokens}: no passage of the docs fits")
    low, high = 1, len(window)        # each word is a token or more: find the longest fit
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if fits(middle) else (low, middle - 1)
    return task + "".join(window[:low]).rstrip()
