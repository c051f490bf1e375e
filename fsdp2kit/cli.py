"""The `fsdp2kit` command line. The config is validated before any rank starts; a user's mistake found
inside a rank is reported once, as one sentence, with exit code 2; a diverged run likewise, with exit code 1."""

from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import os
import signal
import sys
import tempfile
import traceback
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

# Imported here, not where used: a Ctrl-C's handler names the complete checkpoints while anything may be importing.
from fsdp2kit.checkpoint.committed import CHECKPOINTS, committed_checkpoints
from fsdp2kit.errors import (
    ERROR_DIR_ENV,
    PROCESS_STOP,
    Interrupted,
    RunFault,
    TrainingDiverged,
    UserError,
    report_error,
)

if TYPE_CHECKING:
    from fsdp2kit.config.schema import JobConfig


_CONFIG_COMMANDS = (
    ("train", "train a model"),
    ("infer", "fsdp2_infer: forward-only per-sample log-probs and perplexity"),
    ("check", "validate the config and print the sharding plan"),
    ("plan", "predict per-rank peak memory (traced on fake tensors) and a table by strategy"),
    ("prepare", "tokenize the config's data once into the token store every later run and rank memory-maps"),
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fsdp2kit", description="Train and serve transformer models with PyTorch FSDP2."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    for name, help_text in _CONFIG_COMMANDS:
        _add_config_command(commands.add_parser(name, help=help_text), name)
    _add_convert(commands.add_parser("convert", help="convert a checkpoint: DCP -> HF/torch, HF -> DCP"))
    report = commands.add_parser(
        "report", help="plot runs' metrics (loss, lr, grad norm, tokens/s, memory) and summarise them"
    )
    report.add_argument(
        "run_dirs",
        nargs="+",
        metavar="RUN_DIR",
        help="training output folders holding metrics.jsonl; "
        "several are overlaid, and the plots go to the first one's report/ folder",
    )
    return parser


# plan only computes for a world size; the other commands start it.
_NPROC_HELP = {"plan": "the world size to plan for (nothing is launched)"}


def _add_config_command(sub: argparse.ArgumentParser, name: str) -> None:
    """The arguments of the commands that read a config: train, infer, check, plan, prepare."""
    sub.add_argument("config", help="YAML config (native, or a ROLL file with roles)")
    if name != "prepare":  # one process: the store's build uses every core itself
        sub.add_argument(
            "--nproc",
            type=int,
            default=None,
            help=_NPROC_HELP.get(name, "launch this many local ranks (torch.distributed.run); without it, one process"),
        )
    sub.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY.PATH=VALUE",
        help="override a config key (value parsed as YAML); repeatable",
    )
    sub.add_argument(
        "--role",
        default=None,
        help="the role of a ROLL config to use (default: its first fsdp2_train/fsdp2_infer role)",
    )
    _add_beside_the_config(sub)
    if name == "prepare":
        sub.add_argument(
            "--show",
            type=int,
            default=0,
            metavar="N",
            help="print the first N training samples as the model sees them, loss targets marked [[so]] "
            "(in colour on a terminal)",
        )
    if name in ("check", "plan"):
        sub.add_argument("--json", action="store_true", help="print one JSON object")
    if name == "plan":
        sub.add_argument(
            "--budget-gb",
            type=float,
            default=None,
            help="also print, as --set lines, the fastest configuration whose per-rank peak fits X GiB",
        )
        sub.add_argument(
            "--measure",
            action="store_true",
            help="with --budget-gb: train a few real steps of each configuration that fits and pick the fastest",
        )
        sub.add_argument(
            "--measure-steps",
            type=int,
            default=5,
            help="with --measure: optimizer steps per configuration (tokens/s: median after the first; default 5)",
        )


