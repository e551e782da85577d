"""`tokenmill bench serve | sweep | plot | compare`: flags and their small drivers."""

from __future__ import annotations

import argparse
import sys
from datetime import datetime, timezone
from pathlib import Path

from tokenmill.bench.workloads import WORKLOADS, WorkloadArgs, parse_len


def _length(value: str) -> tuple[int, int]:
    try:
        return parse_len(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _positive(value: str) -> float:
    try:
        number = float(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"want a number: {exc}") from exc
    if not number > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return number


def _numbers(kind):
    def parse(value: str) -> list:
        try:
            return [kind(v) for v in value.split(",") if v.strip()]
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"want a comma-separated list: {exc}") from exc
    return parse


def _add_target_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server's root URL")
    p.add_argument("--model", default=None, help="model name to send (default: first of "
                   "GET /v1/models)")
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions",
                   help="multiturn always uses chat")
    p.add_argument("--label", default="tokenmill", help="engine label stored with the results")
    p.add_argument("--tokenizer", type=Path, default=None, help="the served model's Hugging "
                   "Face tokenizer directory (default: tokenmill's default model's)")
    p.add_argument("--timeout", type=float, default=900.0, help="per-request timeout (s)")


def _add_workload_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", choices=WORKLOADS, default="random")
    p.add_argument("--trace", type=Path, default=None, help="JSONL trace for --workload trace")
    p.add_argument("--num-requests", type=int, default=None, help="requests (multiturn: "
                   "conversations; long_interference: decoding streams)")
    p.add_argument("--input-len", type=_length, default=None, help="N or MIN:MAX prompt tokens "
                   "(shared_prefix: the question; multiturn: each new message)")
    p.add_argument("--output-len", type=_length, default=None, help="N or MIN:MAX output tokens")
    p.add_argument("--prefix-len", type=int, default=None, help="shared_prefix: system prompt")
    p.add_argument("--num-turns", type=int, default=None, help="multiturn: turns per "
                   "conversation")
    p.add_argument("--long-len", type=int, default=None, help="long_interference: the long "
                   "prompt's tokens")
    p.add_argument("--seed", type=int, default=0)


def _add_run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--warmup", type=int, default=2, help="requests sent first, not counted")
    p.add_argument("--max-duration", type=float, default=None,
                   help="seconds; then no new requests and the ones in flight are cut off")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--slo-ttft-ms", type=float, default=None, help="goodput: TTFT limit")
    p.add_argument("--slo-tpot-ms", type=float, default=None, help="goodput: TPOT limit")
    p.add_argument("--save-requests", type=Path, default=None, help="append one JSON line per "
                   "request here: its session and turn, start, token counts, TTFT, TPOT, E2E, "
                   "every inter-token gap, status and error")


def _add_utilization_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--peak-gflops", type=_positive, default=None, help="this machine's fp32 GEMM "
                   "peak (`tokenmill bench peak`): the result gets the run's model-FLOPs "
                   "utilization")
    p.add_argument("--peak-gbps", type=_positive, default=None, help="its copy bandwidth "
                   "(`tokenmill bench peak`): at concurrency 1 the result also gets the "
                   "memory-bandwidth utilization")
    p.add_argument("--model-shapes", default=None, help="the served model (a known name, a .gguf "
                   "file or a Hugging Face directory) whose shapes give the FLOPs and bytes of "
                   "a token (default: tokenmill's default model)")
    p.add_argument("--weight-bytes", type=_positive, default=None, help="bytes of weights a lone "
                   "stream reads per token (default: 4 per weight, fp32)")


def add_serve_bench_parsers(kinds) -> None:
    serve = kinds.add_parser("serve", help="load-test a running OpenAI-compatible server")
    for add in (_add_target_args, _add_workload_args, _add_run_args, _add_utilization_args):
        add(serve)
    serve.add_argument("--concurrency", type=int, default=None,
                       help="in-flight requests (default: the workload's)")
    serve.add_argument("--request-rate", type=float, default=None,
                       help="Poisson arrivals per second instead of a fixed concurrency")
    serve.add_argument("--results", type=Path, default=None, help="append a JSON line here")
    serve.set_defaults(run=_run_serve)

    sweep = kinds.add_parser("sweep", help="one workload at several concurrencies or rates")
    for add in (_add_target_args, _add_workload_args, _add_run_args, _add_utilization_args):
        add(sweep)
    loads = sweep.add_mutually_exclusive_group(required=True)
    loads.add_argument("--concurrencies", type=_numbers(int), help="e.g. 1,4,16")
    loads.add_argument("--request-rates", type=_numbers(float), help="e.g. 0.5,1,2")
    sweep.add_argument("--results", type=Path, default=Path("bench-results.jsonl"))
    sweep.add_argument("--plot", type=Path, default=None,
                       help="PNG path (default: the results file with .png)")
    sweep.set_defaults(run=_run_sweep)

    plot = kinds.add_parser("plot", help="throughput-latency PNG from result files")
    plot.add_argument("results", type=Path, nargs="+")
    plot.add_argument("--out", type=Path, required=True)
    plot.add_argument("--workload", default=None, help="only this workload")
    plot.set_defaults(run=_run_plot)

    compare = kinds.add_parser("compare", help="side-by-side table with ratios to a baseline")
    compare.add_argument("results", type=Path, nargs="+")
    compare.add_argument("--baseline", required=True, help="the label the ratios divide by")
    compare.set_defaults(run=_run_compare)

    peak = kinds.add_parser("peak", help="this machine's fp32 GEMM peak and copy bandwidth")
    peak.add_argument("--rounds", type=int, default=10, help="timed runs of each, the best kept")
    peak.add_argument("--json", type=Path, default=None, help="append the figures as a JSON line")
    peak.set_defaults(run=_run_peak)


