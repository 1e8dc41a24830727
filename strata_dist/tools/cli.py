"""`strata-dist`: the single-process tools — synth, logits, generate, profile, calibrate.

Bad input (a malformed model, an impossible flag) prints one `error: …` line and exits 2."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np

from ..backends import BackendError
from ..backends.kv_cache import KV_TYPES
from ..compute_options import installed, read_environment
from ..gguf_file.reader import GGUFError

DEFAULT_MODEL_LIKE = "tiny"
DEFAULT_PROMPT_IDS = "1,2,3,4,5,6,7,8"


class UsageError(Exception):
    """A flag combination or value that cannot be honoured."""


def parse_ids(text: str, flag: str = "--prompt-ids") -> list[int]:
    try:
        ids = [int(x) for x in text.replace(" ", "").split(",") if x != ""]
    except ValueError:
        raise UsageError(f"{flag} wants comma-separated integers, got '{text}'") from None
    if not ids:
        raise UsageError(f"{flag} is empty")
    return ids


def default_model_path() -> Path:
    """The built-in tiny synthetic model, written once into the user's cache."""
    from ..synth import write_synthetic
    cache = Path(os.environ.get("STRATA_CACHE_DIR", Path.home() / ".cache" / "strata-dist"))
    path = cache / "tiny-f32.gguf"
    if not path.exists():
        cache.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        write_synthetic(tmp, like=DEFAULT_MODEL_LIKE, quant="f32", popularity="zipf:1.0", seed=0)
        tmp.replace(path)
        print(f"info: wrote the built-in tiny model to {path}", file=sys.stderr)
    return path


def _engine(args):
    from .single_process import SingleProcessRunner
    model = args.model or default_model_path()
    if args.kv_type is not None:
        check_kv_type(str(model), args.kv_type)
    resident = 0
    if args.kv_resident is not None:
        from ..models import architecture_for, open_checked
        from .single_process import context_cells
        gguf = open_checked(str(model))
        try:   # the cells the runner will carve (it warns about a long context itself)
            cells = context_cells(args.max_context, architecture_for(gguf).read_geometry(gguf),
                                  str(model), warn=lambda m: None)
        except ValueError as e:
            raise UsageError(str(e)) from None
        gpu = args.device.startswith("cuda")
        resident = check_kv_resident(args.kv_resident, cells, args.prompt_chunk,
                                     gpu_refusal=gpu_kv_resident_refusal(
                                         gguf, args.kv_type, args.device) if gpu else "")
    return SingleProcessRunner(str(model), device=args.device, max_context=args.max_context,
                               prompt_chunk=args.prompt_chunk, kv_type=args.kv_type,
                               kv_resident=resident)


def gpu_kv_resident_refusal(gguf, kv_type: str | None, device: str) -> str:
    """Why --kv-resident cannot run on the GPUs `device` names, or "": the decode graph's ring
    builds (kernels/attention.cuh, next_attention.cuh) take qwen3moe's and qwen3next's f16 or
    q8_0 K/V only (None: the GPU's default, f16)."""
    from ..backends.kv_cache import DeviceRing
    arch = gguf.arch
    if arch not in DeviceRing.ARCHS:
        return (f"on {device} for {arch}: the GPU ring kernels are {' and '.join(DeviceRing.ARCHS)}"
                f"'s only so far (the CPU takes every architecture)")
    if kv_type is not None and kv_type not in DeviceRing.KV_TYPES:
        return (f"with --kv-type {kv_type} on {device}: the GPU ring kernels read "
                f"{' or '.join(DeviceRing.KV_TYPES)} K/V only so far")
    return ""


