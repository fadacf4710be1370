"""The app's commands, none of which starts Ray but `serve` (through `serve run`).

    python -m deploy check serve_config.yaml   # the config's args, base model and local adapters, in seconds
    python -m deploy serve serve_config.yaml   # check, free the ports, `serve run`, and a line once it answers
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m deploy", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    for name, text in (("check", "check a serve config before Ray starts: exit 1 with one line per problem"),
                       ("serve", "check the config, free its ports, then `serve run` it (what `make serve` runs)")):
        command = commands.add_parser(name, help=text, description=text)
        command.add_argument("config", type=Path, nargs="?", default=Path("serve_config.yaml"),
                             help="a serve config (default: serve_config.yaml)")
    args = parser.parse_args(argv)
    if args.command == "check":
        from deploy.check import ConfigProblem, check_file

        try:
            checked = check_file(args.config)
        except ConfigProblem as e:
            print(f"{args.config}: problems found\n{e}", file=sys.stderr)
            return 1
        print(f"{args.config}: ok ({len(checked)} application{'s' if len(checked) > 1 else ''})")
        return 0
    from deploy.start import serve

    return serve(args.config)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
