"""What real rows leave of a padded batch on the links, as the capacity plan counts it (aqpipe.runtime.capacity.rows):
against a real run's bytes, and against the same run with every position on the links."""

import json

from aqpipe.runtime.capacity import plan as cap
from aqpipe.runtime.plan import make_plan
from tests import warm
from tests.test_capacity import SMALL, flags_to_config


def test_the_plan_counts_only_the_real_tokens_of_padded_batches_on_the_links_in_m_and_in_evaluation(tmp_path):
    """Instruction data over real rows: the run's link bytes, each held-out pass's and m(ξ)'s as the run measures
    them; with padded links every position counts, and the plan says what real rows saved against them."""
    flags = [*SMALL, "--model", "llama-tiny", "--data", "builtin-instruct", "--seq-len", "64", "--max-samples", "48",
             "--epochs", "2", "--eval-every", "4", "--eval-samples", "24"]
    proc = warm.run("launch", *flags, "--no-progress", "--out", str(tmp_path / "run"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    real = cap.plan_capacity(make_plan(flags_to_config(flags, tmp_path / "plan")))
    padded = cap.plan_capacity(make_plan(flags_to_config([*flags, "--link-rows", "padded"], tmp_path / "padded")))
    sent = sum(r["fwd_bytes"] + r["bwd_bytes"] for r in records)
    assert abs(sent - real.run_link_bytes()[0]) <= 0.03 * sent, (sent, real.run_link_bytes())
    assert real.run_link_bytes()[0] < 0.85 * padded.run_link_bytes()[0]
    # (what AQ-SGD's padded lossless messages add: a mode byte per sample)
    assert 0 <= padded.run_link_bytes()[1] - real.fixed_shape_bytes() <= 0.001 * real.fixed_shape_bytes()
    assert padded.fixed_shape_bytes() == 0
    passes = [r["eval_bytes"] for r in records if r.get("eval_bytes")]
    assert len(passes) == real.evaluation.passes == 2
    for measured in passes:  # (framing aside: a header, ids and mask per message)
        assert real.evaluation.pass_bytes <= measured <= 1.1 * real.evaluation.pass_bytes
    assert real.evaluation.pass_bytes < 0.85 * padded.evaluation.pass_bytes
    assert real.links[0].store_side_bytes < 0.85 * padded.links[0].store_side_bytes
