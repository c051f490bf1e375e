"""Data at any scale: a 2-step, 2-rank training run of the demo model on jsonl corpora of about 4, 40 and 400 MB,
each run twice — cold (no token store, no `datasets` cache) and warm (both present) — with every rank's peak RSS
and the run's wall time; and the cold store build's tokens/s against a single-process `tokenizer(batch)` loop over
the same texts, run as a user's loop runs (the tokenizer's default thread pool) and on one thread.

Prints one JSON object. Run: .venv/bin/python benchmarks/data_scaling.py [--sizes-mb 4,40,400] [--workdir DIR]
Peak RSS per rank is each rank process's VmHWM, sampled from /proc every 0.1 s while the run lasts (processes a rank
forks to tokenize are reported apart, as `build_workers_peak_rss_mb`). Targets (issue 11): warm peak RSS per rank
grows by <= 100 MB from the smallest corpus to the largest; the warm largest run takes <= 10 s longer than the warm
smallest one; the cold build is >= 1.6x the single-process loop's tokens/s with 2 cores (the default loop).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MB = 1_000_000


def write_corpus(path: Path, size_mb: int) -> int:
    """A jsonl of the built-in corpus's documents, numbered so no two lines are equal, of about `size_mb` MB."""
    from fsdp2kit.data.builtin import corpus_documents

    documents = corpus_documents()
    written, index = 0, 0
    with path.open("w") as handle:
        while written < size_mb * MB:
            line = json.dumps({"text": f"{index}. {documents[index % len(documents)]}"}) + "\n"
            handle.write(line)
            written += len(line.encode())
            index += 1
    return index


def _proc(pid: int, name: str) -> str:
    try:
        return Path(f"/proc/{pid}/{name}").read_text(errors="replace")
    except OSError:
        return ""


def _descendants(root: int) -> dict[int, int]:
    """pid -> parent pid of every process under `root`."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            stat = _proc(int(entry.name), "stat")
            if stat:
                parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = {}, [root]
    while frontier:
        parent = frontier.pop()
        for pid, ppid in parents.items():
            if ppid == parent and pid not in found:
                found[pid] = ppid
                frontier.append(pid)
    return found


def _peak_rss_mb(pid: int) -> float | None:
    for line in _proc(pid, "status").splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024 / MB
    return None


def train_run(source: Path, cache: Path, out: Path, hf_cache: Path) -> dict:
    """`fsdp2kit train examples/demo.yaml --nproc 2` for 2 steps; wall time and each rank's peak RSS."""
    command = [sys.executable, "-m", "fsdp2kit", "train", "examples/demo.yaml", "--nproc", "2"]
    for setting in (
        f"data.source={source}",
        f"data.cache_dir={cache}",
        "training.max_steps=2",
        "training.save_steps=0",
        "training.export_hf=false",
        "training.report_to=[]",
        f"training.output_dir={out}",
    ):
        command += ["--set", setting]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_DATASETS_CACHE": str(hf_cache)}
    started = time.perf_counter()
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ranks: dict[int, float] = {}
    workers: dict[int, float] = {}
    while process.poll() is None:
        tree = _descendants(process.pid)
        for pid, ppid in tree.items():
            if "LOCAL_RANK=" not in _proc(pid, "environ"):
                continue
            peak = _peak_rss_mb(pid)
            if peak is None:
                continue
            # a rank's parent is the launcher; a process whose parent is a rank tokenizes for it
            target = workers if ppid in tree and "LOCAL_RANK=" in _proc(ppid, "environ") else ranks
            target[pid] = max(target.get(pid, 0.0), peak)
        time.sleep(0.1)
    wall = time.perf_counter() - started
    stdout, stderr = process.communicate()
    if process.returncode != 0:
        raise SystemExit(f"training failed on {source}:\n{stderr[-3000:]}")
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {
        "wall_s": round(wall, 2),
        "peak_rss_mb_per_rank": sorted(round(v, 1) for v in ranks.values()),
        "build_workers_peak_rss_mb": sorted(round(v, 1) for v in workers.values()),
        "data_time_s": [round(m["data_time"], 4) for m in metrics],
        "step_time_s": [round(m["step_time"], 3) for m in metrics],
        "built_store": "token store:" in stdout,
    }


def single_process_loop(source: Path, hf_cache: Path, tokenizer_threads: bool) -> dict:
    """The baseline: one process tokenizing the same texts with `tokenizer(batch)`, 1000 documents a call, with the
    tokenizer's default thread pool (as a user's loop runs) or with TOKENIZERS_PARALLELISM=false (one core)."""
    code = f"""
import json, os, time
os.environ["HF_DATASETS_CACHE"] = {str(hf_cache)!r}
import datasets
from transformers import AutoTokenizer
from fsdp2kit.data.builtin import tokenizer_dir
datasets.disable_progress_bars()
texts = datasets.load_dataset("json", data_files=[{str(source)!r}], split="train")
tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir())
started, tokens = time.perf_counter(), 0
for start in range(0, len(texts), 1000):
    tokens += sum(len(ids) + 1 for ids in tokenizer(texts[start : start + 1000]["text"])["input_ids"])
seconds = time.perf_counter() - started
print(json.dumps({{"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}}))
"""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "true" if tokenizer_threads else "false"}
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(result.stderr[-3000:])
    return json.loads(result.stdout.strip().splitlines()[-1])


def store_meta(cache: Path) -> dict:
    (meta,) = [json.loads(p.read_text()) for p in cache.glob("*/meta.json")]
    return {k: meta[k] for k in ("documents", "tokens", "text_bytes", "build_seconds", "tokens_per_s", "workers")}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes-mb", default="4,40,400")
    parser.add_argument("--workdir", default=None, help="where corpora and stores go (default: a temp folder)")
    parser.add_argument("--baseline-max-mb", type=int, default=40, help="largest corpus the 1-process loop reads")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes_mb.split(",")]
    root = Path(args.workdir or tempfile.mkdtemp(prefix="fsdp2kit-data-scaling-"))
    root.mkdir(parents=True, exist_ok=True)
    results: dict = {"machine": f"{os.cpu_count()} CPUs", "corpora": {}}
    for size in sizes:
        folder = root / f"{size}mb"
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir()
        source = folder / "corpus.jsonl"
        documents = write_corpus(source, size)
        cache, hf_cache = folder / "tokens", folder / "hf-datasets"
        entry: dict = {"bytes": source.stat().st_size, "documents": documents}
        entry["cold"] = train_run(source, cache, folder / "cold", hf_cache)
        entry["store"] = store_meta(cache)
        entry["warm"] = train_run(source, cache, folder / "warm", hf_cache)
        if size <= args.baseline_max_mb:
            for key, threads in (("single_process_loop", True), ("single_process_loop_one_thread", False)):
                entry[key] = single_process_loop(source, hf_cache, threads)
                entry[f"build_speedup_vs_{key}"] = round(entry["store"]["tokens_per_s"] / entry[key]["tokens_per_s"], 2)
        results["corpora"][f"{size}MB"] = entry
        shutil.rmtree(hf_cache, ignore_errors=True)
        print(json.dumps({"progress": f"{size}MB", **entry}), file=sys.stderr, flush=True)
    small, large = results["corpora"][f"{sizes[0]}MB"], results["corpora"][f"{sizes[-1]}MB"]
    results["warm_rss_growth_mb_per_rank"] = round(
        max(large["warm"]["peak_rss_mb_per_rank"]) - max(small["warm"]["peak_rss_mb_per_rank"]), 1
    )
    results["warm_wall_difference_s"] = round(large["warm"]["wall_s"] - small["warm"]["wall_s"], 2)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
