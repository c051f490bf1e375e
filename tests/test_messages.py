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
