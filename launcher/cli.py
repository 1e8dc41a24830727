"""`strata-launch`: one rank per device, a coordinator, and a surface (--serve, --prompt-ids, or
--plan-only). Impossible flag combinations are refused at start (exit 2) naming both values; a
rank that dies stops the launch with that rank's error (exit 1); Ctrl-C, SIGTERM or SIGHUP stops
every rank (no process is left behind; exit 130)."""
from __future__ import annotations

import os
import sys
from dataclasses import replace

from .stop_signals import EXIT_STOPPED, StopSignals, exit_at_once_while_starting

if __name__ == "__main__" or os.path.basename(sys.argv[0]) == "strata-launch":
    exit_at_once_while_starting()   # before the imports below, which take about 0.2 s

import argparse

from protocol.bounded_read import KEY_FILE_MAX, read_capped
from strata_dist.backends.kv_cache import KV_TYPES
from strata_dist.checkpoints import DEFAULT_EVERY
from strata_dist.compute_options import read_environment
from strata_dist.tools.cli import (UsageError as ToolsUsageError, check_kv_resident, check_kv_type,
                             gpu_kv_resident_refusal, parse_ids, prompt_tokens)
from strata_dist.head.coordinator import RankFailure, RequestError
from strata_dist.rank.draft_model import check_draft_model, plan_bytes as draft_plan_bytes
from strata_dist.sampling.mtp_draft import mtp_layer, plan_bytes as mtp_plan_bytes
from strata_dist.flag_values import check_seconds
from strata_dist.gguf_file.reader import GGUFError
from strata_dist.models.shape import model_shape
from strata_dist.models import architecture_for, open_checked
from strata_dist.plan import PlanError, make_plan, render_table
from strata_dist.plan.pricing import MIB
from strata_dist.tools.single_process import DEFAULT_CONTEXT, context_cells
from strata_dist.sampling.speculative import DRAFTERS, MAX_SPEC, SpecOptions, plan_prediction

from .adapt_flags import add_adapt_flags, check_adapt_flags
from .cluster import add_cluster_flags, check_cluster_flags, cluster_config
from .layout_flags import (DEFAULT_CPU_BUDGET, UsageError, layout_args, load_profile, plan_params,
                           planning_devices, prompt_chunk_arg, rank_specs, split_arg)



