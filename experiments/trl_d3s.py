"""
D3S inside TRL's GRPOTrainer: the same method as train.py, for runs that outgrow one GPU.
experiments/trl.md tells the whole story: commands, logs, what is checked and what was never run.

    # one GPU: train.py's real-model step, 32 prompts x 8 = 256 rollouts, in 4 micro-batches
    python experiments/trl_d3s.py --model Qwen/Qwen2.5-0.5B --dataset gsm8k \
        --output_dir out/trl-d3s-Qwen2.5-0.5B --max_steps 200 --per_device_train_batch_size 64 \
        --gradient_accumulation_steps 4 --num_generations 8 --max_completion_length 512 \
        --learning_rate 1e-6 --lr_scheduler_type constant --logging_steps 1
    # 8 GPUs: the same 256 rollouts a step, 32 per process, one micro-batch each
    accelerate launch --num_processes 8 experiments/trl_d3s.py --model Qwen/Qwen2.5-0.5B \
        --dataset gsm8k --output_dir out/trl-d3s-Qwen2.5-0.5B --max_steps 200 \
        --per_device_train_batch_size 32 --gradient_accumulation_steps 1 --num_generations 8 \
        --max_completion_length 512 --learning_rate 1e-6 --lr_scheduler_type constant \
        --logging_steps 1
    # the offline tiny world on a CPU, to try it out (builds out/tiny once, like train.py)
    python experiments/trl_d3s.py --model tiny --dataset tiny --output_dir out/trl-d3s-tiny \
        --use_cpu true --bf16 false --max_steps 20 --per_device_train_batch_size 128 \
        --num_generations 8 --max_completion_length 32 --learning_rate 1e-4 \
        --lr_scheduler_type constant --logging_steps 1 --gradient_checkpointing false

Every flag of TRL's GRPOConfig works (DeepSpeed, vLLM, GSPO through --importance_sampling_level
sequence, ...), plus the D3S knobs under train.py's names and defaults: --method (a name of
d3s.METHODS), --s_init --s_final --t_init --t_final. As in train.py, a ratio the method ignores is
refused (--method grpo --s_init 0.5: one line on stderr, exit code 2). [ours] --disable_dropout
defaults to true (TRL: false), as train.py: with dropout the first mini-batch's ratio is not 1. The
math is d3s.py's; this file only wires it into TRL's step.

TRL's step, and what D3STrainer changes in it (docs/algorithm.md numbers the steps):
    TRL generates a generation batch of B = per_device_train_batch_size x processes x
    steps_per_generation rollouts, grades them with the reward function (here reward.grade) and
    computes group advantages (steps 1-3). Each process holds its own contiguous rows of the batch.
  4. _down_sample gathers the whole batch onto every process and picks the kept rollouts once with
     d3s.select_samples, pooled over all processes (cross-group selection sees every group), then
     deals them out again in near-equal contiguous shares. Dropped rollouts are in no micro-batch,
     so they never reach the gradient forward.
  5. A no-grad forward of each process's kept rollouts gives the entropy H of every completion token
     (softmax(logits / T), TRL's own fused LM head).
  6. The scores |A| * H (d3s.token_scores) of every process are gathered and d3s.select_tokens keeps
     the top rho_t of them, pooled over all kept tokens of the step, as docs/algorithm.md says.
  7. TRL's own loss runs on each micro-batch. The kept tokens become its loss mask (tool_mask: the
     loss uses completion_mask * tool_mask, the attention completion_mask alone), and the step's
     kept-token count becomes the divisor of loss_type="dapo": the sum over kept tokens / kept
     tokens of the step, train.py's --divisor kept, for every method and loss (train.py's defaults
     differ for --method entropy, valid, and --loss gspo, seq). GRPO and GSPO are TRL's
     (--importance_sampling_level token | sequence).
The random controls (d3s-random, d1s-cross-random) draw from torch's global generator, which TRL
seeds with --seed (train.py: the step's own generator), and skip the port's entropy pass.
The schedule (d3s.keep_ratios) reads TRL's global step when the batch is generated, and max_steps;
d3s.applied_ratios turns its values into the ratios the method applies (1 where it keeps every
rollout or token, the 80/20 baseline's fixed 0.2 of tokens), as train.py does.
Each step adds d3s/* metrics to TRL's log (so to wandb, tensorboard, ...), named as train.py's
log.jsonl: rho_s and rho_t (as applied), rollouts, kept, valid (tokens of the kept rollouts),
tokens (kept), var_adv and var_kept (d3s.population_variance of A, all rollouts -> kept ones),
entropy (with token selection: mean H over the valid tokens of the kept rollouts), fillers (below).

Every process must make the same forward/backward calls with the same row counts (DDP and ZeRO
reduce gradients in lockstep, ZeRO-3 gathers parameters per forward, TRL gathers per-row metrics),
but selection keeps different numbers of rollouts from different processes. So each process gets
R = max(ceil(N / processes), steps_per_generation) rows: its share of the N kept rollouts, topped up
with filler rows (a copy of a kept rollout with an empty completion mask and advantage 0: no loss,
no gradient, no token counted). That is at most processes - 1 fillers in all, unless fewer than
processes x steps_per_generation rollouts are kept: then every process is topped up to
steps_per_generation rows, so that no micro-batch is ever empty. Every process shuffles its R rows
(as TRL does) and splits them into steps_per_generation micro-batches of the same sizes.

What is not the same as train.py:
  - Advantages are TRL's: (r - mean) / (std + 1e-4), not + 1e-6 (PODS's re-normalisation is
    d3s.py's, with 1e-6). With 0/1 rewards in groups of 8 the std is at least 0.35 when it is not 0,
    so A differs by under 0.03%.
  - The token scores come from an extra no-grad forward of the kept rollouts at every step with
    token selection. train.py needs none: its entropy comes from the gradient forward (one
    micro-batch), the sampler (several), or the no-grad pass that K > 1 needs for logp_old anyway.
  - GSPO's sequence ratio averages log(pi / pi_old) over the kept tokens (TRL averages over its loss
    mask), train.py's over all valid tokens of the rollout. On-policy (num_iterations 1 and
    steps_per_generation = gradient_accumulation_steps, TRL's default) every ratio is 1 and the
    gradient is exactly train.py's GSPO-token gradient under --divisor kept (train.py's --loss gspo
    defaults to seq, the GSPO paper's mean per sequence); the two part ways only off-policy. TRL's
    warning that 'dapo' with sequence-level ratios weights sequences by length is expected: that is
    the kept-token mean of docs/algorithm.md.
  - GSPO's clip range is TRL's --epsilon / --epsilon_high, 0.2 unless given; train.py's --loss gspo
    defaults to GSPO's 3e-4 / 4e-4. Pass them. (On-policy the clip never acts.)
  - Only loss_type="dapo" (TRL's default) is accepted: its divisor is the step's token count, which
    D3STrainer sets to the kept tokens. TRL's other aggregations average per sequence or per
    micro-batch, which filler rows and the kept subset would change.
  - TRL's own `entropy` metric averages over its loss mask, the kept tokens; d3s/entropy is
    train.py's.
  - With --use_vllm, vLLM loads the model from its files, blind to the stop ids set in memory:
    main passes them (<|im_end|> and the eos ids) as SamplingParams' stop_token_ids, through
    GRPOConfig's generation_kwargs. vLLM itself was never run here.
  - The commands above run one update per rollout batch (K = 1: steps_per_generation =
    gradient_accumulation_steps, num_iterations 1); train.py runs K = 4. TRL's --num_iterations 4
    would make four updates each on the whole batch, not one on each of four mini-batches.
  - TRL's own no-grad passes that run before rewards exist (old log-probs for vLLM's importance
    correction or num_iterations > 1, reference log-probs when beta > 0) still see every rollout.
  - Prompts come in TRL's order (its sampler, shuffled with --seed), not train.py's; there is no
    held-out accuracy during training (eval.py reads the saved folder); TRL's eval_strategy computes
    the plain GRPO loss on every rollout. Text-only models only.
"""
import os
import sys
from dataclasses import dataclass, field, fields
from typing import Optional

