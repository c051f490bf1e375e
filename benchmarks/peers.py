"""fsdp2kit against the engines its users would otherwise pick, each driven by its framework's own worker (issue 52
item 3): verl 0.9.1's `FSDPEngineWithLMHead` (verl's `TrainingWorker`, as tests_verl/verl_driver.py drives it) and
ROLL's `FSDP2TrainStrategy` (ROLL's RLVR `ActorWorker`, as tests_roll/roll_worker.py drives it), each against
fsdp2kit behind the same worker, from the same model folder, batches and settings, in the environments
`make test-verl` / `make test-roll` build (this script launches each side with that environment's python); and
transformers' `Trainer` with Accelerate's FSDP2, and TRL's `SFTTrainer` on it, each against fsdp2kit's
`Strategy.train_step` on the same SFT rows (benchmarks/peers_trainer.py, in the main environment with the `bench`
extra, all under torchrun; one optimizer step is the timed call).

The RL engines run two workloads each, their own defaults first (no entropy bonus: verl's `entropy_coeff: 0`, ROLL's
`entropy_loss_coef: 0`), then with the bonus of 0.01 their RL tests train with (`--workloads` picks); every table is
printed under the line of its settings.
Per launch the worker is built, then its two calls are each called twice as the frameworks' trainers call them
(verl: infer_batch (log-probs + entropy), train_mini_batch (two mini-batches, an optimizer step each), again both;
ROLL: compute_log_probs, train_step, again both). Launches alternate fsdp2kit / peer (A/B/A/B, `--repeats` each) at
each world size (2 ranks: torchrun for verl, one process per rank for ROLL, as their tests launch them). Reported:
medians of rank 0's wall time and CPU time (`time.process_time()`) per call, peak RSS per rank (ru_maxrss) and RSS
after setup, and the two sides' agreement: log-probs before the first update and the first update's losses (the
Trainer and TRL arms: log-probs after the first step and its loss). Two
sides that disagree by more than 1e-4 computed different things: their ratios are void (None, with the reason).

Prints one JSON object; ratios are fsdp2kit / peer (< 1: fsdp2kit faster or smaller).

Run: make bench-peers, or
  .venv/bin/python benchmarks/peers.py [--repeats 3] [--world-sizes 1 2] [--frameworks verl roll trainer trl]
      [--workloads defaults "entropy bonus"] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
ROLL_SOURCE = Path(os.environ.get("ROLL_SOURCE", REPO.parent / "shared" / "third_party" / "ROLL"))
TOLERANCE = 1e-4  # beyond it the two sides computed different things
# The issue's model: a 22.6M-parameter Qwen2 (2 layers of 512, 16384-token vocabulary, untied head), fp32.
QWEN2_22M = {
    "vocab_size": 16384,
    "hidden_size": 512,
    "intermediate_size": 1376,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": False,
}
QUICK = {**QWEN2_22M, "vocab_size": 1024, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4}
# 8 rollouts: prompts of up to 128 tokens, responses of up to 384 (rows of up to 512 tokens); quick: 16 + 48.
ROLLOUT = {"prompt": 128, "response": 384}
QUICK_ROLLOUT = {"prompt": 16, "response": 48}
# Each framework: its peer backend's name, its environment, its rank script, the calls timed.
FRAMEWORKS = {
    "verl": {"peer": "fsdp2", "python": ".venv-verl", "script": "peers_verl.py", "path": ["tests_verl"]},
    "roll": {"peer": "roll", "python": ".venv-roll", "script": "peers_roll.py", "path": ["tests_roll"]},
    "trainer": {"peer": "trainer", "python": ".venv", "script": "peers_trainer.py", "path": []},
    "trl": {"peer": "sft_trainer", "python": ".venv", "script": "peers_trainer.py", "path": []},
}
# Each framework's workloads, its own defaults first: the RL engines without an entropy bonus (verl's
# `entropy_coeff: 0`, ROLL's `entropy_loss_coef: 0`; verl's trainer still asks the log-prob call for entropies,
# ROLL's returns them), then with the bonus their RL tests train with (0.01: the update computes entropies too);
# the Trainer and TRL arms have one, SFT.
RL_WORKLOADS = {"defaults": {"entropy_coeff": 0.0}, "entropy bonus": {"entropy_coeff": 0.01}}
WORKLOADS = {"verl": RL_WORKLOADS, "roll": RL_WORKLOADS, "trainer": {"sft": {}}, "trl": {"sft": {}}}
# The Trainer and TRL arms' SFT: per optimizer step 8 rows of up to 256 tokens (prompts without targets, right
# padding) in micro-batches of 2 rows over all ranks, 4 steps per launch; quick: rows of 64 tokens, 2 steps.
SFT = {"rows_per_step": 8, "micro_rows": 2, "length": 256, "steps": 4}
QUICK_SFT = {**SFT, "length": 64, "steps": 2}


# ---- in each rank: what a measured launch records ----


def current_rss() -> int:
    """This process's resident set now, in bytes."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE")


