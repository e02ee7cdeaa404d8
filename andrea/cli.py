"""`python -m andrea …`: the stable command line (scripts, tests and systemd units depend on it).

    train    train (or resume) a run in a run directory
    prepare  prepare a run's data (tokenizer, token files) without training; train's first start does the same
    info     a preset's size and parameter layout, as JSON
    verify   validate checkpoints (a run directory or one file)
    sample   generate text from a checkpoint
    export   a checkpoint as a Hugging Face directory (GPT-2, or Qwen3 for a modern run) or npz
    eval     a checkpoint's multiple-choice accuracy on a HellaSwag-format tasks file (andrea/commands/evaluate.py)
    ctl      talk to a running trainer: checkpoint | stop | status
    restore  bring a run back from its replica (checkpoint.replica) onto an empty disk
    status, pivot, branch, compare, plot: a run's life (andrea/commands/operate.py, with ctl)

This module parses and dispatches; each command's body is in andrea/commands/ (train.py, prepare.py, info.py,
checkpoints.py: verify, sample, export; evaluate.py, restore.py, operate.py), imported when the command runs.
Every user error is one line on stderr, `andrea: error: …`, and a non-zero exit: 2 for a bad configuration
or command line (argparse's refusals too: a mistyped command names the closest one), 1 for anything else
(andrea/errors.py: `UserError`, and an OSError). Every flag's help says its default (`Help`); a reader that closes
stdout early (`andrea status RUN | head -1`) ends the command quietly, exit 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import logging
import os
import re
import sys

from andrea.commands import operate
from andrea.config import load as configload
from andrea.errors import UserError

log = logging.getLogger("andrea")


def error(message: str) -> None:
    """The one `andrea: error: …` line, in ONE write: under torchrun every worker shares the launcher's stderr,
    and a line written in pieces would interleave with another worker's."""
    sys.stderr.write(f"andrea: error: {message}\n")
    sys.stderr.flush()


# Each command's module is imported when that command runs: the others' imports (torch) cost it nothing.
def cmd_train(args: argparse.Namespace) -> int:
    from andrea.commands.train import cmd_train
    return cmd_train(args)


def cmd_prepare(args: argparse.Namespace) -> int:
    from andrea.commands.prepare import cmd_prepare
    return cmd_prepare(args)


def cmd_info(args: argparse.Namespace) -> int:
    from andrea.commands.info import cmd_info
    return cmd_info(args)


def cmd_verify(args: argparse.Namespace) -> int:
    from andrea.commands.checkpoints import cmd_verify
    return cmd_verify(args)


def cmd_sample(args: argparse.Namespace) -> int:
    from andrea.commands.checkpoints import cmd_sample
    return cmd_sample(args)


def cmd_export(args: argparse.Namespace) -> int:
    from andrea.commands.checkpoints import cmd_export
    return cmd_export(args)


def cmd_eval(args: argparse.Namespace) -> int:
    from andrea.commands.evaluate import cmd_eval
    return cmd_eval(args)


def cmd_restore(args: argparse.Namespace) -> int:
    from andrea.commands.restore import cmd_restore
    return cmd_restore(args)


class Help(argparse.HelpFormatter):
    """Every flag's help ends with its default, where it has one and the help does not already say it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default not in (None, False, argparse.SUPPRESS) and "default" not in text and action.option_strings:
            text += " (default: %(default)s)"
        return text


class Parser(argparse.ArgumentParser):
    """argparse, its errors one `andrea: error:` line (exit 2); a mistyped command gets the closest one."""

    def error(self, message: str):
        bad = re.match(r"argument command: invalid choice: '([^']*)'", message)
        if bad:
            commands = sorted(_subparsers(self))
            close = difflib.get_close_matches(bad.group(1), commands, n=1)
            message = (f"no command {bad.group(1)!r}: did you mean {close[0]!r}?" if close
                       else f"no command {bad.group(1)!r} (commands: {', '.join(commands)})")
        else:
            message += f" (`{self.prog} --help` lists the flags)"
        error(message)
        self.exit(2)


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices
    return {}


def config_sections() -> list[str]:
    """The sections a --config file may hold: the configuration schema's top-level fields."""
    from andrea.config.schema import RunConfig
    return [f.name for f in dataclasses.fields(RunConfig)]


