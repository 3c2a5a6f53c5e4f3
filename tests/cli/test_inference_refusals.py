"""medusa-eval / medusa-generate / medusa-export refuse what their keys alone decide before anything loads
(issue 43, items 7, 9, 10 and 11).

Each row runs a command in-process with the loaders replaced by a failure (``no_loading``): a refusal that
only comes after the backbone loaded (behind its progress bars, minutes into a large model) fails the
test with "the backbone was loaded". Every refusal must be one ``<prog>: error: ...`` line, exit 2, and
leave the test's folder as it was. ``{tmp}`` in an argument is the test's folder (``setup``): a Medusa
export and an EAGLE-3 export whose recorded backbone does not exist, three prompts, a plain file, a tree
file holding ``[]`` and a heads dir whose config.json is a JSON list; exports whose weights (or LoRA adapter)
are cut short or empty, backbone configs without weights (with and without a tokenizer, another vocabulary);
``_review7_files``' prompts, backbone folders, choice files and out= folders.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

EVAL, GEN, EXPORT = "medusa-eval", "medusa-generate", "medusa-export"
MEDUSA, EAGLE = "heads={tmp}/heads3", "heads={tmp}/e3"
PROMPTS = "prompts={tmp}/prompts.jsonl"
DRAFT = ["methods=[draft]", PROMPTS, "backbone={tmp}/bbtok", "max_new_tokens=8"]   # a target with no weights

REFUSED = [
    # -- item 7: EAGLE-3 trees beyond any serious setting (10^5 drafter calls a step), before loading -------------
    (EVAL, [EAGLE, PROMPTS, "methods=[eagle3]", "choice=fixed", "eagle_depth=100000", "eagle_nodes=8"],
     "eagle_depth must be an integer in 1..32, got 100000"),
    (EVAL, [EAGLE, PROMPTS, "methods=[eagle3]", "choice=fixed", "eagle_topk=100000", "eagle_nodes=8",
            "eagle_depth=3"], "eagle_topk must be an integer in 1..64, got 100000"),
    (EVAL, [EAGLE, PROMPTS, "methods=[eagle3]", "choice=fixed", "eagle_nodes=100000", "eagle_depth=8",
            "eagle_topk=64"], "eagle_nodes must be an integer in 0..256, got 100000"),
    (EVAL, [EAGLE, PROMPTS, "methods=[eagle3]", "choice=fixed", "eagle_topk=60", "eagle_nodes=8",
            "eagle_depth=2"], "eagle_topk=60 is more than the drafter's 50 outputs"),
    (GEN, [EAGLE, "prompt=hi", "eagle_depth=100000", "eagle_nodes=8"], "eagle_depth must be an integer in 1..32"),
    (GEN, [EAGLE, "prompt=hi", "eagle_topk=1000", "eagle_nodes=8", "eagle_depth=3"],
     "eagle_topk must be an integer in 1..64"),
    (GEN, [EAGLE, "prompt=hi", "eagle_topk=60", "eagle_nodes=8", "eagle_depth=2"],
     "eagle_topk=60 is more than the drafter's 50 outputs"),
    # -- item 9: refused only after the backbone loaded, after the evaluation, or with a traceback ----------------
    (EVAL, [MEDUSA, PROMPTS, "choice=fixed", "out={tmp}/afile"], "out={tmp}/afile is a file, not a folder"),
    (EVAL, [MEDUSA, PROMPTS, "choice=fixed", "out={tmp}/afile/eval"], "out={tmp}/afile/eval cannot be created"),
    (EVAL, ["heads={tmp}/listcfg", PROMPTS], "config.json is not a JSON object"),
    (GEN, ["heads={tmp}/listcfg", "prompt=hi"], "config.json is not a JSON object"),
    (EXPORT, ["heads={tmp}/listcfg", "format=vllm", "out={tmp}/o"], "config.json is not a JSON object"),
    (EVAL, [MEDUSA, PROMPTS, "threads=-1"], "threads must be an integer in 0..1024 (0: one per idle core), got -1"),
    (GEN, [MEDUSA, "prompt=hi", "threads=-1"], "threads must be an integer in 0..1024"),
    # thousands of threads: "can't start new thread" / MemoryError tracebacks once the backbone loaded
    (GEN, [MEDUSA, "prompt=hi", "threads=100000"], "threads must be an integer in 0..1024"),
    (EVAL, [MEDUSA, PROMPTS, "max_new_tokens=0"], "max_new_tokens must be an integer >= 1, got 0"),
    (GEN, [MEDUSA, "prompt=hi", "max_new_tokens=0"], "max_new_tokens must be an integer >= 1, got 0"),
    (GEN, [MEDUSA, "prompt=hi", "max_new_tokens=-3"], "max_new_tokens must be an integer >= 1, got -3"),
    (EVAL, [MEDUSA, PROMPTS, "calibration_tokens=0"], "calibration_tokens must be an integer >= 1, got 0"),
    (EVAL, [MEDUSA, PROMPTS, "tree_budgets=[]"], "tree_budgets must be a non-empty list of node counts >= 1"),
    (EVAL, [MEDUSA, PROMPTS, "tree_budgets=[4,-2]"], "tree_budgets must be a non-empty list of node counts >= 1"),
    (EVAL, [MEDUSA, PROMPTS, "tree=calibrated:1"], "tree=calibrated:N needs N >= 2 nodes"),
    (EVAL, [MEDUSA, PROMPTS, "turns=bogus"], "turns must be first|both, got 'bogus'"),
    (EVAL, ["methods=[draft]", PROMPTS, "draft=self:0"], "a self-draft takes N >= 1 layers of the backbone, got 'self:0'"),
    (GEN, [MEDUSA, "prompt=hi", "mode=sample", "temperature=0"], "sample mode needs temperature > 0"),
    (GEN, [MEDUSA, "prompt=hi", "mode=sample", "top_p=0"], "top_p must be in (0, 1], got 0.0"),
    (GEN, [MEDUSA, "prompt=hi", "mode=bogus"], "decoding mode must be one of"),
    # -- issue 45: graphs= and graph_buckets= ------------------------------------------------------------------------
    (EVAL, [MEDUSA, PROMPTS, "graphs=maybe"], "graphs must be one of auto, on, off, uncaptured, got 'maybe'"),
    (GEN, [MEDUSA, "prompt=hi", "graph_buckets=[1,8,4]"], "graph_buckets must be a strictly increasing list"),
    (EVAL, [MEDUSA, PROMPTS, "graph_buckets=[0,4]"], "graph_buckets must be a strictly increasing list"),
    (GEN, [MEDUSA, "prompt=hi", "graphs=on", "device=cpu"], "graphs=on captures CUDA graphs: it needs device=cuda"),
    # -- item 10: reports of what was not measured ----------------------------------------------------------------
    (EVAL, [MEDUSA, PROMPTS, "tree=chain2", "batch_size=100000000"],
     "batch_size 100000000 exceeds the 3 prompts evaluated"),
    (EVAL, [MEDUSA, PROMPTS, "tree=chain2", "batch_size=[1,2,4,8]"], "batch_size 4, 8 exceed the 3 prompts evaluated"),
    (EVAL, [MEDUSA, PROMPTS, "num_prompts=1", "calibration_prompts=2", "batch_size=[1,2]"],   # 2 held out
     "batch_size 2 exceeds the 1 prompt evaluated"),
    (EVAL, [MEDUSA, PROMPTS, "calibration_prompts=0"], "calibration_prompts must be an integer >= 1, got 0"),
    (EVAL, [MEDUSA, PROMPTS, "tree_budgets=[0]"], "tree_budgets must be a non-empty list of node counts >= 1"),
    # -- item 11: an empty tree file; booleans that are not true/false -------------------------------------------
    (EVAL, [MEDUSA, PROMPTS, "tree={tmp}/empty_tree.json"], "holds no tree paths"),
    (GEN, [MEDUSA, "prompt=hi", "tree={tmp}/empty_tree.json"], "holds no tree paths"),
    # a tree of no draft node decoded as plain decoding with the heads' cost on top, saying nothing
    (GEN, [MEDUSA, "prompt=hi", "tree=[]"], "tree=[] has no draft node: give at least one path"),
    (EVAL, [MEDUSA, PROMPTS, "choice=fixed", "tree=[]"], "tree=[] has no draft node"),
    (EXPORT, [MEDUSA, "format=vllm", "out={tmp}/o", "materialize=3"],
     "materialize must be true or false (or yes/no, on/off, 1/0), got '3'"),
    (EVAL, [MEDUSA, PROMPTS, "compare=2"], "compare must be true or false"),
    (GEN, [MEDUSA, "prompt=hi", "trust_remote_code=maybe"], "trust_remote_code must be true or false"),
    (GEN, [MEDUSA, "prompt=hi", "apply_adapter=-1"], "apply_adapter must be true or false"),
    # a switch for an adapter these heads do not have: decoded without it, silently
    (GEN, [MEDUSA, "prompt=hi", "apply_adapter=true"], "trained without a LoRA adapter (Medusa-2): there is none"),
    # -- review 2: refused only after loading (or never), a traceback or gigabytes allocated ----------------------
    (EVAL, [MEDUSA, PROMPTS, "choice=fixed", "out=/proc/medusa_no_such/eval"],
     "out=/proc/medusa_no_such/eval cannot be created"),
    (EVAL, [EAGLE, PROMPTS, "methods=[eagle3_lookup]", "choice=fixed", "eagle_nodes=8", "eagle_depth=3",
            "eagle_lookup_tokens=100000000"], "eagle_lookup_tokens must be an integer in 0..64, got 100000000"),
    (GEN, [EAGLE, "prompt=hi", "eagle_nodes=8", "eagle_depth=3", "eagle_lookup_tokens=100000000"],
     "eagle_lookup_tokens must be an integer in 0..64"),
    (EVAL, [EAGLE, PROMPTS, "methods=[eagle3_lookup]", "choice=fixed", "eagle_nodes=8", "eagle_depth=3",
            "eagle_lookup_max_ngram=1000"], "eagle_lookup_max_ngram must be an integer in 1..16"),
    (EVAL, ["methods=[prompt_lookup]", PROMPTS, "prompt_lookup_tokens=100000000"],
     "prompt lookup num_tokens must be an integer in 1..64, got 100000000"),
    (EVAL, ["methods=[lookahead]", PROMPTS, "lookahead_window=100000"], "lookahead window must be an integer in 2..64"),
    (EVAL, ["methods=[lookahead]", PROMPTS, "lookahead_ngram=100000"], "lookahead ngram must be an integer in 2..16"),
    (EVAL, ["methods=[lookahead]", PROMPTS, "lookahead_guesses=100000"], "lookahead guesses must be an integer in 1..64"),
    (EVAL, ["methods=[draft]", PROMPTS, "draft_k=100000"], "draft_k (draft tokens per step) must be an integer in 1..64"),
    (EVAL, [MEDUSA, PROMPTS, "backbone={tmp}/bb", "max_new_tokens=1000000000"],
     "max_new_tokens=1000000000 does not fit the backbone's 64 positions with a prompt: at most 63"),
    (EVAL, ["methods=[autoregressive]", PROMPTS, "backbone={tmp}/bb", "max_new_tokens=64"],
     "max_new_tokens=64 does not fit the backbone's 64 positions"),
    (GEN, [MEDUSA, "prompt=hi", "backbone={tmp}/bb", "max_new_tokens=1000000000"],
     "max_new_tokens=1000000000 does not fit the backbone's 64 positions"),
    (EVAL, ["methods=[draft]", PROMPTS, "backbone={tmp}/bb", "draft=self:100", "max_new_tokens=8"],
     "draft=self:100 takes more layers than the backbone's 2: give draft=self:N with N in 1..2, or a draft checkpoint"),
    # compare=true on a shallow (debug) backbone: the draft= the user never gave is named as the default
    (EVAL, ["compare=true", PROMPTS, "backbone={tmp}/bb", "max_new_tokens=8"],
     "draft=self:4 (the default) takes more layers than the backbone's 2"),
    # tree=calibrated:N needs calibration prompts: medusa-generate said "unknown tree" after the backbone loaded
    (GEN, [MEDUSA, "prompt=hi", "tree=calibrated:4"],
     "tree=calibrated:4 is grown from measurements on calibration prompts, which medusa-generate does not take"),
    (EVAL, [MEDUSA, PROMPTS, "tree=tree99999999"], "tree tree99999999 has more than 256 nodes"),
    (EVAL, [MEDUSA, PROMPTS, "tree=tree9999"], "tree tree9999 has more than 256 nodes"),
    (GEN, [MEDUSA, "prompt=hi", "tree=tree99999999"], "tree tree99999999 has more than 256 nodes"),
    (GEN, [MEDUSA, "prompt=hi", "tree=chain99999999"], "tree chain99999999 has more than 256 nodes"),
    (EVAL, [MEDUSA, PROMPTS, "tree=calibrated:100000"], "tree=calibrated:N needs N >= 2 nodes (root included), at most 256"),
    (EVAL, [MEDUSA, PROMPTS, "tree_budgets=[100000000]"], "tree_budgets must be a non-empty list of node counts >= 1"),
    # -- issue 44: one choice key, one choice file; the keys and files they replaced -----------------------------
    (EVAL, [EAGLE, PROMPTS, "methods=[eagle3]", "eagle_tree=auto"], "eagle_tree= is gone: give choice=auto"),
    (GEN, [EAGLE, "prompt=hi", "eagle_tree={tmp}/eagle3_tree.json"], "eagle_tree= is gone: give choice=auto"),
    (EVAL, ["methods=[draft]", PROMPTS, "batch_size=[1,2]", "batch_chains=fixed"], "batch_chains= is gone: give choice="),
    (EVAL, [MEDUSA, PROMPTS, "tree=auto"], "tree=auto is gone: give choice=auto"),
    (GEN, [MEDUSA, "prompt=hi", "choice=auto"], "choice=auto is made by an evaluation"),
    (GEN, [MEDUSA, "prompt=hi", "choice={tmp}/tree_schedule.json"], "format from before the one choice file"),
    (GEN, [EAGLE, "prompt=hi", "choice={tmp}/eagle3_tree.json"], "format from before the one choice file"),
    (EVAL, [EAGLE, PROMPTS, "choice={tmp}/eagle3_lookup_tree.json"], "format from before the one choice file"),
    (GEN, [MEDUSA, "prompt=hi", "tree={tmp}/tree_schedule.json"], "from before the one choice file"),
    (GEN, [MEDUSA, "prompt=hi", "choice={tmp}/no_such_choice.json"], "no such file"),
    # -- review 3: tracebacks after loading, a key given twice, an empty method list -----------------------------
    (GEN, [MEDUSA, "prompt=hi", "seed=99999999999999999999"], "seed must lie in -2**63 .. 2**63-1"),
    (EVAL, [MEDUSA, PROMPTS, "seed=-9223372036854775809"], "seed must lie in -2**63 .. 2**63-1"),
    (GEN, [MEDUSA, "prompt=hi", "choice={tmp}/version_string.json"], "its version is '2', not a number"),
    (GEN, [MEDUSA, "prompt=hi", "max_new_tokens=4", "max_new_tokens=5"], "max_new_tokens= is given twice"),
    (EXPORT, [MEDUSA, "format=vllm", "out={tmp}/o", "format=tgi"], "format= is given twice"),
    (EVAL, [MEDUSA, PROMPTS, "methods=[]"], "methods= is empty"),
    (GEN, [MEDUSA, "prompt=hi", "eagle_nodes=4"], "eagle_nodes= is a key of eagle3, eagle3_lookup, and none of"),
    # medusa-generate has no methods= key: "or name such a method" could not be done there
    (GEN, [EAGLE, "prompt=hi", "draft_k=3"], "draft_k= is a key of draft, and none of the methods decoding here "
                                             "(eagle3_lookup) takes it: drop it"),
    (GEN, [EAGLE, "prompt=hi", "tree=tree8"], "tree= is a key of medusa, medusa_lookup"),
    (EVAL, [MEDUSA, PROMPTS, "draft_k=3", "choice=fixed"], "draft_k= is a key of draft"),
    (EVAL, [MEDUSA, PROMPTS, "methods=[medusa]", "draft_k=3"], "takes it: drop it, or name such a method"),
    (GEN, ["heads=", "prompt=hi"], "heads= needs a value"),
    (GEN, [MEDUSA, "prompt=" + "long " * 20, "backbone={tmp}/bbtok", "max_new_tokens=8"],
     "exceeds the backbone's 64 positions"),   # the tokenizer alone read: the weights never load
    (GEN, ["heads={tmp}/model", "prompt=hi"], "holds a model (llama), not heads"),
    (GEN, [MEDUSA, "prompt=hi", "backbone={tmp}/afile"], "it is a file, give the model's folder"),
    # -- review 4: a corrupt heads weights file, a draft model that cannot load: refused only after loading --------
    (EVAL, ["heads={tmp}/corrupt", PROMPTS], "corrupt/model.safetensors is corrupt or unreadable"),
    (GEN, ["heads={tmp}/corrupt", "prompt=hi"], "corrupt/model.safetensors is corrupt or unreadable"),
    (EVAL, ["heads={tmp}/empty_weights", PROMPTS], "empty_weights/model.safetensors is corrupt or unreadable"),
    (GEN, ["heads={tmp}/corrupt_adapter", "prompt=hi"], "adapter_model.safetensors is corrupt or unreadable"),
    (EVAL, ["draft={tmp}/no_such_draft"] + DRAFT, "draft={tmp}/no_such_draft: cannot load backbone"),
    (EVAL, ["draft={tmp}/afile"] + DRAFT, "draft={tmp}/afile: cannot load backbone"),
    (EVAL, ["draft={tmp}/heads3"] + DRAFT, "draft={tmp}/heads3: cannot read the config of backbone"),
    (EVAL, ["draft=no-such-org/no-such-draft"] + DRAFT, "draft=no-such-org/no-such-draft: cannot load backbone"),
    (EVAL, ["draft={tmp}/bb400"] + DRAFT, "the draft model's vocabulary has 400 entries, the target's 320"),
    (EVAL, ["draft={tmp}/bb"] + DRAFT, "draft={tmp}/bb: its tokenizer cannot be loaded"),
    (EVAL, ["draft={tmp}/bbeos"] + DRAFT, "the draft model's tokenizer has another eos_token_id (256 vs 258)"),
    (EVAL, ["draft={tmp}/bbswapped"] + DRAFT, "the draft model's tokenizer maps tokens to other ids than the target's"),
    (EVAL, ["methods=[hf_generate]", PROMPTS, "backbone={tmp}/bbtok", "mode=sample", "max_new_tokens=8"],
     "hf_generate is measured in greedy mode only"),
    (EVAL, ["methods=[autoregressive]", "prompts={tmp}/long.jsonl", "backbone={tmp}/bbtok", "max_new_tokens=8"],
     "prompt 'long' (119 tokens) + max_new_tokens (8) exceeds the backbone's 64 positions"),
    # the calibration prompts' budget named as max_new_tokens, a key the command line had not set
    (EVAL, [MEDUSA, PROMPTS, "backbone={tmp}/bbtok", "max_new_tokens=8", "calibration_prompts=1",
            "calibration_tokens=60"], "+ calibration_tokens (60) exceeds the backbone's 64 positions"),
    (EVAL, ["methods=[autoregressive]", PROMPTS, "backbone={tmp}/bbnochat", "max_new_tokens=8"],
     "has no chat template, and prompts are rendered as chats: give a chat model"),
    (EVAL, ["methods=[autoregressive]", PROMPTS, "backbone={tmp}/bb", "max_new_tokens=8"],
     "cannot load the tokenizer of backbone"),
    (GEN, [MEDUSA, "prompt=hi", "backbone={tmp}/bb", "max_new_tokens=8"], "cannot load the tokenizer of backbone"),
    (GEN, [MEDUSA, "prompt=hi", "backbone={tmp}/bbnosys", "system=Be brief.", "max_new_tokens=8"],
     "refuses the prompt: System role not supported"),
    # -- review 5: a backbone the tree decoder cannot decode, refused only once its weights had loaded -------------
    # (a backbone with sliding-window layers beside full ones is decoded within its window since: as bbwindow)
    (GEN, [MEDUSA, "prompt=hi", "backbone={tmp}/bbsliding", "max_new_tokens=8"],
     "exceeds the backbone's 16-token sliding window (decoded exactly only within it)"),
    (EVAL, ["methods=[autoregressive]", PROMPTS, "backbone={tmp}/bbsliding", "max_new_tokens=8"],
     "exceeds the backbone's 16-token sliding window (decoded exactly only within it)"),
    (EVAL, [MEDUSA, PROMPTS, "backbone={tmp}/bbwindow", "choice=fixed", "max_new_tokens=16"],
     "max_new_tokens=16 does not fit the backbone's 16-token sliding window (decoded exactly only within it)"),
    (GEN, [MEDUSA, "prompt=" + "x" * 20, "backbone={tmp}/bbwindow", "max_new_tokens=8"],
     "exceeds the backbone's 16-token sliding window"),
    # -- review 7: tracebacks, a choice file silently winning over keys, out= folders that are not the report's -----
    (EVAL, [MEDUSA, "prompts={tmp}/utf16.jsonl"], "{tmp}/utf16.jsonl: not UTF-8 text (invalid start byte 0xff)"),
    (GEN, [MEDUSA, "prompts_file={tmp}/utf16.jsonl"], "{tmp}/utf16.jsonl: not UTF-8 text"),
    (EVAL, [MEDUSA, "prompts={tmp}/heads3"], "{tmp}/heads3 is a folder, not a prompts file"),
    (GEN, [MEDUSA, "prompts_file={tmp}/heads3"], "{tmp}/heads3 is a folder, not a prompts file"),
    (GEN, [MEDUSA, "prompt=hi", "backbone={tmp}/emptydir"],
     "cannot load backbone '{tmp}/emptydir': the folder holds no config.json"),
    (EVAL, ["methods=[autoregressive]", PROMPTS, "backbone={tmp}/emptydir"], "the folder holds no config.json"),
    (GEN, [MEDUSA, "prompt=hi", "backbone={tmp}/bbnotype"],
     "cannot read the config of backbone '{tmp}/bbnotype': Unrecognized model in {tmp}/bbnotype"),
    (EVAL, ["methods=[autoregressive]", PROMPTS, "backbone={tmp}/bbnotype"], "Should have a `model_type` key"),
    (EVAL, [MEDUSA, PROMPTS, "choice={tmp}/medusa_choice.json", "tree=chain1"],
     "tree= and choice={tmp}/medusa_choice.json both set medusa's tree: give one"),
    (GEN, [MEDUSA, "prompt=hi", "choice={tmp}/medusa_choice.json", "tree=chain1"],
     "tree= and choice={tmp}/medusa_choice.json both set medusa's tree: give one"),
    (GEN, [MEDUSA, "prompt=hi", "choice={tmp}/plain_choice.json", "tree=tree8"],   # plain decoding: no tree at all
     "tree= and choice={tmp}/plain_choice.json both set medusa's tree: give one"),
    (GEN, [EAGLE, "prompt=hi", "choice={tmp}/eagle3_choice.json", "eagle_nodes=0"],
     "eagle_nodes= and choice={tmp}/eagle3_choice.json both set eagle3's tree: give one"),
    (EVAL, [EAGLE, PROMPTS, "methods=[eagle3]", "choice={tmp}/eagle3_choice.json", "eagle_topk=3"],
     "eagle_topk= and choice={tmp}/eagle3_choice.json both set eagle3's tree: give one"),
    (GEN, [MEDUSA, "prompt=true"], "prompt must be text, got the boolean true: quote it, e.g. 'prompt=\"true\"'"),
    (GEN, [MEDUSA, "prompt=Write: a poem"], "e.g. 'prompt=\"Write: a poem\"'"),
    (EVAL, [MEDUSA, PROMPTS, "choice=fixed", "out={tmp}/heads3"], "out={tmp}/heads3 holds heads or a model"),
    (EVAL, [MEDUSA, PROMPTS, "choice=fixed", "out={tmp}/model"], "out={tmp}/model holds heads or a model"),
    (EVAL, [MEDUSA, PROMPTS, "choice=fixed", "out={tmp}/mine"],
     "out={tmp}/mine holds files but no earlier evaluation's report.json"),
    (EVAL, [MEDUSA, PROMPTS, "choice=fixed", "out={tmp}/notours"],
     "out={tmp}/notours holds files but no earlier evaluation's report.json"),
    # -- review 8: an unbounded bucket, a key equal to its default ignored, a note before a refusal, a folder ------
    (GEN, [MEDUSA, "prompt=hi", "max_new_tokens=4", "graphs=uncaptured", "graph_buckets=[1,2,100000000]"],
     "graph_buckets must be at most 2048"),
    (EVAL, [MEDUSA, PROMPTS, "graphs=uncaptured", "graph_buckets=[1,2,100000000]"],
     "graph_buckets must be at most 2048"),
    # tree4 is medusa-generate's own default: written on the command line, it is given all the same
    (GEN, [MEDUSA, "prompt=hi", "choice={tmp}/medusa_choice.json", "tree=tree4"],
     "tree= and choice={tmp}/medusa_choice.json both set medusa's tree: give one"),
    (GEN, [EAGLE, "prompt=hi", "tree=tree4"], "tree= is a key of medusa, medusa_lookup, and none of the methods"),
    (EVAL, [MEDUSA, PROMPTS, "choice={tmp}/medusa_choice.json", "tree=tree8"],   # tree8: the library's default
     "tree= and choice={tmp}/medusa_choice.json both set medusa's tree: give one"),
    (EVAL, [EAGLE, PROMPTS, "methods=[eagle3]", "tree=tree8"], "tree= is a key of medusa, medusa_lookup"),
    # tree_budgets= only sizes the trees a Medusa choice grows at batch 1: taken silently (and recorded in
    # report.json) with EAGLE-3 heads, batched choices or a fixed node count
    (EVAL, [EAGLE, PROMPTS, "methods=[eagle3]", "tree_budgets=[4]"],
     "tree_budgets= sizes the trees a choice grows one prompt at a time, and no choice here grows them (each "
     "method's choice is fixed, grows the one tree tree=calibrated:N sizes, or chooses by other measures): drop "
     "tree_budgets="),
    (EVAL, [MEDUSA, PROMPTS, "batch_size=[1,2]", "tree_budgets=[4]"],
     "no choice here grows them (batched choices size their own candidates): drop tree_budgets="),
    (EVAL, [MEDUSA, PROMPTS, "tree=calibrated:4", "tree_budgets=[4]"], "no choice here grows them"),
    # several prompts decode in batches: the batching note must not come before the refusal
    (GEN, [MEDUSA, "prompts_file={tmp}/long.jsonl", "backbone={tmp}/bbtok", "max_new_tokens=8"],
     "exceeds the backbone's 64 positions"),
    (GEN, [MEDUSA, "prompt=hi", "choice={tmp}/emptydir"], "choice={tmp}/emptydir is a folder, not a choice file"),
    (EVAL, [MEDUSA, PROMPTS, "choice={tmp}/emptydir"], "choice={tmp}/emptydir is a folder, not a choice file"),
]


@pytest.fixture
def setup(tmp_path) -> Path:
    from inference.heads.eagle3 import draft_layer_config
    from inference.heads.native import save_heads
    from inference.heads.registry import build_heads
    from inference.heads.spec import HeadsSpec

    missing = str(tmp_path / "no_such_backbone")   # a check made after loading would fail with "not found"
    specs = {"heads3": HeadsSpec(num_heads=3, num_layers=1, hidden_size=64, vocab_size=320, base_model=missing),
             "e3": HeadsSpec(num_heads=2, num_layers=1, hidden_size=64, vocab_size=320, kind="eagle3",
                             projection="truncated", truncated_vocab_size=50, aux_layers=[1, 2, 3],
                             draft_layer=draft_layer_config({"hidden_size": 64, "num_attention_heads": 4,
                                                             "intermediate_size": 128, "num_hidden_layers": 4,
                                                             "model_type": "llama"}),
                             base_model=missing)}
    for name, spec in specs.items():   # weights whose header is sound (checked before loading), never loaded
        save_heads(build_heads(spec), tmp_path / name)
    shutil.copytree(tmp_path / "heads3", tmp_path / "corrupt")   # a half-written export
    weights = (tmp_path / "heads3" / "model.safetensors").read_bytes()
    (tmp_path / "corrupt" / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    shutil.copytree(tmp_path / "heads3", tmp_path / "empty_weights")
    (tmp_path / "empty_weights" / "model.safetensors").write_bytes(b"")
    adapted = HeadsSpec(num_heads=3, num_layers=1, hidden_size=64, vocab_size=320, base_model=missing,
                        backbone_adapter="adapter")   # Medusa-2 heads whose LoRA adapter file is cut short
    save_heads(build_heads(adapted), tmp_path / "corrupt_adapter")
    (tmp_path / "corrupt_adapter" / "adapter").mkdir()
    (tmp_path / "corrupt_adapter" / "adapter" / "adapter_config.json").write_text(json.dumps({"r": 2}))
    (tmp_path / "corrupt_adapter" / "adapter" / "adapter_model.safetensors").write_bytes(weights[:100])
    (tmp_path / "listcfg").mkdir()
    (tmp_path / "listcfg" / "config.json").write_text("[1, 2]")
    (tmp_path / "listcfg" / "model.safetensors").write_bytes(b"")
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("Hi.", "Yes?", "No.")))
    (tmp_path / "afile").write_text("not a folder\n")
    (tmp_path / "empty_tree.json").write_text("[]\n")
    (tmp_path / "tree_schedule.json").write_text(json.dumps({"format": "medusa-train tree schedule", "version": 1}))
    for name in ("eagle3_tree.json", "eagle3_lookup_tree.json"):
        (tmp_path / name).write_text(json.dumps({"format": "medusa-train eagle3 tree choice", "method": "eagle3"}))
    (tmp_path / "model").mkdir()   # a transformers model folder given as heads=
    (tmp_path / "model" / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    (tmp_path / "model" / "model.safetensors").write_bytes(b"")
    (tmp_path / "version_string.json").write_text(json.dumps({"format": "medusa-train speculation choice",
                                                             "version": "2", "method": "medusa"}))
    from transformers import LlamaConfig   # a backbone's config alone (no weights): 64 positions, 2 layers

    LlamaConfig(hidden_size=64, vocab_size=320, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                max_position_embeddings=64).save_pretrained(tmp_path / "bb")
    from medusa_train.backbone import byte_tokenizer   # the same config with a tokenizer, still no weights

    LlamaConfig(hidden_size=64, vocab_size=320, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                max_position_embeddings=64).save_pretrained(tmp_path / "bbtok")
    byte_tokenizer().save_pretrained(tmp_path / "bbtok")
    shutil.copytree(tmp_path / "bbtok", tmp_path / "bbnochat")   # a tokenizer without a chat template
    for f in (tmp_path / "bbnochat").glob("chat_template.*"):
        f.unlink()
    tokenizer_config = json.loads((tmp_path / "bbnochat" / "tokenizer_config.json").read_text())
    tokenizer_config.pop("chat_template", None)
    (tmp_path / "bbnochat" / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    for name in ("bbeos", "bbswapped"):   # drafts of the target's vocabulary size, with another tokenizer
        (tmp_path / name).mkdir()
        shutil.copy(tmp_path / "bbtok" / "config.json", tmp_path / name / "config.json")
    other_eos = byte_tokenizer()
    other_eos.eos_token = "<|endoftext|>"
    other_eos.save_pretrained(tmp_path / "bbeos")
    swapped = json.loads((tmp_path / "bbtok" / "tokenizer.json").read_text())
    vocab = swapped["model"]["vocab"]
    first, second = sorted(vocab, key=vocab.get)[:2]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (tmp_path / "bbswapped" / "tokenizer.json").write_text(json.dumps(swapped))
    for f in ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (tmp_path / "bbtok" / f).is_file():
            shutil.copy(tmp_path / "bbtok" / f, tmp_path / "bbswapped" / f)
    nosys = byte_tokenizer()   # a chat template that refuses a system prompt, as Gemma's
    nosys.chat_template = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not "
                           "supported') }}{% endif %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}")
    nosys.save_pretrained(tmp_path / "bbnosys")
    shutil.copy(tmp_path / "bb" / "config.json", tmp_path / "bbnosys" / "config.json")
    (tmp_path / "long.jsonl").write_text(json.dumps({"id": "long", "prompt": "x" * 100}) + "\n")
    LlamaConfig(hidden_size=64, vocab_size=400, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                max_position_embeddings=64).save_pretrained(tmp_path / "bb400")   # a draft of another vocabulary
    from transformers import MistralConfig, Qwen2Config   # sliding-window backbones (config and tokenizer)

    shapes = dict(hidden_size=64, vocab_size=320, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                  max_position_embeddings=64, sliding_window=16)
    Qwen2Config(use_sliding_window=True, max_window_layers=1, **shapes).save_pretrained(tmp_path / "bbsliding")
    MistralConfig(**shapes).save_pretrained(tmp_path / "bbwindow")   # every layer within the window
    for name in ("bbsliding", "bbwindow"):
        byte_tokenizer().save_pretrained(tmp_path / name)
    _review7_files(tmp_path)
    return tmp_path


MEDUSA_CHOICE = {"format": "medusa-train speculation choice", "version": 2, "method": "medusa",
                 "schedule": {"choices": {"1": {"tree": {"name": "chain2", "choices": [[0], [0, 0]]}}}}}
EAGLE3_CHOICE = {"format": "medusa-train speculation choice", "version": 2, "method": "eagle3",
                 "schedule": {"choices": {"1": {"eagle_nodes": 4, "eagle_depth": 2, "eagle_topk": 2}}}}


def _review7_files(tmp_path: Path) -> None:
    """A UTF-16 prompts file, backbone folders without config.json / without model_type, a choice file per head
    kind, a folder of the user's own holding a report.md, one whose report.json is no evaluation's."""
    (tmp_path / "utf16.jsonl").write_bytes(b'\xff\xfe{"prompt":"x"}\n')
    (tmp_path / "emptydir").mkdir()
    shutil.copytree(tmp_path / "bbtok", tmp_path / "bbnotype")
    (tmp_path / "bbnotype" / "config.json").write_text("{}")
    (tmp_path / "medusa_choice.json").write_text(json.dumps(MEDUSA_CHOICE))
    (tmp_path / "eagle3_choice.json").write_text(json.dumps(EAGLE3_CHOICE))
    (tmp_path / "plain_choice.json").write_text(json.dumps({**MEDUSA_CHOICE, "schedule": {"choices": {"1": None}}}))
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "report.md").write_text("my own notes\n")
    (tmp_path / "notours").mkdir()
    (tmp_path / "notours" / "report.json").write_text(json.dumps({"accuracy": 0.9}))


@pytest.fixture
def no_loading(monkeypatch):
    """Every way the commands load a backbone (or heads' weights) fails the test. The command modules are
    imported here first: one imported for the first time under the patches would keep them for good."""
    import inference.backbone
    import inference.cli_run
    import inference.export_run
    import inference.loading

    def loaded(*args, **kwargs):
        raise AssertionError("the backbone was loaded before the refusal")

    for module, name in ((inference.cli_run, "_load"), (inference.cli_run, "_load_eval"),
                         (inference.loading, "load_backbone"), (inference.backbone, "load_backbone"),
                         (inference.loading, "load_heads"), (inference.export_run, "load_heads"),
                         (inference.export_run, "load_backbone")):
        monkeypatch.setattr(module, name, loaded)


def _snapshot(root: Path) -> dict:
    return {str(p.relative_to(root)): (p.stat().st_size if p.is_file() else -1) for p in root.rglob("*")}


def _row_id(row):
    prog, argv, _ = row
    return f"{prog.split('-')[1]}:{' '.join(a.replace('{tmp}/', '') for a in argv)}"[:70]


@pytest.mark.parametrize("prog, argv, phrase", REFUSED, ids=[_row_id(r) for r in REFUSED])
def test_refused_in_one_line_before_loading(prog, argv, phrase, setup, no_loading, capsys, monkeypatch):
    """Guards against (issue 43): eagle_depth / eagle_topk / eagle_nodes of 10^5 accepted (10^5 drafter calls
    a step); max_new_tokens=0, temperature, calibration, tree budget and turns refusals that came only after the
    backbone loaded; medusa-eval out=<a file> refused only after evaluating everything; a config.json list ->
    AttributeError; threads=-1 -> RuntimeError; batch_size beyond the prompts, calibration_prompts=0 and
    tree_budgets=[0] reported as measured; a tree file holding [] decoded as plain decoding; materialize=3 and
    other non-boolean words taken as true. Review 2: out=/proc/... evaluated in full, then a FileNotFoundError;
    eagle_lookup_tokens=10^8 allocating 12.8 GB after loading (and the other unbounded lookup / lookahead /
    draft_k keys); max_new_tokens beyond the backbone's positions and draft=self:100 refused only after loading;
    tree=tree99999999 a MemoryError and tree9999 accepted; tree_budgets=[10^8] accepted. Review 4: a cut or empty
    model.safetensors (or adapter_model.safetensors) and a draft= that is no model (missing, a file, a heads
    folder, an unreachable hub id, another vocabulary, no tokenizer) refused only after the backbone loaded; so were
    methods=[hf_generate] in sample mode, an evaluated prompt beyond the backbone's positions and a tokenizer
    without a chat template (medusa-eval); a backbone without a tokenizer and a chat template refusing system=
    were tracebacks. Review 5: a backbone with sliding-window layers (Qwen2 with use_sliding_window) refused by
    ``MedusaModel`` only once its weights had loaded; a request past a Mistral-7B-v0.1-style window (every layer
    within it). Review 6: a draft of the target's vocabulary size whose tokenizer maps tokens to other ids, or has
    another EOS, refused only once both models had loaded. Review 7: a prompts file that is no UTF-8 a
    UnicodeDecodeError traceback, a folder given as one "not found"; a backbone folder without config.json (or one
    without model_type) a ValueError traceback once the heads had loaded; a key a choice= file also sets (tree=,
    eagle_nodes=) silently overridden by the file (report.json still naming the key's value); prompt=true given the
    ": " hint, which printed prompt=""Write: a poem"" (it fails when pasted into a shell); out= naming heads, an
    export or a folder of the user's (report.md there deleted as an earlier evaluation's leftover). Review 8:
    graph_buckets=[1,2,100000000] accepted, then a 100 GB allocation traceback once loaded (steps are padded up to
    their bucket); a key written equal to its default (medusa-generate's tree=tree4) ignored beside a choice file or
    heads whose method does not take it; a prompts file's batching note printed before a prompt's refusal; a folder
    given as choice= called "no such file"."""
    from inference.cli import eval_main, generate_main
    from inference.export_cli import export_main

    tmp = setup
    monkeypatch.chdir(tmp)
    args = [a.replace("{tmp}", str(tmp)) for a in argv]
    before = _snapshot(tmp)
    main = {EVAL: eval_main, GEN: generate_main, EXPORT: export_main}[prog]
    with pytest.raises(SystemExit) as exit_:
        main(args)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("[transformers]")]
    assert exit_.value.code == 2, err[-3000:]
    assert len(lines) == 1, err[-3000:]
    assert lines[0].startswith(f"{prog}: error: "), lines[0]
    assert phrase.replace("{tmp}", str(tmp)) in lines[0], (phrase, lines[0])
    assert _snapshot(tmp) == before, "a refused command wrote files"


@pytest.mark.parametrize("main_name, argv", [("generate_main", ["prompt=hi"]), ("eval_main", [PROMPTS])])
def test_a_missing_adapter_is_refused_before_the_backbone_loads(main_name, argv, setup, monkeypatch, capsys):
    """Guards against Medusa-2 heads copied without the LoRA adapter folder their config names refused only once
    the backbone had loaded (``merge_lora`` read it after ``load_backbone``), in ``load_medusa`` itself: only the
    backbone's loader is replaced here."""
    import inference.backbone
    import inference.cli as cli
    import inference.cli_run  # noqa: F401  (imported before the patches, as no_loading)
    import inference.loading
    from inference.heads.native import save_heads
    from inference.heads.registry import build_heads
    from inference.heads.spec import HeadsSpec

    def loaded(*args, **kwargs):
        raise AssertionError("the backbone was loaded before the refusal")

    for module in (inference.loading, inference.backbone):
        monkeypatch.setattr(module, "load_backbone", loaded)
    spec = HeadsSpec(num_heads=3, num_layers=1, hidden_size=64, vocab_size=320, base_model=str(setup / "bbtok"),
                     backbone_adapter="adapter")
    save_heads(build_heads(spec), setup / "no_adapter")
    before = _snapshot(setup)
    with pytest.raises(SystemExit) as exit_:
        getattr(cli, main_name)([f"heads={setup / 'no_adapter'}", "max_new_tokens=8", "choice=fixed",
                                 *[a.replace("{tmp}", str(setup)) for a in argv]])
    err = capsys.readouterr().err
    assert exit_.value.code == 2, err[-3000:]
    assert "adapter is not a LoRA adapter directory" in err and len(err.strip().splitlines()) == 1, err[-3000:]
    assert _snapshot(setup) == before


def _one_line_refusal(main, argv: list[str], root: Path, capsys) -> str:
    """The one ``error:`` line ``main(argv)`` exits 2 with, having written nothing under ``root``."""
    before = _snapshot(root)
    capsys.readouterr()   # what setting up printed (transformers' progress bars)
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("[transformers]")]
    assert exit_.value.code == 2 and len(lines) == 1, err[-3000:]
    assert _snapshot(root) == before, "a refused command wrote files"
    return lines[0]


@pytest.mark.parametrize("folder, phrase", [
    ("bbtok", "bbtok holds a config.json but no weights (model.safetensors, its shards or pytorch_model.bin)"),
    ("bbcut", "bbcut/model.safetensors is corrupt or unreadable (Error while deserializing header"),
    ("bbshards", "model.safetensors.index.json names 1 shard(s) missing from"),
])
def test_backbone_weights_are_checked_before_transformers_reads_them(folder, phrase, setup, monkeypatch, capsys):
    """Guards against a backbone folder whose weights are missing or cut short reaching transformers: no weights
    read as "not a local model folder, and the hub has no such model or cannot be reached", a safetensors file cut
    short (or a shard its index names, missing) was a SafetensorError / OSError traceback once the model had been
    built. Here transformers' model loader fails the test: the folder is checked before it runs."""
    import transformers

    import inference.cli_run  # noqa: F401  (imported before the patch, as no_loading)
    from inference.cli import generate_main

    def built(*args, **kwargs):
        raise AssertionError("transformers read the backbone before the refusal")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", built)
    from safetensors.torch import save_file

    shutil.copytree(setup / "bbtok", setup / "bbcut")
    save_file({"w": torch.zeros(64, 64)}, str(setup / "bbcut" / "model.safetensors"))
    weights = (setup / "bbcut" / "model.safetensors").read_bytes()
    (setup / "bbcut" / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    shutil.copytree(setup / "bbtok", setup / "bbshards")
    (setup / "bbshards" / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"w": "model-00001-of-00001.safetensors"}}))
    line = _one_line_refusal(generate_main, [MEDUSA.replace("{tmp}", str(setup)), "prompt=hi", "max_new_tokens=8",
                                             f"backbone={setup / folder}"], setup, capsys)
    assert line.startswith(f"medusa-generate: error: cannot load backbone '{setup / folder}': "), line
    assert phrase in line, (phrase, line)


