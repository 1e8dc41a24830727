"""strata-launch refusals (exit 2, naming both values) and --plan-only output."""
import json
import subprocess
import sys

import pytest

from hf_fixtures import tiny_qwen3moe, write_gguf


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_gguf(tiny_qwen3moe(31, n_layers=4), tmp_path_factory.mktemp("cli") / "m.gguf")


def launch(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "launcher.cli", *args], capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.parametrize("args,needles", [
    (["--cpu-ranks", "1", "--layer-split", "2"], ["--layer-split 2", "2 devices", "has 1"]),
    (["--cpu-ranks", "3", "--layer-split", "3,2"], ["3", "2"]),
    (["--cpu-ranks", "2", "--layer-split", "1,2"], ["stages", "2"]),
    (["--cpu-ranks", "2", "--layer-split", "0"], ["0"]),
    (["--gpus", "0", "--cpu-ranks", "2"], ["--gpus 0", "--cpu-ranks 2"]),
    (["--cpu-ranks", "2", "--vram-budget", "1M,1M,1M"], ["3 values", "2 ranks"]),
    (["--cpu-ranks", "2", "--vram-budget", "12Q"], ["12Q"]),
    (["--cpu-ranks", "2", "--serve", "--prompt-ids", "1,2"], ["--serve", "--prompt-ids"]),
    (["--cpu-ranks", "2", "--serve", "--prompt", "hi"], ["--prompt", "--serve"]),
    (["--cpu-ranks", "2", "--prefill", "0"], ["--prefill 0"]),
    (["--cpu-ranks", "2", "--expert-cache", "-3"], ["-3"]),
    (["--cpu-ranks", "2", "--rejoin"], ["--rejoin", "--serve"]),
    (["--cpu-ranks", "2", "--serve", "--rejoin", "--restart-ranks", "2"],
     ["--rejoin", "--restart-ranks 2"]),
    (["--cpu-ranks", "2", "--serve", "--rejoin", "--backend", "ray"], ["--rejoin", "--backend ray"]),
])
def test_refusals_exit_2_naming_the_values(model, args, needles):
    proc = launch("--model", model, "--plan-only", *args)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("error:") or "\nerror:" in proc.stderr
    for n in needles:
        assert n in proc.stderr, (n, proc.stderr)


def test_a_card_too_small_is_refused_with_both_numbers(model):
    proc = launch("--model", model, "--plan-only", "--cpu-ranks", "2", "--layer-split", "2",
                  "--vram-budget", "16M")
    assert proc.returncode == 2
    assert "MiB" in proc.stderr and "16.0" in proc.stderr, proc.stderr


def test_plan_only_json_is_the_plan_value(model, tmp_path):
    rig = tmp_path / "rig.json"
    rig.write_text(json.dumps([{"name": "a", "total_mib": 4096, "free_mib": 4000},
                               {"name": "b", "total_mib": 4096, "free_mib": 4000,
                                "mem_bandwidth_gbs": 900, "host": "h2"}]))
    proc = launch("--model", model, "--inventory", str(rig), "--layer-split", "2", "--plan-only",
                  "--json")
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    assert [(s["lb"], s["le"]) for s in plan["stages"]] == [(0, 2), (2, 4)]
    assert plan["expert_slots"] >= plan["expert_slots_primary"] > 0
    from strata_dist.plan import Plan
    assert Plan.from_json(proc.stdout).to_dict() == plan
    table = launch("--model", model, "--inventory", str(rig), "--layer-split", "2", "--plan-only")
    assert "expert_slots" in table.stdout and "[0, 2)" in table.stdout


def test_text_prompt_through_the_models_tokenizer(tmp_path):
    """--prompt TEXT: the GGUF's tokenizer in, text out; the same text from one process and from
    a 2-stage launch."""
    from strata_dist.synth import write_synthetic
    path = tmp_path / "tiny.gguf"
    write_synthetic(path, like="tiny", quant="f32", popularity="uniform")
    single = subprocess.run([sys.executable, "-m", "strata_dist.tools.cli", "generate", "--model", str(path),
                             "--prompt", "the cat", "--max-new", "8"], capture_output=True,
                            text=True, timeout=60)
    assert single.returncode == 0, single.stderr
    split = launch("--model", str(path), "--cpu-ranks", "2", "--layer-split", "2", "--prompt",
                   "the cat", "--max-new", "8")
    assert split.returncode == 0, split.stderr
    assert split.stdout == single.stdout and split.stdout.strip()


def test_no_prompt_loans_is_in_the_plan(model):
    args = ["--model", model, "--plan-only", "--json", "--cpu-ranks", "2", "--layer-split", "2"]
    on, off = launch(*args), launch(*args, "--no-prompt-loans")
    assert on.returncode == 0 and off.returncode == 0, (on.stderr, off.stderr)
    notes_on, notes_off = json.loads(on.stdout)["notes"], json.loads(off.stdout)["notes"]
    assert not any("prompt loans are off" in n for n in notes_on)
    assert sum("prompt loans are off" in n for n in notes_off) == 2, notes_off
    assert all(s["loan_slots"] == 0 and s["own_prompt_bytes"] > 0
               for s in json.loads(off.stdout)["stages"])


def test_ranks_listed_on_one_gpu_split_its_free_memory():
    """--gpus 0,0,1: the two ranks of GPU 0 take halves of its free memory (or what a budget
    leaves), GPU 1's rank keeps its own; budgets asking more than the card has are refused."""
    from launcher.layout_flags import UsageError, check_listed_gpus
    from strata_dist.plan import Device, split_shared_cards
    gib = 1 << 30
    free = {0: 80 * gib, 1: 60 * gib}

    def reported(gpus, budgets):     # what each rank's gpu_device(g, budget) tells the coordinator
        check_listed_gpus(gpus, budgets, free)
        out = []
        for i, (g, b) in enumerate(zip(gpus, budgets)):
            cap = int(b[:-1]) * gib if b else None
            total, have = 141 * gib, free[g]
            out.append(Device("h200", min(total, cap or total), min(have, cap or have),
                              index=i, card=f"uuid-{g}"))
        return [d.free_bytes // (1 << 20) for d in split_shared_cards(out)]

    assert reported([0, 0, 1], [None, None, None]) == [40960, 40960, 61440]
    assert reported([0, 1, 0], ["20G", None, None]) == [20480, 61440, 61440]
    assert reported([0, 0], ["30G", "50G"]) == [30720, 51200]
    with pytest.raises(UsageError, match=r"--vram-budget 50G,40G for ranks 0,1, which share GPU 0: 80\.0 GiB"):
        check_listed_gpus([0, 0], ["50G", "40G"], free)
    with pytest.raises(UsageError, match=r"80G,\(a share\)"):
        check_listed_gpus([0, 0], ["80G", None], free)
