"""TRL's GRPOTrainer on `make real`'s work (issue 35, point 5): the peer side of `make bench-peers-real`.

    .venv-trl/bin/python benchmarks/trl_real.py --model DIR --task FILE --seed S --progress FILE --result FILE

DIR: the imported SmolLM2-135M-Instruct (models/smollm2-135m-instruct, what `make real` trains). FILE --task: the
problems peer_real.py wrote with dppo's own generator (the training problems and the 256 held-out ones of
examples/real/smollm2_arithmetic.yaml, as data.source=reasoning_gym draws them). The reward is dppo's: the dataset's
score_answer on the answer dppo.data.reasoning_gym.extract_answer takes from the response (this script imports that
module from the checkout: PYTHONPATH holds the repository; reasoning-gym is installed in .venv-trl for it).

The settings match the real run's (peer_real.py checks them against the YAML): 8 prompts x 8 samples per generation,
2 optimizer steps on them (steps_per_generation) with the generation-time weights as the old policy, up to 12
completion tokens at temperature 1, AdamW at the YAML's constant lr (peer_real.py passes --lr: 2e-5), no warm-up, no
decay, clip 0.2/0.2 with the two-sided clip delta=3 (dppo's dual clip c=3), token-mean ("dapo"), no KL,
group-normalized advantages, and dppo's actor precision: bf16 compute over fp32 weights (TRL's bf16=True: autocast)
where dppo's actor.mixed_precision resolved to bfloat16 on this machine, fp32 where it did not (--no-bf16). What is
not matched (docs/benchmarks.md): dppo's group filter (algorithm.filter_groups: DAPO's dynamic sampling; TRL trains on
every group), the sampler (TRL's transformers `generate` in fp32; dppo's vLLM in its rollout.dtype, bf16 where auto
chose it) and the prompt order.

Held-out greedy accuracy on the 256 problems every --eval-every generation cycles and after the last, as dppo's
trainer.test_freq: one left-padded batch through `generate` (greedy, 12 tokens), on the clock as dppo's evaluation is.

FILE --progress: one JSON line per generation cycle once its optimizer steps are done: {"step", "reward" (the mean
reward of the cycle's samples), "acc" (their exact accuracy), "t" (time.time())}, with "val_acc" on the cycles that
evaluate. FILE --result: the final evaluation and the settings, as JSON.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

PROMPTS_PER_STEP = 8  # trainer.train_batch_size
SAMPLES = 8  # rollout.n
RESPONSE_TOKENS = 12  # data.max_response_length


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--task", required=True, help="the problems (JSON) peer_real.py wrote")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--progress", required=True)
    parser.add_argument("--result", required=True)
    parser.add_argument("--steps", type=int, default=20, help="generation cycles (global steps)")
    parser.add_argument("--steps-per-generation", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--eval-every", type=int, default=2, help="held-out evaluation every N cycles")
    parser.add_argument("--output-dir", default="/tmp/trl_real")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's, the cores)")
    parser.add_argument(
        "--bf16",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="bf16 compute over fp32 weights (TRL's bf16=True); peer_real.py passes dppo's actor.mixed_precision",
    )
    args = parser.parse_args(argv)

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from dppo.data.reasoning_gym import ReasoningGymScore  # the checkout's (PYTHONPATH)

    task = json.loads(Path(args.task).read_text())
    score = ReasoningGymScore(task["dataset"], task["config"])
    train, val = task["train"], task["val"]
    dataset = Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": row["prompt"]}] for row in train],
            "ground_truth": [row["answer"] for row in train],
            "entry": [row["entry"] for row in train],
        }
    )
    cycle: dict[str, list[float]] = {"reward": [], "acc": []}

    def real_reward(prompts, completions, ground_truth, entry, **kwargs):
        """dppo's reward on each completion's text; remembers each generation's mean reward and exact accuracy."""
        results = [
            score(task["dataset"], c[0]["content"], gt, json.loads(e))
            for c, gt, e in zip(completions, ground_truth, entry)
        ]
        cycle["reward"].append(sum(r["score"] for r in results) / len(results))
        cycle["acc"].append(sum(r["acc"] for r in results) / len(results))
        return [r["score"] for r in results]

    spg = args.steps_per_generation
    if (PROMPTS_PER_STEP * SAMPLES) % spg:
        parser.error(
            f"--steps-per-generation {spg} must divide the {PROMPTS_PER_STEP * SAMPLES} samples of a generation"
        )
    config = GRPOConfig(
        output_dir=args.output_dir,
        seed=args.seed,
        use_cpu=True,
        bf16=args.bf16,
        fp16=False,
        gradient_checkpointing=False,
        per_device_train_batch_size=PROMPTS_PER_STEP * SAMPLES // spg,
        gradient_accumulation_steps=1,
        steps_per_generation=spg,
        num_generations=SAMPLES,
        num_iterations=1,
        max_steps=spg * args.steps,
        max_completion_length=RESPONSE_TOKENS,
        temperature=1.0,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
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
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    with open(args.progress, "a", encoding="utf-8") as progress:

        class CycleLog(TrainerCallback):
            """A progress line when a cycle's last optimizer step ends, with a held-out evaluation every eval_every."""

            def on_step_end(self, training_args, state, control, model=None, **kwargs):
                if state.global_step % spg:
                    return
                step = state.global_step // spg
                line = {"step": step, "reward": cycle["reward"][step - 1], "acc": cycle["acc"][step - 1]}
                if step % args.eval_every == 0 or step == args.steps:
                    line["val_acc"] = evaluate(model, tokenizer, val, score, task["dataset"])["acc"]
                    model.train()
                line["t"] = time.time()
                progress.write(json.dumps(line) + "\n")
                progress.flush()

        trainer = GRPOTrainer(
            model=model,
            reward_funcs=real_reward,
            args=config,
            train_dataset=dataset,
            processing_class=tokenizer,
            callbacks=[CycleLog()],
        )
        trainer.train()
    final = evaluate(trainer.model, tokenizer, val, score, task["dataset"])
    keys = (
        "per_device_train_batch_size",
        "steps_per_generation",
        "num_generations",
        "max_steps",
        "learning_rate",
        "bf16",
    )
    result = {
        "evaluation": final,
        "torch_threads": torch.get_num_threads(),
        "config": {k: getattr(config, k) for k in keys},
    }
    Path(args.result).write_text(json.dumps(result, indent=2, default=str))


def evaluate(model, tokenizer, rows: list[dict], score, dataset: str) -> dict[str, float]:
    """Greedy decoding of the held-out problems in one left-padded batch through the chat template, scored by dppo's
    reward: {"acc": exact accuracy, "score": the mean verifier score, "prompts"}."""
    import torch

    messages = [[{"role": "user", "content": row["prompt"]}] for row in rows]
    texts = [tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in messages]
    tokenizer.padding_side = "left"
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    model.eval()
    with torch.no_grad():
        out = model.generate(
            **batch,
            max_new_tokens=RESPONSE_TOKENS,
            do_sample=False,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    responses = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    results = [score(dataset, text, row["answer"], json.loads(row["entry"])) for row, text in zip(rows, responses)]
    n = len(results)
    return {"acc": sum(r["acc"] for r in results) / n, "score": sum(r["score"] for r in results) / n, "prompts": n}


if __name__ == "__main__":
    main()
