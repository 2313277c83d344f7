"""TRL's GRPOTrainer on the text task of issue 18's point 3: the peer side of `peer_bench.py --task text`.

    .venv-trl/bin/python benchmarks/trl_text.py --task-dir DIR --seed S --progress FILE --result FILE

DIR is what benchmarks/text_peer_task.py wrote: the 43M Qwen2 with its tokenizer and chat template (DIR/model),
the verl-format parquet files (DIR/data) and the reward (benchmarks/text_peer_reward.py, the file dppo loads as
custom_reward_function.path). The settings match peer_bench.py's dppo command for this task: 16 prompts x 8
samples per generation, --steps-per-generation optimizer steps on them with the generation-time weights as the
old policy, up to 64 completion tokens at temperature 1, AdamW at --lr constant, clip 0.2/0.2 and the two-sided
clip delta=3 (dppo's dual clip c=3), token-mean ("dapo"), no KL, fp32, with TRL's transformers `generate` (its
vLLM mode was not tried here: docs/benchmarks.md). Then greedy decoding of the validation prompts, scored by the
same reward, as `dppo train` ends.

FILE --progress: one JSON line per generation cycle once its optimizer steps are done: {"step", "reward" (the
mean reward of the cycle's samples), "t" (time.time())}. FILE --result: the evaluation and the settings, as JSON.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

PROMPTS_PER_STEP = 16  # trainer.train_batch_size
SAMPLES = 8  # rollout.n
REWARD_FILE = Path(__file__).resolve().parent / "text_peer_reward.py"


def load_reward():
    spec = importlib.util.spec_from_file_location("text_peer_reward", REWARD_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def read_rows(path: Path) -> list[dict]:
    import pyarrow.parquet as pq

    return pq.read_table(path).to_pylist()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task-dir", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--progress", required=True)
    parser.add_argument("--result", required=True)
    parser.add_argument("--steps", type=int, default=25, help="generation cycles (global steps)")
    parser.add_argument("--steps-per-generation", type=int, default=2)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--output-dir", default="/tmp/trl_text")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's, the cores)")
    args = parser.parse_args(argv)

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl_copy import cycle_log  # next to this file
    from trl import GRPOConfig, GRPOTrainer

    reward = load_reward()
    task = Path(args.task_dir)
    train = read_rows(task / "data" / "train.parquet")
    val = read_rows(task / "data" / "val.parquet")
    dataset = Dataset.from_dict(
        {
            "prompt": [r["prompt"] for r in train],
            "ground_truth": [r["reward_model"]["ground_truth"] for r in train],
            "data_source": [r["data_source"] for r in train],
        }
    )
    cycle_rewards: list[float] = []

    def text_reward(prompts, completions, ground_truth, data_source, **kwargs):
        """The reward dppo loads, on each completion's text; remembers each generation's mean."""
        scores = [
            reward.compute_score(src, c[0]["content"], gt)["score"]
            for c, gt, src in zip(completions, ground_truth, data_source)
        ]
        cycle_rewards.append(sum(scores) / len(scores))
        return scores

    spg = args.steps_per_generation
    if (PROMPTS_PER_STEP * SAMPLES) % spg:
        parser.error(
            f"--steps-per-generation {spg} must divide the {PROMPTS_PER_STEP * SAMPLES} samples of a generation"
        )
    progress = open(args.progress, "a", encoding="utf-8")

    config = GRPOConfig(
        output_dir=args.output_dir,
        seed=args.seed,
        use_cpu=True,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        per_device_train_batch_size=PROMPTS_PER_STEP * SAMPLES // spg,
        gradient_accumulation_steps=1,
        steps_per_generation=spg,
        num_generations=SAMPLES,
        num_iterations=1,
        max_steps=spg * args.steps,
        max_completion_length=reward.RESPONSE_TOKENS,
        temperature=1.0,
        learning_rate=args.lr,
        # dppo's default schedule (actor.optim, issue 32): int(5% of the global steps) of warmup from 0, then a
        # cosine down to 0.1 x lr at the last step; transformers' cosine_with_min_lr is the same curve
        lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr_rate": 0.1},
        warmup_steps=spg * int(0.05 * args.steps),
        weight_decay=0.0,
        max_grad_norm=1.0,
        epsilon=0.2,
        epsilon_high=0.2,
        delta=3.0,
        loss_type="dapo",
        beta=0.0,
        scale_rewards="group",
        logging_steps=spg,
        save_strategy="no",
        report_to="none",
        dataloader_num_workers=0,
    )
    tokenizer = AutoTokenizer.from_pretrained(task / "model")
    model = AutoModelForCausalLM.from_pretrained(task / "model", dtype=torch.float32)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=text_reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[cycle_log(progress, spg, cycle_rewards)],
    )
    trainer.train()
    progress.close()
    evaluation = evaluate(trainer.model, tokenizer, val, reward)
    with open(args.result, "w") as f:
        json.dump(
            {
                "evaluation": evaluation,
                "torch_threads": torch.get_num_threads(),
                "config": {
                    k: getattr(config, k)
                    for k in (
                        "per_device_train_batch_size",
                        "steps_per_generation",
                        "num_generations",
                        "max_steps",
                        "learning_rate",
                    )
                },
            },
            f,
            indent=2,
            default=str,
        )


def evaluate(model, tokenizer, rows: list[dict], reward) -> dict[str, float]:
    """Greedy decoding of the validation prompts in one left-padded batch, scored by the task's reward."""
    import torch

    texts = [tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False) for r in rows]
    tokenizer.padding_side = "left"
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    model.eval()
    with torch.no_grad():
        out = model.generate(
            **batch,
            max_new_tokens=reward.RESPONSE_TOKENS,
            do_sample=False,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    responses = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    scores = [
        reward.compute_score(r["data_source"], text, r["reward_model"]["ground_truth"])["score"]
        for r, text in zip(rows, responses)
    ]
    return {"eval/reward": sum(scores) / len(scores), "eval/prompts": float(len(scores))}


if __name__ == "__main__":
    main()
