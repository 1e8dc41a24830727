"""bench_serve.py's token check fires: a real strata-launch --port on a CPU rank answers every
request, and the reference of one prompt (its tokens run alone) is altered by one token after the
server gave it, so the concurrent stream of that prompt no longer matches it. The record names
that stream, the arm says its tokens are not those alone, and the script exits 1 saying so."""
from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_serve  # noqa: E402
from record_check import check_record  # noqa: E402
from records import model_facts  # noqa: E402


def test_a_stream_unlike_its_prompt_alone_is_reported(tmp_path, monkeypatch, capsys):
    from strata_dist.synth import write_synthetic
    model = tmp_path / "tiny.gguf"
    write_synthetic(str(model), like="tiny", quant="q8_0", popularity="zipf:1.0", seed=0)
    vocab = model_facts(str(model))["vocab"]
    prompt_tokens, tokens = 16, 6
    second = bench_serve.prompt_ids(prompt_tokens, bench_serve.prompt_seed(1), vocab)
    real_run_streams, altered = bench_serve.run_streams, []

    def second_prompt_alone_altered(server, prompts, new_tokens, order):
        results = real_run_streams(server, prompts, new_tokens, order)
        if prompts == [second]:       # the second prompt run alone: its reference, one token off
            ids = results[0]["tokens"]
            altered.append(ids[:])
            ids[2] = (ids[2] + 1) % vocab
        return results
    monkeypatch.setattr(bench_serve, "run_streams", second_prompt_alone_altered)
    out = tmp_path / "out"
    monkeypatch.setattr(sys, "argv", [
        "bench_serve.py", "--model", str(model), "--cpu", "--streams", "1,2", "--prompt-tokens",
        str(prompt_tokens), "--tokens", str(tokens), "--seed", "3", "--out", str(out)])
    assert bench_serve.main() == 1
    assert len(altered) == 1 and len(altered[0]) == tokens
    [path] = out.glob("serve-tiny-q8_0-*.json")
    record = json.loads(path.read_text())
    assert check_record(record, str(path)) == []
    one, two = record["arms"]
    # one stream (the first prompt) matches; of two streams, the second prompt's does not
    assert one["tokens_identical_to_alone"] is True and one["streams_differing"] == []
    assert two["tokens_identical_to_alone"] is False and two["streams_differing"] == [1]
    said = capsys.readouterr()
    assert "of streams [1] DIFFER from alone" in said.out
    assert "tokens: some streams' tokens DIFFER from their prompts' alone" in said.err
