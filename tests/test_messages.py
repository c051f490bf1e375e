"""Messages that named the wrong thing (issue 34's fourth pass): each refusal names the key the user wrote and what
the path really is."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fsdp2kit.cli import main

DEMO = "examples/demo.yaml"


def _empty(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("")
    return path


def _context_only(tmp_path):
    """Conversations whose every assistant turn has loss_weight 0: context only."""
    path = tmp_path / "context.jsonl"
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo", "loss_weight": 0}]
    path.write_text((json.dumps({"messages": turns}) + "\n") * 2)
    return path


def _own_code(tmp_path, auto_class: str, class_ref: str, code: str):
    """A tiny Llama folder whose config.json names its own code for `auto_class` (auto_map), and that code."""
    from conftest import make_hf_folder

    folder = tmp_path / "model"
    make_hf_folder(folder, "tiny-llama")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "auto_map": {auto_class: class_ref}}))
    (folder / "mine.py").write_text(code)
    return folder


def _trusted_check(folder) -> list[str]:
    return ["check", DEMO, "--set", f"model.name_or_path={folder}", "--trust-remote-code"]


OWN_CODE = "model.name_or_path: the model's own code {} (config.json's auto_map, trusted by --trust-remote-code) "
OWN_CODE += "cannot build it: "

CHATML = Path(__file__).parent / "fixtures" / "chat_templates" / "chatml.jinja"

# case: (command line from tmp_path, the one error line)
MESSAGES = {
    "config_is_a_folder": (lambda t: ["check", str(t)], "config file '{t}' is a folder, not a file"),
    "config_is_a_device": (
        lambda t: ["check", "/dev/zero"],
        "config file '/dev/zero' is not a regular file (a device, pipe or socket)",
    ),
    "source_is_a_device": (
        lambda t: ["check", DEMO, "--set", "data.source=/dev/zero"],
        "data.source: '/dev/zero' is not a regular file (a device, pipe or socket)",
    ),
    "source_lists_a_folder": (
        lambda t: ["check", DEMO, "--set", f"data.source=[{t}]"],
        "data.source: '{t}' is a folder, not a file",
    ),
    "eval_source_missing": (
        lambda t: ["check", DEMO, "--set", f"data.eval_source={t / 'gone.jsonl'}"],
        "data.eval_source: no such file '{t}/gone.jsonl'",
    ),
    "eval_source_empty_list": (
        lambda t: ["check", DEMO, "--set", "data.eval_source=[]"],
        "data.eval_source: an empty list names no file",
    ),
    "eval_source_empty_file": (
        lambda t: ["prepare", DEMO, "--set", f"data.eval_source={_empty(t)}", "--set", f"data.cache_dir={t}"],
        "data.eval_source: '{t}/empty.jsonl' is empty (no documents)",
    ),
    "no_trained_turn": (
        lambda t: (
            ["prepare", DEMO, "--set", f"data.source={_context_only(t)}", "--set", f"data.cache_dir={t}"]
            + ["--set", f"data.chat_template={CHATML}"]
        ),
        "data.source: none of its 2 conversations has a token to train on (no assistant turn, or every one with "
        "loss_weight 0); nothing is left to train",
    ),
    # A broken auto_map under --trust-remote-code was a traceback from inside transformers or the folder's code.
    "own_code_file_missing": (
        lambda t: _trusted_check(_own_code(t, "AutoModelForCausalLM", "gone.MyLlama", "")),
        OWN_CODE.format("gone.MyLlama") + "OSError: {t}/model does not appear to have a file named gone.py.",
    ),
    "own_code_raises": (
        lambda t: _trusted_check(_own_code(t, "AutoModelForCausalLM", "mine.MyLlama", "raise RuntimeError('no')")),
        OWN_CODE.format("mine.MyLlama") + "RuntimeError: no",
    ),
    "own_config_raises": (
        lambda t: _trusted_check(_own_code(t, "AutoConfig", "mine.MyConfig", "raise ImportError('no torch 3')")),
        OWN_CODE.format("mine.MyConfig") + "ImportError: no torch 3",
    ),
}


@pytest.mark.parametrize("case", list(MESSAGES))
def test_a_refusal_names_the_key_and_what_the_path_is(tmp_path, capsys, case):
    argv, message = MESSAGES[case]
    assert main(argv(tmp_path)) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert errors == [f"error: {message.format(t=tmp_path)}"]


def test_a_pickled_rng_file_is_refused_without_torchs_advice_to_unpickle_it(tmp_path):
    """torch's refusal ended with how to pass weights_only=False: the one thing not to do with a crafted file."""
    import pickle

    from test_robustness import _CreatesFile

    from fsdp2kit.checkpoint.manager import read_rng_file
    from fsdp2kit.errors import UserError

    rng_file, marker = tmp_path / "rng_rank0.pt", tmp_path / "pwned"
    rng_file.write_bytes(pickle.dumps(_CreatesFile(marker)))
    with pytest.raises(UserError) as refused:
        read_rng_file(rng_file)
    message = str(refused.value)
    assert message.startswith(f"training.resume: '{rng_file}' holds pickled objects other than tensors; refusing")
    assert "weights_only" not in message and "\n" not in message and not marker.exists()
