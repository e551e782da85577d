"""Benchmark workloads: deterministic request plans built to exact token lengths.

A plan is a list of sessions. A session is one or more turns sent one after another (a
multi-turn conversation); single-request workloads have one-turn sessions. Prompts are made
of whole-word vocabulary entries (" word"), which re-tokenize one token per word, so a prompt
of n words is n tokens for the served model's tokenizer; a fix-up pass checks it. The
`prose` workload instead asks about passages of real text (bench/prose.py) and lets each
answer end where the model ends it.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from tokenmill.bench.prose import prose_prompt

WORKLOADS = ("decode1", "random", "shared_prefix", "multiturn", "long_interference", "prose",
             "trace")


class TextTokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...
    def vocab_words(self) -> list[str]: ...


@dataclass
class Turn:
    text: str                # the prompt (completions) or the new user message (chat)
    input_len: int           # tokens in the system text + `text` (the chat template adds more)
    output_len: int          # exact, or at most (exact_len False: the model may end sooner)
    exact_len: bool = True


@dataclass
class Session:
    turns: list[Turn]
    group: str = "main"      # reported separately when a workload has several groups
    arrival: float | None = None   # seconds after the start (trace); None: as load allows
    after_first_tokens: bool = False  # start once every other session has its first token
    system: str | None = None  # chat: a system message sent before the turns


@dataclass
class Plan:
    workload: str
    sessions: list[Session]
    concurrency: int | None          # default in-flight sessions (None: unlimited)
    chat_history: bool = False       # chat turns resend the whole conversation
    endpoint: str | None = None      # the endpoint the workload needs (None: --endpoint)
    settings: dict = field(default_factory=dict)


@dataclass
class WorkloadArgs:
    """Sizes; None means the workload's default."""
    num_requests: int | None = None
    input_len: tuple[int, int] | None = None
    output_len: tuple[int, int] | None = None
    prefix_len: int | None = None
    num_turns: int | None = None
    long_len: int | None = None
    trace: Path | None = None
    seed: int = 0


class HFTextTokenizer:
    """The served model's tokenizer: tokenizer.json through `tokenizers` (fast to load),
    else any Hugging Face tokenizer directory through transformers."""

    def __init__(self, path: Path) -> None:
        path = Path(path)
        if (path / "tokenizer.json").exists():
            from tokenizers import Tokenizer
            backend = Tokenizer.from_file(str(path / "tokenizer.json"))
        else:
            from transformers import AutoTokenizer
            backend = AutoTokenizer.from_pretrained(str(path)).backend_tokenizer
        self.backend = backend
        self._words: list[str] | None = None

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def vocab_words(self) -> list[str]:
        if self._words is None:  # decoding the whole vocabulary is worth doing once
            self._words = self._whole_words()
        return self._words

    def _whole_words(self) -> list[str]:
        words = []
        for piece, token_id in sorted(self.backend.get_vocab().items(), key=lambda kv: kv[1]):
            text = self.backend.decode([token_id])
            if len(text) >= 3 and text[0] == " " and text[1:].isascii() and text[1:].isalpha():
                words.append(text)
        return words


class TextMaker:
    """Random text of an exact token length."""

    def __init__(self, tokenizer: TextTokenizer, seed: int | str) -> None:
        self.tokenizer = tokenizer
        self.words = tokenizer.vocab_words()
        if len(self.words) < 100:
            raise ValueError("tokenizer: too few whole-word vocabulary entries to build prompts")
        self.rng = random.Random(seed)

    def text(self, num_tokens: int, prefix: str = "") -> str:
        """`prefix` followed by new words, `num_tokens` more tokens than `prefix` alone."""
        target = (len(self.tokenizer.encode(prefix)) if prefix else 0) + num_tokens
        words = [self.rng.choice(self.words) for _ in range(num_tokens)]
        for _ in range(8):  # word merges are rare; a few passes settle them
            have = len(self.tokenizer.encode(prefix + "".join(words)))
            if have == target:
                return prefix + "".join(words)
            if have > target:
                del words[target - have:]
            else:
                words += [self.rng.choice(self.words) for _ in range(target - have)]
        raise ValueError(f"could not build a prompt of exactly {num_tokens} tokens")


def parse_len(value: str) -> tuple[int, int]:
    """'128' -> (128, 128); '64:512' -> (64, 512)."""
    low, _, high = value.partition(":")
    low_n, high_n = int(low), int(high or low)
    if low_n < 1 or high_n < low_n:
        raise ValueError(f"bad length {value!r}: want N or MIN:MAX with 1 <= MIN <= MAX")
    return low_n, high_n


def _draw(rng: random.Random, bounds: tuple[int, int]) -> int:
    return rng.randint(*bounds)


def _single(name: str, args: WorkloadArgs, maker: TextMaker, defaults: tuple) -> Plan:
    num, in_len, out_len, concurrency = defaults
    in_len, out_len = args.input_len or in_len, args.output_len or out_len
    rng = random.Random(args.seed)
    sessions = []
    for _ in range(args.num_requests or num):
        n_in = _draw(rng, in_len)
        sessions.append(Session([Turn(maker.text(n_in), n_in, _draw(rng, out_len))]))
    return Plan(name, sessions, concurrency,
                settings={"input_len": list(in_len), "output_len": list(out_len)})


