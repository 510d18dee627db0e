"""`hacrl` command line: one entry point, one sub-command per job.

    hacrl train [--preset NAME|FILE] [--agent NAME] [key=value ...]  HACRL training (default: the CPU demo)
    hacrl pretrain [--preset ...] [overrides ...]              supervised warm-up of every agent (cached)
    hacrl eval ...                                             evaluate an agent on benchmarks
    hacrl convert ...                                          HF / GGUF ↔ Megatron checkpoints
    hacrl launch ...                                           submit a job through NeMo-Run
    hacrl plan ...                                             will a layout fit; layouts for a whole cluster
    hacrl prepare data NAME... | model HUB_ID                  datasets and models into data/ and models/
    hacrl samples RUN [--step N]                               a run's generations, printed readably
    hacrl config [--preset ...] [overrides ...]                print the resolved, validated config
    hacrl presets                                              list built-in presets

Heavy modules are imported inside each command so `hacrl --help` stays instant.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import signal
import sys
import threading

import yaml

from hacrl_megatron.config import ConfigError, check_data_files, load_config, preset_names
from hacrl_megatron.config.files import check_loggers, check_model_files
from hacrl_megatron.console import log_to_console
from hacrl_megatron.durable import OutOfSpaceError
from hacrl_megatron.errors import InputError, Terminated
from hacrl_megatron.outputs import check_dir
from hacrl_megatron.paths import CACHE_ENV, default_cache_dir
from hacrl_megatron.trainer.run_folder import RunFolderError, check_output_paths, resume_note

DEFAULT_PRESET = "cpu_demo"

# sub-commands implemented in other modules: name -> (module, help). Each module exposes
# add_arguments(parser) and main(args) -> int.
EXTERNAL_COMMANDS = {
    "eval": ("hacrl_megatron.eval.cli", "evaluate agents on benchmarks (avg@k, pass@k, best@k)"),
    "convert": ("hacrl_megatron.cli_convert", "convert HF/GGUF checkpoints to Megatron and back"),
    "launch": ("hacrl_megatron.launch.cli", "run a hacrl job through NeMo-Run (local, Slurm + Ray cluster, Docker)"),
    "plan": ("hacrl_megatron.plan.cli", "memory, layout and step-time planner for a cluster (docs/planner.md)"),
    "prepare": ("hacrl_megatron.prepare.cli", "fetch the paper's datasets and models (hub or local mirror)"),
    "samples": ("hacrl_megatron.samples_cli", "print a run's generations (RUN/samples/step-*.jsonl) readably"),
}


_SIGTERM_OWNER = {"pid": None}  # the process whose main thread installed _on_sigterm


def _on_sigterm(signum: int, frame: object) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM while stopping ends the process at once
    if os.getpid() != _SIGTERM_OWNER["pid"]:
        # a forked child that inherited the handler (megatron's checkpoint writers, verifier workers; Slurm's
        # scancel signals every process of the step): it ends the default, silent way, not with a traceback
        os.kill(os.getpid(), signal.SIGTERM)
        return
    raise Terminated


class IntermixedParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose options and positionals (``key=value`` overrides, names) may come in any
    order: ``hacrl train --preset p a=b --agent x c=d`` keeps both overrides. argparse stops collecting a
    ``nargs="*"`` positional at the first option, so a plain parser loses whatever follows it; this one
    parses intermixed (``parse_known_intermixed_args``) wherever that is possible, i.e. on every parser
    without sub-commands (sub-parsers are built with the class of their parent, so every ``hacrl``
    command gets it)."""

    _intermixing = False

    def parse_known_args(self, args=None, namespace=None):
        if self._intermixing or self._subparsers is not None:
            return super().parse_known_args(args, namespace)
        self._intermixing = True  # parse_known_intermixed_args calls parse_known_args itself
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._intermixing = False


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default=DEFAULT_PRESET,
                   help=f"built-in preset name or YAML path (default {DEFAULT_PRESET}; see `hacrl presets`)")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="dotted overrides, e.g. hacpo.alpha=3 agents.0.parallel.tp=2")


def _check_files(cfg) -> None:
    """The files the run reads exist here (data, checker, models, tokenizers, init checkpoints) and
    every path it writes can be written (output and checkpoint folders, metrics, the cache)."""
    check_data_files(cfg.data)
    _check_data_rows(cfg)
    check_model_files(cfg)
    check_loggers(cfg)
    check_output_paths(cfg)


