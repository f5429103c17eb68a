"""`python -m tests.model.aot_moe MODEL_DIR FORM [compile flags]`: `ringserve compile` with expert
parallelism held to one form (model/layers/expert_parallel.py; FORM psum or a2a: the plan's
`moe_a2a_rows` emptied, or 0 so every program whose rows ep divides routes by all_to_all), for
tests/model/test_tpu_aot.py in a subprocess with libtpu on its path."""

from __future__ import annotations

import sys

from ringserve.actors.cli.main import main
from ringserve.model.compute import plan

if __name__ == "__main__":
    path, form, *flags = sys.argv[1:]
    plan.MOE_A2A_ROWS.clear()
    if form == "a2a":
        plan.MOE_A2A_ROWS.update(cpu=0, tpu=0, gpu=0)
    sys.exit(main(["compile", "--model", path, *flags]))
