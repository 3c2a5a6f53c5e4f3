"""Batched evaluation and generation (inference/evaluation/batch_eval.py, ``medusa-eval batch_size=``,
``medusa-generate prompt=[...]``) on tiny random models: the report's ``batched`` section, greedy
identity per row, the throughput plot, the tree per batch size, HF's batched generate, the CLIs."""

from __future__ import annotations

import json
import types

import pytest
import torch

from inference.errors import UserError
from inference.evaluation import batch_eval
from inference.evaluation.batch_eval import evaluate_batched, parse_batch_sizes, stops_paying
from inference.evaluation.batch_reports import THROUGHPUT_PLOT
from inference.prompts import Prompt
from inference.evaluation.reports import check_report_dir, write_report
from inference.heads.drafting import IndependentDrafting
from inference.methods import generate, generate_batch
from inference.methods.hf_generate import hf_generate_batch
from inference.runtime.speculation import SpeculationSchedule
from inference.runtime.model import MedusaModel
from inference.runtime.tree import resolve_tree
from conftest import call_main
from runtime_support import one_thread, random_heads  # noqa: F401  (one_thread: autouse fixture)

TINY = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 320, "max_position_embeddings": 512}
PROMPTS = [Prompt(str(i), [f"question number {i}?" + " and more" * i]) for i in range(5)]
NEW = 10


class ManyOracles(IndependentDrafting, torch.nn.Module):
    """Stub heads that know the backbone's greedy continuation of several prompts (perfect guesses, so
    batched rows accept several tokens per step): a hidden state is matched to its (sequence, position)
    by nearest neighbour, and head k ranks the token at position + k + 2 first."""

    def __init__(self, m: MedusaModel, sequences: list[list[int]], num_heads: int = 2):
        super().__init__()
        self.spec = types.SimpleNamespace(num_heads=num_heads, output_size=m.vocab_size)
        self.vocab = m.vocab_size
        self.where = [(seq, t) for seq in sequences for t in range(len(seq))]
        with torch.no_grad():
            self.reference = torch.cat([m.model.model(input_ids=torch.tensor([s])).last_hidden_state[0]
                                        for s in sequences])

    def head_logits(self, hidden, k):
        flat = hidden.reshape(-1, hidden.shape[-1])
        out = torch.zeros(flat.shape[0], self.vocab)
        for i, n in enumerate(torch.cdist(flat, self.reference).argmin(-1).tolist()):
            seq, t = self.where[n]
            if t + k + 2 < len(seq):
                out[i, seq[t + k + 2]] = 10.0
        return out.reshape(*hidden.shape[:-1], self.vocab)

    def to_vocab_ids(self, ids):
        return ids


@pytest.fixture(scope="module")
def backbone():
    from medusa_train.backbone import random_backbone

    return random_backbone(TINY, seed=0)


@pytest.fixture(scope="module")
def oracle(backbone):
    """The tiny backbone with heads that guess its greedy continuation of PROMPTS right."""
    plain = MedusaModel(model=backbone.model.eval(), tokenizer=backbone.tokenizer, heads=None)
    seqs = []
    for p in PROMPTS:
        ids = plain.encode_chat(p.turns[0])
        seqs.append(ids + generate(plain, ids, "autoregressive", max_new_tokens=NEW + 4).tokens)
    return MedusaModel(model=backbone.model, tokenizer=backbone.tokenizer, heads=ManyOracles(plain, seqs))


def _quiet(s):
    pass


def test_batch_size_values():
    """Guards against: batch_size=1 no longer meaning today's one-prompt-at-a-time evaluation, a list
    decoded unsorted or with repeats, and a bad size (0, negative, text, float, bool, a bad list entry)
    slipping through instead of one clear line."""
    assert parse_batch_sizes(1) is None
    assert parse_batch_sizes(4) == [4] and parse_batch_sizes([8, 1, 2, 2]) == [1, 2, 8] and parse_batch_sizes([1]) == [1]
    for bad, words in ((0, "got 0"), (-2, "got -2"), ("x", "got 'x'"), (2.5, "got 2.5"), (True, "got True"),
                       ([], "got []"), ([1, 0], "0 in [1, 0]"), ([1, "x"], "'x' in [1, 'x']"), ([2, 1.5], "1.5 in")):
        with pytest.raises(UserError, match="batch_size must be an integer >= 1") as e:
            parse_batch_sizes(bad)
        assert words in str(e.value) and "\n" not in str(e.value)
    assert stops_paying({1: {"medusa": 3.0, "autoregressive": 2.0}, 4: {"medusa": 5.0, "autoregressive": 5.0}},
                        "medusa") == 4
    assert stops_paying({1: {"medusa": 3.0, "autoregressive": 2.0}}, "medusa") is None


