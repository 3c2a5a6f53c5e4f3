"""Evaluation review: what each prompt's turns are encoded from (a record's system message and given replies, the
second turn's history, its fit within the positions), at unit level with a recording model; so are medusa-generate's
prompts and the backbone drift check's."""

from __future__ import annotations

import json
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

import inference.cli_run as cli_run
from inference.errors import UserError
from inference.evaluation import evaluate as evaluation
from inference.prompts import Prompt, encode_checked, encode_turn, load_prompts
from inference.runtime.decode import GenerationOutput
from inference.runtime.verify import SamplingConfig


class Recorder:
    """encode_chat's calls recorded (the chat, the system message); one token per word of the chat."""

    def __init__(self, max_positions=None):
        self.calls, self.max_positions, self.config, self.static = [], max_positions, None, None
        self.tokenizer = SimpleNamespace(decode=lambda ids, skip_special_tokens=True, **kw: " ".join(map(str, ids)))

    def encode_chat(self, prompt, system=None):
        msgs = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        self.calls.append((msgs, system))
        return [1] * sum(len(x["content"].split()) + 1 for x in msgs)


@dataclass
class NoOptions:
    pass


def _decode(m, prompts, methods, monkeypatch, turns="both"):
    """decode_interleaved with each method emitting one token of its own (its index + 1)."""
    def fake(m, ids, meth, **kw):
        return GenerationOutput(tokens=[methods.index(meth) + 1], prompt_tokens=len(ids), finish_reason="length")

    monkeypatch.setattr(evaluation.registry, "generate", fake)
    return evaluation.decode_interleaved(m, prompts, methods, {x: None for x in methods}, max_new_tokens=4,
                                         sampling=SamplingConfig(), turns=turns, seed=0, progress=False)


def test_a_system_field_or_message_reaches_the_chat_template(tmp_path):
    """Guards against: a prompts file's ``system`` field, or a ``messages`` record's system message, silently
    dropped: every prompt encoded (and decoded, calibrated on) without the system message the user gave."""
    f = tmp_path / "p.jsonl"
    f.write_text("\n".join(json.dumps(x) for x in [
        {"system": "Be brief.", "prompt": "hi"},
        {"messages": [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "hello"}]},
        {"prompt": "plain"},
    ]) + "\n")
    m = Recorder()
    encode_checked(m, load_prompts(str(f)), 4)
    assert [(msgs[-1]["content"], system) for msgs, system in m.calls] == [
        ("hi", "Be brief."), ("hello", "Answer in French."), ("plain", None)]


def test_a_reply_the_record_gives_is_the_second_turns_history(tmp_path, monkeypatch):
    """Guards against: a ``messages`` record's own assistant reply replaced, in the second turn's chat, by the
    plain answer decoded (the user's conversation was not the one evaluated)."""
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"messages": [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"},
                                          {"role": "user", "content": "q2"}]}) + "\n")
    prompts = load_prompts(str(f))
    assert prompts[0].turns == ["q1", "q2"]
    m = Recorder()
    _decode(m, prompts, ["autoregressive"], monkeypatch)
    assert m.calls[-1][0] == [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"},
                              {"role": "user", "content": "q2"}]


def test_the_second_turn_continues_from_one_methods_answer_on_every_prompt(monkeypatch):
    """Guards against: without the autoregressive baseline, each prompt's second turn continuing from the answer of
    the first method of that prompt's rotated order: methods' second turns measured on chats that change with the
    rotation (prompt 1 after method a's answer, prompt 2 after b's)."""
    prompts = [Prompt(str(i), [f"q{i}", "again?"]) for i in range(2)]
    m = Recorder()
    _decode(m, prompts, ["a", "b"], monkeypatch)
    answers = [msgs[1]["content"] for msgs, _ in m.calls if len(msgs) > 1]
    assert answers == ["1", "1"]   # method a's answer (its token 1) on both prompts