import torch
from accelerate.utils import broadcast
from datasets import Dataset
from transformers import HfArgumentParser
from trl import GRPOConfig, GRPOTrainer
from trl.models.utils import disable_gradient_checkpointing
from trl.trainer.utils import shuffle_sequence_dict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root
import d3s  # noqa: E402
from machinery.data import format_prompt, load_problems
from machinery.model import disable_dropout, load_model
from reward import grade
from rollout import stop_token_ids

# The per-rollout tensors of TRL's scored batch (text-only): left-padded prompt columns,
# right-padded completion columns, one value per rollout. Anything else (images, ...) is refused.
PROMPT_KEYS = ("prompt_ids", "prompt_mask")
COMPLETION_KEYS = ("completion_ids", "completion_mask", "tool_mask", "old_per_token_logps",
                   "sampling_per_token_logps", "ref_per_token_logps", "importance_sampling_ratio")
ROW_KEYS = ("advantages", "rollout_index")
# the schedule's four keep ratios, train.py's knobs
RATIOS = ("s_init", "s_final", "t_init", "t_final")

# -----------------------------------------------------------------------------
# config: TRL's GRPOConfig plus the D3S knobs, under train.py's names and with its defaults


@dataclass
class D3SConfig(GRPOConfig):
    method: str = field(default="d3s", metadata={
        "help": "grpo | pods | d1s | d1s-cross | d2s | d3s | d3s-i | entropy | d3s-random | "
                "d1s-cross-random (d3s.METHODS, the named methods of docs/algorithm.md)"})
    s_init: float = field(default=0.25, metadata={
        "help": "rho_s at the first step: share of rollouts kept [ours]"})
    s_final: float = field(default=0.75, metadata={"help": "rho_s at the last step [ours]"})
    t_init: float = field(default=0.2, metadata={
        "help": "rho_t at the first step: share of kept rollouts' tokens kept [ours]"})
    t_final: float = field(default=0.6, metadata={"help": "rho_t at the last step [ours]"})
    # [ours] TRL's default is False. With dropout the first mini-batch's ratio is not 1 and one seed
    # gives two runs (docs/algorithm.md, "No dropout"): off, as in train.py
    disable_dropout: bool = field(default=True, metadata={
        "help": "no dropout in the policy, as train.py"})

    def __post_init__(self):
        super().__post_init__()
        if self.method not in d3s.METHODS:
            raise ValueError(f"method {self.method!r} is unknown; choose one of "
                             f"{', '.join(d3s.METHODS)}")
        for name in RATIOS:
            value = getattr(self, name)
            if not (0 < value <= 1):
                raise ValueError(f"{name} must be in (0, 1], got {value}")
        # A ratio the method ignores is refused, as train.py refuses it: set to other than its
        # default, yet the method trains with the same ratios as with the default (grpo and s_init,
        # say).
        applied = self.applied_ratios()
        for f in fields(D3SConfig):
            if f.name in RATIOS and getattr(self, f.name) != f.default and \
                    self.applied_ratios(**{f.name: f.default}) == applied:
                raise ValueError(f"{f.name} {getattr(self, f.name)} does not apply to method "
                                 f"{self.method!r}: it trains with (rho_s, rho_t) {applied[0]} at "
                                 f"the first step and {applied[1]} at the last, whatever {f.name} "
                                 "is; leave it out")
        if self.loss_type != "dapo":
            raise ValueError(f"loss_type {self.loss_type!r} is not supported with D3S; use 'dapo' "
                             "(the default): the loss is the sum over kept tokens / the step's "
                             "kept tokens, as in train.py")
        if self.top_entropy_quantile != 1.0:
            raise ValueError("top_entropy_quantile is TRL's own 80/20 token mask; use "
                             "method='entropy' (the same baseline, pooled over the step) and leave "
                             "top_entropy_quantile at 1.0")

    def applied_ratios(self, **ratios):
        """[(rho_s, rho_t) at the first step, at the last step] as the method applies them
        (d3s.keep_ratios, then d3s.applied_ratios), for this config's ratios or those given."""
        r = {**{name: getattr(self, name) for name in RATIOS}, **ratios}
        schedule = d3s.METHODS[self.method]["schedule"]
        return [d3s.applied_ratios(self.method,
                                   *d3s.keep_ratios(step, 2, schedule, **r)) for step in (0, 1)]

