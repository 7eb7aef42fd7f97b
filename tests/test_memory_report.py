"""`loraplex memory-plan`: its Markdown and JSON state the plan's own figures (model/memory_plan.py), refuse
a split by naming its reason, and say which tensor-parallel sizes fit which card."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from loraplex.bench.presets import PRESETS
from loraplex.cli import main
from loraplex.model.config import DecoderConfig
from loraplex.model.memory_plan import Card, LoraSpec, plan_rank
from loraplex.model.presets import PUBLISHED

GIB = 1 << 30
MEMORY_DOC = Path(__file__).resolve().parents[1] / "docs" / "MEMORY.md"
# A table pasted into the doc: the command's arguments, then its output verbatim.
PASTED = re.compile(r"<!-- loraplex memory-plan(.*?) -->\n(.*?)<!-- end of loraplex memory-plan -->", re.S)


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    assert main(["memory-plan", *args]) == 0
    return capsys.readouterr().out


def test_the_markdown_rows_are_the_plans_figures_in_gib(capsys: pytest.CaptureFixture[str]) -> None:
    out = _run(capsys, "--model", "Llama-3.3-70B", "--tp", "2,8", "--rank", "16", "--slots", "4")
    config = DecoderConfig.from_hf(PUBLISHED["Llama-3.3-70B"])
    for tp in (2, 8):
        plan = plan_rank(config, tp, 2, LoraSpec(16), 4, 32768)
        sizes = (plan.base, plan.adapter, plan.optimizer, plan.kv, plan.total)
        figures = " | ".join(f"{size / GIB:.1f}" for size in sizes)
        assert f"| {tp} | {figures} | " in out
    assert "### Llama-3.3-70B (70.55B parameters)" in out
    assert "4 slots of LoRA rank 16 on attn, mlp, unembed; a KV cache of 32768 tokens" in out
    # At T = 2 a rank needs 81.2 GiB: 1.6 more than an 80 GB card's 79.6, and its 65.7 GiB of base and 5.0
    # of KV cache leave no room for a slot within the 16 GiB of headroom; 20 slots of 2.6 fit in 141 GB.
    row = "| 2 | 65.7 | 2.1 | 8.4 | 5.0 | 81.2 | no: 1.6 short, 0 slots | yes: 59.2 free, 20 slots |"
    assert row in out
    assert "| Llama-3.3-70B | T = 8 | T = 2, 8 |" in out


def test_a_split_the_rules_refuse_is_a_row_that_says_why(capsys: pytest.CaptureFixture[str]) -> None:
    out = _run(capsys, "--model", "Qwen3-235B-A22B", "--tp", "4,8")
    assert "| 8 | T = 8 does not divide the 4 KV heads | | | | | | |" in out
    assert (
        "| Qwen3-235B-A22B | none of T = 4 (T = 8 does not divide the 4 KV heads) "
        "| none of T = 4 (T = 8 does not divide the 4 KV heads) |"
    ) in out


def test_json_carries_the_exact_bytes_and_each_cards_verdict(capsys: pytest.CaptureFixture[str]) -> None:
    args = ("--model", "Qwen3-30B-A3B", "--tp", "1,4,8", "--targets", "attn,unembed", "--kv-tokens", "0")
    report = json.loads(_run(capsys, *args, "--json", "--card", "B200=183359", "--headroom-gib", "8"))
    assert (report["targets"], report["kv_tokens"], report["headroom_bytes"]) == (
        ["attn", "unembed"],
        0,
        8 * GIB,
    )
    assert report["cards"] == {"B200": 183359 << 20}
    (model,) = report["models"]
    config = DecoderConfig.from_hf(PUBLISHED["Qwen3-30B-A3B"])
    one, four, eight = model["ranks"]
    plan = plan_rank(config, 4, 2, LoraSpec(32, frozenset({"attn", "unembed"})), 8, 0)
    assert four["base_bytes"] == plan.base and four["adapter_bytes"] == plan.adapter
    assert (four["optimizer_bytes"], four["kv_bytes"], four["total_bytes"]) == (plan.optimizer, 0, plan.total)
    assert four["slot_parameters"] == plan.slot.parameters
    card = Card("B200", 183359 << 20)
    assert four["cards"]["B200"] == {
        "fits": True,
        "free_bytes": plan.free_bytes(card),
        "slots_that_fit": plan.slots_that_fit(card, 8 * GIB),
    }
    assert one["base_bytes"] == plan_rank(config, 1, 2, LoraSpec(32), 8, 0).base
    assert eight == {"tp": 8, "refused": "T = 8 does not divide the 4 KV heads"}
    assert model["parameters"] == 30_532_122_624


def test_a_model_directory_is_planned_from_its_config_json(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    model = tmp_path / "my-model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(PRESETS["smoke"]))
    out = _run(capsys, "--model", str(model), "--tp", "1,2", "--dtype", "fp32", "--kv-tokens", "10")
    plan = plan_rank(DecoderConfig.from_hf(PRESETS["smoke"]), 2, 4, LoraSpec(32), 8, 10)
    assert "### my-model (" in out and "the base in fp32" in out
    assert f"| 2 | {plan.base / GIB:.1f} | " in out


def test_a_bad_model_or_option_is_a_usage_error(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["memory-plan", "--model", str(tmp_path)]) == 2
    assert "is neither a published shape" in capsys.readouterr().err
    (tmp_path / "config.json").write_text(json.dumps({**PRESETS["smoke"], "hidden_act": "gelu"}))
    assert main(["memory-plan", "--model", str(tmp_path)]) == 2
    assert "hidden_act 'gelu' is not supported" in capsys.readouterr().err
    assert main(["memory-plan", "--rank", "0"]) == 2
    for bad in (["--tp", "0"], ["--targets", "attn,lm"], ["--card", "80"]):
        with pytest.raises(SystemExit):
            main(["memory-plan", *bad])


def test_every_table_in_the_memory_doc_is_what_its_command_prints_now(
    capsys: pytest.CaptureFixture[str],
) -> None:
    pasted = PASTED.findall(MEMORY_DOC.read_text())
    assert [args for args, _ in pasted] == [
        "",
        " --model Qwen3-30B-A3B Qwen3-235B-A22B --targets attn,unembed",
    ]
    for args, table in pasted:
        assert _run(capsys, *shlex.split(args)) == table, f"docs/MEMORY.md: rerun loraplex memory-plan{args}"