def test_a_model_transformers_cannot_build_is_one_line(setup, capsys):
    """Guards against transformers' refusals to build the backbone ending in a ValueError traceback (both come
    before any weight is read): a model class without the attention implementation asked for (Gemma-2 with
    attn_implementation="sdpa": "does not support an attention implementation through
    torch.nn.functional.scaled_dot_product_attention"), and a config of no causal LM (ViT: "Unrecognized
    configuration class ... for this kind of AutoModel"); and a Bloom backbone (ALiBi, which the tree decoder cannot
    position), once refused only because its class lacks sdpa, reaching the decoder now that such classes load eager:
    refused from its config before its weights load."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, BloomConfig, Gemma2Config, ViTConfig

    from inference.backbone import load_backbone
    from inference.cli import generate_main
    from inference.errors import UserError
    from medusa_train.backbone import byte_tokenizer

    bloom = AutoModelForCausalLM.from_config(BloomConfig(hidden_size=64, n_layer=2, n_head=4, vocab_size=320),
                                             attn_implementation="eager")
    bloom.save_pretrained(setup / "bloom")
    byte_tokenizer().save_pretrained(setup / "bloom")
    line = _one_line_refusal(generate_main, [MEDUSA.replace("{tmp}", str(setup)), "prompt=hi", "max_new_tokens=8",
                                             f"backbone={setup / 'bloom'}"], setup, capsys)
    assert line.startswith(f"medusa-generate: error: backbone '{setup / 'bloom'}' positions its tokens by ALiBi "
                           "biases, which the tree decoder does not support"), line
    gemma2 = AutoModelForCausalLM.from_config(Gemma2Config(hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                                                           num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                                           vocab_size=320), attn_implementation="eager")
    gemma2.save_pretrained(setup / "gemma2")
    byte_tokenizer().save_pretrained(setup / "gemma2")
    with pytest.raises(UserError) as refused:
        load_backbone(str(setup / "gemma2"), attn_implementation="sdpa", attn_advice="set eager")
    assert str(refused.value) == (f"cannot load backbone '{setup / 'gemma2'}': transformers' Gemma2ForCausalLM does "
                                  "not support attn_implementation='sdpa' "
                                  "(torch.nn.functional.scaled_dot_product_attention), which it is loaded with: "
                                  "set eager")
    ViTConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64).save_pretrained(
        setup / "vit")
    byte_tokenizer().save_pretrained(setup / "vit")
    save_file({"w": torch.zeros(2)}, str(setup / "vit" / "model.safetensors"))
    with pytest.raises(UserError) as refused:
        load_backbone(str(setup / "vit"))
    assert str(refused.value) == (f"cannot load backbone '{setup / 'vit'}': its config (ViTConfig) is no causal "
                                  "language model's: transformers' AutoModelForCausalLM has no class for it")


@pytest.mark.parametrize("word, value", [("true", True), ("False", False), ("yes", True), ("off", False),
                                         ("1", True), ("0", False)])
def test_boolean_keys_take_the_usual_words(word, value):
    """Guards against the strict boolean check refusing the words a user means as true/false."""
    from inference.cli_support import parse_overrides
    from inference.export_cli import ExportConfig

    cfg = parse_overrides("medusa-export", ExportConfig, [f"materialize={word}", "heads=h", "format=vllm", "out=o"])
    assert cfg.materialize is value


def test_eagle_bounds_are_in_the_help():
    """Guards against bounds a user meets only as a refusal: medusa-eval --help states them."""
    from inference.cli import eval_help

    text = eval_help()
    assert "at most 32" in text and "at most 64" in text and "at most 256" in text


def test_an_auto_tree_is_named_by_the_nodes_it_has(monkeypatch):
    """Guards against tree_budgets=[100000000] reported as the chosen tree "auto100000000" while growth (which
    stops where no node is worth anything) gave it 4 nodes: a report names only what was measured."""
    import torch

    import inference.methods.medusa_choice as tc
    from inference.methods.medusa_choice import candidate_trees
    from inference.runtime import race

    per_rank = [[0.6, 0.2] + [0.0] * 8, [0.4, 0.1] + [0.0] * 8]   # 6 nodes with a value, whatever the budget
    hits = torch.tensor([[int(v * 1000) for v in row] for row in per_rank])
    monkeypatch.setattr(tc, "measure_head_accuracy", lambda m, prompts, **kw: tc.HeadAccuracy(hits, torch.tensor([1000] * 2)))
    monkeypatch.setattr(race, "machine_load", lambda: (0.2, 2))
    monkeypatch.setattr(tc, "step_times", lambda m, ids, tree, *, steps=8, **kw: [0.1 if tree is None else 0.05] * steps)
    choice = tc.choose_tree(None, [[1, 2, 3]] * 2, [1, 2, 3], budgets=[3, 200], log=lambda line: None)
    assert {c["name"]: c["nodes"] for c in choice.candidates} == {"auto3": 4, "auto6": 7}
    assert choice.tree is not None and choice.tree.name == f"auto{len(choice.tree.paths)}"
    assert [t.name for t, _ in candidate_trees(per_rank, 2, budgets=[3, 200], chains=())] == ["auto3", "auto6"]


def test_every_prompt_is_checked_against_the_positions_before_any_is_decoded(monkeypatch):
    """Guards against an evaluation (one prompt at a time or batched) refusing a prompt longer than the
    backbone's positions only when its turn came, mid-run, after decoding the prompts before it."""
    from medusa_train.backbone import byte_tokenizer

    from inference.errors import UserError
    from inference.evaluation import batch_eval, evaluate as evaluate_module
    from inference.prompts import Prompt
    from inference.methods import registry
    from inference.runtime.model import MedusaModel
    from runtime_support import tiny_llama

    def decoded(*args, **kwargs):
        raise AssertionError("a prompt was decoded before the refusal")

    monkeypatch.setattr(registry, "generate", decoded)
    monkeypatch.setattr(batch_eval, "hf_generate_batch", decoded)
    m = MedusaModel(model=tiny_llama(vocab=259, max_positions=64), tokenizer=byte_tokenizer(), heads=None)
    prompts = [Prompt("short", ["Hi."]), Prompt("long", ["x" * 200])]
    with pytest.raises(UserError, match=r"prompt 'long' \(\d+ tokens\) \+ max_new_tokens \(4\) exceeds the backbone's 64"):
        evaluate_module.evaluate(m, prompts, methods=["autoregressive"], max_new_tokens=4, progress=False,
                                 log=lambda line: None)
    with pytest.raises(UserError, match="prompt 'long'"):
        batch_eval.evaluate_batched(m, prompts, methods=["autoregressive"], batch_sizes=[1], max_new_tokens=4,
                                    progress=False, log=lambda line: None)


