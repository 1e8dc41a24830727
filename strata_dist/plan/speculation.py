"""Decode tok/s with speculative decoding (--spec K) at an acceptance rate: pure arithmetic.

A verify window is one decode step of K + 1 rows through every stage (strata_dist/sampling/speculative.py).
The planner prices it as it prices a one-row step (score.py), with what changes for R rows:
- a stage reads its dense weights, head, K/V and recurrent state once for all rows (the many-row
  path reads each tile of them once for the rows it holds), and spends layer_ms per layer once;
- an expert is read once per step if any row routes to it: a pair that one token routes to with
  probability p (top_k * n_layers times its share of the routing mass, at most 1) is read by a
  step of R rows with probability 1 - (1 - p)^R, from wherever it lives (stage cache, helper
  tier, host memory); at R = 1 this is the one-row price exactly;
- a hand-off carries R hidden rows (the bytes matter only on a link between hosts).
The drafter adds its own time: the n-gram drafter nothing the model prices; a draft model K
one-row steps of its own weights on the last stage's device (`draft_step_ms`: a catch-up step,
then K - 1 drafts, draft_model.py); the MTP block (--draft mtp) K one-row steps of its one layer
and the head it projects with there (`block_step_ms` of mtp_draft.step_bytes: a catch-up call,
then K - 1 chained drafts).

Not priced: the per-row arithmetic (the model is of bytes read, as the planner's is), and on a
stage with recurrent state (qwen3next) the accepted rows it runs again after a rejected draft to
roll its state back (speculative.py), which makes such a stage's windows dearer than this says.

With --parallel B (the plan's sessions) a batched step carries each session's window, and each
stage runs those windows one after another (strata_dist/rank/stage_step.py: each through the many-row
path, as one session's), so B sessions that all draft take B windows' time a step for B windows'
tokens: the aggregate tok/s is one session's, while without speculation a batched step of B rows
reads each expert once for all of its rows (K = 0's aggregate: B rows in batched_step_ms; the
graphs are captured for 1 .. DECODE_ROWS rows, so on a stage that replays its graph (a CUDA
stage of a model without recurrent layers) B > DECODE_ROWS rows take ceil(B / DECODE_ROWS)
replays, each reading the stage's weights again; a CPU rank or a qwen3next stage takes the B rows
at once). The prediction states both, so that the cheaper
one shows. Not priced: a long context can leave the graph fewer rows a replay than DECODE_ROWS
(kernels/abi.py attn_launch's max_rows: the attention partials' budget), which makes more
replays than this says.

A window yields the drafts accepted plus one token. With each draft accepted with probability a,
independently (the i.i.d. acceptance model), the expected yield is
    1 + a + a^2 + ... + a^K = (1 - a^(K+1)) / (1 - a)      (K + 1 at a = 1),
and decode tok/s = 1000 * yield / (window_ms + drafter_ms)."""
from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from .params import PlanParams
from .pricing import DECODE_ROWS, HANDOFF_DTYPE_BYTES, weights_bytes
from .profile import RoutingProfile
from .score import CostModel
from .shape import ModelShape

ACCEPTANCES = (0.5, 0.7, 0.9)   # the acceptance rates --plan-only predicts at


def expected_yield(acceptance: float, k: int) -> float:
    """Tokens a window of K drafts yields on average: (1 - a^(K+1)) / (1 - a)."""
    if not 0.0 <= acceptance <= 1.0:
        raise ValueError(f"acceptance {acceptance}: a rate in [0, 1]")
    if k < 0:
        raise ValueError(f"K {k}: at least 0 drafts")
    if acceptance == 1.0:
        return float(k + 1)
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


def spec_tok_s(acceptance: float, k: int, window_ms: float, drafter_ms: float = 0.0) -> float:
    """Decode tok/s of windows of K drafts that take `window_ms` to verify and `drafter_ms` to
    draft, at the acceptance rate given."""
    return 1000.0 * expected_yield(acceptance, k) / (window_ms + drafter_ms)


def window_ms(plan, shape: ModelShape, profile: RoutingProfile | None, rows: int) -> float:
    """Predicted milliseconds of one decode step of `rows` rows through every stage of `plan`
    (made by make_plan for `shape` and `profile`; None: the uniform profile it then used), each
    stage taking them at once (a verify window through the many-row path): at rows = 1, the
    plan's predicted ms per token."""
    if rows < 1:
        raise ValueError(f"rows {rows}: a step has at least one")
    return _step_ms(plan, shape, profile, rows)