def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="strata-launch", description=__doc__)
    ap.add_argument("--model", required=True, help="GGUF model file")
    where = ap.add_argument_group("devices")
    where.add_argument("--gpus", default=None, help="GPU indices, e.g. 0,1,2,3 (one rank each)")
    where.add_argument("--cpu-ranks", type=int, default=None, help="N ranks computing on the CPU")
    where.add_argument("--vram-budget", default=None,
                       help="bytes per rank (one value, or one per rank): 512K, 64M, 16G; cpu "
                            f"ranks default to {DEFAULT_CPU_BUDGET}, GPU ranks are capped by it")
    where.add_argument("--inventory", default=None,
                       help="rig.json: plan for the devices listed there (with --plan-only)")
    plan = ap.add_argument_group("plan")
    plan.add_argument("--layer-split", default="auto",
                      help="auto, or K1,K2,… — the first layers of the second, third, … stage")
    plan.add_argument("--max-context", type=int, default=None,
                      help=f"session cells (default {DEFAULT_CONTEXT}, or the context the model "
                           "was trained for where that is shorter; more than that is allowed, "
                           "with a warning)")
    plan.add_argument("--prefill", dest="prompt_chunk", default="auto", metavar="auto|N",
                      help="the prompt chunk: auto or N tokens")
    plan.add_argument("--kv-type", choices=KV_TYPES, default=None,
                      help="how sessions keep K/V: f32, f16 or q8_0 (34 bytes per 32 values); "
                           "default f16 on GPU ranks, f32 on CPU ranks")
    plan.add_argument("--kv-resident", default=None, metavar="N|auto",
                      help="each stage keeps N cells of each session's K/V on its device (the "
                           "attention sinks and a ring of the newest), every cell in pinned host "
                           "memory, priced so; auto: every cell where it fits, else the most that "
                           "fit (default: every cell resident; on GPUs qwen3moe and qwen3next with f16 "
                           "or q8_0 K/V only)")
    plan.add_argument("--prompt-cache-every", type=int, default=DEFAULT_EVERY, metavar="N",
                      help="hybrid models (qwen3next): checkpoint the recurrent state at the first "
                           "chunk boundary past every N prompt tokens, besides each request's start "
                           f"and prompt end; 0: only those (default {DEFAULT_EVERY})")
    plan.add_argument("--conversation-cache-mib", type=int, default=0, metavar="N",
                      help="each stage keeps earlier conversations' state (its own layers' K/V "
                           "and recurrent state) in up to N MiB, on its card before its expert "
                           "cache fills (pinned host memory when the cards have no room; host "
                           "memory on CPU ranks), so a request resumes from the longest prefix of "
                           "any of them; least recently used first out (default 0: off, only the "
                           "previous request's state is reused)")
    plan.add_argument("--gpu-order", choices=("fastest_last", "as_given"), default="fastest_last")
    plan.add_argument("--split-skip-if-fits", action="store_true",
                      help="run on one card when everything fits there")
    plan.add_argument("--expert-profile", default=None, help="routing profile (strata-dist profile)")
    plan.add_argument("--no-remote-auto", action="store_true", help="no helper expert tier")
    plan.add_argument("--no-prompt-loans", action="store_true",
                      help="stages withhold their own prompt buffers instead of lending cache slots")
    plan.add_argument("--expert-cache", default="auto",
                      help="auto (fill what is left), N (at most N pairs per stage cache) or 0 "
                           "(no resident experts; the profile still drives the split search)")
    add_adapt_flags(plan)
    plan.add_argument("--stage-gpus", default=None, metavar="N,N,…",
                      help="the listed devices that run stages (GPU indices as in --gpus; an "
                           "inventory's index, host:N where hosts share one, rank:N for one rank of "
                           "a card several share); the others hold "
                           "helper tiers only. With --layer-split K1,…: one stage per device")
    plan.add_argument("--expert-cache-device", action="append", default=[], metavar="N=MiB",
                      help="an explicit helper tier of MiB on device N (repeatable, or N=MiB,N=MiB): "
                           "taken before a stage card's cache, kept with --no-remote-auto, and the "
                           "launch stops if it cannot open")
    plan.add_argument("--calibration", default=None, metavar="FILE",
                      help="plan with the constants `strata-dist calibrate --out FILE` measured "
                           "on this rig (a STRATA_SPLIT_* variable still overrides its field)")
    plan.add_argument("--plan-only", action="store_true", help="print the plan and exit")
    plan.add_argument("--json", action="store_true", help="with --plan-only: the plan as JSON")
    run = ap.add_argument_group("run")
    run.add_argument("--serve", action="store_true", help="the stdin/stdout line protocol")
    run.add_argument("--prompt-ids", default=None, help="generate once for these ids and exit")
    run.add_argument("--prompt", default=None,
                     help="generate once for this text (the model's tokenizer) and print the text")
    run.add_argument("--chat", action="store_true", help="with --prompt: apply the chat template")
    run.add_argument("--max-new", type=int, default=32, help="with --prompt-ids (default 32)")
    run.add_argument("--spec", type=int, default=0, metavar="K",
                     help=f"speculative decoding: each step verifies up to K draft tokens at once "
                          f"(0-{MAX_SPEC}; default 0: off); greedy tokens are those of K = 0, "
                          "sampled ones follow the same distribution")
    run.add_argument("--draft", default=None, metavar="|".join(DRAFTERS),
                     help="with --spec: the drafter; ngram (default) continues the longest suffix "
                          "of the conversation that occurred in it before; model: --draft-model's; "
                          "mtp: the model file's multi-token-prediction block (qwen3next files "
                          "with blk.N.nextn.*), on the last stage")
    run.add_argument("--draft-model", default="", metavar="FILE.gguf",
                     help="with --spec K: a small model of the same vocabulary drafts up to K "
                          "tokens a step (implies --draft model); loaded on the last stage, which "
                          "the plan prices with its weights and session")
    run.add_argument("--spec-min-p", type=float, default=0.0, metavar="P",
                     help="with --spec: stop drafting where the drafter's probability (an n-gram's "
                          "share of the suffix's earlier continuations, the draft model's softmax) "
                          "is below P (default 0)")
    run.add_argument("--load-timeout", type=float, default=600.0, help="seconds for ranks to load")
    run.add_argument("--restart-ranks", type=int, default=0, metavar="N",
                     help="with --serve or --port: after a rank dies (its request gets ERR / an "
                          "error), start every rank afresh, up to N times (default 0: the launch "
                          "ends)")
    run.add_argument("--rejoin", action="store_true",
                     help="with --serve or --port: a stage rank that dies is started again (ranks "
                          "started elsewhere: waited for, up to --load-timeout) and takes its place "
                          "while the other ranks keep their weights, caches and sessions; its "
                          "request gets ERR / an error, the next one waits for it. Hand-offs "
                          "between GPU ranks travel as frames (no CUDA IPC)")
    http = ap.add_argument_group("http (an OpenAI-compatible server)")
    http.add_argument("--port", type=int, default=None,
                      help="serve HTTP on this port (0: any free port, printed at start)")
    http.add_argument("--host", default=None, help="address to listen on (default 127.0.0.1)")
    http.add_argument("--api-key", default=None,
                      help="every endpoint but /health wants 'Authorization: Bearer KEY' (visible "
                           "to every user in ps: prefer --api-key-file or STRATA_API_KEY)")
    http.add_argument("--api-key-file", default=None,
                      help="read the API key from this file (its first line)")
    http.add_argument("--queue-size", type=int, default=None,
                      help="requests that may wait behind the running one (default 64; more: 429)")
    http.add_argument("--parallel", type=int, default=None, metavar="B",
                      help="serve up to B requests at once, their decode steps batched (each its "
                           "own session on every stage; default 1: one after another)")
    http.add_argument("--allowed-hosts", default=None, metavar="HOST[:PORT],...",
                      help="answer only requests whose Host header is one of these (a name without "
                           "a port: any port; '*': any Host). Default: the --host address, "
                           "localhost, 127.0.0.1 and [::1], with the port (guards a local server "
                           "against DNS rebinding from web pages)")
    add_cluster_flags(ap)
    return ap


