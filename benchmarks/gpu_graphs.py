"""The GPU check's CUDA-graph part (``graphs=``, inference/runtime/static_steps.py), run by benchmarks/gpu_check.py.

At SmolLM2-135M's shape (``gpu_models.SMOLLM2_135M``) and Llama-3.1-8B's (``LLAMA31_8B``, ~16 GB, made on the
device: ``gpu_models.device_llama``), random bf16 weights, batch 1, each part a guarded section (``run_shape``);
the parts issue 45's verdicts read first at both shapes, then the others (``ORDER``, ``VERDICT_PARTS``):
  steps:    the 1-token step (``hidden`` + ``logits``, benchmarks/timing.py): wall vs device time (torch.profiler,
            ``device_time``: absurd events dropped, a sum past the wall time "unreliable"), graphs off and on, beside
            its graph and logits replayed back to back between CUDA events; 1 / 16 / 64-row verification graphs
            on, over 1 row;
  gqa:      the captured 1 / 16-row steps over 2,048 slots, grouped-query attention folded vs repeated (``gpu_gqa``);
  loop:     tokens/s of the plain loop graphs off / on beside ``generate`` eager and ``hf_generate_static``: an
            untimed warm-up call each (captures, transformers' compile), interleaved rounds, medians + min / max;
            the weight-read floor (the bytes of weights a step reads, ``read_bytes``: an untied input embedding's
            one row, / the device's memory bandwidth, ``read_bandwidth``: measured there, 4.2e12 B/s on an H200)
            and the loop's fraction of it by its decode-only rate;
  drafting: Medusa (3 random heads, tree16; greedy, and exact sampling at temperature 0.7: one host read a step
            either way) and EAGLE-3 (gpu_check's random drafter) steps, graphs on and off, over a plain captured step;
  stub:     ``gpu_stub.StubChain``, a drafter of set acceptance, end to end against the captured plain loop;
  capture_ways: the 1-token static step uncaptured, captured with torch.cuda.CUDAGraph directly (what graphs=on
            does) and compiled with torch.compile(mode="reduce-overhead") (inductor + CUDA-graph trees): its
            compile / warm-up seconds, graph breaks, whether it equals the uncaptured step, which is faster and why;
  batches:  the plain batched loop at batch 1 / 4 / 16 / 32, graphs off and on (``gpu_batches``), last: it
            gives way first when time runs short;
then ``m.static.summary()`` (captures, capture time, graph memory), the verdicts (first, per shape: everything
captured, no capture failed, no replay disagreed; a shape whose "on" fell back to uncaptured steps has its other
verdicts and its summary column marked "on (fell back to uncaptured)") and a summary.md section.
Dry run (CPU): both shapes are ``gpu_models.TINY`` (``--full-shape``: SmolLM2 keeps its own), sizes shrink,
and "graphs on" is ``graphs=uncaptured`` (``on`` is refused off CUDA; ``graphs_on_mode`` in the JSON says
which), the profiler records CPU op time (``clock: cpu``), reduce-overhead is skipped (its reason recorded),
and every verdict reads "dry run".
"""

from __future__ import annotations

import gc
import time
import traceback

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from benchmarks.gpu_models import EAGLE3_TAU, LLAMA31_8B, SMOLLM2_135M, TINY, device_llama, eagle3_model
from benchmarks.gpu_batches import batch_loop, summary_rows as batch_rows
from benchmarks.gpu_capture_ways import capture_ways
from benchmarks.gpu_gqa import gqa_fold, summary_rows as gqa_rows
from benchmarks.gpu_stub import stub_speed
from benchmarks.timing import median, off_if, rate, spread, sync, verification_step
from inference.heads.medusa import MedusaHeads
from inference.heads.spec import HeadsSpec
from inference.loading import attach_heads
from inference.methods import generate
from inference.methods.eagle3_choice import eagle3_name, eagle3_step_times
from inference.methods.medusa_choice import step_times
from inference.runtime.model import MedusaModel
from inference.runtime.static_steps import apply_graphs
from inference.runtime.tree import resolve_tree
from inference.runtime.verify import SamplingConfig

SHAPES = {"smollm2_135m": ("SmolLM2-135M", SMOLLM2_135M), "llama31_8b": ("Llama-3.1-8B", LLAMA31_8B)}
READ_BYTES_PER_S = 4.2e12   # the H200's (issue 45: ~4.2 TB/s); the dry run's stand-in, a GPU measures its own
# Seconds a part may take on the H200 at the 8B shape (generous; hf_generate_static's compile dominates the loop):
# a part that could not finish before the deadline is skipped, and one still running at 1.5x its estimate is stopped
# (gpu_check's ``Sections``), so gpu_check.py writes its summary in time. ``reduce_overhead``: capture_ways's
# torch.compile(mode="reduce-overhead") of the step (inductor, 60-120 s at the 8B shape), run only where the time
# left covers it besides the part's own (else the part compares uncaptured and CUDAGraph alone, and lists it skipped).
PART_S = {"build": 25, "steps": 15, "gqa": 10, "loop": 110, "drafting": 48, "stub": 30, "capture_ways": 15,
          "reduce_overhead": 90, "batches": 30}