def plain(value: Any) -> Any:
    """A metric as JSON holds it (the frameworks report floats, lists, numpy or torch values)."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, list | tuple):
        return [plain(item) for item in value]
    return float(value)


class Record:
    """One rank's figures: each timed call's wall and CPU seconds, RSS after setup, and what the sides compare."""

    def __init__(self) -> None:
        self.calls: dict[str, list[dict[str, float]]] = {}
        self.rss_after_setup = 0
        self.started = (0.0, 0.0)

    def setup_done(self) -> None:
        self.rss_after_setup = current_rss()

    def begin(self, barrier: Callable[[], Any]) -> None:
        """A timed call starts (after a barrier: every rank starts it together)."""
        barrier()
        self.started = (time.perf_counter(), time.process_time())

    def end(self, name: str) -> None:
        """The call begun last ends: its wall and CPU seconds go to calls[name]."""
        wall, cpu = self.started
        self.calls.setdefault(name, []).append(
            {"wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu}
        )

    def timed(self, name: str, call: Callable[..., Any], barrier: Callable[[], Any]) -> Callable[..., Any]:
        """`call`, timed into calls[name]."""

        def timed_call(*args: Any, **kwargs: Any) -> Any:
            self.begin(barrier)
            result = call(*args, **kwargs)
            self.end(name)
            return result

        return timed_call

    def write(self, out: str, rank: int, log_probs: list, losses: dict[str, Any]) -> None:
        figures = {
            "rank": rank,
            "calls": self.calls,
            "rss_after_setup_bytes": self.rss_after_setup,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "log_probs": log_probs,
            "losses": {key: plain(value) for key, value in losses.items()},
        }
        Path(f"{out}.rank{rank}.json").write_text(json.dumps(figures))


# ---- the summary: pure, tested in tests/test_bench_peers.py ----


def _flat(value: Any) -> list[float]:
    if isinstance(value, list | tuple):
        return [x for item in value for x in _flat(item)]
    return [float(value)]


def largest_difference(ours: Any, theirs: Any) -> float:
    """The largest |a - b| over two nested lists (or dicts of them) of the same shape; inf where shapes differ."""
    if isinstance(ours, dict):
        if set(ours) != set(theirs) or not ours:
            return float("inf")
        return max(largest_difference(ours[key], theirs[key]) for key in ours)
    a, b = _flat(ours), _flat(theirs)
    if len(a) != len(b):
        return float("inf")
    return max((abs(x - y) for x, y in zip(a, b, strict=True)), default=0.0)


def agreement(ours: list[list[dict]], theirs: list[list[dict]]) -> dict[str, Any]:
    """Log-probs before the first update and the first update's losses, rank by rank, over every pair of launches."""
    pairs = [(a, b) for x in ours for y in theirs for a, b in zip(x, y, strict=True)]
    log_probs = max(largest_difference(a["log_probs"], b["log_probs"]) for a, b in pairs)
    losses = max(largest_difference(a["losses"], b["losses"]) for a, b in pairs)
    result: dict[str, Any] = {"log_probs_max_abs_diff": log_probs, "losses_max_abs_diff": losses}
    result["tolerance"] = TOLERANCE
    result["void"] = None
    if not (log_probs <= TOLERANCE and losses <= TOLERANCE):
        result["void"] = (
            f"log-probs differ by {log_probs:.3g}, losses by {losses:.3g} (> {TOLERANCE}): different computations"
        )
    return result


def _ratio(ours: float, theirs: float, void: bool) -> float | None:
    return None if void or not theirs else ours / theirs