def _check_data_rows(cfg) -> None:
    """The data file parses and holds the held-out prompts the run evaluates on: the same reading as
    training start-up, so `hacrl config` refuses exactly what `hacrl train` would."""
    from hacrl_megatron.data.formats import dataset_options
    from hacrl_megatron.data.tasks import BENCHMARKS, task_and_eval_set

    d = cfg.data
    if d.task in BENCHMARKS:  # a procedural task generates what it is asked for
        task_and_eval_set(d.task, d.difficulty, d.seed, d.path, d.eval_size if cfg.train.eval_every else 0,
                          **dataset_options(d))


def _cmd_config(args: argparse.Namespace) -> int:
    cfg = load_config(args.preset, args.overrides)
    _check_files(cfg)  # they must exist here, like at training start-up
    print(yaml.safe_dump(cfg.to_dict(), sort_keys=False), end="")
    print(resolved_comment(cfg), end="")
    return 0


def resolved_comment(cfg) -> str:
    """What the config's ``auto`` values resolve to on this machine, as YAML comments (the printed
    config stays a preset that loads as it is): each agent's ``model.dtype`` and why."""
    import torch

    from hacrl_megatron.models.resolved import configured_dtype

    cuda = torch.cuda.is_available()
    lines = [f"# resolved on this machine ({'CUDA' if cuda else 'no CUDA'}):"]
    for i, agent in enumerate(cfg.agents):
        dtype, why = configured_dtype(agent, engine=cfg.rollout.engine, cuda=cuda)
        lines.append(f"#   agents.{i}.model.dtype: {dtype}  ({why})")
    return "\n".join(lines) + "\n"


def _cmd_presets(args: argparse.Namespace) -> int:
    for name in preset_names():
        cfg = load_config(name)
        agents = ", ".join(a.name for a in cfg.agents)
        print(f"{name:38s} {cfg.hacpo.algorithm:8s} agents: {agents}")
    return 0


def new_run_folders(cfg):
    """``hacrl train --new``: ``cfg`` writing into ``<output_dir>-<UTC time>`` (``-2``, ``-3``, ... if that
    exists), ``checkpoint.dir`` likewise when set; a resume is refused (it continues a folder's run)."""
    import dataclasses
    import datetime
    from pathlib import Path

    from hacrl_megatron.config.validation import validate

    if cfg.checkpoint.resume:
        raise ConfigError("--new starts a fresh run in a new folder: it cannot continue one (drop "
                          "checkpoint.resume=true, or drop --new to resume in output_dir)")
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    suffix, n = stamp, 1
    while Path(f"{cfg.output_dir.rstrip('/')}-{suffix}").exists() or (
            cfg.checkpoint.dir and Path(f"{cfg.checkpoint.dir.rstrip('/')}-{suffix}").exists()):
        n += 1
        suffix = f"{stamp}-{n}"
    ckpt = cfg.checkpoint.dir and f"{cfg.checkpoint.dir.rstrip('/')}-{suffix}"
    return validate(dataclasses.replace(cfg, output_dir=f"{cfg.output_dir.rstrip('/')}-{suffix}",
                                        checkpoint=dataclasses.replace(cfg.checkpoint, dir=ckpt)))


