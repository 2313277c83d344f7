"""The command-line entry point (console script `dppo`): it parses, runs, and maps errors to one line and an exit code.

dppo train [--config FILE] [key=value ...]            train (dppo.launch.run)
dppo export CHECKPOINT_DIR OUT_DIR                     a checkpoint as a transformers directory (dppo.checkpoint.export)
dppo eval MODEL_DIR_OR_CHECKPOINT [key=value ...]      evaluate as training does (dppo.trainer.evaluation)
dppo import-gguf SRC.gguf OUT_DIR [--dtype D]          a GGUF model file as a transformers directory
                                                       (dppo.commands.import_gguf)
dppo data reasoning-gym NAME OUT.parquet [--size N]    a reasoning-gym dataset as verl-format parquet
                                                       (dppo.commands.data)
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import textwrap
import traceback

from dppo._text import one_line
from dppo.stopping import StopOnSignal

USAGE_EXAMPLES = """\
examples:
  dppo train                                        # the demo: separate-async Decoupled PPO on `copy`
  dppo train trainer.mode=sync trainer.total_steps=20
  dppo train algorithm.rollout_correction.bypass_mode=true trainer.output_dir=outputs/bypass
  dppo train trainer.resume=true                    # continue from the newest valid checkpoint
  dppo train ray.address=auto                       # run on an existing Ray cluster
