"""Weight sync across processes: a 20-step GRPO-style loop at 1 and 2 trainer ranks whose rollout engine is another
process (tests/weight_sync_worker.py, tests/weight_sync_receiver.py). After every step the rollout's bf16 models
hold the actor's weights cast to bf16, bit for bit, through the gathered full sync, the sharded sync and the delta
sync (sent in the background while a LoRA actor steps); the peft model fed by adapter-only sync gives the LoRA
actor's log-probs to 1e-6. At 2 ranks the rollout process is killed (SIGKILL) in the middle of a delta: the next
syncs go whole, with one line each, and every check holds again."""

from __future__ import annotations

import json

import pytest
from conftest import launch_two_ranks, make_hf_folder

STEPS = 20


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [1, 2])
def test_a_grpo_loop_keeps_its_rollout_process_in_sync(ranks, tmp_path):
    base = tmp_path / "base"
    make_hf_folder(base, "tiny-llama", hidden_size=64, intermediate_size=128, num_attention_heads=4)
    kill_at = [10] if ranks == 2 else []
    launch_two_ranks("weight_sync_worker.py", base, tmp_path / "out.json", STEPS, *kill_at, ranks=ranks, timeout=300)
    result = json.loads((tmp_path / "out.json").read_text())
    records = result["records"]
    assert [r["step"] for r in records] == list(range(STEPS + 1))
    for record in records:
        step = record["step"]
        assert {c: record["versions"][c] for c in ("full", "sharded", "delta")} == dict.fromkeys(
            ("full", "sharded", "delta"), step
        ), record
        assert record["equal"] == {"full": True, "sharded": True, "delta": True}, record
        assert record["logprob_error"] <= 1e-6, record
        stats = record["stats"]
        assert stats["sharded"]["full"] and stats["sharded"]["sent_elements"] == stats["sharded"]["elements"]
        whole = step == 0 or step in kill_at
        assert stats["delta"]["full"] == whole, record
        if not whole:  # the changes only: fewer bytes than the whole blocks
            assert stats["delta"]["bytes"] < stats["sharded"]["bytes"], record
    versions = [r["versions"]["adapter"] for r in records]
    assert versions == sorted(set(versions)), versions  # the LoRA actor's own steps, each reached
    healed = [f"version {kill_at[0]} did not reach the receiver whole"] if kill_at else []
    assert [line.split(" (")[0].removeprefix("weight sync: ") for line in result["warnings"]][: len(healed)] == healed
    assert len(result["warnings"]) == 2 * len(kill_at)  # the delta sync's line and the adapter sync's