def call_figures(launches: list[list[dict]], call: str) -> dict[str, float]:
    """Medians over every timed call of rank 0, across the launches (and of each launch's first call alone: the
    warm-up, also in the medians)."""
    samples = [sample for launch in launches for sample in launch[0]["calls"][call]]
    return {
        "wall_s": statistics.median(s["wall_s"] for s in samples),
        "cpu_s": statistics.median(s["cpu_s"] for s in samples),
        "first_cpu_s": statistics.median(launch[0]["calls"][call][0]["cpu_s"] for launch in launches),
        "samples": len(samples),
    }


def memory_figures(launches: list[list[dict]], key: str) -> list[float]:
    """Per rank, the median over the launches."""
    return [statistics.median(launch[rank][key] for launch in launches) for rank in range(len(launches[0]))]


def summarise(
    peer: str, by_backend: dict[str, list[list[dict]]], settings: dict[str, Any] | None = None
) -> dict[str, Any]:
    """One workload at one world size: {backend: [launch: [rank figures]]} -> medians, ratios fsdp2kit / peer
    (None where the two sides disagree), the agreement, and the `settings` it ran with."""
    ours, theirs = by_backend["fsdp2kit"], by_backend[peer]
    agree = agreement(ours, theirs)
    void = agree["void"] is not None
    result: dict[str, Any] = {"peer": peer, "settings": settings or {}, "agreement": agree, "calls": {}, "memory": {}}
    for call in ours[0][0]["calls"]:
        mine, other = call_figures(ours, call), call_figures(theirs, call)
        result["calls"][call] = {
            "fsdp2kit": mine,
            peer: other,
            "ratio_wall": _ratio(mine["wall_s"], other["wall_s"], void),
            "ratio_cpu": _ratio(mine["cpu_s"], other["cpu_s"], void),
        }
    for key in ("peak_rss_bytes", "rss_after_setup_bytes"):
        mine_rss, other_rss = memory_figures(ours, key), memory_figures(theirs, key)
        result["memory"][key] = {
            "fsdp2kit": mine_rss,
            peer: other_rss,
            "ratio_largest_rank": _ratio(max(mine_rss), max(other_rss), void),
        }
    return result


def headline(results: dict[str, dict[str, dict]]) -> dict[str, dict[str, Any]]:
    """The ratios at a glance: CPU time per call and peak RSS, per workload (`results`' keys) and world size."""
    return {
        f"{workload} @{ranks}": {
            **{f"{call} cpu": figures["ratio_cpu"] for call, figures in result["calls"].items()},
            "peak_rss": result["memory"]["peak_rss_bytes"]["ratio_largest_rank"],
        }
        for workload, by_ranks in results.items()
        for ranks, result in by_ranks.items()
    }


def settings_line(workload: str, settings: dict[str, Any]) -> str:
    """What a table's rows ran with, in one line above them."""
    return f"{workload}: " + ", ".join(f"{key} {value}" for key, value in settings.items())


def table(results: dict[str, dict[str, dict]]) -> str:
    """The summaries as markdown tables, one a workload under the line of its settings (medians of rank 0's seconds
    per call; peak RSS of the largest rank)."""
    show = lambda ratio: "void" if ratio is None else f"{ratio:.3f}"  # noqa: E731
    lines = []
    for framework, by_ranks in results.items():
        lines += [
            "",
            settings_line(framework, next(iter(by_ranks.values()))["settings"]),
            "",
            "| peer | ranks | call | fsdp2kit CPU s | peer CPU s | ratio CPU | fsdp2kit wall s | peer wall s | "
            "ratio wall |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for ranks, result in by_ranks.items():
            peer = result["peer"]
            for call, figures in result["calls"].items():
                ours, theirs = figures["fsdp2kit"], figures[peer]
                lines.append(
                    f"| {framework} | {ranks} | {call} | {ours['cpu_s']:.2f} | {theirs['cpu_s']:.2f} | "
                    f"{show(figures['ratio_cpu'])} | {ours['wall_s']:.2f} | {theirs['wall_s']:.2f} | "
                    f"{show(figures['ratio_wall'])} |"
                )
            for key in ("peak_rss_bytes", "rss_after_setup_bytes"):
                memory, name = result["memory"][key], key.removesuffix("_bytes")
                lines.append(
                    f"| {framework} | {ranks} | {name} MiB | {max(memory['fsdp2kit']) / 2**20:.0f} | "
                    f"{max(memory[peer]) / 2**20:.0f} | {show(memory['ratio_largest_rank'])} | | | |"
                )
            agree = result["agreement"]
            lines.append(
                f"| {framework} | {ranks} | agreement | log-probs {agree['log_probs_max_abs_diff']:.2g}, "
                f"losses {agree['losses_max_abs_diff']:.2g} | | {'void' if agree['void'] else 'ok'} | | | |"
            )
    return "\n".join(lines)


# ---- the launches ----


def env_for(framework: str) -> dict[str, str]:
    """A measured launch's environment: one thread per rank, this checkout first on the path, then the
    framework's driver folder, benchmarks/ and (ROLL) ROLL's source; no launcher variables of our own."""
    path = [str(REPO), *(str(REPO / folder) for folder in FRAMEWORKS[framework]["path"]), str(REPO / "benchmarks")]
    if framework == "roll":
        path.append(str(ROLL_SOURCE))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(path), "ROLL_SOURCE": str(ROLL_SOURCE)}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def python_of(framework: str) -> str:
    return str(REPO / FRAMEWORKS[framework]["python"] / "bin" / "python")


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _check(processes: list[subprocess.Popen], what: str) -> None:
    logs = [process.communicate(timeout=900)[0] for process in processes]
    for process, log in zip(processes, logs, strict=True):
        if process.returncode:
            raise SystemExit(f"{what} failed (exit {process.returncode}):\n{log[-4000:]}")