def _backbone_config_folder(setup: Path) -> Path:
    """``setup/bb4``: a backbone's config and tokenizer without weights, deep enough for aux layers 1, 2, 3."""
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=64, vocab_size=320, num_hidden_layers=4, num_attention_heads=4, intermediate_size=128,
                max_position_embeddings=64).save_pretrained(setup / "bb4")
    shutil.copytree(setup / "bbtok", setup / "bb4", dirs_exist_ok=True, ignore=shutil.ignore_patterns("config.json"))
    return setup / "bb4"


def _rewrite_weights(folder: Path, change) -> None:
    """``folder``'s single safetensors file rewritten with ``change(tensors)`` applied (a sound header)."""
    from safetensors.torch import load_file, save_file

    f = next(folder.glob("*.safetensors"))
    tensors = load_file(str(f))
    change(tensors)
    save_file(tensors, str(f))


def _widen_first(tensors: dict) -> None:
    name = sorted(k for k, t in tensors.items() if t.dim() == 2)[0]
    tensors[name] = torch.zeros(tensors[name].shape[0] + 1, tensors[name].shape[1])


@pytest.mark.parametrize("source, change, phrase", [
    ("heads3", _widen_first, "has shape (65, 64), config implies (64, 64)"),
    ("heads3", lambda t: t.pop(sorted(t)[0]), "does not match its config: missing"),
    ("heads3", lambda t: t.update(extra=torch.zeros(2)), "unexpected ['extra']"),
    ("e3", _widen_first, "config implies"),
    ("vllm_e3", lambda t: t.pop("fc.weight"), "fc.weight"),
])
def test_heads_that_do_not_match_their_config_are_refused_before_the_backbone_loads(source, change, phrase, setup,
                                                                                    monkeypatch, capsys):
    """Guards against heads whose tensors are not the ones their config implies (one mis-shaped, missing or extra
    tensor; a native Medusa or EAGLE-3 export, and an EAGLE-3 drafter in the engines' layout) refused only after the
    backbone's weights had loaded (minutes into an 8B model): ``load_medusa`` now reads the heads whole, from the
    target's config alone, before the backbone. Only the backbone's loader is replaced here."""
    import inference.backbone
    import inference.cli_run  # noqa: F401  (imported before the patches, as no_loading)
    import inference.loading
    from inference.cli import generate_main
    from inference.formats.export import export_heads
    from inference.loading import load_heads

    def loaded(*args, **kwargs):
        raise AssertionError("the backbone was loaded before the refusal")

    if source == "vllm_e3":   # the engines' EAGLE-3 layout, exported from the native one
        e3 = load_heads(setup / "e3", input_embeddings=torch.zeros(320, 64))
        export_heads(e3, "eagle3", setup / "vllm_e3")
    _backbone_config_folder(setup)
    folder = setup / f"bad_{source}"
    shutil.copytree(setup / source, folder)
    _rewrite_weights(folder, change)
    for module in (inference.loading, inference.backbone):
        monkeypatch.setattr(module, "load_backbone", loaded)
    line = _one_line_refusal(generate_main, [f"heads={folder}", f"backbone={setup / 'bb4'}", "prompt=hi",
                                             "max_new_tokens=8", "choice=fixed"], setup, capsys)
    assert line.startswith("medusa-generate: error: "), line
    assert phrase in line, (phrase, line)