def _shared_prefix(args: WorkloadArgs, maker: TextMaker) -> Plan:
    prefix_len = args.prefix_len or 1024
    in_len, out_len = args.input_len or (32, 32), args.output_len or (64, 64)
    rng = random.Random(args.seed)
    prefix = maker.text(prefix_len)
    sessions = []
    for _ in range(args.num_requests or 32):
        n_in = _draw(rng, in_len)
        question = maker.text(n_in, prefix=prefix)[len(prefix):]
        # The prefix is the system message on the chat endpoint, the prompt's start otherwise.
        sessions.append(Session([Turn(question, prefix_len + n_in, _draw(rng, out_len))],
                                system=prefix))
    return Plan("shared_prefix", sessions, 16, settings={
        "prefix_len": prefix_len, "input_len": list(in_len), "output_len": list(out_len)})


def _multiturn(args: WorkloadArgs, maker: TextMaker) -> Plan:
    num_turns = args.num_turns or 4
    in_len, out_len = args.input_len or (64, 64), args.output_len or (64, 64)
    rng = random.Random(args.seed)
    sessions = []
    for _ in range(args.num_requests or 8):
        turns = []
        for _ in range(num_turns):
            n_in = _draw(rng, in_len)
            turns.append(Turn(maker.text(n_in), n_in, _draw(rng, out_len)))
        sessions.append(Session(turns))
    return Plan("multiturn", sessions, 8, chat_history=True, settings={
        "num_conversations": len(sessions), "num_turns": num_turns,
        "input_len": list(in_len), "output_len": list(out_len)})


def _prose(args: WorkloadArgs, maker: TextMaker) -> Plan:
    in_len, out_len = args.input_len or (64, 512), args.output_len or (256, 256)
    rng = random.Random(args.seed)
    sessions = []
    for _ in range(args.num_requests or 32):
        text = prose_prompt(maker.tokenizer, rng, _draw(rng, in_len))
        sessions.append(Session([Turn(text, len(maker.tokenizer.encode(text)),
                                      _draw(rng, out_len), exact_len=False)]))
    return Plan("prose", sessions, 16, endpoint="chat", settings={
        "input_len": list(in_len), "output_len": list(out_len), "exact_output_len": False})


LONG_OUTPUT_LEN = 16  # the long prompt only needs to show its TTFT


def _long_interference(args: WorkloadArgs, maker: TextMaker) -> Plan:
    in_len, out_len = args.input_len or (128, 128), args.output_len or (256, 256)
    long_len = args.long_len or 3000
    rng = random.Random(args.seed)
    sessions = []
    for _ in range(args.num_requests or 8):
        n_in = _draw(rng, in_len)
        sessions.append(Session([Turn(maker.text(n_in), n_in, _draw(rng, out_len))],
                                group="stream"))
    # Arrives while every stream is decoding: its prefill is what the streams must survive.
    sessions.append(Session([Turn(maker.text(long_len), long_len, LONG_OUTPUT_LEN)],
                            group="long", after_first_tokens=True))
    return Plan("long_interference", sessions, None, settings={
        "num_streams": len(sessions) - 1, "long_len": long_len,
        "input_len": list(in_len), "output_len": list(out_len)})


def _trace(args: WorkloadArgs, maker: TextMaker) -> Plan:
    """JSONL: {"prompt": str | "prompt_len": int, "output_len": int, "arrival_time": s}."""
    if args.trace is None:
        raise ValueError("workload trace: --trace FILE is required")
    sessions = []
    for number, line in enumerate(Path(args.trace).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
            prompt = entry.get("prompt")
            text = prompt if prompt is not None else maker.text(int(entry["prompt_len"]))
            turn = Turn(text, len(maker.tokenizer.encode(text)), int(entry["output_len"]))
            arrival = float(entry.get("arrival_time", entry.get("timestamp", 0.0)))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{args.trace}:{number}: bad trace entry: {exc}") from exc
        sessions.append(Session([turn], arrival=arrival))
    sessions.sort(key=lambda s: s.arrival)
    if args.num_requests:
        sessions = sessions[:args.num_requests]
    start = sessions[0].arrival if sessions else 0.0
    for session in sessions:
        session.arrival -= start
    return Plan("trace", sessions, None, settings={"trace": str(args.trace)})


def build_plan(name: str, args: WorkloadArgs, tokenizer: TextTokenizer) -> Plan:
    """The request plan of workload `name`, deterministic for a given seed."""
    # Words drawn per workload: with the seed alone, decode1 sent long_interference's stream
    # prompts (both 128 tokens), and a server that had run one found the other 87.5% cached.
    maker = TextMaker(tokenizer, f"{name}:{args.seed}")
    if name == "decode1":
        return _single(name, args, maker, (8, (128, 128), (128, 128), 1))
    if name == "random":
        return _single(name, args, maker, (32, (64, 512), (64, 256), 16))
    if name == "shared_prefix":
        return _shared_prefix(args, maker)
    if name == "multiturn":
        return _multiturn(args, maker)
    if name == "long_interference":
        return _long_interference(args, maker)
    if name == "prose":
        return _prose(args, maker)
    if name == "trace":
        return _trace(args, maker)
    raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