# ---- turning flags into a configuration ------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    with StopSignals() as signals:
        try:
            args = build_parser().parse_args(argv)
            return _main(args, signals)
        except (UsageError, ToolsUsageError, GGUFError, PlanError, ValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        except BrokenPipeError:   # stdout closed early (`… | head`): the ranks are closed; stop quietly
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 141
        except KeyboardInterrupt:   # stopped before any rank started: nothing to close
            return EXIT_STOPPED


def _main(args, signals: StopSignals) -> int:
    check_seconds_flags(args)
    check_adapt_flags(args)
    args.compute = read_environment()   # every compute switch, once: the plan keeps, ranks run it
    if args.serve and args.prompt_ids is not None:
        raise UsageError("--serve and --prompt-ids cannot be combined: pick one surface")
    if args.prompt is not None and (args.serve or args.prompt_ids is not None):
        other = "--serve" if args.serve else "--prompt-ids"
        raise UsageError(f"--prompt and {other} cannot be combined: pick one surface")
    http_flags(args)
    if args.restart_ranks < 0 or (args.restart_ranks and not args.serve and args.port is None):
        raise UsageError(f"--restart-ranks {args.restart_ranks} goes with --serve or --port, "
                         f"and N >= 0")
    if args.rejoin and not args.serve and args.port is None:
        raise UsageError("--rejoin goes with --serve or --port")
    if args.rejoin and args.restart_ranks:
        raise UsageError(f"--rejoin and --restart-ranks {args.restart_ranks} cannot be combined: "
                         "a rank is either replaced alone or every rank is restarted")
    if args.rejoin and args.backend == "ray":
        raise UsageError("--rejoin and --backend ray cannot be combined: Ray actors are not "
                         "started again one by one")
    if args.json and not args.plan_only:
        raise UsageError("--json goes with --plan-only")
    if args.inventory and not args.plan_only:
        raise UsageError(f"--inventory {args.inventory} plans for another rig: add --plan-only")
    check_cluster_flags(args)
    gguf = open_checked(args.model)
    try:   # the rule strata-dist's own commands follow too (single_process.context_cells)
        args.max_context = context_cells(args.max_context,
                                         architecture_for(gguf).read_geometry(gguf), args.model)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.kv_type is not None:
        check_kv_type(args.model, args.kv_type)
        if args.gpus and args.kv_type == "f32":
            print("warning: --kv-type f32: GPU decode steps take the general path (the decode "
                  "graph reads f16 or q8_0 K/V)", file=sys.stderr)
    # before any device is probed: a GPU launch is refused by the flag's own words
    kv_resident = (kv_resident_arg(args, prompt_chunk_arg(args.prompt_chunk))
                   if args.kv_resident is not None else 0)
    # the prompt is read before any rank starts: a bad one costs nothing
    args.prompt_list, args.prompt_tokenizer = None, None
    if args.prompt_ids is not None:
        args.prompt_list = parse_ids(args.prompt_ids)
    elif args.prompt is not None:
        args.prompt_list, args.prompt_tokenizer = prompt_tokens(args.model, args.prompt, args.chat)
    if args.listen and args.backend == "local":      # the ranks register from elsewhere
        specs, n_devices = [], args.expect_ranks
    elif args.backend == "ray" and args.cpu_ranks is None:
        specs, n_devices = [], 2                      # a rank per GPU of the cluster, counted at start
    else:
        specs = rank_specs(args) if not args.inventory else []
        n_devices = len(specs) if specs else len(planning_devices(args, specs))
    split = split_arg(args.layer_split, n_devices)
    prompt_chunk = prompt_chunk_arg(args.prompt_chunk)
    if args.prompt_cache_every < 0:
        raise UsageError(f"--prompt-cache-every {args.prompt_cache_every}: N >= 0 (0: no "
                         "mid-prompt checkpoints)")
    if args.conversation_cache_mib < 0:
        raise UsageError(f"--conversation-cache-mib {args.conversation_cache_mib}: N >= 0 "
                         "(0: off)")
    try:
        drafter = args.draft or ("model" if args.draft_model else "ngram")
        args.spec_options = SpecOptions(args.spec, drafter, args.spec_min_p, args.draft_model)
        if args.draft_model:
            check_draft_model(args.model, args.draft_model)
        if drafter == "mtp":
            mtp_layer(args.model)      # a file with a block the drafter runs, else refused here
    except ValueError as e:
        raise UsageError(str(e)) from None
    params = plan_params(args)
    if kv_resident:
        params = replace(params, kv_resident=kv_resident)
    if args.draft_model:   # priced on the last stage, as the kind of device it lands on
        params = replace(params, **{
            field: draft_plan_bytes(args.draft_model, kind, args.kv_type, args.max_context,
                                    getattr(args, "parallel", None) or 1)   # one per session
            for field, kind in (("draft_bytes", "cuda"), ("draft_cpu_bytes", "cpu"))})
    args.draft_mtp = args.spec_options.drafter == "mtp" and args.spec > 0
    if args.draft_mtp:     # the MTP block and its session, priced on the last stage likewise
        params = replace(params, drafter=("MTP block", "--draft mtp"), **{
            field: mtp_plan_bytes(args.model, kind, args.kv_type, args.max_context,
                                  getattr(args, "parallel", None) or 1)
            for field, kind in (("draft_bytes", "cuda"), ("draft_cpu_bytes", "cpu"))})
    layout = layout_args(args, specs, split)
    profile = load_profile(args, gguf)
    if args.plan_only:
        kind = "cuda" if args.gpus or args.inventory else "cpu"
        shape = model_shape(gguf, kind, args.kv_type)
        plan = make_plan(shape, planning_devices(args, specs),
                         cells=args.max_context, profile=profile, params=params, split=split,
                         order=args.gpu_order, skip_if_fits=args.split_skip_if_fits,
                         prompt_chunk=prompt_chunk,
                         compute=args.compute, conversation_bytes=args.conversation_cache_mib * MIB,
                         **layout)
        out = plan.to_json() if args.json else render_table(plan)
        if args.spec:   # decode tok/s with speculation at a few acceptance rates
            pred = plan_prediction(plan, shape, profile, args.spec_options, args.kv_type,
                                   args.model)
            out = pred.in_plan_json(out) if args.json else "\n".join([out, *pred.lines()])
        print(out)
        return 0
    return run_launch(args, gguf, specs, split, prompt_chunk, params, profile, signals, layout)


def kv_resident_arg(args, prompt_chunk: int | None) -> int:
    """--kv-resident for the plan (strata_dist/tools/cli.py check_kv_resident): on GPU ranks what their
    kernels do not take yet refused unless the plan is only printed, kept conversations refused
    (they copy K/V as the device holds it)."""
    if args.conversation_cache_mib:
        raise UsageError(f"--kv-resident {args.kv_resident} with --conversation-cache-mib "
                         f"{args.conversation_cache_mib}: kept conversations are not yet copied "
                         f"from K/V beyond the device; drop one of them")
    refusal = (gpu_kv_resident_refusal(open_checked(args.model), args.kv_type,
                                       f"--gpus {args.gpus}")
               if args.gpus and not args.plan_only else "")
    return check_kv_resident(args.kv_resident, args.max_context, prompt_chunk, gpu_refusal=refusal,
                             auto=True)


SECONDS_FLAGS = (("--load-timeout", "load_timeout"), ("--register-timeout", "register_timeout"),
                 ("--heartbeat-timeout", "heartbeat_timeout"))


def check_seconds_flags(args) -> None:
    """Every wait given in seconds is a finite number > 0 (strata_dist/flag_values.py)."""
    for flag, name in SECONDS_FLAGS:
        check_seconds(flag, getattr(args, name, None))


def run_launch(args, gguf, specs, split, prompt_chunk, params, profile, signals: StopSignals,
               layout: dict | None = None) -> int:
    from .launch import Launch, LaunchConfig
    from .line_protocol import parse_gen

    cfg = LaunchConfig(model=args.model, ranks=specs, split=split, max_context=args.max_context,
                       prompt_chunk=prompt_chunk, params=params, profile=profile, order=args.gpu_order,
                       skip_if_fits=args.split_skip_if_fits, load_timeout_s=args.load_timeout,
                       rejoin_timeout_s=args.load_timeout if args.rejoin else None,
                       kv_type=args.kv_type, compute=args.compute, **(layout or {}),
                       adapt_every=args.adapt_every, adapt_swaps=args.adapt_swaps,
                       conversation_bytes=args.conversation_cache_mib * MIB,
                       profile_out=args.expert_profile_out,
                       profile_every_s=args.expert_profile_every,
                       draft_model=args.draft_model, draft_mtp=args.draft_mtp,
                       **cluster_config(args))
    current: list = [None]   # the launch running now (a restart replaces it): the one to close
    code = 0
    try:
        launch = current[0] = Launch(cfg)
        if args.port is not None:
            def relaunch():
                current[0].close("restarting after a rank failure")
                current[0] = Launch(cfg)
                return current[0]
            return _serve_http(args, gguf, launch, specs, relaunch)
        if args.serve:
            return _serve_lines(args, gguf, cfg, current, signals)
        plan = launch.start()
        server = _line_server(args, gguf, launch, plan)
        if args.prompt_list is not None:
            tok = args.prompt_tokenizer
            ids = " ".join(map(str, args.prompt_list))
            out = _CaptureTokens()
            server.out = out
            server.generate(parse_gen(f"GEN {args.max_new} {ids}"))
            print(tok.decode(out.tokens) if tok else ",".join(str(t) for t in out.tokens))
            print(out.summary, file=sys.stderr)
        else:
            print("ready; Ctrl-C stops every rank", file=sys.stderr)
            while True:
                launch.coordinator.idle(1.0)
    except RankFailure as e:
        print(f"error: {e}", file=sys.stderr)
        code = 2 if _a_rank_refused_its_input(current[0]) else 1
    except RequestError as e:
        print(f"error: {e}", file=sys.stderr)
        code = 1
    except KeyboardInterrupt:
        code = EXIT_STOPPED
    finally:
        signals.on_interrupt = None
        if current[0] is not None:
            with signals.held():
                current[0].close("launcher stopping")
    return code


def _a_rank_refused_its_input(launch) -> bool:
    """A rank process that exited with status 2 refused what it was given (the model file: NaN
    weights it found loading them; a flag): the launch ends with that status too."""
    procs = getattr(getattr(launch, "ranks", None), "procs", None) or []
    return any(p.poll() == 2 for p in procs)


def _line_server(args, gguf, launch, plan):
    """The --serve / --prompt-ids surface over a started launch; prints the INFO lines."""
    from strata_dist.head.session import HeadSession

    from .line_protocol import LineProtocol, info_lines
    g = architecture_for(gguf).read_geometry(gguf)
    eos = gguf.metadata("tokenizer.ggml.eos_token_id")
    session = HeadSession(launch.coordinator, args.max_context, plan.prompt_chunk, g.n_vocab,
                          None if eos is None else int(eos),
                          checkpoint_every=args.prompt_cache_every,
                          keep_conversations=any(s.conversation_bytes for s in plan.stages),
                          conversations_in_host=any(s.conversation_in == "host"
                                                    for s in plan.stages),
                          spec=args.spec_options)
    devices = [s.register.devices[0] for s in launch.coordinator.ranks]
    for line in info_lines(plan, launch.ready, devices, args.max_context,
                           {"model": os.path.basename(args.model), "arch": g.arch,
                            "layers": g.n_layers}):
        print(line, file=sys.stdout if args.serve else sys.stderr, flush=True)
    return LineProtocol(session)


def _serve_lines(args, gguf, cfg, current: list, signals: StopSignals) -> int:
    """--serve until QUIT or the end of input. A rank that dies fails the request in flight (ERR);
    with --restart-ranks N the launch then starts its ranks afresh (a new READY) up to N times.
    `current[0]` is always the launch running, so the caller closes the right one. A SIGINT
    while a generation runs cancels it (LineProtocol.interrupt); otherwise it stops the launch."""
    from .launch import Launch
    from .line_protocol import max_line_bytes, stdin_lines
    lines = stdin_lines(max_line=max_line_bytes(args.max_context))
    restarts = 0
    while True:
        launch = current[0]
        server = _line_server(args, gguf, launch, launch.start())
        signals.on_interrupt = server.interrupt
        server.say(f"READY {args.max_context}")
        code = server.run(lines)
        signals.on_interrupt = None
        if code == 1 and server.failure:     # the operator reads stderr, the client got ERR
            print(f"error: {server.failure}", file=sys.stderr, flush=True)
        if code != 1 or restarts >= args.restart_ranks:
            return code
        restarts += 1
        print(f"warning: restarting every rank ({restarts} of {args.restart_ranks})",
              file=sys.stderr, flush=True)
        launch.close("restarting after a rank failure")
        current[0] = Launch(cfg)


def http_flags(args) -> None:
    """--port's refusals: one surface per launch; the HTTP flags need --port (--parallel
    also goes with --plan-only, which prices its sessions)."""
    if args.parallel is not None:
        from protocol.batch import MAX_BATCH_ROWS
        if not 1 <= args.parallel <= MAX_BATCH_ROWS:
            raise UsageError(f"--parallel {args.parallel}: 1 to {MAX_BATCH_ROWS}")
    if args.port is None:
        if args.serve and args.parallel is not None and args.parallel > 1:
            # the line protocol is one request at a time by design (launcher/line_protocol.py):
            # GENs are answered in order, each in full, and its T/DONE lines name no request
            raise UsageError(f"--serve and --parallel {args.parallel} cannot be combined: the "
                             f"line protocol answers one GEN at a time (its T and DONE lines "
                             f"name no request); serve --parallel {args.parallel} over HTTP "
                             f"with --port")
        for flag, value in (("--host", args.host), ("--api-key", args.api_key),
                            ("--api-key-file", args.api_key_file),
                            ("--queue-size", args.queue_size),
                            ("--parallel", None if args.plan_only else args.parallel),
                            ("--allowed-hosts", args.allowed_hosts)):
            if value is not None:
                raise UsageError(f"{flag} goes with --port")
        return
    args.api_key = api_key(args)
    for flag, on in (("--serve", args.serve), ("--prompt-ids", args.prompt_ids is not None),
                     ("--prompt", args.prompt is not None), ("--plan-only", args.plan_only)):
        if on:
            raise UsageError(f"--port {args.port} and {flag} cannot be combined: pick one surface")
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port {args.port} is not a TCP port (0-65535)")
    if args.queue_size is not None and args.queue_size < 1:
        raise UsageError(f"--queue-size {args.queue_size}: at least 1")
    if args.api_key is not None and not args.api_key.strip():
        raise UsageError("--api-key is empty")
    if args.allowed_hosts is not None:
        from strata_dist.server.hosts import parse_allowed_hosts
        try:
            parse_allowed_hosts(args.allowed_hosts)
        except ValueError as e:
            raise UsageError(str(e)) from None


def api_key(args) -> str | None:
    """The HTTP API key: --api-key, else the first line of --api-key-file, else STRATA_API_KEY
    (the two last keep it out of the process list)."""
    if args.api_key is not None and args.api_key_file is not None:
        raise UsageError(f"--api-key and --api-key-file {args.api_key_file} cannot be combined")
    if args.api_key_file is not None:
        try:
            text = read_capped(args.api_key_file, KEY_FILE_MAX, "--api-key-file")
            key = text.decode("utf-8").partition("\n")[0].strip()
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"--api-key-file {args.api_key_file}: cannot be read "
                             f"({getattr(e, 'strerror', None) or e})") from None
        if not key:
            raise UsageError(f"--api-key-file {args.api_key_file} holds no key")
        return key
    if args.api_key is None and os.environ.get("STRATA_API_KEY", "").strip():
        return os.environ["STRATA_API_KEY"].strip()
    return args.api_key