def _cmd_train(args: argparse.Namespace) -> int:
    cfg = load_config(args.preset, args.overrides)
    if args.new:
        cfg = new_run_folders(cfg)
        print(f"hacrl: --new: this run writes to {cfg.output_dir}", file=sys.stderr)
    _check_files(cfg)  # before any import of torch, warm-up or model build
    if args.agent is not None:  # the exchange is usable before any model is built
        from hacrl_megatron.config.agent_jobs import agent_index, check_exchange_config
        from hacrl_megatron.exchange.remote.store import ExchangeBackendError
        from hacrl_megatron.trainer.peers import open_exchange_store

        agent_index(cfg, args.agent)
        check_exchange_config(cfg)
        try:
            open_exchange_store(cfg).close()
        except ExchangeBackendError as err:  # a server that does not answer: one line, exit 2 (nothing ran)
            raise InputError(str(err)) from None
    log_to_console()
    from hacrl_megatron.agents.ray_placement import TrainerNodeLost
    from hacrl_megatron.exchange.remote.store import ExchangeBackendError
    from hacrl_megatron.trainer.guards import NonFiniteError

    try:
        from hacrl_megatron.trainer.loop import train

        train(cfg) if args.agent is None else train(cfg, agent=args.agent)
    except KeyboardInterrupt:  # Ctrl-C: one line saying where to continue from, exit 130 (128 + SIGINT)
        print(f"hacrl: interrupted; {resume_note(cfg)}", file=sys.stderr)
        return 130
    except Terminated:  # a scheduler's SIGTERM: the same line, exit 143 (128 + SIGTERM)
        print(f"hacrl: terminated (SIGTERM); {resume_note(cfg)}", file=sys.stderr)
        return 143
    except NonFiniteError as err:  # the diverged step wrote no checkpoint: name the newest one
        print(f"hacrl: {err}; {resume_note(cfg)}", file=sys.stderr)
        return 1
    except TrainerNodeLost as err:  # a trainer rank's node left the cluster; the message names the last checkpoint
        print(f"hacrl: {str(err).splitlines()[0]}", file=sys.stderr)
        return 1
    except ExchangeBackendError as err:  # hacrl train --agent: the exchange's server or folder failed mid-run
        print(f"hacrl: {err}; {resume_note(cfg)}", file=sys.stderr)
        return 1
    return 0


def _cmd_pretrain(args: argparse.Namespace) -> int:
    from hacrl_megatron.trainer.pretrain import pretrain_all

    cfg = load_config(args.preset, args.overrides)
    check_data_files(cfg.data)
    check_model_files(cfg)
    check_dir(default_cache_dir() / "warmup", f"the warm-up cache (${CACHE_ENV})")  # where pretrain writes
    log_to_console()
    pretrain_all(cfg, force=args.force)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from hacrl_megatron import __version__

    parser = IntermixedParser(prog="hacrl", description="Heterogeneous Agent Collaborative RL (HACPO)")
    parser.add_argument("--version", action="version", version=f"hacrl {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    p = sub.add_parser("train", help="run HACRL training (no arguments: the CPU demo)")
    _add_config_args(p)
    p.add_argument("--new", action="store_true",
                   help="start a fresh run in a new sibling folder <output_dir>-<UTC time> (and checkpoint.dir "
                        "likewise when set) instead of refusing a folder that holds a run")
    p.add_argument("--agent", metavar="NAME",
                   help="train only agent NAME of the config, as its own job: it meets the other agents' jobs through "
                        "exchange.backend shared_dir or redis (docs/exchange.md)")
    p.set_defaults(func=_cmd_train)
    p = sub.add_parser("pretrain", help="supervised warm-up of every agent, cached for `train`")
    _add_config_args(p)
    p.add_argument("--force", action="store_true", help="redo the warm-up even if a cached one exists")
    p.set_defaults(func=_cmd_pretrain)
    p = sub.add_parser("config", help="print the resolved, validated configuration")
    _add_config_args(p)
    p.set_defaults(func=_cmd_config)
    p = sub.add_parser("presets", help="list built-in presets")
    p.set_defaults(func=_cmd_presets)
    for name, (module, help_text) in EXTERNAL_COMMANDS.items():
        if importlib.util.find_spec(module) is None:
            continue  # only expose commands whose implementation is installed
        p = sub.add_parser(name, help=help_text)
        mod = importlib.import_module(module)
        mod.add_arguments(p)
        p.set_defaults(func=mod.main)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    in_main_thread = threading.current_thread() is threading.main_thread()
    if in_main_thread:
        _SIGTERM_OWNER["pid"] = os.getpid()
    previous = signal.signal(signal.SIGTERM, _on_sigterm) if in_main_thread else None
    try:
        return int(args.func(args) or 0)
    except ConfigError as err:
        print(f"hacrl: configuration error: {err}", file=sys.stderr)
        return 2
    except InputError as err:  # a data file, checkpoint or tokenizer that cannot be used; it is named
        print(f"hacrl: {err}", file=sys.stderr)
        return 2
    except RunFolderError as err:  # the output folder is in use or holds another run
        print(f"hacrl: {err}", file=sys.stderr)
        return 2
    except OutOfSpaceError as err:
        print(f"hacrl: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("hacrl: interrupted", file=sys.stderr)
        return 130
    except Terminated:
        print("hacrl: terminated (SIGTERM)", file=sys.stderr)
        return 143
    finally:
        if in_main_thread:
            signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


if __name__ == "__main__":
    sys.exit(main())
