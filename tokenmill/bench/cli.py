"""`tokenmill bench ...` subcommands."""

from __future__ import annotations

import argparse
from pathlib import Path

from tokenmill.cli_args import add_engine_args, engine_config


def add_bench_parser(commands) -> None:
    bench = commands.add_parser("bench", help="benchmarks")
    kinds = bench.add_subparsers(dest="bench_command", required=True)
    offline = kinds.add_parser("offline", help="offline throughput: random prompts, no server")
    offline.add_argument("--num-prompts", type=int, default=64)
    offline.add_argument("--input-len-min", type=int, default=64)
    offline.add_argument("--input-len-max", type=int, default=512)
    offline.add_argument("--output-len", type=int, default=128)
    offline.add_argument("--prefix-len", type=int, default=0,
                         help="tokens of a random prefix every prompt shares (a system prompt)")
    offline.add_argument("--seed", type=int, default=0, help="prompt generator seed")
    offline.add_argument("--json", type=Path, default=None,
                         help="append the result as one JSON line to this file")
    add_engine_args(offline, skip=("seed",))
    offline.set_defaults(run=_run_offline)
    from tokenmill.bench.serve_cli import add_serve_bench_parsers
    add_serve_bench_parsers(kinds)


def _run_offline(args: argparse.Namespace) -> int:
    from tokenmill.bench.offline import print_result, run_offline, write_json
    result = run_offline(engine_config(args), args.num_prompts, args.input_len_min,
                         args.input_len_max, args.output_len, args.seed, args.prefix_len)
    print_result(result)
    if args.json:
        write_json(result, args.json)
    return 0