def check_kv_resident(text: str, cells: int, prompt_chunk: int | None, gpu_refusal: str = "",
                      auto: bool = False) -> int:
    """--kv-resident N|auto as PlanParams.kv_resident (KV_RESIDENT_AUTO for auto, where `auto`
    is allowed: a plan picks it): N must leave cells in host memory (below the context `cells`)
    and hold the sinks and a prompt chunk (`prompt_chunk`; None: the plan's auto chunk, at least its
    smallest, which the ring then caps). `gpu_refusal` (gpu_kv_resident_refusal): a device
    path not built yet, refused."""
    from ..plan.lend import LEND_CHUNKS
    from ..plan.params import KV_RESIDENT_AUTO
    from ..plan.pricing import KV_SINK_CELLS, kv_resident_floor
    if text == "auto":
        if not auto:
            raise UsageError("--kv-resident auto: the resident cells are picked by a plan from "
                             "each card's free memory (strata-launch); give a number here")
        n = KV_RESIDENT_AUTO
    else:
        try:
            n = int(text)
        except ValueError:
            raise UsageError(f"--kv-resident wants a number of cells or auto, got '{text}'") from None
        if n >= cells:
            raise UsageError(f"--kv-resident {n} with --max-context {cells}: every cell is "
                             f"resident already, nothing would be kept in host memory (give N "
                             f"below the context, or leave --kv-resident out)")
        floor = kv_resident_floor(prompt_chunk or min(LEND_CHUNKS))
        if n < floor:
            raise UsageError(f"--kv-resident {n} is below its floor of {floor} cells: the "
                             f"{KV_SINK_CELLS} attention sinks plus a ring that holds a whole "
                             f"prompt chunk (--prefill {prompt_chunk or 'auto: its smallest chunk'})")
    if gpu_refusal:
        raise UsageError(f"--kv-resident {text} {gpu_refusal}")
    return n


def check_kv_type(model: str, kv_type: str) -> None:
    """--kv-type against the model's heads (q8_0 needs whole blocks of 32), before loading."""
    from ..models.shape import model_shape
    from ..models import open_checked
    try:
        model_shape(open_checked(model), "cpu", kv_type)
    except ValueError as e:
        raise UsageError(f"--kv-type {kv_type} does not fit {model}: {e}") from None


def prompt_tokens(gguf_path: str, text: str, chat: bool) -> tuple[list[int], object]:
    """A text prompt through the model's own tokenizer (and chat template with chat=True)."""
    from ..gguf_file.tokenizer import GGUFTokenizer, TextError
    tok = GGUFTokenizer.from_gguf(gguf_path)
    try:
        ids = tok.encode_chat([{"role": "user", "content": text}]) if chat else tok.encode(text)
    except TextError as e:
        raise UsageError(f"--prompt is {e}") from None
    if not ids:
        raise UsageError("--prompt encodes to no tokens")
    return ids, tok


def cmd_generate(args) -> int:
    from ..sampling.sampler import SamplingParams
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                            min_p=args.min_p, seed=args.seed)
    engine = _engine(args)
    tok = None
    if args.prompt is not None:
        prompt, tok = prompt_tokens(engine.gguf.path, args.prompt, args.chat)
    else:
        prompt = parse_ids(args.prompt_ids)
    result = engine.generate(prompt, args.max_new, params)
    print(tok.decode(result.tokens) if tok else ",".join(str(t) for t in result.tokens))
    decode_tps = (len(result.tokens) - 1) / (result.decode_ms / 1e3) if result.decode_ms > 0 else 0.0
    print(f"info: {len(prompt)} prompt tokens in {result.prompt_ms:.1f} ms, {len(result.tokens)} "
          f"generated ({decode_tps:.1f} tok/s decode), stop={result.stop_reason}, "
          f"device={engine.backend.device}", file=sys.stderr)
    return 0


