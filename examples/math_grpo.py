"""The tiny math GRPO recipe through the Python API.

The same run as `rlinf fit --config configs/math_grpo_tiny.yaml`:

bash scripts/setup.sh && source .venv/bin/activate
rlinf sft --config configs/math_sft_tiny.yaml      # warm start, cached
python examples/math_grpo.py
"""

from rlinf_lightning import LMPolicy, RLTrainer, SamplingParams
from rlinf_lightning.algorithms import GRPO
from rlinf_lightning.tasks import MathTask

if __name__ == "__main__":
    trainer = RLTrainer(
        algorithm=GRPO(clip_eps=0.2, kl_coef=0.0),
        strategy="collocated",
        max_iterations=800,
        eval_every=100,
        ckpt_every=200,
        default_root_dir="runs/example_math_grpo",
        num_threads=2,
    )
    policy = LMPolicy("artifacts/tiny-qwen2-sft", lr=1e-4, anneal_lr_steps=800)
    task = MathTask(
        "data/arithmetic/train.jsonl",
        "data/arithmetic/test.jsonl",
        reward="math_verify",
        group_size=8,
        rollout_batch_size=128,
        rollout="hf",
        train_micro_batch_size=64,
        sampling=SamplingParams(temperature=1.0, max_new_tokens=6),
    )
    summary = trainer.fit(policy, task)
    print(f"gain: {summary['eval_accuracy_after'] - summary['eval_accuracy_before']:+.3f}")