def _add_beside_the_config(sub: argparse.ArgumentParser) -> None:
    """What a config file cannot say for itself: a strategy file beside it, and trust in a model folder's code."""
    sub.add_argument(
        "--fsdp-config",
        "--fsdp2-config-path",
        "--fsdp2-config",
        dest="fsdp_config",
        default=None,
        help="a MindSpeed-MM fsdp2_config.yaml or an Accelerate config replacing strategy_config",
    )
    sub.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="let transformers import and run the Python files a model folder ships (its config's auto_map); a "
        "config file's trust_remote_code never does",
    )


def _add_convert(convert: argparse.ArgumentParser) -> None:
    convert.add_argument("src", help="a DCP checkpoint folder (checkpoints/step_N) or an HF model folder")
    convert.add_argument("dst", help="a new folder")
    convert.add_argument("--to", required=True, choices=["hf", "torch", "dcp"], help="target format")
    convert.add_argument(
        "--dtype",
        choices=["bf16", "fp16", "fp32"],
        default=None,
        help="cast the weights (default: keep the stored dtype)",
    )
    convert.add_argument(
        "--adapter",
        type=Path,
        default=None,
        help="a PEFT adapter folder to merge into the HF model SRC (--to hf): the merged HF folder goes to DST",
    )


def _under_launcher() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _strip_nproc(argv: list[str]) -> list[str]:
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--nproc":
            skip = True
        elif not arg.startswith("--nproc="):
            out.append(arg)
    return out


def _launch(nproc: int, argv: list[str], output_dir: Path, command: str) -> int:
    """Start `nproc` local ranks with torch's own elastic launcher (torch.distributed.run), quietly. A failed rank's
    one-line report is printed once. On SIGINT/SIGTERM the launcher forwards the signal to the ranks (each in its
    own session), which stop at a step boundary and report; it then re-raises the signal as SignalException."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    for name in list(logging.root.manager.loggerDict):  # elastic's modules set their own levels (env LOGLEVEL)
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory(prefix="fsdp2kit-errors-") as error_dir:
        os.environ[ERROR_DIR_ENV] = error_dir
        parser = get_args_parser()
        launcher = ["--standalone", f"--nproc-per-node={nproc}", "--max-restarts=0", *_forwarded_signals(parser)]
        args = parser.parse_args([*launcher, "-m", "fsdp2kit", *_strip_nproc(argv)])
        try:
            run(args)
        except ChildFailedError as failure:
            # A rank killed by a signal (the launcher's own SIGTERM to the survivors aside) is the cause: the others
            # only lost their connection to it.
            killed = sorted(
                (rank, f) for rank, f in failure.failures.items() if f.exitcode < 0 and -f.exitcode != signal.SIGTERM
            )
            if killed:
                rank, dead = killed[0]
                left = _left_by_interrupt(command, output_dir)
                print(f"error: rank {rank} died ({dead.signal_name()}); {left}", file=sys.stderr)
                return 1
            code = _print_rank_report(Path(error_dir))
            if code is None:
                ranks = ", ".join(f"rank {r} (exit code {f.exitcode})" for r, f in sorted(failure.failures.items()))
                print(f"error: {_WORK[command]} failed: {ranks}; its output is above", file=sys.stderr)
                return 1
            return code
        except SignalException as stopped:
            _end_rendezvous(stopped)
            code = _print_rank_report(Path(error_dir))
            if code is None:
                print(
                    f"error: stopped by {stopped.sigval.name}; {_left_by_interrupt(command, output_dir)}",
                    file=sys.stderr,
                )
            return code or 128 + int(stopped.sigval)
    return 0


def _forwarded_signals(parser: argparse.ArgumentParser) -> list[str]:
    """torch's launcher forwards SIGTERM, SIGINT, SIGHUP and SIGQUIT to the ranks; SIGUSR1 too (Slurm's `--signal`
    ahead of a time limit), which would otherwise end the launcher itself. A torch without the option leaves it so:
    the ranks, their launcher gone, stop as on SIGTERM."""
    handled = getattr(parser.parse_args(["fsdp2kit"]), "signals_to_handle", None)
    if handled is None or "SIGUSR1" in handled:
        return []
    return [f"--signals-to-handle={handled},SIGUSR1"]


def _end_rendezvous(stopped: BaseException) -> None:
    """Stopped by a signal, torch's launcher leaves its rendezvous open (for a restart), its keep-alive timer running.
    The timer's thread holds the rendezvous while it sends a heartbeat: if this thread lets go of it meanwhile, the
    rendezvous is freed in the timer's thread, whose finaliser then joins that thread itself ("cannot join current
    thread", a traceback after the one-line report). This launcher restarts nothing: it ends the rendezvous here."""
    from torch.distributed.elastic.agent.server import WorkerSpec

    for frame, _ in traceback.walk_tb(stopped.__traceback__):
        for value in frame.f_locals.values():
            if isinstance(value, WorkerSpec):
                value.rdzv_handler.shutdown()
                return


