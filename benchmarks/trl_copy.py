"""TRL's GRPOTrainer on dppo's demo work: the peer side of benchmarks/peer_bench.py (run in .venv-trl).

    .venv-trl/bin/python benchmarks/trl_copy.py --model DIR --seed S --progress FILE --result FILE

The same work as `dppo train` with its defaults (dppo.config's train.yaml): the copy task of 5 digits with
dppo's own reward (dppo.tasks, imported from this tree: it needs numpy only), the policy loaded from DIR (the
tiny Qwen2 that peer_bench.py built with dppo.models.build_model and saved), 128 prompts x 8 samples per
generation, 4 optimizer steps of 32 prompts x 8 samples per generation with the generation-time weights as the
old policy, AdamW lr 1e-3 constant, clip 0.2/0.2 and TRL's two-sided clip delta=3 (the same loss as dppo's dual
clip c=3), token-mean (TRL's "dapo"), no KL, fp32, 60 generations (240 optimizer steps); then greedy decoding of
dppo's 256 held-out evaluation prompts, as `dppo train` ends. docs/benchmarks.md lists every difference left.

FILE --progress: one JSON line per generation cycle once its 4 optimizer steps are done (the moment dppo writes
a global step's metrics line): {"step", "reward" (the mean reward of the cycle's 1024 samples), "t" (time.time())}.
FILE --result: the evaluation and the run's settings, as JSON.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from dppo.tasks import BOS_TOKEN, NUM_DIGITS, SEP_TOKEN, PromptSampler, held_out_prompts, make_task

TASK_LENGTH = 5  # task.length
PROMPTS_PER_STEP = 128  # trainer.train_batch_size
SAMPLES = 8  # rollout.n
STEPS_PER_GENERATION = 4  # trainer.parameter_sync_step
GLOBAL_STEPS = 60  # trainer.total_steps
EVAL_PROMPTS = 256  # trainer.eval_prompts
EOS_PAD_TOKEN = 12  # a token id the 12-token model can never emit: TRL needs an EOS and a pad token; none is used
_PROMPT_STREAM = 0x7E1  # the training prompts' random stream (dppo's own stream is private to its rollout workers)

TOKENS = {**{str(d): d for d in range(NUM_DIGITS)}, "<bos>": BOS_TOKEN, "<sep>": SEP_TOKEN, "<eos>": EOS_PAD_TOKEN}
NAMES = {i: t for t, i in TOKENS.items()}


def make_tokenizer():
    """A word-level tokenizer over dppo's 12 task tokens (ids as dppo's task uses them) plus <eos>/<pad>."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel(vocab=TOKENS, unk_token="<eos>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", pad_token="<eos>", unk_token="<eos>")


def prompt_text(ids: np.ndarray) -> str:
    return " ".join(NAMES[int(i)] for i in ids)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--progress", required=True)
    parser.add_argument("--result", required=True)
    parser.add_argument("--steps", type=int, default=GLOBAL_STEPS, help="generation cycles (global steps)")
    parser.add_argument("--output-dir", default="/tmp/trl_copy")
    parser.add_argument(
        "--steps-per-generation",
        type=int,
        default=STEPS_PER_GENERATION,
        help="optimizer steps per generation (dppo's trainer.parameter_sync_step)",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's, the cores)")
    args = parser.parse_args(argv)

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    task = make_task("copy", TASK_LENGTH)
    held_out = held_out_prompts(task, args.seed, EVAL_PROMPTS)  # dppo's evaluation set of this seed
    train_ids = PromptSampler(task, [args.seed, _PROMPT_STREAM], held_out).sample(PROMPTS_PER_STEP * args.steps)
    dataset = Dataset.from_dict({"prompt": [prompt_text(row) for row in train_ids], "prompt_ids": train_ids.tolist()})

    cycle_rewards: list[float] = []

    def copy_reward(prompts, completions, completion_ids, prompt_ids, **kwargs):
        """dppo's reward (dppo.tasks) on the token ids; remembers each generation's mean reward."""
        width = max(len(c) for c in completion_ids)
        responses = np.zeros((len(completion_ids), width), dtype=np.int64)
        mask = np.zeros_like(responses)
        for i, ids in enumerate(completion_ids):
            responses[i, : len(ids)], mask[i, : len(ids)] = ids, 1
        scores = task.rewards(np.asarray(prompt_ids, dtype=np.int64), responses, mask)
        cycle_rewards.append(float(scores.mean()))
        return scores.tolist()

    progress = open(args.progress, "a", encoding="utf-8")
    spg = args.steps_per_generation
    if (PROMPTS_PER_STEP * SAMPLES) % spg or PROMPTS_PER_STEP % spg:
        parser.error(f"--steps-per-generation {spg} must divide the {PROMPTS_PER_STEP} prompts of a generation")

    config = GRPOConfig(
        output_dir=args.output_dir,
        seed=args.seed,
        use_cpu=True,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        per_device_train_batch_size=PROMPTS_PER_STEP * SAMPLES // spg,  # 256 completions a step (spg 4)
        gradient_accumulation_steps=1,
        steps_per_generation=spg,  # 1024 completions generated at once, spg optimizer steps on them
        num_generations=SAMPLES,
        num_iterations=1,
        max_steps=spg * args.steps,
        max_completion_length=TASK_LENGTH,
        temperature=1.0,
        learning_rate=1e-3,
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
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=copy_reward,
        args=config,
        train_dataset=dataset,
        processing_class=make_tokenizer(),
        callbacks=[cycle_log(progress, spg, cycle_rewards)],
    )
    trainer.train()
    progress.close()
    evaluation = evaluate(trainer.model, task, held_out)
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
                        "optim",
                    )
                },
            },
            f,
            indent=2,
            default=str,
        )


def cycle_log(progress, spg: int, cycle_rewards: list[float]):
    """A TrainerCallback writing a progress line per generation cycle ({"step", "reward": the cycle's mean reward from
    cycle_rewards, "t"}) when the cycle's last of spg optimizer steps ends. Shared with trl_text.py."""
    from transformers import TrainerCallback

    class CycleLog(TrainerCallback):
        def on_step_end(self, training_args, state, control, **kwargs):
            if state.global_step % spg == 0:
                step = state.global_step // spg
                progress.write(json.dumps({"step": step, "reward": cycle_rewards[step - 1], "t": time.time()}) + "\n")
                progress.flush()

    return CycleLog()


def evaluate(model, task, held_out: np.ndarray) -> dict[str, float]:
    """Greedy decoding of the held-out prompts (one batch, as dppo's evaluation), scored by dppo's reward."""
    import torch

    model.eval()
    with torch.no_grad():
        out = model.generate(
            torch.from_numpy(held_out),
            attention_mask=torch.ones_like(torch.from_numpy(held_out)),
            max_new_tokens=TASK_LENGTH,
            do_sample=False,
            eos_token_id=EOS_PAD_TOKEN,
            pad_token_id=EOS_PAD_TOKEN,
            use_cache=True,
        )
    responses = out[:, held_out.shape[1] :].numpy()
    scores = task.rewards(held_out, responses, np.ones_like(responses))
    return {
        "eval/reward": float(scores.mean()),
        "eval/accuracy": float((scores >= 1.0).mean()),
        "eval/prompts": float(len(scores)),
    }


if __name__ == "__main__":
    main()