# SmolLM2's: its 0.27 GB of weights build in seconds and every device-bound figure is ~60x smaller; the loop keeps
# most of the 8B's (hf_generate_static's compile: 30 layers against 32), drafting the drafters' captures.
SHAPE_PART_S = {"llama31_8b": PART_S, "smollm2_135m": {**PART_S, "build": 5, "loop": 85, "drafting": 30}}
PARTS = ("steps", "gqa", "loop", "drafting", "stub", "batches", "capture_ways")   # a shape's parts, in this order
# The parts issue 45's verdicts read (``verdicts``: steps, the loop and its floor, drafting, 8B's stub). ``ORDER``:
# both shapes' first, so a short budget costs the other parts, not a verdict; at the estimates they take
# SmolLM2 5 + 15 + 85 + 30 = 135 s and the 8B 25 + 15 + 110 + 48 + 30 = 228 s, 363 s in all (+ ~1 s measuring
# the bandwidth): inside the 440 s that gpu_check.sh's default 470 leaves less its margins (20 s to its timeout,
# gpu_check's RESERVE_S 10) where the script's start and the tier take up to 76 s (the tier alone: 33 s on the
# H200 in December). Parts start on the time really left, so one quicker than its estimate leaves it to the next.
VERDICT_PARTS = {"smollm2_135m": ("steps", "loop", "drafting"), "llama31_8b": ("steps", "loop", "drafting", "stub")}
ORDER = (("smollm2_135m", "verdicts"), ("llama31_8b", "verdicts"), ("llama31_8b", "rest"), ("smollm2_135m", "rest"))
SAMPLED = SamplingConfig(mode="sample", temperature=0.7)   # the drafting part's sampled Medusa step
# A kernel sum above the step's median wall time by more than this is "unreliable": the 8B's captured step is
# device-bound (wall ~ kernels + a launch), so run-to-run noise alone can put the sum a little over the wall.
KERNEL_OVER_WALL = 1.05
TARGETS = dict(wall_vs_kernel=1.3, vs_hf_static={"smollm2_135m": 2.0, "llama31_8b": 1.3}, floor=0.60,
               verify16=1.25, draft_step=1.3, stub=(2.0, 1.6))


def sizes(dry: bool) -> dict:
    if dry:
        return dict(dry=True, prompt_len=8, new_tokens=6, rounds=2, profile_steps=2, step_rounds=1, per_round=1,
                    verify_rows=[1, 16, 64], draft_rounds=1, draft_steps=2, warmup=1, stub_tokens=10, stub_rounds=1,
                    ways_rounds=2, ways_per_round=2, compile_warmup=0, event_reps=2)
    return dict(dry=False, prompt_len=64, new_tokens=64, rounds=3, profile_steps=10, step_rounds=3, per_round=5,
                verify_rows=[1, 16, 64], draft_rounds=2, draft_steps=6, warmup=2, stub_tokens=128, stub_rounds=2,
                ways_rounds=5, ways_per_round=10, compile_warmup=4, event_reps=50)


# -- steps: wall vs device time, verification rows ------------------------------------------------------------
def kernel_sum(durations_us: list, window_us: float, steps: int) -> dict:
    """The profiler's device events summed per step, sanity-checked: CUPTI can report absurd durations (corrupted
    timestamps at a session's start, pytorch#192021; CUDA-graph replays, kineto#1165), so an event of negative
    duration or one longer than the whole profiled window is dropped (counted), and a sum past the window, which
    one stream cannot be busy for, marks the figure unreliable."""
    kept = [d for d in durations_us if 0 <= d <= window_us]
    return {"kernel_ms": round(sum(kept) / 1e3 / steps, 3), "device_ops": round(len(kept) / steps, 1),
            "dropped_events": len(durations_us) - len(kept), "kernel_unreliable": sum(kept) > window_us}


def device_time(fn, device: torch.device, steps: int) -> dict:
    """Device ms per call of ``fn`` over ``steps`` calls under torch.profiler: each CUDA event (kernel, copy,
    memset, also when replayed from a graph) counted once by its own duration (summing key_averages' self
    device times counts a kernel twice: on its op and on itself), checked by ``kernel_sum`` against the profiled
    window (host clock, device synchronized at both ends). On CPU: torch ops' self CPU time instead."""
    cuda = device.type == "cuda"
    sync(device)
    t = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        for _ in range(steps):
            fn()
        sync(device)
        window_us = (time.perf_counter() - t) * 1e6
    events = prof.events()
    if cuda:
        dev = [e.time_range.elapsed_us() for e in events if e.device_type == DeviceType.CUDA]
        return {**kernel_sum(dev, window_us, steps), "clock": "cuda"}
    cpu_us = sum(e.self_cpu_time_total for e in events if e.device_type == DeviceType.CPU)
    return {"kernel_ms": round(cpu_us / 1e3 / steps, 3), "device_ops": None, "dropped_events": 0,
            "kernel_unreliable": False, "clock": "cpu"}