# What each launched command's ranks do, for the line that says they failed.
_WORK = {"train": "training", "infer": "inference", "check": "the check"}


def _intact(output_dir: Path) -> str:
    complete = committed_checkpoints(output_dir / CHECKPOINTS)
    if not complete:
        return "no checkpoint was written yet"
    return f"checkpoint {complete[-1].name} is complete and the same command resumes from it"


def _print_rank_report(error_dir: Path) -> int | None:
    """Print the first rank's one-line error report (the lowest rank of those written at once); its exit code, or
    None when none wrote one. The first is the cause: a rank stopped by what another's exit brought about (the
    launcher's SIGTERM to the survivors, a lost peer) reports later."""
    reports = sorted(error_dir.glob("rank*.json"), key=lambda p: (p.stat().st_mtime_ns, int(p.stem[4:])))
    if not reports:
        return None
    report = json.loads(reports[0].read_text())
    print(f"error: {report['message']}", file=sys.stderr)
    return report["exit_code"]


def _run_rank(args: argparse.Namespace, cfg: JobConfig) -> int:
    from fsdp2kit.distributed import init_distributed, lost_peer_message, out_of_memory_message, shutdown, watch_parent

    launched = _under_launcher()  # asked first: a world of one sets RANK and WORLD_SIZE
    runtime = init_distributed(cfg.device_mapping)
    if launched:
        watch_parent()
    try:
        if args.command == "train":
            if cfg.strategy_args.strategy_name != "fsdp2_train":
                raise UserError("strategy_args.strategy_name is fsdp2_infer; use `fsdp2kit infer` or set fsdp2_train")
            from fsdp2kit.trainer import train

            train(cfg, runtime)
        elif args.command == "infer":
            from fsdp2kit.infer.logprobs import infer

            infer(cfg, runtime)
        elif args.command == "check":
            from fsdp2kit.check import print_check

            print_check(cfg, runtime, args.json)
    except (MemoryError, RuntimeError) as exc:  # torch.OutOfMemoryError and gloo's errors are RuntimeErrors
        message = out_of_memory_message(exc, runtime) or lost_peer_message(exc, runtime)
        if message is None:
            raise
        raise RunFault(message) from None
    finally:
        shutdown()
    return 0