# -----------------------------------------------------------------------------
# moving rows between processes: pure functions of tensors and an accelerate.Accelerator


def gather_batch(local, accelerator, pad_id):
    """Every process's rows of TRL's scored batch, in process order (TRL's global order: groups are
    contiguous), padded to common widths. local: dict of per-rollout tensors -> dict of (B, ...)."""
    batch = {}
    for key, t in local.items():  # TRL builds the dict in the same key order on every process
        if key == "num_items_in_batch":
            continue
        pad = pad_id if key.endswith("_ids") else 0
        t = accelerator.pad_across_processes(t, dim=1, pad_index=pad, pad_first=key in PROMPT_KEYS)
        batch[key] = accelerator.gather(t)
    return batch


def process_shares(num_kept, num_processes, steps):
    """For each process, the positions in the kept list of the rows it trains on: contiguous shares
    whose sizes differ by at most 1, each topped up with -1 (a filler row) to the same length
    R = max(ceil(num_kept / num_processes), steps), so every micro-batch of every process has a
    row."""
    rows = max(-(-num_kept // num_processes), steps)
    return [torch.cat([share, torch.full((rows - len(share),), -1, dtype=torch.long)])
            for share in torch.arange(num_kept).tensor_split(num_processes)]


def trim(part):
    """Drop the prompt columns that are padding in every row and the completion columns after the
    last real token (keeping at least one), so a short batch is not as wide as the longest one."""
    first = int(part["prompt_mask"].any(dim=0).long().argmax())
    real = part["completion_mask"].any(dim=0)
    width = int(real.nonzero().max()) + 1 if real.any() else 1
    out = {}
    for key, t in part.items():
        if key in PROMPT_KEYS:
            t = t[:, first:]
        elif key in COMPLETION_KEYS and t.size(1) > 1:  # importance_sampling_ratio may be (b, 1)
            t = t[:, :width]
        out[key] = t
    return out


def take_rows(batch, index, advantages, share):
    """This process's rows: share holds positions into index (the kept rollouts, (N,)), -1 for a
    filler. A filler copies the first kept rollout with an empty completion mask and advantage 0."""
    share = share.to(index.device)
    real, pos = share >= 0, share.clamp(min=0)
    rows = index[pos]
    part = {key: t[rows] for key, t in batch.items()}
    mask = part["completion_mask"]
    part["completion_mask"] = mask * real[:, None].to(mask.dtype)
    part["advantages"] = torch.where(real, advantages[pos], torch.zeros_like(advantages[pos]))
    part["rollout_index"] = torch.where(real, rows, torch.full_like(rows, -1))  # -1: a filler
    return trim(part)


def split_micro_batches(part, steps):
    """steps micro-batches of near-equal size (the same sizes on every process, since all have R
    rows)."""
    rows = part["advantages"].size(0)
    return [trim({key: t[chunk] if t.dim() > 0 else t for key, t in part.items()})
            for chunk in torch.arange(rows, device=part["advantages"].device).tensor_split(steps)]

# -----------------------------------------------------------------------------
# the trainer


class D3STrainer(GRPOTrainer):
    """TRL's GRPOTrainer with D3S's sample- and token-level down-sampling (the module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if not isinstance(self.args, D3SConfig):
            raise TypeError(f"D3STrainer needs a D3SConfig, got {type(self.args).__name__}")
        if self._is_vlm:
            raise ValueError("D3STrainer supports text-only models; multimodal inputs are not "
                             "handled")
        if self.args.disable_dropout:  # TRL's own switch misses Qwen2's attention dropout, a float
            disable_dropout(self.model)
        self.method = d3s.METHODS[self.args.method]  # dict(sample=..., token=..., schedule=...)
        self._rewards_per_func = None  # (B, reward functions), every process's rollouts

    def _calculate_rewards(self, *args, **kwargs):
        # TRL gathers the rewards of every process before normalising them per group; keep them for
        # step 4
        self._rewards_per_func = super()._calculate_rewards(*args, **kwargs)
        return self._rewards_per_func

    def _prepare_inputs(self, generation_batch):
        """One micro-batch of this process. As TRL's, but the scored batch goes through _down_sample
        before it is split: the buffer holds only kept rollouts (and fillers), in near-equal
        micro-batches."""
        if not self.model.training:  # evaluation: TRL's plain GRPO on every rollout
            return super()._prepare_inputs(generation_batch)
        steps = self.args.steps_per_generation
        if self._step % (steps * self.num_iterations) == 0 or self._buffered_inputs is None:
            scored = self._generate_and_score_completions(generation_batch)  # TRL: steps 1-3
            weights = self.reward_weights.to(self._rewards_per_func.device)
            rewards = (self._rewards_per_func * weights).nansum(dim=1)  # (B,) as TRL sums them
            self._buffered_inputs = self._down_sample(scored, rewards)
        return self._buffered_inputs[self._step % steps]

    def _down_sample(self, local, rewards):
        """
        Steps 4-6 (docs/algorithm.md) on TRL's scored generation batch. local: this process's rows
        as _generate_and_score_completions returns them; rewards (B,): every process's rollouts in
        TRL's order. Returns this process's steps_per_generation micro-batches (dicts for TRL's
        loss) whose tool_mask (b, C) marks the kept tokens, plus rollout_index (b,): each row's
        place in the generation batch, -1 for a filler.
        """
        known = set(PROMPT_KEYS + COMPLETION_KEYS + ROW_KEYS) | {"num_items_in_batch"}
        unknown = set(local) - known
        if unknown:
            raise ValueError("D3STrainer handles text-only batches; got "
                             f"{', '.join(sorted(unknown))}")
        acc, steps = self.accelerator, self.args.steps_per_generation
        a = self.args
        # the schedule: rho(p), p = global step / (max_steps - 1), read when the batch is generated;
        # then the ratios the method applies (1 where it keeps everything, the 80/20 baseline's
        # fixed share)
        total = max(self.state.max_steps, 1)
        scheduled = d3s.keep_ratios(min(self.state.global_step, total - 1), total,
                                    self.method["schedule"],
                                    a.s_init, a.s_final, a.t_init, a.t_final)
        rho_s, rho_t = d3s.applied_ratios(a.method, *scheduled)

        # step 4: the kept rollouts, chosen once over the whole generation batch of every process
        batch = gather_batch(local, acc, self._tokenizer.pad_token_id)
        advantages = batch["advantages"]  # (B,) TRL's group advantages
        scale = "none" if self.scale_rewards == "none" else "group"  # for PODS's re-normalisation
        index, kept_adv = d3s.select_samples(rewards.to(advantages.device), advantages,
                                             self.num_generations,
                                             rho_s, self.method["sample"], scale=scale)
        if len(index) == 0:  # grpo-filter on a step of zero-variance groups only: no row has a
            index, kept_adv = index.new_zeros(1), kept_adv.new_zeros(1)  # gradient; one with A = 0
        # decided once: process 0's choice for all
        index, kept_adv = broadcast(index), broadcast(kept_adv)
        share = process_shares(len(index), acc.num_processes, steps)[acc.process_index]
        part = take_rows(batch, index, kept_adv, share)  # this process's kept rollouts, (R, ...)

        # steps 5-6: token selection, pooled over every kept token of the step (all processes)
        valid = part["completion_mask"].bool()
        if "tool_mask" in part:
            valid = valid & part["tool_mask"].bool()
        metrics = {}
        if self.method["token"] == "none":
            kept = valid
        elif self.method["token"] == "random":  # the control: no score, so no entropy pass;
            lengths = batch["completion_mask"].sum(dim=1)  # D3S's count of tokens, as train.py's
            count = d3s.d3s_token_count(rewards.to(advantages.device), advantages, lengths,
                                        self.num_generations, rho_s, rho_t)
            kept = self._select_tokens(None, valid, rho_t, count)
        else:
            entropy = self._entropy(part)  # (R, C)
            scores = d3s.token_scores(part["advantages"], entropy, self.method["token"])  # (R, C)
            kept = self._select_tokens(scores, valid, rho_t)
            # train.py's entropy column: over every valid token of the kept rollouts (TRL's own
            # `entropy` metric averages over its loss mask, which is now the kept tokens)
            total = acc.reduce(torch.stack([torch.where(valid, entropy, 0.0).sum(),
                                            valid.sum().float()]), "sum")
            metrics["entropy"] = (total[0] / total[1].clamp(min=1)).item()
        # TRL's loss masks tokens with completion_mask * tool_mask and attends with completion_mask
        # alone (tool_mask is its mask for tool outputs): the kept tokens go there, so the others
        # take part in the forward as context but add nothing to the loss, its gradient or the
        # divisor.
        part["tool_mask"] = kept.to(part["completion_mask"].dtype)
        num_kept = acc.reduce(kept.sum(), reduction="sum")
        part["num_items_in_batch"] = num_kept  # TRL's "dapo" divisor: the step's kept tokens

        # the diagnostics of train.py's step line, through TRL's metrics (so to any logger)
        metrics.update(rho_s=rho_s, rho_t=rho_t, rollouts=advantages.numel(), kept=len(index),
                       valid=acc.reduce(valid.sum(), reduction="sum").item(),
                       tokens=num_kept.item(),
                       var_adv=d3s.population_variance(advantages),
                       var_kept=d3s.population_variance(kept_adv),
                       fillers=len(share) * acc.num_processes - len(index))
        for name, value in metrics.items():
            self._metrics["train"][f"d3s/{name}"].append(float(value))
        return split_micro_batches(shuffle_sequence_dict(part), steps)

    def _entropy(self, part):
        """Step 5 without gradient: H of every completion token of this process's rows, (R, C)."""
        input_ids = torch.cat([part["prompt_ids"], part["completion_ids"]], dim=1)
        attention_mask = torch.cat([part["prompt_mask"], part["completion_mask"]], dim=1)
        no_checkpointing = disable_gradient_checkpointing(self.model,
                                                          self.args.gradient_checkpointing_kwargs)
        with torch.no_grad(), no_checkpointing:
            _, entropy, _ = self._get_per_token_logps_and_entropies(
                self.model, input_ids, attention_mask, part["completion_ids"].size(1),
                batch_size=self.args.per_device_train_batch_size, compute_entropy=True)
        return entropy

    def _select_tokens(self, scores, valid, keep, count=None):
        """Step 6: the top `keep` of every process's scores (None: a uniform draw of `count`, the
        random control), chosen once; this process's rows."""
        acc = self.accelerator
        # every process's scores, (processes * R, C_max)
        all_scores = None if scores is None else \
            acc.gather(acc.pad_across_processes(scores.float(), dim=1))
        all_valid = acc.gather(acc.pad_across_processes(valid.long(), dim=1)).bool()
        if all_valid.any():
            kept = d3s.select_tokens(all_scores, all_valid, keep, count=count)
        else:  # every kept rollout has an empty mask (mask_truncated_completions): nothing to train
            kept = all_valid
        kept = broadcast(kept.long()).bool()
        rows, width = valid.shape
        return kept[acc.process_index * rows:(acc.process_index + 1) * rows, :width]


# -----------------------------------------------------------------------------
# the reward and the entry point


def correctness_reward(stop_ids):
    """TRL reward function: 1.0 when the completion's final answer equals the row's answer
    (reward.grade, step 2), else 0.0. A completion that does not end in a stop token hit the token
    limit: it counts only with an explicit answer, as in train.py."""
    def correct(completions, answer, completion_ids, **kwargs):
        return [grade(text, reference, truncated=not ids or ids[-1] not in stop_ids)
                for text, reference, ids in zip(completions, answer, completion_ids)]
    return correct


def stop_at_the_turns_end(model, tokenizer, config):
    """A completion ends at its turn's end, <|im_end|>, or an eos id (rollout.stop_token_ids), with
    either sampler. TRL's own generate reads model.generation_config, set here (TRL counts these ids
    as eos too). vLLM loads the model from its files and never sees it: TRL hands
    --generation_kwargs to vLLM's SamplingParams (colocate mode) or to the server's request (server
    mode), so the ids go there as stop_token_ids, unless the command line set those."""
    ids = stop_token_ids(model, tokenizer)
    model.generation_config.eos_token_id = ids
    if config.use_vllm:
        config.generation_kwargs = {"stop_token_ids": ids, **(config.generation_kwargs or {})}
    return ids


@dataclass
class ScriptArguments:
    model: str = field(default="Qwen/Qwen2.5-0.5B", metadata={
        "help": "hub id, short name (Qwen2.5-0.5B), local folder or tiny (model.load_model)"})
    dataset: str = field(default="gsm8k", metadata={
        "help": "training prompts: a data.load_problems name or .jsonl"})
    data_dir: Optional[str] = field(default=None, metadata={
        "help": "local copies laid out as NAME/SPLIT.jsonl"})
    limit: Optional[int] = field(default=None, metadata={
        "help": "use only the first LIMIT training problems"})


def main(argv=None):
    parser = HfArgumentParser((ScriptArguments, D3SConfig))
    try:
        script, config = parser.parse_args_into_dataclasses(argv)
    except ValueError as e:  # a bad knob (D3SConfig's or TRL's): one line, exit 2, no traceback
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    # the tiny world is built once, by process 0
    with config.main_process_first(desc="loading data and model"):
        rows = load_problems(script.dataset, "train", limit=script.limit, data_dir=script.data_dir)
        # float32 weights: with --bf16 (TRL's default) the forward runs in bf16 autocast, as
        # train.py on a GPU
        model, tokenizer = load_model(script.model, device="cpu", dtype="float32")
    stop_ids = stop_at_the_turns_end(model, tokenizer, config)
    dataset = Dataset.from_list([{"prompt": format_prompt(tokenizer, row["prompt"]),
                                  "answer": str(row["answer"])} for row in rows])
    trainer = D3STrainer(model=model,
                         reward_funcs=correctness_reward(set(stop_ids)),
                         args=config, train_dataset=dataset, processing_class=tokenizer)
    trainer.train(resume_from_checkpoint=config.resume_from_checkpoint)  # checkpoint-N, or None
    trainer.save_model(config.output_dir)
    trainer.save_state()  # trainer_state.json: every logged step, d3s/* metrics included
    return trainer


if __name__ == "__main__":
    main()