def replay_rows(rows: int) -> tuple[int, ...]:
    """The rows of each graph replay of a batched step of `rows` rows: the decode graphs are
    captured per row count 1 .. DECODE_ROWS (backends/batched_decode.py step_rows), so a larger
    batch takes ceil(rows / DECODE_ROWS) replays, the last one holding the rest."""
    if rows < 1:
        raise ValueError(f"rows {rows}: a step has at least one")
    full, rest = divmod(rows, DECODE_ROWS)
    return (DECODE_ROWS,) * full + ((rest,) if rest else ())


def batched_step_ms(plan, shape: ModelShape, profile: RoutingProfile | None, rows: int) -> float:
    """Predicted milliseconds of a batched decode step of `rows` sessions' rows (--parallel, no
    speculation): a stage that runs it on its decode graph (`replays_batch`) replays the graph for
    every DECODE_ROWS rows (replay_rows), each replay reading the weights and the experts its own
    rows route to; any other stage (a CPU rank, qwen3next's) takes all the rows at once through
    the general path; then all the rows go on at once. Equal to window_ms up to DECODE_ROWS rows."""
    return _step_ms(plan, shape, profile, rows, replay_rows(rows))


def replays_batch(device, shape: ModelShape) -> bool:
    """Whether a stage on `device` runs a batched step as graph replays of up to DECODE_ROWS rows
    (backends/batched_decode.py batch_replays: a CUDA stage of a model without recurrent layers,
    qwen3moe); else the general path takes the step's rows at once (a CPU rank; a model with
    recurrent layers, qwen3next, whose graph reads one session's state)."""
    return device.decodes_as_graph and "linear" not in shape.layer_kind


def _step_ms(plan, shape: ModelShape, profile: RoutingProfile | None, rows: int,
             replays: tuple[int, ...] | None = None) -> float:
    """A step of `rows` rows: each stage that replays a batch (`replays_batch`) runs replays of
    `replays` rows one after another (None: all the rows at once), any other stage runs the
    rows at once; then every stage hands all the rows to the next one. A pair a helper tier
    holds or no tier holds is read by the replays of the stage whose layer it is."""
    if profile is None:
        profile = RoutingProfile.uniform(shape.n_layers, shape.n_experts)
    cm = CostModel(shape, plan.devices, profile, plan.cells, plan.params,
                   handoff_rows=plan.prompt_chunk, resident=plan.resident_by_device())
    E = shape.n_experts
    blob = np.repeat(np.asarray(shape.blob_bytes, dtype=np.float64), E)    # by flat pair id
    one = np.minimum(1.0, cm.lk * cm.mass)          # a token routes to the pair
    index = {dev: i for i, dev in enumerate(plan.devices)}
    p = plan.params
    placed = np.zeros(blob.size, dtype=bool)
    helpers = []
    for h in plan.live_helpers:
        ids = np.array([layer * E + e for layer, e in h.pairs], dtype=np.int64)
        placed[ids] = True
        helpers.append((h, ids, float((one[ids] * blob[ids]).sum())))
    for st in plan.stages:
        placed[np.array([layer * E + e for layer, e in st.pairs], dtype=np.int64)] = True
    layer_of = np.arange(blob.size) // E
    total = 0.0
    for st in plan.stages:
        d = index[st.device]
        held = np.array([layer * E + e for layer, e in st.pairs], dtype=np.int64)
        mine = (layer_of >= st.lb) & (layer_of < st.le)
        missed = mine & ~placed
        my_helpers = [(h, ids[mine[ids]], once) for h, ids, once in helpers]   # this stage's pairs
        runs = replays if replays is not None and replays_batch(st.device, shape) else (rows,)
        for n in runs:
            read = 1.0 - (1.0 - one) ** n            # any of the replay's rows does
            total += ((cm.read[d, st.lb, st.le] + float((read[held] * blob[held]).sum()))
                      / cm.bw[d] + p.layer_ms * (st.le - st.lb))
            for h, ids, once in my_helpers:
                # what reading the tier's pairs costs, in proportion to the bytes the replay reads
                total += h.read_ms * (float((read[ids] * blob[ids]).sum()) / once if once else 0.0)
            total += float((read[missed] * (p.miss_ms + blob[missed] / cm.host_bw)).sum())
    devs = [st.device for st in plan.stages]
    row_bytes = rows * shape.hidden * HANDOFF_DTYPE_BYTES
    total += sum(cm._link(a, b, row_bytes=row_bytes) for a, b in zip(devs, devs[1:]))
    if len(devs) > 1:   # the step's tokens back to the first stage: ids, no hidden rows
        total += cm._link(devs[-1], devs[0], row_bytes=0)
    return float(total)