def test_a_second_turn_past_the_positions_is_refused_before_anything_is_decoded(monkeypatch):
    """Guards against: turns=both checking the first turns alone, so a second turn past the backbone's positions
    was refused only after every first turn had been decoded (the run's work lost)."""
    prompts = [Prompt("1", ["short question", " ".join(["word"] * 80)])]
    m = Recorder(max_positions=100)
    monkeypatch.setattr(evaluation.registry, "check_methods", lambda methods, m: list(methods))
    monkeypatch.setattr(evaluation.registry, "check_greedy_only", lambda methods, sampling: None)
    monkeypatch.setattr(evaluation.registry, "get", lambda x: SimpleNamespace(shape=None, prepare=None, options=None))
    monkeypatch.setattr(evaluation, "method_options", lambda *a: {"autoregressive": NoOptions()})
    monkeypatch.setattr(evaluation.registry, "generate", lambda *a, **k: pytest.fail("decoded before the refusal"))
    with pytest.raises(UserError, match="turn 2"):
        evaluation.evaluate(m, prompts, methods=["autoregressive"], choice="fixed", max_new_tokens=8, turns="both",
                            progress=False)
    encode_checked(m, prompts, 8)   # the first turn fits; the second does not, with an 8-token answer before it
    with pytest.raises(UserError, match="turn 2 of prompt '1' with a max_new_tokens answer"):
        encode_checked(m, prompts, 8, "both")


SYSTEM_RECORDS = [{"system": "Be brief.", "prompt": "hi"},
                  {"messages": [{"role": "system", "content": "Answer in French."},
                                {"role": "user", "content": "hello"}]},
                  {"prompt": "plain"}]


@pytest.mark.parametrize("batch", [None, 2], ids=["one-by-one", "batched"])
def test_generate_gives_each_records_system_message_to_the_chat_template(tmp_path, generate_calls, monkeypatch,
                                                                         capsys, batch):
    """Guards against: medusa-generate prompts_file= encoding every record's first turn with the command's own
    ``system=`` alone, a record's ``system`` field or system message dropped (the answers were not to the prompts
    the file gives, nor the ones medusa-eval measured on it); the same in batches (batch_size=). ``system=`` is
    the system message of the records without one, and of prompt= (one prompt or several)."""
    import inference.cli as cli
    import inference.cli_checks as checks
    from conftest import DecodeCalled

    f = tmp_path / "p.jsonl"
    f.write_text("\n".join(json.dumps(x) for x in SYSTEM_RECORDS) + "\n")
    generate_calls["spec"] = None
    monkeypatch.setattr(cli_run, "generate_options", lambda cfg, spec, several, size: ("autoregressive", None,
                                                                                       size is not None))

    def systems(**keys):
        before, loaded = Recorder(), Recorder()   # the check before the weights load, and the loaded model
        monkeypatch.setattr(checks, "tokenizer_model", lambda cfg, spec: before)
        monkeypatch.setattr(cli_run, "_load", lambda cfg: loaded)
        with pytest.raises(DecodeCalled):
            cli_run.run_generate(cli.GenerateConfig(heads="h", batch_size=batch, **keys))
        assert before.calls == loaded.calls
        return [(msgs[-1]["content"], system) for msgs, system in loaded.calls]

    assert systems(prompts_file=str(f)) == [("hi", "Be brief."), ("hello", "Answer in French."), ("plain", None)]
    assert "note:" not in capsys.readouterr().err
    args = generate_calls["args"]
    assert [p.turns for p in args[1]] == [["hi"], ["hello"], ["plain"]] and len(args[2]) == 3
    assert (args[4], args[5]) == ((2, True) if batch else (3, False))
    assert systems(prompts_file=str(f), system="Default.") == [("hi", "Be brief."), ("hello", "Answer in French."),
                                                               ("plain", "Default.")]
    assert "2 of the 3 records of" in capsys.readouterr().err   # which system message wins: said
    assert systems(prompt=["a", "b"], system="Default.") == [("a", "Default."), ("b", "Default.")]
    if batch is None:
        assert systems(prompt="one", system="Default.") == [("one", "Default.")]
        assert systems(prompt="one") == [("one", None)]


