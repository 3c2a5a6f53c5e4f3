"""A GGUF backbone stops where llama.cpp, the format's own runtime, stops: at every end-of-reply token, not at the
one eos id the file's metadata names (``inference/assets.py`` ``gguf_end_ids``, written into the conversion)."""

from __future__ import annotations

import json

import gguf
import pytest

from inference import assets
from inference.backbone import eos_token_ids

GEMMA_LIKE = ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>", "hello", "world"]
PHI3_LIKE = ["<unk>", "<s>", "</s>", "<|endoftext|>", "<|user|>", "<|assistant|>", "<|end|>", "hi"]
HARMONY_LIKE = ["<|start|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|endoftext|>", "x"]


@pytest.mark.parametrize("tokens, metadata, expected", [
    (GEMMA_LIKE, [1], [1, 4]),                        # Gemma: <eos> named, <end_of_turn> ends a chat turn
    (PHI3_LIKE, [3], [3, 6]),                         # Phi-3: <|endoftext|> named, <|end|> ends a turn
    (HARMONY_LIKE, [5], [3, 4, 5]),                   # gpt-oss: <|end|> closes a message, not the reply
    (["a", "b", "<|im_end|>"], [2, 2, 99], [2]),      # an out-of-vocabulary id in the metadata is ignored
])
def test_end_of_reply_ids_follow_llama_cpp(tokens, metadata, expected):
    """Guards against: a Gemma or Phi-3 GGUF decoding past its end of turn (transformers keeps the metadata's one
    eos id), or gpt-oss stopping after its analysis message (<|end|> is not an end of reply when <|return|> is)."""
    assert assets.gguf_end_ids(tokens, metadata) == expected


def _write_gguf(path, tokens, **ids):
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_token_list(tokens)
    for key, value in ids.items():
        getattr(writer, f"add_{key}_token_id")(value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_gguf_conversion_records_every_end_of_reply_token(tmp_path, monkeypatch, tiny_backbone):
    """Guards against: a converted GGUF whose generation config names the eos id alone, so the runtime, the
    evaluation and self-distillation never stop a Gemma-like reply at <end_of_turn>; and a conversion made before
    this rule being reused (it is made again)."""
    model, tokenizer = tiny_backbone.model, tiny_backbone.tokenizer
    gguf_path = tmp_path / "gemma-like.gguf"
    _write_gguf(gguf_path, GEMMA_LIKE, eos=1, bos=2)
    assert assets.read_gguf_end_ids(gguf_path) == [1, 4]

    import transformers

    monkeypatch.setenv("MEDUSA_TRAIN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: tokenizer)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: model)
    folder = assets.converted_gguf_dir(gguf_path)
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == [1, 4]
    assert json.loads((folder / assets.CONVERSION_RECORD).read_text())["version"] == assets.CONVERSION_VERSION

    monkeypatch.undo()   # transformers' own loader reads the conversion
    monkeypatch.setenv("MEDUSA_TRAIN_CACHE", str(tmp_path / "cache"))
    converted = transformers.AutoModelForCausalLM.from_pretrained(folder)
    assert {1, 4} <= set(eos_token_ids(converted))

    (folder / assets.CONVERSION_RECORD).unlink()   # a conversion from before the rule
    assert assets.cached_conversion(gguf_path) is None


def test_a_conversion_writes_nothing_to_stdout(tmp_path, monkeypatch, capsys, tiny_backbone):
    """Guards against the first `medusa-generate ... > out.txt` on a GGUF backbone writing the conversion's line
    (and what loading prints, DeepSpeed's accelerator line) into the answer: all of it goes to stderr."""
    import transformers

    gguf_path = tmp_path / "quiet.gguf"
    _write_gguf(gguf_path, GEMMA_LIKE, eos=1, bos=2)

    def loud(*a, **k):
        print("[WARNING] Setting accelerator to CPU.")
        return tiny_backbone.model

    monkeypatch.setenv("MEDUSA_TRAIN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: tiny_backbone.tokenizer)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", loud)
    assets.converted_gguf_dir(gguf_path)
    out, err = capsys.readouterr()
    assert out == "" and "converting quiet.gguf" in err and "accelerator" in err
