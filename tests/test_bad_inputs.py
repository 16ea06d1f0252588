"""Every bad input a user can give `rlinf fit` ends with one message naming the key or the file (and
the line, for data), exit status 2 and no traceback, before any worker starts or anything is
written. Each case runs the real CLI entry point (`rlinf_lightning.cli.main`) in this process; a
traceback would escape it and fail the test."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from rlinf_lightning.cli import main
from rlinf_lightning.policies.model_dir import TOKENIZER_FILES
from trainer_defaults import cli_fit_args, scaled

HYBRID = "rlinf_lightning.strategies.HybridStrategy"
AUTO = "rlinf_lightning.strategies.AutoStrategy"
NEGATIVE = '{"iteration": -3, "eval_history": []}'  # a checkpoint's state.json
GARBAGE = b"\x07garbage" * 64  # no safetensors header
TRAIN = "--task.train_path"


def _file(key: str, data: bytes, name: str = "d.jsonl") -> Callable[[Path, dict], list[str]]:
    """An override pointing ``key`` at a file holding ``data``."""

    def make(tmp: Path, assets: dict) -> list[str]:
        (tmp / name).write_bytes(data)
        return [f"{key}={tmp / name}"]

    return make


def _model_copy(tmp: Path, assets: dict, drop: tuple[str, ...] = ()) -> Path:
    out = tmp / "model"
    shutil.copytree(assets["sft"], out)
    for name in drop:
        (out / name).unlink(missing_ok=True)
    return out


def _other_config(tmp: Path, assets: dict) -> list[str]:
    out = _model_copy(tmp, assets)
    cfg = json.loads((out / "config.json").read_text())
    cfg["intermediate_size"] *= 2  # the weights were saved for the original size
    (out / "config.json").write_text(json.dumps(cfg))
    return [f"--policy.model_path={out}"]


def _truncated_weights(tmp: Path, assets: dict) -> list[str]:
    out = _model_copy(tmp, assets)
    data = (out / "model.safetensors").read_bytes()
    (out / "model.safetensors").write_bytes(data[: len(data) // 2])
    return [f"--policy.model_path={out}"]


def _checkpoint(tmp: Path, corrupt: Callable[[Path], None], config: dict | None = None) -> list[str]:
    """A complete checkpoint under the run's directory (written under ``config``, if given), then
    ``corrupt`` applied to it."""
    from rlinf_lightning.checkpoint import save_checkpoint

    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters())
    state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    extra = {"config": config} if config else {}
    path = save_checkpoint(tmp / "run" / "checkpoints", 1, state, {"eval_history": [], "seed": 0, **extra})
    corrupt(path)
    return ["--ckpt_path=last"]


def _dapo_run(tmp: Path, assets: dict, resume: bool) -> list[str]:
    """A checkpoint written by the recipe's run under DAPO instead of its GRPO; resumed (``--ckpt_path
    last``) or written into afresh."""
    from rlinf_lightning.algorithms import ALGORITHMS
    from rlinf_lightning.cli import algorithm_names_as_classes, build_parser, subcommand_parser
    from rlinf_lightning.trainer.run_config import resolved_config

    parser = build_parser()
    sub = parser.parse_args(algorithm_names_as_classes(cli_fit_args(assets, tmp)[3:]))["fit"]
    sub.pop("config", None)
    init = subcommand_parser(parser, "fit").instantiate(sub)
    init.trainer.algorithm = ALGORITHMS.resolve("dapo")
    overrides = _checkpoint(tmp, lambda p: None, resolved_config(init.trainer, init.policy, init.task))
    return overrides if resume else []


class _Exploit:
    """A pickle that runs code when loaded with weights_only=False."""

    def __reduce__(self):
        return (exec, ("open('PWNED', 'w').write('x')",))


def _malicious_rng(path: Path) -> None:
    torch.save({"torch": torch.get_rng_state(), "x": _Exploit()}, path / "rng.pt")


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


# (id, overrides or a function (tmp_path, assets) -> overrides, text the message must contain)
CASES: list[tuple[str, object, str]] = [
    # -- config keys, types, registry names
    ("unknown key", ["--trainer.max_iteration=3"], "--trainer.max_iterations"),
    ("wrong type", ["--task.group_size=four"], "task.group_size"),
    ("unknown strategy", ["--trainer.strategy=colocated"], "Did you mean 'collocated'"),
    ("unknown launcher", ["--trainer.launcher=threads"], "trainer.launcher"),
    ("unknown logger", ["--trainer.logger=mlflow"], "trainer.logger: unknown logger 'mlflow'"),
    ("unknown rollout engine", ["--task.rollout=sglang"], "task.rollout"),
    ("unknown algorithm", ["--trainer.algorithm=grpoo"], "trainer.algorithm"),
    ("unknown reward", ["--task.reward=exact"], "task.reward"),
    ("unknown policy class", ["--policy.class_path=rlinf_lightning.policies.NoSuch"], "NoSuch"),
    ("unknown engine option", ["--trainer.train_engine_options={timeout: 9}"], "engine_options.timeout"),
    ("unknown accelerator", ["--trainer.accelerator=tpu"], "trainer.accelerator"),
    (
        "micro-batches by samples and by tokens",
        ["--task.train_max_tokens_per_micro_batch=512"],
        "task.train_max_tokens_per_micro_batch: set either this",
    ),
    ("unknown rollout dtype", ["--task.rollout_dtype=bf16"], "task.rollout_dtype"),
    (
        "unknown rollout engine option",
        ["--task.rollout_engine_options={gpu_memory_utilization: 0.5}"],
        "task.rollout_engine_options.gpu_memory_utilization: not an option of rollout engine 'hf'",
    ),
    (
        "a rollout engine option out of range",
        ["--task.rollout_engine_options={pad_to_multiple_of: 0}"],
        "task.rollout_engine_options.pad_to_multiple_of: must be an integer >= 1 or null, got 0",
    ),
    (
        "a policy width multiple out of range",
        ["--policy.pad_to_multiple_of=0"],
        "policy.pad_to_multiple_of: must be an integer >= 1 or null, got 0",
    ),
    ("a key that moved", ["--trainer.group_size=4"], "--trainer.group_size is now --task.group_size"),
    ("a key renamed", ["--trainer.train_strategy=ddp"], "is now --trainer.train_engine"),
    (
        "out-of-range algorithm option",
        ["--trainer.algorithm={class_path: rlinf_lightning.algorithms.GRPO, init_args: {tis_cap: -1}}"],
        "trainer.algorithm.tis_cap: must be > 0",
    ),
    (
        "an option of an algorithm given by name",
        ["--trainer.algorithm=grpo", "--trainer.algorithm.init_args.clip_eps=-0.1"],
        "trainer.algorithm.clip_eps: must be > 0",
    ),
    (
        "ppo on the math task without a critic",
        ["--trainer.algorithm=ppo"],
        "trainer.algorithm: PPO reads values (a critic's value estimates (a value model)), which the "
        "reasoning workflow does not provide; configure a critic: task.critic: {} in YAML",
    ),
    (
        "a critic for an algorithm that reads no values",
        ["--trainer.algorithm=grpo", "--task.critic={}"],
        "task.critic: GRPO reads no values, so a critic would train for nothing",
    ),
    (
        "a critic with fsdp",
        ["--trainer.algorithm=ppo", "--task.critic={}", "--trainer.train_engine=fsdp"],
        "trainer.train_engine: fsdp runs every forward in lockstep",
    ),
    (
        "mini-batches that split prompt groups",
        ["--trainer.algorithm=grpo", "--trainer.algorithm.num_mini_batches=3"],
        "trainer.algorithm.num_mini_batches: 3 does not divide the 16 prompt groups",
    ),
    (
        "PPO's minibatches finer than a prompt group",
        ["--trainer.algorithm=ppo", "--task.critic={}", "--trainer.algorithm.init_args.num_minibatches=32"],
        "trainer.algorithm.num_minibatches: 32 does not divide the 16 prompt groups of an iteration "
        "(task.rollout_batch_size=128 / task.group_size=8)",
    ),
    ("unknown precision", ["--trainer.precision=16-mixed"], "trainer.precision: must be one of auto"),
    # -- out-of-range and inconsistent sizes
    ("group size < 2", ["--task.group_size=1"], "task.group_size"),
    ("batch not divisible", ["--task.rollout_batch_size=100"], "use a multiple such as 96"),
    ("micro-batch inconsistent", ["--trainer.micro_batch_size=6"], "trainer.micro_batch_size"),
    ("negative iterations", ["--trainer.max_iterations=-1"], "trainer.max_iterations"),
    ("zero devices", ["--trainer.devices=0"], "trainer.devices"),
    ("greedy RL sampling", ["--task.sampling.temperature=0"], "task.sampling.temperature"),
    (
        "token budget below one sample",
        ["--task.train_micro_batch_size=null", "--task.train_max_tokens_per_micro_batch=3"],
        "task.train_max_tokens_per_micro_batch: 3 tokens is less than one sample",
    ),
    ("top_p out of range", ["--task.sampling.top_p=1.5"], "task.sampling.top_p"),
    ("annealing over no steps", ["--policy.anneal_lr_steps=0"], "policy.anneal_lr_steps: must be >= 1"),
    (
        "mmap threshold over glibc's cap",
        ["--trainer.train_engine=fsdp", "--trainer.train_engine_options={malloc_mmap_threshold_mb: 64}"],
        "malloc_mmap_threshold_mb must be in (0, 32]",
    ),
    # -- plans that do not fit the devices
    ("plan needs 2 slots", ["--trainer.strategy=disaggregated"], "needs trainer.devices >= 2"),
    (
        "placement names no such stage",
        [f"--trainer.strategy={{class_path: {HYBRID}, init_args: {{placement: 'rolout: 0'}}}}"],
        "unknown stage 'rolout'",
    ),
    (
        "placement on a missing slot",
        [
            "--trainer.devices=2",
            f"--trainer.strategy={{class_path: {HYBRID}, init_args: "
            "{placement: 'rollout: 0, reward,advantage,inference,actor: 2'}}",
        ],
        "slot 2 does not exist",
    ),
    ("one rank, two replicas", ["--trainer.devices=2", "--trainer.train_engine=single"], "train_engine"),
    (
        "fsdp over threads",
        ["--trainer.devices=2", "--trainer.train_engine=fsdp", "--trainer.launcher=inprocess"],
        "trainer.launcher",
    ),
    ("nodes on a one-machine launcher", ["--trainer.num_nodes=2"], "use trainer.launcher=ray"),
    # -- config files
    ("invalid YAML", _file("--config", b"trainer: [1\n", "c.yaml"), "c.yaml:2:1: invalid YAML"),
    ("missing config file", ["--config=/nonexistent/c.yaml"], "/nonexistent/c.yaml: cannot read it"),
    # -- data files
    ("missing data file", ["--task.train_path=/nonexistent/train.jsonl"], "task.train_path"),
    ("malformed data", _file(TRAIN, b'{"prompt": 1\n'), "d.jsonl:1:"),
    ("empty data", _file("--task.test_path", b""), "d.jsonl: no problems found"),
    (
        "gold answer missing",
        _file(TRAIN, b'{"prompt": "a", "answer": "1"}\n{"prompt": "b"}\n'),
        "d.jsonl:2: no gold answer",
    ),
    ("gold answer empty", _file(TRAIN, b'{"prompt": "a", "answer": " "}\n'), "gold answer is empty"),
    ("GSM8K without ####", _file(TRAIN, b'{"question": "q", "answer": "4"}\n'), "d.jsonl:1: GSM8K"),
    ("non-UTF-8 bytes", _file(TRAIN, b'{"prompt": "caf\xe9", "answer": "1"}\n'), "not UTF-8"),
    ("not Parquet", _file(TRAIN, b"PAR1 but not really", "d.parquet"), "d.parquet: not a readable Parquet"),
    ("no file matches a glob", [f"{TRAIN}=/tmp/no-such-dir/train-*.parquet"], "no file matches"),
    ("template without {prompt}", ["--task.prompt_template=Solve it."], "task.prompt_template"),
    # -- model directories
    ("missing model directory", ["--policy.model_path=/nonexistent/model"], "policy.model_path"),
    (
        "model without tokenizer files",
        lambda t, a: [f"--policy.model_path={_model_copy(t, a, drop=TOKENIZER_FILES)}"],
        "no tokenizer files",
    ),
    ("model config does not match weights", _other_config, "the weights do not match config.json"),
    ("model weights truncated", _truncated_weights, "not a readable safetensors file"),
    # -- checkpoints
    ("no checkpoint to resume", ["--ckpt_path=last"], "--ckpt_path last: no checkpoint under"),
    ("no such checkpoint", ["--ckpt_path=/nonexistent/iter-000001"], "no such checkpoint directory"),
    (
        "corrupt checkpoint state",
        lambda t, a: _checkpoint(t, lambda p: (p / "state.json").write_text("{")),
        "state.json: corrupt",
    ),
    (
        "partial checkpoint",
        lambda t, a: _checkpoint(t, lambda p: (p / "optimizer.pt").unlink()),
        "partial checkpoint, optimizer.pt is missing",
    ),
    (
        "truncated checkpoint weights",
        lambda t, a: _checkpoint(t, lambda p: _truncate(p / "model.safetensors")),
        "model.safetensors: corrupt",
    ),
    (
        "truncated optimizer state",
        lambda t, a: _checkpoint(t, lambda p: _truncate(p / "optimizer.pt")),
        "optimizer.pt: cannot be loaded safely",
    ),
    ("checkpoint of another model", lambda t, a: _checkpoint(t, lambda p: None), "its weights do not fit"),
    ("pickle with code", lambda t, a: _checkpoint(t, _malicious_rng), "rng.pt: cannot be loaded safely"),
    (
        "checkpoint state without its history",
        lambda t, a: _checkpoint(t, lambda p: (p / "state.json").write_text('{"iteration": 1}')),
        "state.json: corrupt ('eval_history' must be a list, got None)",
    ),
    (
        "checkpoint state at a negative iteration",
        lambda t, a: _checkpoint(t, lambda p: (p / "state.json").write_text(NEGATIVE)),
        "state.json: corrupt ('iteration' must be an int >= 0, got -3)",
    ),
    (
        "checkpoint adapters' record without its config",
        lambda t, a: _checkpoint(t, lambda p: (p / "lora.json").write_text('{"base": {}}')),
        "lora.json: corrupt (no 'config' object",
    ),
    (
        "garbage checkpoint weights",
        lambda t, a: _checkpoint(t, lambda p: (p / "model.safetensors").write_bytes(GARBAGE)),
        "model.safetensors: corrupt",
    ),
    (
        "auto strategy by class_path with a bad argument",
        [f"--trainer.strategy={{class_path: {AUTO}, init_args: {{retune_patience: 0}}}}"],
        f"trainer.strategy: {AUTO}: ValueError: strategy 'auto': retune_patience must be >= 1, got 0",
    ),
    (
        "resume across a change of algorithm",
        lambda t, a: _dapo_run(t, a, resume=True),
        "written by a run with another configuration: trainer.algorithm (DAPO there, GRPO here)",
    ),
    (
        "a new run into another run's directory",
        lambda t, a: _dapo_run(t, a, resume=False),
        "holds the checkpoints of another run (up to iteration 1), which differs on trainer.algorithm",
    ),
    # -- the guards' settings
    ("unknown non-finite policy", ["--trainer.on_nonfinite=ignore"], "trainer.on_nonfinite: must be skip"),
    (
        "no non-finite step allowed in a row",
        ["--trainer.max_consecutive_nonfinite=0"],
        "trainer.max_consecutive_nonfinite: must be >= 1, got 0",
    ),
]  # fmt: skip


@pytest.mark.parametrize(("make", "needle"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_message_and_exit_2(tmp_path, assets, capsys, monkeypatch, make, needle):
    monkeypatch.chdir(tmp_path)  # where a malicious pickle would write
    overrides = make(tmp_path, assets) if callable(make) else make
    argv = cli_fit_args(assets, tmp_path, "--trainer.max_iterations=1", *overrides)[3:]
    t0 = time.perf_counter()
    try:
        status = main(argv)
    except SystemExit as exc:  # argument parsing ends this way
        status = exc.code
    elapsed = time.perf_counter() - t0
    err = capsys.readouterr().err
    assert status == 2, err
    assert needle in err, err
    assert "Traceback" not in err and err.startswith("rlinf"), err
    assert elapsed < scaled(10), f"took {elapsed:.1f} s: checked before anything heavy loads"
    assert not (tmp_path / "run" / "logs").exists()  # nothing started
    assert not (tmp_path / "PWNED").exists()


@pytest.mark.parametrize("family", ["gpt_neox", "qwen3_moe"])
def test_weights_in_the_form_transformers_saves_pass_and_another_size_fails(tmp_path, assets, family):
    """transformers 5 loads GPT-NeoX's ``embed_out`` as the module ``lm_head`` and fuses
    Qwen3-MoE's per-expert projections into one tensor, and ``save_pretrained`` writes the
    per-expert, ``embed_out`` form (as the hub's checkpoints hold it): such a directory passes,
    and one whose config.json says another size is still refused."""
    import transformers

    from rlinf_lightning.policies.model_dir import check_causal_lm_dir

    tok = transformers.AutoTokenizer.from_pretrained(str(assets["sft"]))
    kw = dict(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4
    )
    config = {
        "gpt_neox": lambda: transformers.GPTNeoXConfig(**kw),
        "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
            num_key_value_heads=2,
            head_dim=8,
            moe_intermediate_size=16,
            num_experts=4,
            num_experts_per_tok=2,
            **kw,
        ),
    }[family]()
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    assert check_causal_lm_dir(tmp_path) == []
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["hidden_size"] = 64
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (problem,) = check_causal_lm_dir(tmp_path)
    assert "the weights do not match config.json" in problem and "expected [" in problem, problem


def test_an_unreadable_checkpoint_file_is_never_unpickled(tmp_path):
    """The loader refuses a checkpoint whose rng.pt carries code, and the code does not run."""
    from rlinf_lightning.checkpoint import load_checkpoint
    from rlinf_lightning.errors import CheckpointError

    model = torch.nn.Linear(2, 2)
    path = tmp_path / "iter-000001"
    path.mkdir()
    save_file(model.state_dict(), str(path / "model.safetensors"))
    torch.save(torch.optim.AdamW(model.parameters()).state_dict(), path / "optimizer.pt")
    (path / "state.json").write_text('{"iteration": 1, "eval_history": []}')
    marker = tmp_path / "PWNED"
    torch.save({"x": _Payload(str(marker))}, path / "rng.pt")
    with pytest.raises(CheckpointError, match="rng.pt: cannot be loaded safely"):
        load_checkpoint(path)
    assert not marker.exists()


class _Payload:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('x')",))


FETCH, CARTPOLE = "embodied_ppo_fetchreach.yaml", "embodied_ppo_cartpole.yaml"

# (id, override, text the message must contain, config: FetchReach's unless named)
EMBODIED = [
    ("unknown env", "--task.init_args.env=FetchReech-v4", "task.env"),
    ("no envs", "--task.init_args.num_envs=0", "task.num_envs"),
    ("negative seed", "--trainer.seed=-1", "trainer.seed: must be >= 0, got -1"),
    (
        "unknown env keyword",
        "--task.init_args.env_kwargs={reward_typ: sparse}",
        "task.env_kwargs: FetchReachDense-v4",
    ),
    ("policy without a checkpoint", "--policy.init_args.model_path=/nonexistent", "policy.model_path"),
    ("unknown rollout dtype", "--task.init_args.rollout_dtype=bf16", "task.rollout_dtype: must be auto"),
    ("empty micro-batches", "--task.init_args.train_micro_batch_size=0", "task.train_micro_batch_size"),
    ("unknown headline", "--task.init_args.eval_metric=accuracy", "task.eval_metric: must be success"),
    (
        "out-of-range PPO option",
        "--trainer.algorithm={class_path: rlinf_lightning.algorithms.PPO, init_args: {target_kl: -1}}",
        "trainer.algorithm.target_kl: must be > 0",
    ),
    (
        "one sample per mini-batch (FetchReach)",
        "--trainer.algorithm.init_args.num_minibatches=1000",
        "trainer.algorithm.num_minibatches: 1000 mini-batches of the 1024 samples one rollout batch "
        "yields (task.num_envs=16 x task.steps=64) hold 1.02 samples each, fewer than 2",
    ),
    (
        "no sample in most mini-batches (CartPole)",
        "--trainer.algorithm.init_args.num_minibatches=5000",
        "trainer.algorithm.num_minibatches: 5000 mini-batches of the 512 samples one rollout batch "
        "yields (task.num_envs=4 x task.steps=128) hold 0.102 samples each, fewer than 2",
        CARTPOLE,
    ),
]


@pytest.mark.parametrize(
    ("override", "needle", "config"), [(*c[1:], FETCH)[:3] for c in EMBODIED], ids=[c[0] for c in EMBODIED]
)
def test_bad_embodied_input_is_one_message_and_exit_2(tmp_path, capsys, override, needle, config):
    config = Path(__file__).parents[1] / "configs" / config
    argv = ["fit", f"--config={config}", f"--trainer.default_root_dir={tmp_path / 'run'}", override]
    try:
        status = main(argv)
    except SystemExit as exc:
        status = exc.code
    err = capsys.readouterr().err
    assert status == 2, err
    assert needle in err and "Traceback" not in err, err
    assert not (tmp_path / "run").exists()


PI0 = [
    ("checkpoint dir not pi0", "--policy.init_args.model_path={qwen2}", "policy.model_path: "),
    (
        "action dim unlike the env's",
        "--policy.init_args.action_dim=7",
        "policy.action_dim: the checkpoint acts in 7",
    ),
    (
        "chunk longer than the episodes",
        "--task.init_args.chunk=60",
        "task.chunk: 60 steps per chunk, longer than",
    ),
    (
        "chunk longer than pi0's",
        "--task.init_args.chunk=9",
        "task.chunk: 9 steps per chunk, but π0's chunk_size is 8",
    ),
    (
        "state too large",
        "--policy.init_args.state_keys=[observation, desired_goal, achieved_goal, observation]",
        "policy.state_keys: ",
    ),
    (
        "camera the env lacks",
        "--policy.init_args.image_keys=[rgb]",
        "policy.image_keys: the env's observation has no",
    ),
    (
        "no denoising steps",
        "--policy.init_args.num_denoise_steps=0",
        "policy.num_denoise_steps: must be >= 1",
    ),
]


@pytest.mark.parametrize(("override", "needle"), [c[1:] for c in PI0], ids=[c[0] for c in PI0])
def test_bad_pi0_input_is_one_message_and_exit_2(tmp_path, assets, capsys, override, needle):
    """A bad π0 configuration (configs/embodied_ppo_pi0_fetchreach.yaml on a tiny π0 with max_state_dim
    16 and chunk_size 8) is one line naming the key, before any worker starts."""
    from rlinf_lightning.assets import TinyPi0Config, build_tiny_pi0

    pi0 = build_tiny_pi0(tmp_path / "pi0", TinyPi0Config(max_state_dim=16))
    config = Path(__file__).parents[1] / "configs" / "embodied_ppo_pi0_fetchreach.yaml"
    argv = ["fit", f"--config={config}", f"--trainer.default_root_dir={tmp_path / 'run'}",
            f"--policy.init_args.model_path={pi0}", "--policy.init_args.normalize=false",
            override.format(qwen2=assets["base"])]  # fmt: skip
    try:
        status = main(argv)
    except SystemExit as exc:
        status = exc.code
    err = capsys.readouterr().err
    assert status == 2, err
    assert needle in err and "Traceback" not in err, err
    assert not (tmp_path / "run").exists()