def _serve_http(args, gguf, launch, specs, relaunch) -> int:
    from strata_dist.server import serve_launch

    from .line_protocol import info_lines

    g = architecture_for(gguf).read_geometry(gguf)

    def lines(plan):
        devices = [s.register.devices[0] for s in launch.coordinator.ranks]
        return info_lines(plan, launch.ready, devices, args.max_context,
                          {"model": os.path.basename(args.model), "arch": g.arch, "layers": g.n_layers})

    return serve_launch(launch, model_path=args.model, n_vocab=g.n_vocab, arch=g.arch,
                        n_layers=g.n_layers, ctx=args.max_context, host=args.host or "127.0.0.1",
                        port=args.port, api_key=args.api_key, relaunch=relaunch,
                        restarts=args.restart_ranks,
                        queue_size=args.queue_size if args.queue_size is not None else 64,
                        gpu_of_rank={s.index: s.visible_gpu for s in specs
                                     if s.visible_gpu is not None},
                        info_lines=lines, prompt_cache_every=args.prompt_cache_every,
                        spec=args.spec_options,
                        allowed_hosts=args.allowed_hosts, parallel=args.parallel or 1)


class _CaptureTokens:
    """Collects the T lines of one GEN for --prompt-ids (which prints ids, not the protocol)."""

    def __init__(self):
        self.tokens: list[int] = []
        self.summary = ""

    def write(self, text: str) -> None:
        for line in text.splitlines():
            if line.startswith("T "):
                self.tokens.append(int(line[2:]))
            elif line.startswith("DONE") or line.startswith("PP"):
                self.summary = f"info: {line}"

    def flush(self) -> None:
        pass


if __name__ == "__main__":
    sys.exit(main())
