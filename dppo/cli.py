"""`dppo train [--config FILE] [key=value ...]`: the command-line entry point (console script `dppo`)."""

from __future__ import annotations

import argparse
import sys
import textwrap

USAGE_EXAMPLES = """\
examples:
  dppo train                                        # the demo: separate-async Decoupled PPO on `copy`
  dppo train trainer.mode=sync trainer.total_steps=20
  dppo train algorithm.rollout_correction.bypass_mode=true trainer.output_dir=outputs/bypass
  dppo train trainer.resume=true                    # continue from the latest checkpoint
  dppo train ray.address=auto                       # run on an existing Ray cluster
"""


def config_help() -> str:
    """Every config key with its default and its doc, grouped by section."""
    from dppo.trainer.config import describe

    lines = ["config keys (default; override as key=value):"]
    section = None
    for key, default, doc in describe():
        head = key.split(".")[0]
        if head != section:
            section = head
            lines.append(f"\n  {head}:")
        value = "null" if default is None else str(default).lower() if isinstance(default, bool) else str(default)
        lines.append(f"    {key} = {value}")
        lines.extend(textwrap.wrap(doc, width=96, initial_indent="        ", subsequent_indent="        "))
    return "\n".join(lines)


class _HelpAction(argparse.Action):
    """--help that prints the config table too (importing the config only when asked)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        parser.print_help()
        print()
        print(config_help())
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dppo", description="Decoupled PPO for asynchronous RL on language models.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.required = True
    train = commands.add_parser(
        "train",
        help="train a policy (the README's main command)",
        description="Train with Decoupled PPO; writes metrics.jsonl, a plot, a summary and checkpoints.",
        epilog=USAGE_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        add_help=False,
    )
    train.add_argument("-h", "--help", action=_HelpAction, help="show this help and every config key, then exit")
    train.add_argument("--config", metavar="FILE", help="YAML file of overrides, applied before key=value ones")
    train.add_argument("--show-config", action="store_true", help="print the resolved config and exit")
    train.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. trainer.total_steps=20")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from dppo.trainer.config import ConfigError, load_config, to_yaml

    try:
        cfg = load_config(args.overrides, config_file=args.config)
    except ConfigError as err:
        print(f"dppo: error: {err}", file=sys.stderr)
        return 2
    if args.show_config:
        print(to_yaml(cfg), end="")
        return 0
    from dppo.train import run
    from dppo.trainer.rollout_source import RayConnectError

    try:
        run(cfg)
    except RayConnectError as err:  # a setup problem, not a bug: one line, no traceback
        print(f"dppo: error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
