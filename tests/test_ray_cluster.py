"""Ray on a two-node cluster (``ray.cluster_utils.Cluster``: two nodes of one CPU each, on this
machine): a disaggregated plan spans both nodes, and each group's workers run on the node the plan
names (plan node i = the i-th Ray node, the driver's first)."""

from __future__ import annotations

import os
import sys

import pytest

from rlinf_lightning import LMPolicy, RLTrainer
from rlinf_lightning.launchers import LAUNCHERS
from trainer_defaults import scaled, tiny_task, tiny_trainer_kwargs


@pytest.fixture(scope="module")
def two_nodes():
    import ray
    from ray.cluster_utils import Cluster

    ray.shutdown()  # a local Ray of earlier tests is not this cluster
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=1)
    path = os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))
    ray.init(address=cluster.address, runtime_env={"env_vars": {"PYTHONPATH": path}})
    cluster.wait_for_nodes()
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.mark.slow  # 54 s in CI; two nodes stay in the default run through the data-parallel case
def test_a_disaggregated_plan_spans_two_nodes(warm_assets, tmp_path, two_nodes):
    assets = warm_assets
    import ray

    trainer = RLTrainer(
        **tiny_trainer_kwargs(
            tmp_path, devices=1, num_nodes=2, num_threads=1, strategy="disaggregated", launcher="ray",
            max_iterations=2,
        )
    )  # fmt: skip
    task = tiny_task(assets, eval_size=8, rollout_batch_size=64)  # 64 samples: some group disagrees
    policy = LMPolicy(str(assets["sft"]), lr=1e-3)
    workflow, plan = trainer.build_plan(policy, task)
    assert [(g.name, g.slots, plan.node_of(g.slots[0])) for g in plan.groups] == [
        ("gen", [0], 0),
        ("train", [1], 1),
    ]
    assert "(node 0)" in plan.describe() and "(node 1)" in plan.describe()

    runtime = LAUNCHERS.get("ray")().launch(workflow, plan, timeout_s=scaled(120))
    try:
        driver_node = ray.get_runtime_context().get_node_id()
        nodes = {w: ray.get(a.node_id.remote()) for w, a in runtime.actors.items()}
        metrics = runtime.run_iteration(
            1, task.inputs(1, plan.micro_batch_size["__input__->rollout"], trainer.run_spec)
        )
    finally:
        runtime.shutdown()
    assert nodes["gen/0"] == driver_node and nodes["train/0"] != driver_node  # each on its plan node
    # the same iteration in one process: across the two nodes it is the same update, and a real one
    # (iteration 1 of seed 0 has groups whose samples disagree)
    workflow, plan = trainer.build_plan(LMPolicy(str(assets["sft"]), lr=1e-3), task)
    local = LAUNCHERS.get("inprocess")().launch(workflow, plan, timeout_s=scaled(120))
    try:
        ref = local.run_iteration(
            1, task.inputs(1, plan.micro_batch_size["__input__->rollout"], trainer.run_spec)
        )
    finally:
        local.shutdown()
    assert ref["advantage"]["groups_with_signal"] > 0 and ref["actor"]["grad_norm"] > 0
    assert metrics["reward"]["reward"] == ref["reward"]["reward"]
    for key in ("loss", "grad_norm"):
        assert metrics["actor"][key] == pytest.approx(ref["actor"][key], rel=1e-4, abs=1e-6), key

    summary = trainer.fit(policy, task)  # the whole fit, across the two nodes
    assert summary["iterations"] == 2 and summary["strategy"] == "disaggregated"


def test_a_data_parallel_group_trains_across_two_nodes(assets, tmp_path, two_nodes):
    """Collocated over two nodes: one replica per node, and the actor's ddp ranks meet across them."""
    import ray

    trainer = RLTrainer(
        **tiny_trainer_kwargs(
            tmp_path, devices=1, num_nodes=2, num_threads=1, strategy="collocated", launcher="ray"
        )
    )
    task = tiny_task(assets, eval_size=8)
    workflow, plan = trainer.build_plan(LMPolicy(str(assets["sft"]), lr=1e-3), task)
    runtime = LAUNCHERS.get("ray")().launch(workflow, plan, timeout_s=scaled(120))
    try:
        nodes = {w: ray.get(a.node_id.remote()) for w, a in runtime.actors.items()}
        inputs = task.inputs(1, plan.micro_batch_size["__input__->rollout"], trainer.run_spec)
        runtime.run_iteration(1, inputs)
        ranks = runtime.call("actor", "engine_info", replicas="all")
    finally:
        runtime.shutdown()
    assert len(set(nodes.values())) == 2
    assert [(r["engine"], r["rank"], r["world_size"]) for r in ranks] == [("ddp", 0, 2), ("ddp", 1, 2)]