def writable_path(path: str, flag: str) -> Path:
    """`path`, refused before any work when its folder does not exist or cannot be written."""
    out = Path(path)
    if out.is_dir():
        raise UsageError(f"{flag} {path} is a folder: name a file in it")
    folder = out.parent if str(out.parent) else Path(".")
    if not folder.is_dir():
        raise UsageError(f"{flag} {path}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise UsageError(f"{flag} {path}: the folder {folder} is not writable")
    return out


def cmd_logits(args) -> int:
    ids = parse_ids(args.tokens, "--tokens")
    writable_path(args.out, "--out")
    logits = _engine(args).logits(ids)
    try:
        with open(args.out, "wb") as f:    # the path as given: np.save on a name adds ".npy"
            np.save(f, logits.astype(np.float32))
    except OSError as e:
        raise UsageError(f"cannot write {args.out}: {e.strerror or e}") from None
    print(f"info: wrote logits {list(logits.shape)} to {args.out}", file=sys.stderr)
    return 0


def cmd_synth(args) -> int:
    from ..synth import FILE_TYPES, parse_rope_scaling, parse_size, write_synthetic
    from tqdm import tqdm
    writable_path(args.out, "synth")
    if args.quant not in FILE_TYPES:
        raise UsageError(f"--quant {args.quant}: expected one of {', '.join(FILE_TYPES)}")
    try:
        split = parse_size(args.split_max_size) if args.split_max_size is not None else 0
    except ValueError as e:
        raise UsageError(f"--split-max-size {args.split_max_size}: {e}") from None
    try:
        rope_scaling = parse_rope_scaling(args.rope_scaling)
    except ValueError as e:
        raise UsageError(f"--rope-scaling {e}") from None
    bar = tqdm(total=0, unit="B", unit_scale=True, desc="synth", disable=args.quiet)

    def progress(done: int, total: int) -> None:
        bar.total = total
        bar.n = done
        bar.refresh()

    try:
        summary = write_synthetic(args.out, like=args.like, quant=args.quant,
                                  popularity=args.popularity, seed=args.seed, progress=progress,
                                  split_max_size=split, rope_scaling=rope_scaling, mtp=args.mtp)
    except ValueError as e:    # --mtp on a geometry without an MTP layout
        raise UsageError(str(e)) from None
    except OSError as e:
        raise UsageError(f"cannot write {args.out}: {e.strerror or e}") from None
    finally:
        bar.close()
    files = (f"{summary.path} and {len(summary.shards) - 1} more shard(s)" if len(summary.shards) > 1
             else str(summary.path))
    print(f"wrote {files}: {summary.bytes_written / 2**20:.1f} MiB, "
          f"{summary.n_params / 1e9:.3f} B parameters ({args.like}, {args.quant})")
    return 0


def cmd_profile(args) -> int:
    from tqdm import tqdm
    from ..gguf_file.reader import GGUFModel
    from .profile_io import read_prompt_ids_file, record_profile, save_profile, summary_line
    if args.max_new < 0:
        raise UsageError(f"--max-new must be >= 0, got {args.max_new}")
    if args.prompt_chunk < 1:
        raise UsageError(f"--prefill must be >= 1, got {args.prompt_chunk}")
    writable_path(args.out, "--out")    # refused before the runs, not after them
    prompts = read_prompt_ids_file(args.prompt_ids_file)
    bar = tqdm(total=len(prompts), unit="prompt", desc="profile", file=sys.stderr, disable=None)
    profile = record_profile(args.model, prompts, device=args.device, max_new=args.max_new,
                             prompt_chunk=args.prompt_chunk,
                             progress=lambda done, total: bar.update(done - bar.n))
    bar.close()
    gguf = GGUFModel(args.model)
    top_k = int(gguf.arch_metadata("expert_used_count", required=True))
    meta = {"model": Path(args.model).name, "prompts": len(prompts),
            "prompt_tokens": sum(len(p) for p in prompts), "max_new": args.max_new,
            "top_k": top_k, "device": args.device}
    try:
        save_profile(profile, args.out, model_fingerprint=gguf.fingerprint, meta=meta)
    except OSError as e:
        raise UsageError(f"cannot write {args.out}: {e.strerror or e}") from None
    print(f"wrote {args.out}: {summary_line(profile, top_k)}")
    return 0


def _add_run_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="GGUF file (default: a built-in tiny synthetic model)")
    p.add_argument("--device", default="cpu", help="cpu or cuda:N (default cpu)")
    p.add_argument("--max-context", type=int, default=None,
                   help="session cells, allocated up front (default 4096, or the context the "
                        "model was trained for where that is shorter; more is allowed, with a "
                        "warning)")
    p.add_argument("--prefill", dest="prompt_chunk", type=int, default=512, metavar="N",
                   help="the prompt chunk in tokens (default 512)")
    p.add_argument("--kv-type", choices=KV_TYPES, default=None,
                   help="how the session keeps K/V: f32, f16 or q8_0 (default f16 on a GPU, f32 "
                        "on the CPU)")
    p.add_argument("--kv-resident", default=None, metavar="N",
                   help="keep N cells of each K/V resident (the attention sinks and a ring of the "
                        "newest), every cell in host memory; below --max-context, at least "
                        "--prefill + 4 (default: every cell resident; on a GPU qwen3moe and "
                        "qwen3next with f16 or q8_0 K/V only so far)")


def tcp_endpoint(text: str, flag: str, default_host: str | None = None) -> str:
    """tcp://HOST:PORT from "tcp://HOST:PORT", "HOST:PORT" or (with a default host) "PORT"."""
    rest = text[len("tcp://"):] if text.startswith("tcp://") else text
    host, sep, port = rest.rpartition(":")
    if not sep and default_host is not None:
        host, port = default_host, rest
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        want = "PORT, HOST:PORT or tcp://HOST:PORT" if default_host else "HOST:PORT or tcp://HOST:PORT"
        raise UsageError(f"{flag} {text}: expected {want} (a port in 1-65535)")
    return f"tcp://{host}:{port}"