def _plan(args: argparse.Namespace, world_size: int) -> int:
    from fsdp2kit.memory_plan import GIB, ConfigSource, candidate_configs, plan_report, planned_fit, print_plan
    from fsdp2kit.models.sharded import check_expert_parallel
    from fsdp2kit.parallel.mesh import mesh_layout

    if args.budget_gb is not None and not (math.isfinite(args.budget_gb) and args.budget_gb > 0):
        raise UserError(f"--budget-gb {args.budget_gb}: give the memory per rank in GiB, a finite number > 0")
    if args.measure and args.budget_gb is None:
        raise UserError("--measure measures the configurations that fit a budget: give --budget-gb X too")
    if args.measure and args.measure_steps < 2:
        raise UserError(f"--measure-steps {args.measure_steps}: give >= 2 (the first step warms up and is not timed)")
    source = ConfigSource(args.config, args.overrides, args.role, args.fsdp_config, args.trust_remote_code)
    cfg = source.load()
    model = cfg.model
    check_expert_parallel(world_size, model, cfg.strategy_args.strategy_config, cfg.data)
    mesh_layout(world_size, cfg.strategy_args.strategy_config, model.ulysses_size, model.context_parallel_size)
    report = plan_report(source, world_size, args.budget_gb)
    if args.measure:
        from fsdp2kit.plan_measure import measure_candidates, print_measured, train_command
        from fsdp2kit.train.interrupt import stopping_at_once

        command = train_command(args.config, world_size, args.role, args.fsdp_config)
        budget_bytes = int(args.budget_gb * GIB)

        def fits(candidate: dict[str, object]) -> dict[str, object] | None:
            return planned_fit(source, world_size, budget_bytes, candidate)

        # Stopped by raising: the candidate's run is killed and its temporary folder removed on the way out.
        with stopping_at_once("no configuration was chosen; the measuring runs were stopped and removed"):
            measured = measure_candidates(command, args.overrides, candidate_configs(source), fits, args.measure_steps)
        report["budget"]["measured"] = measured  # type: ignore[index]
    print_plan(report, args.json)
    if args.measure and not args.json:
        print_measured(report["budget"]["measured"], args.budget_gb)  # type: ignore[index]
    return 0


def main(argv: list[str] | None = None) -> int:
    """The `fsdp2kit` command. Without `argv` it runs this process's own command line (`fsdp2kit`, `python -m
    fsdp2kit`): a process that ends with the command, so a Ctrl-C or SIGUSR1 (and, outside a launcher, a SIGTERM) is
    one line wherever it lands, and once a stop signal has stopped its work it ignores the ones after it; an
    in-process caller passes `argv` and gets its own handlers back."""
    if argv is None:
        PROCESS_STOP.for_this_process = True
        signal.signal(signal.SIGINT, PROCESS_STOP.stop_at_once)
        signal.signal(signal.SIGUSR1, PROCESS_STOP.stop_at_once)  # a scheduler's warning (Slurm's --signal)
        if not _under_launcher():  # a launcher's SIGTERM to a rank may end the survivors of another's failure
            signal.signal(signal.SIGTERM, PROCESS_STOP.stop_at_once)
    code = _command(sys.argv[1:] if argv is None else argv)
    # A finished command's model and device meshes are cyclic garbage that still holds the process group: collected
    # here, while the interpreter is whole, so the group's gloo and TCPStore threads are joined now rather than torn
    # down during interpreter exit, which can abort the process after its result is reported.
    gc.collect()
    return code