@pytest.mark.parametrize("source, path, value, phrase", [
    ("heads3", ["num_heads"], 10 ** 8, "need num_heads in 1..64 and num_layers in 0..64, got 100000000, 1"),
    ("heads3", ["num_layers"], 10 ** 6, "need num_heads in 1..64 and num_layers in 0..64, got 3, 1000000"),
    ("heads3", ["num_heads"], 5, "does not match its config: missing ['blocks.3.0.linear.bias'"),
    ("e3", ["draft_layer", "intermediate_size"], 10 ** 9, "down_proj.weight has shape (64, 128), config implies (64, 1000000000)"),
    # the engines' EAGLE-3 layout, imported: built at its config's sizes before the state was compared
    ("vllm_e3", ["intermediate_size"], 10 ** 9, "down_proj.weight has shape (64, 128), config implies (64, 1000000000)"),
])
def test_a_config_that_disagrees_with_its_weights_is_refused_before_anything_is_built(source, path, value, phrase,
                                                                                      setup, capsys):
    """Guards against a heads config.json edited (or another export's) to sizes its weights do not have being built
    at those sizes before the weights were compared with it: 10^8 heads built for minutes then a MemoryError
    traceback, a 10^9-wide EAGLE-3 draft layer asking for 256 GB (a traceback), in medusa-generate, medusa-eval and
    medusa-export alike. The header's shapes are compared with the heads built on the meta device instead."""
    from inference.cli import generate_main
    from inference.export_cli import export_main
    from inference.formats.export import export_heads
    from inference.loading import load_heads

    if source == "vllm_e3":
        export_heads(load_heads(setup / "e3", input_embeddings=torch.zeros(320, 64)), "eagle3", setup / source)
    folder = setup / f"edited_{source}"
    shutil.copytree(setup / source, folder)
    config = json.loads((folder / "config.json").read_text())
    inner = config
    for key in path[:-1]:
        inner = inner[key]
    inner[path[-1]] = value
    (folder / "config.json").write_text(json.dumps(config))
    backbone = f"backbone={_backbone_config_folder(setup)}"
    for main, argv in ((generate_main, [f"heads={folder}", backbone, "prompt=hi", "choice=fixed",
                                        "max_new_tokens=8"]),
                       (export_main, [f"heads={folder}", "format=vllm" if source == "heads3" else "format=eagle3",
                                      f"out={setup / 'exported'}"])):
        line = _one_line_refusal(main, argv, setup, capsys)
        assert phrase in line, (phrase, line)