def serve_endpoint(serve: str, bind: str | None) -> str:
    """--serve PORT listens on --bind (default loopback: this host only); --serve HOST:PORT on HOST."""
    names_host = ":" in (serve[len("tcp://"):] if serve.startswith("tcp://") else serve)
    if names_host and bind is not None:
        raise UsageError(f"--serve {serve} names the address to listen on and so does --bind {bind}: "
                         f"give one")
    host = bind if bind is not None else "127.0.0.1"
    return tcp_endpoint(serve, "--serve", f"[{host}]" if ":" in host else host)


def cmd_calibrate(args) -> int:
    from .calibrate import CalibrationError, calibrate, save_calibration, serve_link
    from ..flag_values import check_seconds
    if args.serve is not None:
        check_seconds("--idle", args.idle)
        if args.peer or args.out:
            raise UsageError(f"--serve {args.serve} is the peer's side: --peer and --out belong "
                             f"to the prober's")
        return serve_link(serve_endpoint(args.serve, args.bind), args.idle,
                          say=lambda line: print(line, file=sys.stderr, flush=True))
    if args.bind is not None:
        raise UsageError(f"--bind {args.bind} goes with --serve (the address the peer listens on)")
    if args.rounds < 10:
        raise UsageError(f"--rounds {args.rounds}: at least 10 round trips")
    peer = tcp_endpoint(args.peer, "--peer") if args.peer else None
    if args.out:
        writable_path(args.out, "--out")    # refused before measuring, not after
    try:
        content = calibrate(args.device, peer, rounds=args.rounds)
    except CalibrationError as e:
        raise UsageError(str(e)) from None
    m = content["measured"]
    for name, value in content["params"].items():
        print(f"{name:22s} {value:g}")
    if "device_read_gbs" in m:
        print(f"(blobs read in place: {m['device_read_gbs']:g} GB/s from this card's memory; "
              + ("host and peer" if "peer_gbs" in content["params"] else
                 "host only: no second card with peer access, peer_gbs keeps its default")
              + ")")
    if "shared_card_handoff_us" in m and "handoff_us" not in m:
        print("(one card: shared_card_handoff_ms is two ranks taking turns on it; handoff_ms, "
              "between two cards, keeps its default)")
    print(f"(hand-off by {m['handoff_path']} on {m['device']}"
          + (f"; link to {m['peer']}: round trip {m['rtt_ms']:.3f} ms, "
             f"{m['payload_bytes'] >> 20} MiB in {m['payload_ms']:.1f} ms" if peer else
             "; no --peer: the link constants keep their defaults") + ")")
    if args.out:
        try:
            save_calibration(content, args.out)
        except OSError as e:
            raise UsageError(f"cannot write {args.out}: {e.strerror or e}") from None
        print(f"wrote {args.out}: plan with strata-launch --calibration {args.out}")
    return 0


