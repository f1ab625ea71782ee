"""The ``tidepool`` command: one subcommand per task, each defined next to the code it drives."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from engine.capacity import add_kv_calc_parser
from engine.generate import add_generate_parser
from loadtest.cli import add_bench_parser
from router.sim_cli import add_simulate_parser
from services.config import add_serve_arguments, configs_from_args
from services.profile_cli import add_profile_parser
from services.scale_cli import add_scale_parser
from services.status import add_status_parser


def _serve(args: argparse.Namespace) -> int:
    from engine.config import UnsupportedModelError
    from engine.errors import CheckpointError, LoRAAdapterError
    from services.errors import PlacementError
    from services.serve import Server

    try:
        cluster, gateway = configs_from_args(args)
    except ValueError as exc:
        print(f"tidepool serve: {exc}", file=sys.stderr)
        return 2

    async def run() -> None:
        server = Server(cluster, gateway)
        try:
            await server.start()
        except PlacementError as exc:
            raise SystemExit(f"tidepool serve: {exc}") from None
        except LoRAAdapterError as exc:
            raise SystemExit(f"tidepool serve: --lora-modules: {exc}") from None
        except (CheckpointError, UnsupportedModelError) as exc:
            raise SystemExit(f"tidepool serve: --model {cluster.engine.model}: {exc}") from None
        except (OSError, ValueError) as exc:  # e.g. --http-port taken, --max-model-len past the model's context
            raise SystemExit(f"tidepool serve: {exc}") from None
        print(server.cluster.describe_placement(), flush=True)
        print(f"tidepool: serving {server.cluster.dispatcher.served_model_names[0]} on {server.http_url} (OpenAI HTTP) "
              f"and {server.grpc_target} (gRPC); Ctrl-C stops", flush=True)
        await server.serve_until_stopped()
        print("tidepool: stopped", flush=True)

    asyncio.run(run())
    return 0


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="start the cluster and its HTTP + gRPC gateways",
                       description="Start the prefill/decode workers, the router and the OpenAI HTTP + gRPC "
                                   "gateways; Ctrl-C or SIGTERM stops everything.")
    add_serve_arguments(p)
    p.set_defaults(func=_serve)


# Each command's parser is defined next to the code it drives.
_ADD_COMMAND = {"serve": add_serve_parser, "generate": add_generate_parser, "kv-calc": add_kv_calc_parser,
                "simulate": add_simulate_parser, "bench": add_bench_parser, "status": add_status_parser,
                "profile": add_profile_parser, "scale": add_scale_parser}
COMMANDS = tuple(_ADD_COMMAND)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's help ends with its default, except where the default is None: there the help says
    what happens instead (a printed "None" would tell a user nothing)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is argparse.SUPPRESS:
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tidepool", description="Disaggregated prefill/decode LLM serving")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join(COMMANDS) + "}")
    for name, add in _ADD_COMMAND.items():
        add(sub)
        sub.choices[name].formatter_class = HelpFormatter  # one help style for every command
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
        # argparse would only say that a command is required, not which word it could not use
        parser.error(f"unrecognized option {argv[0]!r}: give a command first ({', '.join(COMMANDS)})")
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
