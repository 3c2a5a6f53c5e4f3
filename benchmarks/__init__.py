"""What ``python scripts/bench.py`` runs: the studies (``studies/*.yaml``: recipes to train x ``medusa-eval``
argument sets, run by ``study.py``, each writing its generated section to ``results/<name>.md``), the
micro-benchmarks (``micro/``), the GPU check's measurements (``gpu_check.py``, run by ``scripts/gpu_check.sh``)
and the timing helpers they share (``timing.py``). ``history.md`` is the chronological record every figure of
BENCHMARKS.md comes from; ``gpu_h200/`` keeps the raw outputs of the GPU check's one H200 run.

Not part of the installed package: tooling for this repository, which imports ``inference`` and
``medusa_train`` and is never imported by them.
"""