def synth_quant_help() -> str:
    """`synth --quant`'s help, from the synth's table of file types (synth/ftypes.py FILE_TYPES),
    so a file type added there is listed here."""
    from ..synth.ftypes import FILE_TYPES
    ruled = [n for n, f in FILE_TYPES.items() if not f.experts_only]
    experts_only = [n for n, f in FILE_TYPES.items() if f.experts_only]
    text = (f"a file type: {' | '.join(ruled)}, each tensor typed as the reference quantizer's "
            f"rules say (docs/DEVELOPING.md)")
    for name in experts_only:
        text += (f"; or {name}: {FILE_TYPES[name].default.name} experts with F16 dense tensors "
                 f"(the first synth files)")
    return text


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="strata-dist", description=__doc__)
    sub = ap.add_subparsers(dest="command")

    g = sub.add_parser("generate", help="greedy (or sampled) generation in one process")
    _add_run_flags(g)
    g.add_argument("--prompt-ids", default=DEFAULT_PROMPT_IDS, help="comma-separated token ids")
    g.add_argument("--prompt", default=None,
                   help="a text prompt, through the model's tokenizer (prints text, not ids)")
    g.add_argument("--chat", action="store_true", help="with --prompt: apply the chat template")
    g.add_argument("--max-new", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.set_defaults(func=cmd_generate)

    lg = sub.add_parser("logits", help="float32 logits of every position, saved as .npy")
    _add_run_flags(lg)
    lg.add_argument("--tokens", required=True, help="comma-separated token ids")
    lg.add_argument("--out", required=True, help="output .npy path")
    lg.set_defaults(func=cmd_logits)

    s = sub.add_parser("synth", help="write a synthetic model of a real geometry")
    s.add_argument("out", help="output .gguf path")
    s.add_argument("--like", default="tiny",
                   help="tiny | qwen3-30b-a3b | qwen3-30b-a3b-2507 | qwen3-235b-a22b | tiny-next | "
                        "qwen3-next-80b-a3b | tiny-qwen35 | qwen3.5-35b-a3b")
    s.add_argument("--quant", default="q8_0", help=synth_quant_help())
    s.add_argument("--split-max-size", default=None, metavar="N[K|M|G]",
                   help="write shards OUT-00001-of-0000N.gguf of at most this much tensor data "
                        "each (decimal units, e.g. 4G)")
    s.add_argument("--popularity", default="uniform", help="uniform | zipf:S")
    s.add_argument("--rope-scaling", default=None, metavar="SPEC",
                   help="the file's RoPE scaling keys: none, linear:FACTOR or "
                        "yarn:FACTOR:ORIGINAL_CONTEXT (e.g. yarn:4:32768; context_length becomes "
                        "factor x original)")
    s.add_argument("--mtp", action="store_true",
                   help="qwen3next and qwen35moe geometries: one multi-token-prediction block "
                        "after the stack, laid out as llama.cpp's converter writes it (for "
                        "--draft mtp, which drafts with qwen3next's; a qwen35moe file's block "
                        "loads unused)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--quiet", action="store_true", help="no progress bar")
    s.set_defaults(func=cmd_synth)

    pr = sub.add_parser("profile", help="record a routing profile (counts per layer and expert) from real runs")
    pr.add_argument("--model", required=True, help="GGUF file")
    pr.add_argument("--prompt-ids-file", required=True,
                    help="one prompt per line, token ids separated by commas or spaces; '#' comments")
    pr.add_argument("--out", required=True, help="output profile (JSON; see strata_dist/tools/profile_io.py)")
    pr.add_argument("--device", default="cpu", help="cpu or cuda:N (default cpu)")
    pr.add_argument("--max-new", type=int, default=0,
                    help="also greedily decode this many tokens per prompt and count them (default 0)")
    pr.add_argument("--prefill", dest="prompt_chunk", type=int, default=512, metavar="N",
                    help="the prompt chunk in tokens (default 512)")
    pr.set_defaults(func=cmd_profile)

    c = sub.add_parser("calibrate", help="measure this machine's planner constants (the stage "
                                         "hand-off, a link to another host; on a GPU, expert "
                                         "blobs read in place from host memory and another "
                                         "card) for strata-launch --calibration")
    c.add_argument("--device", default="cpu",
                   help="cpu or cuda:N: where the hand-off between two stages is measured "
                        "(CUDA IPC between GPU processes, frames on CPUs; default cpu)")
    c.add_argument("--peer", default=None, metavar="HOST:PORT",
                   help="`strata-dist calibrate --serve` on another host: measure the link to it")
    c.add_argument("--rounds", type=int, default=2000, help="hand-off round trips (default 2000)")
    c.add_argument("--out", default=None, help="write the calibration (JSON) here")
    c.add_argument("--serve", default=None, metavar="PORT|HOST:PORT",
                   help="be the peer of another host's --peer and answer its probes (listens on "
                        "--bind, or the HOST given)")
    c.add_argument("--bind", default=None, metavar="ADDRESS",
                   help="with --serve PORT: the address to listen on (default 127.0.0.1, this host "
                        "only; give this host's address on the link to measure, or 0.0.0.0)")
    c.add_argument("--idle", type=float, default=120.0,
                   help="with --serve: stop after this many seconds without a probe (default 120)")
    c.set_defaults(func=cmd_calibrate)
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if not getattr(args, "func", None):
        # The embedded default job: generate on the built-in tiny model.
        args = ap.parse_args(["generate"] + (argv or []))
    try:
        # every compute switch read once, here (a bad value: one error line naming it); the
        # command runs that record, not variables changed while it runs (compute_options.py)
        with installed(read_environment()):
            return args.func(args)
    except (GGUFError, UsageError, BackendError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ValueError as e:  # a request the engine refuses (out-of-range id, context full)
        print(f"error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:   # stdout closed early (`… | head`): stop quietly, as `yes | head` does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