def draft_step_ms(draft: ModelShape, bandwidth_gbs: float | None, params: PlanParams,
                  cells: int) -> float:
    """One one-row step of a draft model on the device of bandwidth `bandwidth_gbs` (None: the
    planner's default): its dense weights and head, its K/V (kv_fill of `cells`) and recurrent
    state, and the top_k experts of each layer a token routes to, read once; layer_ms a layer."""
    L = draft.n_layers
    state = sum(params.kv_fill * cells * draft.kv_bytes_per_cell[l]
                if draft.layer_kind[l] == "attention" else 2.0 * draft.recurrent_bytes[l]
                for l in range(L))
    experts = draft.top_k * float(sum(draft.blob_bytes))
    bw = (bandwidth_gbs or params.default_bw_gbs) * 1e6    # bytes per millisecond
    return (weights_bytes(draft, 0, L, True, True) + state + experts) / bw + params.layer_ms * L


def block_step_ms(step_bytes: float, bandwidth_gbs: float | None, params: PlanParams) -> float:
    """One one-row step of the MTP block that reads `step_bytes` (mtp_draft.step_bytes) on the
    device of bandwidth `bandwidth_gbs` (None: the planner's default); layer_ms for its layer."""
    bw = (bandwidth_gbs or params.default_bw_gbs) * 1e6    # bytes per millisecond
    return step_bytes / bw + params.layer_ms


@dataclass(frozen=True)
class SpecPrediction:
    """--spec K's predicted decode: one window's verify and draft milliseconds, and tok/s at each
    acceptance rate of `acceptances` (beside K = 0's, the plan's one-row steps); with `sessions`
    B > 1 (--parallel), tok/s over all B streams (K = 0's: a batched step of B rows, which a
    stage on its decode graph runs as `graph_replays` replays; 0: no stage replays a graph)."""
    k: int
    drafter: str
    window_ms: float
    drafter_ms: float
    k0_tok_s: float
    acceptances: tuple[float, ...]
    sessions: int = 1
    graph_replays: int = 0

    def tok_s(self, acceptance: float) -> float:
        return spec_tok_s(acceptance, self.k, self.window_ms, self.drafter_ms)

    def to_dict(self) -> dict:
        return {"k": self.k, "drafter": self.drafter, "window_ms": round(self.window_ms, 4),
                "drafter_ms": round(self.drafter_ms, 4), "k0_tok_s": round(self.k0_tok_s, 2),
                "sessions": self.sessions,
                "tok_s": {f"{a:g}": round(self.tok_s(a), 2) for a in self.acceptances}}

    def in_plan_json(self, plan_json: str) -> str:
        """The plan's JSON (Plan.to_json) with this prediction under "speculation"."""
        out = json.loads(plan_json)
        out["speculation"] = self.to_dict()
        return json.dumps(out, indent=1)

    def lines(self) -> list[str]:
        at = ", ".join(f"{self.tok_s(a):.1f} at {a:g}" for a in self.acceptances)
        n = self.graph_replays
        replays = f", {n} graph replay{'s' if n > 1 else ''} a step" if n else ""
        over = (f" over {self.sessions} sessions (their windows one after another a step; K = 0 "
                f"batches their rows{replays})" if self.sessions > 1 else "")
        return [f"speculation (--spec {self.k}, drafter {self.drafter}): a window of {self.k + 1} "
                f"rows {self.window_ms:.3f} ms + drafting {self.drafter_ms:.3f} ms; predicted "
                f"decode tok/s{over} {at} (acceptance per draft, i.i.d.; K = 0: "
                f"{self.k0_tok_s:.1f})"]


def predict_spec(plan, shape: ModelShape, profile: RoutingProfile | None, k: int,
                 drafter: str = "ngram", draft: ModelShape | None = None,
                 acceptances: tuple[float, ...] = ACCEPTANCES,
                 block_bytes: float | None = None) -> SpecPrediction:
    """The prediction of --spec K on `plan`; `draft`: the draft model's shape as the last stage's
    device loads it (drafter "model"), priced there; `block_bytes`: what one step of the MTP
    block reads there (drafter "mtp", mtp_draft.step_bytes). With the plan's sessions B > 1
    (--parallel) the tok/s are over B streams (module doc)."""
    drafting = 0.0
    last = plan.stages[-1].device
    if draft is not None:
        drafting = k * draft_step_ms(draft, last.mem_bandwidth_gbs, plan.params, plan.cells)
    elif block_bytes is not None:
        drafting = k * block_step_ms(block_bytes, last.mem_bandwidth_gbs, plan.params)
    sessions = plan.params.sessions
    k0 = (1000.0 / plan.predicted_ms_per_token if sessions == 1
          else 1000.0 * sessions / batched_step_ms(plan, shape, profile, sessions))
    graph_replays = (len(replay_rows(sessions))
                     if any(replays_batch(st.device, shape) for st in plan.stages) else 0)
    return SpecPrediction(k, drafter, window_ms(plan, shape, profile, k + 1), drafting, k0,
                          tuple(acceptances), sessions, graph_replays)