def test_a_choice_file_without_a_key_of_its_own_given_still_decodes(setup, no_loading, monkeypatch):
    """Guards against the refusal of a key a choice file also sets refusing what it does not set: a choice file
    alone (medusa-generate's own default tree=tree4 is no key the user gave), or beside a key of another part of
    the options, must pass every check and reach the load; so must EAGLE-3 heads, which that default tree=tree4 does
    not concern (review 8: a key is given when written, so a default must never count as written)."""
    from inference.cli import eval_main, generate_main

    monkeypatch.chdir(setup)
    for main, argv in ((generate_main, [MEDUSA, "prompt=hi", "choice={tmp}/medusa_choice.json"]),
                       (eval_main, [MEDUSA, PROMPTS, "choice={tmp}/medusa_choice.json", "prompt_lookup_tokens=3",
                                    "methods=[medusa,medusa_lookup]"]),
                       (generate_main, [EAGLE, "prompt=hi", "choice={tmp}/eagle3_choice.json"]),
                       # tree=tree4, medusa-generate's own default, is no key of these EAGLE-3 heads' user
                       (generate_main, [EAGLE, "prompt=hi", "max_new_tokens=4"]),
                       (generate_main, [MEDUSA, "prompt=hi", "choice={tmp}/medusa_choice.json", "max_new_tokens=4",
                                        "mode=greedy"])):
        with pytest.raises(AssertionError, match="the backbone was loaded"):
            main([a.replace("{tmp}", str(setup)) for a in argv])