def profiler_short(on: dict, off: dict) -> bool:
    """Whether the profiler missed kernels of the graph's replays (CUDA only): it saw under half the kernels
    graphs off launches for the same step, or under half the device time of its graph and logits replayed back to
    back."""
    if on.get("clock") != "cuda":
        return False
    few = bool(on.get("device_ops") is not None and off.get("device_ops") and on["device_ops"] < off["device_ops"] / 2)
    events = on.get("events_ms")
    return few or bool(events and on["kernel_ms"] < events / 2)


def step_costs(m: MedusaModel, prompt: list[int], sz: dict) -> dict:
    """The 1-token step graphs off / on (wall, device time, their ratio; graphs on also the same step's device time
    from CUDA events, back to back), then 1 / 16 / 64-row verification steps graphs on as ratios to the 1-row
    step; medians of interleaved rounds."""
    rows = sz["verify_rows"]
    fns = {}
    for mode in ("off", "on"):   # each closure keeps its own cache: dynamic (off) or a static view (on)
        with off_if(m, mode):
            fns[mode] = verification_step(m, prompt, max_nodes=max(rows))
    for fn in fns.values():
        fn(1), fn(1)   # warm-up: kernels chosen, the 1-row bucket captured
    walls: dict = {mode: [] for mode in fns}
    for _ in range(sz["step_rounds"]):
        for mode, fn in fns.items():
            walls[mode] += [fn(1) for _ in range(sz["per_round"])]
    out: dict = {}
    for mode, fn in fns.items():
        wall = median(walls[mode]) * 1e3
        prof = device_time(lambda: fn(1), m.device, sz["profile_steps"])
        # a kernel sum past the step's own wall time is no kernel time (one stream, synchronized at both ends)
        over = prof["clock"] == "cuda" and prof["kernel_ms"] > wall * KERNEL_OVER_WALL
        prof["kernel_unreliable"] = prof["kernel_unreliable"] or over
        out[mode] = {"wall_ms": round(wall, 3), **prof, "samples": len(walls[mode]),
                     "wall_vs_kernel": round(wall / prof["kernel_ms"], 3) if prof["kernel_ms"] else None}
    captured = out["on"]
    # the step's device time paced by the device (graph + logits replayed back to back): beside the profiler's sum
    captured["events_ms"] = events = round(fns["on"].device_ms(1, sz["event_reps"]), 3)
    captured["wall_vs_events"] = round(captured["wall_ms"] / events, 3) if events else None
    captured["profiler_short"] = profiler_short(captured, out["off"])
    on = fns["on"]
    for n in rows:
        on(n), on(n)   # each bucket captured before it is timed
    times: dict = {n: [] for n in rows}
    for _ in range(sz["step_rounds"]):
        for n in rows:
            times[n] += [on(n) for _ in range(sz["per_round"])]
    base = median(times[rows[0]])
    out["verify"] = {n: {"ms": round(median(t) * 1e3, 3), "vs_1": round(median(t) / base, 3), "samples": len(t)}
                     for n, t in times.items()}
    return out


# -- loop: plain off / on vs transformers ---------------------------------------------------------------------
LOOP = ("plain_off", "plain_on", "hf_generate", "hf_generate_static")


def loop_call(m: MedusaModel, name: str, ids: list[int], n: int):
    if name.startswith("plain"):
        with off_if(m, name[6:]):
            return generate(m, ids, "autoregressive", max_new_tokens=n, eos_token_ids=())
    return generate(m, ids, name, max_new_tokens=n)   # runners: transformers' own cache, m.static unused


def plain_loop(m: MedusaModel, prompts: list, sz: dict, errors: dict, where: str) -> dict:
    """Tokens/s (prefill included) of ``LOOP``'s four, steady state, and the plain loop's decode-only tokens/s
    (``GenerationOutput.decode_tokens_per_s``: its prefill runs uncaptured); a method that fails its warm-up is left
    out (its traceback in ``errors``) and the others still run."""
    n, names, warm = sz["new_tokens"], list(LOOP), {}
    for name in LOOP:   # untimed: captures, kernel choices, transformers' compile for hf_generate_static on CUDA
        t = time.perf_counter()
        try:
            loop_call(m, name, prompts[0], n)
            warm[name] = round(time.perf_counter() - t, 2)
        except Exception:
            errors[f"{where}.{name}"] = traceback.format_exc()
            names.remove(name)
    rates: dict = {k: [] for k in names}
    decode: dict = {k: [] for k in names if k.startswith("plain")}   # transformers' runners time one whole call
    tokens: dict = {k: [] for k in names}
    for r in range(sz["rounds"]):
        ids = prompts[r % len(prompts)]
        for name in names[r % len(names):] + names[:r % len(names)]:   # rotating order: no method always first
            out = loop_call(m, name, ids, n)
            rates[name].append(rate(out))
            tokens[name].append(out.tokens)
            if name in decode:
                decode[name].append(out.decode_tokens_per_s)
    tps = {k: spread(v) for k, v in rates.items()}
    on = tps.get("plain_on", {}).get("median")
    return {"new_tokens": n, "prompt_len": len(prompts[0]), "rounds": sz["rounds"], "warmup_s": warm,
            "tokens_per_s": tps, "decode_tokens_per_s": {k: spread(v) for k, v in decode.items()},
            "plain_on_vs": {k: round(on / v["median"], 3) for k, v in tps.items() if on and k != "plain_on"},
            "identical_to_plain_on": {k: sum(a == b for a, b in zip(tokens["plain_on"], v))
                                      for k, v in tokens.items() if on and k != "plain_on"}}


