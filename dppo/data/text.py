"""Text data (data.train_files): verl-format parquet prompts through the model's tokenizer and chat template.

Every row's messages go through tokenizer.apply_chat_template(..., add_generation_prompt=True) and are
tokenized once, on the driver, before any Ray process starts, so a bad file, a missing column, a prompt that
is too long or a tokenizer without a chat template fails at once with one line naming it. Rollout workers
get the tokenized rows and the tokenizer with the source object; they decode each response (special tokens
skipped, as verl does) and score it with the reward function.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from dppo._text import one_line
from dppo.data.errors import DataRowError, PromptTooLongError, TokenizerError
from dppo.data.parquet import ParquetRows, read_parquet_files
from dppo.data.rewards import RewardFunction, RewardRow, score_texts
from dppo.data.source import Prompts, PromptSource, Scores

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
TRUNCATIONS = ("error", "left", "right")


def load_tokenizer(model_path: str, chat_template: bool = True):
    """AutoTokenizer of model_path; TokenizerError if it has none, no EOS token, or (chat_template) no chat
    template."""
    from transformers import AutoTokenizer  # heavy; only a run on text data loads a tokenizer

    if not any(os.path.isfile(os.path.join(model_path, name)) for name in TOKENIZER_FILES):
        raise TokenizerError(
            f"model.path={model_path!r} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}); "
            f"save one there with tokenizer.save_pretrained({model_path!r})"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
    except Exception as err:  # transformers raises many kinds here; all mean the same to the user
        raise TokenizerError(
            f"model.path={model_path!r}: AutoTokenizer cannot load its tokenizer ({type(err).__name__}: {one_line(err, None)})"
        ) from err
    if chat_template and not has_chat_template(tokenizer):
        raise TokenizerError(
            f"the tokenizer in model.path={model_path!r} has no chat template (chat_template in "
            "tokenizer_config.json or chat_template.jinja); set tokenizer.chat_template and save it "
            "with save_pretrained"
        )
    if tokenizer.eos_token_id is None:
        raise TokenizerError(f"the tokenizer in model.path={model_path!r} has no eos_token: responses could not end")
    return tokenizer


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


@dataclass
class TextRows:
    """Tokenized prompts and what the reward function is told about each row."""

    prompt_ids: list[np.ndarray]  # (P_i,) int64 each: the chat-templated prompt
    reward_rows: list[RewardRow]

    def __len__(self) -> int:
        return len(self.prompt_ids)

    def prompts(self, rows) -> Prompts:
        return Prompts([self.prompt_ids[i] for i in rows], [self.reward_rows[i] for i in rows])

    def max_id(self) -> int:
        """The largest token id of any prompt (-1 if there are none)."""
        return max((int(ids.max()) for ids in self.prompt_ids if len(ids)), default=-1)


def tokenize_rows(
    tokenizer, rows: ParquetRows, max_prompt_length: int, truncation: str, chat_template: bool = True
) -> TextRows:
    """Chat template with the generation prompt (chat_template=False: the messages' contents as plain text), then
    tokens (no special tokens added on top, as verl does); a prompt longer than max_prompt_length is cut on the
    left or right, or a PromptTooLongError (truncation)."""
    if truncation not in TRUNCATIONS:
        raise ValueError(f"data.truncation={truncation!r}: expected one of {', '.join(TRUNCATIONS)}")
    texts = []
    for i, messages in enumerate(rows.messages):
        if not chat_template:
            texts.append("\n".join(message["content"] for message in messages))
            continue
        try:
            texts.append(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
        except Exception as err:  # a jinja template error, or a role the template rejects
            raise DataRowError(
                f"{rows.where(i)}: the tokenizer's chat template fails on its prompt ({type(err).__name__}: {one_line(err, None)})"
            ) from err
    prompt_ids = []
    for i, ids in enumerate(tokenizer(texts, add_special_tokens=False)["input_ids"]):
        if len(ids) > max_prompt_length:
            if truncation == "error":
                raise PromptTooLongError(
                    f"{rows.where(i)}: its prompt is {len(ids)} tokens after the chat template, more than "
                    f"data.max_prompt_length={max_prompt_length} (data.truncation=error); raise data.max_prompt_length "
                    "or set data.truncation=left or right"
                )
            ids = ids[-max_prompt_length:] if truncation == "left" else ids[:max_prompt_length]
        prompt_ids.append(np.asarray(ids, dtype=np.int64))
    reward_rows = [
        RewardRow(rows.data_source[i], rows.ground_truth[i], rows.extra_info[i], rows.where(i), tuple(rows.messages[i]))
        for i in range(len(rows))
    ]
    return TextRows(prompt_ids, reward_rows)


class EpochSampler:
    """Row indices of one worker, epoch after epoch.

    Epoch e is a permutation of all rows (seeded by seed and e when shuffle, else in file order); worker w of
    W takes its rows w, w + W, ... of it, so the workers together see every row once per epoch. start skips
    that many of this worker's rows (a resumed run continues near where the checkpoint left off).
    """

    def __init__(
        self, num_rows: int, shuffle: bool, seed: int, worker_index: int = 0, num_workers: int = 1, start: int = 0
    ):
        self.num_rows, self.shuffle, self.seed = num_rows, shuffle, seed
        # a worker beyond the row count reads the whole epoch rather than nothing
        self.shard = (worker_index, num_workers) if worker_index < num_rows else (0, 1)
        self.per_epoch = len(range(self.shard[0], num_rows, self.shard[1]))  # this worker's rows per epoch
        self.position = start  # rows this worker has taken, over all epochs
        self._epoch, self._order = -1, np.zeros(0, dtype=np.int64)

    def _rows_of_epoch(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            if self.shuffle:
                order = np.random.default_rng([self.seed, epoch]).permutation(self.num_rows)
            else:
                order = np.arange(self.num_rows)
            first, step = self.shard
            self._epoch, self._order = epoch, order[first::step]
        return self._order

    def next_rows(self, num: int) -> np.ndarray:
        """The next num row indices of this worker (crossing into the next epoch where one ends)."""
        taken: list[np.ndarray] = []
        while num > 0:
            epoch, offset = divmod(self.position, self.per_epoch)
            part = self._rows_of_epoch(epoch)[offset : offset + num]
            taken.append(part)
            self.position += len(part)
            num -= len(part)
        return np.concatenate(taken) if taken else np.zeros(0, dtype=np.int64)


class _TextPrompts:
    def __init__(self, rows: TextRows, order: EpochSampler):
        self.rows, self.order = rows, order

    def start_ticket(self, first: int, prompt_seed: int) -> None:
        """The k-th granted group of the run takes the k-th row of the epoch order: every row once per epoch,
        whichever worker generates it, and a resumed run goes on where it stopped."""
        self.order.position = first

    def sample(self, num: int) -> Prompts:
        return self.rows.prompts(self.order.next_rows(num))


class TextSource(PromptSource):
    """Prompts from parquet rows, scored by a verl-signature reward function on the decoded responses."""

    def __init__(
        self,
        tokenizer,
        train: TextRows,
        val: TextRows | None,
        reward: RewardFunction,
        response_length: int,
        shuffle: bool = True,
        seed: int = 0,
        groups_per_step: int = 1,
    ):
        self.tokenizer, self.train, self.val, self.reward = tokenizer, train, val, reward
        self.eos_token = tokenizer.eos_token_id
        self.pad_token = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_token
        # the ids that can reach the model: the prompts', the pad and the EOS (generated ones are the model's own);
        # a tokenizer's unused added tokens past the model's vocab do not matter
        self.vocab_size = max(self.pad_token, self.eos_token, *(rows.max_id() for rows in (train, val) if rows)) + 1
        self.response_length = response_length
        self.prompt_length = max(len(ids) for rows in (train, val) if rows is not None for ids in rows.prompt_ids)
        self.shuffle, self.seed, self.groups_per_step = shuffle, seed, groups_per_step
        # rollout.agent: the agent function (dppo.data.user_code.FileFunction) that makes a row's responses and returns
        # their rewards in place of the reward function (dppo.workers.rollout.agent); None: one response per prompt
        self.agent = None

    @classmethod
    def from_config(cls, data, model_path: str, reward_cfg, seed: int, batch_size: int) -> TextSource:
        """data: the config's data section; reward_cfg its custom_reward_function; seed: trainer.seed (data.seed
        overrides it for the shuffle); batch_size: trainer.train_batch_size (groups a step draws)."""
        tokenizer = load_tokenizer(model_path)
        reward = RewardFunction(reward_cfg.path, reward_cfg.name, reward_cfg.timeout_s)

        def load(files) -> TextRows:
            rows = read_parquet_files(files, data.prompt_key)
            return tokenize_rows(tokenizer, rows, data.max_prompt_length, data.truncation)

        train = load(data.train_files)
        val = load(data.val_files) if data.val_files is not None else None
        return cls._from_rows(data, model_path, tokenizer, train, val, reward, seed, batch_size)

    @classmethod
    def _from_rows(
        cls, data, model_path: str, tokenizer, train: TextRows, val: TextRows | None, reward, seed: int, batch_size: int
    ) -> TextSource:
        """The source of from_config (a subclass's too) once its rows and reward are made: data's response length and
        shuffle, shuffled at data.seed or else seed (trainer.seed), batch_size groups a step, and checked against
        model_path's vocabulary (check_model_vocab)."""
        source = cls(
            tokenizer,
            train,
            val,
            reward,
            data.max_response_length,
            data.shuffle,
            seed if data.seed is None else data.seed,
            batch_size,
        )
        source.check_model_vocab(model_path)
        return source

    def check_model_vocab(self, model_path: str) -> None:
        """TokenizerError naming the tokens and both sizes if an id that can reach the model (a prompt's, the pad,
        the EOS) lies past model_path's vocab_size: one line before any Ray process starts."""
        from transformers import AutoConfig

        model_vocab = AutoConfig.from_pretrained(model_path, local_files_only=True).vocab_size
        if self.vocab_size <= model_vocab:
            return
        past = {}
        for role, token in (("the pad token", self.pad_token), ("the EOS token", self.eos_token)):
            if token >= model_vocab:
                past.setdefault(token, role)
        for rows in (self.train, self.val):
            for ids, row in zip(rows.prompt_ids if rows else [], rows.reward_rows if rows else []):
                for token in ids[ids >= model_vocab].tolist():
                    past.setdefault(token, f"the prompt of {row.where}")
        named = "; ".join(
            f"{self.tokenizer.convert_ids_to_tokens(token)!r} (id {token}, {where})"
            for token, where in sorted(past.items())[:5]
        )
        raise TokenizerError(
            f"the tokenizer in model.path={model_path!r} has {len(self.tokenizer)} tokens and the "
            f"model's vocab_size is {model_vocab}; {len(past)} id(s) the model would be given lie past "
            f"it: {named}"
        )

    def sampler(self, seed) -> _TextPrompts:
        return _TextPrompts(self.train, EpochSampler(len(self.train), self.shuffle, self.seed))

    def decode(self, responses: np.ndarray, response_mask: np.ndarray) -> list[str]:
        """The responses' valid tokens as text, special tokens (the EOS) left out."""
        rows = [row[mask.astype(bool)].tolist() for row, mask in zip(responses, response_mask)]
        return self.tokenizer.batch_decode(rows, skip_special_tokens=True)

    def score(self, prompts: Prompts, responses: np.ndarray, response_mask: np.ndarray) -> Scores:
        scores, extra = score_texts(self.reward, prompts.meta, self.decode(responses, response_mask))
        return Scores(scores, extra)

    def eval_prompts(self) -> Prompts:
        return self.val.prompts(range(len(self.val))) if self.val is not None else Prompts([], [])

    def eval_metrics(self, prompts: Prompts, scores: Scores) -> dict[str, float]:
        """val/score/<data_source>: the mean score of each data source's rows; val/<key>/<data_source>: the mean of
        each numeric extra the reward function returned (verl's val-core/<data_source>/<key>), over the rows that
        have it (reasoning-gym verifiers's acc: the fraction answered exactly)."""
        rows_of: dict[str, list[int]] = {}
        for i, row in enumerate(prompts.meta):
            rows_of.setdefault(row.data_source, []).append(i)
        metrics = {}
        for source, rows in sorted(rows_of.items()):
            metrics[f"val/score/{source}"] = float(np.mean(scores.scores[rows]))
            for key, values in sorted(scores.extra.items()):
                present = values[rows][~np.isnan(values[rows])]
                if len(present):
                    metrics[f"val/{key}/{source}"] = float(present.mean())
        return metrics