def test_a_local_backbone_folder_transformers_cannot_read_is_one_line(setup):
    """Guards against a local backbone folder whose config.json has no model_type (with weights beside it) ending
    in transformers' ValueError traceback ("Unrecognized model ... model_type") from ``load_backbone``: the files are
    the user's to mend, so the line names the backbone and the first line of the cause."""
    from safetensors.torch import save_file

    from inference.backbone import load_backbone
    from inference.errors import UserError

    save_file({"w": torch.zeros(2)}, str(setup / "bbnotype" / "model.safetensors"))
    with pytest.raises(UserError) as refused:
        load_backbone(str(setup / "bbnotype"))
    text = str(refused.value)
    assert text.startswith(f"cannot load backbone '{setup / 'bbnotype'}': Unrecognized model") and "\n" not in text


def test_the_printed_generate_command_decodes_as_the_evaluation_measured(tmp_path, monkeypatch, capsys):
    """Guards against medusa-eval's "decode with <method>'s choice: medusa-generate ..." line dropping backbone=,
    dtype=, device=, trust_remote_code=, apply_adapter=, the sampling keys and chat_template_args: pasted, heads
    whose recorded base model is unreachable failed, a bfloat16 evaluation's choice decoded in float32, Medusa-2
    heads decoded without their adapter, a sampled one greedily, thinking-off prompts with thinking on; and the line
    not running as printed (no prompt=; a batched one's "prompts_file=<prompts.jsonl>", shell redirections; a line
    for a draft model's or prompt lookup's choice, which medusa-generate refused; the evaluation's max_new_tokens
    dropped). The line is read back as medusa-generate reads its argv."""
    import shlex
    import types

    import inference.cli as cli
    from inference import cli_run
    from inference.cli_support import parse_overrides

    monkeypatch.setattr(cli_run, "write_report", lambda out, report: [out / "report.json"])
    monkeypatch.setattr(cli_run, "print_per_method", lambda report: None)
    monkeypatch.setattr(cli_run, "print_batched", lambda batched: None)
    monkeypatch.setattr(cli_run, "write_choice", lambda out, method, *a: out / f"{method}_choice.json")
    from inference.heads.spec import HeadsSpec

    # a draft model's choice too: medusa-generate decodes with the heads' own methods, and refused its line
    chosen = {"medusa": types.SimpleNamespace(measured=True, options=None),
              "draft": types.SimpleNamespace(measured=True, options=None)}
    m = types.SimpleNamespace(heads=types.SimpleNamespace(spec=HeadsSpec(kind="medusa", num_heads=3, num_layers=1,
                                                                         hidden_size=8, vocab_size=16)))
    out = tmp_path / "my eval"   # a space: the line must still paste as one argument
    out.mkdir()
    for given, expected in (
            (dict(backbone="/models/my bb", dtype="bfloat16", device="cpu", trust_remote_code=True),
             dict(backbone="/models/my bb", dtype="bfloat16", device="cpu", trust_remote_code=True)),
            # Medusa-2 heads measured on a named base with the adapter merged: printed with backbone=, the unset
            # apply_adapter would mean off; a choice measured sampling stays sampling
            (dict(backbone="/models/base", apply_adapter=True, mode="sample", temperature=0.5, top_k=20),
             dict(backbone="/models/base", apply_adapter=True, mode="sample", temperature=0.5, top_k=20)),
            # prompts rendered with the template's variables (Qwen3 with thinking off): decoded so too
            # (a string the command line would read as another value, "1", quoted)
            (dict(chat_template_args={"enable_thinking": False, "effort": "low", "level": "1"}),
             dict(chat_template_args={"enable_thinking": False, "effort": "low", "level": "1"})),
            # the answers' length the prompts were checked to fit with
            (dict(max_new_tokens=12), dict(max_new_tokens=12)),
            ({}, dict(backbone=None, dtype="float32", device="auto", trust_remote_code=False, apply_adapter=None,
                      mode="greedy"))):
        cfg = cli.EvalConfig(heads="runs/a/heads", out=str(out), **given)
        cli_run.write_eval(cfg, m, out, {}, chosen, batched=False)
        printed = capsys.readouterr().out
        assert "decode with draft's choice" not in printed
        line = next(x for x in printed.splitlines() if x.startswith("decode with medusa's choice: "))
        argv = shlex.split(line.split(": ", 1)[1])
        assert argv[0] == "medusa-generate", line
        read = parse_overrides("medusa-generate", cli.GenerateConfig, argv[1:])
        assert read.heads == "runs/a/heads" and read.choice == str(out / "medusa_choice.json"), line
        assert {k: getattr(read, k) for k in expected} == expected, line
        assert read.prompt == cli_run.EXAMPLE_PROMPT, line   # runs as printed: "prompt= is required" was the answer
        assert given or argv[1:] == ["heads=runs/a/heads", f"prompt={cli_run.EXAMPLE_PROMPT}",
                                     f"choice={out / 'medusa_choice.json'}"], line
    cfg = cli.EvalConfig(heads="runs/a/heads", out=str(out), prompts="my prompts.jsonl", batch_size=[1, 4, 8])
    cli_run.write_eval(cfg, m, out, {"batched": {"batch_sizes": [1, 4, 8]}}, chosen, batched=True)
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("decode with medusa's choice: "))
    read = parse_overrides("medusa-generate", cli.GenerateConfig, shlex.split(line.split(": ", 1)[1])[1:])
    assert (read.prompts_file, read.batch_size, read.prompt) == ("my prompts.jsonl", 8, None), line
    cli_run.write_eval(cli.EvalConfig(heads=None, out=str(out)), types.SimpleNamespace(heads=None), out, {}, chosen,
                       batched=False)
    assert "decode with" not in capsys.readouterr().out   # medusa-generate decodes with heads: "heads=None" never ran


