"""Peak memory of loading and exporting a model of >= 200 MB: it must stay well below world_size x model size.

Prints one JSON object. Run: .venv/bin/python benchmarks/load_export_memory.py [--nproc 2]
Each figure is the peak resident set of the largest process of the command (the launcher and its ranks),
minus the same command's peak on a 2-layer model of the same family (Python, torch and transformers themselves).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from test_infer import make_hf_folder  # noqa: E402  (the tests' own HF-folder builder)

from fsdp2kit.models import builtin  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def peak_rss_of(args: list[str]) -> int:
    """Run `python -m fsdp2kit ARGS` in a fresh interpreter that reports its children's peak RSS."""
    probe = (
        "import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024); sys.exit(r.returncode)"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-c", probe, sys.executable, "-m", "fsdp2kit", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        raise SystemExit(result.stderr)
    return int(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nproc", type=int, default=2)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="fsdp2kit-mem-"))
    big = dict(
        hidden_size=768, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=12, num_key_value_heads=4
    )
    builtin.BUILTIN_MODELS["bench-llama"] = {**builtin.BUILTIN_MODELS["tiny-llama"], **big}
    data = work / "data.jsonl"
    data.write_text("".join(json.dumps({"text": f"sample {i} " * 20}) + "\n" for i in range(8)))

    figures: dict = {"nproc": args.nproc}
    for label, layers in (("baseline", 2), ("model", big["num_hidden_layers"])):
        folder = work / f"hf-{label}"
        make_hf_folder(folder, "bench-llama", layers=layers)
        size = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
        common = ["--set", f"model.name_or_path={folder}", "--set", f"data.source={data}", "--set", "data.seq_len=32"]
        load = peak_rss_of(
            [
                "infer",
                "examples/demo.yaml",
                "--nproc",
                str(args.nproc),
                *common,
                "--set",
                f"training.output_dir={work / ('infer-' + label)}",
            ]
        )
        run = work / f"train-{label}"
        train = peak_rss_of(
            [
                "train",
                "examples/demo.yaml",
                "--nproc",
                str(args.nproc),
                *common,
                "--set",
                "training.max_steps=1",
                "--set",
                "training.per_device_train_batch_size=1",
                "--set",
                "training.gradient_accumulation_steps=1",
                "--set",
                f"training.output_dir={run}",
            ]
        )
        convert = peak_rss_of(
            ["convert", str(run / "checkpoints" / "step_1"), str(work / f"conv-{label}"), "--to", "hf"]
        )
        figures[label] = {
            "weights_bytes": size,
            "infer_load_peak": load,
            "train_1_step_with_export_peak": train,
            "convert_dcp_to_hf_peak": convert,
        }
    model_bytes = figures["model"]["weights_bytes"] - figures["baseline"]["weights_bytes"]
    for key in ("infer_load_peak", "train_1_step_with_export_peak", "convert_dcp_to_hf_peak"):
        extra = figures["model"][key] - figures["baseline"][key]
        figures[f"{key}_over_baseline_bytes"] = extra
        figures[f"{key}_over_baseline_vs_model_size"] = round(extra / model_bytes, 3)
    figures["extra_weights_bytes"] = model_bytes
    figures["world_x_model_bytes"] = args.nproc * figures["model"]["weights_bytes"]
    print(json.dumps(figures, indent=2))
    shutil.rmtree(work)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