def make_model(framework: str, folder: Path, shape: dict) -> None:
    """The seeded Qwen2 saved by the framework's own transformers (with fsdp2kit's built-in tokenizer)."""
    code = (
        "import json, shutil, sys, torch\n"
        "from pathlib import Path\n"
        "from transformers import Qwen2Config, Qwen2ForCausalLM\n"
        "from fsdp2kit.data.builtin import tokenizer_dir\n"
        "torch.manual_seed(3)\n"
        "Qwen2ForCausalLM(Qwen2Config(**json.loads(sys.argv[2]))).save_pretrained(sys.argv[1])\n"
        "for f in tokenizer_dir().iterdir(): shutil.copy(f, Path(sys.argv[1]) / f.name)\n"
    )
    command = [python_of(framework), "-c", code, str(folder), json.dumps(shape)]
    _check(
        [
            subprocess.Popen(
                command, env=env_for(framework), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        ],
        "making the model",
    )


def launch(framework: str, backend: str, ranks: int, settings: dict, out: Path) -> list[dict]:
    """One measured launch of `backend` behind `framework`'s worker at `ranks` ranks; each rank's figures."""
    script = str(REPO / "benchmarks" / FRAMEWORKS[framework]["script"])
    config = json.dumps({**settings, "backend": backend, "out": str(out), "ranks": ranks, "port": free_port()})
    env, processes = env_for(framework), []
    # verl at 2 ranks as tests_verl/test_verl_worker.py launches verl's driver; the Trainer as its users launch it
    if (framework == "verl" and ranks > 1) or framework in ("trainer", "trl"):
        command = [python_of(framework), "-m", "torch.distributed.run", "--nproc-per-node", str(ranks)]
        command += ["--master-port", str(free_port()), script, config]
        processes.append(
            subprocess.Popen(
                command, env=env, cwd=out.parent, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    elif framework == "verl":
        processes.append(
            subprocess.Popen(
                [python_of(framework), script, config],
                env=env,
                cwd=out.parent,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    else:  # as tests_roll/test_roll_real.py:run_ranks launches ROLL's worker: one process per rank, ROLL's variables
        port = free_port()
        for rank in range(ranks):
            rank_env = {
                **env, "RANK": str(rank), "WORLD_SIZE": str(ranks), "LOCAL_RANK": str(rank),
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORKER_NAME": f"actor_train-{rank}",
                "CLUSTER_NAME": "actor_train",
            }  # fmt: skip
            command = [python_of(framework), script, config]
            processes.append(
                subprocess.Popen(
                    command, env=rank_env, cwd=out.parent, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
                )
            )
    _check(processes, f"{framework} {backend} at {ranks} rank(s)")
    return [json.loads(Path(f"{out}.rank{rank}.json").read_text()) for rank in range(ranks)]


def workload_settings(framework: str, workload: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """What a workload's launches run with, as its table prints it."""
    model = QUICK if args.quick else QWEN2_22M
    shape = f"Qwen2 {model['num_hidden_layers']} x {model['hidden_size']}, vocabulary {model['vocab_size']}, fp32"
    if framework in ("trainer", "trl"):
        sft = QUICK_SFT if args.quick else SFT
        return {"model": shape, **sft, "recompute": False, "repeats": args.repeats}
    rollout = QUICK_ROLLOUT if args.quick else ROLLOUT
    settings = {"model": shape, "rollouts": f"8 x ({rollout['prompt']} + {rollout['response']}) tokens"}
    settings.update(workload if framework == "verl" else {"entropy_loss_coef": workload["entropy_coeff"]})
    if framework == "verl":
        settings["max_token_len_per_gpu"] = args.max_tokens
        settings["update computes entropy"] = workload["entropy_coeff"] != 0
    settings["recompute"] = framework == "verl" or not args.roll_no_recompute
    return {**settings, "repeats": args.repeats}


def measure(framework: str, args: argparse.Namespace, workdir: Path) -> dict[str, dict[str, dict]]:
    """Every workload and world size: fsdp2kit and the peer alternately, `repeats` launches each; the summaries by
    "framework, workload" and world size."""
    peer = FRAMEWORKS[framework]["peer"]
    if framework == "roll" and not (ROLL_SOURCE / "roll").is_dir():
        raise SystemExit(f"peers: no ROLL snapshot at {ROLL_SOURCE} (set ROLL_SOURCE=..., or --frameworks verl)")
    folder = workdir / framework / "model"
    folder.parent.mkdir(parents=True)
    make_model(framework, folder, QUICK if args.quick else QWEN2_22M)
    base = {"model": str(folder), **(QUICK_ROLLOUT if args.quick else ROLLOUT), "max_tokens": args.max_tokens}
    base["roll_recompute"] = not args.roll_no_recompute
    base["sft"] = QUICK_SFT if args.quick else SFT
    results: dict[str, dict[str, dict]] = {}
    for name, workload in WORKLOADS[framework].items():
        if args.workloads and name not in args.workloads and len(WORKLOADS[framework]) > 1:
            continue
        settings, by_ranks = {**base, **workload}, {}
        for ranks in args.world_sizes:
            launches: dict[str, list[list[dict]]] = {"fsdp2kit": [], peer: []}
            for repeat in range(args.repeats):
                for backend in launches:
                    out = workdir / framework / f"{name.replace(' ', '_')}-{backend}-{ranks}-{repeat}"
                    launches[backend].append(launch(framework, backend, ranks, settings, out))
                    print(f"{framework} {name} {backend} ranks {ranks} repeat {repeat}: done", file=sys.stderr)
            by_ranks[str(ranks)] = summarise(peer, launches, workload_settings(framework, workload, args))
        results[f"{framework}, {name}"] = by_ranks
    return results


def load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--frameworks", nargs="+", choices=list(FRAMEWORKS), default=list(FRAMEWORKS))
    parser.add_argument("--max-tokens", type=int, default=1024, help="verl's max_token_len_per_gpu (dynamic batch)")
    parser.add_argument(
        "--workloads", nargs="+", choices=list(RL_WORKLOADS), help="the RL engines' workloads (default: both)"
    )
    parser.add_argument(
        "--roll-no-recompute",
        action="store_true",
        help="ROLL's actor with disable_gradient_checkpointing: true (tests_roll's YAML) instead of ROLL's default",
    )
    parser.add_argument("--quick", action="store_true", help="a tiny model and short rollouts, one repeat: a smoke run")
    args = parser.parse_args()
    if args.quick:
        args.repeats = 1
    return args


def main() -> None:
    args = parse_args()
    before = load_average()
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="fsdp2kit-peers-") as workdir:
        for framework in args.frameworks:
            results.update(measure(framework, args, Path(workdir)))
    report = {
        "benchmark": "peers",
        "model": QUICK if args.quick else QWEN2_22M,
        "rollouts": {"rows": 8, **(QUICK_ROLLOUT if args.quick else ROLLOUT)},
        "repeats": args.repeats,
        "sft": QUICK_SFT if args.quick else SFT,
        "nproc": os.cpu_count(),
        "loadavg": {"before": before, "after": load_average()},
        "headline_ratios_fsdp2kit_over_peer": headline(results),
        "workloads": results,
    }
    print(table(results), file=sys.stderr)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