def read_bandwidth(device: torch.device, gib: int = 2, copies: int = 10) -> tuple[float, str]:
    """(bytes/s, how it was found) for the weight-read floor. CUDA: a device-to-device copy of ``gib`` GiB, bytes
    read and written over the median of ``copies`` timed copies (CUDA events, after a warm-up), as the device
    notes measure it (H200 ~4.3e12, H100 ~3.0e12: the lent kind decides, so no figure is assumed). Elsewhere
    (dry run): ``READ_BYTES_PER_S``."""
    if device.type != "cuda":
        return READ_BYTES_PER_S, f"assumed {READ_BYTES_PER_S:.2e} B/s (the H200's; dry run)"
    n = gib * 2**30
    src, dst = torch.empty(n, dtype=torch.uint8, device=device), torch.empty(n, dtype=torch.uint8, device=device)
    dst.copy_(src)
    times = []
    for _ in range(copies):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    bw = 2 * n / median(times)
    return bw, f"measured {bw:.2e} B/s: a {gib} GiB device-to-device copy, bytes read + written, median of {copies}"


def read_bytes(model) -> tuple[int, int]:
    """(bytes of parameters a 1-token step reads, input-embedding bytes left out of them). A decoding step reads
    one row of the input embedding, not the table (Llama-3.1-8B's untied one: 1.05 GB of 16 GB): where it is not
    the lm_head's own weight, the rest of the table is left out; tied, the lm_head reads it whole (counted once)."""
    size = sum(p.numel() * p.element_size() for p in model.parameters())   # a tied weight is one parameter here
    table, head = model.get_input_embeddings().weight, model.get_output_embeddings()
    if head is not None and table.data_ptr() == head.weight.data_ptr():
        return size, 0
    left = (table.shape[0] - 1) * table[0].numel() * table.element_size()
    return size - left, left


def weight_floor(m: MedusaModel, loop: dict, read_bytes_per_s: float) -> dict:
    """Tokens/s if a step cost only reading once what it reads of the weights (``read_bytes``) at
    ``read_bytes_per_s``; the loop's fraction of it by its decode-only rate (the prefill is no decoding step; its
    rate with the prefill where a loop has none)."""
    size, left = read_bytes(m.model)
    floor = read_bytes_per_s / size
    tps, dec = loop.get("tokens_per_s", {}), loop.get("decode_tokens_per_s", {})
    fig = {k: (dec.get(k) or tps[k])["median"] for k in ("plain_off", "plain_on") if k in tps}
    return {"param_bytes": size + left, "read_bytes": size, "input_embedding_left_out": left,
            "ms_per_token": round(1e3 / floor, 4), "tokens_per_s": round(floor, 1),
            "rate": "decode-only" if dec else "prefill included",
            **{f"{k}_tokens_per_s": v for k, v in fig.items()},
            **{f"{k}_fraction": round(v / floor, 6) for k, v in fig.items()}}


# -- drafting: Medusa and EAGLE-3 steps vs a plain captured step ---------------------------------------------
def medusa_model(m: MedusaModel, seed: int = 0) -> MedusaModel:
    """``m``'s backbone with 3 random Medusa heads (one residual block each) sharing its lm_head, on the device."""
    with torch.device(m.device):
        heads = MedusaHeads(HeadsSpec(num_heads=3, num_layers=1, hidden_size=m.config.hidden_size,
                                      vocab_size=m.vocab_size, projection="shared", base_model="random:llama"))
    g = torch.Generator(device=m.device).manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0.0, p.shape[-1] ** -0.5, generator=g)
    return attach_heads(m.model, heads)


def drafting_steps(m: MedusaModel, prompt: list[int], sz: dict, mode_on: str) -> dict:
    """Median ms of a plain, a Medusa tree16 (greedy and sampled) and EAGLE-3 decoding step (drafting + verification
    + acceptance, ``run_decoder``'s step time), graphs on and off, interleaved rounds; each over the plain captured
    step."""
    med, eag = medusa_model(m), eagle3_model(m)
    apply_graphs(med, mode_on), apply_graphs(eag, mode_on)
    tree, w, k = resolve_tree("tree16", 3), sz["warmup"], sz["draft_steps"]
    kinds = {"plain": (m, lambda x: step_times(x, prompt, None, steps=k, warmup=w)),
             "medusa tree16": (med, lambda x: step_times(x, prompt, tree, steps=k, warmup=w)),
             # not "medusa ...": the Medusa verdict's rows are greedy steps
             "sampled medusa tree16": (med, lambda x: step_times(x, prompt, tree, steps=k, warmup=w, sampling=SAMPLED))}
    for s in EAGLE3_TAU:
        kinds[f"eagle3 {eagle3_name(s)}"] = (eag, lambda x, s=s: eagle3_step_times(x, prompt, s, steps=k, warmup=w))
    times: dict = {(kind, mode): [] for kind in kinds for mode in ("on", "off")}
    for _ in range(sz["draft_rounds"]):
        for mode in ("on", "off"):
            for kind, (x, fn) in kinds.items():
                with off_if(x, mode):
                    times[kind, mode] += fn(x)
    ms = {key: median(t) * 1e3 for key, t in times.items()}
    on = ms["plain", "on"]
    out = {"tree": tree.choices, "plain_ms": {mode: round(ms["plain", mode], 3) for mode in ("on", "off")},
           "kinds": {}, "static": {"medusa": med.static.summary(), "eagle3": eag.static.summary()}}
    for kind in list(kinds)[1:]:
        out["kinds"][kind] = {"ms": {mode: round(ms[kind, mode], 3) for mode in ("on", "off")},
                              "vs_plain_captured": {mode: round(ms[kind, mode] / on, 3) for mode in ("on", "off")},
                              "off_vs_plain_off": round(ms[kind, "off"] / ms["plain", "off"], 3),
                              "samples": len(times[kind, "on"])}
    return out