def _command(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    cfg = None
    try:
        from fsdp2kit.config.load import load_config, name_as_written  # imported here: pydantic takes a second

        if args.command != "report":  # every other command loads transformers' configs, tokenizers or conversions
            from fsdp2kit.distributed import require_supported_versions

            require_supported_versions()
        if args.command in ("convert", "report"):
            return _file_command(args)
        cfg = load_config(
            args.config,
            args.overrides,
            role=args.role,
            strategy_file=args.fsdp_config,
            trust_remote_code=args.trust_remote_code,
        )
        PROCESS_STOP.left_by_stop = partial(_left_by_interrupt, args.command, Path(cfg.training.output_dir))
        if args.command == "prepare":
            return _prepare(cfg, args.show)
        return _config_command(args, argv, cfg)
    except UserError as exc:
        return report_error(name_as_written(str(exc), cfg) if cfg else str(exc), 2)
    except (TrainingDiverged, RunFault) as exc:
        return report_error(str(exc), 1)
    except Interrupted as exc:
        return report_error(str(exc), exc.exit_code)


def _left_by_interrupt(command: str, output_dir: Path) -> str:
    """What a Ctrl-C outside the work's own handling leaves: a training run's complete checkpoints, an inference's
    partial output, else nothing (a token store or a conversion is only ever committed whole)."""
    if command == "train":
        return _intact(output_dir)
    if command == "infer" and (output_dir / "infer.jsonl").exists():
        return f"'{output_dir / 'infer.jsonl'}' may be incomplete"
    return "nothing was written"


def _file_command(args: argparse.Namespace) -> int:
    """`convert` and `report`: they read files, not a config."""
    if args.command == "report":
        from fsdp2kit.report import write_report

        print(write_report([Path(d) for d in args.run_dirs]))
        return 0
    from fsdp2kit.checkpoint.convert import convert
    from fsdp2kit.dtypes import torch_dtype
    from fsdp2kit.train.interrupt import stopping_at_once
    from fsdp2kit.train.loggers import phase

    with (
        stopping_at_once(f"'{args.dst}' was not written"),  # convert removes what it wrote, as on any failure
        phase(f"converting {args.src} -> {args.dst} ({args.to})", is_main=True),
    ):
        convert(Path(args.src), Path(args.dst), args.to, torch_dtype(args.dtype), args.adapter)
    return 0


def _prepare(cfg: JobConfig, show: int = 0) -> int:
    """The token store of every source the run reads (a mixture's entries and the evaluation source included), and
    with `show` the first training samples as the model sees them, targets marked."""
    from fsdp2kit.data.dataset import load_tokenizer
    from fsdp2kit.data.mixture import data_lines, named_as, source_configs, split_samples
    from fsdp2kit.data.samples import marked_text
    from fsdp2kit.data.store import describe, token_store
    from fsdp2kit.models.build import check_data_fits, resolve_model
    from fsdp2kit.models.variant import pick_variant
    from fsdp2kit.train.interrupt import stopping_at_once
    from fsdp2kit.train.loggers import phase

    source = resolve_model(cfg.model, cfg.data.tokenizer)
    tokenizer = load_tokenizer(source.tokenizer_path)
    check_data_fits(source.hf_config, cfg.data.seq_len, tokenizer)
    unstored = pick_variant(source.hf_config, cfg.model, cfg.strategy_args.strategy_config).modality
    said = unstored.read_without_store(cfg.data)
    if said is not None:
        print(said)
        return 0
    for key, data in source_configs(cfg.data):
        with (
            named_as(key),
            stopping_at_once(f"the token store of {data.source} was not written"),
            phase(f"the token store of {data.source}", is_main=True),
        ):
            store = token_store(data, tokenizer)
        print(f"token store {describe(store)}")
    samples, eval_samples = split_samples(cfg.data, tokenizer, cfg.training.seed)  # the stores are built: cheap
    for line in data_lines(samples, eval_samples, cfg.data):
        print(line)
    for index in range(min(show, len(samples))):
        print(f"--- sample {index + 1} of {len(samples)}")
        print(marked_text(samples[index], tokenizer, colour=sys.stdout.isatty()))
    return 0


def _config_command(args: argparse.Namespace, argv: list[str], cfg: JobConfig) -> int:
    """train, infer, check and plan: planned for --nproc ranks, launched as that many, or run in this process."""
    nproc = args.nproc
    if nproc is None and cfg.device_mapping and not _under_launcher():
        nproc = len(cfg.device_mapping)
    if nproc is not None and nproc < 1:
        raise UserError(f"--nproc {nproc}: give a number of ranks >= 1")
    if args.command == "plan":
        return _plan(args, nproc or int(os.environ.get("WORLD_SIZE", "1")))
    if nproc and nproc > 1 and not _under_launcher():
        from fsdp2kit.models.sharded import check_expert_parallel
        from fsdp2kit.parallel.mesh import mesh_layout

        model = cfg.model  # the mesh must exist: fail before spawning
        check_expert_parallel(nproc, model, cfg.strategy_args.strategy_config, cfg.data)
        mesh_layout(nproc, cfg.strategy_args.strategy_config, model.ulysses_size, model.context_parallel_size)
        return _launch(nproc, argv, Path(cfg.training.output_dir), args.command)
    return _run_rank(args, cfg)


if __name__ == "__main__":
    raise SystemExit(main())