def add_config_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE.toml",
                   help=f"a TOML file of any of the sections {', '.join(config_sections())} "
                        "(docs/configuration.md), layered over the preset and run.toml")
    p.add_argument("--preset", help=f"a shipped preset: {', '.join(configload.preset_names())} (default: the run's "
                                    f"run.toml, else andrea-12m, said in the log)")
    p.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE",
                   help="override one key, e.g. train.lr=3e-4 (repeatable; kept in run.toml)")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="andrea", description=__doc__.split("\n")[0], formatter_class=Help)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    sub.add_parser = _with_help(sub.add_parser)

    p = sub.add_parser("train", help="train or resume a run")
    add_config_flags(p)
    p.add_argument("--run-dir", required=True, metavar="DIR",
                   help="the run directory: created on the first start, resumed from on every later one")
    p.add_argument("--steps", type=int, metavar="N",
                   help="the step to stop at, counted from 0 (the final step is checkpointed); kept in run.toml "
                        "(default: train.steps, 200,000 in the presets)")
    p.add_argument("--checkpoint-every", type=int, metavar="K",
                   help="a checkpoint every K steps (checkpoint.every; default: run.toml's, else 100)")
    p.add_argument("--seed", type=int, metavar="S",
                   help="seeds initialisation, data order and the bandit (train.seed; default: 1337); a resume "
                        "keeps the run's")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"],
                   help="where to train (train.device; default: auto, a GPU when there is one)")
    p.add_argument("--kernels", choices=["auto", "torch", "triton"],
                   help="Triton kernels or the plain-torch reference (train.kernels; default: auto, Triton on a "
                        "GPU of sm_80 or newer)")
    p.add_argument("--init-from", metavar="PATH",
                   help="start from this step_NNNNNN.bin instead of the run's newest checkpoint; or, in a run "
                        "without checkpoints, from weights only (step 0, m = v = 0): a model.safetensors, "
                        "model.npz, pytorch_model.bin or a Hugging Face directory holding one (andrea export's output: GPT-2, "
                        "or Qwen3 for a modern run)")
    p.add_argument("--accept-ledger-gap", action="store_true",
                   help="resume although .loss.json is not what the checkpoint recorded (cut short, changed): "
                        "continue past the gap, recorded as a `gap` marker")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("prepare", help="prepare a run's data (tokenizer, token files) without training")
    add_config_flags(p)
    p.add_argument("--run-dir", required=True, metavar="DIR", help="the run directory to prepare (created if absent)")
    p.set_defaults(func=cmd_prepare)

    p = sub.add_parser("info", help="a preset's size, parameter layout and device-memory estimate (JSON)")
    add_config_flags(p)
    p.add_argument("--micro-batch-size", type=int, metavar="M", help="estimate memory with M rows per pass")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="estimate memory with train.activation_checkpointing = blocks")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cuda: bf16 autocast activations (default); cpu: fp32")
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("verify", help="validate checkpoints")
    p.add_argument("path", help="a run directory or one step_NNNNNN.bin")
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("sample", help="generate text from a checkpoint")
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run directory")
    p.add_argument("--step", type=int, help="the checkpoint's step (default: the newest valid checkpoint)")
    p.add_argument("--prompt", required=True, help="the text to continue")
    p.add_argument("--max-new-tokens", type=int, default=100, metavar="N", help="tokens to generate")
    p.add_argument("--temperature", type=float, default=0.8, metavar="T", help="sampling temperature (0: greedy)")
    p.add_argument("--seed", type=int, default=0, help="the sampling seed (the same seed, the same text)")
    p.set_defaults(func=cmd_sample)

    p = sub.add_parser("export", help="a checkpoint as a Hugging Face directory: GPT-2, or Qwen3 for a modern run "
                                        "(or numpy arrays)")
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run directory")
    p.add_argument("--step", type=int, help="the checkpoint's step (default: the newest valid checkpoint)")
    p.add_argument("--out", required=True, help="the directory to create (absent or empty)")
    p.add_argument("--format", choices=["safetensors", "npz"], default="safetensors",
                   help="safetensors: Hugging Face names, GPT2LMHeadModel's or, for a modern run, Qwen3ForCausalLM's "
                        "(default); npz: andrea's layout names")
    p.add_argument("--average", type=int, default=1, metavar="K",
                   help="export the mean of the weights of the K retained checkpoints ending at --step (default 1)")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("eval", help="a checkpoint's multiple-choice accuracy on a HellaSwag-format tasks file")
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run directory")
    p.add_argument("--tasks", required=True, metavar="FILE.jsonl",
                   help="JSON Lines: ctx, endings, label per line (HellaSwag's format, e.g. hellaswag_val.jsonl)")
    p.add_argument("--step", type=int, help="the checkpoint's step (default: the newest valid checkpoint)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the summary line")
    p.add_argument("--batch-size", type=int, metavar="ROWS",
                   help="rows (example endings) per forward (default: eval.batch_rows's, 32)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], help="default: the run's train.device")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("restore", help="bring a run back from its replica onto an empty disk")
    p.add_argument("replica", metavar="REPLICA", help="the run's checkpoint.replica: s3://bucket/prefix or a path")
    p.add_argument("--run-dir", required=True, help="the directory to restore into (absent or empty)")
    p.set_defaults(func=cmd_restore)

    operate.add_commands(sub)
    return parser


def _with_help(add_parser):
    """Every subcommand's parser formats its help with the defaults (Help) and reports errors in one line."""
    def add(name: str, **kw):
        return add_parser(name, formatter_class=Help, description=kw.get("help"), **kw)
    return add


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    if args.command != "prepare":
        from andrea.control.run import early_signals
        early_signals.release()  # `prepare` alone takes over a signal received while starting
    try:
        rc = args.func(args)
        sys.stdout.flush()  # a reader that closed the pipe (`status | head -1`) is met here, not at exit
        return rc
    except BrokenPipeError:  # the reader has what it wanted: end quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's flush writes nowhere
        return 0
    except UserError as e:  # every one-line error of andrea's own (andrea/errors.py)
        error(str(e))
        return e.exit_code
    except OSError as e:  # the system's: a missing file, a full disk, a permission, each naming its path
        error(str(e))
        return 1
