"""The one benchmark entry: studies (recipes trained x medusa-eval runs, each writing its own section of results)
and a few micro-benchmarks. Every figure is a latency: run it alone on the machine.

    python scripts/bench.py list                              # the studies, what each measures
    python scripts/bench.py study families --dry-run          # its medusa-train / medusa-eval commands
    python scripts/bench.py study families                    # run them -> benchmarks/results/families.md
    python scripts/bench.py machine --prompts 6 --tokens 96   # what this machine gives the runtime
    python scripts/bench.py kernels --rounds 3                # verification forward per node count, kernels
    python scripts/bench.py tree-attention --rounds 60        # sdpa vs the decoding attention
    python scripts/bench.py train --steps 4                   # training step vs backbone forward tokens/s
    python scripts/bench.py profile-gpu --out DIR [--dry-run] # where a GPU step's time goes
    python scripts/bench.py static-steps --prompts 6          # static-shape steps vs dynamic ones, uncaptured
    python scripts/bench.py host-work --rounds 5              # what a step leaves on the host beside its graphs

Studies are data (benchmarks/studies/<name>.yaml; format in benchmarks/study.py); the chronological record
is benchmarks/history.md, the current results BENCHMARKS.md. ``<command> --help`` gives each one's options.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the benchmarks package (not installed) beside inference/ and medusa_train/

from benchmarks.options import EXIT_USER_ERROR, Parser  # noqa: E402  (standard library only: --help stays instant)
from inference.errors import UserError  # noqa: E402  (no torch: the exception module alone)

MICRO = {  # subcommand -> (module, help); imported only when run, so --help stays instant
    "machine": ("benchmarks.micro.machine", "memory bandwidth, stock vs routed steps, plain loop vs generate"),
    "kernels": ("benchmarks.micro.kernels", "a verification forward per node count: stock, routed, prepacked"),
    "tree-attention": ("benchmarks.micro.tree_attention", "transformers' sdpa vs the decoding attention"),
    "train": ("benchmarks.micro.train", "training step tokens/s against the backbone's forward, per projection"),
    "joint-checkpointing": ("benchmarks.micro.joint_checkpointing", "Medusa-2's joint step, checkpointing off vs on"),
    "profile-gpu": ("benchmarks.micro.gpu_profile", "a GPU step's kernel time against its wall time (or --dry-run)"),
    "static-steps": ("benchmarks.micro.static_steps", "graphs=uncaptured vs off (and off vs off) on this machine"),
    "host-work": ("benchmarks.micro.host_work", "a step's host reads, ops and time outside its captured graphs"),
}


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand; a user's mistake (a bad option, a missing path, the project's ``UserError`` from a
    loader) ends as one ``bench.py: error: <line>`` and exit 2, as every CLI of the toolkit does."""
    try:
        return _main(argv)
    except UserError as e:
        print(f"bench.py: error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR


def _main(argv: list[str] | None) -> int:
    head, examples = __doc__.split("\n\n", 1)
    ap = Parser(prog="bench.py", description=head, epilog=examples,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="the studies and what each measures")
    st = sub.add_parser("study", help="run a study: train what is missing, evaluate, write its section")
    st.add_argument("name")
    st.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    st.add_argument("--only", choices=("train", "eval"), help="only the training runs, or only the evaluations")
    st.add_argument("--section", action="store_true", help="only rewrite benchmarks/results/<name>.md from the reports")
    st.add_argument("--bin", type=Path, help="folder of medusa-train / medusa-eval (default: this Python's, else PATH)")
    for name, (_, text) in MICRO.items():
        sub.add_parser(name, help=text, add_help=False)
    args, rest = ap.parse_known_args(argv)
    if args.command in MICRO:
        importlib.import_module(MICRO[args.command][0]).main(rest)
        return 0
    if rest:
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    from benchmarks import study

    if args.command == "list":
        for name in study.names():
            s = study.load(name)
            print(f"{name:16} {s['title']}")
        return 0
    if args.section:
        print(study.write_section(args.name, study.load(args.name)))
        return 0
    return study.run(args.name, dry_run=args.dry_run, only=args.only, bin_dir=args.bin)


if __name__ == "__main__":
    sys.exit(main())