def _settings(args: argparse.Namespace, concurrency: int | None, rate: float | None,
              extra: dict):
    from tokenmill.bench.serve import BenchSettings
    from tokenmill.bench.utilization import Ceilings, model_cost
    sizes = WorkloadArgs(args.num_requests, args.input_len, args.output_len, args.prefix_len,
                         args.num_turns, args.long_len, args.trace, args.seed)
    ceilings = cost = None
    if args.peak_gflops or args.peak_gbps:
        ceilings = Ceilings(args.peak_gflops, args.peak_gbps)
        try:
            cost = model_cost(args.model_shapes)
        except ValueError as exc:
            raise ValueError(f"--model-shapes: {exc}") from exc
    return BenchSettings(args.base_url, args.workload, args.model, args.endpoint, args.label,
                         concurrency, rate, args.warmup, args.max_duration, args.temperature,
                         args.slo_ttft_ms, args.slo_tpot_ms, args.timeout, sizes, extra,
                         args.save_requests, ceilings, cost, args.weight_bytes)


def _bench_once(args: argparse.Namespace, tokenizer, concurrency, rate, extra) -> dict:
    from tokenmill.bench.report import append_result, format_table
    from tokenmill.bench.serve import run_bench
    result = run_bench(_settings(args, concurrency, rate, extra), tokenizer)
    print(format_table(result), flush=True)
    if args.results:
        append_result(result, args.results)
    return result


def _run_serve(args: argparse.Namespace) -> int:
    from tokenmill.bench.serve import load_tokenizer
    tokenizer = load_tokenizer(args.tokenizer)
    try:
        result = _bench_once(args, tokenizer, args.concurrency, args.request_rate, {})
    except (RuntimeError, ValueError) as exc:
        print(f"tokenmill bench serve: {exc}", file=sys.stderr)
        return 2
    return 0 if result["num_failed"] == 0 else 1


def _run_sweep(args: argparse.Namespace) -> int:
    from tokenmill.bench.plot import plot_results
    from tokenmill.bench.report import load_results
    from tokenmill.bench.serve import load_tokenizer
    tokenizer = load_tokenizer(args.tokenizer)
    sweep_id = f"{args.label}/{args.workload}/{datetime.now(timezone.utc).isoformat()}"
    loads = ([(c, None) for c in args.concurrencies] if args.concurrencies
             else [(None, r) for r in args.request_rates])
    failed = 0
    try:
        for concurrency, rate in loads:
            result = _bench_once(args, tokenizer, concurrency, rate, {"sweep_id": sweep_id})
            failed += result["num_failed"]
            print()
    except (RuntimeError, ValueError) as exc:
        print(f"tokenmill bench sweep: {exc}", file=sys.stderr)
        return 2
    out = plot_results(load_results([args.results]), args.plot or
                       args.results.with_suffix(".png"), args.workload)
    print(f"plot: {out}")
    return 0 if failed == 0 else 1


def _run_plot(args: argparse.Namespace) -> int:
    from tokenmill.bench.plot import plot_results
    from tokenmill.bench.report import load_results
    print(f"plot: {plot_results(load_results(args.results), args.out, args.workload)}")
    return 0


def _run_peak(args: argparse.Namespace) -> int:
    from tokenmill.bench.report import append_result
    from tokenmill.bench.utilization import measure_ceilings
    if args.rounds < 1:
        print(f"tokenmill bench peak: --rounds must be >= 1, got {args.rounds}", file=sys.stderr)
        return 2
    figures = measure_ceilings(args.rounds)
    figures["date"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    print(f"fp32 GEMM peak: {figures['gemm_gflops']:.1f} GFLOP/s ({figures['gemm_shape']}, "
          f"{figures['threads']} threads); copy: {figures['copy_gbps']:.1f} GB/s (read + "
          "written)")
    if args.json:
        append_result(figures, args.json)
    return 0


def _run_compare(args: argparse.Namespace) -> int:
    from tokenmill.bench.report import compare_table, load_results
    try:
        print(compare_table(load_results(args.results), args.baseline))
    except ValueError as exc:
        print(f"tokenmill bench compare: {exc}", file=sys.stderr)
        return 2
    return 0