def test_the_prompt_quoting_hint_works_when_pasted_into_a_shell(capsys):
    """Guards against medusa-generate's hint for a prompt holding ": " printing prompt=""Write: a poem"", which a
    shell turns back into the unquoted prompt that was refused: the example it prints, split as a shell splits it,
    must be read as that text."""
    import shlex

    import inference.cli as cli
    from inference.cli_checks import generate_prompts
    from inference.cli_support import parse_overrides
    from inference.errors import UserError

    refused = parse_overrides("medusa-generate", cli.GenerateConfig, ["heads=h", "prompt=Write: a poem"])
    with pytest.raises(UserError) as e:
        generate_prompts(refused)
    example = str(e.value).split("e.g. ", 1)[1].rstrip(")")
    cfg = parse_overrides("medusa-generate", cli.GenerateConfig, ["heads=h", *shlex.split(example)])
    prompts, several = generate_prompts(cfg)
    assert [p.turns for p in prompts] == [["Write: a poem"]] and not several


def test_eval_help_gives_outs_default_with_compare():
    """Guards against medusa-eval --help saying out's default is <heads>/../eval also with compare=true, where the
    report goes to <heads>/../compare (``cli_checks.eval_out_dir``)."""
    from inference.cli import eval_help

    line = next(x for x in eval_help().splitlines() if x.startswith("  out (default"))
    assert "<heads>/../eval" in line and "<heads>/../compare with compare=true" in line, line