def test_batched_report_identity_and_plot(oracle, tmp_path):
    """Guards against: the batched section missing keys or holding inconsistent numbers (tokens/s vs
    tokens and seconds, speedups vs the baselines' rates, tau per row), a batched row whose tokens differ
    from the plain batched loop's or from batch-1 greedy decoding, HF's batched generate (left padding)
    measured on garbage rows, the stop-paying size outside the measured sizes, the throughput plot
    or report.md not being written, and a speedup reported without the spread of its batch-by-batch ratios."""
    r = evaluate_batched(oracle, PROMPTS, methods=["medusa"], batch_sizes=[1, 2, 4], tree="chain3",
                         max_new_tokens=NEW, progress=False, log=_quiet,
                         settings={"prompts": "tiny", "max_new_tokens": NEW, "mode": "greedy"})
    b = r["batched"]
    assert r["methods"] == b["methods"] == ["medusa", "autoregressive", "hf_generate"]
    assert b["batch_sizes"] == [1, 2, 4] and b["num_prompts"] == len(PROMPTS) == r["num_samples"]
    assert b["speculation"] == {"medusa": {"tree": "given", "schedule": {"1": "chain3", "2": "chain3", "4": "chain3"},
                                           "sizing": None}}
    assert r["method_options"]["medusa"]["tree"] == b["speculation"]["medusa"]["schedule"]
    assert set(b["per_batch_size"]) == {"1", "2", "4"}
    for size, entry in b["per_batch_size"].items():
        assert entry["batches"] == -(-len(PROMPTS) // int(size)) and entry["rows"] == len(PROMPTS)
        assert entry["speculation"] == {"medusa": "chain3"}
        rates = entry["tokens_per_s"]
        for meth, row in entry["per_method"].items():
            assert rates[meth] == row["tokens_per_s"] > 0
            assert row["tokens_per_s"] == pytest.approx(row["new_tokens"] / row["seconds"], rel=0.02)
            assert row["new_tokens"] == NEW * len(PROMPTS)  # no EOS from this model within NEW tokens
            assert len(row["tau_per_row"]) == len(PROMPTS)
            assert row["greedy_identical"] is True, (size, meth)
            assert all(row["identical_to_batch1"]), (size, meth)
            if meth != "autoregressive":
                assert row["identical_to_plain_batched"] == [True] * len(PROMPTS), (size, meth)
                assert row["speedup_vs_autoregressive"] == pytest.approx(rates[meth] / rates["autoregressive"],
                                                                         rel=1e-3)
                lo, mid, hi = row["speedup_vs_autoregressive_runs"]   # batch by batch, beside the pooled ratio
                assert 0 < lo <= mid <= hi and (lo == hi) == (entry["batches"] == 1)
        med = entry["per_method"]["medusa"]
        assert med["tau"] > 1.5 and min(med["tau_per_row"]) > 1.0  # the oracle's guesses are accepted
        assert med["nodes_per_step"] == 3.0 and "speedup_vs_hf_generate" in med
        assert entry["per_method"]["autoregressive"]["tau"] == 1.0
    assert b["greedy_identical"] == {"medusa": True, "autoregressive": True, "hf_generate": True}
    assert b["speculation_stops_paying"]["medusa"] in (None, 1, 2, 4)
    paths = write_report(tmp_path, r)
    assert {p.name for p in paths} == {"report.json", "report.md", THROUGHPUT_PLOT}
    assert (tmp_path / THROUGHPUT_PLOT).stat().st_size > 1000
    assert json.loads((tmp_path / "report.json").read_text())["batched"]["per_batch_size"]["2"]["rows"] == 5
    md = (tmp_path / "report.md").read_text()
    assert "| 4 | medusa | chain3 |" in md and "speculation" in md
    two = b["per_batch_size"]["2"]["per_method"]["medusa"]
    lo, mid, hi = two["speedup_vs_autoregressive_runs"]
    assert f"{two['speedup_vs_autoregressive']:.2f}x ({mid:.2f}x [{lo:.2f}-{hi:.2f}])" in md


def test_rounds_repeat_each_batch_without_mixing_rows(oracle):
    """Guards against: repeated rounds (batch_rounds, for large B where there are one or two batches to
    average over) compared row by row against the wrong prompts (a round's rows taken as the next
    batch's), counted as more batches, or dropping the spread of the single runs."""
    r = evaluate_batched(oracle, PROMPTS, methods=["medusa"], batch_sizes=[2], tree="chain3", max_new_tokens=NEW,
                         progress=False, log=_quiet, rounds=3)
    entry = r["batched"]["per_batch_size"]["2"]
    assert entry["batches"] == 3 and entry["rounds"] == 3
    for meth, row in entry["per_method"].items():
        assert row["new_tokens"] == 3 * NEW * len(PROMPTS)
        assert len(row["tau_per_row"]) == len(PROMPTS) and row["greedy_identical"] is True, meth
        lo, mid, hi = row["tokens_per_s_runs"]
        assert 0 < lo <= mid <= hi


def test_tree_auto_takes_the_schedule_choose_schedule_picks(oracle, monkeypatch):
    """Guards against: choice=auto in a batched run not asking the Medusa tree shape for a tree per batch size
    (with the heads' measured per-rank accuracy, every batch size), the per-batch-size steps timed on the evaluated
    prompts instead of the held-out calibration ones, the calibration prompts not being held out, the chosen
    schedule not being the one decoded with (plain steps where it says none pays), or the sizing record missing
    from the report."""
    calls = {}

    class Sizing:
        def __init__(self, schedule):
            self.schedule = schedule

        def to_dict(self):
            return {"1": {"winner": "chain2"}, "4": {"winner": "plain"}}

    def choose_schedule(m, per_rank, latency_prompts, batch_sizes, *, drafter, log=print, progress=False):
        calls.update(per_rank=per_rank, latency=latency_prompts, sizes=list(batch_sizes))
        return Sizing(SpeculationSchedule({1: resolve_tree("chain2", 2), 4: None}))

    from inference.methods import medusa_choice

    monkeypatch.setattr(medusa_choice, "choose_schedule", choose_schedule)
    chosen = {}
    r = evaluate_batched(oracle, PROMPTS, methods=["medusa"], batch_sizes=[1, 4], choice="auto", max_new_tokens=NEW,
                         calibration_prompts=1, calibration_tokens=6, progress=False, log=_quiet, chosen=chosen)
    b = r["batched"]   # (batch 4 needs 4 prompts evaluated: a larger size than the prompts is refused)
    assert calls["sizes"] == [1, 4] and 4 == b["num_prompts"]  # 1 of 5 held out
    assert calls["latency"] == [oracle.encode_chat(PROMPTS[-1].turns[0])]   # timed on the held-out prompt only
    assert r["calibration_prompt_ids"] == ["4"] and r["evaluated_prompt_ids"] == ["0", "1", "2", "3"]
    assert len(calls["per_rank"]) == 2 and calls["per_rank"] == r["head_accuracy"]["per_rank"]
    assert b["speculation"]["medusa"] == {"tree": "auto", "schedule": {"1": "chain2", "4": "plain"},
                                          "sizing": {"1": {"winner": "chain2"}, "4": {"winner": "plain"}}}
    # what the choice file stores: each batch size's tree as the method's own key (None: plain decoding)
    assert chosen["medusa"].measured and chosen["medusa"].schedule.choices[4] is None
    shape = medusa_choice.MedusaTreeShape(None)
    assert shape.encode(chosen["medusa"].schedule.choices[1], None) == {"tree": {"name": "chain2", "choices": [[0]]}}
    one, four = b["per_batch_size"]["1"], b["per_batch_size"]["4"]
    assert one["speculation"] == {"medusa": "chain2"} and four["speculation"] == {"medusa": "plain"}
    assert one["per_method"]["medusa"]["nodes_per_step"] == 2.0 and one["per_method"]["medusa"]["tau"] > 1.0
    assert four["per_method"]["medusa"]["nodes_per_step"] == 1.0 and four["per_method"]["medusa"]["tau"] == 1.0
    assert all(b["greedy_identical"].values())


def test_hf_batched_generate_pads_left_and_cuts_at_eos(backbone):
    """Guards against: HF's batched generate padded on the right or without a mask (rows of different
    lengths then continue the padding), or counted past a row's EOS, which would make its tokens/s
    incomparable with the runtime's rows that stop at EOS (EOS kept)."""
    plain = MedusaModel(model=backbone.model, tokenizer=backbone.tokenizer, heads=None)
    ids = [plain.encode_chat(p.turns[0]) for p in PROMPTS[:3]]
    first = generate(plain, ids[0], "autoregressive", max_new_tokens=NEW).tokens
    eos = first[3]  # row 0 ends at its 4th token
    m = MedusaModel(model=backbone.model, tokenizer=backbone.tokenizer, heads=None, eos_token_ids=[eos])
    hf = hf_generate_batch(m, ids, NEW)
    ours = generate_batch(m, ids, "autoregressive", max_new_tokens=NEW)
    assert [r.tokens for r in hf.rows] == [r.tokens for r in ours.rows]
    assert hf.rows[0].tokens == first[:first.index(eos) + 1] and len(hf.rows[0].tokens) <= 4
    assert hf.new_tokens == ours.new_tokens and hf.decode_s > 0 and hf.tokens_per_s > 0


def test_sample_mode_and_refusals(oracle):
    """Guards against: sampled batched runs claiming greedy identity or running HF's greedy-only generate,
    and a method that cannot decode batches (or hf_generate in sample mode) failing late or in more than
    one line."""
    from inference.runtime.verify import SamplingConfig

    r = evaluate_batched(oracle, PROMPTS[:2], methods=["medusa"], batch_sizes=[2], tree="chain2", max_new_tokens=4,
                         sampling=SamplingConfig(mode="sample", temperature=0.8), progress=False, log=_quiet)
    b = r["batched"]
    assert b["methods"] == ["medusa", "autoregressive"] and b["greedy_reference"] is None
    assert "greedy_identical" not in b and "hf_generate" not in b["per_batch_size"]["2"]["tokens_per_s"]
    assert "identical_to_plain_batched" not in json.dumps(b)
    with pytest.raises(UserError, match="method lookahead decodes one prompt at a time.*decode batches: .*medusa"):
        evaluate_batched(oracle, PROMPTS, methods=["lookahead"], batch_sizes=[2], progress=False, log=_quiet)
    with pytest.raises(UserError, match="greedy mode only"):
        evaluate_batched(oracle, PROMPTS, methods=["medusa", "hf_generate"], batch_sizes=[2], tree="chain2",
                         sampling=SamplingConfig(mode="sample"), progress=False, log=_quiet)


# -- the command lines -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def heads_dir(backbone, tmp_path_factory):
    """A heads export (2 random heads) whose recorded base model is the tiny backbone saved beside it."""
    from inference.heads.native import save_heads

    root = tmp_path_factory.mktemp("batched_cli")
    backbone.model.save_pretrained(root / "backbone")
    backbone.tokenizer.save_pretrained(root / "backbone")
    heads = random_heads(backbone.model, num_heads=2)
    heads.spec.base_model = str(root / "backbone")
    return save_heads(heads, root / "heads")


def test_cli_batched_eval_writes_the_batched_report(heads_dir, tmp_path, capsys):
    """Guards against: medusa-eval batch_size=[...] not reaching the batched evaluation (or batch_size=1
    no longer running today's), losing the method settings or the tree, or not writing report.json's
    batched section and the throughput plot."""
    from inference.cli import eval_main

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"say {w} {w}"}) + "\n" for w in ("one", "two", "three")))
    out = tmp_path / "eval"
    common = [f"heads={heads_dir}", f"prompts={prompts}", "max_new_tokens=5", "threads=1", "kernels=stock",
              "progress_bar=false", "tree=chain2"]
    code, stdout, err = call_main(eval_main, common + ["batch_size=[1,2]", f"out={out}"], capsys)
    assert code == 0, err[-3000:]
    report = json.loads((out / "report.json").read_text())
    b = report["batched"]
    assert report["settings"]["batch_size"] == [1, 2] and b["batch_sizes"] == [1, 2] and b["num_prompts"] == 3
    assert b["methods"] == ["medusa", "autoregressive", "hf_generate"]
    assert b["speculation"]["medusa"]["schedule"] == {"1": "chain2", "2": "chain2"}
    assert b["greedy_identical"]["medusa"] is True and "per_method" not in report
    assert (out / THROUGHPUT_PLOT).is_file() and (out / "report.md").is_file()
    assert "batch   2 | medusa " in stdout and "medusa: every row identical to greedy: True" in stdout
    check_report_dir(out)   # a batched evaluation's folder is one a rerun may write into
    single = tmp_path / "single"
    code, _, err = call_main(eval_main, common + [f"out={single}", "methods=[medusa,autoregressive]"], capsys)
    assert code == 0, err[-3000:]
    plain = json.loads((single / "report.json").read_text())
    assert "batched" not in plain and "medusa" in plain["per_method"] and not (single / THROUGHPUT_PLOT).exists()