def test_backbone_drift_encodes_each_prompt_with_its_system_message(monkeypatch, capsys):
    """Guards against: the drift check of Medusa-2 heads (the adapted backbone against the original) encoding each
    prompt's first turn without the record's system message, where the evaluation it reports on encodes it with
    (``encode_turn``): the drift was measured on other prompts than the evaluation's."""
    prompts = [Prompt("1", ["hi"], system="Be brief."), Prompt("2", ["plain"])]
    m = Recorder()
    m.heads, m.adapter_applied, m.device = SimpleNamespace(spec=SimpleNamespace(backbone_adapter=True,
                                                                                  base_model="b")), True, "cpu"
    seen = {}

    def drift(adapted, original, ids, max_new_tokens):
        seen["ids"] = ids
        return {"greedy_token_agreement": 1.0, "identical_answers": 1.0}

    monkeypatch.setattr(cli_run, "load_backbone", lambda *a, **k: (object(), None, None))
    monkeypatch.setattr(cli_run, "MedusaModel", lambda **kw: None)
    monkeypatch.setattr(cli_run, "greedy_drift", drift)
    cfg = SimpleNamespace(backbone=None, dtype="float32", trust_remote_code=False, max_new_tokens=4)
    report: dict = {}
    cli_run.backbone_drift(cfg, m, prompts, report)
    assert [(msgs[-1]["content"], system) for msgs, system in m.calls] == [("hi", "Be brief."), ("plain", None)]
    expected = Recorder()
    assert seen["ids"] == [encode_turn(expected, p) for p in prompts] and report["backbone_drift"]["identical_answers"]


def test_generate_answers_a_chats_last_question(tmp_path, generate_calls, monkeypatch, capsys):
    """Guards against: medusa-generate prompts_file= given a chat (``messages``: a question, its reply, a second
    question) answering the first question, which the record already answers, and dropping the rest without a
    word. The chat is encoded whole up to its last question; an MT-Bench ``turns`` record, whose second question
    follows an answer not decoded here, has its first answered, said in one line."""
    import inference.cli as cli
    import inference.cli_checks as checks
    from conftest import DecodeCalled

    chat = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4."},
            {"role": "user", "content": "And 3+3?"}]
    f = tmp_path / "p.jsonl"
    f.write_text("\n".join(json.dumps(x) for x in [{"messages": chat}, {"turns": ["one", "two"]}]) + "\n")
    generate_calls["spec"] = None
    monkeypatch.setattr(cli_run, "generate_options", lambda cfg, spec, several, size: ("autoregressive", None, False))
    before, loaded = Recorder(), Recorder()
    monkeypatch.setattr(checks, "tokenizer_model", lambda cfg, spec: before)
    monkeypatch.setattr(cli_run, "_load", lambda cfg: loaded)
    with pytest.raises(DecodeCalled):
        cli_run.run_generate(cli.GenerateConfig(heads="h", prompts_file=str(f)))
    assert before.calls == loaded.calls
    assert [msgs for msgs, _ in loaded.calls] == [chat, [{"role": "user", "content": "one"}]]
    err = capsys.readouterr().err
    assert err.count("note:") == 1 and "1 of the 2 records" in err and "turns=both" in err


def test_a_templates_refusal_is_one_line_in_the_python_api():
    """Guards against: ``MedusaModel.encode_chat`` with a system message under a template that refuses one
    (Gemma's "System role not supported") raising jinja2's TemplateError: a UserError naming the refusal."""
    from types import SimpleNamespace

    from inference.runtime.model import chat_ids

    def refuse(*a, **k):
        from jinja2 import TemplateError
        raise TemplateError("System role not supported")

    tok = SimpleNamespace(chat_template="{{ raise_exception('x') }}", apply_chat_template=refuse)
    with pytest.raises(UserError, match="^the chat template refuses the prompt: System role not supported$"):
        chat_ids(tok, "hi", system="Be brief.")
