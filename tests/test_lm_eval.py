"""lm-evaluation-harness (its `local-completions` model) against `strata-launch --port` on the
tiny CPU model: a loglikelihood (multiple-choice) task and a generate task, both local task files
over a local jsonl (nothing downloaded). The loglikelihoods it reports equal a numpy log-softmax of
the single-process forward's logits within 1e-4; its generations are the reference's greedy text.
Skips when lm_eval is not importable (it is not in the `test` extra)."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("lm_eval")

from server_helpers import ServerProcess                    # noqa: E402
from strata_dist.tools.single_process import SingleProcessRunner  # noqa: E402
from strata_dist.synth import write_synthetic               # noqa: E402
from strata_dist.gguf_file.tokenizer import GGUFTokenizer             # noqa: E402

RANK_ARGS = ("--cpu-ranks", "2", "--layer-split", "2", "--vram-budget", "1G", "--max-context", "4096",
             "--gpu-order", "as_given", "--prefill", "8")
DOCS = [
    {"question": "The sky is", "choices": [" blue", " green", " made of cheese"], "answer": 0},
    {"question": "Two and two make", "choices": [" four", " five"], "answer": 0},
    {"question": "Water is", "choices": [" wet", " dry", " loud"], "answer": 0},
]
MC_TASK = """task: strata_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""
GEN_TASK = """task: strata_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{choices[0]}}}}"
generation_kwargs:
  until: ["\\n\\n"]
  max_gen_toks: 6
  do_sample: false
metric_list:
  - metric: exact_match
"""
MAX_GEN = 6

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]


def log_softmax(x: np.ndarray) -> np.ndarray:
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def test_lm_eval_loglikelihood_and_generate(tmp_path: Path):
    model = tmp_path / "tiny.gguf"
    write_synthetic(model, like="tiny", quant="f32", popularity="zipf:1.0")
    tok = GGUFTokenizer.from_gguf(str(model))
    # the model's own tokenizer as a local Hugging Face tokenizer directory (lm-eval tokenizes
    # the requests itself and sends token ids)
    hf_dir = tmp_path / "hf_tokenizer"
    hf_dir.mkdir()
    tok.tk.save(str(hf_dir / "tokenizer.json"))
    (hf_dir / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 4096}))
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "strata_mc.yaml").write_text(MC_TASK.format(data=data))
    (tasks / "strata_gen.yaml").write_text(GEN_TASK.format(data=data))
    out = tmp_path / "out"
    lm_eval = shutil.which("lm_eval", path=os.path.dirname(sys.executable)) or shutil.which("lm_eval")
    argv = [lm_eval] if lm_eval else [sys.executable, "-m", "lm_eval"]
    server = ServerProcess(str(model), *RANK_ARGS)
    try:
        run = subprocess.run(
            argv + ["--model", "local-completions", "--model_args",
                    f"model=tiny,base_url={server.url}/v1/completions,tokenizer_backend=huggingface,"
                    f"tokenizer={hf_dir},num_concurrent=1,max_retries=1,tokenized_requests=True",
                    "--batch_size", "2",     # batched prompts: a list of prompts per request
                    "--tasks", "strata_mc,strata_gen", "--include_path", str(tasks),
                    "--output_path", str(out), "--log_samples"],
            capture_output=True, text=True, timeout=150,
            env=dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1",
                     TRANSFORMERS_OFFLINE="1", HF_DATASETS_CACHE=str(tmp_path / "hf_cache")))
    finally:
        assert server.close() in (0, 130, -signal.SIGTERM)
    assert run.returncode == 0, run.stderr[-4000:]
    samples = {p.name.split("_strata_")[1].split("_")[0]: [json.loads(x) for x in p.read_text().splitlines()]
               for p in out.rglob("samples_*.jsonl")}
    assert set(samples) == {"mc", "gen"}, list(out.rglob("*"))

    from transformers import AutoTokenizer
    hf_tok = AutoTokenizer.from_pretrained(str(hf_dir))
    runner = SingleProcessRunner(str(model))
    checked = 0
    for s in samples["mc"]:
        doc = s["doc"]
        for args, resp in zip(s["arguments"].values(), s["resps"]):
            # lm-eval's split: a context's trailing spaces go to the continuation; the context's
            # ids, then what the whole text adds after them
            text, choice = args["arg_0"], args["arg_1"]
            stripped = text.rstrip(" ")
            text, choice = stripped, text[len(stripped):] + choice
            whole = hf_tok(text + choice, add_special_tokens=False)["input_ids"]
            context = hf_tok(text, add_special_tokens=False)["input_ids"]
            cont = whole[len(context):]
            lsm = log_softmax(runner.logits(whole).astype(np.float64))
            want = sum(lsm[len(context) - 1 + i, t] for i, t in enumerate(cont))
            greedy = all(int(np.argmax(lsm[len(context) - 1 + i])) == t for i, t in enumerate(cont))
            got_ll, got_greedy = resp[0]
            assert abs(float(got_ll) - want) <= 1e-4, (doc, choice, got_ll, want)
            assert str(got_greedy) == str(greedy)     # the sample log writes them as text
            checked += 1
    assert checked == sum(len(d["choices"]) for d in DOCS)
    for s in samples["gen"]:
        ids = hf_tok(s["doc"]["question"], add_special_tokens=False)["input_ids"]
        gen: list[int] = []
        while len(gen) < MAX_GEN:
            t = int(np.argmax(runner.logits(ids + gen)[-1]))
            if t in tok.stop_ids:
                break
            gen.append(t)
        want = tok.decode(gen).split("\n\n")[0]
        assert s["resps"][0][0] == want, (s["doc"], s["resps"], want)