"""


# Exit codes of `dppo train`: one per kind of error of its own (each printed as one line, `dppo: error: ...`).
EXIT_CODES = (
    (0, "the run finished (a checkpoint that could not be written is a warning line; the run goes on)"),
    (
        1,
        "the rollout failed beyond recovery (the replay buffer died, a worker died or was killed for memory more "
        "often than rollout.max_restarts allows, or a worker raised (your reward function, say) or its reward call "
        "ran past custom_reward_function.timeout_s); the trainer's state was checkpointed first. Or an actor rank "
        "died: its shards are lost, so the line names the rank, its node and the last checkpoint",
    ),
    (
        2,
        "invalid config: an unknown key, a wrong type or value, an impossible combination, or more than this "
        "machine or cluster has (CPUs, memory for the model, nodes or GPUs for the actor's ranks and the rollout's "
        "GPU workers); or an optional package the run or command needs is not installed (the line names the extra: "
        "dppo[gguf], dppo[tasks]); or a LoRA checkpoint (trainer.resume=true, dppo export, dppo eval) met a base "
        "model other than the one its adapter was trained on (the line names both weights' hashes)",
    ),
    (
        3,
        "trainer.output_dir cannot be created or written, or two checkpoints in a row could not be written there "
        "(full disk, quota, permissions, I/O error; the line says which, with the free and the needed bytes); "
        "dppo import-gguf and dppo data: the output exists (without --force) or cannot be written",
    ),
    (
        4,
        "trainer.resume=true found checkpoints but none it can use (a warning line names each one skipped), or "
        "the run's checkpoint ledger is unreadable; dppo export and dppo eval: the checkpoint is not trusted; dppo "
        "replay: the run's schedule.jsonl is missing or damaged, or the replay stopped following it (the line names "
        "the step and the trigger)",
    ),
    (5, "the Ray cluster of ray.address or RAY_ADDRESS cannot be joined"),
    (
        6,
        "the data cannot be used: a data file that is missing or damaged, a column or row, the tokenizer of "
        "model.path, or the reward function (it raised, returned no finite score or ran past "
        "custom_reward_function.timeout_s in this process; on a Ray worker that ends the rollout, code 1, same line), "
        "or gives no group to learn from (algorithm.filter_groups without max_num_gen_batches kept none of 10 "
        "mini-batches' worth: a constant reward; checkpointed first); "
        "dppo import-gguf: SRC is missing, a directory, not a GGUF file, or a GGUF that transformers cannot load as "
        "a causal LM",
    ),
    (
        7,
        "dppo replay without overrides: the replay did not end where the run did (its weights or its metrics differ; "
        "the lines before say where first)",
    ),
    (70, "an unexpected error: a bug, or an exception in your own code (its traceback is printed)"),
    (130, "stopped by SIGINT (Ctrl-C); checkpoints already written are kept"),
    (141, "stdout was closed by its reader (--help piped into head, say); nothing else happened"),
    (143, "stopped by SIGTERM; checkpoints already written are kept"),
)


def exit_code_help() -> str:
    lines = ["exit codes (errors print one line; --debug or DPPO_DEBUG=1 adds the traceback):"]
    for code, what in EXIT_CODES:
        lines.extend(textwrap.wrap(what, width=96, initial_indent=f"  {code:>3}  ", subsequent_indent=" " * 7))
    return "\n".join(lines)


def _error_exit_codes() -> tuple:
    """(exception class, exit code) of every error dppo reports in one line."""
    # Imported when an error is being reported, not at start-up: the driver's modules pull in torch and Ray
    # (seconds), which `dppo --help` does not need.
    from dppo.commands.import_gguf import GGUFError
    from dppo.commands.output import OutputPathError
    from dppo.config import ConfigError
    from dppo.data import DataError, MissingExtraError
    from dppo.checkpoint.store import CheckpointError
    from dppo.trainer.placement import PlacementError
    from dppo.checkpoint.failure import CheckpointWriteError
    from dppo.launch.preflight import OutputDirError
    from dppo.launch.ray_cluster import RayConnectError
    from dppo.lora import LoraError
    from dppo.trainer.rollout import RolloutFailedError
    from dppo._errors import RankDiedError
    from dppo.trainer.schedule import ScheduleError

    return (
        (RolloutFailedError, 1),
        (RankDiedError, 1),
        (ConfigError, 2),
        (LoraError, 2),  # model.target_modules naming a module the model lacks: the plan's count finds it
        (PlacementError, 2),
        (MissingExtraError, 2),
        (OutputDirError, 3),
        (OutputPathError, 3),
        (CheckpointWriteError, 3),
        (CheckpointError, 4),
        (ScheduleError, 4),
        (RayConnectError, 5),
        (DataError, 6),
        (GGUFError, 6),
    )


def config_help() -> str:
    """Every config key with its default and its doc, grouped by section."""
    from dppo.config import describe  # imported when asked: the schema pulls in torch (seconds)

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
        print(exit_code_help())
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
    train.add_argument("--debug", action="store_true", help="print the traceback of errors too (also: DPPO_DEBUG=1)")
    train.add_argument(
        "overrides", nargs="*", metavar="key=value", help="config overrides, e.g. trainer.total_steps=20"
    )
    export = commands.add_parser(
        "export",
        help="write a checkpoint's policy as a transformers model directory",
        description="Verify a checkpoint as trainer.resume does and write its policy (any world size) as a transformers "
        "model directory: config.json, model.safetensors, generation_config.json and the tokenizer. No Ray, no GPU.",
    )
    export.add_argument("checkpoint", metavar="CHECKPOINT_DIR", help="e.g. outputs/dppo/checkpoints/step_00000060")
    export.add_argument("out_dir", metavar="OUT_DIR", help="the transformers directory to write (replaced whole)")
    export.add_argument("--debug", action="store_true", help="print the traceback of errors too (also: DPPO_DEBUG=1)")
    evaluate = commands.add_parser(
        "eval",
        help="score a model directory or a checkpoint on the evaluation prompts, as training does",
        description="Greedy decoding (rollout.n=K: K samples per prompt at rollout.temperature) on the run's "
        "evaluation prompts: a task's held-out prompts (eval/*) or data.val_files (val/score/<data_source>), scored "
        "as in training. Prints a table and writes JSON.",
        epilog="examples:\n  dppo eval outputs/dppo/hf_model --config outputs/dppo/config.yaml\n"
        "  dppo eval outputs/dppo/checkpoints/step_00000060\n"
        "  dppo eval outputs/text/hf_model data.val_files=val.parquet custom_reward_function.path=reward.py\n",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    evaluate.add_argument("target", metavar="MODEL_DIR_OR_CHECKPOINT", help="a transformers directory or a checkpoint")
    evaluate.add_argument("--config", metavar="FILE", help="YAML file of overrides (e.g. the run's config.yaml)")
    evaluate.add_argument("--out", metavar="FILE", help="where the JSON goes (default: trainer.output_dir/eval.json)")
    evaluate.add_argument("--debug", action="store_true", help="print the traceback of errors too (also: DPPO_DEBUG=1)")
    evaluate.add_argument(
        "overrides", nargs="*", metavar="key=value", help="config overrides, e.g. data.val_files=v.parquet"
    )
    _add_replay(commands)
    _add_import_gguf(commands)
    _add_data(commands)
    return parser


def _add_replay(commands) -> None:
    replay = commands.add_parser(
        "replay",
        help="train again along a run's recorded schedule, bitwise, or re-train its samples under another loss",
        description="Re-run a run (its config.yaml) with a rollout that follows its schedule.jsonl: every ticket "
        "generated with its recorded version, seed and mid-ticket switches, every group taken at its recorded "
        "trigger; then compare the final weights and metrics.jsonl with the run's (exit code 7 if they differ and "
        "no key=value was given). --samples trains on the run's stored samples instead (trainer.record_samples=true), "
        "so key=value overrides of the loss re-train exactly the same data. docs/replay.md.",
        epilog="examples:\n  dppo replay outputs/dppo\n  dppo replay outputs/dppo --until 30 --out /tmp/at30\n"
        "  dppo replay outputs/dppo --samples actor.policy_loss.loss_mode=vanilla algorithm.prox_logp_method=bypass\n",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    replay.add_argument("run_dir", metavar="RUN_DIR", help="a run's trainer.output_dir (schedule.jsonl, config.yaml)")
    replay.add_argument("--until", type=int, metavar="STEP", help="stop after this global step and checkpoint there")
    replay.add_argument("--out", metavar="DIR", help="the replay's own run directory (default: RUN_DIR/replay)")
    replay.add_argument("--samples", action="store_true", help="train on the run's stored samples (no generation)")
    replay.add_argument("--debug", action="store_true", help="print the traceback of errors too (also: DPPO_DEBUG=1)")
    replay.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. actor.clip_ratio=0.1")


def _add_import_gguf(commands) -> None:
    gguf = commands.add_parser(
        "import-gguf",
        help="write a GGUF model file (llama.cpp's format) as a transformers model directory",
        description="Load a GGUF model file with transformers' own GGUF loader (dequantized to float32) and write it\n"
        "as a plain transformers directory for model.path: model.safetensors, config.json,\n"
        "generation_config.json and the tokenizer with its chat template. Needs the extra dppo[gguf].\n"
        "OUT_DIR is written whole or not at all.",
        epilog="example:\n  dppo import-gguf SmolLM2-135M-Instruct.Q4_1.gguf models/smollm2-135m-instruct\n"
        "  dppo train model.path=models/smollm2-135m-instruct data.source=reasoning_gym ...\n",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    gguf.add_argument("src", metavar="SRC.gguf", help="the GGUF file")
    gguf.add_argument(
        "out_dir", metavar="OUT_DIR", help="the transformers directory to write (must not exist, or be empty)"
    )
    gguf.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="the weights' dtype (default float32: exactly what transformers dequantizes)",
    )
    gguf.add_argument("--force", action="store_true", help="replace OUT_DIR if it exists and is not empty")
    gguf.add_argument("--debug", action="store_true", help="print the traceback of errors too (also: DPPO_DEBUG=1)")


def _add_data(commands) -> None:
    data = commands.add_parser(
        "data",
        help="write training data files (reasoning-gym problems as verl-format parquet)",
        description="Write training data files.",
    )
    kinds = data.add_subparsers(dest="data_command", metavar="KIND")
    kinds.required = True
    rg = kinds.add_parser(
        "reasoning-gym",
        help="a reasoning-gym dataset's problems as verl-format parquet",
        description="Items 0..SIZE-1 of a reasoning-gym dataset at SEED as verl-format parquet (prompt as chat\n"
        "messages, reward_model.ground_truth, data_source, extra_info with the whole entry), as\n"
        "data.source=reasoning_gym generates them. Needs the extra dppo[tasks]. Score them with the dataset's\n"
        "verifier: custom_reward_function.path=examples/reasoning_gym_reward.py.",
        epilog="example:\n  dppo data reasoning-gym basic_arithmetic train.parquet --size 2000 --seed 0 "
        "--config max_terms=2 --config max_digits=2 --config 'operators=[+,-]'\n",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    rg.add_argument("name", metavar="NAME", help="the dataset, e.g. basic_arithmetic, chain_sum, gsm_symbolic")
    rg.add_argument("out", metavar="OUT.parquet", help="the parquet file to write")
    rg.add_argument("--size", type=int, default=1000, help="problems (items 0..SIZE-1; default 1000)")
    rg.add_argument("--seed", type=int, default=0, help="reasoning-gym draws item i from SEED + i (default 0)")
    rg.add_argument(
        "--config",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a setting of the dataset's config, its value read as YAML (repeat for several)",
    )
    rg.add_argument("--prompt-suffix", default="", metavar="TEXT", help="text after each question (after a space)")
    rg.add_argument("--split", default="train", help="extra_info.split of every row (default train)")
    rg.add_argument("--force", action="store_true", help="replace OUT.parquet if it exists")
    rg.add_argument("--debug", action="store_true", help="print the traceback of errors too (also: DPPO_DEBUG=1)")


@contextlib.contextmanager
def _warning_lines():
    """dppo's warnings (a skipped checkpoint, a restarted worker) as `dppo: warning: ...` lines on stderr."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("dppo: warning: %(message)s"))
    logger = logging.getLogger("dppo")
    logger.addHandler(handler)
    previous, logger.propagate = logger.propagate, False
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.propagate = previous


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except BrokenPipeError:
        # The reader of stdout went away (`dppo train --help | head`): not an error of the run. Point stdout at
        # /dev/null so that the interpreter's own flush at exit does not raise again, and exit as a process killed
        # by SIGPIPE would (128 + 13), which is what shells expect.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # key=value after an option (dppo eval MODEL --config F key=value): argparse leaves them over; they are overrides
    if extra and hasattr(args, "overrides") and all("=" in item and not item.startswith("-") for item in extra):
        args.overrides = [*args.overrides, *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    debug = args.debug or os.environ.get("DPPO_DEBUG", "") not in ("", "0")

    with StopOnSignal() as stop, _warning_lines():
        try:
            commands = {"train": _train, "export": _export, "eval": _eval, "replay": _replay}
            commands.update({"import-gguf": _import_gguf, "data": _data})
            return commands[args.command](args)
        except KeyboardInterrupt:  # Stopped, or what Ray made of it (ray.get raises a plain KeyboardInterrupt)
            if debug:
                traceback.print_exc()
            if stop.signum is None:
                return stop.report()
            stop.finish()  # ends the process
        except Exception as err:  # noqa: BLE001  every error ends here: one line, or the traceback of a bug
            for cls, code in _error_exit_codes():
                if isinstance(err, cls):
                    if debug:
                        traceback.print_exc()
                    print(f"dppo: error: {one_line(err, 2000)}", file=sys.stderr)
                    return code
            traceback.print_exc()
            print(f"dppo: internal error: {type(err).__name__}: {one_line(err, 2000)}", file=sys.stderr)
            return 70


def _train(args) -> int:
    # Imported here, not at start-up: config pulls in torch, the run torch, transformers and Ray (seconds), which
    # `dppo --help` and a malformed command line do not need.
    from dppo.config import load_config, to_yaml

    cfg = load_config(args.overrides, config_file=args.config)
    if args.show_config:
        print(to_yaml(cfg), end="")
        return 0
    from dppo.launch.run import run

    run(cfg)
    return 0


def _replay(args) -> int:
    from dppo.commands.replay import replay

    result = replay(args.run_dir, args.until, args.out, args.overrides, args.samples)
    print(f"\nreplay of {result.run_dir} ({result.steps} step(s), {result.tickets} ticket(s) generated):")
    for line in result.lines():
        print(f"  {line}")
    if result.equal:
        print("the replay ended where the run did")
        return 0
    if result.counterfactual:
        print("the overrides changed the run (above: how)")
        return 0
    return 7


def _export(args) -> int:
    from dppo.checkpoint.export import export_checkpoint

    from dppo.checkpoint.hf_model import ADAPTER_DIR

    out = export_checkpoint(args.checkpoint, args.out_dir)
    print(f"exported {args.checkpoint} to {out}")
    if (out / ADAPTER_DIR).is_dir():  # a LoRA run's: out is the merged model
        print(f"adapter (PEFT): {out / ADAPTER_DIR}")
    return 0


def _eval(args) -> int:
    from pathlib import Path

    from dppo.commands.evaluate import run_eval, write_eval

    result = run_eval(args.target, args.overrides, config_file=args.config)
    out = Path(args.out) if args.out else Path(result.config["trainer"]["output_dir"]) / "eval.json"
    print(result.table())
    print(f"\nwritten: {write_eval(result, out)}")
    return 0


def _import_gguf(args) -> int:
    from dppo.commands.import_gguf import import_gguf

    done = import_gguf(args.src, args.out_dir, dtype=args.dtype, force=args.force)
    print(
        f"wrote {done.out_dir}: {done.params:,} parameters in {done.dtype}, {done.bytes:,} bytes "
        f"({', '.join(done.files)}) in {done.seconds:.1f} s"
    )
    return 0


def _data(args) -> int:
    from dppo.commands.data import parse_config_items, write_reasoning_gym_parquet

    rows = write_reasoning_gym_parquet(
        args.name,
        args.out,
        args.size,
        args.seed,
        parse_config_items(args.config),
        args.prompt_suffix,
        args.split,
        args.force,
    )
    print(
        f"wrote {args.out}: {rows} problems of reasoning-gym {args.name!r} (seeds {args.seed}..{args.seed + rows - 1})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
