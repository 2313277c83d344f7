"""dppo.train.run: the main job's terminal report (in-process, no Ray)."""

import json

from dppo.train import run


def test_run_prints_the_summary_and_where_it_wrote_its_outputs(small_cfg, capsys):
    cfg = small_cfg(**{"trainer.total_steps": 1, "algorithm.prox_anchor": "current"})
    result = run(cfg)  # prints to the sys.stdout of the moment (here: pytest's capture), not the one at import
    printed = capsys.readouterr().out
    out_dir = result.output_dir
    assert f"metrics: {out_dir / 'metrics.jsonl'}" in printed
    assert f"plot:    {out_dir / 'training_curves.png'}" in printed
    assert f"summary: {out_dir / 'summary.json'}" in printed
    assert "reward, last 10% of steps" in printed and result.summary_table() in printed
    assert (out_dir / "config.yaml").read_text().startswith("trainer:")
    summary = json.loads((out_dir / "summary.json").read_text())
    assert summary["summary"]["global steps"] == "1"