# -- the per-shape driver -------------------------------------------------------------------------------------
def run(result: dict, section, device: torch.device, dry: bool, full_shape: bool = False,
        deadline: float = float("inf"), skip=()) -> None:
    """Both shapes into ``result["graphs"]`` in ``ORDER`` (each part through gpu_check's ``section``: a failure
    lands in ``result["errors"]``, the next part runs): first the parts issue 45's verdicts read (``VERDICT_PARTS``)
    at both shapes, SmolLM2's model kept meanwhile (0.3 GB), then the other parts, each shape's model freed after
    its last. A part that could not end before ``deadline`` is skipped (listed); ``skip``: gpu_check's ``--skip``,
    whose ``graphs.<part>`` names leave that part out at both shapes (a second call's)."""
    t0, sz = time.perf_counter(), sizes(dry)
    cuda = device.type == "cuda"
    try:
        bandwidth, how = read_bandwidth(device)
    except Exception as exc:   # the floor's figure only: the rest of the check still runs
        bandwidth, how = READ_BYTES_PER_S, f"assumed {READ_BYTES_PER_S:.2e} B/s (measuring failed: {exc!r})"
        torch.cuda.empty_cache()
    g = result["graphs"] = {"graphs_on_mode": "on" if cuda else "uncaptured", "sizes": sz, "skipped": [],
                            "read_bytes_per_s": bandwidth, "read_bandwidth": how, "shapes": dict.fromkeys(SHAPES),
                            "graphs_on_note": "graphs 'on' = " + ("captured CUDA graphs" if cuda else
                                              "graphs=uncaptured (dry run: graphs=on is refused off CUDA)")}
    held: dict = {}   # shape key -> (model, prompts) between its two phases
    for i, (key, phase) in enumerate(ORDER):
        label, shape = SHAPES[key]
        used = shape if not dry or (full_shape and key == "smollm2_135m") else TINY
        parts = [p for p in PARTS if (p in VERDICT_PARTS[key]) == (phase == "verdicts") and f"graphs.{p}" not in skip]
        later = any(k == key for k, _ in ORDER[i + 1:])
        run_shape(g, result["errors"], key, label, used, section, device, sz, deadline, parts, held, later)
    g["seconds"] = round(time.perf_counter() - t0, 1)


def shape_parts(m: MedusaModel, prompts: list, s: dict, g: dict, key: str, sz: dict, errors: dict,
                compile_too: dict) -> dict:
    """A shape's parts, name -> the call that measures it into ``s`` (``PARTS`` in that order)."""
    def loop():
        s["loop"] = plain_loop(m, prompts, sz, errors, f"graphs.{key}.loop")
        s["floor"] = weight_floor(m, s["loop"], g["read_bytes_per_s"])

    def ways():   # compile_too["on"]: whether reduce-overhead's compile fits too (decided as the part starts)
        s["capture_ways"] = capture_ways(m, prompts[0], sz, errors, f"graphs.{key}.capture_ways", compile_too["on"])

    return {"steps": lambda: s.update(step=step_costs(m, prompts[0], sz)),
            "gqa": lambda: s.update(gqa=gqa_fold(m, prompts[0], sz, g["graphs_on_mode"])), "loop": loop,
            "drafting": lambda: s.update(drafting=drafting_steps(m, prompts[1], sz, g["graphs_on_mode"])),
            "stub": lambda: s.update(stub=stub_speed(m, prompts[2], sz)),
            "batches": lambda: s.update(batches=batch_loop(m, prompts, sz)),
            # last: compiling the whole forward (reduce-overhead) is the part whose time is least known
            "capture_ways": ways}