def test_cli_generate_several_prompts_in_batches(heads_dir, tmp_path, capsys):
    """Guards against: medusa-generate with several prompts (prompt=[...] or prompts_file=) not decoding
    them all, mixing up which answer belongs to which prompt, ignoring batch_size, batched rows that
    differ from each prompt's own greedy answer, each answer's numbers written into the answers on stdout, or a
    chat headed by its first question while its last one is answered."""
    from inference.cli import generate_main
    from inference.loading import load_medusa

    texts = ["Say hello.", "Name a colour.", "Count to three."]
    common = [f"heads={heads_dir}", "max_new_tokens=6", "threads=1", "kernels=stock", "tree=chain2"]
    code, out, err = call_main(generate_main, common + ["prompt=[" + ", ".join(texts) + "]"], capsys)
    assert code == 0, err[-3000:]
    m = load_medusa(heads_dir, kernels="stock")
    for i, t in enumerate(texts, start=1):
        answer = m.tokenizer.decode(generate(m, m.encode_chat(t), "autoregressive", max_new_tokens=6).tokens,
                                    skip_special_tokens=True)
        assert f"=== [{i}/3] {t}\n{answer}\n\n" in out, (i, out)   # the answers alone on stdout: > out.txt
    assert err.count("[batch of 3:") == 1 and err.count(" tokens, tau ") == 3 and "[" not in out.replace("=== [", "")
    # a chat is answered (and headed) at its last question
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant",
                                                                                 "content": "Hello!"},
                                             {"role": "user", "content": "Bye"}]}) + "\n")
    code, out3, err = call_main(generate_main, common + [f"prompts_file={chat}", "batch_size=1"], capsys)
    assert code == 0 and out3.startswith("=== [1/1] Bye\n"), out3
    f = tmp_path / "p.jsonl"
    f.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    code, out2, err = call_main(generate_main, common + [f"prompts_file={f}", "batch_size=2"], capsys)
    assert code == 0, err[-3000:]
    assert out2 == out and err.count("[batch of 2:") == 1 and err.count("[batch of 1:") == 1
    code, _, err = call_main(generate_main, common + ["prompt=[hi, '  ']"], capsys)
    assert code == 2 and err.strip() == "medusa-generate: error: prompt 2 of 2 is empty"


def test_captured_batches_are_warmed_untimed_and_reported(oracle, monkeypatch):
    """Guards against the batched evaluation timing its first batches with their captures inside them (the
    method would look slower than it is), and against report.json not saying what was captured."""
    from inference.evaluation import batch_eval as be
    from inference.runtime.static_steps import StaticSteps
    from test_static_steps import replaying

    oracle.static = StaticSteps(oracle, capture=replaying, log=_quiet)
    seen = {}
    timed = be.run_batches
    monkeypatch.setattr(be, "run_batches", lambda *a, **kw: (seen.update(oracle.static.captures), timed(*a, **kw))[1])
    try:
        r = evaluate_batched(oracle, PROMPTS, methods=["medusa"], batch_sizes=[2], tree="chain3", max_new_tokens=NEW,
                             progress=False, log=_quiet)
    finally:
        captures, oracle.static = dict(oracle.static.captures), None
    assert {"2x4", "2x1", "4", "1"} <= set(seen)            # chain3 and plain steps, for batches of 2 and of 1
    assert r["graphs"]["captures"] == captures == seen      # nothing captured inside the timed batches
    assert all(row["greedy_identical"] for row in r["batched"]["per_batch_size"]["2"]["per_method"].values())