WIDE_TREE = [[r] for r in range(300)]   # 301 nodes, beyond MAX_TREE_NODES
TREES_REFUSED = [
    (GEN, [MEDUSA, "prompt=hi", "tree={tmp}/version_str_tree.json"], "its version is '2', not a number"),
    (EVAL, [MEDUSA, PROMPTS, "choice=fixed", "tree={tmp}/version_null_tree.json"], "its version is None, not a number"),
    (GEN, [MEDUSA, "prompt=hi", "tree={tmp}/wide_tree.json"], "has 301 nodes (root included), more than 256"),
    (EVAL, [MEDUSA, PROMPTS, "choice=fixed", "tree={tmp}/wide_tree.json"], "has 301 nodes"),
    (GEN, [MEDUSA, "prompt=hi", "tree=" + json.dumps(WIDE_TREE).replace(" ", "")], "has 301 nodes"),
    (GEN, [MEDUSA, "prompt=hi", "tree=chain1"], "tree=chain1 has no draft node"),
    (EVAL, [MEDUSA, PROMPTS, "choice=fixed", "tree=chain1"], "tree=chain1 has no draft node"),
    (GEN, [MEDUSA, "prompt=hi", "choice={tmp}/rootless_choice.json"], "its tree chain1 has no draft node"),
    (GEN, [MEDUSA, "prompt=hi", "choice={tmp}/wide_choice.json"], "its tree wide has 301 nodes"),
    (EXPORT, [EAGLE, "format=eagle3", "out={tmp}/o", "materialize=true"], "materialize= is not read by format=eagle3"),
]


@pytest.mark.parametrize("prog, argv, phrase", TREES_REFUSED, ids=[_row_id(r) for r in TREES_REFUSED])
def test_trees_and_unread_export_keys_are_refused_in_one_line_before_loading(prog, argv, phrase, setup, no_loading,
                                                                            capsys, monkeypatch):
    """Guards against: a tree file whose version is "2" or null a TypeError traceback; a tree file or an inline tree
    of 301 (or 16,512) nodes decoded past the 256-node cap named trees have (0.2 tok/s); tree=chain1, or a choice
    file whose tree has no draft node, decoded as plain decoding reported as medusa with tau 1.0; materialize=true
    silently ignored by format=eagle3. Each one line, exit 2, before anything loads, nothing written."""
    for name, version in (("version_str_tree.json", "2"), ("version_null_tree.json", None)):
        (setup / name).write_text(json.dumps({"format": "medusa-tree", "version": version, "choices": [[0]]}))
    (setup / "wide_tree.json").write_text(json.dumps({"format": "medusa-tree", "version": 1, "choices": WIDE_TREE}))
    for name, tree in (("rootless_choice.json", {"name": "chain1", "choices": []}),
                       ("wide_choice.json", {"name": "wide", "choices": WIDE_TREE})):
        (setup / name).write_text(json.dumps({**MEDUSA_CHOICE, "schedule": {"choices": {"1": {"tree": tree}}}}))
    test_refused_in_one_line_before_loading(prog, argv, phrase, setup, no_loading, capsys, monkeypatch)