def run_shape(g: dict, errors: dict, key: str, label: str, shape: dict, section, device: torch.device, sz: dict,
              deadline: float, parts=PARTS, held: dict | None = None, keep: bool = False) -> None:
    """One phase of a shape: ``parts`` in ``PARTS``'s order, the model built first in the shape's first phase;
    then its static steps' summary. ``keep``: the model stays in ``held`` for the shape's later phase, else freed."""
    held = {} if held is None else held
    first = g["shapes"].get(key) is None
    if first:
        g["shapes"][key] = {"label": label, "shape": shape, "tiny_stand_in": shape is TINY}
    s, cuda, est = g["shapes"][key], device.type == "cuda", SHAPE_PART_S[key]

    def fits(part: str, extra_s: float = 0.0, name: str = "") -> bool:
        """Whether ``part`` (its estimate, plus ``extra_s``; nothing on the dry run) can end before the deadline;
        if not, listed as skipped (as ``name``, default ``part``)."""
        if time.perf_counter() + (0 if sz["dry"] else est[part] + extra_s) <= deadline:
            return True
        g["skipped"].append(f"{key}.{name or part}")
        return False

    def build():
        t = time.perf_counter()
        m = MedusaModel(model=device_llama(shape, device, torch.bfloat16), tokenizer=None, heads=None)
        apply_graphs(m, g["graphs_on_mode"])
        gen = torch.Generator().manual_seed(3)
        held[key] = m, [torch.randint(0, shape["vocab_size"], (sz["prompt_len"],), generator=gen).tolist()
                        for _ in range(3)]
        s["build_s"] = round(time.perf_counter() - t, 2)
        s["param_bytes"] = sum(p.numel() * p.element_size() for p in m.model.parameters())

    if first and cuda:
        torch.cuda.reset_peak_memory_stats()
    if first and fits("build"):
        section(f"graphs.{key}.build", build, est["build"])
    if key not in held:   # not built (time, or its error recorded): none of its parts can run
        return
    m, prompts = held[key] if keep else held.pop(key)
    compile_too: dict = {}
    fns = shape_parts(m, prompts, s, g, key, sz, errors, compile_too)
    for part in parts:
        if not fits(part):
            continue
        estimate = est[part]
        if part == "capture_ways":   # reduce-overhead's compile only where the time left covers it too
            compile_too["on"] = fits(part, est["reduce_overhead"], "capture_ways.reduce_overhead")
            if compile_too["on"]:
                estimate += est["reduce_overhead"]
        section(f"graphs.{key}.{part}", fns[part], estimate)
    s["static"] = m.static.summary()
    if cuda:   # the 8B's peak includes SmolLM2's model, kept meanwhile (0.3 GB)
        s["peak_gpu_memory_gb"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    del m, fns, prompts
    if cuda:   # first what dynamo holds (hf_generate_static's compiled forward and its graphs), then the model
        torch._dynamo.reset()
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()


# -- verdicts and summary -------------------------------------------------------------------------------------
def static_stats(s: dict) -> dict:
    """A shape's static steps' summaries (``StaticSteps.summary``): the backbone model's, then the drafting part's
    Medusa and EAGLE-3 models' (their own static steps) where it ran."""
    return {"backbone": s["static"], **(s.get("drafting") or {}).get("static", {})}


def fell_back(s: dict, g: dict | None) -> bool:
    """Whether graphs "on" fell back to uncaptured steps at this shape: on CUDA a failed capture sets the static steps
    uncaptured from then on, so its "on" figures are (partly) uncaptured ones."""
    if (g or {}).get("graphs_on_mode") != "on" or not s or "static" not in s:
        return False
    return any(not st["captured"] or st["failed_captures"] for st in static_stats(s).values())


def all_captured(s: dict) -> tuple[bool, str]:
    """Every static step and drafter call of the shape captured: the static steps still captured, no capture
    failed, no replay disagreed with its uncaptured run (backbone steps and drafter calls, every model)."""
    stats, ok, parts = static_stats(s), True, []
    first = stats["backbone"]
    if first["captured"] and not first["captures"] and not first["failed_captures"]:
        raise ValueError("nothing captured yet: not run")
    for name, st in stats.items():
        calls = st["drafter_calls"]
        failed = st["failed_captures"] + calls["failed_captures"]
        disagreed = st["disagreeing_replays"] + calls["disagreeing_replays"]
        checked = st["checked_replays"] + calls["checked_replays"]
        ok = ok and st["captured"] and not failed and not disagreed
        how = "" if st["captured"] else ", fell back to uncaptured" if st["failed_captures"] else ", uncaptured"
        parts.append(f"{name}: {len(st['captures'])} steps + {len(calls['captures'])} drafter calls captured, "
                     f"{failed} failed, {disagreed} of {checked} checked replays disagreed{how}")
    return ok, "; ".join(parts)


def verdicts(g: dict | None, dry: bool) -> list[dict]:
    """The graph targets (``TARGETS``), in order; "not run" where a figure is missing, "dry run" on the CPU. First, per
    shape, whether graphs=on captured everything; a shape where it fell back to uncaptured steps has every other
    verdict marked "(on fell back to uncaptured)": its "on" figures are not captured ones."""
    shapes, t, out = (g or {}).get("shapes", {}), TARGETS, []

    def add(target: str, key: str, fig, mark: bool = True):   # fig(a shape's figures) -> (passed or None, detail)
        try:
            ok, detail = fig(shapes[key])
            verdict = "dry run" if dry else "unreliable" if ok is None else "PASS" if ok else "FAIL"
            if mark and not dry and fell_back(shapes[key], g):
                verdict, detail = f"{verdict} (on fell back to uncaptured)", f"on (fell back to uncaptured): {detail}"
            out.append({"target": target, "verdict": verdict, "detail": detail})
        except (KeyError, TypeError, ZeroDivisionError, StopIteration, ValueError):
            out.append({"target": target, "verdict": "not run", "detail": ""})

    def step(s):   # -> (passed, detail); passed None: the profiler's figure is no kernel time ("unreliable")
        on, off = s["step"]["on"], s["step"]["off"]
        events = (f"its graph and logits replayed back to back (CUDA events): {on['events_ms']} ms, wall "
                  f"{on['wall_vs_events']}x that")
        if on.get("kernel_unreliable"):
            return None, (f"the profiler's kernel sum {on['kernel_ms']} ms exceeds the step's wall time "
                          f"{on['wall_ms']} ms ({on.get('dropped_events')} absurd events dropped); {events}")
        if on.get("profiler_short"):   # the step's device time from CUDA events instead, and said so
            return on["wall_vs_events"] <= t["wall_vs_kernel"], (
                f"{on['wall_ms']} ms wall / {on['events_ms']} ms of its graph and logits back to back (CUDA events) = "
                f"{on['wall_vs_events']}x (the profiler saw {on['kernel_ms']} ms, {on['device_ops']} of graphs off's "
                f"{off['device_ops']} kernels)")
        return on["wall_vs_kernel"] <= t["wall_vs_kernel"], (f"{on['wall_ms']} ms wall / {on['kernel_ms']} ms "
                f"{on['clock']} = {on['wall_vs_kernel']}x (graphs off: {off['wall_vs_kernel']}x; {events})")

    def static(s, x):
        r, tps = s["loop"]["plain_on_vs"]["hf_generate_static"], s["loop"]["tokens_per_s"]
        return r >= x, f"{r}x ({tps['plain_on']['median']} vs {tps['hf_generate_static']['median']} tokens/s)"

    def floor(s):
        f = s["floor"]
        return f["plain_on_fraction"] >= t["floor"], (
            f"{f['plain_on_fraction']:.1%}: {f['plain_on_tokens_per_s']} ({f['rate']}) of {f['tokens_per_s']} "
            f"tokens/s ({f['read_bytes'] / 1e9:.2f} GB read a token; input embedding "
            f"{f['input_embedding_left_out'] / 1e9:.2f} GB left out)")

    def drafting(s, fam):
        rows = {k: v["vs_plain_captured"]["on"] for k, v in s["drafting"]["kinds"].items() if k.startswith(fam)}
        worst = max(rows, key=rows.get)
        return rows[worst] <= t["draft_step"], f"{worst}: {rows[worst]}x a plain captured step"

    def stub(s):
        r = next(r for r in s["stub"]["runs"] if r["target_tau"] == t["stub"][0] and r["graphs"] == "on")
        return r["vs_plain_on"] >= t["stub"][1], f"{r['vs_plain_on']}x at measured tau {r['measured_tau']} " \
                                                 f"(k {r['k']}, p {r['p']})"

    labels = {key: label for key, (label, _) in SHAPES.items()}
    for key, label in labels.items():
        add(f"graphs=on: every step and drafter call captured, none failed, no replay disagreed ({label} shape)", key,
            all_captured, mark=False)
    for key, label in labels.items():
        add(f"graphs=on: 1-token step wall <= {t['wall_vs_kernel']}x its kernel time ({label} shape)", key, step)
    for key, label in labels.items():
        x = t["vs_hf_static"][key]
        add(f"graphs=on: plain loop >= {x}x hf_generate_static ({label} shape)", key, lambda s, x=x: static(s, x))
    add(f"graphs=on: 8B plain loop >= {t['floor']:.0%} of the weight-read floor", "llama31_8b", floor)
    add(f"graphs=on: 16-row verification <= {t['verify16']}x a 1-token step (8B)", "llama31_8b",
        lambda s: (s["step"]["verify"][16]["vs_1"] <= t["verify16"], f"{s['step']['verify'][16]['ms']} vs "
                   f"{s['step']['verify'][1]['ms']} ms = {s['step']['verify'][16]['vs_1']}x"))
    for fam, name in (("medusa", "Medusa"), ("eagle3", "EAGLE-3")):
        for key, label in labels.items():
            add(f"graphs=on: {name} drafting + verification <= {t['draft_step']}x a plain step ({label} shape)", key,
                lambda s, fam=fam: drafting(s, fam))
    add(f"graphs=on: stub drafter at tau {t['stub'][0]} >= {t['stub'][1]}x the captured plain loop (8B)",
        "llama31_8b", stub)
    return out


def summary_lines(g: dict | None) -> list[str]:
    """summary.md's CUDA-graph section: a figure per row, a shape per column; then the stub runs."""
    shapes = [s for s in (g or {}).get("shapes", {}).values() if s]   # the shapes begun so far
    if not shapes:
        return []
    lines = ["", f"CUDA graphs: {g['graphs_on_note']}; bf16 random weights, batch 1 unless a row names one, "
             f"medians ({g.get('seconds')} s):",
             "", "| figure | " + " | ".join(s["label"] + " (tiny stand-in)" * s["tiny_stand_in"]
                                          + " [graphs on: on (fell back to uncaptured)]" * fell_back(s, g)
                                          for s in shapes) + " |", "|---|" + "---|" * len(shapes)]

    def row(name, fig):
        cells = []
        for s in shapes:
            try:
                cells.append(fig(s))
            except (KeyError, TypeError, ValueError):
                cells.append("-")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")

    for mode in ("off", "on"):
        row(f"1-token step wall / kernel ms, graphs {mode}", lambda s, mode=mode: "{wall_ms} / {kernel_ms} "
            "({wall_vs_kernel}x, {clock}".format(**s["step"][mode])
            + ", UNRELIABLE: over the wall time" * bool(s["step"][mode].get("kernel_unreliable")) + ")")
    row("1-token step graphs on: kernel ms (profiler) / graph + logits back to back ms (CUDA events; wall / it; "
        "profiler short?; absurd events dropped)", lambda s: "{kernel_ms} / {events_ms} ({wall_vs_events}x; "
        "{profiler_short}; {dropped_events})".format(**s["step"]["on"]))
    row("verification 16 / 64 rows vs 1 row (graphs on)",
        lambda s: f"{s['step']['verify'][16]['vs_1']}x / {s['step']['verify'][64]['vs_1']}x")
    gqa_rows(row)
    tps = lambda s, ks: " / ".join("{median} [{min}-{max}]".format(**s["loop"]["tokens_per_s"][k]) for k in ks)  # noqa
    row("tokens/s plain off / on [min-max]", lambda s: tps(s, ("plain_off", "plain_on")))
    row("tokens/s generate eager / hf_generate_static", lambda s: tps(s, ("hf_generate", "hf_generate_static")))
    row("plain on vs off / eager / static", lambda s: " / ".join(
        f"{s['loop']['plain_on_vs'].get(k, '-')}x" for k in ("plain_off", "hf_generate", "hf_generate_static")))
    row(f"weight-read floor tokens/s ({g.get('read_bandwidth', '')}; the bytes a step reads); plain on's fraction",
        lambda s: f"{s['floor']['tokens_per_s']}; {s['floor']['plain_on_fraction']:.1%} ({s['floor']['rate']})")
    for kind in next((list(s["drafting"]["kinds"]) for s in shapes if "drafting" in s), []):
        row(f"{kind} step vs plain captured, on / off", lambda s, kind=kind: "{on}x / {off}x".format(
            **s["drafting"]["kinds"][kind]["vs_plain_captured"]))
    batch_rows(row)
    row("captures; capture s; graph memory MiB", lambda s: f"{len(s['static']['captures'])}; "
        f"{s['static']['capture_s']}; {s['static']['graph_memory_bytes'] / 2**20:.1f}")
    row("failed captures / disagreeing replays (steps + drafter calls, every model)", lambda s: " / ".join(
        str(sum(st[k] + st["drafter_calls"][k] for st in static_stats(s).values()))
        for k in ("failed_captures", "disagreeing_replays")))
    row("drafter calls captured; capture s; graph memory MiB", lambda s: "; ".join(
        f"{fam} {len(d['drafter_calls']['captures'])}, {d['drafter_calls']['capture_s']}, "
        f"{d['drafter_calls']['graph_memory_bytes'] / 2**20:.1f}" for fam, d in s["drafting"]["static"].items()))
    row("build s; peak GPU GB", lambda s: f"{s['build_s']}; {s.get('peak_gpu_memory_gb', '-')}")
    row("static 1-token step ms: uncaptured / CUDAGraph / reduce-overhead", lambda s: " / ".join(
        "-" if v is None else "{median} [{min}-{max}]".format(**v) for v in s["capture_ways"]["ms"].values()))
    row("reduce-overhead compile s; graph breaks; equal to uncaptured",
        lambda s: "{compile_s}; {graph_breaks}; ".format(**s["capture_ways"]["reduce_overhead"])
        + str(s["capture_ways"]["matches_uncaptured"]["reduce_overhead"]))
    ways = [(s["label"], s["capture_ways"]) for s in shapes if "capture_ways" in s]
    if ways:
        lines += ["", "Capturing: torch.cuda.CUDAGraph directly or torch.compile(mode=\"reduce-overhead\") "
                  f"(torch {ways[0][1]['torch']}; reduce-overhead regressions: {ways[0][1]['issues'][0]}):", ""]
        lines += [f"- {lab}: {w['which']}" + (f" [reduce-overhead skipped: {w['skipped']}]" if w["skipped"] else "")
                  for lab, w in ways]
    runs = [(s["label"], r) for s in shapes for r in s.get("stub", {}).get("runs", [])]
    if runs:
        lines += ["", "Stub drafter of set acceptance (a chain of k, each token right with probability p) vs the "
                  "captured plain loop:", "", "| shape | target tau | k | p | graphs | measured tau | tokens/s | vs "
                  "plain on |", "|---|---|---|---|---|---|---|---|"]
        lines += [f"| {lab} | {r['target_tau']} | {r['k']} | {r['p']} | {r['graphs']} | {r['measured_tau']} | "
                  f"{r['tokens_per_s']['median']} | {r['vs_plain_on']}x |" for lab, r in runs]
    return lines + (["", f"Skipped (time budget): {', '.join(g['skipped'])}"] if g.get("skipped") else [])
